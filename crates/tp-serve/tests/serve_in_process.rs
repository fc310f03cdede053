//! `tp_serve::serve` called from Rust, without the `tp` binary: a synthetic model at tp 2 on
//! local rank threads answers requests, then stops through its `StopHandle`, drains and
//! returns, and rank 0 releases the follower. Under a KV budget too small for everyone,
//! requests are preempted and still get their text; memory comes back after 100 requests.

use serde_json::json;
use std::net::IpAddr;
use std::sync::mpsc;
use std::time::Duration;
use tp_comm::local::{self, LocalOptions};
use tp_engine::{Command, Session, Worker};
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{open_checkpoint, Arch, LoadOptions, ModelConfig, ShardedModel};
use tp_serve::client::Client;
use tp_serve::{ConnLimits, KvBudget, Ready, ServeConfig};

use tp_tokenizer::Tokenizer;

fn config() -> ServeConfig {
    ServeConfig {
        host: IpAddr::from([127, 0, 0, 1]),
        port: 0,
        api_key: None,
        public_health: false,
        model_name: "synthetic".into(),
        kv_budget: KvBudget::Bytes(1 << 20),
        max_seqs: 4,
        max_batch_tokens: 64,
        max_queue: 8,
        max_n: tp_serve::DEFAULT_MAX_N,
        max_body_bytes: tp_serve::DEFAULT_MAX_BODY_BYTES,
        drain_timeout: Duration::from_secs(5),
        term_drain_timeout: Duration::from_secs(5),
        collective_timeout: Duration::from_secs(30),
        connections: ConnLimits {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(10),
            max_connections: 16,
        },
        log: false,
        auth_hint: None,
        prefix_cache: true,
    }
}

/// Serves a synthetic model (the byte tokenizer's vocabulary, so every token decodes) at
/// `tp` on local rank threads with `serve_cfg` while `drive` talks to it through the address
/// it reports; stops the server once `drive` returns, and checks every rank ended cleanly.
fn with_server<T: Send>(
    tp: usize,
    ctx: usize,
    serve_cfg: ServeConfig,
    drive: impl FnOnce(&Ready) -> T + Send,
) -> (Ready, T) {
    let tokenizer = Tokenizer::bytes(&["<|endoftext|>"]);
    let cfg = ModelConfig {
        vocab: tokenizer.vocab_size(),
        context: ctx.max(128),
        ..SyntheticModel::small(Arch::Llama, 7).cfg
    };
    let dir = std::env::temp_dir().join(format!(
        "tp-serve-in-process-{}-{tp}-{ctx}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.gguf");
    SyntheticModel::new(cfg, 7)
        .write_gguf(&path, GgufTypes::F32)
        .unwrap();
    let ckpt = open_checkpoint(&path).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let memory = tp_engine::session::memory_plan(
        &*ckpt,
        &tp_models::RankWeights::even(tp),
        ctx,
        LoadOptions::default(),
    )
    .unwrap();
    let (tx, rx) = mpsc::channel::<Ready>();
    std::thread::scope(|s| {
        let client = s.spawn(move || {
            let ready = rx
                .recv_timeout(Duration::from_secs(120))
                .expect("the server reports its address");
            // Stop the server even when `drive` fails, so the ranks end and the failure shows.
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drive(&ready)));
            ready.stop.stop();
            match out {
                Ok(out) => (ready, out),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        });
        let outcomes = local::run(
            tp,
            LocalOptions {
                timeout: Duration::from_secs(60),
            },
            |g| -> Result<(), String> {
                let rank = g.rank();
                let model = ShardedModel::load(&*ckpt, rank, tp, LoadOptions::default(), ctx)
                    .map_err(|e| e.to_string())?;
                let mut worker = Worker::new(model, g);
                if rank != 0 {
                    return worker.follow().map_err(|e| e.to_string());
                }
                let mut session = Session {
                    worker,
                    tokenizer: tokenizer.clone(),
                    ctx_size: ctx,
                    memory: memory.clone(),
                    weights: tp_models::RankWeights::even(tp),
                };
                let served = tp_serve::serve(&mut session, &serve_cfg, |r| {
                    let _ = tx.send(r.clone());
                    Ok(())
                });
                let _ = session.worker.submit(Command::Exit);
                served.map_err(|e| e.to_string())
            },
        )
        .unwrap();
        for (rank, o) in outcomes.into_iter().enumerate() {
            assert_eq!(o, Ok(Ok(())), "rank {rank}");
        }
        client.join().expect("the client thread panicked")
    })
}

/// The value of the metric line that starts with `name ` on the server's `/metrics`.
fn metric(c: &Client, name: &str) -> f64 {
    let text = c.get("/metrics").unwrap().text();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// `name`'s value once it is `want` (the scheduler closes a sequence just after its answer
/// goes out), or its last value after 5 s.
fn settled_metric(c: &Client, name: &str, want: f64) -> f64 {
    let t0 = std::time::Instant::now();
    loop {
        let v = metric(c, name);
        if v == want || t0.elapsed() > Duration::from_secs(5) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A greedy completion's text.
fn complete(c: &Client, prompt: &str, max_tokens: usize) -> String {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true});
    let r = c.post_json("/v1/completions", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["text"].as_str().unwrap().to_string()
}

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

/// Resident memory after 100 finished requests is back within 5% of what the idle server
/// held (KV blocks are returned to the system as requests end; the prefix cache is off).
#[test]
fn memory_returns_to_the_idle_baseline_after_100_requests() {
    let cfg = ServeConfig {
        prefix_cache: false,
        max_queue: 64,
        ..config()
    };
    let (_, (idle, after)) = with_server(2, 512, cfg, |ready| {
        let c = Client::new(ready.addr);
        // Warm-up: first touches of the weights, the HTTP stack and the allocator's arenas.
        for i in 0..8 {
            complete(&c, &"warm ".repeat(20 + i), 100);
        }
        assert_eq!(settled_metric(&c, "tp_kv_blocks_used", 0.0), 0.0);
        let idle = rss_bytes();
        std::thread::scope(|s| {
            for t in 0..4 {
                let c = c.clone();
                s.spawn(move || {
                    for i in 0..25 {
                        let prompt = format!("request {t} {i} ").repeat(3 + i % 9);
                        complete(&c, &prompt, 60 + i * 5);
                    }
                });
            }
        });
        assert_eq!(settled_metric(&c, "tp_kv_blocks_used", 0.0), 0.0);
        (idle, rss_bytes())
    });
    if let (Some(idle), Some(after)) = (idle, after) {
        assert!(
            after as f64 <= idle as f64 * 1.05,
            "resident memory {after} bytes after 100 requests, {idle} idle"
        );
    }
}

/// This process's resident memory (Linux), `None` elsewhere.
fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}
