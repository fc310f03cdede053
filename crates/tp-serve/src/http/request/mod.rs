//! Request parsing, part one: the bodies of `/v1/chat/completions` and `/v1/completions`
//! read into a [`GenRequest`], checked field by field (every refusal names its parameter, as
//! vLLM and OpenAI do). [`prepare`] then tokenizes the prompt and fits it to the server's
//! limits.
//!
//! Requests are read as a `serde_json::Value` and then walked by hand rather than derived
//! with serde: a derived reader reports "invalid type at line 1 column 40", not the parameter.
//! `fields` reads single parameters, `prompt` the messages or the prompt.

mod fields;
pub mod prepare;
mod prompt;

use crate::error::{json_kind, ApiError};
use fields::{check_model, check_unsupported, read_logprobs, read_n, read_stop, Reader};
use prompt::{read_messages, read_prompt};
use serde_json::Value;
use tp_tokenizer::ChatMessage;

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
