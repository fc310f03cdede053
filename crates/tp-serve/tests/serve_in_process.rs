//! `tp_serve::serve` called from Rust, without the `tp` binary: a synthetic model at tp 2 on
//! local rank threads answers requests, then stops through its `StopHandle`, drains and
//! returns, and rank 0 releases the follower.

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

#[test]
fn serve_answers_from_rust_and_stops_on_its_handle() {
    let tokenizer = Tokenizer::bytes(&["<|endoftext|>"]);
    // The synthetic shape with the byte tokenizer's vocabulary, so every token decodes.
    let cfg = ModelConfig {
        vocab: tokenizer.vocab_size(),
        ..SyntheticModel::small(Arch::Llama, 7).cfg
    };
    let dir = std::env::temp_dir().join(format!("tp-serve-in-process-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.gguf");
    SyntheticModel::new(cfg, 7)
        .write_gguf(&path, GgufTypes::F32)
        .unwrap();
    let ckpt = open_checkpoint(&path).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let (tp, ctx) = (2, 64);
    let memory = tp_engine::session::memory_plan(
        &*ckpt,
        &tp_models::RankWeights::even(tp),
        ctx,
        LoadOptions::default(),
    )
    .unwrap();
    let serve_cfg = config();

    let (tx, rx) = mpsc::channel::<Ready>();
    let client = std::thread::spawn(move || {
        let ready = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the server reports its address");
        let c = Client::new(ready.addr);
        let health = c.get("/health").unwrap().status;
        let body = json!({"prompt": "hello", "max_tokens": 5, "temperature": 0});
        let answer = c.post_json("/v1/completions", &body).unwrap();
        ready.stop.stop();
        (ready, health, answer.status, answer.json())
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
    let (ready, health, status, body) = client.join().unwrap();
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
