//! The watchdog of one connection: its phase (waiting, head, busy) as its socket wrapper
//! ([`Watched`]) and its service ([`ConnService`]) report it, and the deadline that phase
//! sets (see the parent module for the rules).

use super::ConnLimits;
use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use axum::Router;
use http_body_util::BodyExt;
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Why the watchdog closed a connection (the label of `tp_connections_timed_out_total`;
/// evictions count in `tp_connections_evicted_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// Request headers incomplete within the header timeout.
    Header,
    /// No new request within the idle timeout.
    Idle,
    /// A write blocked for the idle timeout.
    WriteStall,
    /// Closed at the connection cap to make room for a new connection: it had not sent a
    /// complete request (idle, or headers still incomplete) and was the oldest such.
    Evicted,
}

impl Expiry {
    pub fn label(self) -> &'static str {
        match self {
            Expiry::Header => "header",
            Expiry::Idle => "idle",
            Expiry::WriteStall => "write_stall",
            Expiry::Evicted => "evicted",
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
    /// Set by [`Watch::evict`]: the watchdog closes the connection at once.
    evicted: bool,
}

/// The phase of one connection, shared by its socket wrapper, its service and its watchdog.
#[derive(Debug)]
pub(super) struct Watch {
    state: Mutex<WatchState>,
    /// Woken when a deadline may have come closer.
    changed: Notify,
    limits: ConnLimits,
}

impl Watch {
    pub(super) fn new(limits: ConnLimits) -> Self {
        Watch {
            state: Mutex::new(WatchState {
                phase: Phase::Waiting {
                    since: Instant::now(),
                    fresh: true,
                },
                write_blocked: None,
                evicted: false,
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

    /// Since when the connection has waited without a complete request (none arrived yet,
    /// or its headers are incomplete), or `None` while a request is being answered: what
    /// makes a connection evictable at the cap, the oldest first.
    pub(super) fn idle_since(&self) -> Option<Instant> {
        match self.lock().phase {
            Phase::Waiting { since, .. } | Phase::Head { since } => Some(since),
            Phase::Busy { .. } => None,
        }
    }

    /// Closes the connection now if it is still without a complete request (true then); a
    /// connection whose request has just begun is left alone.
    pub(super) fn evict(&self) -> bool {
        let mut s = self.lock();
        if matches!(s.phase, Phase::Busy { .. }) {
            return false;
        }
        s.evicted = true;
        drop(s);
        self.changed.notify_one();
        true
    }

    /// The next deadline and what passing it means (`None`: none while the phase lasts).
    fn deadline(&self) -> Option<(Instant, Expiry)> {
        let s = self.lock();
        if s.evicted {
            return Some((Instant::now(), Expiry::Evicted));
        }
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
    pub(super) async fn expired(&self) -> Expiry {
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
pub(super) struct Watched {
    pub(super) io: TcpStream,
    pub(super) watch: Arc<Watch>,
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
pub(super) struct ConnService {
    pub(super) inner: TowerToHyperService<Router>,
    pub(super) watch: Arc<Watch>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::conn::tests::limits;
    use std::time::Duration;

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
}
