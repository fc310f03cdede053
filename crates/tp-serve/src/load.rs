//! A load generator for a running server (what `tp bench serve` measures): streaming
//! completion requests from `c` concurrent clients, each a shared system prompt (optional)
//! and a distinct prompt (about a token per word, or an edit of a piece of code), with time
//! to first token, time per output token and output throughput per level.

use crate::client::Client;
use serde_json::json;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// What every request of a level looks like.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    /// Approximate prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens generated per request (end-of-sequence ignored).
    pub gen_tokens: usize,
    /// Tokens of a system prompt every request begins with (0: none).
    pub system_prompt_tokens: usize,
    pub prompts: Prompts,
}

/// What the requests ask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prompts {
    /// Distinct runs of words, about `prompt_tokens` each.
    Words,
    /// A piece of Python code (`tp_engine::bench_spec::EDIT_SOURCE`) to print again with a
    /// variable renamed (a name distinct per request): an answer that mostly copies its
    /// prompt, where speculative decoding's drafts are accepted; `prompt_tokens` is unused.
    Edit,
}

impl Prompts {
    pub fn name(self) -> &'static str {
        match self {
            Prompts::Words => "words",
            Prompts::Edit => "edit",
        }
    }
}

/// Why a level could not be measured.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot talk to the server: {0}")]
    Io(#[from] std::io::Error),
    #[error("the server answered {0}")]
    Status(u16),
    #[error("the server failed the request: {0}")]
    Failed(String),
    #[error("the server sent an unreadable event: {0}")]
    Json(#[from] serde_json::Error),
    #[error("the stream carried no text")]
    NoText,
    #[error("a client thread panicked")]
    Panicked,
}

/// One request's timings.
pub struct Sample {
    /// Seconds to the first text.
    pub ttft: f64,
    /// Seconds per output token after the first (with at least two tokens).
    pub tpot: Option<f64>,
    pub tokens: usize,
}

/// One level's figures.
pub struct Level {
    pub concurrency: usize,
    pub requests: usize,
    /// Output tokens of all requests.
    pub tokens: usize,
    /// Seconds from the first request to the last answer.
    pub wall: f64,
    pub ttft: Vec<f64>,
    pub tpot: Vec<f64>,
}

impl Level {
    /// Output tokens per second.
    pub fn throughput(&self) -> f64 {
        self.tokens as f64 / self.wall.max(1e-9)
    }
}

const WORDS: &[&str] = &[
    "river", "market", "city", "song", "letter", "harbor", "mountain", "garden", "lantern",
    "engine", "forest", "bridge", "window", "story", "winter", "island",
];

/// Runs `requests` streaming requests with `c` clients at a time.
pub fn drive(client: &Client, c: usize, requests: usize, w: &Workload) -> Result<Level, LoadError> {
    let next = AtomicUsize::new(0);
    let t0 = Instant::now();
    let results: Vec<Result<Vec<Sample>, LoadError>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..c)
            .map(|_| {
                let client = client.clone();
                let next = &next;
                s.spawn(move || -> Result<Vec<Sample>, LoadError> {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= requests {
                            return Ok(out);
                        }
                        out.push(one_request(&client, i + 1, w, w.gen_tokens)?);
                    }
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or(Err(LoadError::Panicked)))
            .collect()
    });
    let wall = t0.elapsed().as_secs_f64();
    let mut level = Level {
        concurrency: c,
        requests,
        tokens: 0,
        wall,
        ttft: Vec::new(),
        tpot: Vec::new(),
    };
    for r in results {
        for s in r? {
            level.tokens += s.tokens;
            level.ttft.push(s.ttft);
            level.tpot.extend(s.tpot);
        }
    }
    Ok(level)
}

/// One streamed completion of `gen` tokens: the shared system prompt, then a distinct prompt
/// of about `w.prompt_tokens` tokens.
pub fn one_request(
    client: &Client,
    i: usize,
    w: &Workload,
    gen: usize,
) -> Result<Sample, LoadError> {
    // About one token per word with a leading space.
    let mut prompt = String::new();
    if w.system_prompt_tokens > 0 {
        prompt.push_str("System:");
        for k in 0..w.system_prompt_tokens.saturating_sub(2) {
            prompt.push(' ');
            prompt.push_str(WORDS[(k * 5) % WORDS.len()]);
        }
        prompt.push('\n');
    }
    match w.prompts {
        Prompts::Words => {
            prompt.push_str(&format!("Request {i}:"));
            for k in 0..w.prompt_tokens.saturating_sub(3) {
                prompt.push(' ');
                prompt.push_str(WORDS[(i * 7 + k * 3) % WORDS.len()]);
            }
        }
        Prompts::Edit => prompt.push_str(&format!(
            "```python\n{}```\n\nThe same code with the variable `records` renamed to `rows{i}`, nothing else changed:\n\n```python\n",
            tp_engine::bench_spec::EDIT_SOURCE
        )),
    }
    let body = json!({
        "prompt": prompt,
        "max_tokens": gen,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let t0 = Instant::now();
    let mut s = client.stream("/v1/completions", &body)?;
    if s.status != 200 {
        return Err(LoadError::Status(s.status));
    }
    let mut first: Option<Instant> = None;
    let mut last = t0;
    let mut tokens = 0;
    while let Some(data) = s.next_data()? {
        if data == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(&data)?;
        if let Some(e) = v.get("error") {
            return Err(LoadError::Failed(e.to_string()));
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n as usize;
        }
        if v["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
        {
            let now = Instant::now();
            first.get_or_insert(now);
            last = now;
        }
    }
    let first = first.ok_or(LoadError::NoText)?;
    Ok(Sample {
        ttft: first.duration_since(t0).as_secs_f64(),
        tpot: (tokens >= 2).then(|| last.duration_since(first).as_secs_f64() / (tokens - 1) as f64),
        tokens,
    })
}

/// The `p`th percentile (nearest rank) of `v`; NaN when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let idx = ((p / 100.0) * (s.len() - 1) as f64).round() as usize;
    s[idx.min(s.len() - 1)]
}
