//! Routing: which handler answers which method and path, the handlers of the small routes
//! (health, models, metrics, unknown paths and methods), and the generation endpoints from
//! body to response: read the body, [`prepare`] it, queue its choices, then stream or
//! collect the answer.

use super::admin;
use super::auth::auth;
use super::choices::{submit, Choices};
use super::request::prepare::{prepare, Prepared};
use super::request::{Endpoint, GenRequest};
use super::response::new_meta;
use super::response::stream::stream_response;
use super::response::whole::whole_response;
use super::server::AppState;
use super::ui;
use crate::error::ApiError;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// Every route, the body limit, and the API-key check in front of them all.
pub(crate) fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/", get(ui::chat_page))
        .route("/dashboard", get(ui::dashboard_page))
        .route("/dashboard.json", get(dashboard_json))
        .route("/ui/{name}", get(ui::asset))
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/admin/reload", post(admin::reload))
        .route("/admin/rollback", post(admin::rollback))
        .route("/admin/models", get(admin::models))
        .route(
            "/admin/models/{id}/v1/completions",
            post(admin::held_completions),
        )
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.cfg.max_body_bytes))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), auth))
        .with_state(state)
}

/// An error as its status and OpenAI error body (a 401 names the `Bearer` scheme).
pub(crate) fn error_response(e: &ApiError) -> Response {
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
pub(crate) fn label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "chat",
        "/v1/completions" => "completions",
        "/v1/models" => "models",
        "/health" => "health",
        "/metrics" => "metrics",
        "/dashboard.json" => "dashboard",
        p if p.starts_with("/v1/models/") => "models",
        p if p.starts_with("/admin/") => "admin",
        p if ui::is_public(p) => "ui",
        _ => "other",
    }
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if let Some(why) = st.metrics.engine_failure() {
        st.metrics.request("health", 503);
        let body =
            json!({"status": "unhealthy", "error": format!("the inference engine failed: {why}")});
        return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
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

/// The dashboard's figures (see [`crate::dashboard`]).
async fn dashboard_json(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.request("dashboard", 200);
    Json(st.metrics.board.snapshot()).into_response()
}

async fn not_found(State(st): State<Arc<AppState>>, req: Request) -> Response {
    st.metrics.request("other", 404);
    error_response(&ApiError::not_found(format!(
        "no route {} {}; this server has POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics, GET /dashboard.json, and the web pages GET / (chat) and GET /dashboard",
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
pub(crate) async fn read_body(
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

/// A generation request, body to response: its choices queued, then their events streamed as
/// server-sent events or collected into one answer.
async fn generate(
    st: Arc<AppState>,
    endpoint: Endpoint,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    generate_on(st, endpoint, body, None).await
}

/// [`generate`] on held model `model` (`None`: the live one).
pub(crate) async fn generate_on(
    st: Arc<AppState>,
    endpoint: Endpoint,
    body: std::result::Result<Bytes, BytesRejection>,
    model: Option<u32>,
) -> Response {
    let arrived = Instant::now();
    match start_request(&st, endpoint, body, arrived, model).await {
        Ok((req, prompt_tokens, choices)) => {
            st.metrics.request(endpoint.label(), 200);
            let meta = new_meta(&st, endpoint);
            let logprobs = req.logprobs.is_some();
            if req.stream {
                stream_response(st, meta, req.include_usage, logprobs, choices, arrived)
                    .into_response()
            } else {
                match whole_response(&st, &meta, logprobs, choices, arrived).await {
                    Ok(body) => Json(body).into_response(),
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
    st: &AppState,
    endpoint: Endpoint,
    body: std::result::Result<Bytes, BytesRejection>,
    arrived: Instant,
    model: Option<u32>,
) -> std::result::Result<(GenRequest, usize, Choices), ApiError> {
    let Prepared { req, ids, params } = prepare(st, endpoint, body).await?;
    let prompt_tokens = ids.len();
    let choices = submit(st, ids, &params, req.n, arrived, model)?;
    Ok((req, prompt_tokens, choices))
}
