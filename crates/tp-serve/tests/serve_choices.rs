//! `n` choices per request, end to end: a synthetic model at tp 2 on local rank threads
//! serves `/v1/completions` and `/v1/chat/completions`; requests for several choices get them
//! indexed, counted (the prompt once) and streamed interleaved, and the scheduler computes
//! their shared prompt once (its prefix-cache counter says so).

mod common;

use common::{config, metric, with_client};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tp_serve::client::Client;
use tp_serve::ServeConfig;

fn post(c: &Client, path: &str, body: &Value) -> Value {
    let r = c.post_json(path, body).unwrap();
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    r.json()
}

fn texts(body: &Value) -> Vec<String> {
    body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect()
}

fn indices(body: &Value) -> Vec<u64> {
    body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect()
}

#[test]
fn several_choices_share_the_prompt_and_are_indexed_counted_and_streamed() {
    with_client(config(), |c| {
        // Sampled choices (each with its own seed, seed + index: choices.rs's unit tests check
        // the jobs; this synthetic model's logits are too peaked for a seed to change its
        // text, so only the counts and the reproducibility show here).
        let hits_before = metric(c, "tp_prefix_cache_hits_total");
        let sampled = json!({"prompt": "Once upon a time, in a land", "max_tokens": 8,
            "temperature": 1.0, "seed": 42, "n": 3, "ignore_eos": true});
        let body = post(c, "/v1/completions", &sampled);
        // The three choices computed the prompt once: two (or all three) started as forks.
        let hits = metric(c, "tp_prefix_cache_hits_total") - hits_before;
        assert!(
            hits >= 2.0,
            "prefix-cache hits {hits} after an n = 3 request"
        );
        assert_eq!(indices(&body), vec![0, 1, 2], "{body}");
        let sampled_texts = texts(&body);
        let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(prompt_tokens, 27, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 3 * 8, "{body}");
        assert_eq!(body["usage"]["total_tokens"], prompt_tokens + 24, "{body}");
        for choice in body["choices"].as_array().unwrap() {
            assert_eq!(choice["finish_reason"], "length", "{body}");
            assert_eq!(choice["logprobs"], Value::Null, "{body}");
        }
        assert_eq!(texts(&post(c, "/v1/completions", &sampled)), sampled_texts);

        // Greedy choices are all the greedy answer.
        let greedy = json!({"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0,
            "logprobs": 2});
        let single = post(c, "/v1/completions", &greedy);
        let mut three = greedy.clone();
        three["n"] = json!(3);
        let body = post(c, "/v1/completions", &three);
        assert_eq!(indices(&body), vec![0, 1, 2], "{body}");
        assert_eq!(texts(&body), vec![texts(&single)[0].clone(); 3], "{body}");
        for choice in body["choices"].as_array().unwrap() {
            assert_eq!(
                choice["finish_reason"],
                single["choices"][0]["finish_reason"]
            );
            assert_eq!(choice["logprobs"], single["choices"][0]["logprobs"]);
        }
        let u = &single["usage"];
        assert_eq!(body["usage"]["prompt_tokens"], u["prompt_tokens"], "{body}");
        assert_eq!(
            body["usage"]["completion_tokens"],
            3 * u["completion_tokens"].as_u64().unwrap(),
            "{body}"
        );

        // Streamed choices: chunks of both, each ending with its own finish chunk, the usage
        // chunk summing them, one [DONE] at the very end.
        let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": true, "n": 2, "stream": true,
            "stream_options": {"include_usage": true}});
        let mut events = c.stream("/v1/chat/completions", &chat).unwrap();
        assert_eq!(events.status, 200);
        let mut data = Vec::new();
        while let Some(d) = events.next_data().unwrap() {
            data.push(d);
        }
        assert_eq!(
            data.iter().filter(|d| *d == "[DONE]").count(),
            1,
            "{data:?}"
        );
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
        let chunks: Vec<Value> = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let (usage, choices) = chunks.split_last().unwrap();
        assert_eq!(usage["choices"], json!([]), "{usage}");
        let mut streamed = [String::new(), String::new()];
        let mut roles = [0, 0];
        let mut finishes = Vec::new();
        for chunk in choices {
            assert_eq!(chunk["object"], "chat.completion.chunk", "{chunk}");
            let choice = &chunk["choices"][0];
            let i = choice["index"].as_u64().unwrap() as usize;
            assert!(i < 2, "{chunk}");
            assert!(
                !finishes.contains(&i),
                "a chunk after choice {i} finished: {chunk}"
            );
            if choice["delta"]["role"] == "assistant" {
                roles[i] += 1;
            }
            if let Some(t) = choice["delta"]["content"].as_str() {
                streamed[i].push_str(t);
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                assert_eq!(f, "length", "{chunk}");
                finishes.push(i);
            }
        }
        assert_eq!(roles, [1, 1], "{data:?}");
        finishes.sort();
        assert_eq!(finishes, vec![0, 1], "{data:?}");
        assert_eq!(streamed[0], streamed[1], "{data:?}");
        assert!(!streamed[0].is_empty(), "{data:?}");
        assert_eq!(usage["usage"]["completion_tokens"], 2 * 5, "{usage}");
        let prompt_tokens = usage["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(
            usage["usage"]["total_tokens"],
            prompt_tokens + 10,
            "{usage}"
        );
        // The same text as the whole answer.
        let mut whole = chat.clone();
        whole["stream"] = json!(false);
        whole["stream_options"] = Value::Null;
        whole["n"] = json!(1);
        let body = post(c, "/v1/chat/completions", &whole);
        assert_eq!(
            body["choices"][0]["message"]["content"],
            streamed[0].as_str()
        );
        assert_eq!(body["usage"]["prompt_tokens"], prompt_tokens);

        // More choices than the server gives: 400 naming n and the limit.
        let r = c
            .post_json("/v1/completions", &json!({"prompt": "x", "n": 9}))
            .unwrap();
        assert_eq!(r.status, 400, "{}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["param"], "n");
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("at most 8"),
            "{e}"
        );
    });
}

#[test]
fn a_client_that_goes_away_cancels_every_choice() {
    // One sequence at a time: while choice 0 generates, choices 1 and 2 wait in the queue.
    let serve_cfg = ServeConfig {
        max_seqs: 1,
        ..config()
    };
    with_client(serve_cfg, |c| {
        let body = json!({"prompt": "x", "max_tokens": 150, "temperature": 0,
            "ignore_eos": true, "n": 3, "stream": true});
        let mut events = c.stream("/v1/completions", &body).unwrap();
        assert_eq!(events.status, 200);
        assert!(events.next_data().unwrap().is_some());
        drop(events);
        // The scheduler drops the choices still waiting (and the running one, unless it
        // finished first) and nothing is left running or queued.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let cancelled = metric(c, "tp_requests_cancelled_total");
            let running = metric(c, "tp_running_requests");
            let queued = metric(c, "tp_queue_length");
            if cancelled >= 2.0 && running == 0.0 && queued == 0.0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "cancelled {cancelled}, running {running}, queued {queued}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(metric(c, "tp_generation_tokens_total") < 3.0 * 150.0);
    });
}
