//! Speculative decoding in `tp serve`, end to end: a synthetic model served at tp 1 and 2
//! on local rank threads gives eight concurrent requests (mixed lengths, stop strings,
//! `max_tokens` ends, seeded sampling, log-probabilities; and a KV budget small enough to
//! preempt, where the texts are compared) exactly the
//! answers it gives without speculation, with n-gram drafts accepted along the way (the
//! /metrics counters say so). The oracle is the same server without speculation: each row's
//! logits do not depend on its batch, so speculation may change nothing a client sees.

mod common;

use common::{config, metric, with_server};
use serde_json::{json, Value};
use std::sync::Arc;
use tp_engine::spec::ngram_lookup;
use tp_engine::{DraftTokens, Drafter, DrafterSource, SpecMethod};
use tp_serve::client::Client;
use tp_serve::{KvBudget, ServeConfig, ServeSpec};

/// Eight requests: repetitive prompts (n-gram drafts find matches), greedy with and
/// without stop strings and end tokens, and seeded sampling.
fn requests() -> Vec<Value> {
    let rep = "one two three four one two three four one two";
    vec![
        json!({"prompt": rep, "max_tokens": 60, "temperature": 0, "ignore_eos": true}),
        json!({"prompt": "abcabcabcabc", "max_tokens": 40, "temperature": 0}),
        json!({"prompt": rep, "max_tokens": 50, "temperature": 0, "ignore_eos": true,
            "stop": ["ee f", "o t"]}),
        json!({"prompt": "x", "max_tokens": 3, "temperature": 0, "ignore_eos": true}),
        json!({"prompt": "the cat sat on the mat and the cat", "max_tokens": 45,
            "temperature": 1.2, "top_p": 0.9, "seed": 11, "ignore_eos": true}),
        json!({"prompt": "la la la la la", "max_tokens": 70, "temperature": 0.7, "seed": 5,
            "top_k": 8}),
        json!({"prompt": "0123456789012345678901234567890123456789", "max_tokens": 30,
            "temperature": 0, "ignore_eos": true, "logprobs": 2}),
        json!({"prompt": "Once upon a time", "max_tokens": 80, "temperature": 0,
            "ignore_eos": true}),
    ]
}

/// Every request's (text, finish reason, completion tokens, logprobs) sent at once, and
/// the speculation counters (drafted, accepted) and the preemptions.
fn answers(tp: usize, cfg: ServeConfig) -> (Vec<Value>, f64, f64, f64) {
    with_server(tp, 256, cfg, |ready| {
        let c = Client::new(ready.addr);
        let got: Vec<Value> = std::thread::scope(|s| {
            let hs: Vec<_> = requests()
                .into_iter()
                .map(|body| {
                    let c = c.clone();
                    s.spawn(move || {
                        let r = c.post_json("/v1/completions", &body).unwrap();
                        assert_eq!(r.status, 200, "{body}: {}", r.text());
                        let v = r.json();
                        let ch = &v["choices"][0];
                        json!([
                            ch["text"],
                            ch["finish_reason"],
                            v["usage"]["completion_tokens"],
                            ch["logprobs"]
                        ])
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        (
            got,
            metric(&c, "tp_spec_drafted_tokens_total"),
            metric(&c, "tp_spec_accepted_tokens_total"),
            metric(&c, "tp_preemptions_total"),
        )
    })
    .1
}

/// N-gram drafts with every other one moved to the next byte: drafts are rejected often.
struct Spoiled;

struct SpoiledDrafter(usize);

impl Drafter for SpoiledDrafter {
    fn draft(&mut self, history: &[u32], k: usize) -> tp_engine::error::Result<Vec<u32>> {
        self.0 += 1;
        let mut d = ngram_lookup(history, 4, k);
        if self.0.is_multiple_of(2) {
            if let Some(t) = d.first_mut() {
                *t = (*t + 1) % 256;
            }
        }
        Ok(d)
    }
}

impl DrafterSource for Spoiled {
    fn drafter(&self) -> tp_engine::error::Result<Box<dyn Drafter>> {
        Ok(Box::new(SpoiledDrafter(0)))
    }
    fn describe(&self) -> String {
        "spoiled n-gram".into()
    }
}

/// The answers without their log-probabilities.
fn texts(answers: &[Value]) -> Vec<Value> {
    answers.iter().map(|a| json!([a[0], a[1], a[2]])).collect()
}

/// Eight sequences over `budget`, no prefix sharing, speculating with `spec`.
fn unshared(budget: KvBudget, spec: Option<ServeSpec>) -> ServeConfig {
    ServeConfig {
        max_seqs: 8,
        kv_budget: budget,
        prefix_cache: false,
        spec,
        ..config()
    }
}

#[test]
fn ngram_speculation_changes_no_answer() {
    for tp in [1, 2] {
        let plain = ServeConfig {
            max_seqs: 8,
            ..config()
        };
        let (want, drafted, _, preempted) = answers(tp, plain.clone());
        assert_eq!((drafted, preempted), (0.0, 0.0));
        // Eight blocks of 32 positions for eight requests of up to 120: some are preempted
        // and recomputed, with and without speculation. Only the texts, finish reasons and
        // counts are compared then: a recomputed request's log-probabilities differ now and
        // then from the unpreempted ones in plain serving too (about 1 run in 10 here, its
        // text unchanged), a fault outside speculation.
        let small = KvBudget::Positions(256);
        let (tight, _, _, preempted) = answers(tp, unshared(small, None));
        assert_eq!(
            texts(&tight),
            texts(&want),
            "tp {tp}: a small budget changed an answer"
        );
        // Whether the small budget preempts depends on when the requests reach the scheduler
        // (under load they may trickle in and fit): not asserted here. The scheduler tests
        // (`spec::tests`, a scripted executor) preempt deterministically and check the same
        // texts with every drafter.
        if preempted == 0.0 {
            eprintln!("tp {tp}: the small budget preempted nothing in this run");
        }
        let ngram: Arc<dyn DrafterSource> = Arc::new(SpecMethod::Ngram);
        let spoiled: Arc<dyn DrafterSource> = Arc::new(Spoiled);
        let big = config().kv_budget;
        for (source, k, budget) in [
            (&ngram, None, big),
            (&ngram, Some(4), big),
            (&ngram, Some(6), small),
            (&spoiled, Some(2), small),
            (&spoiled, Some(3), big),
            (&spoiled, None, small),
        ] {
            let name = source.describe();
            let spec = ServeSpec {
                source: source.clone(),
                tokens: DraftTokens::new(k).unwrap(),
                batch: tp_serve::SpecBatch::Always,
            };
            let cfg = if budget == small {
                unshared(small, Some(spec))
            } else {
                ServeConfig {
                    max_seqs: 8,
                    kv_budget: budget,
                    spec: Some(spec),
                    ..config()
                }
            };
            let (got, drafted, accepted, preempted) = answers(tp, cfg);
            eprintln!(
                "tp {tp} {name} k {k:?}: {accepted} of {drafted} drafts accepted, {preempted} preemptions"
            );
            // Log-probabilities only where nothing was preempted (see above).
            let (got, want) = if budget == small || preempted > 0.0 {
                (texts(&got), texts(&want))
            } else {
                (got, want.clone())
            };
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "tp {tp}, {name}, k {k:?}, request {i}");
            }
            assert!(
                accepted > 0.0,
                "tp {tp} {name} k {k:?}: {accepted} of {drafted}"
            );
            if name.starts_with("spoiled") {
                assert!(
                    accepted < drafted,
                    "tp {tp}: every spoiled draft was accepted"
                );
            }
        }
    }
}
