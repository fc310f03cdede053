//! Connections: the accept loop with a cap on open connections, a watchdog per connection that closes it when a
//! deadline passes (request headers, idle keep-alive, a stalled write), and graceful closing
//! on shutdown.
//!
//! At the cap, a new connection first takes the place of the oldest connection that has not
//! sent a complete request (silent since it opened, idle between requests, or with headers
//! still incomplete), which is closed; only when every open connection is answering a request
//! is the new one refused with a `503` (`Retry-After`, `Connection: close`). So silent or slow
//! clients cannot lock others out until their deadlines pass.
//!
//! A connection is in one of three phases. *Waiting*: no request in progress; a new connection
//! must send its request headers within the header timeout, a kept-alive one must start its
//! next request within the idle timeout. *Head*: a request's first bytes arrived; its headers
//! must be complete within the header timeout (slowloris). *Busy*: a request is being answered
//! (from the handler's call until its response body is dropped): no deadline here, so long
//! generations and SSE streams are never cut, except that a write may not stall for longer
//! than the idle timeout (a client that stopped reading).

mod watchdog;

use crate::error::ApiError;
use crate::metrics::Metrics;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;
use watchdog::{ConnService, Watch, Watched};

pub use watchdog::Expiry;

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

/// How long the accept loop waits for an evicted connection to close before it refuses the
/// new one instead.
const EVICTION_WAIT: Duration = Duration::from_secs(1);

/// The watchdogs of the open connections, by connection number: where the accept loop finds
/// the oldest connection without a complete request.
#[derive(Default)]
struct Registry(Mutex<HashMap<u64, Arc<Watch>>>);

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Watch>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Closes the connection that has waited longest without a complete request; false when
    /// every connection is answering one.
    fn evict_oldest_idle(&self) -> bool {
        let mut idle: Vec<(Instant, u64, Arc<Watch>)> = self
            .lock()
            .iter()
            .filter_map(|(id, w)| w.idle_since().map(|t| (t, *id, Arc::clone(w))))
            .collect();
        idle.sort_by_key(|(t, id, _)| (*t, *id));
        // The oldest that is still idle when asked (its request may have begun meanwhile).
        idle.iter().any(|(_, _, w)| w.evict())
    }
}

/// Counts a connection open (gauge, the watch the drain waits on, the registry) while it
/// lives.
struct Slot {
    id: u64,
    open: Arc<watch::Sender<usize>>,
    metrics: Arc<Metrics>,
    registry: Arc<Registry>,
}

impl Slot {
    fn new(
        id: u64,
        watch: &Arc<Watch>,
        open: &Arc<watch::Sender<usize>>,
        metrics: &Arc<Metrics>,
        registry: &Arc<Registry>,
    ) -> Self {
        registry.lock().insert(id, Arc::clone(watch));
        open.send_modify(|n| *n += 1);
        metrics.connections_open.increment(1.0);
        Slot {
            id,
            open: Arc::clone(open),
            metrics: Arc::clone(metrics),
            registry: Arc::clone(registry),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.id);
        self.open.send_modify(|n| *n = n.saturating_sub(1));
        self.metrics.connections_open.decrement(1.0);
    }
}

/// At the cap: evicts the oldest connection without a complete request and waits (at most
/// [`EVICTION_WAIT`]) for its slot; true when there is room for one more connection.
async fn make_room(registry: &Registry, open: &watch::Sender<usize>, limits: &ConnLimits) -> bool {
    if *open.borrow() < limits.max_connections {
        return true;
    }
    if !registry.evict_oldest_idle() {
        return false;
    }
    let mut rx = open.subscribe();
    let freed = tokio::time::timeout(EVICTION_WAIT, rx.wait_for(|n| *n < limits.max_connections))
        .await
        .is_ok_and(|r| r.is_ok());
    freed
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
        let registry = Arc::new(Registry::default());
        let mut next_id = 0u64;
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
            if !make_room(&registry, &open, &limits).await {
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
            let watch = Arc::new(Watch::new(limits));
            next_id += 1;
            let slot = Slot::new(next_id, &watch, &open, &metrics, &registry);
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
                            if why == Expiry::Evicted {
                                metrics.connections_evicted.increment(1);
                            } else {
                                metrics.connection_timed_out(why.label());
                            }
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

    pub(super) fn limits() -> ConnLimits {
        ConnLimits {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: 100,
        }
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
