//! `tp serve` against connection exhaustion (issue 18, class 2). Under a lowered open-file
//! limit, more idle sockets than the process has descriptors neither stop the server nor
//! starve a real client: at the connection cap each new connection closes the oldest silent
//! one (issue 35), so a real client is served at once, and the silent sockets left are closed
//! at the header timeout. Slow headers (slowloris),
//! slow bodies and idle kept-alive connections are closed at their deadlines, while requests
//! being answered for longer than the idle timeout are not.

mod serve_util;

use serde_json::json;
use serve_util::{chat_body, metric_value, read_stream, ServerProc};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

/// The server's open-file limit (soft and hard, so it cannot raise it).
const FD_LIMIT: u64 = 64;
/// The cap `tp serve` derives from it: 64 less a reserve of 32.
const CAP: usize = 32;
const HEADER_S: f64 = 3.0;
const IDLE_S: f64 = 0.5;
/// More than the server's whole descriptor table.
const IDLE_SOCKETS: usize = 100;

#[cfg(unix)]
fn limit_open_files(cmd: &mut Command, n: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only setrlimit (async-signal-safe) runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let r = libc::rlimit {
                rlim_cur: n as libc::rlim_t,
                rlim_max: n as libc::rlim_t,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// What a socket saw: the bytes the server sent, and when (after the start) it closed.
#[derive(Debug, Default)]
struct Seen {
    bytes: Vec<u8>,
    closed_after: Option<Duration>,
}

/// Polls every socket until each is closed by the server or `deadline` passes.
fn watch_all(socks: Vec<TcpStream>, t0: Instant, deadline: Duration) -> Vec<Seen> {
    let mut seen: Vec<Seen> = socks.iter().map(|_| Seen::default()).collect();
    for s in &socks {
        s.set_nonblocking(true).unwrap();
    }
    let mut buf = [0u8; 4096];
    while t0.elapsed() < deadline && seen.iter().any(|s| s.closed_after.is_none()) {
        for (s, out) in socks.iter().zip(seen.iter_mut()) {
            if out.closed_after.is_some() {
                continue;
            }
            loop {
                match (&*s).read(&mut buf) {
                    Ok(0) => out.closed_after = Some(t0.elapsed()),
                    Ok(n) => {
                        out.bytes.extend_from_slice(&buf[..n]);
                        continue;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(_) => out.closed_after = Some(t0.elapsed()),
                }
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    seen
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// Reads until `done` holds for what was read, the connection closes, or `deadline`
/// passes; returns what was read and whether the server closed the connection.
fn read_until(
    s: &mut TcpStream,
    deadline: Duration,
    done: impl Fn(&[u8]) -> bool,
) -> (Vec<u8>, bool) {
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while t0.elapsed() < deadline && !done(&got) {
        match s.read(&mut buf) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return (got, true),
        }
    }
    (got, false)
}

/// A kept-alive connection is closed at the idle timeout (well before the header timeout).
fn idle_keep_alive_is_closed(addr: SocketAddr) -> Duration {
    let mut s = connect(addr);
    s.write_all(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        .unwrap();
    let (got, closed) = read_until(&mut s, Duration::from_secs(5), |b| {
        b.windows(4).any(|w| w == b"\"ok\"")
    });
    assert!(!closed, "closed right after the response");
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    let t = Instant::now();
    let (rest, closed) = read_until(&mut s, Duration::from_secs(10), |_| false);
    assert!(
        closed && rest.is_empty(),
        "{}",
        String::from_utf8_lossy(&rest)
    );
    t.elapsed()
}

/// Headers sent a line every 200 ms never complete: closed at the header timeout.
fn slow_headers_are_closed(addr: SocketAddr) -> Duration {
    let t = Instant::now();
    let mut s = connect(addr);
    s.write_all(b"GET /health HTTP/1.1\r\n").unwrap();
    let mut got = Vec::new();
    for i in 0.. {
        if t.elapsed() > Duration::from_secs(15) {
            panic!("a slowloris connection stayed open for 15 s");
        }
        if s.write_all(format!("X-Slow-{i}: x\r\n").as_bytes())
            .is_err()
        {
            break;
        }
        let (more, closed) = read_until(&mut s, Duration::from_millis(200), |_| false);
        got.extend(more);
        if closed {
            break;
        }
    }
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    t.elapsed()
}

/// A body that stops arriving gets 408 at the header timeout.
fn slow_body_gets_408(addr: SocketAddr) -> Duration {
    let t = Instant::now();
    let mut s = connect(addr);
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"",
    )
    .unwrap();
    let (got, _) = read_until(&mut s, Duration::from_secs(15), |b| {
        b.windows(15).any(|w| w == b"request_timeout")
    });
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    t.elapsed()
}

#[test]
fn idle_sockets_beyond_the_fd_limit_do_not_starve_a_real_client() {
    let header = HEADER_S.to_string();
    let idle = IDLE_S.to_string();
    let Some(server) = ServerProc::start_configured(
        &[
            "--tp",
            "1",
            "--ctx-size",
            "256",
            "--header-timeout",
            &header,
            "--idle-timeout",
            &idle,
        ],
        |cmd| limit_open_files(cmd, FD_LIMIT),
    ) else {
        return;
    };
    let mut c = server.client.clone();
    c.timeout = Duration::from_secs(10);
    // Only the metrics request itself is open.
    let text = server.wait_metrics(Duration::from_secs(5), |t| {
        metric_value(t, "tp_connections_open") == Some(1.0)
    });
    assert_eq!(
        metric_value(&text, "tp_connections_max"),
        Some(CAP as f64),
        "{text}"
    );

    // More idle sockets than the server has descriptors.
    let t0 = Instant::now();
    let socks: Vec<TcpStream> = (0..IDLE_SOCKETS).map(|_| connect(server.addr)).collect();
    // A real client while they hold every slot: served at once, in the place of the oldest.
    let r = c.get("/health").expect("a real client is served");
    assert!(
        t0.elapsed() < Duration::from_secs_f64(HEADER_S),
        "too slow to test the cap"
    );
    assert_eq!(r.status, 200, "{}", r.text());

    let seen = watch_all(socks, t0, Duration::from_secs_f64(HEADER_S + 10.0));
    let silent_close = |s: &Seen| s.bytes.is_empty().then_some(s.closed_after).flatten();
    let evicted = seen
        .iter()
        .filter_map(silent_close)
        .filter(|t| t.as_secs_f64() < HEADER_S - 0.2)
        .count();
    let timed_out: Vec<Duration> = seen
        .iter()
        .filter_map(silent_close)
        .filter(|t| t.as_secs_f64() >= HEADER_S - 0.2)
        .collect();
    let hung = seen.iter().filter(|s| s.closed_after.is_none()).count();
    let other = IDLE_SOCKETS - evicted - timed_out.len() - hung;
    eprintln!(
        "{IDLE_SOCKETS} idle sockets against open-file limit {FD_LIMIT}, cap {CAP}: {evicted} closed at once to make room, {} served then closed at the header timeout ({:?} .. {:?}), {hung} left open, {other} other",
        timed_out.len(),
        timed_out.iter().min(),
        timed_out.iter().max()
    );
    assert_eq!(hung, 0, "sockets never closed");
    assert_eq!(other, 0, "sockets that got something else: {seen:?}");
    assert!(
        timed_out.len() < CAP && evicted > IDLE_SOCKETS - CAP,
        "the real client took a silent socket's place"
    );
    for t in &timed_out {
        let t = t.as_secs_f64();
        assert!(
            (HEADER_S - 0.2..HEADER_S + 3.0).contains(&t),
            "an idle connection closed after {t} s, not at the {HEADER_S} s header timeout"
        );
    }
    // The slots are free again: a real client is served.
    let r = c.get("/health").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());

    // Deadlines of single connections, side by side.
    let addr = server.addr;
    let (keep_alive, slowloris, slow_body) = std::thread::scope(|s| {
        let a = s.spawn(|| idle_keep_alive_is_closed(addr));
        let b = s.spawn(|| slow_headers_are_closed(addr));
        let c = s.spawn(|| slow_body_gets_408(addr));
        (a.join().unwrap(), b.join().unwrap(), c.join().unwrap())
    });
    eprintln!("closed: kept-alive idle after {keep_alive:?}, slow headers after {slowloris:?}; slow body answered 408 after {slow_body:?}");
    let ka = keep_alive.as_secs_f64();
    assert!(
        (IDLE_S - 0.1..HEADER_S - 0.5).contains(&ka),
        "kept-alive idle closed after {ka} s"
    );
    for (what, t) in [("slow headers", slowloris), ("slow body", slow_body)] {
        let t = t.as_secs_f64();
        assert!(
            (HEADER_S - 0.2..HEADER_S + 3.0).contains(&t),
            "{what}: {t} s"
        );
    }

    // Requests answered for longer than the idle timeout are not cut: a silent one (the
    // whole answer at the end) and a stream.
    let t = Instant::now();
    let r = c
        .post_json(
            "/v1/completions",
            &json!({"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": true, "temperature": 0}),
        )
        .unwrap();
    let took = t.elapsed();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 120);
    assert!(
        took.as_secs_f64() > IDLE_S,
        "the request took {took:?}, less than the idle timeout: raise max_tokens"
    );
    let s = read_stream(
        &c,
        "/v1/chat/completions",
        &chat_body(
            "Tell me a story.",
            60,
            json!({"stream": true, "ignore_eos": true}),
        ),
    );
    assert_eq!(s.finish_reason, "length");

    let text = c.get("/metrics").unwrap().text();
    assert_eq!(
        metric_value(&text, "tp_connections_evicted_total"),
        Some(evicted as f64),
        "{text}"
    );
    assert_eq!(
        metric_value(&text, "tp_connections_refused_total").unwrap_or(0.0),
        0.0,
        "{text}"
    );
    assert_eq!(
        metric_value(&text, "tp_connections_dropped_total").unwrap_or(0.0),
        0.0,
        "{text}"
    );
    assert!(
        !server.stderr().contains("cannot accept"),
        "the server ran out of descriptors: {}",
        server.stderr()
    );
}
