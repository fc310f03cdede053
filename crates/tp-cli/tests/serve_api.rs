//! `tp serve` end to end on loopback with the real SmolLM2 at tp 2: the OpenAI endpoints
//! (chat and text completions, streaming and not), and continuous batching giving every
//! client exactly what a lone request gets.

mod serve_util;

use serde_json::json;
use serve_util::{chat_body, metric_value, read_stream, ServerProc};
use std::time::Duration;

#[test]
fn chat_and_completions_answer_streaming_and_not() {
    let Some(server) = ServerProc::start(&["--tp", "2", "--ctx-size", "512"]) else {
        return;
    };
    let c = &server.client;

    let health = c.get("/health").unwrap();
    assert_eq!(health.status, 200);
    let models = c.get("/v1/models").unwrap().json();
    let name = models["data"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(name, "SmolLM2-135M-Instruct.Q4_1", "{models}");
    assert_eq!(models["data"][0]["max_model_len"], 512);

    // Non-streaming chat: the OpenAI shape, usage, finish reason.
    let body = chat_body("What is the capital of France?", 12, json!({"model": name}));
    let r = c.post_json("/v1/chat/completions", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], name);
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["role"], "assistant");
    let text = msg["content"].as_str().unwrap().to_string();
    assert!(!text.is_empty(), "{v}");
    let usage = &v["usage"];
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 5, "{v}");
    assert!((1..=12).contains(&completion), "{v}");
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["prompt_tokens"].as_u64().unwrap() + completion)
    );
    let finish = v["choices"][0]["finish_reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(finish == "stop" || finish == "length", "{v}");
    if completion == 12 {
        assert_eq!(finish, "length");
    }

    // The same request streamed: same text, same finish, usage on request, [DONE] last.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let s = read_stream(c, "/v1/chat/completions", &sbody);
    assert_eq!(s.text, text);
    assert_eq!(s.finish_reason, finish);
    assert_eq!(s.usage.as_ref(), Some(usage));
    assert!(s.chunks >= 3, "role, text and finish chunks expected");

    // Text completions, both ways, with OpenAI's default of 16 tokens.
    let cbody = json!({"prompt": "Once upon a time", "temperature": 0});
    let r = c.post_json("/v1/completions", &cbody).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    let ctext = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() <= 16);
    let mut sc = cbody.clone();
    sc["stream"] = json!(true);
    let s = read_stream(c, "/v1/completions", &sc);
    assert_eq!(s.text, ctext);
    assert!(s.usage.is_none());

    // A stop sequence cuts the text before it and reports "stop".
    let words: Vec<&str> = ctext.split_whitespace().collect();
    if words.len() >= 3 {
        let stop = words[2];
        let mut sb = cbody.clone();
        sb["stop"] = json!([stop]);
        let v = c.post_json("/v1/completions", &sb).unwrap().json();
        let cut = v["choices"][0]["text"].as_str().unwrap();
        assert_eq!(cut, &ctext[..ctext.find(stop).unwrap()], "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }

    // A seeded sampled request repeats itself.
    let sampled = json!({"prompt": "The weather today", "temperature": 0.9, "top_p": 0.9,
                         "seed": 1234, "max_tokens": 10});
    let a = c.post_json("/v1/completions", &sampled).unwrap().json();
    let b = c.post_json("/v1/completions", &sampled).unwrap().json();
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);

    // The metrics saw all this.
    let m = c.get("/metrics").unwrap();
    assert_eq!(m.status, 200);
    let text = m.text();
    for name in [
        "tp_time_to_first_token_seconds_count",
        "tp_time_per_output_token_seconds_count",
        "tp_step_collective_seconds_sum",
        "tp_generation_tokens_total",
        "tp_queue_length",
    ] {
        assert!(
            metric_value(&text, name).is_some(),
            "{name} missing:\n{text}"
        );
    }
    assert!(
        text.contains(r#"tp_requests_total{endpoint="chat",status="200"} 2"#),
        "{text}"
    );
    assert!(metric_value(&text, "tp_step_collective_seconds_sum").unwrap() > 0.0);
}

/// Eight different prompts, greedy: alone one after another, then all at once.
#[test]
fn eight_concurrent_clients_get_what_a_lone_request_gets() {
    let Some(server) = ServerProc::start(&["--tp", "2", "--ctx-size", "512"]) else {
        return;
    };
    let prompts = [
        "Name three colors.",
        "What is 2 + 2?",
        "Write a haiku about rain.",
        "Who wrote Hamlet?",
        "Give me a word that rhymes with cat.",
        "What is the largest planet?",
        "Say hello in Spanish.",
        "List two fruits.",
    ];
    let body = |i: usize| {
        // Half streamed, half not; the last one sampled with a seed.
        let mut b = chat_body(prompts[i], 10, json!({}));
        if i == 7 {
            b["temperature"] = json!(0.8);
            b["seed"] = json!(99);
        }
        b
    };
    let ask = |client: &tp_serve::client::Client, i: usize| -> String {
        if i.is_multiple_of(2) {
            let mut b = body(i);
            b["stream"] = json!(true);
            read_stream(client, "/v1/chat/completions", &b).text
        } else {
            let r = client.post_json("/v1/chat/completions", &body(i)).unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            r.json()["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };
    let alone: Vec<String> = (0..8).map(|i| ask(&server.client, i)).collect();
    let batched_before = batched_steps(&server);
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let c = server.client.clone();
                let ask = &ask;
                s.spawn(move || ask(&c, i))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for i in 0..8 {
        assert_eq!(together[i], alone[i], "prompt {i} ({:?})", prompts[i]);
    }
    assert!(
        batched_steps(&server) > batched_before,
        "no step ran more than one sequence: the requests were not batched"
    );

    // A new request joins a running one without waiting for it to finish.
    let long = chat_body(
        "Write a long essay about the sea.",
        300,
        json!({"stream": true, "ignore_eos": true}),
    );
    let mut stream = server.client.stream("/v1/chat/completions", &long).unwrap();
    for _ in 0..3 {
        stream
            .next_data()
            .unwrap()
            .expect("a chunk of the long answer");
    }
    let short = server
        .client
        .post_json("/v1/chat/completions", &chat_body(prompts[1], 4, json!({})))
        .unwrap();
    assert_eq!(short.status, 200);
    let more = stream
        .next_data()
        .unwrap()
        .expect("the long answer goes on");
    assert!(
        more.contains("chat.completion.chunk") && !more.contains("finish_reason\":\"length"),
        "{more}"
    );
}

/// Steps that carried more than one sequence (from the `tp_step_rows` histogram).
fn batched_steps(server: &ServerProc) -> f64 {
    let text = server.wait_metrics(Duration::ZERO, |_| true);
    let count = metric_value(&text, "tp_step_rows_count").unwrap_or(0.0);
    let single = text
        .lines()
        .find(|l| l.starts_with(r#"tp_step_rows_bucket{le="1"}"#))
        .and_then(|l| l.rsplit_once(' '))
        .and_then(|(_, v)| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    count - single
}

/// Concatenated `bytes` of chat logprob entries.
fn entry_bytes(entries: &[serde_json::Value]) -> Vec<u8> {
    entries
        .iter()
        .flat_map(|e| {
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect::<Vec<u8>>()
        })
        .collect()
}

/// Log-probabilities (chat and completions, streamed and not, with a stop sequence) and the
/// presence/frequency penalties.
#[test]
fn logprobs_and_penalties() {
    let Some(server) = ServerProc::start(&["--tp", "2", "--ctx-size", "512"]) else {
        return;
    };
    let c = &server.client;

    // Greedy chat with 3 alternatives per token.
    let body = chat_body(
        "What is the capital of France?",
        12,
        json!({"logprobs": true, "top_logprobs": 3}),
    );
    let r = c.post_json("/v1/chat/completions", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let entries = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(
        entries.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap(),
        "{v}"
    );
    // The tokens make up the text exactly (no stop sequence here).
    assert_eq!(entry_bytes(&entries), content.as_bytes(), "{v}");
    let strings: String = entries
        .iter()
        .map(|e| e["token"].as_str().unwrap())
        .collect();
    if !strings.contains('\u{FFFD}') {
        assert_eq!(strings, content);
    }
    for e in &entries {
        let lp = e["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0, "{e}");
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{e}");
        let tops: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(tops.windows(2).all(|w| w[0] >= w[1]), "{e}");
        assert!(tops.iter().all(|&t| t <= 0.0), "{e}");
        // Greedy: the chosen token is the most likely one.
        let max = tops.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(lp, max, "{e}");
        assert_eq!(e["token"], top[0]["token"], "{e}");
        assert!(top[0]["bytes"].is_array(), "{e}");
    }
    // Streamed: each text chunk carries its tokens; together the same entries.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let s = read_stream(c, "/v1/chat/completions", &sbody);
    assert_eq!(s.text, content);
    let streamed: Vec<serde_json::Value> = s
        .logprobs
        .iter()
        .flat_map(|l| l["content"].as_array().unwrap().clone())
        .collect();
    assert_eq!(streamed, entries);
    // Without top_logprobs: the chosen tokens only.
    let r = c
        .post_json(
            "/v1/chat/completions",
            &chat_body(
                "What is the capital of France?",
                12,
                json!({"logprobs": true}),
            ),
        )
        .unwrap()
        .json();
    let plain = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(plain.len(), entries.len());
    assert_eq!(plain[0]["top_logprobs"], json!([]));
    assert_eq!(plain[0]["logprob"], entries[0]["logprob"]);
    // Not asked for: null.
    let r = c
        .post_json(
            "/v1/chat/completions",
            &chat_body("What is the capital of France?", 4, json!({})),
        )
        .unwrap()
        .json();
    assert!(r["choices"][0]["logprobs"].is_null(), "{r}");

    // Completions, logprobs=2, streamed and not: the same tokens and numbers.
    let cbody = json!({"prompt": "Once upon a time", "temperature": 0, "max_tokens": 16,
                       "logprobs": 2});
    let v = c.post_json("/v1/completions", &cbody).unwrap().json();
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let lp = v["choices"][0]["logprobs"].clone();
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let n = tokens.len();
    assert_eq!(n as u64, v["usage"]["completion_tokens"].as_u64().unwrap());
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
    assert_eq!(lp["top_logprobs"].as_array().unwrap().len(), n);
    assert_eq!(lp["text_offset"].as_array().unwrap().len(), n);
    let joined: String = tokens.concat();
    let mut offset = 0;
    for (i, t) in tokens.iter().enumerate() {
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(chosen <= 0.0);
        let top = lp["top_logprobs"][i].as_object().unwrap();
        // The two alternatives and the chosen token, which greedy makes the first of them.
        assert!((1..=3).contains(&top.len()), "{lp}");
        assert_eq!(top.get(*t).and_then(|x| x.as_f64()), Some(chosen), "{lp}");
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(chosen, best, "{lp}");
        if !joined.contains('\u{FFFD}') {
            assert_eq!(lp["text_offset"][i].as_u64(), Some(offset as u64), "{lp}");
            offset += t.chars().count();
        }
    }
    if !joined.contains('\u{FFFD}') {
        assert_eq!(joined, text);
    }
    let mut sc = cbody.clone();
    sc["stream"] = json!(true);
    let s = read_stream(c, "/v1/completions", &sc);
    assert_eq!(s.text, text);
    let mut merged = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []});
    for chunk in &s.logprobs {
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let items = chunk[key].as_array().unwrap().clone();
            merged[key].as_array_mut().unwrap().extend(items);
        }
    }
    assert_eq!(merged, lp);

    // With a stop sequence: the reported tokens cover the text and end within the stop.
    let words: Vec<&str> = text.split_whitespace().collect();
    if words.len() >= 3 && !joined.contains('\u{FFFD}') {
        let mut sb = cbody.clone();
        sb["stop"] = json!([words[2]]);
        let v = c.post_json("/v1/completions", &sb).unwrap().json();
        let cut = v["choices"][0]["text"].as_str().unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        let tokens: Vec<&str> = v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        let covered: String = tokens.concat();
        assert!(covered.starts_with(cut), "{covered:?} vs {cut:?}");
        let last = tokens.last().map_or(0, |t| t.len());
        assert!(
            covered.len() < cut.len() + last.max(1),
            "{covered:?} vs {cut:?}"
        );
        assert!(tokens.len() as u64 <= v["usage"]["completion_tokens"].as_u64().unwrap());
    }

    // Penalties: a prompt the model answers by repeating itself, the same length either way.
    let repeat = |extra: serde_json::Value| -> (String, usize) {
        let mut b = json!({"prompt": "la la la la la la la la la la la la la la la la",
                           "temperature": 0, "max_tokens": 24, "ignore_eos": true,
                           "logprobs": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let r = c.post_json("/v1/completions", &b).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let tokens: Vec<String> = v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect();
        let distinct: std::collections::HashSet<&String> = tokens.iter().collect();
        let text = v["choices"][0]["text"].as_str().unwrap().to_string();
        (text, tokens.len() - distinct.len())
    };
    let (plain_text, plain_repeats) = repeat(json!({}));
    let (pen_text, pen_repeats) = repeat(json!({"frequency_penalty": 2}));
    let (pres_text, _) = repeat(json!({"presence_penalty": 2}));
    eprintln!(
        "repeated tokens: {plain_repeats} without a penalty ({plain_text:?}), {pen_repeats} with frequency_penalty 2 ({pen_text:?}); presence_penalty 2: {pres_text:?}"
    );
    assert!(
        plain_repeats >= 12,
        "the prompt should make the model repeat: {plain_text:?}"
    );
    assert!(
        pen_repeats < plain_repeats,
        "{pen_text:?} vs {plain_text:?}"
    );
    assert_ne!(pres_text, plain_text);
    // The same penalized request is deterministic.
    assert_eq!(repeat(json!({"frequency_penalty": 2})).0, pen_text);
}
