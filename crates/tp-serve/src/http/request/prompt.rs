//! Request parsing, what the model continues: chat `messages` and completion `prompt`s (a
//! string, one string in an array, or token ids).

use super::fields::Reader;
use super::Prompt;
use crate::error::{json_kind, ApiError};
use serde_json::Value;
use tp_tokenizer::ChatMessage;

pub(super) fn read_messages(r: &Reader<'_>) -> Result<Vec<ChatMessage>, ApiError> {
    let Some(v) = r.get("messages") else {
        return Err(ApiError::invalid(
            "messages",
            "missing_required_parameter",
            "'messages' is required: an array of {\"role\", \"content\"} objects",
        ));
    };
    let Value::Array(items) = v else {
        return Err(ApiError::wrong_type("messages", "an array", v));
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "invalid_value",
            "'messages' is empty; give at least one message",
        ));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let here = format!("messages[{i}]");
        let Value::Object(o) = m else {
            return Err(ApiError::wrong_type(&here, "an object", m));
        };
        let role = match o.get("role") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(Value::String(_)) | None | Some(Value::Null) => {
                return Err(ApiError::invalid(
                    format!("{here}.role"),
                    "missing_required_parameter",
                    format!("{here}.role is missing; use \"system\", \"user\" or \"assistant\""),
                ))
            }
            Some(v) => return Err(ApiError::wrong_type(&format!("{here}.role"), "a string", v)),
        };
        let content = match o.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.iter().enumerate() {
                    let at = format!("{here}.content[{j}]");
                    let kind = p.get("type").and_then(Value::as_str);
                    match (kind, p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => text.push_str(t),
                        (Some("text"), other) => {
                            return Err(ApiError::wrong_type(
                                &format!("{at}.text"),
                                "a string",
                                other.unwrap_or(&Value::Null),
                            ))
                        }
                        _ => {
                            return Err(ApiError::invalid(
                                at,
                                "invalid_value",
                                "only content parts of type \"text\" are supported",
                            ))
                        }
                    }
                }
                text
            }
            // An assistant turn may carry no content.
            None | Some(Value::Null) if role == "assistant" => String::new(),
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(
                    format!("{here}.content"),
                    "missing_required_parameter",
                    format!("{here}.content is missing"),
                ))
            }
            Some(v) => {
                return Err(ApiError::wrong_type(
                    &format!("{here}.content"),
                    "a string or an array of text parts",
                    v,
                ))
            }
        };
        out.push(ChatMessage::new(role, content));
    }
    if out.iter().all(|m| m.content.is_empty()) {
        return Err(ApiError::invalid(
            "messages",
            "invalid_value",
            "every message is empty; give some text",
        ));
    }
    Ok(out)
}

pub(super) fn read_prompt(r: &Reader<'_>) -> Result<Prompt, ApiError> {
    let empty = || {
        ApiError::invalid(
            "prompt",
            "invalid_value",
            "'prompt' is empty; give some text to continue",
        )
    };
    let one_only = || {
        ApiError::invalid(
            "prompt",
            "invalid_value",
            "batches of prompts are not supported; send one prompt per request",
        )
    };
    let Some(v) = r.get("prompt") else {
        return Err(ApiError::invalid(
            "prompt",
            "missing_required_parameter",
            "'prompt' is required: a string (or an array of token ids)",
        ));
    };
    match v {
        Value::String(s) if s.is_empty() => Err(empty()),
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) if items.is_empty() => Err(empty()),
        Value::Array(items) => match &items[0] {
            Value::String(_) if items.len() > 1 => Err(one_only()),
            Value::String(s) if s.is_empty() => Err(empty()),
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(_) if items.len() > 1 => Err(one_only()),
            Value::Array(ids) if ids.is_empty() => Err(empty()),
            Value::Array(ids) => token_ids(ids).map(Prompt::Tokens),
            Value::Number(_) => token_ids(items).map(Prompt::Tokens),
            other => Err(ApiError::wrong_type(
                "prompt",
                "a string or an array of token ids",
                other,
            )),
        },
        other => Err(ApiError::wrong_type(
            "prompt",
            "a string or an array of token ids",
            other,
        )),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "prompt",
                        "invalid_value",
                        format!(
                            "token ids must be non-negative integers, got {}",
                            json_kind(v)
                        ),
                    )
                })
        })
        .collect()
}
