//! The OpenAI wire format, responses: whole answers (one or `n` choices), streamed chunks
//! (each naming its choice's `index`) and the usage chunk of both endpoints, with
//! log-probabilities ([`LogprobEntry`]) in OpenAI's two shapes: per-token objects under
//! `logprobs.content` for chat, and the legacy parallel arrays (`tokens`, `token_logprobs`,
//! `top_logprobs`, `text_offset`) for completions. The scheduler's plain types
//! ([`Usage`], [`LogprobEntry`]) become JSON here.

use crate::http::request::Endpoint;
use crate::scheduler::Usage;
use serde_json::{json, Map, Value};
use tp_engine::{LogprobEntry, TokenInfo};

/// What is reported for a log-probability that is not a finite number (a token the model
/// rules out with a logit of -inf): OpenAI's stand-in for minus infinity.
pub const LOGPROB_FLOOR: f64 = -9999.0;

/// The `usage` object: a request's token counts (all its choices).
fn usage_json(usage: Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    })
}

/// A token's log-probability as reported: finite, [`LOGPROB_FLOOR`] at worst.
pub fn reported(t: &TokenInfo) -> f64 {
    if t.logprob.is_finite() {
        t.logprob.max(LOGPROB_FLOOR)
    } else {
        LOGPROB_FLOOR
    }
}

fn chat_json(t: &TokenInfo) -> Value {
    json!({"token": t.token, "logprob": reported(t), "bytes": t.bytes})
}

/// The `logprobs` object of a choice for `entries`, in the endpoint's shape.
pub fn logprobs_json(endpoint: Endpoint, entries: &[LogprobEntry]) -> Value {
    match endpoint {
        Endpoint::Chat => {
            let content: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let mut v = chat_json(&e.chosen);
                    v["top_logprobs"] = e.top.iter().map(chat_json).collect();
                    v
                })
                .collect();
            json!({ "content": content })
        }
        Endpoint::Completions => {
            let top: Vec<Value> = entries
                .iter()
                .map(|e| {
                    // As OpenAI: the alternatives and the chosen token (up to k + 1 entries).
                    let mut m = Map::new();
                    for t in e.top.iter().chain(std::iter::once(&e.chosen)) {
                        m.entry(t.token.clone()).or_insert(json!(reported(t)));
                    }
                    Value::Object(m)
                })
                .collect();
            json!({
                "tokens": entries.iter().map(|e| e.chosen.token.as_str()).collect::<Vec<_>>(),
                "token_logprobs": entries.iter().map(|e| reported(&e.chosen)).collect::<Vec<_>>(),
                "top_logprobs": top,
                "text_offset": entries.iter().map(|e| e.text_offset).collect::<Vec<_>>(),
            })
        }
    }
}

/// One finished choice of a whole answer.
#[derive(Clone, Copy, Debug)]
pub struct Choice<'a> {
    pub text: &'a str,
    pub finish_reason: &'a str,
    /// When log-probabilities were asked for.
    pub logprobs: Option<&'a [LogprobEntry]>,
}

/// Identity of one response: its id, creation time and model name.
#[derive(Clone, Debug)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

impl ResponseMeta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
        }
    }

    fn logprobs(&self, entries: Option<&[LogprobEntry]>) -> Value {
        entries.map_or(Value::Null, |e| logprobs_json(self.endpoint, e))
    }

    /// The whole answer (non-streaming): `choices` in order, their `index` their position.
    pub fn full(&self, choices: &[Choice<'_>], usage: Usage) -> Value {
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(index, c)| match self.endpoint {
                Endpoint::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.logprobs(c.logprobs),
                    "finish_reason": c.finish_reason,
                }),
                Endpoint::Completions => json!({
                    "index": index,
                    "text": c.text,
                    "logprobs": self.logprobs(c.logprobs),
                    "finish_reason": c.finish_reason,
                }),
            })
            .collect();
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_json(usage),
        })
    }

    /// A streamed piece of choice `index`: the opening role chunk (chat, `text` None and
    /// `role`), a text delta (with the log-probabilities of its tokens when they were asked
    /// for), or the closing chunk with `finish_reason`.
    pub fn chunk(
        &self,
        index: usize,
        role: bool,
        text: Option<&str>,
        finish_reason: Option<&str>,
        logprobs: Option<&[LogprobEntry]>,
    ) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({
                    "index": index,
                    "delta": delta,
                    "logprobs": self.logprobs(logprobs),
                    "finish_reason": finish_reason,
                })
            }
            Endpoint::Completions => json!({
                "index": index,
                "text": text.unwrap_or(""),
                "logprobs": self.logprobs(logprobs),
                "finish_reason": finish_reason,
            }),
        };
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// The usage chunk sent last when `stream_options.include_usage` is set.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage_json(usage),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_have_the_openai_shape() {
        let meta = ResponseMeta {
            id: "x".into(),
            created: 1,
            model: "m".into(),
            endpoint: Endpoint::Chat,
        };
        let c = meta.chunk(0, true, Some(""), None, None);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(c["choices"][0]["index"], 0);
        let f = meta.full(
            &[Choice {
                text: "hi",
                finish_reason: "stop",
                logprobs: None,
            }],
            Usage {
                prompt_tokens: 2,
                completion_tokens: 1,
            },
        );
        assert_eq!(f["choices"][0]["message"]["content"], "hi");
        assert_eq!(f["choices"][0]["logprobs"], Value::Null);
        assert_eq!(f["usage"]["total_tokens"], 3);
    }

    #[test]
    fn several_choices_are_indexed_and_counted_once_per_prompt() {
        let meta = ResponseMeta {
            id: "x".into(),
            created: 1,
            model: "m".into(),
            endpoint: Endpoint::Completions,
        };
        let choice = |prompt_tokens, completion_tokens| Usage {
            prompt_tokens,
            completion_tokens,
        };
        let usage = Usage::default()
            .with_choice(choice(5, 3))
            .with_choice(choice(5, 4));
        assert_eq!(usage, choice(5, 7));
        let f = meta.full(
            &[
                Choice {
                    text: "a",
                    finish_reason: "stop",
                    logprobs: None,
                },
                Choice {
                    text: "b",
                    finish_reason: "length",
                    logprobs: Some(&[]),
                },
            ],
            usage,
        );
        let c = &f["choices"];
        assert_eq!(
            (c[0]["index"].clone(), c[1]["index"].clone()),
            (json!(0), json!(1))
        );
        assert_eq!(
            (c[0]["text"].clone(), c[1]["text"].clone()),
            (json!("a"), json!("b"))
        );
        assert_eq!(c[1]["finish_reason"], "length");
        assert_eq!(c[0]["logprobs"], Value::Null);
        assert_eq!(c[1]["logprobs"]["tokens"], json!([]));
        assert_eq!(f["usage"]["total_tokens"], 12);
        assert_eq!(
            meta.chunk(1, false, Some("b"), None, None)["choices"][0]["index"],
            1
        );
    }

    fn entries() -> Vec<LogprobEntry> {
        vec![
            LogprobEntry {
                chosen: TokenInfo::new(b"h".to_vec(), -0.5),
                top: vec![
                    TokenInfo::new(b"h".to_vec(), -0.5),
                    TokenInfo::new(vec![0xe2], -1.5),
                ],
                text_offset: 0,
            },
            LogprobEntry {
                chosen: TokenInfo::new(b"i".to_vec(), f64::NEG_INFINITY),
                top: vec![],
                text_offset: 1,
            },
        ]
    }

    #[test]
    fn chat_logprobs_have_the_openai_shape() {
        let v = logprobs_json(Endpoint::Chat, &entries());
        let c = &v["content"];
        assert_eq!(c[0]["token"], "h");
        assert_eq!(c[0]["logprob"], -0.5);
        assert_eq!(c[0]["bytes"], json!([104]));
        assert_eq!(c[0]["top_logprobs"][1]["token"], "\u{FFFD}");
        assert_eq!(c[0]["top_logprobs"][1]["bytes"], json!([0xe2]));
        assert_eq!(c[1]["logprob"], LOGPROB_FLOOR);
        assert_eq!(c[1]["top_logprobs"], json!([]));
        let meta = ResponseMeta {
            id: "x".into(),
            created: 1,
            model: "m".into(),
            endpoint: Endpoint::Chat,
        };
        let e = entries();
        let chunk = meta.chunk(0, false, Some("hi"), None, Some(&e));
        assert_eq!(chunk["choices"][0]["logprobs"], v);
        let empty = meta.full(
            &[Choice {
                text: "",
                finish_reason: "stop",
                logprobs: Some(&[]),
            }],
            Usage::default(),
        );
        assert_eq!(empty["choices"][0]["logprobs"], json!({"content": []}));
    }

    #[test]
    fn completion_logprobs_have_the_legacy_shape() {
        let v = logprobs_json(Endpoint::Completions, &entries());
        assert_eq!(v["tokens"], json!(["h", "i"]));
        assert_eq!(v["token_logprobs"], json!([-0.5, LOGPROB_FLOOR]));
        assert_eq!(v["text_offset"], json!([0, 1]));
        assert_eq!(v["top_logprobs"][0], json!({"h": -0.5, "\u{FFFD}": -1.5}));
        // The chosen token is always among the alternatives.
        assert_eq!(v["top_logprobs"][1], json!({"i": LOGPROB_FLOOR}));
    }
}
