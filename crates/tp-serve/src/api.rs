//! The OpenAI wire format, requests: bodies of `/v1/chat/completions` and `/v1/completions`
//! checked field by field (every refusal names its parameter, as vLLM and OpenAI do).
//!
//! Requests are read as a `serde_json::Value` and then walked by hand rather than derived
//! with serde: a derived reader reports "invalid type at line 1 column 40", not the parameter.
//!
//! The response bodies are built in [`crate::response`], re-exported here.

use crate::error::{json_kind, ApiError};
use serde_json::{Map, Value};
use tp_tokenizer::ChatMessage;

pub use crate::response::{
    logprobs_json, Choice, LogprobEntry, ResponseMeta, TokenInfo, Usage, LOGPROB_FLOOR,
};

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "completions",
        }
    }
}

/// What the model is asked to continue.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Chat messages, rendered with the model's chat template.
    Chat(Vec<ChatMessage>),
    /// Plain text to continue.
    Text(String),
    /// Token ids to continue (`prompt` given as an array of integers).
    Tokens(Vec<u32>),
}

/// A validated generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    pub prompt: Prompt,
    /// `None`: as many as the context allows (chat) or 16 (completions, OpenAI's default).
    pub max_tokens: Option<usize>,
    /// Which parameter `max_tokens` came from (`max_tokens` or `max_completion_tokens`).
    pub max_tokens_param: &'static str,
    pub temperature: f32,
    pub top_p: f32,
    /// 0: all tokens (an extension, as in vLLM).
    pub top_k: usize,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Keep generating past end-of-sequence tokens (an extension, as in vLLM; for benchmarks).
    pub ignore_eos: bool,
    /// Report log-probabilities: `Some(k)` with the `k` most likely alternatives per token
    /// (chat: `logprobs: true` and `top_logprobs: k`; completions: `logprobs: k`).
    pub logprobs: Option<usize>,
    /// OpenAI's penalties in [-2, 2], over the tokens generated so far.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Choices to generate for the prompt, 1..=the server's limit (each its own sequence;
    /// the scheduler computes their shared prompt once).
    pub n: usize,
}

/// Most choices one request may ask for (`n`) unless the server is set otherwise.
pub const DEFAULT_MAX_N: usize = 8;

/// Most stop sequences a request may give (OpenAI's limit).
pub const MAX_STOPS: usize = 4;

/// Most alternatives per token: chat `top_logprobs` (OpenAI's limit) and completions
/// `logprobs` (OpenAI allows 5; 20 is accepted as vLLM does).
pub const MAX_TOP_LOGPROBS: usize = tp_engine::MAX_TOP_LOGPROBS;

/// Reads a request body: UTF-8, JSON, an object, then each parameter. `max_n` is the most
/// choices (`n`) the server gives one request.
pub fn parse_request(
    endpoint: Endpoint,
    body: &[u8],
    served_model: &str,
    max_n: usize,
) -> Result<GenRequest, ApiError> {
    let text = std::str::from_utf8(body).map_err(|e| {
        ApiError::bad_body(
            "invalid_encoding",
            format!(
                "the request body is not valid UTF-8 (bad byte at offset {}); send JSON encoded as UTF-8",
                e.valid_up_to()
            ),
        )
    })?;
    if text.trim().is_empty() {
        return Err(ApiError::bad_body(
            "invalid_json",
            "the request body is empty; send a JSON object",
        ));
    }
    let value: Value = serde_json::from_str(text).map_err(|e| {
        ApiError::bad_body(
            "invalid_json",
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    let Value::Object(obj) = value else {
        return Err(ApiError::bad_body(
            "invalid_json",
            format!(
                "the request body must be a JSON object, not {}",
                json_kind(&value)
            ),
        ));
    };
    let r = Reader(&obj);
    check_model(&r, served_model)?;
    let prompt = match endpoint {
        Endpoint::Chat => Prompt::Chat(read_messages(&r)?),
        Endpoint::Completions => read_prompt(&r)?,
    };
    let (max_tokens, max_tokens_param) = match endpoint {
        Endpoint::Chat if r.has("max_completion_tokens") => (
            r.positive_int("max_completion_tokens")?,
            "max_completion_tokens",
        ),
        _ => (r.positive_int("max_tokens")?, "max_tokens"),
    };
    let temperature = r
        .number_in("temperature", 0.0, 2.0, true, "[0, 2]")?
        .unwrap_or(1.0);
    let top_p = r
        .number_in("top_p", 0.0, 1.0, false, "(0, 1]")?
        .unwrap_or(1.0);
    let top_k = match r.get("top_k") {
        None => 0,
        Some(v) => match v.as_i64() {
            Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    "invalid_value",
                    format!("top_k is {k}; use a positive count, or 0 or -1 for all tokens"),
                ))
            }
            None => return Err(ApiError::wrong_type("top_k", "an integer", v)),
        },
    };
    let n = read_n(&r, max_n)?;
    if let Some(v) = r.get("best_of") {
        match v.as_i64() {
            Some(1) => {}
            Some(n) => {
                return Err(ApiError::invalid(
                    "best_of",
                    "invalid_value",
                    format!("best_of is {n}; only 1 is supported"),
                ))
            }
            None => return Err(ApiError::wrong_type("best_of", "an integer", v)),
        }
    }
    let seed = match r.get("seed") {
        None => None,
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(s), _) => Some(s),
            // Negative seeds are valid for OpenAI: keep their bits.
            (None, Some(s)) => Some(s as u64),
            _ => return Err(ApiError::wrong_type("seed", "an integer", v)),
        },
    };
    let stop = read_stop(&r)?;
    let stream = r.boolean("stream")?.unwrap_or(false);
    let include_usage = match r.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "invalid_value",
                    "stream_options is only allowed with stream: true",
                ));
            }
            Reader(o)
                .boolean("include_usage")
                .map_err(|e| ApiError {
                    param: Some("stream_options.include_usage".into()),
                    ..e
                })?
                .unwrap_or(false)
        }
        Some(v) => return Err(ApiError::wrong_type("stream_options", "an object", v)),
    };
    let ignore_eos = r.boolean("ignore_eos")?.unwrap_or(false);
    let presence_penalty = r
        .number_in("presence_penalty", -2.0, 2.0, true, "[-2, 2]")?
        .unwrap_or(0.0);
    let frequency_penalty = r
        .number_in("frequency_penalty", -2.0, 2.0, true, "[-2, 2]")?
        .unwrap_or(0.0);
    let logprobs = read_logprobs(&r, endpoint)?;
    check_unsupported(&r, endpoint)?;
    Ok(GenRequest {
        endpoint,
        prompt,
        max_tokens,
        max_tokens_param,
        temperature,
        top_p,
        top_k,
        seed,
        stop,
        stream,
        include_usage,
        ignore_eos,
        logprobs,
        presence_penalty,
        frequency_penalty,
        n,
    })
}

/// `n`: an integer in `1..=max_n` (1 when absent).
fn read_n(r: &Reader<'_>, max_n: usize) -> Result<usize, ApiError> {
    let Some(v) = r.get("n") else {
        return Ok(1);
    };
    let out_of_range = |shown: &dyn std::fmt::Display| {
        ApiError::invalid(
            "n",
            "invalid_value",
            format!("n is {shown}; it must be in [1, {max_n}] (this server returns at most {max_n} choices per request)"),
        )
    };
    match (v.as_u64(), v.as_i64()) {
        (Some(n), _) => match usize::try_from(n) {
            Ok(n) if (1..=max_n).contains(&n) => Ok(n),
            _ => Err(out_of_range(&n)),
        },
        (None, Some(n)) => Err(out_of_range(&n)),
        _ => Err(ApiError::wrong_type("n", "an integer", v)),
    }
}

/// `logprobs` and `top_logprobs`: `None` when no log-probabilities are asked for.
fn read_logprobs(r: &Reader<'_>, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
    let count = |name: &str, v: &Value| match (v.as_u64(), v.as_i64()) {
        (Some(k), _) if k <= MAX_TOP_LOGPROBS as u64 => Ok(k as usize),
        (Some(k), _) => Err(ApiError::invalid(
            name,
            "invalid_value",
            format!("{name} is {k}; it must be in [0, {MAX_TOP_LOGPROBS}]"),
        )),
        (None, Some(k)) => Err(ApiError::invalid(
            name,
            "invalid_value",
            format!("{name} is {k}; it must be in [0, {MAX_TOP_LOGPROBS}]"),
        )),
        _ => Err(ApiError::wrong_type(name, "an integer", v)),
    };
    match endpoint {
        Endpoint::Chat => {
            let on = r.boolean("logprobs")?.unwrap_or(false);
            let top = match r.get("top_logprobs") {
                None => None,
                Some(v) => Some(count("top_logprobs", v)?),
            };
            if top.is_some() && !on {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "invalid_value",
                    "top_logprobs needs logprobs: true",
                ));
            }
            Ok(on.then(|| top.unwrap_or(0)))
        }
        Endpoint::Completions => match r.get("logprobs") {
            None => Ok(None),
            Some(v) => count("logprobs", v).map(Some),
        },
    }
}

/// Field access with errors that name the field. `null` counts as absent, as in OpenAI's API.
struct Reader<'a>(&'a Map<String, Value>);

impl Reader<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    fn boolean(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::wrong_type(name, "a boolean", v)),
        }
    }

    /// An integer >= 1.
    fn positive_int(&self, name: &str) -> Result<Option<usize>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        match (v.as_u64(), v.as_i64()) {
            (Some(n), _) if n >= 1 => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
            (Some(n), _) => Err(Self::below_one(name, n as i64)),
            (None, Some(n)) => Err(Self::below_one(name, n)),
            _ => Err(ApiError::wrong_type(name, "an integer", v)),
        }
    }

    fn below_one(name: &str, n: i64) -> ApiError {
        ApiError::invalid(
            name,
            "invalid_value",
            format!("{name} is {n}; it must be at least 1"),
        )
    }

    /// A finite number in `[lo, hi]` (`(lo, hi]` unless `lo_inclusive`).
    fn number_in(
        &self,
        name: &str,
        lo: f64,
        hi: f64,
        lo_inclusive: bool,
        range: &str,
    ) -> Result<Option<f32>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let Some(x) = v.as_f64() else {
            return Err(ApiError::wrong_type(name, "a number", v));
        };
        let above_lo = if lo_inclusive { x >= lo } else { x > lo };
        if !x.is_finite() || !above_lo || x > hi {
            return Err(ApiError::invalid(
                name,
                "invalid_value",
                format!("{name} is {x}; it must be in {range}"),
            ));
        }
        Ok(Some(x as f32))
    }
}

fn check_model(r: &Reader<'_>, served: &str) -> Result<(), ApiError> {
    match r.get("model") {
        None => Ok(()),
        Some(Value::String(m)) if m == served => Ok(()),
        Some(Value::String(m)) => Err(ApiError {
            status: 404,
            message: format!(
                "the model '{m}' does not exist on this server; it serves '{served}' (or omit 'model')"
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }),
        Some(v) => Err(ApiError::wrong_type("model", "a string", v)),
    }
}

fn read_messages(r: &Reader<'_>) -> Result<Vec<ChatMessage>, ApiError> {
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

fn read_prompt(r: &Reader<'_>) -> Result<Prompt, ApiError> {
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

fn read_stop(r: &Reader<'_>) -> Result<Vec<String>, ApiError> {
    let stops = match r.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            let mut out = Vec::new();
            for (i, s) in items.iter().enumerate() {
                match s {
                    Value::String(s) => out.push(s.clone()),
                    v => return Err(ApiError::wrong_type(&format!("stop[{i}]"), "a string", v)),
                }
            }
            out
        }
        Some(v) => {
            return Err(ApiError::wrong_type(
                "stop",
                "a string or an array of strings",
                v,
            ))
        }
    };
    if stops.len() > MAX_STOPS {
        return Err(ApiError::invalid(
            "stop",
            "invalid_value",
            format!(
                "{} stop sequences given; at most {MAX_STOPS} are allowed",
                stops.len()
            ),
        ));
    }
    Ok(stops)
}

/// Parameters this server cannot honour: refused rather than silently ignored.
fn check_unsupported(r: &Reader<'_>, endpoint: Endpoint) -> Result<(), ApiError> {
    let unsupported = |name: &str, why: &str| {
        Err(ApiError::invalid(
            name,
            "unsupported_parameter",
            format!("'{name}' is not supported by this server: {why}"),
        ))
    };
    if endpoint == Endpoint::Completions && r.has("top_logprobs") {
        return unsupported(
            "top_logprobs",
            "for completions, give the number of alternatives as 'logprobs'",
        );
    }
    if let Some(Value::Object(o)) = r.get("logit_bias") {
        if !o.is_empty() {
            return unsupported("logit_bias", "logits are not biased");
        }
    }
    if let Some(Value::Array(t)) = r.get("tools") {
        if !t.is_empty() {
            return unsupported("tools", "no tool calling");
        }
    }
    if r.has("functions") {
        return unsupported("functions", "no function calling");
    }
    if let Some(v) = r.get("response_format") {
        let kind = v.get("type").and_then(Value::as_str);
        if kind != Some("text") {
            return unsupported("response_format", "only {\"type\": \"text\"} is produced");
        }
    }
    if endpoint == Endpoint::Completions {
        if r.boolean("echo")?.unwrap_or(false) {
            return unsupported("echo", "the prompt is not echoed");
        }
        if let Some(Value::String(s)) = r.get("suffix") {
            if !s.is_empty() {
                return unsupported("suffix", "no insertion mode");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<GenRequest, ApiError> {
        parse_request(Endpoint::Chat, body.as_bytes(), "m", DEFAULT_MAX_N)
    }

    fn completion(body: &str) -> Result<GenRequest, ApiError> {
        parse_request(Endpoint::Completions, body.as_bytes(), "m", DEFAULT_MAX_N)
    }

    fn param_of(r: Result<GenRequest, ApiError>) -> Option<String> {
        let e = r.expect_err("should be refused");
        assert!(e.status == 400 || e.status == 404, "{e:?}");
        e.param
    }

    #[test]
    fn a_plain_chat_request_reads_with_defaults() {
        let r = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Chat(vec![ChatMessage::new("user", "hi")]));
        assert_eq!((r.max_tokens, r.temperature, r.top_p), (None, 1.0, 1.0));
        assert!(!r.stream && r.stop.is_empty() && r.seed.is_none());
        let r = chat(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
                "max_completion_tokens":5,"temperature":0,"top_p":0.5,"seed":-1,"stop":"x",
                "stream":true,"stream_options":{"include_usage":true},"n":1}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Chat(vec![ChatMessage::new("user", "ab")]));
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.max_tokens_param, "max_completion_tokens");
        assert_eq!(r.seed, Some(u64::MAX));
        assert_eq!(r.stop, vec!["x".to_string()]);
        assert!(r.stream && r.include_usage);
    }

    #[test]
    fn completion_prompts_of_every_shape() {
        assert_eq!(
            completion(r#"{"prompt":"abc"}"#).unwrap().prompt,
            Prompt::Text("abc".into())
        );
        assert_eq!(
            completion(r#"{"prompt":["abc"]}"#).unwrap().prompt,
            Prompt::Text("abc".into())
        );
        assert_eq!(
            completion(r#"{"prompt":[1,2,3]}"#).unwrap().prompt,
            Prompt::Tokens(vec![1, 2, 3])
        );
        assert_eq!(
            completion(r#"{"prompt":[[4]]}"#).unwrap().prompt,
            Prompt::Tokens(vec![4])
        );
        for bad in [
            r#"{"prompt":""}"#,
            r#"{"prompt":[]}"#,
            r#"{"prompt":["a","b"]}"#,
            r#"{"prompt":[-1]}"#,
            r#"{"prompt":5}"#,
            r#"{}"#,
        ] {
            assert_eq!(
                param_of(completion(bad)).as_deref(),
                Some("prompt"),
                "{bad}"
            );
        }
    }

    #[test]
    fn every_bad_parameter_is_named() {
        let m = r#""messages":[{"role":"user","content":"hi"}]"#;
        for (extra, param) in [
            (r#""max_tokens":0"#, "max_tokens"),
            (r#""max_tokens":-5"#, "max_tokens"),
            (r#""max_tokens":"10""#, "max_tokens"),
            (r#""max_tokens":1.5"#, "max_tokens"),
            (r#""temperature":2.5"#, "temperature"),
            (r#""temperature":-0.1"#, "temperature"),
            (r#""temperature":"hot""#, "temperature"),
            (r#""top_p":0"#, "top_p"),
            (r#""top_p":1.01"#, "top_p"),
            (r#""n":9"#, "n"),
            (r#""n":"one""#, "n"),
            (r#""seed":"x""#, "seed"),
            (r#""stop":5"#, "stop"),
            (r#""stop":["a","b","c","d","e"]"#, "stop"),
            (r#""stop":[1]"#, "stop[0]"),
            (r#""stream":"yes""#, "stream"),
            (
                r#""stream_options":{"include_usage":true}"#,
                "stream_options",
            ),
            (r#""model":"other""#, "model"),
            (r#""model":7"#, "model"),
            (r#""presence_penalty":2.01"#, "presence_penalty"),
            (r#""presence_penalty":"x""#, "presence_penalty"),
            (r#""frequency_penalty":-3"#, "frequency_penalty"),
            (r#""frequency_penalty":[]"#, "frequency_penalty"),
            (r#""logprobs":1"#, "logprobs"),
            (r#""top_logprobs":2"#, "top_logprobs"),
            (r#""logprobs":false,"top_logprobs":2"#, "top_logprobs"),
            (r#""logprobs":true,"top_logprobs":21"#, "top_logprobs"),
            (r#""logprobs":true,"top_logprobs":-1"#, "top_logprobs"),
            (r#""logprobs":true,"top_logprobs":1.5"#, "top_logprobs"),
            (r#""top_k":-3"#, "top_k"),
        ] {
            let body = format!("{{{m},{extra}}}");
            assert_eq!(param_of(chat(&body)).as_deref(), Some(param), "{body}");
        }
        for (body, param) in [
            (r#"{"messages":[]}"#, "messages"),
            (r#"{"messages":"hi"}"#, "messages"),
            (r#"{}"#, "messages"),
            (r#"{"messages":[5]}"#, "messages[0]"),
            (r#"{"messages":[{"content":"x"}]}"#, "messages[0].role"),
            (r#"{"messages":[{"role":"user"}]}"#, "messages[0].content"),
            (
                r#"{"messages":[{"role":"user","content":7}]}"#,
                "messages[0].content",
            ),
            (r#"{"messages":[{"role":"user","content":""}]}"#, "messages"),
        ] {
            assert_eq!(param_of(chat(body)).as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn n_is_an_integer_up_to_the_servers_limit() {
        let m = r#""messages":[{"role":"user","content":"hi"}]"#;
        assert_eq!(chat(&format!("{{{m}}}")).unwrap().n, 1);
        assert_eq!(chat(&format!(r#"{{{m},"n":null}}"#)).unwrap().n, 1);
        assert_eq!(chat(&format!(r#"{{{m},"n":1}}"#)).unwrap().n, 1);
        assert_eq!(chat(&format!(r#"{{{m},"n":8}}"#)).unwrap().n, 8);
        // Greedy choices are allowed (they are then identical, as with OpenAI).
        let r = completion(r#"{"prompt":"a","n":3,"temperature":0}"#).unwrap();
        assert_eq!((r.n, r.temperature), (3, 0.0));
        for bad in [
            "0",
            "9",
            "-1",
            "\"x\"",
            "2.5",
            "true",
            "18446744073709551615",
        ] {
            let e = chat(&format!(r#"{{{m},"n":{bad}}}"#)).expect_err(bad);
            assert_eq!((e.status, e.param.as_deref()), (400, Some("n")), "{bad}");
            if !bad.starts_with('"') && bad != "2.5" && bad != "true" {
                assert!(e.message.contains("[1, 8]"), "{bad}: {}", e.message);
            }
        }
        // The limit is the server's.
        let body = format!(r#"{{{m},"n":3}}"#);
        let e = parse_request(Endpoint::Chat, body.as_bytes(), "m", 2).unwrap_err();
        assert!(e.message.contains("at most 2 choices"), "{}", e.message);
        assert_eq!(
            parse_request(Endpoint::Chat, body.as_bytes(), "m", 3).map(|r| r.n),
            Ok(3)
        );
    }

    #[test]
    fn bodies_that_are_not_json_objects_are_refused() {
        for body in [&b"{\"messages\": [\xff]}"[..], b"", b"{", b"[1]", b"null"] {
            let e = parse_request(Endpoint::Chat, body, "m", DEFAULT_MAX_N).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.param.is_none());
        }
        let e = parse_request(Endpoint::Chat, b"\xc3\x28", "m", DEFAULT_MAX_N).unwrap_err();
        assert!(e.message.contains("UTF-8"), "{}", e.message);
    }

    #[test]
    fn logprobs_and_penalties_are_read() {
        let m = r#""messages":[{"role":"user","content":"hi"}]"#;
        let r = chat(&format!("{{{m}}}")).unwrap();
        assert_eq!(r.logprobs, None);
        assert_eq!((r.presence_penalty, r.frequency_penalty), (0.0, 0.0));
        let r = chat(&format!(r#"{{{m},"logprobs":true}}"#)).unwrap();
        assert_eq!(r.logprobs, Some(0));
        let r = chat(&format!(
            r#"{{{m},"logprobs":true,"top_logprobs":20,"presence_penalty":-2,"frequency_penalty":1.5}}"#
        ))
        .unwrap();
        assert_eq!(r.logprobs, Some(20));
        assert_eq!((r.presence_penalty, r.frequency_penalty), (-2.0, 1.5));
        let r = chat(&format!(r#"{{{m},"logprobs":false,"top_logprobs":null}}"#)).unwrap();
        assert_eq!(r.logprobs, None);
        assert_eq!(completion(r#"{"prompt":"a"}"#).unwrap().logprobs, None);
        assert_eq!(
            completion(r#"{"prompt":"a","logprobs":0}"#)
                .unwrap()
                .logprobs,
            Some(0)
        );
        assert_eq!(
            completion(r#"{"prompt":"a","logprobs":5}"#)
                .unwrap()
                .logprobs,
            Some(5)
        );
        for (body, param) in [
            (r#"{"prompt":"a","logprobs":21}"#, "logprobs"),
            (r#"{"prompt":"a","logprobs":-1}"#, "logprobs"),
            (r#"{"prompt":"a","logprobs":true}"#, "logprobs"),
            (
                r#"{"prompt":"a","logprobs":1,"top_logprobs":1}"#,
                "top_logprobs",
            ),
            (
                r#"{"prompt":"a","frequency_penalty":-2.5}"#,
                "frequency_penalty",
            ),
        ] {
            assert_eq!(param_of(completion(body)).as_deref(), Some(param), "{body}");
        }
    }
}
