//! Reload without downtime at tp 2 (rank threads), against synthetic models A (the one the
//! server starts with) and B (same shape, other weights). The oracle of every text is a
//! server of that model alone: greedy completions are deterministic per model.
//! - A switch to B while 8 clients stream loses no request: each finishes with A's full
//!   answer (the model it started on); later requests get B's; a rollback brings A back.
//! - A path that does not exist, a file that is no model, and a model of another shape are
//!   refused with 400 naming the path and the loader's words; A keeps serving.
//! - A candidate that fails the canary is not switched to; one switched to without the check
//!   fails the periodic canary and is rolled back automatically.
//! - The admin endpoints are off without an admin key (404) and need it (401), not the API key.

mod common;

use common::reload::{
    admin, ids, models, models_when, oracle, prompts, reload, stream_all, with_admin, write, A, B,
    CTX,
};
use common::{complete, config, metric, test_dir, with_model, write_model};
use serde_json::json;
use std::time::Duration;
use tp_serve::client::Client;

#[test]
fn a_switch_while_8_clients_stream_loses_no_request() {
    const MAX: usize = 200;
    let (want_a, _) = oracle(A, MAX);
    let (want_b, canary_b) = oracle(B, MAX);
    assert_ne!(want_a, want_b, "the models must answer differently");
    let dir = test_dir();
    let b = dir.join("b.gguf");
    write_model(&b, CTX, B);
    let b_canary = write(&dir, "b.jsonl", &canary_b.to_jsonl());
    with_model(2, CTX, A, with_admin(None), |ready| {
        let api = Client::new(ready.addr).with_api_key("api-key-1");
        let adm = admin(ready);
        let started = std::sync::Barrier::new(9);
        let finished = std::sync::atomic::AtomicUsize::new(0);
        let (texts, running_at_switch) = std::thread::scope(|s| {
            let clients = stream_all(s, &api, MAX, &started, &finished);
            // Every client has its first text: all 8 run on A. Switch now.
            started.wait();
            let (status, body) = reload(
                &adm,
                json!({"path": b.to_str().unwrap(), "canary": b_canary}),
            );
            let running = 8 - finished.load(std::sync::atomic::Ordering::SeqCst);
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["live"]["id"], 1, "{body}");
            assert_eq!(body["previous"]["id"], 0, "{body}");
            assert_eq!(body["canary"]["passed"], true, "{body}");
            let texts: Vec<String> = clients.into_iter().map(|h| h.join().unwrap()).collect();
            (texts, running)
        });
        // The switch happened while requests streamed, and none of them changed model.
        assert!(
            running_at_switch > 0,
            "every stream ended before the switch"
        );
        for (i, (got, want)) in texts.iter().zip(&want_a).enumerate() {
            assert_eq!(
                got, want,
                "stream {i} did not finish on the model it started on"
            );
        }
        // New requests run on B.
        assert_eq!(complete(&api, &prompts()[0], MAX), want_b[0]);
        assert_eq!(metric(&api, "tp_model_switches_total"), 1.0);
        let m = models(&adm);
        assert_eq!(m["live"]["id"], 1, "{m}");
        assert_eq!(ids(&m), vec![0, 1], "A stays held for a rollback: {m}");
        // Roll back by hand: A again.
        let r = adm.post("/admin/rollback", b"").unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["live"]["id"], 0);
        assert_eq!(complete(&api, &prompts()[1], MAX), want_a[1]);
        assert_eq!(metric(&api, "tp_model_rollbacks_total"), 1.0);
        let text = api.get("/metrics").unwrap().text();
        assert!(text.contains("tp_model_live{id=\"0\""), "{text}");
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_path_is_refused_with_the_loaders_error_and_the_old_model_keeps_serving() {
    let dir = test_dir();
    let missing = dir.join("missing.gguf");
    let text = write(&dir, "notes.gguf", "these are notes, not a model");
    // Another shape: a context-256 model of 4 layers instead of 2.
    let other = dir.join("other.gguf");
    let cfg = tp_models::ModelConfig {
        layers: 4,
        vocab: tp_tokenizer::Tokenizer::bytes(&["<|endoftext|>"]).vocab_size(),
        context: CTX,
        ..tp_models::synthetic::SyntheticModel::small(tp_models::Arch::Llama, 7).cfg
    };
    tp_models::synthetic::SyntheticModel::new(cfg, 3)
        .write_gguf(&other, tp_models::synthetic::GgufTypes::F32)
        .unwrap();
    with_model(2, CTX, A, with_admin(None), |ready| {
        let api = Client::new(ready.addr).with_api_key("api-key-1");
        let adm = admin(ready);
        let before = complete(&api, "hello", 16);
        for (path, words) in [
            (missing.to_str().unwrap().to_string(), "does not exist"),
            (text.clone(), "GGUF"),
            (other.to_str().unwrap().to_string(), "4 layers"),
        ] {
            let (status, body) = reload(&adm, json!({"path": path}));
            assert_eq!(status, 400, "{body}");
            let msg = body["error"]["message"].as_str().unwrap();
            assert!(msg.contains(&path), "{msg}");
            assert!(msg.contains(words), "{msg}");
            assert!(msg.contains("the live model keeps serving"), "{msg}");
            assert_eq!(body["error"]["param"], "path");
            assert_eq!(complete(&api, "hello", 16), before);
        }
        for (body, param) in [
            (json!({}), "path"),
            (json!({"path": 3}), "path"),
            (
                json!({"path": "x", "canary": "/no/such/canary.jsonl"}),
                "canary",
            ),
        ] {
            let (status, b) = reload(&adm, body);
            assert_eq!(
                (status, b["error"]["param"].as_str()),
                (400, Some(param)),
                "{b}"
            );
        }
        let m = models(&adm);
        assert_eq!(ids(&m), vec![0], "{m}");
        assert_eq!(m["live"]["id"], 0);
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_canary_failure_refuses_the_switch_or_rolls_it_back() {
    let (want_a, canary_a) = oracle(A, 16);
    let dir = test_dir();
    let b = dir.join("b.gguf");
    write_model(&b, CTX, B);
    with_model(2, CTX, A, with_admin(Some(canary_a)), |ready| {
        let api = Client::new(ready.addr).with_api_key("api-key-1");
        let adm = admin(ready);
        // The server's canary (written from A) fails on B: no switch.
        let (status, body) = reload(&adm, json!({"path": b.to_str().unwrap()}));
        assert_eq!(status, 409, "{body}");
        assert_eq!(body["error"]["code"], "canary_failed", "{body}");
        assert_eq!(complete(&api, &prompts()[2], 16), want_a[2]);
        // The candidate is dropped once its canary requests ended.
        let m = models_when(&adm, |m| ids(m) == vec![0]);
        assert_eq!(m["reload_failures"], 1, "{m}");
        // Switched without the check, B fails the periodic canary and is rolled back.
        let (status, body) = reload(
            &adm,
            json!({"path": b.to_str().unwrap(), "skip_canary": true}),
        );
        assert_eq!(status, 200, "{body}");
        assert!(body["canary"].is_null(), "{body}");
        let m = models_when(&adm, |m| m["rollbacks"] == 1);
        assert_eq!(m["live"]["id"], 0, "{m}");
        assert!(
            m["last_event"]
                .as_str()
                .unwrap()
                .contains("the canary failed"),
            "{m}"
        );
        assert_eq!(complete(&api, &prompts()[2], 16), want_a[2]);
        // Back on A, the canary passes again; no automatic rollback to B follows.
        std::thread::sleep(Duration::from_millis(600));
        let m = models(&adm);
        assert_eq!(
            (m["live"]["id"].as_u64(), m["rollbacks"].as_u64()),
            (Some(0), Some(1)),
            "{m}"
        );
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn admin_endpoints_need_the_admin_key() {
    // Off without one.
    with_model(2, CTX, A, config(), |ready| {
        let r = Client::new(ready.addr)
            .post_json("/admin/reload", &json!({"path": "x"}))
            .unwrap();
        assert_eq!(r.status, 404, "{}", r.text());
        assert!(r.text().contains("without an admin key"), "{}", r.text());
    });
    with_model(2, CTX, A, with_admin(None), |ready| {
        for client in [
            Client::new(ready.addr),
            Client::new(ready.addr).with_api_key("api-key-1"),
            Client::new(ready.addr).with_api_key("wrong"),
        ] {
            for (method, path) in [
                ("POST", "/admin/reload"),
                ("POST", "/admin/rollback"),
                ("GET", "/admin/models"),
                ("POST", "/admin/models/0/v1/completions"),
            ] {
                let r = client.request(method, path, Some(b"{}")).unwrap();
                assert_eq!(r.status, 401, "{method} {path}: {}", r.text());
                assert!(r.text().contains("admin key"), "{}", r.text());
            }
        }
        let adm = admin(ready);
        // Nothing to roll back to yet.
        let r = adm.post("/admin/rollback", b"").unwrap();
        assert_eq!(r.status, 409, "{}", r.text());
        // The admin key is not the API key.
        let r = adm
            .post_json("/v1/completions", &json!({"prompt": "a", "max_tokens": 1}))
            .unwrap();
        assert_eq!(r.status, 401, "{}", r.text());
        // A held model answers on its own route.
        let r = adm
            .post_json(
                "/admin/models/0/v1/completions",
                &json!({"prompt": "a", "max_tokens": 2}),
            )
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    });
}
