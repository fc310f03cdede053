//! Connections: the accept loop with a cap on open connections (beyond it a `503` with
//! `Retry-After` and `Connection: close`), a watchdog per connection that closes it when a
//! deadline passes (request headers, idle keep-alive, a stalled write), and graceful closing
//! on shutdown.
//!
//! A connection is in one of three phases. *Waiting*: no request in progress; a new connection
//! must send its request headers within the header timeout, a kept-alive one must start its
//! next request within the idle timeout. *Head*: a request's first bytes arrived; its headers
//! must be complete within the header timeout (slowloris). *Busy*: a request is being answered
//! (from the handler's call until its response body is dropped): no deadline here, so long
//! generations and SSE streams are never cut, except that a write may not stall for longer
//! than the idle timeout (a client that stopped reading).

use crate::error::ApiError;
use crate::metrics::Metrics;
use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use axum::Router;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

/// Deadlines and the cap of the connection layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// From a connection's start (or a request's first byte) until its headers are complete.
    pub header_timeout: Duration,
    /// From the end of a response until the next request's first byte; also the longest a
    /// write may stall.
    pub idle_timeout: Duration,
    /// Connections served at once; more are refused with 503.
    pub max_connections: usize,
}

impl ConnLimits {
    /// Refused connections kept open at once to read what their client sends (up to
    /// [`REFUSAL_LINGER`]); beyond them a refused connection is answered and closed at once.
    pub fn max_lingering(&self) -> usize {
        (self.max_connections / 4).clamp(4, 64)
    }
}

/// How long a refused connection is kept after its 503 to read what the client still sends,
/// so that closing it does not reset the connection before the client has read the 503.
pub const REFUSAL_LINGER: Duration = Duration::from_secs(1);

/// The `Retry-After` of a refusal, in seconds.
pub const REFUSAL_RETRY_AFTER_S: u32 = 1;

/// Why the watchdog closed a connection (the label of `tp_connections_timed_out_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// Request headers incomplete within the header timeout.
    Header,
    /// No new request within the idle timeout.
    Idle,
    /// A write blocked for the idle timeout.
    WriteStall,
}

impl Expiry {
    pub fn label(self) -> &'static str {
        match self {
            Expiry::Header => "header",
            Expiry::Idle => "idle",
            Expiry::WriteStall => "write_stall",
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Phase {
    /// No request in progress since `since`; `fresh` before the first request.
    Waiting { since: Instant, fresh: bool },
    /// A request's first byte came at `since`; its headers are not complete.
    Head { since: Instant },
    /// `n` requests being answered.
    Busy { n: usize },
}

#[derive(Debug)]
struct WatchState {
    phase: Phase,
    /// Since when a write has been blocked (the client does not read).
    write_blocked: Option<Instant>,
}

/// The phase of one connection, shared by its socket wrapper, its service and its watchdog.
#[derive(Debug)]
struct Watch {
    state: Mutex<WatchState>,
    /// Woken when a deadline may have come closer.
    changed: Notify,
    limits: ConnLimits,
}

impl Watch {
    fn new(limits: ConnLimits) -> Self {
        Watch {
            state: Mutex::new(WatchState {
                phase: Phase::Waiting {
                    since: Instant::now(),
                    fresh: true,
                },
                write_blocked: None,
            }),
            changed: Notify::new(),
            limits,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WatchState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn on_read(&self) {
        let mut s = self.lock();
        if let Phase::Waiting { since, fresh } = s.phase {
            // A new connection's headers are due a header timeout after it was accepted,
            // however late its first byte comes.
            s.phase = Phase::Head {
                since: if fresh { since } else { Instant::now() },
            };
            drop(s);
            self.changed.notify_one();
        }
    }

    fn on_write(&self, blocked: bool) {
        let mut s = self.lock();
        match (blocked, s.write_blocked) {
            (true, None) => {
                s.write_blocked = Some(Instant::now());
                drop(s);
                self.changed.notify_one();
            }
            (false, Some(_)) => s.write_blocked = None,
            _ => {}
        }
    }

    fn begin_request(&self) {
        let mut s = self.lock();
        s.phase = match s.phase {
            Phase::Busy { n } => Phase::Busy { n: n + 1 },
            _ => Phase::Busy { n: 1 },
        };
    }

    fn end_request(&self) {
        let mut s = self.lock();
        s.phase = match s.phase {
            Phase::Busy { n } if n > 1 => Phase::Busy { n: n - 1 },
            _ => Phase::Waiting {
                since: Instant::now(),
                fresh: false,
            },
        };
        drop(s);
        self.changed.notify_one();
    }

    /// The next deadline and what passing it means (`None`: none while the phase lasts).
    fn deadline(&self) -> Option<(Instant, Expiry)> {
        let s = self.lock();
        let l = &self.limits;
        let phase = match s.phase {
            Phase::Waiting { since, fresh: true } => {
                Some((since + l.header_timeout, Expiry::Header))
            }
            Phase::Waiting { since, .. } => Some((since + l.idle_timeout, Expiry::Idle)),
            Phase::Head { since } => Some((since + l.header_timeout, Expiry::Header)),
            Phase::Busy { .. } => None,
        };
        let write = s
            .write_blocked
            .map(|t| (t + l.idle_timeout, Expiry::WriteStall));
        match (phase, write) {
            (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
            (a, b) => a.or(b),
        }
    }

    /// Resolves when a deadline has passed, saying which.
    async fn expired(&self) -> Expiry {
        loop {
            let changed = self.changed.notified();
            match self.deadline() {
                Some((at, why)) if at <= Instant::now() => return why,
                Some((at, _)) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at) => {}
                        _ = changed => {}
                    }
                }
                None => changed.await,
            }
        }
    }
}

/// The TCP stream, reporting reads and blocked writes to the [`Watch`].
struct Watched {
    io: TcpStream,
    watch: Arc<Watch>,
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.watch.on_read();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, data);
        this.watch.on_write(r.is_pending());
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.watch.on_write(r.is_pending());
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// Marks its connection busy from a request's start until the guard (held by the response
/// body) is dropped.
struct Busy(Arc<Watch>);

impl Busy {
    fn begin(watch: &Arc<Watch>) -> Self {
        watch.begin_request();
        Busy(Arc::clone(watch))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.end_request();
    }
}

/// The router as a hyper service that keeps the connection's phase.
#[derive(Clone)]
struct ConnService {
    inner: TowerToHyperService<Router>,
    watch: Arc<Watch>,
}

type ResponseFuture = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for ConnService {
    type Response = Response;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn call(&self, req: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        let busy = Busy::begin(&self.watch);
        let fut = hyper::service::Service::call(&self.inner, req.map(Body::new) as Request);
        Box::pin(async move {
            let resp = fut.await?;
            // The guard lives as long as the body: until hyper has written all of it.
            Ok(resp.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    let _held = &busy;
                    frame
                }))
            }))
        })
    }
}

/// Counts a connection open (gauge and the watch the drain waits on) while it lives.
struct Slot {
    open: Arc<watch::Sender<usize>>,
    metrics: Arc<Metrics>,
}

impl Slot {
    fn new(open: &Arc<watch::Sender<usize>>, metrics: &Arc<Metrics>) -> Self {
        open.send_modify(|n| *n += 1);
        metrics.connections_open.increment(1.0);
        Slot {
            open: Arc::clone(open),
            metrics: Arc::clone(metrics),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.send_modify(|n| *n = n.saturating_sub(1));
        self.metrics.connections_open.decrement(1.0);
    }
}

/// The bytes a refused connection gets: a whole HTTP response.
pub fn refusal_response(max_connections: usize) -> Vec<u8> {
    let body = ApiError::unavailable(
        503,
        "too_many_connections",
        format!(
            "this server already has {max_connections} connections open, its limit; retry in a moment"
        ),
    )
    .body()
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: {REFUSAL_RETRY_AFTER_S}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Reads what has already arrived on `sock` without waiting (at most 64 KiB).
fn drain_ready(mut sock: &socket2::Socket) {
    let mut buf = [0u8; 4096];
    for _ in 0..16 {
        match io::Read::read(&mut sock, &mut buf) {
            Ok(n) if n > 0 => {}
            _ => return,
        }
    }
}

/// Answers a refused connection without waiting: reads the request if it has arrived
/// (closing with unread data would reset the connection), writes the 503 (it fits any socket
/// buffer) and shuts this side. True when it was written whole. Plain system calls on the
/// non-blocking socket: the runtime has not yet seen it become readable or writable.
fn answer_refusal(stream: &TcpStream, response: &[u8]) -> bool {
    let sock = socket2::SockRef::from(stream);
    drain_ready(&sock);
    let mut w: &socket2::Socket = &sock;
    let written = matches!(io::Write::write(&mut w, response), Ok(n) if n == response.len());
    let _ = sock.shutdown(std::net::Shutdown::Write);
    written
}

/// After the answer, reads whatever the client still sends until it closes, for at most
/// [`REFUSAL_LINGER`], so that the close is a clean FIN and not a reset.
async fn linger(mut stream: TcpStream) {
    let _ = tokio::time::timeout(REFUSAL_LINGER, async {
        let mut buf = [0u8; 4096];
        let mut total = 0usize;
        while total < 64 * 1024 {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            total += n;
        }
        Ok::<_, io::Error>(())
    })
    .await;
}

/// Errors of `accept` that concern one connection only (the next accept may well succeed).
fn per_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
    )
}

/// What the accept loop needs.
pub(crate) struct Acceptor {
    pub listener: TcpListener,
    pub app: Router,
    pub limits: ConnLimits,
    pub metrics: Arc<Metrics>,
    /// Set on shutdown: stop accepting, close connections once their requests are answered.
    pub closing: watch::Receiver<bool>,
    /// Open (served) connections.
    pub open: Arc<watch::Sender<usize>>,
    pub log: bool,
}

impl Acceptor {
    /// Accepts until `closing` is set, then drops the listener.
    pub async fn run(self) {
        let Acceptor {
            listener,
            app,
            limits,
            metrics,
            mut closing,
            open,
            log,
        } = self;
        metrics.connections_max.set(limits.max_connections as f64);
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new()).header_read_timeout(None);
        let refusal = refusal_response(limits.max_connections);
        let lingering = Arc::new(AtomicUsize::new(0));
        let mut last_warning: Option<Instant> = None;
        loop {
            let accepted = tokio::select! {
                r = listener.accept() => r,
                _ = closing.wait_for(|c| *c) => break,
            };
            let stream = match accepted {
                Ok((s, _)) => s,
                Err(e) if per_connection_error(&e) => continue,
                Err(e) => {
                    // Out of file descriptors (or memory): the connection stays queued in the
                    // kernel; retry shortly instead of spinning.
                    if log && last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                        eprintln!(
                            "# tp serve: cannot accept a connection: {e}; retrying (open connections: {})",
                            *open.borrow()
                        );
                        last_warning = Some(Instant::now());
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            if *open.borrow() >= limits.max_connections {
                if answer_refusal(&stream, &refusal) {
                    metrics.connections_refused.increment(1);
                } else {
                    metrics.connections_dropped.increment(1);
                }
                // Kept a moment to read the client's request if there is room; else closed now.
                if lingering.load(Ordering::Relaxed) < limits.max_lingering() {
                    lingering.fetch_add(1, Ordering::Relaxed);
                    let lingering = Arc::clone(&lingering);
                    tokio::spawn(async move {
                        linger(stream).await;
                        lingering.fetch_sub(1, Ordering::Relaxed);
                    });
                }
                continue;
            }
            let slot = Slot::new(&open, &metrics);
            let watch = Arc::new(Watch::new(limits));
            let io = TokioIo::new(Watched {
                io: stream,
                watch: Arc::clone(&watch),
            });
            let service = ConnService {
                inner: TowerToHyperService::new(app.clone()),
                watch: Arc::clone(&watch),
            };
            let conn = http.serve_connection(io, service);
            let mut closing = closing.clone();
            let metrics = Arc::clone(&metrics);
            tokio::spawn(async move {
                let _slot = slot;
                tokio::pin!(conn);
                let mut asked = false;
                loop {
                    tokio::select! {
                        _ = conn.as_mut() => break,
                        why = watch.expired() => {
                            metrics.connection_timed_out(why.label());
                            break;
                        }
                        _ = closing.wait_for(|c| *c), if !asked => {
                            asked = true;
                            conn.as_mut().graceful_shutdown();
                        }
                    }
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConnLimits {
        ConnLimits {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: 100,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_follow_the_phase() {
        let w = Watch::new(limits());
        let t0 = Instant::now();
        // A new connection: the header deadline, which a late first byte does not move.
        assert_eq!(
            w.deadline(),
            Some((t0 + Duration::from_secs(10), Expiry::Header))
        );
        tokio::time::advance(Duration::from_secs(9)).await;
        w.on_read();
        assert_eq!(
            w.deadline(),
            Some((t0 + Duration::from_secs(10), Expiry::Header))
        );
        w.begin_request();
        assert_eq!(
            w.deadline(),
            None,
            "no deadline while a request is answered"
        );
        tokio::time::advance(Duration::from_secs(500)).await;
        w.on_write(true);
        let t1 = Instant::now();
        assert_eq!(
            w.deadline(),
            Some((t1 + Duration::from_secs(60), Expiry::WriteStall))
        );
        w.on_write(false);
        assert_eq!(w.deadline(), None);
        w.end_request();
        let t2 = Instant::now();
        assert_eq!(
            w.deadline(),
            Some((t2 + Duration::from_secs(60), Expiry::Idle))
        );
        tokio::time::advance(Duration::from_secs(30)).await;
        w.on_read();
        let t3 = Instant::now();
        assert_eq!(
            w.deadline(),
            Some((t3 + Duration::from_secs(10), Expiry::Header))
        );
        // The watchdog fires at the header deadline, not the idle one.
        let why = w.expired().await;
        assert_eq!(why, Expiry::Header);
        assert_eq!(Instant::now(), t3 + Duration::from_secs(10));
    }

    #[test]
    fn the_refusal_is_a_whole_http_response() {
        let r = String::from_utf8(refusal_response(7)).unwrap();
        let (head, body) = r.split_once("\r\n\r\n").unwrap();
        let head = format!("{head}\r\n");
        assert!(head.starts_with("HTTP/1.1 503 "), "{head}");
        assert!(head.contains("\r\nretry-after: 1\r\n"), "{head}");
        assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("7 connections"));
    }

    #[test]
    fn lingering_refusals_are_bounded() {
        let mut l = limits();
        assert_eq!(l.max_lingering(), 25);
        l.max_connections = 1;
        assert_eq!(l.max_lingering(), 4);
        l.max_connections = 100_000;
        assert_eq!(l.max_lingering(), 64);
    }
}
