//! The admin endpoints, behind their own key (`Authorization: Bearer ADMIN_KEY`; off without
//! one): `POST /admin/reload` loads a model on every rank beside the live one, runs the
//! canary against it and only then switches traffic (the previous model stays held; when
//! the memory plan says two cannot be held, or the swap policy says so, it drains first);
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
use crate::rollout::{Admin, SwapPolicy, Switched};
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
    /// Hold the new model beside the live one when it fits, or always drain first.
    pub swap: SwapPolicy,
    /// Memory a reload's model may take on this host, in place of what the system reports
    /// available now (`MemAvailable`); `None`: what the system reports.
    pub reload_memory: Option<u64>,
    /// The first model's weights on this host (its path may be unknown), by the memory plan.
    pub first_weights: u64,
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
    let rollout = st.metrics.board.snapshot().rollout;
    let memory = Memory {
        policy: admin.cfg.swap,
        available: admin.cfg.reload_memory.or_else(available_memory),
        held: rollout.models.iter().map(|m| m.path.clone()).collect(),
        first_weights: admin.cfg.first_weights,
    };
    let (path, note, room) = tokio::task::spawn_blocking(move || {
        preflight(&checked, &shape, &tokenizer, layout.as_ref(), &memory)
    })
    .await
    .map_err(|e| ApiError::internal(format!("the model check failed: {e}")))??;
    let shown = path.display().to_string();
    let drain = match room {
        Room::Beside => None,
        Room::Drain(why) => {
            if rollout.live.path.is_none() {
                return Err(no_room(format!(
                    "{shown} must be swapped in by draining first ({why}) but the live model's path is unknown, so it could not be loaded back; restart the server on the new model (this server does not drain and swap in place)"
                )));
            }
            Some(why)
        }
    };
    let drained = drain.is_some();
    let id = ask(
        st,
        |reply| Admin::Load {
            path: shown.clone(),
            drain,
            reply,
        },
        admin.cfg.load_timeout,
    )
    .await?
    .map_err(|why| {
        if drained {
            // The scheduler's words say what became of the model live before.
            ApiError::invalid("path", "invalid_model", why)
        } else {
            invalid_model(&shown, &why)
        }
    })?;
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
            let ran = tokio::task::spawn_blocking(move || {
                canary::run_at(&client, &endpoint, &c, threshold)
            })
            .await;
            match ran {
                Ok(v) => Some(v),
                Err(e) => {
                    // A drained candidate is the only model held: give it up for the old one.
                    let _ = discard(st, id, false, drained).await;
                    return Err(ApiError::internal(format!("the canary failed to run: {e}")));
                }
            }
        }
        None => None,
    };
    if let Some(v) = verdict.as_ref().filter(|v| !v.passed) {
        eprintln!(
            "# tp serve: model {id} ({shown}) failed its canary and is not switched to: {}",
            v.detail
        );
        let after = discard(st, id, true, drained).await?;
        return Err(ApiError {
            status: 409,
            message: format!(
                "the canary failed on {shown} ({} of {} cases differ, largest mean-logprob shift {:.4}): {}; {after}",
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
        "swap": if drained { "drain" } else { "beside" },
        "drained": switched.drained,
    }))
}

/// Gives candidate `id` up; a drained one is replaced by the model live before, loaded back
/// from its path. What became of the live model, in words.
async fn discard(st: &AppState, id: u32, failed: bool, drained: bool) -> Result<String, ApiError> {
    if !drained {
        let _ = st.sched.control.send(Control::Admin(Admin::Discard {
            id,
            failed,
            reply: None,
        }));
        return Ok("the live model keeps serving".into());
    }
    let back = ask(
        st,
        |reply| Admin::Discard {
            id,
            failed,
            reply: Some(reply),
        },
        RESTORE_TIMEOUT,
    )
    .await?
    .map_err(|why| ApiError::unavailable(503, "restore_failed", why))?;
    Ok(format!(
        "the model live before, {}, was loaded back and serves ({:.3} s without a model)",
        back.live.name,
        back.drained.map_or(0.0, |d| d.downtime_seconds)
    ))
}

/// Longest wait for the model live before a drain swap to be loaded back.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(1800);

/// 507: the memory plan leaves no room, in `message`'s words.
fn no_room(message: String) -> ApiError {
    ApiError {
        status: 507,
        message,
        kind: "server_error",
        param: Some("path".into()),
        code: Some("insufficient_memory"),
    }
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

/// What decides where a reload's model goes.
struct Memory {
    policy: SwapPolicy,
    /// Bytes available to the new model on this host (`None`: unknown, not priced).
    available: Option<u64>,
    /// Each held model's path (`None`: the first model's, unknown).
    held: Vec<Option<String>>,
    first_weights: u64,
}

/// Where a reload's model goes.
#[derive(Debug, PartialEq)]
enum Room {
    /// Loaded beside the held models.
    Beside,
    /// In their place, after a drain, because of the reason given (in words).
    Drain(String),
}

/// The path (made absolute when it exists) once it opens as a model of the live one's
/// shape with the live tokenizer, a note when it carries no tokenizer of its own, and where
/// it goes by the memory plan.
fn preflight(
    path: &std::path::Path,
    live: &ModelConfig,
    tokenizer: &Tokenizer,
    layout: Option<&Layout>,
    memory: &Memory,
) -> Result<(PathBuf, Option<String>, Room), ApiError> {
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
    let room = match layout {
        Some(l) => {
            let need = host_weights(&shown, &*ckpt, l)?;
            let held = memory
                .held
                .iter()
                .map(|p| match p {
                    Some(p) => open_checkpoint(std::path::Path::new(p))
                        .ok()
                        .and_then(|c| host_weights(p, &*c, l).ok())
                        .unwrap_or(memory.first_weights),
                    None => memory.first_weights,
                })
                .sum();
            check_room(&shown, need, held, memory.available, memory.policy)?
        }
        None if memory.policy == SwapPolicy::Drain => {
            Room::Drain("the server's swap policy is to drain first".into())
        }
        None => Room::Beside,
    };
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    Ok((path, note, room))
}

/// The weights of `ckpt` on this host's ranks, by the memory plan. Only this host is priced:
/// under mpirun other hosts' ranks find out when they load (and the reload is then refused
/// on every rank).
fn host_weights(
    shown: &str,
    ckpt: &dyn tp_models::Checkpoint,
    l: &Layout,
) -> Result<u64, ApiError> {
    let plan = tp_engine::session::memory_plan(ckpt, &l.weights, l.ctx, l.load)
        .map_err(|e| invalid_model(shown, &tp_engine::report::chain(&e)))?;
    Ok(l.local_ranks
        .iter()
        .filter_map(|&r| plan.get(r))
        .map(|m| (m.sharded + m.replicated) as u64)
        .sum())
}

/// Where a model whose weights take `need` bytes on this host goes, with `held` bytes taken
/// by the held models and `available` free for it: beside them when it fits (and the policy
/// allows), in their place after a drain when it fits only without them, nowhere (507) when
/// it does not fit even then.
fn check_room(
    shown: &str,
    need: u64,
    held: u64,
    available: Option<u64>,
    policy: SwapPolicy,
) -> Result<Room, ApiError> {
    let show = tp_engine::report::show_bytes;
    if let Some(a) = available {
        if need > a.saturating_add(held) {
            return Err(no_room(format!(
                "the memory plan says {shown} cannot be held even with the held models dropped: its weights take {} on this host, and the held models' {} with the {} available make {}; free memory, or restart the server on the new model",
                show(need),
                show(held),
                show(a),
                show(a.saturating_add(held))
            )));
        }
    }
    Ok(match (policy, available) {
        (SwapPolicy::Drain, _) => Room::Drain(format!(
            "the server's swap policy is to drain first ({shown}'s weights take {} on this host)",
            show(need)
        )),
        (SwapPolicy::Auto, Some(a)) if need > a => Room::Drain(format!(
            "the memory plan says {shown} cannot be held beside the live model: its weights take {} on this host and {} is available; the held models' {} are freed first",
            show(need),
            show(a),
            show(held)
        )),
        (SwapPolicy::Auto, _) => Room::Beside,
    })
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

/// `POST /admin/rollback`: the previous model is live again (after a drain swap, which
/// dropped it, it is drained back: loaded again from its path).
pub(crate) async fn rollback(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let r = async {
        let admin = authorize(&st, &headers)?;
        let switched = ask(
            &st,
            |reply| Admin::Rollback {
                reason: "requested on the admin endpoint".into(),
                automatic: false,
                reply: Some(reply),
            },
            admin.cfg.load_timeout,
        )
        .await?
        .map_err(|why| ApiError::unavailable(409, "no_previous_model", why))?;
        Ok(json!({"live": switched.live, "previous": switched.previous,
            "drained": switched.drained}))
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
    fn the_memory_plan_decides_beside_the_live_model_after_a_drain_or_507() {
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
        assert_eq!(host_weights("m.gguf", &*ckpt, &layout).unwrap(), need);
        let auto = SwapPolicy::Auto;
        let room = |available, held, policy| check_room("m.gguf", need, held, available, policy);
        assert_eq!(room(Some(need), need, auto).unwrap(), Room::Beside);
        assert_eq!(room(None, need, auto).unwrap(), Room::Beside);
        // Beside the live model it does not fit; in its place it does: drain first.
        match room(Some(need - 1), need, auto).unwrap() {
            Room::Drain(why) => assert!(why.contains("m.gguf cannot be held beside"), "{why}"),
            other => panic!("{other:?}"),
        }
        // The drain policy drains even when both fit.
        assert!(matches!(
            room(Some(need), need, SwapPolicy::Drain).unwrap(),
            Room::Drain(_)
        ));
        // Not even in the held models' place: 507 with both sizes.
        let e = room(Some(need / 4), need / 2, auto).unwrap_err();
        assert_eq!(e.status, 507);
        assert!(
            e.message.contains("even with the held models dropped"),
            "{}",
            e.message
        );
        let show = tp_engine::report::show_bytes;
        assert!(e.message.contains(&show(need)), "{}", e.message);
        assert!(e.message.contains(&show(need / 2)), "{}", e.message);
        let e = room(Some(0), 0, SwapPolicy::Drain).unwrap_err();
        assert_eq!(e.status, 507);
        // Only this host's ranks count.
        let one = Layout {
            local_ranks: vec![0],
            ..layout
        };
        assert!(host_weights("m.gguf", &*ckpt, &one).unwrap() < need);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
