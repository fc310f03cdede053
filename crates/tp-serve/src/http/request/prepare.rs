//! Request parsing, part two: a body becomes what the scheduler runs. The body's rejection
//! (too large, unreadable) as a client error, the parse ([`super::parse_request`]), the prompt
//! tokenized (off the async workers), `max_tokens` fitted to the context and the KV budget,
//! and the [`DecodeParams`] (a seed drawn for requests that give none).

use super::{parse_request, Endpoint, GenRequest, Prompt};
use crate::error::ApiError;
use crate::http::server::{AppState, ServerConfig};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tp_engine::{DecodeParams, SamplingParams};
use tp_tokenizer::{Tokenizer, TokenizerError};

/// A request ready for the scheduler.
pub(crate) struct Prepared {
    pub(crate) req: GenRequest,
    /// The prompt's token ids.
    pub(crate) ids: Vec<u32>,
    /// How to decode every choice (each choice's seed is derived from this one's).
    pub(crate) params: DecodeParams,
}

/// Validates and tokenizes a request body.
pub(crate) async fn prepare(
    st: &AppState,
    endpoint: Endpoint,
    body: std::result::Result<Bytes, BytesRejection>,
) -> std::result::Result<Prepared, ApiError> {
    let body = body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(st.cfg.max_body_bytes)
        } else {
            ApiError::bad_body("invalid_body", r.body_text())
        }
    })?;
    let req = parse_request(endpoint, &body, &st.cfg.model_name, st.cfg.max_n)?;
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
    Ok(Prepared { req, ids, params })
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

/// A seed for requests that give none: differs per request and per server start.
fn random_seed(st: &AppState) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ st.seeds.fetch_add(1, Ordering::Relaxed).rotate_left(32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::request::DEFAULT_MAX_N;
    use crate::http::server::tests::cfg;

    #[test]
    fn max_tokens_is_checked_against_the_context() {
        let mut req = parse_request(
            Endpoint::Completions,
            br#"{"prompt":"x","max_tokens":60}"#,
            "m",
            DEFAULT_MAX_N,
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
