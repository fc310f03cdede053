//! `tp serve` under bad input and faults (docs/reliability.md R9): every bad request gets 400 (413
//! for an oversized body) with an OpenAI error body naming the parameter, and leaves KV cache
//! and memory at baseline; a client gone mid-stream frees its slot at once; the API key is
//! required on every request (any case of `Bearer`; /health exempt only with
//! --public-health), and an empty key is refused; SIGTERM/SIGINT drain in-flight requests and
//! exit 0, and those the drain timeout cuts end with an error (an SSE error event and
//! `[DONE]` for streams, 503 otherwise); requests beyond the KV budget queue instead of
//! failing; a reload that the memory plan (`--reload-memory`) says cannot be held beside the
//! live model drains first and fails no request.

mod serve_util;

use serde_json::json;
use serve_util::{chat_body, metric_value, read_stream, ServerProc};
use std::time::{Duration, Instant};

/// `(body, expected status, expected param)`.
fn bad_requests() -> Vec<(Vec<u8>, u16, Option<&'static str>)> {
    let user = |extra: &str| {
        format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{extra}}}"#).into_bytes()
    };
    let huge_prompt = "word ".repeat(2000);
    vec![
        (user(r#","max_tokens":0"#), 400, Some("max_tokens")),
        (user(r#","max_tokens":-3"#), 400, Some("max_tokens")),
        (user(r#","max_tokens":100000"#), 400, Some("max_tokens")),
        (user(r#","max_tokens":"many""#), 400, Some("max_tokens")),
        (
            user(r#","max_completion_tokens":0"#),
            400,
            Some("max_completion_tokens"),
        ),
        (user(r#","temperature":3"#), 400, Some("temperature")),
        (user(r#","temperature":-1"#), 400, Some("temperature")),
        (user(r#","temperature":"warm""#), 400, Some("temperature")),
        (user(r#","top_p":0"#), 400, Some("top_p")),
        (user(r#","top_p":1.5"#), 400, Some("top_p")),
        (user(r#","n":9"#), 400, Some("n")),
        (user(r#","n":0"#), 400, Some("n")),
        (user(r#","stop":7"#), 400, Some("stop")),
        (user(r#","stream":"yes""#), 400, Some("stream")),
        (user(r#","seed":"abc""#), 400, Some("seed")),
        (
            user(r#","presence_penalty":2.5"#),
            400,
            Some("presence_penalty"),
        ),
        (
            user(r#","frequency_penalty":-3"#),
            400,
            Some("frequency_penalty"),
        ),
        (
            user(r#","frequency_penalty":"high""#),
            400,
            Some("frequency_penalty"),
        ),
        (user(r#","logprobs":3"#), 400, Some("logprobs")),
        (
            user(r#","logprobs":true,"top_logprobs":21"#),
            400,
            Some("top_logprobs"),
        ),
        (
            user(r#","logprobs":true,"top_logprobs":-1"#),
            400,
            Some("top_logprobs"),
        ),
        (user(r#","top_logprobs":2"#), 400, Some("top_logprobs")),
        (user(r#","model":"gpt-4""#), 404, Some("model")),
        (br#"{"messages":[]}"#.to_vec(), 400, Some("messages")),
        (br#"{"messages":"hello"}"#.to_vec(), 400, Some("messages")),
        (
            br#"{"messages":[{"role":"user","content":""}]}"#.to_vec(),
            400,
            Some("messages"),
        ),
        (
            br#"{"messages":[{"role":"user","content":5}]}"#.to_vec(),
            400,
            Some("messages[0].content"),
        ),
        (br#"{"max_tokens":5}"#.to_vec(), 400, Some("messages")),
        (
            json!({"messages":[{"role":"user","content": huge_prompt}]})
                .to_string()
                .into_bytes(),
            400,
            Some("messages"),
        ),
        (
            json!({"messages":[{"role":"user","content":"hi"}],"max_tokens":505})
                .to_string()
                .into_bytes(),
            400,
            Some("max_tokens"),
        ),
        (b"{\"messages\": [".to_vec(), 400, None),
        (b"not json at all".to_vec(), 400, None),
        (b"".to_vec(), 400, None),
        (b"[1, 2, 3]".to_vec(), 400, None),
        (
            b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}".to_vec(),
            400,
            None,
        ),
        (vec![b' '; 2 << 20], 413, None),
    ]
}

#[test]
fn bad_requests_are_refused_by_name_and_leave_no_trace() {
    let Some(server) = ServerProc::start(&["--tp", "2", "--ctx-size", "512"]) else {
        return;
    };
    let c = &server.client;
    // Warm up, then take the baseline.
    let good = chat_body("Say one word.", 4, json!({}));
    assert_eq!(
        c.post_json("/v1/chat/completions", &good).unwrap().status,
        200
    );
    let rss0 = server.rss_bytes();
    // The warm-up request's blocks stay in the prefix cache: the baseline of the KV gauges.
    let kv0 = server.wait_metrics(Duration::from_secs(5), |t| {
        metric_value(t, "tp_running_requests") == Some(0.0)
    });
    let kv_bytes0 = metric_value(&kv0, "tp_kv_cache_bytes");
    let kv_blocks0 = metric_value(&kv0, "tp_kv_blocks_used");
    assert!(kv_blocks0.is_some_and(|b| b > 0.0), "{kv0}");
    for (body, status, param) in bad_requests() {
        let r = c.post("/v1/chat/completions", &body).unwrap();
        let shown = String::from_utf8_lossy(&body[..body.len().min(80)]).into_owned();
        assert_eq!(r.status, status, "{shown}: {}", r.text());
        let err = &r.json()["error"];
        assert!(
            err["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{shown}: {}",
            r.text()
        );
        assert!(err["type"].is_string(), "{shown}: {}", r.text());
        assert_eq!(err["param"].as_str(), param, "{shown}: {}", r.text());
    }
    // Completions: an empty prompt, a batch, ids out of range.
    for (body, param) in [
        (json!({"prompt": ""}), "prompt"),
        (json!({"prompt": ["a", "b"]}), "prompt"),
        (json!({"prompt": [1, 99999999]}), "prompt"),
        (json!({"prompt": "hi", "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": "hi", "n": 9}), "n"),
        (json!({"prompt": "hi", "logprobs": 21}), "logprobs"),
        (json!({"prompt": "hi", "logprobs": true}), "logprobs"),
        (
            json!({"prompt": "hi", "presence_penalty": -2.1}),
            "presence_penalty",
        ),
    ] {
        let r = c.post_json("/v1/completions", &body).unwrap();
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{body}");
    }
    // A burst of bad requests, concurrent, then the baseline holds and a good one is served.
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                // All but the oversized body.
                let bad = bad_requests();
                let n = bad.len() - 1;
                for (body, status, _) in bad.into_iter().take(n).cycle().take(100) {
                    assert_eq!(
                        c.post("/v1/chat/completions", &body).unwrap().status,
                        status
                    );
                }
            });
        }
    });
    let text = server.wait_metrics(Duration::from_secs(5), |t| {
        metric_value(t, "tp_running_requests") == Some(0.0)
    });
    for (name, want) in [
        ("tp_kv_cache_bytes", kv_bytes0),
        ("tp_kv_blocks_used", kv_blocks0),
        ("tp_running_requests", Some(0.0)),
        ("tp_queue_length", Some(0.0)),
    ] {
        assert_eq!(metric_value(&text, name), want, "{name}:\n{text}");
    }
    if let (Some(a), Some(b)) = (rss0, server.rss_bytes()) {
        assert!(
            b < a + (64 << 20),
            "resident memory grew from {a} to {b} bytes over a burst of bad requests"
        );
    }
    let r = c.post_json("/v1/chat/completions", &good).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    // Unknown routes and methods answer in the same error format.
    let r = c.get("/v1/nothing").unwrap();
    assert_eq!(r.status, 404);
    assert!(r.json()["error"]["message"].is_string());
    let r = c.get("/v1/chat/completions").unwrap();
    assert_eq!(r.status, 405);
}

#[test]
fn a_client_gone_mid_stream_frees_its_slot_at_once() {
    let Some(server) = ServerProc::start(&["--tp", "2", "--ctx-size", "512"]) else {
        return;
    };
    let c = &server.client;
    let body = chat_body(
        "Tell me a long story about a dragon.",
        400,
        json!({"stream": true, "ignore_eos": true}),
    );
    let mut s = c.stream("/v1/chat/completions", &body).unwrap();
    assert_eq!(s.status, 200);
    for _ in 0..4 {
        s.next_data().unwrap().expect("a chunk");
    }
    let running = server.metric("tp_running_requests");
    assert_eq!(running, Some(1.0));
    let t0 = Instant::now();
    drop(s);
    let text = server.wait_metrics(Duration::from_secs(10), |t| {
        metric_value(t, "tp_running_requests") == Some(0.0)
            && metric_value(t, "tp_kv_cache_bytes") == Some(0.0)
    });
    assert_eq!(
        metric_value(&text, "tp_running_requests"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        metric_value(&text, "tp_kv_cache_bytes"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        metric_value(&text, "tp_requests_cancelled_total"),
        Some(1.0),
        "{text}"
    );
    let generated = metric_value(&text, "tp_generation_tokens_total").unwrap_or(0.0);
    assert!(
        generated < 400.0,
        "the request ran to the end: {generated} tokens"
    );
    eprintln!("slot freed {:?} after the disconnect", t0.elapsed());
    // The server goes on serving.
    let r = c
        .post_json("/v1/chat/completions", &chat_body("Hi", 3, json!({})))
        .unwrap();
    assert_eq!(r.status, 200);
}

#[test]
fn the_api_key_is_required_on_every_request() {
    let Some(server) =
        ServerProc::start(&["--tp", "1", "--ctx-size", "256", "--api-key", "s3cret"])
    else {
        return;
    };
    let anon = &server.client;
    let body = chat_body("Hi", 2, json!({}));
    for (method, path) in [
        ("GET", "/health"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/nowhere"),
    ] {
        let b = body.to_string();
        let r = anon
            .request(method, path, (method == "POST").then_some(b.as_bytes()))
            .unwrap();
        assert_eq!(r.status, 401, "{method} {path}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    }
    let wrong = anon.clone().with_api_key("s3cre");
    assert_eq!(wrong.get("/health").unwrap().status, 401);
    let wrong = anon.clone().with_api_key("s3cret2");
    assert_eq!(wrong.get("/health").unwrap().status, 401);
    let right = anon.clone().with_api_key("s3cret");
    assert_eq!(right.get("/health").unwrap().status, 200);
    let r = right.post_json("/v1/chat/completions", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    // The scheme is case-insensitive (RFC 9110); the key is not; other schemes are refused.
    for (value, status) in [
        ("bearer s3cret", 200),
        ("BEARER s3cret", 200),
        ("bEaReR   s3cret", 200),
        ("Bearer S3CRET", 401),
        ("Basic s3cret", 401),
        ("Bearers3cret", 401),
        ("s3cret", 401),
    ] {
        let mut c = anon.clone();
        c.headers.push(("Authorization".into(), value.into()));
        assert_eq!(c.get("/v1/models").unwrap().status, status, "{value}");
    }
}

/// `tp serve` with an empty API key from the flag or $TP_API_KEY exits at once with an
/// error naming where the key came from, instead of serving without authentication.
#[test]
fn an_empty_api_key_is_refused() {
    // The key is checked before the model is opened: no model is needed.
    let serve = |key_flag: Option<&str>, env: Option<&str>| {
        let mut cmd = std::process::Command::new(serve_util::TP);
        cmd.args(["serve", "--model", "/nonexistent/model.gguf", "--port", "0"])
            .env_remove("TP_API_KEY");
        if let Some(k) = key_flag {
            cmd.args(["--api-key", k]);
        }
        if let Some(v) = env {
            cmd.env("TP_API_KEY", v);
        }
        let out = cmd.output().expect("run tp serve");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for (flag, env, needle) in [
        (Some(""), None, "--api-key is empty"),
        (Some("   "), None, "--api-key is only whitespace"),
        (Some(""), Some("fine-key"), "--api-key is empty"),
        (None, Some(""), "$TP_API_KEY is empty"),
        (None, Some(" \t"), "$TP_API_KEY is only whitespace"),
        (Some("two words"), None, "printable ASCII without spaces"),
    ] {
        let (code, stderr) = serve(flag, env);
        assert_ne!(code, Some(0), "{flag:?} {env:?}: {stderr}");
        assert!(stderr.contains(needle), "{flag:?} {env:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// `tp serve` refuses an admin key that is empty (flag or $TP_ADMIN_KEY), not printable, or
/// the API key itself, before the model is opened.
#[test]
fn a_bad_admin_key_is_refused() {
    let serve = |args: &[&str], env: Option<&str>| {
        let mut cmd = std::process::Command::new(serve_util::TP);
        cmd.args(["serve", "--model", "/nonexistent/model.gguf", "--port", "0"])
            .args(args)
            .env_remove("TP_API_KEY")
            .env_remove("TP_ADMIN_KEY");
        if let Some(v) = env {
            cmd.env("TP_ADMIN_KEY", v);
        }
        let out = cmd.output().expect("run tp serve");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for (args, env, needle) in [
        (&["--admin-key", ""][..], None, "--admin-key is empty"),
        (&[][..], Some(" "), "$TP_ADMIN_KEY is only whitespace"),
        (
            &["--admin-key", "a b"][..],
            None,
            "--admin-key: the key contains ' '",
        ),
        (
            &["--api-key", "k1", "--admin-key", "k1"][..],
            None,
            "the admin key is the API key",
        ),
    ] {
        let (code, stderr) = serve(args, env);
        assert_ne!(code, Some(0), "{args:?} {env:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?} {env:?}: {stderr}");
        assert!(
            !stderr.contains("/nonexistent"),
            "checked before the model: {stderr}"
        );
    }
}

/// With $TP_API_KEY and --public-health, /health answers anyone and the rest needs the key;
/// a stream the drain timeout cuts ends with an error event and `[DONE]`, and a whole
/// answer still being generated gets 503.
#[test]
fn the_drain_timeout_ends_requests_with_an_error() {
    let Some(mut server) = ServerProc::start_configured(
        &[
            "--tp",
            "1",
            "--ctx-size",
            "2048",
            "--drain-timeout",
            "1",
            "--public-health",
        ],
        |cmd| {
            cmd.env("TP_API_KEY", "k-77");
        },
    ) else {
        return;
    };
    let anon = server.client.clone();
    assert_eq!(anon.get("/health").unwrap().status, 200);
    for path in ["/metrics", "/v1/models", "/v1/models/x"] {
        assert_eq!(anon.get(path).unwrap().status, 401, "{path}");
    }
    let mut c = anon.clone();
    c.headers
        .push(("Authorization".into(), "bearer k-77".into()));
    assert_eq!(c.get("/metrics").unwrap().status, 200);

    let long = |stream: bool| {
        chat_body(
            "Tell me a very long story.",
            1500,
            json!({"stream": stream, "ignore_eos": true}),
        )
    };
    let mut s = c.stream("/v1/chat/completions", &long(true)).unwrap();
    assert_eq!(s.status, 200);
    for _ in 0..3 {
        s.next_data().unwrap().expect("a chunk");
    }
    let whole = {
        let c = c.clone();
        let body = long(false);
        std::thread::spawn(move || c.post_json("/v1/chat/completions", &body).unwrap())
    };
    let t0 = Instant::now();
    loop {
        let text = c.get("/metrics").unwrap().text();
        if metric_value(&text, "tp_running_requests") == Some(2.0) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
    server.signal("TERM");
    let term = Instant::now();
    let mut tail = Vec::new();
    while let Some(data) = s.next_data().unwrap() {
        tail.push(data);
    }
    let cut = term.elapsed();
    let n = tail.len();
    assert!(n >= 2, "{tail:?}");
    assert_eq!(tail[n - 1], "[DONE]", "{tail:?}");
    let err: serde_json::Value = serde_json::from_str(&tail[n - 2]).unwrap();
    assert_eq!(err["error"]["code"], "shutting_down", "{err}");
    assert_eq!(err["error"]["type"], "server_error", "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("drain timeout (1 s)")),
        "{err}"
    );
    for d in &tail[..n - 2] {
        let v: serde_json::Value = serde_json::from_str(d).unwrap();
        assert!(
            v.get("error").is_none() && v["choices"][0]["finish_reason"].is_null(),
            "{v}"
        );
    }
    assert!(
        cut >= Duration::from_millis(900) && cut < Duration::from_secs(10),
        "the stream ended {cut:?} after SIGTERM"
    );
    let r = whole.join().unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "shutting_down", "{}", r.text());
    let status = server.wait(Duration::from_secs(15));
    assert_eq!(status.code(), Some(0), "{}", server.stderr());
}

#[test]
fn sigterm_drains_in_flight_requests_then_exits_zero() {
    let Some(mut server) = ServerProc::start(&["--tp", "2", "--ctx-size", "256"]) else {
        return;
    };
    let c = server.client.clone();
    let body = chat_body(
        "Count from one to twenty.",
        24,
        json!({"stream": true, "ignore_eos": true}),
    );
    let mut s = c.stream("/v1/chat/completions", &body).unwrap();
    assert_eq!(s.status, 200);
    s.next_data().unwrap().expect("the role chunk");
    s.next_data().unwrap().expect("a text chunk");
    server.signal("TERM");
    // The in-flight stream runs to its end.
    let mut finish = None;
    let mut done = false;
    while let Some(data) = s.next_data().unwrap() {
        if data == "[DONE]" {
            done = true;
            break;
        }
        let v: serde_json::Value = serde_json::from_str(&data).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert!(done, "the stream was cut: {}", server.stderr());
    assert_eq!(finish.as_deref(), Some("length"));
    let status = server.wait(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{}", server.stderr());
    // Nothing listens any more.
    assert!(c.get("/health").is_err());

    // SIGINT (Ctrl-C) on an idle server exits 0 too.
    let Some(mut idle) = ServerProc::start(&["--tp", "2", "--ctx-size", "256"]) else {
        return;
    };
    idle.signal("INT");
    let status = idle.wait(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{}", idle.stderr());
}

/// A KV budget of 3 blocks (96 positions) for requests of ~60: concurrent requests queue or
/// are preempted and all succeed, with prompts prefilled 7 tokens per step and still the
/// answer `tp generate` gives; one that could never fit is refused by name.
#[test]
fn requests_beyond_the_kv_budget_queue_and_never_crash() {
    // SmolLM2 at tp 2: the busiest rank caches 2 KV heads x 64 x 30 layers x K,V x 2 B (the
    // default f16 cache) = 15 KiB per position, 480 KiB per block of 32, so 1.5 MiB hold 3
    // blocks.
    // Prompts also go in chunks of 7 tokens per step (--max-batch-tokens 7).
    let Some(server) = ServerProc::start(&[
        "--tp",
        "2",
        "--ctx-size",
        "512",
        "--max-kv-memory",
        "1536KiB",
        "--max-batch-tokens",
        "7",
    ]) else {
        return;
    };
    let c = &server.client;
    let body = |i: usize| chat_body(&format!("Say the number {i}."), 30, json!({}));
    // Prompt (~30 tokens) + 30: two requests need 4 blocks, more than the budget.
    let alone: Vec<String> = (0..3)
        .map(|i| {
            c.post_json("/v1/chat/completions", &body(i))
                .unwrap()
                .json()["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let together: Vec<(u16, String)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|i| {
                let c = c.clone();
                s.spawn(move || {
                    let r = c.post_json("/v1/chat/completions", &body(i)).unwrap();
                    let text = r.json()["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap_or("")
                        .to_string();
                    (r.status, text)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (status, text)) in together.iter().enumerate() {
        assert_eq!(*status, 200);
        assert_eq!(text, &alone[i]);
    }
    // Chunked prefill gives what `tp generate` gives (one prefill pass, then decode).
    let model = tp_testkit::smollm2().unwrap();
    let generated = std::process::Command::new(serve_util::TP)
        .arg("generate")
        .arg("--model")
        .arg(&model)
        .args([
            "--tp",
            "2",
            "--ctx-size",
            "512",
            "--greedy",
            "--chat",
            "--quiet",
        ])
        .args(["--max-tokens", "30", "Say the number 0."])
        .output()
        .expect("tp generate");
    assert!(generated.status.success());
    let reference = String::from_utf8_lossy(&generated.stdout);
    assert_eq!(reference.strip_suffix('\n').unwrap_or(&reference), alone[0]);
    let text = server.wait_metrics(Duration::ZERO, |_| true);
    let budget = metric_value(&text, "tp_kv_blocks_total").unwrap();
    assert_eq!(budget, 3.0, "{text}");
    // More than the whole budget: refused, naming max_tokens.
    let r = c
        .post_json("/v1/chat/completions", &chat_body("Hi", 200, json!({})))
        .unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "max_tokens");
    let s = read_stream(
        c,
        "/v1/chat/completions",
        &chat_body("Hi", 3, json!({"stream": true})),
    );
    assert!(!s.finish_reason.is_empty());
}

/// A server is priced at its KV budget (issue 16): a --max-rank-memory that holds SmolLM2's
/// weights (96.5 MB at tp 1) and a few blocks but not one --ctx-size of KV (8192 positions:
/// 189 MB) starts, and serves within those blocks; pricing one context refused it before.
#[test]
fn a_rank_memory_limit_below_one_context_serves_within_its_blocks() {
    let Some(server) = ServerProc::start(&["--ctx-size", "8192", "--max-rank-memory", "110MB"])
    else {
        return;
    };
    let r = server
        .client
        .post_json(
            "/v1/chat/completions",
            &chat_body("Say the number 3.", 8, json!({})),
        )
        .unwrap();
    assert_eq!(r.status, 200, "{}", server.stderr());
    assert!(
        server.stderr().contains("positions at most"),
        "{}",
        server.stderr()
    );
}

/// SmolLM2 at tp 2 with `--reload-memory 50MB` (its weights take 98 MB on this host): a
/// reload of the same file cannot be held beside the live model, so it drains first. The 4
/// streams running then finish, the requests that arrive during the drain wait, and every
/// text is the model's alone (the same file before and after); the answer and the log say it
/// drained and why. A rollback drains back (the first model loaded again from its path).
#[test]
fn a_reload_that_does_not_fit_beside_the_live_model_drains_and_fails_no_request() {
    const ADMIN: &str = "admin-key-9";
    let Some(server) = ServerProc::start(&[
        "--tp",
        "2",
        "--ctx-size",
        "512",
        "--admin-key",
        ADMIN,
        "--reload-memory",
        "50MB",
    ]) else {
        return;
    };
    let c = &server.client;
    let adm = c.clone().with_api_key(ADMIN);
    let model = tp_testkit::smollm2().unwrap();
    let body = |i: usize, max: usize, stream: bool| {
        json!({"prompt": format!("Story {i}: once upon a time"), "max_tokens": max,
            "temperature": 0, "ignore_eos": true, "stream": stream})
    };
    let text = |r: tp_serve::client::Response| {
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    // The oracle: each prompt alone.
    let alone: Vec<String> = (0..6)
        .map(|i| text(c.post_json("/v1/completions", &body(i, 64, false)).unwrap()))
        .collect();
    let started = std::sync::Barrier::new(5);
    let (streams, late, answer) = std::thread::scope(|s| {
        let streams: Vec<_> = (0..4)
            .map(|i| {
                let (c, started) = (c.clone(), &started);
                s.spawn(move || {
                    let mut st = c.stream("/v1/completions", &body(i, 64, true)).unwrap();
                    let mut out = String::new();
                    let mut first = true;
                    while let Some(d) = st.next_data().unwrap() {
                        if d == "[DONE]" {
                            break;
                        }
                        let v: serde_json::Value = serde_json::from_str(&d).unwrap();
                        assert!(v.get("error").is_none(), "{v}");
                        out.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
                        if first {
                            first = false;
                            started.wait();
                        }
                    }
                    out
                })
            })
            .collect();
        started.wait();
        let reloading = {
            let adm = adm.clone();
            let path = model.to_str().unwrap().to_string();
            s.spawn(move || {
                let r = adm
                    .post_json("/admin/reload", &json!({"path": path}))
                    .unwrap();
                (r.status, r.json())
            })
        };
        let t0 = Instant::now();
        while adm.get("/admin/models").unwrap().json()["draining"].is_null() {
            assert!(t0.elapsed() < Duration::from_secs(60), "no drain began");
            std::thread::sleep(Duration::from_millis(10));
        }
        let late: Vec<_> = (4..6)
            .map(|i| {
                let c = c.clone();
                s.spawn(move || text(c.post_json("/v1/completions", &body(i, 64, false)).unwrap()))
            })
            .collect();
        let answer = reloading.join().unwrap();
        let streams: Vec<String> = streams.into_iter().map(|h| h.join().unwrap()).collect();
        let late: Vec<String> = late.into_iter().map(|h| h.join().unwrap()).collect();
        (streams, late, answer)
    });
    let (status, answer) = answer;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["swap"], "drain", "{answer}");
    let why = answer["drained"]["why"].as_str().unwrap();
    assert!(
        why.contains("cannot be held beside the live model"),
        "{why}"
    );
    assert!(why.contains("50.0 MB is available"), "{why}");
    assert_eq!(answer["drained"]["waited"], 2, "{answer}");
    assert!(answer["drained"]["downtime_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(streams, alone[..4]);
    assert_eq!(late, alone[4..]);
    assert!(
        server.stderr().contains("# tp serve: drain swap"),
        "{}",
        server.stderr()
    );
    // A rollback loads the first model back from its path.
    let r = adm.post("/admin/rollback", b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["live"]["id"], 2, "{}", r.text());
    assert_eq!(
        text(c.post_json("/v1/completions", &body(0, 64, false)).unwrap()),
        alone[0]
    );
}
