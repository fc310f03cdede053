//! The connection cap against silent clients: at the cap, a new connection closes the oldest
//! one that has not sent a complete request (silent since it opened, or headers incomplete)
//! instead of being refused, so silent sockets cannot lock a real client out; only when every
//! open connection is answering a request is a new one refused with 503.

mod common;

use common::{config, metric, with_client};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use tp_serve::{ConnLimits, ServeConfig};

const CAP: usize = 4;

fn capped() -> ServeConfig {
    ServeConfig {
        connections: ConnLimits {
            max_connections: CAP,
            ..config().connections
        },
        ..config()
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    // Accepted one after the other, so that their ages are in connection order.
    std::thread::sleep(Duration::from_millis(30));
    s
}

/// Whether the server closed `s` (end of stream or reset) within `wait`, having sent nothing.
fn closed_silently(s: &mut TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut buf = [0u8; 256];
    match s.read(&mut buf) {
        Ok(0) => true,
        Ok(n) => panic!("the server sent {:?}", String::from_utf8_lossy(&buf[..n])),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => false,
        Err(e) if e.kind() == ErrorKind::ConnectionReset => true,
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn silent_connections_make_room_oldest_first_and_busy_ones_do_not() {
    with_client(capped(), |c| {
        let addr = c.addr;
        // The oldest sent half a request head; the others nothing at all.
        let mut socks = vec![connect(addr)];
        socks[0].write_all(b"GET /health HTTP/1.1\r\n").unwrap();
        for _ in 1..10 {
            socks.push(connect(addr));
        }
        // A real client is served at once although 10 silent sockets came first.
        let t0 = Instant::now();
        let r = c.get("/health").unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        // 11 connections for 4 slots: the 7 oldest were closed, the 3 newest still wait
        // (their header timeout is 10 s).
        for (i, s) in socks.iter_mut().enumerate() {
            let wait = Duration::from_millis(if i < 7 { 2000 } else { 200 });
            assert_eq!(closed_silently(s, wait), i < 7, "socket {i}");
        }
        assert_eq!(metric(c, "tp_connections_evicted_total"), 7.0);
        assert_eq!(metric(c, "tp_connections_refused_total"), 0.0);
        drop(socks);
        // Their closes seen: only the metrics request itself is open.
        let t0 = Instant::now();
        while metric(c, "tp_connections_open") != 1.0 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "closed sockets still counted"
            );
            std::thread::sleep(Duration::from_millis(20));
        }

        // Connections answering requests (headers in, body still coming) are not evicted:
        // at the cap with all of them busy, a new client is refused.
        let busy: Vec<TcpStream> = (0..CAP)
            .map(|_| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(
                    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\":",
                )
                .unwrap();
                s
            })
            .collect();
        // Once the server has read their heads (a connection whose request has not arrived
        // yet is still evictable), a new client is refused.
        std::thread::sleep(Duration::from_millis(500));
        let r = c.get("/health").unwrap();
        assert_eq!(r.status, 503, "{}", r.text());
        assert_eq!(r.json()["error"]["code"], "too_many_connections");
        drop(busy);
        // Their slots come back once the server sees them gone.
        let t0 = Instant::now();
        while c.get("/health").map_or(0, |r| r.status) != 200 {
            assert!(t0.elapsed() < Duration::from_secs(5), "slots not freed");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(metric(c, "tp_connections_evicted_total"), 7.0);
    });
}
