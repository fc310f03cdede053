//! The server as one call: [`serve`] takes rank 0's [`Session`] (a loaded model leading its
//! tp group) and a [`ServeConfig`], and does everything `tp serve` does after its flags are
//! read: the KV budget in blocks (from the session's memory plan, without reopening the
//! model), the HTTP front end, the continuous-batching scheduler on the calling thread, and
//! the drain on shutdown. `tp serve` and `tp bench serve` both start servers through it.

use crate::canary::{Canaries, CanaryConfig};
use crate::client::Client;
use crate::dashboard::RankSetup;
use crate::error::{Result, ServeError};
use crate::http::admin::{AdminConfig, Layout};
use crate::http::conn::ConnLimits;
use crate::http::server::{Server, ServerConfig, StopHandle};
use crate::metrics::Metrics;
use crate::rollout::Admin;
use crate::scheduler::Control;
use crate::scheduler::{Load, SchedulerConfig, SchedulerHandle};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tp_engine::kv_budget::{block_bytes, limiting_rank};
use tp_engine::{EngineError, Session};
use tp_models::{KvDtype, ModelConfig, RankWeights, BLOCK_POSITIONS};

pub use tp_engine::kv_budget::{KvBudget, DEFAULT_KV_BYTES};

/// Finished sequences the prefix cache keeps per sequence slot (`max_seqs`): enough for a
/// few system prompts and every recent conversation, few enough to scan each admission.
pub const PREFIX_CACHE_PER_SEQ: usize = 4;

/// Everything a server needs besides the model.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub host: IpAddr,
    /// 0: any free port (the bound address goes to the ready callback).
    pub port: u16,
    pub api_key: Option<String>,
    /// With a key, `GET /health` answers without it.
    pub public_health: bool,
    /// The name clients pass as `model`.
    pub model_name: String,
    pub kv_budget: KvBudget,
    /// Most requests generated at once.
    pub max_seqs: usize,
    /// Most tokens in one forward step.
    pub max_batch_tokens: usize,
    /// Requests waiting for admission beyond which new ones get 429 (a request for `n`
    /// choices counts `n`).
    pub max_queue: usize,
    /// Most choices (`n`) one request may ask for ([`crate::DEFAULT_MAX_N`] by default).
    pub max_n: usize,
    pub max_body_bytes: usize,
    pub drain_timeout: Duration,
    /// The drain after SIGTERM (shorter under mpirun, see [`ServerConfig`]).
    pub term_drain_timeout: Duration,
    /// The group's collective deadline: the idle heartbeat is at most a quarter of it, and a
    /// request waits at least twice it (and 120 s) for its next token.
    pub collective_timeout: Duration,
    pub connections: ConnLimits,
    /// One line per request on stderr, and the shutdown lines.
    pub log: bool,
    /// Added to the 401 message (see [`ServerConfig::auth_hint`]).
    pub auth_hint: Option<String>,
    /// Share the KV blocks of a common prefix between requests and keep finished sequences'
    /// blocks for later requests that begin alike (off: every request, and every choice of
    /// `n`, computes its whole prompt).
    pub prefix_cache: bool,
    /// Run this canary once the server is up and then periodically (see [`crate::canary`]).
    pub canary: Option<CanaryConfig>,
    /// The admin endpoints' key (reload, rollback; see [`crate::rollout`]): off when `None`.
    pub admin_key: Option<String>,
    /// Speculative decoding per request (see [`crate::spec`]); `None`: off.
    pub spec: Option<crate::spec::ServeSpec>,
    /// How a reload makes room for the new model.
    pub swap: SwapConfig,
    /// After the inference engine fails (a lost or stalled rank), how long the server keeps
    /// answering (`/health` 503 with the error, requests 503) before it returns the error,
    /// so that health checks see why; SIGTERM ends it sooner. Zero: it returns at once.
    pub unhealthy_linger: Duration,
}

/// How a reload makes room for the new model (see [`crate::rollout`]): beside the live one,
/// or in its place after a drain.
#[derive(Clone, Debug, Default)]
pub struct SwapConfig {
    pub policy: crate::rollout::SwapPolicy,
    /// Memory a reload's model may take on this host, in place of what the system reports
    /// available (`MemAvailable`) when the reload is asked for; `None`: what it reports.
    pub reload_memory: Option<u64>,
    /// Where the first model was loaded from, to load it back after a drain swap; `None`:
    /// unknown (a swap that must drain is then refused).
    pub model_path: Option<std::path::PathBuf>,
}

/// Longest wait for every rank to load a model on a reload.
pub const RELOAD_TIMEOUT: Duration = Duration::from_secs(1800);

/// The KV budget of a running server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPlan {
    /// Bytes of the limiting rank (the one that holds the fewest blocks).
    pub budget_bytes: u64,
    /// Bytes one block of [`BLOCK_POSITIONS`] positions takes on the limiting rank.
    pub bytes_per_block: usize,
    /// Blocks all sequences may hold together.
    pub blocks: usize,
}

impl KvPlan {
    /// Positions all sequences may hold together.
    pub fn positions(&self) -> usize {
        self.blocks.saturating_mul(BLOCK_POSITIONS)
    }

    /// Bytes one position takes on the limiting rank.
    pub fn bytes_per_position(&self) -> usize {
        self.bytes_per_block / BLOCK_POSITIONS
    }
}

/// What [`serve`] tells its caller once the server accepts connections.
#[derive(Clone, Debug)]
pub struct Ready {
    pub addr: SocketAddr,
    pub kv: KvPlan,
    pub tp: usize,
    pub ctx_size: usize,
    /// The draft model rank 0 holds and its KV pool (as many blocks as `kv`, paid from rank
    /// 0's budget beside the target's: `kv.bytes_per_block` includes its block there).
    pub draft: Option<tp_engine::draft_model::DraftPlan>,
    /// Starts the graceful shutdown, as SIGTERM would.
    pub stop: StopHandle,
}

/// The KV budget in blocks for `cfg` split by `weights`, with `budgets[r]` bytes on rank
/// `r` and caches of `kv_dtype`: every rank holds every block, so the rank that holds the
/// fewest bounds them (bytes per position and weights differ by rank under uneven weights).
pub fn kv_plan(
    cfg: &ModelConfig,
    weights: &RankWeights,
    kv_dtype: KvDtype,
    budgets: &[u64],
) -> Result<KvPlan> {
    let per_rank =
        block_bytes(cfg, weights, kv_dtype).map_err(|e| ServeError::from(EngineError::from(e)))?;
    kv_plan_blocks(&per_rank, budgets)
}

/// [`kv_plan`] from each rank's bytes per block (`per_rank[r]`, as the session's memory
/// plan gives them: a pipeline stage's block holds only its layers).
pub fn kv_plan_blocks(per_rank: &[usize], budgets: &[u64]) -> Result<KvPlan> {
    for &budget in budgets {
        // A budget is reserved as requests arrive; one larger than the machine would let
        // admissions outrun memory instead of queueing.
        if let Some(machine) = tp_models::limits::physical_memory().filter(|&m| budget > m) {
            return Err(ServeError::KvOverMachine { budget, machine });
        }
    }
    let kv = match limiting_rank(budgets, per_rank) {
        Some((r, blocks)) => KvPlan {
            budget_bytes: budgets[r],
            bytes_per_block: per_rank[r],
            blocks,
        },
        None => KvPlan {
            budget_bytes: 0,
            bytes_per_block: 1,
            blocks: 0,
        },
    };
    if kv.blocks < 1 {
        return Err(ServeError::KvTooSmall {
            budget: kv.budget_bytes,
            blocks: kv.blocks,
            per_block: kv.bytes_per_block,
        });
    }
    Ok(kv)
}

/// Serves `session`'s model until shut down (a signal, or [`Ready::stop`]), then drains and
/// returns. Binds first; `ready` runs once connections are accepted (print the address
/// there). The scheduler runs on the calling thread, which must be the one that owns
/// `session` (rank 0's); the caller releases the followers afterwards.
pub fn serve(
    session: &mut Session,
    cfg: &ServeConfig,
    ready: impl FnOnce(&Ready) -> Result<()>,
) -> Result<()> {
    if cfg.max_seqs == 0 || cfg.max_batch_tokens == 0 {
        return Err(ServeError::Config {
            name: if cfg.max_seqs == 0 {
                "max_seqs"
            } else {
                "max_batch_tokens"
            },
            message: "must be at least 1".into(),
        });
    }
    let tp = session.worker.group().size();
    let model = session.worker.model().config().clone();
    let weight_bytes: Vec<u64> = session
        .memory
        .iter()
        .map(|m| (m.sharded + m.replicated) as u64)
        .collect();
    // Every rank's (of every stage), from the memory plan.
    let per_block: Vec<usize> = session.memory.iter().map(|m| m.kv_block_bytes).collect();
    let budgets = cfg.kv_budget.rank_bytes(&weight_bytes, &per_block);
    let kv = kv_plan_blocks(&per_block, &budgets)?;
    let sched_cfg = SchedulerConfig {
        max_seqs: cfg.max_seqs,
        kv_blocks: kv.blocks,
        max_batch_tokens: cfg.max_batch_tokens,
        heartbeat: Duration::from_secs(1)
            .min(cfg.collective_timeout / 4)
            .max(Duration::from_millis(10)),
        prefix_sharing: cfg.prefix_cache,
        prefix_cache_entries: if cfg.prefix_cache {
            PREFIX_CACHE_PER_SEQ * cfg.max_seqs
        } else {
            0
        },
        spec: cfg.spec.clone(),
    };
    let canaries = Arc::new(Canaries::default());
    // The ranks whose processes run on this host (all of them with the local backend).
    let local_ranks: Vec<usize> = (0..tp)
        .filter(|&r| tp_engine::launch::host_of(r) == tp_engine::launch::host_of(0))
        .collect();
    let server_cfg = ServerConfig {
        host: cfg.host,
        port: cfg.port,
        api_key: cfg.api_key.clone(),
        public_health: cfg.public_health,
        model_name: cfg.model_name.clone(),
        ctx_size: session.ctx_size,
        kv_budget_positions: kv.positions(),
        vocab: model.vocab,
        max_body_bytes: cfg.max_body_bytes,
        max_queue: cfg.max_queue,
        max_n: cfg.max_n,
        drain_timeout: cfg.drain_timeout,
        term_drain_timeout: cfg.term_drain_timeout,
        event_timeout: Duration::from_secs(120).max(cfg.collective_timeout.saturating_mul(2)),
        connections: cfg.connections,
        log: cfg.log,
        auth_hint: cfg.auth_hint.clone(),
        admin: cfg.admin_key.as_ref().map(|key| AdminConfig {
            key: key.clone(),
            model: model.clone(),
            canary: cfg.canary.clone(),
            canaries: Arc::clone(&canaries),
            load_timeout: RELOAD_TIMEOUT,
            layout: session.worker.reload_spec().map(|spec| Layout {
                weights: session.weights.clone(),
                ctx: session.ctx_size,
                load: spec.load,
                local_ranks: local_ranks.clone(),
            }),
            swap: cfg.swap.policy,
            reload_memory: cfg.swap.reload_memory,
            first_weights: local_ranks
                .iter()
                .filter_map(|&r| session.memory.get(r))
                .map(|m| (m.sharded + m.replicated) as u64)
                .sum(),
        }),
    };
    let metrics = Arc::new(Metrics::new());
    metrics.set_ranks(&cfg.model_name, rank_setup(session));
    let load = Arc::new(Load::default());
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = SchedulerHandle {
        control: tx.clone(),
        load: Arc::clone(&load),
    };
    let server = Server::start(
        server_cfg,
        Arc::new(session.tokenizer.clone()),
        handle,
        Arc::clone(&metrics),
    )?;
    let info = Ready {
        addr: server.addr,
        kv,
        tp,
        ctx_size: session.ctx_size,
        draft: session.draft.clone(),
        stop: server.stop_handle(),
    };
    if let Err(e) = ready(&info) {
        server.stop();
        drop(rx);
        let _ = server.join();
        return Err(e);
    }
    // The canary talks to the server as a client does, from its own thread.
    let (canary_stop, canary_thread) = match cfg.canary.clone() {
        Some(c) => {
            let mut client = Client::new(loopback(info.addr));
            if let Some(k) = &cfg.api_key {
                client = client.with_api_key(k);
            }
            let (stop_tx, stop_rx) = std::sync::mpsc::channel();
            let m = Arc::clone(&metrics);
            let canaries = Arc::clone(&canaries);
            let control = std::sync::Mutex::new(tx.clone());
            // A failure on a model that came in by a switch rolls it back.
            let rollback = move |reason: String| {
                if let Ok(c) = control.lock() {
                    let _ = c.send(Control::Admin(Admin::Rollback {
                        reason,
                        automatic: true,
                        reply: None,
                    }));
                }
            };
            let t = std::thread::Builder::new()
                .name("tp-canary".into())
                .spawn(move || crate::canary::monitor(client, c, canaries, m, rollback, stop_rx))?;
            (Some(stop_tx), Some(t))
        }
        None => (None, None),
    };
    // The scheduler's own sender goes: the channel closes once the HTTP side and the
    // canary have let theirs go.
    drop(tx);
    let result = crate::scheduler::run_models(
        &mut session.worker,
        &session.tokenizer,
        &sched_cfg,
        &rx,
        &load,
        &metrics,
        cfg.model_name.clone(),
        cfg.swap
            .model_path
            .as_ref()
            .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
            .map(|p| p.display().to_string()),
    );
    // New requests now fail at once; the HTTP side drains what it holds.
    drop(rx);
    drop(canary_stop);
    if let Some(t) = canary_thread {
        let _ = t.join();
    }
    if let Err(e) = &result {
        let why = tp_engine::report::chain(e);
        metrics.engine_failed(why.clone());
        if cfg.unhealthy_linger.is_zero() {
            server.stop();
        } else {
            eprintln!(
                "# the inference engine failed: {why}\n# answering /health with 503 for {} s before exiting (SIGTERM ends it sooner)",
                cfg.unhealthy_linger.as_secs_f64()
            );
            let stop = server.stop_handle();
            let linger = cfg.unhealthy_linger;
            std::thread::spawn(move || {
                std::thread::sleep(linger);
                stop.stop();
            });
        }
    }
    let joined = server.join();
    result?;
    joined
}

/// `addr` as this machine reaches it (an unspecified address becomes loopback).
pub(crate) fn loopback(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        let ip: IpAddr = match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        };
        SocketAddr::new(ip, addr.port())
    } else {
        addr
    }
}

/// Each rank's host, load and memory for the dashboard.
fn rank_setup(session: &Session) -> Vec<RankSetup> {
    (0..session.worker.group().size())
        .map(|r| {
            let load = session.load.get(r);
            RankSetup {
                host: tp_engine::launch::host_of(r),
                load_seconds: load.map_or(0.0, |l| l.time.as_secs_f64()),
                load_bytes: load.map_or(0, |l| l.bytes),
                memory_bytes: session.memory.get(r).map_or(0, |m| m.total() as u64),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tp_models::Arch;

    /// The synthetic test shape: 2 layers, 8 query / 2 KV heads of 32.
    fn cfg() -> ModelConfig {
        tp_models::synthetic::SyntheticModel::small(Arch::Llama, 0).cfg
    }

    #[test]
    fn the_budget_is_counted_in_the_busiest_ranks_positions() {
        let c = cfg();
        let even = |tp| RankWeights::even(tp);
        // tp 1: 2 layers x (K and V) x 2 KV heads x 32 x 4 bytes.
        let one = kv_plan(&c, &even(1), KvDtype::F32, &[1 << 20]).unwrap();
        assert_eq!(one.bytes_per_position(), 2 * 2 * 2 * 32 * 4);
        assert_eq!(one.bytes_per_block, 32 * one.bytes_per_position());
        assert_eq!(one.blocks, (1 << 20) / one.bytes_per_block);
        assert_eq!(one.positions(), 32 * one.blocks);
        // tp 2: one KV head per rank, half the bytes, twice the blocks.
        let two = kv_plan(&c, &even(2), KvDtype::F32, &[1 << 20; 2]).unwrap();
        assert_eq!(two.bytes_per_block * 2, one.bytes_per_block);
        assert_eq!(two.blocks, 2 * one.blocks);
        // An f16 cache: half the bytes again; q8: 1 byte and a 2-byte scale per 32 values.
        let f16 = kv_plan(&c, &even(2), KvDtype::F16, &[1 << 20; 2]).unwrap();
        assert_eq!(f16.blocks, 2 * two.blocks);
        let q8 = kv_plan(&c, &even(2), KvDtype::Q8, &[1 << 20; 2]).unwrap();
        assert_eq!(q8.bytes_per_block * 64, two.bytes_per_block * 17);
        // The rank with the smaller budget limits the blocks.
        let uneven = kv_plan(&c, &even(2), KvDtype::F32, &[1 << 20, 1 << 19]).unwrap();
        assert_eq!(uneven.blocks, two.blocks / 2);
        assert_eq!(uneven.budget_bytes, 1 << 19);
    }

    #[test]
    fn a_budget_below_one_block_is_refused_without_flag_names() {
        let one = RankWeights::even(1);
        let e = kv_plan(&cfg(), &one, KvDtype::F32, &[30_000]).unwrap_err();
        assert!(
            matches!(e, ServeError::KvTooSmall { blocks: 0, .. }),
            "{e:?}"
        );
        assert!(!e.to_string().contains("--"), "{e}");
        if let Some(m) = tp_models::limits::physical_memory() {
            let e = kv_plan(&cfg(), &one, KvDtype::F32, &[m + 1]).unwrap_err();
            assert!(matches!(e, ServeError::KvOverMachine { .. }), "{e:?}");
        }
    }
}
