//! Request parsing, single parameters: field access whose errors name the field, and the
//! readers of `n`, `logprobs`, `model`, `stop` and the parameters this server refuses.

use super::{Endpoint, MAX_STOPS, MAX_TOP_LOGPROBS};
use crate::error::ApiError;
use serde_json::{Map, Value};

/// `n`: an integer in `1..=max_n` (1 when absent).
pub(super) fn read_n(r: &Reader<'_>, max_n: usize) -> Result<usize, ApiError> {
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
pub(super) fn read_logprobs(r: &Reader<'_>, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
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
pub(super) struct Reader<'a>(pub(super) &'a Map<String, Value>);

impl Reader<'_> {
    pub(super) fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    pub(super) fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    pub(super) fn boolean(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::wrong_type(name, "a boolean", v)),
        }
    }

    /// An integer >= 1.
    pub(super) fn positive_int(&self, name: &str) -> Result<Option<usize>, ApiError> {
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
    pub(super) fn number_in(
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

pub(super) fn check_model(r: &Reader<'_>, served: &str) -> Result<(), ApiError> {
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

pub(super) fn read_stop(r: &Reader<'_>) -> Result<Vec<String>, ApiError> {
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
pub(super) fn check_unsupported(r: &Reader<'_>, endpoint: Endpoint) -> Result<(), ApiError> {
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
