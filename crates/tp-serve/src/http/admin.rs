//! The admin endpoints, behind their own key (`Authorization: Bearer ADMIN_KEY`; off without
//! one): `POST /admin/reload` loads a model on every rank beside the live one, runs the
//! canary against it and only then switches traffic (the previous model stays held);
//! `POST /admin/rollback` switches back; `GET /admin/models` lists the held models;
//! `POST /admin/models/{id}/v1/completions` is a completion on one held model (what the
//! candidate's canary asks). See [`crate::rollout`] for the scheduler's side.

use super::auth::{bearer_token, constant_time_eq};
use super::routes::{error_response, generate_on, read_body};
use super::server::AppState;
use crate::canary::{self, Canaries, Canary, CanaryConfig, Verdict};
use crate::client::Client;
use crate::error::ApiError;
use crate::http::request::Endpoint;
use crate::rollout::{Admin, Switched};
use crate::scheduler::Control;
use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tp_models::{open_checkpoint, ModelConfig};
use tp_tokenizer::Tokenizer;

/// What the admin endpoints need (a server without it has them off).
#[derive(Clone, Debug)]
pub struct AdminConfig {
    /// The admin key (not the API key): printable ASCII without spaces.
    pub key: String,
    /// The live model's shape: a model loaded beside it must have the same KV cache and
    /// vocabulary (the KV budget and the tokenizer are the server's).
    pub model: ModelConfig,
    /// The server's canary and threshold (a reload may bring the new model's own canary).
    pub canary: Option<CanaryConfig>,
    /// Each model's canary, shared with the periodic canary.
    pub canaries: Arc<Canaries>,
    /// Longest wait for every rank to load a model.
    pub load_timeout: Duration,
    /// How ranks load a model (to price a second one before it loads); `None`: not priced.
    pub layout: Option<Layout>,
}

/// The server's layout, to price a second model's weights on this host.
#[derive(Clone, Debug)]
pub struct Layout {
    pub weights: tp_models::RankWeights,
    pub ctx: usize,
    pub load: tp_models::LoadOptions,
    /// The ranks whose processes run on this host (all of them with the local backend).
    pub local_ranks: Vec<usize>,
}

/// The admin endpoints' state.
pub(crate) struct AdminState {
    pub(crate) cfg: AdminConfig,
    /// One reload at a time.
    busy: tokio::sync::Mutex<()>,
}

impl AdminState {
    pub(crate) fn new(cfg: AdminConfig) -> Self {
        AdminState {
            cfg,
            busy: tokio::sync::Mutex::new(()),
        }
    }
}

/// The admin state when the request carries the admin key: 404 when the endpoints are off,
/// 401 without the key or with a wrong one.
fn authorize<'a>(st: &'a AppState, headers: &HeaderMap) -> Result<&'a AdminState, ApiError> {
    let Some(admin) = st.admin.as_deref() else {
        return Err(ApiError::not_found(
            "the admin endpoints are off: this server was started without an admin key",
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token);
    if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), admin.cfg.key.as_bytes())) {
        return Err(ApiError {
            status: 401,
            message: "missing or wrong admin key: send 'Authorization: Bearer <admin key>' with the admin key the server was started with (not the API key)".into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_admin_key"),
        });
    }
    Ok(admin)
}

fn answer(st: &AppState, r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => {
            st.metrics.request("admin", 200);
            Json(v).into_response()
        }
        Err(e) => {
            st.metrics.request("admin", e.status);
            error_response(&e)
        }
    }
}

/// A JSON object body (empty: `{}`).
fn object(body: &Bytes) -> Result<serde_json::Map<String, Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Default::default());
    }
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(ApiError::bad_body(
            "invalid_body",
            format!(
                "the body must be a JSON object, not {}",
                crate::error::json_kind(&other)
            ),
        )),
        Err(e) => Err(ApiError::bad_body(
            "invalid_json",
            format!("the body is not JSON: {e}"),
        )),
    }
}

/// `POST /admin/reload {"path", "canary"?, "skip_canary"?}`.
pub(crate) async fn reload(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r = reload_inner(&st, &headers, &body).await;
    answer(&st, r)
}

async fn reload_inner(st: &AppState, headers: &HeaderMap, body: &Bytes) -> Result<Value, ApiError> {
    let admin = authorize(st, headers)?;
    let body = object(body)?;
    let path = match body.get("path") {
        Some(Value::String(p)) if !p.is_empty() => PathBuf::from(p),
        Some(Value::String(_)) | None => {
            return Err(ApiError::invalid(
                "path",
                "missing_path",
                "give the model to load as \"path\": a GGUF file, an HF directory or a `tp train` checkpoint directory",
            ))
        }
        Some(other) => return Err(ApiError::wrong_type("path", "a string", other)),
    };
    let skip = match body.get("skip_canary") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(ApiError::wrong_type("skip_canary", "a boolean", other)),
    };
    let own_canary = match body.get("canary") {
        None | Some(Value::Null) => None,
        Some(Value::String(p)) => Some(
            Canary::load(std::path::Path::new(p))
                .map_err(|e| ApiError::invalid("canary", "invalid_canary", e.to_string()))?,
        ),
        Some(other) => return Err(ApiError::wrong_type("canary", "a string", other)),
    };
    let Ok(_one_at_a_time) = admin.busy.try_lock() else {
        return Err(ApiError {
            status: 409,
            code: Some("reload_in_progress"),
            ..ApiError::not_found("another reload is in progress; retry once it has ended")
        });
    };
    let t0 = Instant::now();
    // Checked here first, where an error costs nothing: the file opens as a model of the
    // live one's shape, with the same tokenizer.
    let tokenizer = Arc::clone(&st.tokenizer);
    let shape = admin.cfg.model.clone();
    let layout = admin.cfg.layout.clone();
    let checked = path.clone();
    let (path, note) = tokio::task::spawn_blocking(move || {
        preflight(&checked, &shape, &tokenizer, layout.as_ref())
    })
    .await
    .map_err(|e| ApiError::internal(format!("the model check failed: {e}")))??;
    let shown = path.display().to_string();
    let id = ask(
        st,
        |reply| Admin::Load {
            path: shown.clone(),
            reply,
        },
        admin.cfg.load_timeout,
    )
    .await?
    .map_err(|why| invalid_model(&shown, &why))?;
    let load_seconds = t0.elapsed().as_secs_f64();
    // The canary against the candidate, through the same HTTP path clients take.
    let canary = match (&own_canary, &admin.cfg.canary) {
        _ if skip => None,
        (Some(c), Some(cfg)) => Some((c.clone(), cfg.threshold)),
        (Some(c), None) => Some((c.clone(), canary::DEFAULT_THRESHOLD)),
        (None, Some(cfg)) => Some((
            admin
                .cfg
                .canaries
                .of(st.metrics.board.live_model(), &cfg.canary),
            cfg.threshold,
        )),
        (None, None) => None,
    };
    let verdict: Option<Verdict> = match canary {
        Some((c, threshold)) => {
            let client =
                Client::new(crate::service::loopback(st.addr)).with_api_key(&admin.cfg.key);
            let endpoint = canary::held_endpoint(id);
            Some(
                tokio::task::spawn_blocking(move || {
                    canary::run_at(&client, &endpoint, &c, threshold)
                })
                .await
                .map_err(|e| ApiError::internal(format!("the canary failed to run: {e}")))?,
            )
        }
        None => None,
    };
    if let Some(v) = verdict.as_ref().filter(|v| !v.passed) {
        let _ = st
            .sched
            .control
            .send(Control::Admin(Admin::Discard { id, failed: true }));
        eprintln!(
            "# tp serve: model {id} ({shown}) failed its canary and is not switched to: {}",
            v.detail
        );
        return Err(ApiError {
            status: 409,
            message: format!(
                "the canary failed on {shown} ({} of {} cases differ, largest mean-logprob shift {:.4}): {}; the live model keeps serving",
                v.mismatches, v.cases, v.max_shift, v.detail
            ),
            kind: "invalid_request_error",
            param: Some("path".into()),
            code: Some("canary_failed"),
        });
    }
    if let Some(c) = own_canary {
        admin.cfg.canaries.set(id, c);
    }
    let switched: Switched = ask(
        st,
        |reply| Admin::Switch { id, reply },
        Duration::from_secs(60),
    )
    .await?
    .map_err(|why| ApiError::unavailable(409, "switch_refused", why))?;
    Ok(json!({
        "live": switched.live,
        "previous": switched.previous,
        "canary": verdict,
        "note": note,
        "load_seconds": load_seconds,
    }))
}

/// 400 naming the model that could not be loaded, with the loader's words.
fn invalid_model(path: &str, why: &str) -> ApiError {
    ApiError::invalid(
        "path",
        "invalid_model",
        format!("cannot load the model {path}: {why}; the live model keeps serving"),
    )
}

/// Sends an admin message to the scheduler and waits (at most `limit`) for its reply.
async fn ask<T>(
    st: &AppState,
    message: impl FnOnce(oneshot::Sender<T>) -> Admin,
    limit: Duration,
) -> Result<T, ApiError> {
    let (tx, rx) = oneshot::channel();
    if st.sched.control.send(Control::Admin(message(tx))).is_err() {
        return Err(ApiError::unavailable(
            503,
            "shutting_down",
            "the server is shutting down",
        ));
    }
    match tokio::time::timeout(limit, rx).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(_)) => Err(ApiError::unavailable(
            503,
            "shutting_down",
            "the server is shutting down",
        )),
        Err(_) => Err(ApiError::unavailable(
            504,
            "admin_timeout",
            format!(
                "no answer from the scheduler within {:.0} s",
                limit.as_secs_f64()
            ),
        )),
    }
}

/// The path (made absolute when it exists) once it opens as a model of the live one's
/// shape with the live tokenizer, and a note when it carries no tokenizer of its own.
fn preflight(
    path: &std::path::Path,
    live: &ModelConfig,
    tokenizer: &Tokenizer,
    layout: Option<&Layout>,
) -> Result<(PathBuf, Option<String>), ApiError> {
    let shown = path.display().to_string();
    let ckpt =
        open_checkpoint(path).map_err(|e| invalid_model(&shown, &tp_engine::report::chain(&e)))?;
    let c = ckpt.config();
    let shape = |c: &ModelConfig| {
        format!(
            "{} with {} layers, {} heads / {} KV heads of {} and a vocabulary of {}",
            c.arch.name(),
            c.layers,
            c.heads,
            c.kv_heads,
            c.head_dim,
            c.vocab
        )
    };
    if shape(c) != shape(live) {
        return Err(invalid_model(
            &shown,
            &format!(
                "it is a {} but the live model is a {}; a server switches between models of one shape (a fine-tuned checkpoint of the live model, another quantization of it)",
                shape(c),
                shape(live)
            ),
        ));
    }
    let note = match tp_engine::session::load_tokenizer(path, &*ckpt) {
        Ok(t) if same_tokenizer(&t, tokenizer) => None,
        Ok(_) => {
            return Err(invalid_model(
                &shown,
                "its tokenizer differs from the live model's (requests are tokenized with the live one)",
            ))
        }
        Err(_) => Some(format!(
            "{shown} carries no tokenizer; the live model's is used"
        )),
    };
    if let Some(l) = layout {
        check_room(&shown, &*ckpt, l, available_memory())?;
    }
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    Ok((path, note))
}

/// Refuses a model whose weights (the shards of this host's ranks, by the memory plan) do not
/// fit the memory available now beside the live one. Only this host is priced: under mpirun
/// other hosts' ranks find out when they load (and the reload is then refused on every rank).
fn check_room(
    shown: &str,
    ckpt: &dyn tp_models::Checkpoint,
    l: &Layout,
    available: Option<u64>,
) -> Result<(), ApiError> {
    let Some(available) = available else {
        return Ok(());
    };
    let plan = tp_engine::session::memory_plan(ckpt, &l.weights, l.ctx, l.load)
        .map_err(|e| invalid_model(shown, &tp_engine::report::chain(&e)))?;
    let need: u64 = l
        .local_ranks
        .iter()
        .filter_map(|&r| plan.get(r))
        .map(|m| (m.sharded + m.replicated) as u64)
        .sum();
    if need > available {
        return Err(ApiError {
            status: 507,
            message: format!(
                "the memory plan says {shown} cannot be held beside the live model: its weights take {} on this host and {} is available; free memory, or restart the server on the new model (this server does not drain and swap in place)",
                tp_engine::report::show_bytes(need),
                tp_engine::report::show_bytes(available)
            ),
            kind: "server_error",
            param: Some("path".into()),
            code: Some("insufficient_memory"),
        });
    }
    Ok(())
}

/// Memory available for new allocations now (Linux `MemAvailable`), `None` elsewhere.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The same vocabulary: as many tokens, each decoding to the same text.
fn same_tokenizer(a: &Tokenizer, b: &Tokenizer) -> bool {
    a.vocab_size() == b.vocab_size()
        && (0..a.vocab_size() as u32).all(|id| {
            let (x, y) = (a.decode(&[id]), b.decode(&[id]));
            match (x, y) {
                (Ok(x), Ok(y)) => x == y,
                (Err(_), Err(_)) => true,
                _ => false,
            }
        })
}

/// `POST /admin/rollback`: the previous model is live again.
pub(crate) async fn rollback(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let r = async {
        authorize(&st, &headers)?;
        let switched = ask(
            &st,
            |reply| Admin::Rollback {
                reason: "requested on the admin endpoint".into(),
                automatic: false,
                reply: Some(reply),
            },
            Duration::from_secs(60),
        )
        .await?
        .map_err(|why| ApiError::unavailable(409, "no_previous_model", why))?;
        Ok(json!({"live": switched.live, "previous": switched.previous}))
    }
    .await;
    answer(&st, r)
}

/// `GET /admin/models`: the held models, the live one, switches and rollbacks.
pub(crate) async fn models(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let r = authorize(&st, &headers).map(|_| json!(st.metrics.board.snapshot().rollout));
    answer(&st, r)
}

/// `POST /admin/models/{id}/v1/completions`: a completion on held model `id`.
pub(crate) async fn held_completions(
    State(st): State<Arc<AppState>>,
    Path(id): Path<u32>,
    req: Request,
) -> Response {
    if let Err(e) = authorize(&st, req.headers()) {
        return answer(&st, Err(e));
    }
    match read_body(&st, req).await {
        Ok(body) => generate_on(st, Endpoint::Completions, body, Some(id)).await,
        Err(e) => answer(&st, Err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tp_models::synthetic::{GgufTypes, SyntheticModel};
    use tp_models::{Arch, LoadOptions, RankWeights};

    #[test]
    fn a_second_model_that_does_not_fit_is_refused_by_its_memory_plan() {
        let dir = std::env::temp_dir().join(format!("tp-admin-room-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        SyntheticModel::small(Arch::Llama, 3)
            .write_gguf(&path, GgufTypes::F32)
            .unwrap();
        let ckpt = open_checkpoint(&path).unwrap();
        let layout = Layout {
            weights: RankWeights::even(2),
            ctx: 128,
            load: LoadOptions::default(),
            local_ranks: vec![0, 1],
        };
        // The oracle: the memory plan's weights of both ranks.
        let plan =
            tp_engine::session::memory_plan(&*ckpt, &layout.weights, 128, layout.load).unwrap();
        let need: u64 = plan.iter().map(|m| (m.sharded + m.replicated) as u64).sum();
        assert!(check_room("m.gguf", &*ckpt, &layout, Some(need)).is_ok());
        assert!(check_room("m.gguf", &*ckpt, &layout, None).is_ok());
        let e = check_room("m.gguf", &*ckpt, &layout, Some(need - 1)).unwrap_err();
        assert_eq!(e.status, 507);
        assert!(e.message.contains("m.gguf cannot be held"), "{}", e.message);
        // Only this host's ranks count.
        let one = Layout {
            local_ranks: vec![0],
            ..layout
        };
        assert!(check_room("m.gguf", &*ckpt, &one, Some(need - 1)).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
