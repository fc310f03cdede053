//! The reload tests' kit (serve_reload, serve_drain): models A and B (same shape, answers
//! that differ), their oracle texts, a server with the admin endpoints and its admin calls.

use super::{complete, config, with_model, Model};
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};
use tp_serve::canary::{self, Canary, CanaryConfig};
use tp_serve::client::Client;
use tp_serve::ServeConfig;

pub const CTX: usize = 256;
/// Untied heads: models of two seeds answer differently.
pub const A: Model = Model {
    seed: 7,
    tied: false,
};
pub const B: Model = Model {
    seed: 8,
    tied: false,
};
pub const ADMIN: &str = "admin-key-1";
pub const API: &str = "api-key-1";

pub fn prompts() -> Vec<String> {
    (0..8).map(|i| format!("request {i}: once upon")).collect()
}

/// Every prompt's greedy text on `model` served alone (the oracle), and a canary
/// written from it.
pub fn oracle(model: Model, max: usize) -> (Vec<String>, Canary) {
    with_model(2, CTX, model, config(), |ready| {
        let c = Client::new(ready.addr);
        let texts = prompts().iter().map(|p| complete(&c, p, max)).collect();
        let canary = canary::record(&c, &prompts()[..3], 8).unwrap();
        (texts, canary)
    })
    .1
}

/// A server with the admin endpoints (key [`ADMIN`]), an API key ([`API`]) and `canary`
/// run every 200 ms.
pub fn with_admin(canary: Option<Canary>) -> ServeConfig {
    ServeConfig {
        admin_key: Some(ADMIN.into()),
        api_key: Some(API.into()),
        canary: canary.map(|canary| CanaryConfig {
            canary,
            interval: Duration::from_millis(200),
            threshold: canary::DEFAULT_THRESHOLD,
        }),
        ..config()
    }
}

pub fn admin(ready: &tp_serve::Ready) -> Client {
    Client::new(ready.addr).with_api_key(ADMIN)
}

pub fn api(ready: &tp_serve::Ready) -> Client {
    Client::new(ready.addr).with_api_key(API)
}

pub fn reload(c: &Client, body: Value) -> (u16, Value) {
    let r = c.post_json("/admin/reload", &body).unwrap();
    (r.status, r.json())
}

pub fn models(c: &Client) -> Value {
    let r = c.get("/admin/models").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// `/admin/models` once `done` holds of it (the scheduler drops a model once idle), or a
/// failure after 10 s.
pub fn models_when(c: &Client, done: impl Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let m = models(c);
        if done(&m) {
            return m;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{m}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn ids(m: &Value) -> Vec<u64> {
    m["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_u64().unwrap())
        .collect()
}

pub fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

/// One client's greedy streamed completion of `prompt` (`max` tokens, end-of-sequence
/// ignored): meets `started` once its first text arrives, counts itself `finished` at the
/// end; no chunk may carry an error.
pub fn stream_greedy(
    api: &Client,
    prompt: &str,
    max: usize,
    started: &std::sync::Barrier,
    finished: &std::sync::atomic::AtomicUsize,
) -> String {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": max, "temperature": 0,
        "ignore_eos": true, "stream": true});
    let mut st = api.stream("/v1/completions", &body).unwrap();
    assert_eq!(st.status, 200);
    let mut text = String::new();
    let mut first = true;
    while let Some(d) = st.next_data().unwrap() {
        if d == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        if first && !text.is_empty() {
            first = false;
            started.wait();
        }
    }
    finished.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    text
}

/// [`stream_greedy`] of every one of [`prompts`], each on a thread of scope `s`.
pub fn stream_all<'scope, 'env>(
    s: &'scope std::thread::Scope<'scope, 'env>,
    api: &Client,
    max: usize,
    started: &'env std::sync::Barrier,
    finished: &'env std::sync::atomic::AtomicUsize,
) -> Vec<std::thread::ScopedJoinHandle<'scope, String>> {
    prompts()
        .into_iter()
        .map(|p| {
            let api = api.clone();
            s.spawn(move || stream_greedy(&api, &p, max, started, finished))
        })
        .collect()
}
