//! The tp-serve integration tests' kit: a synthetic model (the byte tokenizer's vocabulary)
//! served in process at tp N on local rank threads through `tp_serve::serve`, and the client
//! calls and `/metrics` readings the tests share.
#![allow(dead_code)] // each test binary uses its own part of the kit

pub mod reload;

use serde_json::json;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;
use tp_comm::local::{self, LocalOptions};
use tp_engine::load_stats::{self, Counting, LoadStats};
use tp_engine::{Command, ReloadSpec, Session, Worker};
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{open_checkpoint, Arch, LoadOptions, ModelConfig, ShardedModel};
use tp_serve::client::Client;
use tp_serve::{ConnLimits, KvBudget, Ready, ServeConfig};
use tp_tokenizer::Tokenizer;

/// A loopback server of 4 sequences, 64 tokens a step and a KV budget of 1 MiB per rank.
pub fn config() -> ServeConfig {
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
        canary: None,
        admin_key: None,
        spec: None,
        swap: Default::default(),
        unhealthy_linger: Duration::ZERO,
    }
}

/// Serves a synthetic model (the byte tokenizer's vocabulary, so every token decodes) at
/// `tp` on local rank threads with `serve_cfg` while `drive` talks to it through the address
/// it reports; stops the server once `drive` returns, and checks every rank ended cleanly.
pub fn with_server<T: Send>(
    tp: usize,
    ctx: usize,
    serve_cfg: ServeConfig,
    drive: impl FnOnce(&Ready) -> T + Send,
) -> (Ready, T) {
    with_model(tp, ctx, Model::default(), serve_cfg, drive)
}

/// A synthetic model of the shape [`with_server`] serves (the byte tokenizer's vocabulary).
#[derive(Clone, Copy, Debug)]
pub struct Model {
    pub seed: u64,
    /// The LM head is the embedding (a tied head mostly repeats the last token, whatever the
    /// seed; an untied one answers differently per seed).
    pub tied: bool,
}

impl Default for Model {
    /// The model [`with_server`] serves.
    fn default() -> Self {
        Model {
            seed: 7,
            tied: true,
        }
    }
}

/// A fresh directory for one test's files.
pub fn test_dir() -> std::path::PathBuf {
    // Tests run in parallel in one process: each its own directory.
    static DIRS: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tp-serve-test-{}-{}",
        std::process::id(),
        DIRS.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `model` as the synthetic model it is (a context of at least `ctx`).
fn synthetic(ctx: usize, model: Model) -> SyntheticModel {
    let cfg = ModelConfig {
        vocab: Tokenizer::bytes(&["<|endoftext|>"]).vocab_size(),
        context: ctx.max(128),
        tied_embeddings: model.tied,
        ..SyntheticModel::small(Arch::Llama, 7).cfg
    };
    SyntheticModel::new(cfg, model.seed)
}

/// Writes `model` (a context of at least `ctx`) to `path`.
pub fn write_model(path: &std::path::Path, ctx: usize, model: Model) {
    synthetic(ctx, model)
        .write_gguf(path, GgufTypes::F32)
        .unwrap();
}

/// Writes `model` with NaN in its final norm to `path`: it loads, and every request on it
/// fails with the NaN-logits error (a broken model file).
pub fn write_nan_model(path: &std::path::Path, ctx: usize, model: Model) {
    let mut m = synthetic(ctx, model);
    let hidden = m.cfg.hidden;
    m.set_weight(tp_models::WeightName::OutputNorm, vec![f32::NAN; hidden])
        .unwrap();
    m.write_gguf(path, GgufTypes::F32).unwrap();
}

/// [`with_server`] serving `model`; every rank may load further models of the same layout
/// (the admin reload), and the model's file stays until the server stops (a drain swap
/// loads it back from there).
pub fn with_model<T: Send>(
    tp: usize,
    ctx: usize,
    model: Model,
    mut serve_cfg: ServeConfig,
    drive: impl FnOnce(&Ready) -> T + Send,
) -> (Ready, T) {
    let tokenizer = Tokenizer::bytes(&["<|endoftext|>"]);
    let dir = test_dir();
    let path = dir.join("m.gguf");
    write_model(&path, ctx, model);
    let ckpt = open_checkpoint(&path).unwrap();
    serve_cfg.swap.model_path.get_or_insert(path);
    let _cleanup = RemoveOnDrop(dir);
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
                let counting = Counting::new(&*ckpt);
                let t0 = std::time::Instant::now();
                let model = ShardedModel::load(&counting, rank, tp, LoadOptions::default(), ctx)
                    .map_err(|e| e.to_string())?;
                let mine = LoadStats {
                    bytes: counting.bytes(),
                    time: t0.elapsed(),
                };
                let load = load_stats::gather(&g, mine).map_err(|e| e.to_string())?;
                let mut worker = Worker::new(model, g);
                worker.enable_reload(ReloadSpec {
                    weights: tp_models::RankWeights::even(tp),
                    load: LoadOptions::default(),
                    ctx,
                    sync: tp_models::SyncMode::Exact,
                    deadline: Duration::from_secs(30),
                });
                if rank != 0 {
                    return worker.follow().map_err(|e| e.to_string());
                }
                let mut session = Session {
                    worker,
                    tokenizer: tokenizer.clone(),
                    ctx_size: ctx,
                    memory: memory.clone(),
                    weights: tp_models::RankWeights::even(tp),
                    load,
                    draft: None,
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

/// Removes a test's directory when dropped (also when the test fails).
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A metric without labels from the server's `/metrics` (0 before it is first set).
pub fn metric(c: &Client, name: &str) -> f64 {
    let text = c.get("/metrics").unwrap().text();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// `name`'s value once it is `want` (the scheduler closes a sequence just after its answer
/// goes out), or its last value after 5 s.
pub fn settled_metric(c: &Client, name: &str, want: f64) -> f64 {
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
pub fn complete(c: &Client, prompt: &str, max_tokens: usize) -> String {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true});
    let r = c.post_json("/v1/completions", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["text"].as_str().unwrap().to_string()
}

/// [`with_server`] at tp 2 with a context of 160, handing `client` a client of it.
pub fn with_client<T: Send>(serve_cfg: ServeConfig, client: impl FnOnce(&Client) -> T + Send) -> T {
    with_server(2, 160, serve_cfg, |ready| client(&Client::new(ready.addr))).1
}

/// This process's resident memory (Linux), `None` elsewhere.
pub fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}
