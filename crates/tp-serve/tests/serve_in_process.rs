//! `tp_serve::serve` called from Rust, without the `tp` binary: a synthetic model at tp 2 on
//! local rank threads answers requests, then stops through its `StopHandle`, drains and
//! returns, and rank 0 releases the follower. Under a KV budget too small for everyone,
//! requests are preempted and still get their text.

mod common;

use common::{complete, config, metric, settled_metric, with_server};
use serde_json::json;
use tp_serve::client::Client;
use tp_serve::{ConnLimits, KvBudget, ServeConfig};

#[test]
fn serve_answers_from_rust_and_stops_on_its_handle() {
    let ctx = 64;
    let (ready, (health, status, body)) = with_server(2, ctx, config(), |ready| {
        let c = Client::new(ready.addr);
        let health = c.get("/health").unwrap().status;
        let body = json!({"prompt": "hello", "max_tokens": 5, "temperature": 0});
        let answer = c.post_json("/v1/completions", &body).unwrap();
        (health, answer.status, answer.json())
    });
    assert_eq!(ready.tp, 2);
    assert_eq!(ready.ctx_size, ctx);
    // The busiest rank holds one of the 2 KV heads: 2 layers x (K, V) x 32 x 4 bytes.
    assert_eq!(ready.kv.bytes_per_position(), 2 * 2 * 32 * 4);
    assert_eq!(ready.kv.blocks, (1 << 20) / ready.kv.bytes_per_block);
    assert_eq!(ready.kv.bytes_per_block, 32 * ready.kv.bytes_per_position());
    assert_eq!(health, 200);
    assert_eq!(status, 200, "{body}");
    let n = body["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=5).contains(&n), "{body}");
}

/// 32 concurrent greedy requests of mixed lengths under a KV budget of 6 blocks (192
/// positions, a few requests' worth): requests are preempted and recomputed, every one
/// completes, and each gets the text it gets alone. The prefix cache is off so that the
/// memory comes back: after them the blocks in use are 0.
#[test]
fn preempted_requests_all_complete_with_the_text_they_get_alone() {
    let cfg = ServeConfig {
        kv_budget: KvBudget::Positions(192),
        max_seqs: 8,
        max_queue: 64,
        prefix_cache: false,
        connections: ConnLimits {
            max_connections: 64,
            ..config().connections
        },
        ..config()
    };
    let requests: Vec<(String, usize)> = (0..32)
        .map(|i| {
            let prompt: String = (0..3 + (i * 7) % 45)
                .map(|k| char::from(b'a' + ((i + k * 3) % 26) as u8))
                .collect();
            (prompt, 8 + (i * 11) % 50)
        })
        .collect();
    let (_, (alone, together, preemptions, used)) = with_server(2, 256, cfg, |ready| {
        let c = Client::new(ready.addr);
        let alone: Vec<String> = requests.iter().map(|(p, n)| complete(&c, p, *n)).collect();
        let together: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = requests
                .iter()
                .map(|(p, n)| {
                    let c = c.clone();
                    s.spawn(move || complete(&c, p, *n))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        (
            alone,
            together,
            metric(&c, "tp_preemptions_total"),
            settled_metric(&c, "tp_kv_blocks_used", 0.0),
        )
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "request {i}");
    }
    assert!(preemptions > 0.0, "no request was preempted");
    assert_eq!(used, 0.0);
}
