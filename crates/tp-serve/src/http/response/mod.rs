//! Responses to generation requests: the OpenAI JSON of answers and chunks ([`json`]), the
//! server-sent event stream (`stream`) and the whole answer of a non-streaming request
//! (`whole`), both reading the events of a request's choices as they arrive; and what
//! both share: a response's identity and the log line of a finished request.

pub mod json;
pub(crate) mod stream;
pub(crate) mod whole;

pub use json::{logprobs_json, Choice, ResponseMeta, LOGPROB_FLOOR};

use super::request::Endpoint;
use super::server::{unix_now, AppState};
use crate::scheduler::Usage;
use std::sync::atomic::Ordering;
use std::time::Instant;
use tp_engine::FinishReason;

/// The identity of a new response: a fresh id, now, the served model's name.
pub(crate) fn new_meta(st: &AppState, endpoint: Endpoint) -> ResponseMeta {
    ResponseMeta {
        id: response_id(st, endpoint),
        created: unix_now(),
        model: st.cfg.model_name.clone(),
        endpoint,
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

/// The log line of a finished request: its usage (all choices) and how each choice ended.
pub(crate) fn log_done(
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
