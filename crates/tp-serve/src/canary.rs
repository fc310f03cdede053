//! The canary: prompts with the greedy continuation the model gave when the file was written
//! and the mean log-probability of that continuation's tokens. Run against the server (at
//! start and then periodically), a continuation that differs, or a mean log-probability that
//! moved by more than a threshold, is drift: an alarm on `/metrics` (`tp_canary_drift`), on
//! the dashboard, and a log line.
//!
//! The file is JSON Lines, one case a line:
//! `{"prompt": "...", "expected": "...", "mean_logprob": -0.42, "max_tokens": 16}`; blank
//! lines and lines starting with `#` are skipped. [`record`] writes one from a running
//! server. The canary talks to the server over HTTP like any client, so it checks what
//! clients get.

use crate::client::Client;
use crate::metrics::Metrics;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// One prompt and what the model answered when the canary was written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CanaryCase {
    pub prompt: String,
    pub expected: String,
    pub mean_logprob: f64,
    pub max_tokens: usize,
}

/// A canary file's cases.
#[derive(Clone, Debug, PartialEq)]
pub struct Canary {
    pub cases: Vec<CanaryCase>,
}

/// What is wrong with a canary file.
#[derive(Debug, Error)]
pub enum CanaryError {
    #[error("cannot read the canary file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}, line {line}: {message}")]
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{path} holds no canary case; write one per line as {{\"prompt\", \"expected\", \"mean_logprob\", \"max_tokens\"}}")]
    Empty { path: PathBuf },
}

/// Settings of the periodic canary.
#[derive(Clone, Debug)]
pub struct CanaryConfig {
    pub canary: Canary,
    /// Between two runs (the first runs as soon as the server is up).
    pub interval: Duration,
    /// Largest shift of a case's mean log-probability (nats per token) that is not drift.
    pub threshold: f64,
}

/// The default threshold: a mean log-probability shift of 0.1 nats per token.
pub const DEFAULT_THRESHOLD: f64 = 0.1;

impl Canary {
    /// Parses a canary file's text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Canary, CanaryError> {
        let mut cases = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let t = line.trim();
            if t.is_empty() || t.starts_with('#') {
                continue;
            }
            let bad = |message: String| CanaryError::Line {
                path: path.to_path_buf(),
                line: i + 1,
                message,
            };
            let case: CanaryCase = serde_json::from_str(t).map_err(|e| {
                bad(format!(
                    "not a canary case ({e}); expected {{\"prompt\": text, \"expected\": text, \"mean_logprob\": number, \"max_tokens\": number}}"
                ))
            })?;
            if case.max_tokens == 0 {
                return Err(bad("max_tokens must be at least 1".into()));
            }
            if !case.mean_logprob.is_finite() || case.mean_logprob > 0.0 {
                return Err(bad(format!(
                    "mean_logprob {} is not a log-probability (a number at most 0)",
                    case.mean_logprob
                )));
            }
            cases.push(case);
        }
        if cases.is_empty() {
            return Err(CanaryError::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(Canary { cases })
    }

    /// Reads and parses a canary file.
    pub fn load(path: &Path) -> Result<Canary, CanaryError> {
        let text = std::fs::read_to_string(path).map_err(|source| CanaryError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Canary::parse(&text, path)
    }

    /// The file's text.
    pub fn to_jsonl(&self) -> String {
        let mut out = String::new();
        for c in &self.cases {
            out.push_str(&serde_json::to_string(c).unwrap_or_default());
            out.push('\n');
        }
        out
    }
}

/// The completions endpoint of the live model.
pub const LIVE: &str = "/v1/completions";

/// The completions endpoint of held model `id` (the admin routes: a candidate's canary).
pub fn held_endpoint(id: u32) -> String {
    format!("/admin/models/{id}/v1/completions")
}

/// One case's greedy continuation and mean log-probability from `endpoint` of the server.
fn ask(
    c: &Client,
    endpoint: &str,
    prompt: &str,
    max_tokens: usize,
) -> Result<(String, f64), String> {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 1});
    let r = c
        .post_json(endpoint, &body)
        .map_err(|e| format!("the canary request failed: {e}"))?;
    if r.status != 200 {
        return Err(format!("the canary request got {}: {}", r.status, r.text()));
    }
    let v = r.json();
    let choice = &v["choices"][0];
    let text = choice["text"].as_str().unwrap_or_default().to_string();
    let lps: Vec<f64> = choice["logprobs"]["token_logprobs"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        .unwrap_or_default();
    let mean = if lps.is_empty() {
        0.0
    } else {
        lps.iter().sum::<f64>() / lps.len() as f64
    };
    Ok((text, mean))
}

/// Writes a canary from the server behind `c`: each prompt's greedy continuation of at most
/// `max_tokens` tokens.
pub fn record(c: &Client, prompts: &[String], max_tokens: usize) -> Result<Canary, String> {
    let mut cases = Vec::new();
    for p in prompts {
        let (expected, mean_logprob) = ask(c, LIVE, p, max_tokens)?;
        cases.push(CanaryCase {
            prompt: p.clone(),
            expected,
            mean_logprob,
            max_tokens,
        });
    }
    Ok(Canary { cases })
}

/// The prompts of a canary written without a prompt file.
pub const DEFAULT_PROMPTS: &[&str] = &[
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "In 1969, astronauts",
    "To make a cup of tea, first",
];

/// What one run of the canary found.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    pub passed: bool,
    pub cases: usize,
    /// Cases whose continuation differs from the expected one.
    pub mismatches: usize,
    /// Largest shift of a case's mean log-probability.
    pub max_shift: f64,
    /// What failed, in words (empty when it passed).
    pub detail: String,
}

/// Runs every case against the live model of the server behind `c`.
pub fn run(c: &Client, canary: &Canary, threshold: f64) -> Verdict {
    run_at(c, LIVE, canary, threshold)
}

/// Runs every case against `endpoint` (a completions endpoint) of the server behind `c`.
pub fn run_at(c: &Client, endpoint: &str, canary: &Canary, threshold: f64) -> Verdict {
    let mut mismatches = 0;
    let mut max_shift = 0f64;
    let mut detail = Vec::new();
    for (i, case) in canary.cases.iter().enumerate() {
        match ask(c, endpoint, &case.prompt, case.max_tokens) {
            Ok((text, mean)) => {
                let shift = (mean - case.mean_logprob).abs();
                max_shift = max_shift.max(shift);
                if text != case.expected {
                    mismatches += 1;
                    detail.push(format!(
                        "case {} ({:?}): got {text:?}, expected {:?}",
                        i + 1,
                        case.prompt,
                        case.expected
                    ));
                } else if shift > threshold {
                    detail.push(format!(
                        "case {} ({:?}): mean logprob {mean:.4}, expected {:.4} (shift {shift:.4} > {threshold})",
                        i + 1,
                        case.prompt,
                        case.mean_logprob
                    ));
                }
            }
            Err(e) => {
                mismatches += 1;
                detail.push(format!("case {}: {e}", i + 1));
            }
        }
    }
    Verdict {
        passed: detail.is_empty(),
        cases: canary.cases.len(),
        mismatches,
        max_shift,
        detail: detail.join("; "),
    }
}

/// Each held model's canary (a reload may bring the new model's own); a model without one
/// is checked with the server's.
#[derive(Debug, Default)]
pub struct Canaries(std::sync::Mutex<std::collections::BTreeMap<u32, Canary>>);

impl Canaries {
    /// Model `id`'s canary from now on.
    pub fn set(&self, id: u32, canary: Canary) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, canary);
    }

    /// Model `id`'s canary, else `fallback`.
    pub fn of(&self, id: u32, fallback: &Canary) -> Canary {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .unwrap_or(fallback)
            .clone()
    }
}

/// Runs the live model's canary now and then every `interval` until `stop` sends or hangs
/// up; each run sets the drift alarm (metrics and dashboard) and logs a failure. A failure on
/// a model that went live by a switch asks `rollback` to go back to the previous model.
pub(crate) fn monitor(
    c: Client,
    cfg: CanaryConfig,
    canaries: Arc<Canaries>,
    metrics: Arc<Metrics>,
    rollback: impl Fn(String),
    stop: Receiver<()>,
) {
    loop {
        let live = metrics.board.live_model();
        let v = run(&c, &canaries.of(live, &cfg.canary), cfg.threshold);
        if matches!(
            stop.try_recv(),
            Err(std::sync::mpsc::TryRecvError::Disconnected)
        ) {
            // The server is stopping: its refusals say nothing about the model.
            return;
        }
        if metrics.board.live_model() != live {
            // A switch during the run: the answers came from two models.
            continue;
        }
        metrics.canary_ran(&v);
        if !v.passed {
            eprintln!(
                "# tp serve: canary drift alarm on model {live}: {} of {} cases differ, largest mean-logprob shift {:.4}: {}",
                v.mismatches, v.cases, v.max_shift, v.detail
            );
            rollback(format!("the canary failed: {}", v.detail));
        }
        match stop.recv_timeout(cfg.interval) {
            Err(RecvTimeoutError::Timeout) => continue,
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_line_is_named() {
        let p = Path::new("c.jsonl");
        let good = r#"{"prompt": "a", "expected": "b", "mean_logprob": -0.5, "max_tokens": 4}"#;
        let c = Canary::parse(&format!("# header\n{good}\n\n{good}\n"), p).unwrap();
        assert_eq!(c.cases.len(), 2);
        assert_eq!(Canary::parse(&c.to_jsonl(), p).unwrap(), c);
        for (text, line, words) in [
            (format!("{good}\n{{\"prompt\": 1}}"), 2, "not a canary case"),
            (format!("{good}\n\nnot json"), 3, "not a canary case"),
            (good.replace("-0.5", "0.5"), 1, "not a log-probability"),
            (
                good.replace("\"max_tokens\": 4", "\"max_tokens\": 0"),
                1,
                "at least 1",
            ),
            (good.replace('}', ", \"extra\": 1}"), 1, "unknown field"),
        ] {
            let e = Canary::parse(&text, p).unwrap_err();
            let s = e.to_string();
            assert!(
                matches!(e, CanaryError::Line { line: l, .. } if l == line),
                "{text}: {s}"
            );
            assert!(s.contains(&format!("c.jsonl, line {line}: ")), "{s}");
            assert!(s.contains(words), "{s}");
        }
        assert!(matches!(
            Canary::parse("# nothing\n", p),
            Err(CanaryError::Empty { .. })
        ));
    }
}
