//! The HTTP server's life: its settings ([`ServerConfig`]), the tokio runtime thread it runs
//! on, the state its handlers share, and graceful shutdown on SIGINT/SIGTERM (stop accepting,
//! drain in-flight requests, end what is left past the drain timeout). Routes are in
//! `routes`, connections (cap, timeouts) in [`super::conn`]. It talks to the scheduler (on
//! rank 0's thread) only through channels.

use super::auth::check_api_key;
use super::conn::{Acceptor, ConnLimits};
use super::routes::router;
use crate::error::{ApiError, Result, ServeError};
use crate::metrics::Metrics;
use crate::scheduler::{Control, SchedulerHandle};
use std::net::{IpAddr, SocketAddr, TcpListener as StdListener};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{watch, Notify};
use tp_tokenizer::Tokenizer;

/// Settings of the HTTP side.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: IpAddr,
    /// 0: any free port (the bound address is in [`Server::addr`]).
    pub port: u16,
    /// Every request needs `Authorization: Bearer KEY` (see [`check_api_key`]).
    pub api_key: Option<String>,
    /// With a key, `GET /health` answers without it (load-balancer probes).
    pub public_health: bool,
    /// The name clients pass as `model` (or omit).
    pub model_name: String,
    /// Most positions of one sequence (prompt + generated).
    pub ctx_size: usize,
    /// KV positions the scheduler may reserve in all (a request must fit alone).
    pub kv_budget_positions: usize,
    /// Token ids must be below this (`prompt` as ids).
    pub vocab: usize,
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// Requests waiting for admission beyond which new ones get 429 (a request for `n`
    /// choices counts `n`).
    pub max_queue: usize,
    /// Most choices (`n`) one request may ask for.
    pub max_n: usize,
    /// After SIGINT/SIGTERM, how long in-flight requests may take before they are ended.
    pub drain_timeout: Duration,
    /// The same after SIGTERM, where it differs: when ranks run under mpirun, a SIGTERM means
    /// the job is being torn down (a rank failed or mpirun was stopped) and SIGKILL follows
    /// within about a second, so in-flight requests are best ended with an error at once.
    pub term_drain_timeout: Duration,
    /// Longest wait for a request's next token before it is failed (a stuck engine).
    pub event_timeout: Duration,
    /// Connection cap and deadlines.
    pub connections: ConnLimits,
    /// One line per request on stderr.
    pub log: bool,
    /// Added to the 401 message: how the key is given to the server (the CLI: `--api-key`).
    pub auth_hint: Option<String>,
    /// The admin endpoints (reload, rollback) and their key; off when `None`.
    pub admin: Option<super::admin::AdminConfig>,
}

impl ServerConfig {
    /// Refuses settings the server cannot run with.
    pub fn validate(&self) -> Result<()> {
        if let Some(key) = &self.api_key {
            check_api_key(key).map_err(|message| ServeError::Config {
                name: "api key",
                message,
            })?;
        }
        if let Some(a) = &self.admin {
            check_api_key(&a.key).map_err(|message| ServeError::Config {
                name: "admin key",
                message: message.replace("API key", "admin key"),
            })?;
            if self.api_key.as_deref() == Some(a.key.as_str()) {
                return Err(ServeError::Config {
                    name: "admin key",
                    message: "must differ from the API key (every client holds the API key); give the admin endpoints a key of their own".into(),
                });
            }
        }
        let c = &self.connections;
        for (name, d) in [
            ("header timeout", c.header_timeout),
            ("idle timeout", c.idle_timeout),
        ] {
            if d.is_zero() {
                return Err(ServeError::Config {
                    name,
                    message: "must be more than 0 seconds".into(),
                });
            }
        }
        if c.max_connections == 0 {
            return Err(ServeError::Config {
                name: "connection cap",
                message: "must be at least 1".into(),
            });
        }
        if self.max_n == 0 {
            return Err(ServeError::Config {
                name: "max_n",
                message: "must be at least 1".into(),
            });
        }
        Ok(())
    }
}

/// Largest body by default: 1 MiB, far more than the longest prompt a context holds.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;

/// What every handler shares.
pub(crate) struct AppState {
    pub(crate) cfg: ServerConfig,
    /// Becomes the drain timeout that applied once it has passed: handlers end what they
    /// still hold.
    pub(crate) drain_expired: watch::Receiver<Option<Duration>>,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) sched: SchedulerHandle,
    pub(crate) metrics: Arc<Metrics>,
    /// The counter in response ids.
    pub(crate) next_id: AtomicU64,
    /// Mixed into the seeds of requests that give none.
    pub(crate) seeds: AtomicU64,
    /// Start time (Unix seconds): the model card's `created` and the response ids' prefix.
    pub(crate) started: u64,
    /// The bound address (the admin side's canary calls the server itself).
    pub(crate) addr: SocketAddr,
    pub(crate) admin: Option<Arc<super::admin::AdminState>>,
}

/// Starts a graceful shutdown of a [`Server`] (as SIGTERM would) from any thread; the
/// request is kept if the server is not waiting for it yet.
#[derive(Clone, Debug)]
pub struct StopHandle(Arc<Notify>);

impl StopHandle {
    pub fn stop(&self) {
        self.0.notify_one();
    }
}

/// A running HTTP server thread.
#[derive(Debug)]
pub struct Server {
    pub addr: SocketAddr,
    stop: Arc<Notify>,
    thread: std::thread::JoinHandle<Result<()>>,
}

impl Server {
    /// Binds the listener (errors come back here) and serves on a new thread. When the
    /// server ends (signal or [`Server::stop`], then drained), it sends
    /// [`Control::Shutdown`] to the scheduler.
    pub fn start(
        cfg: ServerConfig,
        tokenizer: Arc<Tokenizer>,
        sched: SchedulerHandle,
        metrics: Arc<Metrics>,
    ) -> Result<Server> {
        cfg.validate()?;
        let addr = SocketAddr::new(cfg.host, cfg.port);
        let listener = StdListener::bind(addr).map_err(|source| ServeError::Bind {
            addr: addr.to_string(),
            source,
        })?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(Notify::new());
        let (drain_tx, drain_expired) = watch::channel(None);
        let admin = cfg.admin.clone();
        let state = Arc::new(AppState {
            cfg,
            drain_expired,
            tokenizer,
            sched,
            metrics,
            next_id: AtomicU64::new(1),
            seeds: AtomicU64::new(1),
            started: unix_now(),
            addr,
            admin: admin.map(|a| Arc::new(super::admin::AdminState::new(a))),
        });
        let stop2 = Arc::clone(&stop);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tp-http-worker")
            .enable_all()
            .build()?;
        let signals = {
            let _in_runtime = rt.enter();
            Signals::register()
        };
        let thread = std::thread::Builder::new()
            .name("tp-http".into())
            .spawn(move || serve_thread(rt, listener, state, signals, stop2, drain_tx))?;
        Ok(Server { addr, stop, thread })
    }

    /// Starts a graceful shutdown, as SIGTERM would.
    pub fn stop(&self) {
        self.stop.notify_one();
    }

    /// A handle that starts the same shutdown from any thread.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(Arc::clone(&self.stop))
    }

    /// Waits for the server thread (it ends after draining, bounded by the drain timeout).
    pub fn join(self) -> Result<()> {
        self.thread
            .join()
            .map_err(|_| ServeError::Server("the HTTP thread panicked".into()))?
    }
}

/// After the drain timeout has ended the requests still in flight, how long their
/// connections get to send the closing error (and `[DONE]`) before the runtime stops.
const FINAL_FLUSH: Duration = Duration::from_secs(2);

fn serve_thread(
    rt: tokio::runtime::Runtime,
    listener: StdListener,
    state: Arc<AppState>,
    signals: Signals,
    stop: Arc<Notify>,
    drain_expired: watch::Sender<Option<Duration>>,
) -> Result<()> {
    let control = state.sched.control.clone();
    let log = state.cfg.log;
    let out = rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let (closing_tx, closing) = watch::channel(false);
        let open = Arc::new(watch::Sender::new(0usize));
        let mut open_rx = open.subscribe();
        let acceptor = Acceptor {
            listener,
            app: router(Arc::clone(&state)),
            limits: state.cfg.connections,
            metrics: Arc::clone(&state.metrics),
            closing,
            open,
            log,
        };
        let accepting = tokio::spawn(acceptor.run());
        let (why, term) = signals.wait(&stop).await;
        let drain = if term {
            state.cfg.term_drain_timeout
        } else {
            state.cfg.drain_timeout
        };
        if log {
            eprintln!(
                "# tp serve: {why}: no new connections; finishing in-flight requests (at most {:.0} s)",
                drain.as_secs_f64()
            );
        }
        // Stops accepting (the listener is dropped) and closes idle connections; busy ones
        // close once their response is written.
        let _ = closing_tx.send(true);
        let _ = accepting.await;
        let drained = tokio::time::timeout(drain, open_rx.wait_for(|n| *n == 0))
            .await
            .is_ok();
        if !drained {
            eprintln!(
                "# tp serve: in-flight requests did not finish within {:.0} s; ending them with an error",
                drain.as_secs_f64()
            );
            let _ = drain_expired.send(Some(drain));
            let _ = tokio::time::timeout(FINAL_FLUSH, open_rx.wait_for(|n| *n == 0)).await;
        }
        Ok(())
    });
    // Whatever is left (nothing after a clean drain) is cancelled by the scheduler.
    let _ = control.send(Control::Shutdown);
    rt.shutdown_timeout(Duration::from_secs(2));
    out
}

/// SIGINT and SIGTERM, registered before the address is printed so that a signal sent as
/// soon as the server is up is never lost (or left to kill the process).
struct Signals {
    #[cfg(unix)]
    int: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    /// Must run inside the runtime (`Runtime::enter`).
    fn register() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Signals {
                int: signal(SignalKind::interrupt()).ok(),
                term: signal(SignalKind::terminate()).ok(),
            }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    /// Resolves on SIGINT, SIGTERM or [`Server::stop`]; says which, and whether it was SIGTERM.
    async fn wait(mut self, stop: &Notify) -> (&'static str, bool) {
        #[cfg(unix)]
        {
            async fn recv(s: &mut Option<tokio::signal::unix::Signal>) {
                match s {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            }
            let why = tokio::select! {
                _ = recv(&mut self.int) => ("interrupted (SIGINT)", false),
                _ = recv(&mut self.term) => ("terminated (SIGTERM)", true),
                _ = stop.notified() => ("stopping", false),
            };
            // A second Ctrl-C ends the process at once.
            if let Some(mut int) = self.int.take() {
                tokio::spawn(async move {
                    int.recv().await;
                    eprintln!("# tp serve: second interrupt; exiting now");
                    std::process::exit(130);
                });
            }
            why
        }
        #[cfg(not(unix))]
        {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => ("interrupted (Ctrl-C)", false),
                _ = stop.notified() => ("stopping", false),
            }
        }
    }
}

/// Resolves once the drain timeout has passed (never, while the server runs).
pub(crate) async fn drain_expired(st: &AppState) {
    let mut rx = st.drain_expired.clone();
    if rx.wait_for(|expired| expired.is_some()).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// What a request still in flight when the drain timeout passes is ended with.
pub(crate) fn drain_error(st: &AppState) -> ApiError {
    ApiError::unavailable(
        503,
        "shutting_down",
        format!(
            "the server is shutting down and this request did not finish within its drain timeout ({} s); retry it",
            st.drain_expired
                .borrow()
                .unwrap_or(st.cfg.drain_timeout)
                .as_secs_f64()
        ),
    )
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::http::request::DEFAULT_MAX_N;

    pub(crate) fn cfg() -> ServerConfig {
        ServerConfig {
            host: IpAddr::from([127, 0, 0, 1]),
            port: 0,
            api_key: None,
            public_health: false,
            model_name: "m".into(),
            ctx_size: 100,
            kv_budget_positions: 1000,
            vocab: 10,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_queue: 8,
            max_n: DEFAULT_MAX_N,
            drain_timeout: Duration::from_secs(1),
            term_drain_timeout: Duration::from_secs(1),
            event_timeout: Duration::from_secs(1),
            connections: ConnLimits {
                header_timeout: Duration::from_secs(10),
                idle_timeout: Duration::from_secs(60),
                max_connections: 10,
            },
            log: false,
            auth_hint: None,
            admin: None,
        }
    }

    #[test]
    fn empty_and_unsendable_keys_are_refused() {
        for bad in ["", " ", "\t\n", "two words", "caf\u{e9}"] {
            assert!(check_api_key(bad).is_err(), "{bad:?}");
            let c = ServerConfig {
                api_key: Some(bad.into()),
                ..cfg()
            };
            assert!(
                matches!(
                    c.validate(),
                    Err(ServeError::Config {
                        name: "api key",
                        ..
                    })
                ),
                "{bad:?}"
            );
        }
        assert!(check_api_key("sk-1234_abc").is_ok());
        let zero = ServerConfig {
            connections: ConnLimits {
                max_connections: 0,
                ..cfg().connections
            },
            ..cfg()
        };
        assert!(zero.validate().is_err());
        assert!(cfg().validate().is_ok());
    }

    /// A server's state around a scheduler channel nobody serves (the test reads it).
    pub(crate) fn state(max_queue: usize) -> (AppState, std::sync::mpsc::Receiver<Control>) {
        let (control, rx) = std::sync::mpsc::channel();
        let (_, drain_expired) = watch::channel(None);
        let st = AppState {
            cfg: ServerConfig { max_queue, ..cfg() },
            drain_expired,
            tokenizer: Arc::new(Tokenizer::bytes(&[])),
            sched: SchedulerHandle {
                control,
                load: Arc::default(),
            },
            metrics: Arc::new(Metrics::new()),
            next_id: AtomicU64::new(1),
            seeds: AtomicU64::new(1),
            started: 0,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin: None,
        };
        (st, rx)
    }
}
