//! Drain-first swaps and the error-rate rollback, end to end at tp 2 (rank threads), against
//! synthetic models A (the one the server starts with), B (same shape, other weights) and a
//! copy of A with NaN in its final norm (every request on it fails). The oracle of every text
//! is a server of that model alone: greedy completions are deterministic per model.
//! - A drain swap (the server's swap policy) while 8 clients stream fails no request: the
//!   streams finish with A's text, requests that arrive during the drain wait and get B's;
//!   the answer says it drained and how long no model served. A rollback then drains and
//!   loads A back from its path.
//! - A drain swap whose canary fails loads A back from its path, and A serves; one switched
//!   in without the check fails the periodic canary and is rolled back by draining.
//! - A switch to the NaN model (no canary) is rolled back by the error rate of the first
//!   requests after it, holding both models and draining.

mod common;

use common::reload::{
    admin, api, ids, models, models_when, oracle, prompts, reload, stream_all, with_admin, write,
    A, B, CTX,
};
use common::{complete, metric, test_dir, with_model, write_model, write_nan_model};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};
use tp_serve::rollout::WATCH_MIN_FAILURES;
use tp_serve::{ServeConfig, SwapConfig, SwapPolicy};

/// [`with_admin`] with a swap policy.
fn swapping(policy: SwapPolicy, canary: Option<tp_serve::canary::Canary>) -> ServeConfig {
    ServeConfig {
        max_seqs: 8,
        max_queue: 16,
        swap: SwapConfig {
            policy,
            ..SwapConfig::default()
        },
        ..with_admin(canary)
    }
}

/// Whether the live model is the server's first model file (A, loaded from its path).
fn is_first_model(m: &Value) -> bool {
    m["path"].as_str().is_some_and(|p| p.ends_with("m.gguf"))
}

#[test]
fn a_drain_swap_while_8_clients_stream_fails_no_request_and_a_rollback_drains_back() {
    const MAX: usize = 200;
    const LATE: usize = 4;
    let (want_a, _) = oracle(A, MAX);
    let (want_b, _) = oracle(B, MAX);
    assert_ne!(want_a, want_b, "the models must answer differently");
    let dir = test_dir();
    let b = dir.join("b.gguf");
    write_model(&b, CTX, B);
    with_model(2, CTX, A, swapping(SwapPolicy::Drain, None), |ready| {
        let (api, adm) = (api(ready), admin(ready));
        let started = Barrier::new(9);
        let finished = AtomicUsize::new(0);
        let (streams, late, answer, running_at_drain) = std::thread::scope(|s| {
            let clients = stream_all(s, &api, MAX, &started, &finished);
            // Every client has its first text: all 8 run on A. Reload now.
            started.wait();
            let adm2 = adm.clone();
            let path = b.to_str().unwrap().to_string();
            let reloading = s.spawn(move || reload(&adm2, json!({"path": path})));
            models_when(&adm, |m| !m["draining"].is_null());
            let running = 8 - finished.load(Ordering::SeqCst);
            // Requests that arrive during the drain wait for the new model.
            let late: Vec<_> = (0..LATE)
                .map(|i| {
                    let api = api.clone();
                    s.spawn(move || complete(&api, &prompts()[i], MAX))
                })
                .collect();
            let answer = reloading.join().unwrap();
            let streams: Vec<String> = clients.into_iter().map(|h| h.join().unwrap()).collect();
            let late: Vec<String> = late.into_iter().map(|h| h.join().unwrap()).collect();
            (streams, late, answer, running)
        });
        let (status, body) = answer;
        assert_eq!(status, 200, "{body}");
        assert!(running_at_drain > 0, "every stream ended before the drain");
        assert_eq!(body["swap"], "drain", "{body}");
        let drained = &body["drained"];
        assert_eq!(drained["waited"], LATE, "{body}");
        assert!(
            drained["downtime_seconds"].as_f64().unwrap() > 0.0,
            "{body}"
        );
        assert!(
            drained["why"].as_str().unwrap().contains("swap policy"),
            "{body}"
        );
        assert_eq!(body["live"]["id"], 1, "{body}");
        assert!(body["previous"].is_null(), "A is no longer held: {body}");
        // The streams finished on A, the model they started on; the late requests ran on B.
        for (i, (got, want)) in streams.iter().zip(&want_a).enumerate() {
            assert_eq!(got, want, "stream {i} did not finish on A");
        }
        for (i, (got, want)) in late.iter().zip(&want_b).enumerate() {
            assert_eq!(got, want, "late request {i} did not run on B");
        }
        let m = models(&adm);
        assert_eq!(ids(&m), vec![1], "only B is held: {m}");
        assert!(m["unheld_previous"].as_str().is_some(), "{m}");
        // A rollback drains and loads A back from its path.
        let r = adm.post("/admin/rollback", b"").unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let back = r.json();
        assert!(is_first_model(&back["live"]), "{back}");
        assert!(back["drained"]["downtime_seconds"].as_f64().unwrap() > 0.0);
        assert_eq!(complete(&api, &prompts()[1], MAX), want_a[1]);
        assert_eq!(metric(&api, "tp_model_rollbacks_total"), 1.0);
        assert_eq!(ids(&models(&adm)), vec![2]);
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_drain_swap_whose_canary_fails_loads_the_old_model_back_and_a_later_canary_failure_drains_back()
{
    let (want_a, canary_a) = oracle(A, 16);
    let dir = test_dir();
    let b = dir.join("b.gguf");
    write_model(&b, CTX, B);
    let cfg = swapping(SwapPolicy::Drain, Some(canary_a));
    with_model(2, CTX, A, cfg, |ready| {
        let (api, adm) = (api(ready), admin(ready));
        assert_eq!(complete(&api, &prompts()[2], 16), want_a[2]);
        // The server's canary (written from A) fails on B: A is loaded back.
        let (status, body) = reload(&adm, json!({"path": b.to_str().unwrap()}));
        assert_eq!(status, 409, "{body}");
        assert_eq!(body["error"]["code"], "canary_failed", "{body}");
        let msg = body["error"]["message"].as_str().unwrap();
        assert!(msg.contains("was loaded back and serves"), "{msg}");
        assert_eq!(complete(&api, &prompts()[2], 16), want_a[2]);
        let m = models(&adm);
        assert_eq!(ids(&m), vec![2], "only A, loaded back, is held: {m}");
        assert!(is_first_model(&m["live"]), "{m}");
        assert_eq!(m["reload_failures"], 1, "{m}");
        assert_eq!(m["switches"], 0, "{m}");
        // Switched in without the check, B fails the periodic canary: the automatic rollback
        // drains and loads A back from its path.
        let (status, body) = reload(
            &adm,
            json!({"path": b.to_str().unwrap(), "skip_canary": true}),
        );
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["swap"], "drain", "{body}");
        let m = models_when(&adm, |m| m["rollbacks"] == 1);
        assert!(is_first_model(&m["live"]), "{m}");
        let event = m["last_event"].as_str().unwrap();
        assert!(event.contains("reloaded by a drain swap"), "{m}");
        assert!(event.contains("the canary failed"), "{m}");
        assert_eq!(complete(&api, &prompts()[2], 16), want_a[2]);
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// Requests after a switch to the NaN model until one succeeds: the failures, and the text.
fn until_rolled_back(api: &tp_serve::client::Client, prompt: &str) -> (u64, String) {
    let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": true});
    let t0 = Instant::now();
    let mut failures = 0;
    loop {
        let r = api.post_json("/v1/completions", &body).unwrap();
        if r.status == 200 {
            return (
                failures,
                r.json()["choices"][0]["text"].as_str().unwrap().into(),
            );
        }
        assert!(r.text().contains("NaN"), "{}", r.text());
        failures += 1;
        assert!(t0.elapsed() < Duration::from_secs(30), "no rollback");
    }
}

#[test]
fn failing_requests_after_a_switch_roll_back_holding_both_models_and_draining() {
    let (want_a, _) = oracle(A, 16);
    let dir = test_dir();
    let nan = write(&dir, "nan.gguf", "");
    write_nan_model(std::path::Path::new(&nan), CTX, A);
    for (policy, swap, live_after) in [
        (SwapPolicy::Auto, "beside", 0),
        (SwapPolicy::Drain, "drain", 2),
    ] {
        with_model(2, CTX, A, swapping(policy, None), |ready| {
            let (api, adm) = (api(ready), admin(ready));
            // No canary: the switch happens, and every request on the new model fails.
            let (status, body) = reload(&adm, json!({"path": nan}));
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["swap"], swap, "{body}");
            let (failures, text) = until_rolled_back(&api, &prompts()[0]);
            assert_eq!(failures, WATCH_MIN_FAILURES, "{policy:?}");
            assert_eq!(text, want_a[0], "{policy:?}");
            assert_eq!(metric(&api, "tp_model_rollbacks_total"), 1.0);
            let m = models_when(&adm, |m| m["live"]["id"] == live_after);
            assert!(is_first_model(&m["live"]), "{m}");
            let event = m["last_event"].as_str().unwrap();
            assert!(event.contains("requests since the switch failed"), "{m}");
        });
    }
    let _ = std::fs::remove_dir_all(&dir);
}
