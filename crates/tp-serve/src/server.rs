//! The HTTP front end (axum on its own tokio runtime thread): routes, API-key check, request
//! validation and tokenization, server-sent events, and graceful shutdown on SIGINT/SIGTERM.
//! Connections (cap, timeouts) are [`crate::conn`]'s. It talks to the scheduler (on rank 0's
//! thread) only through channels. A request for `n` choices is `n` scheduler jobs (the same
//! prompt, so the scheduler computes it once and forks it); their events are merged into one
//! answer or one stream.

use crate::api::{self, Choice, Endpoint, GenRequest, LogprobEntry, Prompt, ResponseMeta, Usage};
use crate::conn::{Acceptor, ConnLimits};
use crate::error::{ApiError, Result, ServeError};
use crate::metrics::Metrics;
use crate::scheduler::{Control, Event, Job, SchedulerHandle};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::future::poll_fn;
use std::net::{IpAddr, SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::{watch, Notify};
use tp_engine::{DecodeParams, FinishReason, SamplingParams};
use tp_tokenizer::{Tokenizer, TokenizerError};

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
}

/// What is wrong with an API key, if anything: it must be non-empty and printable ASCII
/// without spaces (it travels in an HTTP header as a Bearer token). An empty key would
/// otherwise turn authentication off without a word.
pub fn check_api_key(key: &str) -> std::result::Result<(), String> {
    if key.trim().is_empty() {
        return Err("the API key is empty; an empty key would serve without authentication. Give a non-empty key, or none to serve without one".into());
    }
    if let Some(c) = key.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "the API key contains {c:?}; a key must be printable ASCII without spaces (clients send it in an HTTP header)"
        ));
    }
    Ok(())
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

struct AppState {
    cfg: ServerConfig,
    /// Becomes the drain timeout that applied once it has passed: handlers end what they
    /// still hold.
    drain_expired: watch::Receiver<Option<Duration>>,
    tokenizer: Arc<Tokenizer>,
    sched: SchedulerHandle,
    metrics: Arc<Metrics>,
    next_id: AtomicU64,
    seeds: AtomicU64,
    started: u64,
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
        let state = Arc::new(AppState {
            cfg,
            drain_expired,
            tokenizer,
            sched,
            metrics,
            next_id: AtomicU64::new(1),
            seeds: AtomicU64::new(1),
            started: unix_now(),
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

fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.cfg.max_body_bytes))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), auth))
        .with_state(state)
}

fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = (status, Json(e.body())).into_response();
    if e.status == 401 {
        resp.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
    }
    resp
}

/// Endpoint label for metrics.
fn label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "chat",
        "/v1/completions" => "completions",
        "/v1/models" => "models",
        "/health" => "health",
        "/metrics" => "metrics",
        p if p.starts_with("/v1/models/") => "models",
        _ => "other",
    }
}

/// With an API key, every request needs `Authorization: Bearer KEY` (the scheme in any case,
/// the key compared in constant time); `/health` is exempt when `public_health` is set.
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let exempt = st.cfg.public_health && req.uri().path() == "/health";
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token);
        let ok = given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()));
        if !ok && !exempt {
            st.metrics.request(label(req.uri().path()), 401);
            return error_response(&ApiError::unauthorized(st.cfg.auth_hint.as_deref()));
        }
    }
    next.run(req).await
}

/// The token of an `Authorization: Bearer TOKEN` value; the scheme is case-insensitive
/// (RFC 9110 section 11.1).
pub fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once([' ', '\t'])?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Equal bytes, in a time that depends only on the lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().max(b.len());
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..n {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    std::hint::black_box(diff) == 0
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.request("health", 200);
    Json(json!({"status": "ok"})).into_response()
}

fn model_card(st: &AppState) -> Value {
    json!({
        "id": st.cfg.model_name,
        "object": "model",
        "created": st.started,
        "owned_by": "tensor-parallel",
        "max_model_len": st.cfg.ctx_size,
    })
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.request("models", 200);
    Json(json!({"object": "list", "data": [model_card(&st)]})).into_response()
}

async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id == st.cfg.model_name {
        st.metrics.request("models", 200);
        Json(model_card(&st)).into_response()
    } else {
        st.metrics.request("models", 404);
        error_response(&ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..ApiError::not_found(format!(
                "the model '{id}' does not exist on this server; it serves '{}'",
                st.cfg.model_name
            ))
        })
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.request("metrics", 200);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.metrics.render(),
    )
        .into_response()
}

async fn not_found(State(st): State<Arc<AppState>>, req: Request) -> Response {
    st.metrics.request("other", 404);
    error_response(&ApiError::not_found(format!(
        "no route {} {}; this server has POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health and GET /metrics",
        req.method(),
        req.uri().path()
    )))
}

async fn method_not_allowed(State(st): State<Arc<AppState>>, req: Request) -> Response {
    st.metrics.request(label(req.uri().path()), 405);
    error_response(&ApiError {
        status: 405,
        code: Some("method_not_allowed"),
        ..ApiError::not_found(format!(
            "{} is not allowed on {}",
            req.method(),
            req.uri().path()
        ))
    })
}

async fn chat(State(st): State<Arc<AppState>>, req: Request) -> Response {
    match read_body(&st, req).await {
        Ok(body) => generate(st, Endpoint::Chat, body).await,
        Err(e) => {
            st.metrics.request(Endpoint::Chat.label(), e.status);
            error_response(&e)
        }
    }
}

async fn completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    match read_body(&st, req).await {
        Ok(body) => generate(st, Endpoint::Completions, body).await,
        Err(e) => {
            st.metrics.request(Endpoint::Completions.label(), e.status);
            error_response(&e)
        }
    }
}

/// The request body, which must arrive within the header timeout (as the headers must).
async fn read_body(
    st: &AppState,
    req: Request,
) -> std::result::Result<std::result::Result<Bytes, BytesRejection>, ApiError> {
    let limit = st.cfg.connections.header_timeout;
    tokio::time::timeout(limit, Bytes::from_request(req, &()))
        .await
        .map_err(|_| ApiError {
            status: 408,
            message: format!(
                "the request body did not arrive within {} s; send it at once after the headers",
                limit.as_secs_f64()
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_timeout"),
        })
}

/// Resolves once the drain timeout has passed (never, while the server runs).
async fn drain_expired(st: &AppState) {
    let mut rx = st.drain_expired.clone();
    if rx.wait_for(|expired| expired.is_some()).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// What a request still in flight when the drain timeout passes is ended with.
fn drain_error(st: &AppState) -> ApiError {
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

async fn generate(
    st: Arc<AppState>,
    endpoint: Endpoint,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    match start_request(&st, endpoint, body, arrived).await {
        Ok((req, prompt_tokens, choices)) => {
            st.metrics.request(endpoint.label(), 200);
            let meta = ResponseMeta {
                id: response_id(&st, endpoint),
                created: unix_now(),
                model: st.cfg.model_name.clone(),
                endpoint,
            };
            let logprobs = req.logprobs.is_some();
            if req.stream {
                stream_response(st, meta, req.include_usage, logprobs, choices, arrived)
                    .into_response()
            } else {
                match collect(&st, choices).await {
                    Ok((answers, usage)) => {
                        let finishes: Vec<FinishReason> =
                            answers.iter().map(|a| a.finish).collect();
                        log_done(&st, endpoint, &meta.id, &finishes, usage, arrived);
                        let choices: Vec<Choice<'_>> = answers
                            .iter()
                            .map(|a| Choice {
                                text: &a.text,
                                finish_reason: a.finish.as_str(),
                                logprobs: logprobs.then_some(a.logprobs.as_slice()),
                            })
                            .collect();
                        Json(meta.full(&choices, usage)).into_response()
                    }
                    Err(e) => {
                        if st.cfg.log {
                            eprintln!(
                                "# {} failed after {prompt_tokens} prompt tokens: {}",
                                meta.id, e.message
                            );
                        }
                        error_response(&e)
                    }
                }
            }
        }
        Err(e) => {
            st.metrics.request(endpoint.label(), e.status);
            error_response(&e)
        }
    }
}

/// Validates, tokenizes and queues a request: its parsed form, prompt length and the events
/// of its choices.
async fn start_request(
    st: &Arc<AppState>,
    endpoint: Endpoint,
    body: std::result::Result<Bytes, BytesRejection>,
    arrived: Instant,
) -> std::result::Result<(GenRequest, usize, Choices), ApiError> {
    let body = body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(st.cfg.max_body_bytes)
        } else {
            ApiError::bad_body("invalid_body", r.body_text())
        }
    })?;
    let req = api::parse_request(endpoint, &body, &st.cfg.model_name, st.cfg.max_n)?;
    drop(body);
    let tokenizer = Arc::clone(&st.tokenizer);
    let prompt = req.prompt.clone();
    let vocab = st.cfg.vocab;
    let ids = tokio::task::spawn_blocking(move || prompt_ids(&tokenizer, &prompt, vocab))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))??;
    let max_tokens = checked_max_tokens(&st.cfg, &req, ids.len())?;
    let params = DecodeParams {
        sampling: SamplingParams {
            temperature: req.temperature,
            top_k: req.top_k,
            top_p: req.top_p,
            seed: req.seed.unwrap_or_else(|| random_seed(st)),
        },
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        logprobs: req.logprobs,
        stop: req.stop.clone(),
        max_tokens,
        ignore_eos: req.ignore_eos,
    };
    // The parser checked the ranges already; this names the parameter should that change.
    params.validate().map_err(|e| {
        let name = match &e {
            tp_engine::EngineError::Param { name, .. } => *name,
            _ => "presence_penalty",
        };
        ApiError::invalid(name, "invalid_value", e.to_string())
    })?;
    let prompt_tokens = ids.len();
    let choices = submit(st, ids, &params, req.n, arrived)?;
    Ok((req, prompt_tokens, choices))
}

/// Queues one scheduler job per choice, all with the prompt `ids` and `params` except the
/// seed: choice `i` samples with `seed + i`, so choices differ and a seeded request is
/// reproducible. The jobs take `n` places in the admission queue: all of them are queued, or
/// none (429 when the queue has no room for all, 503 once the scheduler has stopped).
fn submit(
    st: &AppState,
    ids: Vec<u32>,
    params: &DecodeParams,
    n: usize,
    arrived: Instant,
) -> std::result::Result<Choices, ApiError> {
    let max_queue = st.cfg.max_queue;
    if n > max_queue.max(1) {
        return Err(ApiError::invalid(
            "n",
            "invalid_value",
            format!(
                "n is {n} but this server queues at most {max_queue} requests (each choice is one); ask for at most {max_queue} choices"
            ),
        ));
    }
    let pending = &st.sched.load.pending;
    let reserved = pending.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |p| {
        p.checked_add(n).filter(|&q| q <= max_queue)
    });
    if let Err(waiting) = reserved {
        let message = if n == 1 {
            format!("{waiting} requests are already waiting; retry later")
        } else {
            format!(
                "{waiting} requests are already waiting and this one's {n} choices would pass the queue's limit of {max_queue}; retry later"
            )
        };
        return Err(ApiError::unavailable(429, "queue_full", message));
    }
    let mut rxs = Vec::with_capacity(n);
    for i in 0..n {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut params = params.clone();
        params.sampling.seed = params.sampling.seed.wrapping_add(i as u64);
        let job = Job {
            prompt: ids.clone(),
            params,
            events: tx,
            arrived,
        };
        if st.sched.control.send(Control::Submit(job)).is_err() {
            // Choices i.. never reached the scheduler; the ones before went down with it.
            pending.fetch_sub(n - i, Ordering::Relaxed);
            return Err(ApiError::unavailable(
                503,
                "shutting_down",
                "the server is shutting down",
            ));
        }
        rxs.push(Some(rx));
    }
    Ok(Choices { rxs, next: 0 })
}

/// The event receivers of one request's choices, read in the order their events arrive. A
/// choice's receiver is dropped once it has finished (or failed); dropping [`Choices`], or
/// [`Choices::close`], drops the others, and the scheduler cancels those jobs (freeing their
/// KV blocks) at its next step.
struct Choices {
    rxs: Vec<Option<UnboundedReceiver<Event>>>,
    /// The choice polled first next time, so that a busy choice cannot starve the others.
    next: usize,
}

impl Choices {
    fn len(&self) -> usize {
        self.rxs.len()
    }

    /// Every choice has ended (or [`Choices::close`] gave them up).
    fn all_finished(&self) -> bool {
        self.rxs.iter().all(Option::is_none)
    }

    /// Gives up every choice still running.
    fn close(&mut self) {
        self.rxs.iter_mut().for_each(|rx| *rx = None);
    }

    /// The next event of a running choice, with the choice's index; `Some((i, None))` when
    /// choice `i`'s sender went away before it ended; `None` when no choice is left.
    async fn recv(&mut self) -> Option<(usize, Option<Event>)> {
        poll_fn(|cx| {
            let n = self.rxs.len();
            let mut running = false;
            for k in 0..n {
                let i = (self.next + k) % n;
                let Some(rx) = self.rxs[i].as_mut() else {
                    continue;
                };
                running = true;
                if let Poll::Ready(event) = rx.poll_recv(cx) {
                    if !matches!(event, Some(Event::Text { .. })) {
                        self.rxs[i] = None;
                    }
                    self.next = (i + 1) % n;
                    return Poll::Ready(Some((i, event)));
                }
            }
            if running {
                Poll::Pending
            } else {
                Poll::Ready(None)
            }
        })
        .await
    }
}

/// The prompt's token ids: the chat template rendered and encoded, text encoded, or ids checked.
fn prompt_ids(
    tokenizer: &Tokenizer,
    prompt: &Prompt,
    vocab: usize,
) -> std::result::Result<Vec<u32>, ApiError> {
    let (ids, param) = match prompt {
        // Message text is encoded as plain text (special tokens only where the template puts
        // them); a plain prompt may hold special tokens, as llama.cpp and vLLM allow.
        Prompt::Chat(messages) => {
            let ids = tokenizer.encode_chat(messages, true).map_err(|e| match e {
                TokenizerError::UnknownRole { index, .. } => ApiError::invalid(
                    format!("messages[{index}].role"),
                    "invalid_value",
                    format!("messages[{index}].role: {e}"),
                ),
                _ => ApiError::invalid(
                    "messages",
                    "invalid_value",
                    format!("the model's chat template refused these messages: {e}"),
                ),
            })?;
            (ids, "messages")
        }
        Prompt::Text(text) => (encode(tokenizer, text, "prompt")?, "prompt"),
        Prompt::Tokens(ids) => {
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    "invalid_value",
                    format!("token id {bad} is out of range; this model's ids are 0..{vocab}"),
                ));
            }
            (ids.clone(), "prompt")
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid(
            param,
            "invalid_value",
            format!("'{param}' gives no tokens; give some text"),
        ));
    }
    Ok(ids)
}

fn encode(
    tokenizer: &Tokenizer,
    text: &str,
    param: &str,
) -> std::result::Result<Vec<u32>, ApiError> {
    tokenizer.encode(text).map_err(|e| {
        ApiError::invalid(
            param,
            "invalid_value",
            format!("cannot tokenize '{param}': {e}"),
        )
    })
}

/// `max_tokens` checked against the context and the KV budget (or the default that fits).
fn checked_max_tokens(
    cfg: &ServerConfig,
    req: &GenRequest,
    prompt: usize,
) -> std::result::Result<usize, ApiError> {
    let prompt_param = match req.endpoint {
        Endpoint::Chat => "messages",
        Endpoint::Completions => "prompt",
    };
    // A sequence holds at most ctx positions and at most the whole KV budget.
    let room = cfg.ctx_size.min(cfg.kv_budget_positions);
    if prompt >= room {
        let holder = if cfg.kv_budget_positions < cfg.ctx_size {
            "KV cache budget"
        } else {
            "context"
        };
        return Err(ApiError::invalid(
            prompt_param,
            "context_length_exceeded",
            format!(
                "the prompt has {prompt} tokens but this server's {holder} holds {room} positions (prompt and completion together); shorten the prompt"
            ),
        ));
    }
    let left = room - prompt;
    match req.max_tokens {
        None => Ok(match req.endpoint {
            Endpoint::Chat => left,
            Endpoint::Completions => left.min(16),
        }),
        Some(m) if m <= left => Ok(m),
        Some(m) => Err(ApiError::invalid(
            req.max_tokens_param,
            "context_length_exceeded",
            format!(
                "{} is {m} but the prompt has {prompt} tokens and this server's context holds {room}; set {} to at most {left}",
                req.max_tokens_param, req.max_tokens_param
            ),
        )),
    }
    .inspect(|&m| debug_assert!(prompt + m <= room))
}

/// One choice of a non-streaming request, whole.
struct Answer {
    text: String,
    logprobs: Vec<LogprobEntry>,
    finish: FinishReason,
}

/// Waits for the whole answer of a non-streaming request: its choices in index order and the
/// usage of them all. Any choice failing fails the request (dropping the others).
async fn collect(
    st: &AppState,
    mut choices: Choices,
) -> std::result::Result<(Vec<Answer>, Usage), ApiError> {
    let mut parts: Vec<(String, Vec<LogprobEntry>, Option<FinishReason>)> =
        (0..choices.len()).map(|_| Default::default()).collect();
    let mut usage = Usage::default();
    while !choices.all_finished() {
        let (i, event) = tokio::select! {
            e = next_event(st, &mut choices) => e?,
            _ = drain_expired(st) => return Err(drain_error(st)),
        };
        let (text, entries, finish) = &mut parts[i];
        match event {
            Event::Text { text: t, logprobs } => {
                text.push_str(&t);
                entries.extend(logprobs);
            }
            Event::Done {
                finish: f,
                usage: u,
                ..
            } => {
                *finish = Some(f);
                usage = usage.with_choice(u);
            }
            Event::Failed {
                message,
                shutting_down,
            } => return Err(failure(message, shutting_down)),
        }
    }
    let answers = parts
        .into_iter()
        .map(|(text, logprobs, finish)| {
            finish.map(|finish| Answer {
                text,
                logprobs,
                finish,
            })
        })
        .collect::<Option<Vec<Answer>>>()
        .ok_or_else(|| ApiError::internal("a choice ended without finishing"))?;
    Ok((answers, usage))
}

fn failure(msg: String, shutting_down: bool) -> ApiError {
    if shutting_down {
        ApiError::unavailable(503, "shutting_down", msg)
    } else {
        ApiError::internal(msg)
    }
}

/// The next event of any running choice, bounded by the event deadline.
async fn next_event(
    st: &AppState,
    choices: &mut Choices,
) -> std::result::Result<(usize, Event), ApiError> {
    match tokio::time::timeout(st.cfg.event_timeout, choices.recv()).await {
        Ok(Some((i, Some(e)))) => Ok((i, e)),
        Ok(Some((_, None))) => Err(ApiError::internal(
            "the scheduler stopped before the request finished",
        )),
        Ok(None) => Err(ApiError::internal(
            "no choice of this request is left to wait for",
        )),
        Err(_) => Err(ApiError::internal(format!(
            "no progress on this request for {:.0} s; the server is overloaded or stuck",
            st.cfg.event_timeout.as_secs_f64()
        ))),
    }
}

/// What the SSE stream does next.
enum Phase {
    /// Chat's opening role chunk of each choice, from this index on.
    Start(usize),
    Body,
    /// Every choice's finish chunk went out; the usage chunk (if asked) and `[DONE]` follow.
    Usage(Usage),
    Done,
    End,
}

struct StreamState {
    st: Arc<AppState>,
    meta: ResponseMeta,
    include_usage: bool,
    /// Text chunks carry the log-probabilities of their tokens.
    logprobs: bool,
    choices: Choices,
    /// How the choices ended so far (in the order they ended) and their usage.
    finishes: Vec<FinishReason>,
    usage: Usage,
    phase: Phase,
    arrived: Instant,
}

/// Server-sent events in OpenAI's chunk format, each chunk naming its choice's `index`, the
/// choices interleaved as their events arrive, ending with `data: [DONE]` once all have
/// finished. Dropping the stream (the client went away) drops every choice's receiver, which
/// the scheduler sees at its next step.
fn stream_response(
    st: Arc<AppState>,
    meta: ResponseMeta,
    include_usage: bool,
    logprobs: bool,
    choices: Choices,
    arrived: Instant,
) -> Sse<impl futures_util::Stream<Item = std::result::Result<SseEvent, Infallible>>> {
    let state = StreamState {
        st,
        meta,
        include_usage,
        logprobs,
        choices,
        finishes: Vec::new(),
        usage: Usage::default(),
        phase: Phase::Start(0),
        arrived,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        let data = match std::mem::replace(&mut s.phase, Phase::Body) {
            Phase::Start(i) => match s.meta.endpoint {
                Endpoint::Chat if i < s.choices.len() => {
                    s.phase = Phase::Start(i + 1);
                    s.meta.chunk(i, true, Some(""), None, None).to_string()
                }
                _ => return next_body(s).await,
            },
            Phase::Body => return next_body(s).await,
            Phase::Usage(usage) => {
                s.phase = Phase::Done;
                if s.include_usage {
                    s.meta.usage_chunk(usage).to_string()
                } else {
                    s.phase = Phase::End;
                    "[DONE]".to_string()
                }
            }
            Phase::Done => {
                s.phase = Phase::End;
                "[DONE]".to_string()
            }
            Phase::End => return None,
        };
        Some((Ok(SseEvent::default().data(data)), s))
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

async fn next_body(
    mut s: StreamState,
) -> Option<(std::result::Result<SseEvent, Infallible>, StreamState)> {
    let event = tokio::select! {
        e = next_event(&s.st, &mut s.choices) => e,
        _ = drain_expired(&s.st) => Err(drain_error(&s.st)),
    };
    let data = match event {
        Ok((i, Event::Text { text, logprobs })) => {
            s.phase = Phase::Body;
            let entries = s.logprobs.then_some(logprobs.as_slice());
            s.meta
                .chunk(i, false, Some(&text), None, entries)
                .to_string()
        }
        Ok((i, Event::Done { finish, usage, .. })) => {
            s.finishes.push(finish);
            s.usage = s.usage.with_choice(usage);
            s.phase = if s.choices.all_finished() {
                log_done(
                    &s.st,
                    s.meta.endpoint,
                    &s.meta.id,
                    &s.finishes,
                    s.usage,
                    s.arrived,
                );
                Phase::Usage(s.usage)
            } else {
                Phase::Body
            };
            s.meta
                .chunk(i, false, None, Some(finish.as_str()), None)
                .to_string()
        }
        Ok((
            _,
            Event::Failed {
                message,
                shutting_down,
            },
        )) => {
            s.choices.close();
            s.phase = Phase::Done;
            failure(message, shutting_down).body().to_string()
        }
        Err(e) => {
            s.choices.close();
            s.phase = Phase::Done;
            e.body().to_string()
        }
    };
    Some((Ok(SseEvent::default().data(data)), s))
}

/// The log line of a finished request: its usage (all choices) and how each choice ended.
fn log_done(
    st: &AppState,
    endpoint: Endpoint,
    id: &str,
    finishes: &[FinishReason],
    usage: Usage,
    arrived: Instant,
) {
    if st.cfg.log {
        let finish: Vec<&str> = finishes.iter().map(|f| f.as_str()).collect();
        let choices = match finishes.len() {
            1 => String::new(),
            n => format!(" ({n} choices)"),
        };
        eprintln!(
            "# {id} {}: {} prompt + {} generated tokens{choices} in {:.3} s, finish {}",
            endpoint.label(),
            usage.prompt_tokens,
            usage.completion_tokens,
            arrived.elapsed().as_secs_f64(),
            finish.join(",")
        );
    }
}

fn response_id(st: &AppState, endpoint: Endpoint) -> String {
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completions => "cmpl",
    };
    format!("{prefix}-{:x}{n:06x}", st.started)
}

/// A seed for requests that give none: differs per request and per server start.
fn random_seed(st: &AppState) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ st.seeds.fetch_add(1, Ordering::Relaxed).rotate_left(32)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_compares_whole_keys() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }

    fn cfg() -> ServerConfig {
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
            max_n: api::DEFAULT_MAX_N,
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
        }
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer_token("Bearer k1"), Some("k1"));
        assert_eq!(bearer_token("bearer k1"), Some("k1"));
        assert_eq!(bearer_token("BEARER   k1 "), Some("k1"));
        assert_eq!(bearer_token("Bearer\tk1"), Some("k1"));
        assert_eq!(bearer_token("Basic k1"), None);
        assert_eq!(bearer_token("Bearer"), None);
        assert_eq!(bearer_token("Bearer  "), None);
        assert_eq!(bearer_token("Bearerk1"), None);
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
    fn state(max_queue: usize) -> (AppState, std::sync::mpsc::Receiver<Control>) {
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
        };
        (st, rx)
    }

    fn submitted(rx: &std::sync::mpsc::Receiver<Control>) -> Vec<Job> {
        rx.try_iter()
            .map(|c| match c {
                Control::Submit(job) => job,
                Control::Shutdown => panic!("a shutdown among the jobs"),
            })
            .collect()
    }

    #[test]
    fn choices_are_jobs_with_consecutive_seeds_queued_all_or_none() {
        let (st, rx) = state(8);
        let mut params = DecodeParams::greedy(4);
        params.sampling.temperature = 1.0;
        params.sampling.seed = u64::MAX - 1;
        let now = Instant::now();
        let choices = submit(&st, vec![5, 6, 7], &params, 3, now).unwrap();
        assert_eq!(choices.len(), 3);
        let jobs = submitted(&rx);
        let seeds: Vec<u64> = jobs.iter().map(|j| j.params.sampling.seed).collect();
        assert_eq!(seeds, [u64::MAX - 1, u64::MAX, 0]);
        for j in &jobs {
            assert_eq!(j.prompt, [5, 6, 7]);
            assert_eq!(
                DecodeParams {
                    sampling: params.sampling.clone(),
                    ..j.params.clone()
                },
                params
            );
        }
        assert_eq!(st.sched.load.pending.load(Ordering::Relaxed), 3);
        // 3 of 8 places taken: 6 more choices do not fit, and none is queued.
        let e = submit(&st, vec![1], &params, 6, now).err().unwrap();
        assert_eq!((e.status, e.code), (429, Some("queue_full")));
        assert!(e.message.contains("6 choices"), "{}", e.message);
        assert!(submitted(&rx).is_empty());
        assert_eq!(st.sched.load.pending.load(Ordering::Relaxed), 3);
        // 5 do.
        let _more = submit(&st, vec![1], &params, 5, now).unwrap();
        assert_eq!(submitted(&rx).len(), 5);
        assert_eq!(st.sched.load.pending.load(Ordering::Relaxed), 8);
        let e = submit(&st, vec![1], &params, 1, now).err().unwrap();
        assert_eq!(e.status, 429);
        // More choices than the queue ever holds: a request to change, not to retry.
        let (small, _rx) = state(2);
        let e = submit(&small, vec![1], &params, 3, now).err().unwrap();
        assert_eq!((e.status, e.param.as_deref()), (400, Some("n")));
        // A stopped scheduler: 503, and the places are given back.
        let (gone, rx) = state(8);
        drop(rx);
        let e = submit(&gone, vec![1], &params, 4, now).err().unwrap();
        assert_eq!(e.status, 503);
        assert_eq!(gone.sched.load.pending.load(Ordering::Relaxed), 0);
        drop(choices);
    }

    #[tokio::test]
    async fn choices_are_read_as_their_events_arrive_and_dropped_together() {
        let (st, rx) = state(8);
        let params = DecodeParams::greedy(4);
        let mut choices = submit(&st, vec![1, 2], &params, 3, Instant::now()).unwrap();
        let jobs = submitted(&rx);
        let text = |t: &str| Event::Text {
            text: t.into(),
            logprobs: Vec::new(),
        };
        let done = Event::Done {
            finish: FinishReason::Length,
            usage: Usage {
                prompt_tokens: 2,
                completion_tokens: 1,
            },
            time_to_first_token: Duration::ZERO,
        };
        jobs[2].events.send(text("c")).unwrap();
        assert_eq!(choices.recv().await, Some((2, Some(text("c")))));
        jobs[0].events.send(done.clone()).unwrap();
        assert_eq!(choices.recv().await, Some((0, Some(done.clone()))));
        // A finished choice's receiver is dropped at once; the others stay open.
        assert!(jobs[0].events.is_closed());
        assert!(!jobs[1].events.is_closed() && !jobs[2].events.is_closed());
        assert!(!choices.all_finished());
        // A sender gone without an ending is reported as such.
        let (tx1, tx2) = (jobs[1].events.clone(), jobs[2].events.clone());
        drop(jobs);
        drop(tx1);
        assert_eq!(choices.recv().await, Some((1, None)));
        // Dropping the rest (a client that went away) closes every remaining channel.
        drop(choices);
        assert!(tx2.is_closed());
    }

    #[test]
    fn max_tokens_is_checked_against_the_context() {
        let mut req = api::parse_request(
            Endpoint::Completions,
            br#"{"prompt":"x","max_tokens":60}"#,
            "m",
            api::DEFAULT_MAX_N,
        )
        .unwrap();
        assert_eq!(checked_max_tokens(&cfg(), &req, 40), Ok(60));
        let e = checked_max_tokens(&cfg(), &req, 41).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("at most 59"), "{}", e.message);
        let e = checked_max_tokens(&cfg(), &req, 100).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        req.max_tokens = None;
        assert_eq!(checked_max_tokens(&cfg(), &req, 90), Ok(10));
        assert_eq!(checked_max_tokens(&cfg(), &req, 10), Ok(16));
        let small = ServerConfig {
            kv_budget_positions: 50,
            ..cfg()
        };
        req.endpoint = Endpoint::Chat;
        assert_eq!(checked_max_tokens(&small, &req, 10), Ok(40));
        // A prompt the KV budget cannot hold: 400 naming the budget and the prompt's length.
        let e = checked_max_tokens(&small, &req, 50).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(e.message.contains("50 tokens"), "{}", e.message);
        assert!(
            e.message.contains("KV cache budget holds 50 positions"),
            "{}",
            e.message
        );
    }
}
