//! Starting a model session on every rank: the model opened (under mpirun, every host's copy
//! checked to be the same file before anything loads), the layout's memory plan checked and
//! reported, each rank's shard loaded (bytes and time per rank, reported by rank 0), rank 0's
//! tokenizer built; then rank 0 leads with a [`Session`] while the other ranks follow its
//! steps. `tp generate`, `chat`, `serve`, `perplexity` and the benches all start this way.
//!
//! ```no_run
//! use std::time::Duration;
//! use tp_engine::launch::Backend;
//! use tp_engine::start::{run_session, SessionConfig};
//! use tp_engine::{generate, Command, DecodeParams, Flow, SequenceDecoder};
//!
//! let cfg = SessionConfig {
//!     model: Ok("SmolLM2-135M-Instruct.Q4_1.gguf".into()),
//!     shown: "SmolLM2-135M-Instruct.Q4_1.gguf".into(),
//!     backend: Backend::Local,
//!     tp: Some(2), // two rank threads, each with half of every layer
//!     rank_weights: None,
//!     load: Default::default(),
//!     ctx_size: Some(2048),
//!     max_rank_memory: None,
//!     held: None,
//!     kv_budget: None,
//!     draft: None,
//!     timeout: Duration::from_secs(60),
//!     sync: Default::default(),
//!     report: false,
//! };
//! let text = run_session(&cfg, anyhow::Error::from, |s| {
//!     let ids = s.tokenizer.encode("The capital of France is")?;
//!     s.worker.submit(Command::Open { slot: 0, capacity: s.ctx_size as u32 })?;
//!     let mut decoder = SequenceDecoder::new(&s.tokenizer, DecodeParams::greedy(16))?;
//!     let mut text = String::new();
//!     // `None`: no speculative decoding (see `spec::Speculator`).
//!     generate(&mut s.worker, 0, &ids, &mut decoder, None, |e| {
//!         text.push_str(&e.text);
//!         Flow::Continue
//!     })?;
//!     Ok(text)
//! })?;
//! // Ok(Some(text)) on rank 0's process; Err(RanksFailed) if a rank failed (it printed why).
//! println!("{:?}", text);
//! # Ok::<(), anyhow::Error>(())
//! ```

use crate::draft_model::DraftPlan;
use crate::kv_budget::KvBudget;
use crate::launch::{run_ranks, Backend, LaunchError, RankError, RanksFailed};
use crate::load_stats::{self, Counting, LoadStats};
use crate::model_check::{check_same_model, open_and_identify, ModelCheckError};
use crate::report::{chain, load_table, show_bytes};
use crate::session::{self, Placement, Session, SessionError};
use crate::{Command, ReloadSpec, Worker};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tp_comm::{CommError, Group};
use tp_models::{
    open_checkpoint, Checkpoint, LoadOptions, ModelError, RankMemory, RankWeights, ShardedModel,
    SyncMode, BLOCK_POSITIONS,
};
use tp_tokenizer::Tokenizer;

/// What a session is started with.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// The model file or directory this process found, or why it found none. Under mpirun
    /// each process looks on its own host, and every rank learns every host's answer.
    pub model: Result<PathBuf, String>,
    /// How messages name the model (the path as the user gave it).
    pub shown: PathBuf,
    pub backend: Backend,
    /// Ranks for the local backend (default 1, or the count of `rank_weights`); under mpirun
    /// the world's size, which this must then equal when given.
    pub tp: Option<usize>,
    /// Uneven shards in proportion to these (one per rank); even when `None`.
    pub rank_weights: Option<RankWeights>,
    pub load: LoadOptions,
    /// KV positions per sequence; the model's context length when `None`.
    pub ctx_size: Option<usize>,
    /// Refuse a layout whose busiest rank would need more bytes than this.
    pub max_rank_memory: Option<u64>,
    /// The most positions one sequence of this run holds, told by rank 0's tokenizer (`tp
    /// generate`: its prompt's tokens and the most it generates). The memory preflight and
    /// `max_rank_memory` then price the KV blocks of that many positions (at most `ctx_size`)
    /// instead of the whole context; `None` prices the context (a server's sequences can be
    /// as long as it allows).
    pub held: Option<HeldPositions>,
    /// A server's KV budget per rank: its sequences together hold at most the blocks it
    /// allows, so the preflight and `max_rank_memory` price those blocks (which may be more
    /// or fewer than one context's) instead of `held` or the context.
    pub kv_budget: Option<KvBudget>,
    /// The draft model rank 0 will load for speculative decoding: the preflight charges its
    /// weights and its KV pool (the blocks of `held`, or of the KV budget: a server's budget
    /// then holds as many draft blocks as target blocks) to rank 0, and the session's
    /// [`Session::draft`] bounds its pool.
    pub draft: Option<PathBuf>,
    /// Deadline of every collective.
    pub timeout: Duration,
    pub sync: SyncMode,
    /// Print the layout, every rank's memory plan and the load table on stderr.
    pub report: bool,
}

/// How many positions one sequence of a run holds at most, from the model's tokenizer.
#[derive(Clone)]
pub struct HeldPositions(Arc<dyn Fn(&Tokenizer) -> usize + Send + Sync>);

impl HeldPositions {
    /// `f` gives the positions (a prompt's tokens plus the most tokens generated after it);
    /// more than the context is priced as the context.
    pub fn new(f: impl Fn(&Tokenizer) -> usize + Send + Sync + 'static) -> Self {
        HeldPositions(Arc::new(f))
    }

    pub fn positions(&self, tokenizer: &Tokenizer) -> usize {
        (self.0)(tokenizer)
    }
}

impl std::fmt::Debug for HeldPositions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HeldPositions(..)")
    }
}

/// Why a session could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("tp must be at least 1")]
    NoRanks,
    #[error("tp is {tp} but mpirun started {world} processes")]
    TpNotWorld { tp: usize, world: usize },
    /// A pp x tp mesh that is not the MPI world.
    #[error("{pp} pipeline stages{} do not make the {world} processes mpirun started; use a pp that divides {world} (valid: {}) and tp = {world} / pp, or start pp x tp processes", tp.map_or(String::new(), |t| format!(" of tp {t} ({} ranks)", pp * t)), divisors(*world))]
    PipelineNotWorld {
        pp: usize,
        tp: Option<usize>,
        world: usize,
    },
    /// A pipeline the model cannot take (more stages than layers).
    #[error(transparent)]
    Stages { source: Box<ModelError> },
    #[error("the rank weights {weights} are {} weights for {tp} ranks", weights.tp())]
    WeightsCount { weights: RankWeights, tp: usize },
    #[error("the context size must be at least 1")]
    EmptyContext,
    #[error("{0}")]
    NoModel(String),
    /// An expert-parallel size the model or the tp cannot take.
    #[error(transparent)]
    ExpertGroups { source: tp_spec::ShardError },
    /// A capacity factor the model cannot take (it has no experts).
    #[error(transparent)]
    Capacity { source: tp_models::CapacityError },
    #[error("cannot load the model {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: Box<ModelError>,
    },
    #[error("rank {rank} cannot load its shard of {}", path.display())]
    Load {
        rank: usize,
        path: PathBuf,
        #[source]
        source: Box<ModelError>,
    },
    /// Boxed, as the others below: they are large and errors travel by value.
    #[error(transparent)]
    Check(Box<ModelCheckError>),
    #[error(transparent)]
    Session(Box<SessionError>),
    #[error(transparent)]
    Launch(Box<LaunchError>),
    #[error(transparent)]
    Comm(Box<CommError>),
    #[error(transparent)]
    Engine(Box<crate::EngineError>),
    #[error(transparent)]
    Draft(Box<crate::draft_model::DraftModelError>),
}

macro_rules! boxed_from {
    ($($variant:ident($error:ty)),*) => {$(
        impl From<$error> for StartError {
            fn from(e: $error) -> Self {
                StartError::$variant(Box::new(e))
            }
        }
    )*};
}

boxed_from!(
    Check(ModelCheckError),
    Session(SessionError),
    Launch(LaunchError),
    Comm(CommError),
    Engine(crate::EngineError),
    Draft(crate::draft_model::DraftModelError)
);

/// Each rank's weight at `tp`: `weights` (one per rank), else even.
pub fn weights_for(weights: Option<&RankWeights>, tp: usize) -> Result<RankWeights, StartError> {
    match weights {
        None => Ok(RankWeights::even(tp)),
        Some(w) if w.tp() != tp => Err(StartError::WeightsCount {
            weights: w.clone(),
            tp,
        }),
        Some(w) => Ok(w.clone()),
    }
}

/// `1, 2, 4` for 4.
fn divisors(n: usize) -> String {
    (1..=n.max(1))
        .filter(|d| n.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl SessionConfig {
    /// Pipeline stages (1 without pipelining).
    pub fn pp(&self) -> usize {
        self.load.pipeline_stages.max(1)
    }

    /// The tp size inside each stage for `world` ranks: under MPI the world over the
    /// stages, else `tp` (default 1, or the count of the rank weights).
    fn tp_for(&self, world: usize) -> Result<usize, StartError> {
        let pp = self.pp();
        if pp > 1 && self.backend == Backend::Mpi {
            return match self.tp {
                _ if !world.is_multiple_of(pp) => Err(StartError::PipelineNotWorld {
                    pp,
                    tp: self.tp,
                    world,
                }),
                Some(tp) if tp * pp != world => Err(StartError::PipelineNotWorld {
                    pp,
                    tp: self.tp,
                    world,
                }),
                _ => Ok(world / pp),
            };
        }
        match (self.backend, self.tp) {
            (Backend::Mpi, Some(tp)) if tp != world => Err(StartError::TpNotWorld { tp, world }),
            (Backend::Mpi, _) => Ok(world),
            (Backend::Local, Some(0)) => Err(StartError::NoRanks),
            (Backend::Local, None) => Ok(self.rank_weights.as_ref().map_or(1, RankWeights::tp)),
            (Backend::Local, Some(tp)) => Ok(tp),
        }
    }
}

/// The model as a rank sees it, once opened and checked.
struct Opened<'a> {
    path: &'a Path,
    ckpt: &'a dyn Checkpoint,
    ctx: usize,
    weights: RankWeights,
    /// Every rank's memory plan (a KV cache of the positions a sequence holds at most; the
    /// draft model charged to rank 0).
    memory: Vec<RankMemory>,
    draft: Option<DraftPlan>,
    file_bytes: Option<u64>,
}

/// Loads the model on every rank and runs `lead` on rank 0 while the others follow its steps;
/// rank 0's value comes back (`None` on the other processes of an MPI job). `words` turns a
/// start error into the caller's error type (a front end adds its own hints there). Ranks
/// that fail print their errors and give [`RanksFailed`].
pub fn run_session<T: Send, E: RankError>(
    cfg: &SessionConfig,
    words: impl Fn(StartError) -> E + Sync,
    lead: impl Fn(&mut Session) -> Result<T, E> + Sync,
) -> Result<Result<Option<T>, RanksFailed>, E> {
    if cfg.ctx_size == Some(0) {
        return Err(words(StartError::EmptyContext));
    }
    let out = match cfg.backend {
        Backend::Local => {
            // The layout is known now: check it once, before starting any rank.
            let path = cfg
                .model
                .clone()
                .map_err(|e| words(StartError::NoModel(e)))?;
            let mut ckpt = open_checkpoint(&path).map_err(|source| {
                words(StartError::Open {
                    path: path.clone(),
                    source: Box::new(source),
                })
            })?;
            let file_bytes = std::fs::metadata(&path)
                .ok()
                .filter(|m| m.is_file())
                .map(|m| m.len());
            // Rank 0's tokenizer first, while nothing else is held (see `first_tokenizer`).
            let tokenizer = first_tokenizer(&path, &mut *ckpt);
            let held = held_positions(cfg, &tokenizer);
            let model = open(cfg, &path, &*ckpt, 1, true, file_bytes, held).map_err(&words)?;
            let tokenizer = Mutex::new(Some(tokenizer));
            run_ranks(
                Backend::Local,
                model.weights.tp() * cfg.pp(),
                cfg.timeout,
                |g| {
                    let mine = match g.rank() {
                        0 => tokenizer.lock().ok().and_then(|mut t| t.take()),
                        _ => None,
                    };
                    run_rank(cfg, &model, g, mine, &words, &lead)
                },
            )
        }
        Backend::Mpi => run_ranks(Backend::Mpi, 0, cfg.timeout, |g| {
            // Each host's own copy; every rank learns whether all hosts have the same.
            let opened = cfg.model.clone().and_then(|p| {
                open_and_identify(&p)
                    .map(|(c, id)| (p, c, id))
                    .map_err(|e| chain(&e))
            });
            let mine = opened.as_ref().map(|(_, _, id)| *id).map_err(Clone::clone);
            check_same_model(&g, &cfg.shown, &mine).map_err(|e| words(e.into()))?;
            // Every rank opened the same file: an error here cannot happen on one rank alone.
            let (path, mut ckpt, id) = opened.map_err(|e| words(StartError::NoModel(e)))?;
            // Rank 0 needs its tokenizer; the others build it only to learn the positions this
            // run holds (the same file on every host, so the same answer), then drop it.
            let lead_rank = g.rank() == 0;
            let tokenizer =
                (lead_rank || cfg.held.is_some()).then(|| first_tokenizer(&path, &mut *ckpt));
            let held = tokenizer.as_ref().and_then(|t| held_positions(cfg, t));
            let tokenizer = tokenizer.filter(|_| lead_rank);
            ckpt.forget_tokenizer_metadata();
            if !lead_rank && cfg.held.is_some() {
                session::release_free_heap();
            }
            let model = open(
                cfg,
                &path,
                &*ckpt,
                g.size(),
                lead_rank,
                Some(id.bytes),
                held,
            )
            .map_err(&words)?;
            run_rank(cfg, &model, g, tokenizer, &words, &lead)
        }),
    };
    out.map(|r| r.map(Option::flatten))
        .map_err(|e| words(e.into()))
}

/// Rank 0's tokenizer, built before the shards load: building it (Qwen2.5's 151k-token
/// vocabulary and merges) takes ~150 MB for a moment, which then goes back to the system
/// instead of peaking beside the weights; the checkpoint's copy of the vocabulary (GGUF
/// metadata) is dropped then, as nothing else reads it. An error is reported once the
/// followers can be released.
fn first_tokenizer(path: &Path, ckpt: &mut dyn Checkpoint) -> Result<Tokenizer, SessionError> {
    let tokenizer = session::load_tokenizer(path, ckpt);
    ckpt.forget_tokenizer_metadata();
    session::release_free_heap();
    tokenizer
}

/// The positions one sequence of this run holds at most, when the run says
/// ([`SessionConfig::held`]) and the tokenizer could be built.
fn held_positions(
    cfg: &SessionConfig,
    tokenizer: &Result<Tokenizer, SessionError>,
) -> Option<usize> {
    Some(cfg.held.as_ref()?.positions(tokenizer.as_ref().ok()?))
}

/// The layout for `world` ranks with its memory plan (a KV cache of `held` positions, else of
/// the context), reported (when `show`) and checked.
fn open<'a>(
    cfg: &SessionConfig,
    path: &'a Path,
    ckpt: &'a dyn Checkpoint,
    world: usize,
    show: bool,
    file_bytes: Option<u64>,
    held: Option<usize>,
) -> Result<Opened<'a>, StartError> {
    let ctx = cfg.ctx_size.unwrap_or(ckpt.config().context);
    let tp = cfg.tp_for(world)?;
    let weights = weights_for(cfg.rank_weights.as_ref(), tp)?;
    // The expert layout and the pipeline stages, before anything is priced or loaded.
    tp_models::ShardPlan::new(ckpt.config(), 1, 0, tp)
        .and_then(|p| p.with_expert_groups(ckpt.config(), cfg.load.expert_groups))
        .map_err(|source| StartError::ExpertGroups { source })?;
    tp_models::check_capacity(ckpt.config(), cfg.load.expert_capacity)
        .map_err(|source| StartError::Capacity { source })?;
    tp_models::checkpoint_stages(ckpt, cfg.load).map_err(|source| StartError::Stages {
        source: Box::new(source),
    })?;
    // The draft model's cost, from its metadata. Rank 0 loads it: there an unreadable draft
    // is an error before anything loads; elsewhere (another host's files under mpirun) it is
    // priced where it can be read, and rank 0's checks decide.
    let draft_memory = match &cfg.draft {
        Some(p) => match crate::draft_model::draft_memory(p, cfg.load) {
            Ok(m) => Some((p, m)),
            Err(e) if show => return Err(e.into()),
            Err(_) => None,
        },
        None => None,
    };
    let dm = draft_memory.as_ref().map(|(_, m)| m);
    let held = match cfg.kv_budget {
        Some(budget) => session::budget_positions(ckpt, &weights, ctx, cfg.load, budget, dm)
            .map_err(|source| SessionError::Context {
                ctx,
                source: Box::new(source),
            })?,
        None => held.map_or(ctx, |h| h.min(ctx)),
    };
    let draft = draft_memory.map(|(p, memory)| DraftPlan {
        path: p.clone(),
        memory,
        blocks: held.div_ceil(BLOCK_POSITIONS),
    });
    let placement = match cfg.backend {
        Backend::Local => Placement::OneProcess,
        Backend::Mpi => Placement::ProcessPerRank,
    };
    let memory = session::checked_memory_plan(ckpt, &weights, ctx, held, cfg.load, placement, dm)?;
    if show && cfg.report {
        report_layout(cfg, path, ckpt, &weights, held, &memory, draft.as_ref());
    }
    if let Some(budget) = cfg.max_rank_memory {
        session::check_rank_limit(ckpt, &weights, ctx, held, cfg.load, budget, &memory, dm)?;
    }
    Ok(Opened {
        path,
        ckpt,
        ctx,
        weights,
        memory,
        draft,
        file_bytes,
    })
}

/// The model's shape and the layout, then one line per rank's memory (a KV cache of `held`
/// positions at most) and one on the draft model rank 0 holds, on stderr.
fn report_layout(
    cfg: &SessionConfig,
    path: &Path,
    ckpt: &dyn Checkpoint,
    weights: &RankWeights,
    held: usize,
    memory: &[RankMemory],
    draft: Option<&DraftPlan>,
) {
    let c = ckpt.config();
    eprintln!(
        "# {}: {} {} layers, hidden {}, {} heads / {} KV heads, vocab {}; {}tp {}{} ({:?} backend{})",
        path.display(),
        c.arch.name(),
        c.layers,
        c.hidden,
        c.heads,
        c.kv_heads,
        c.vocab,
        match cfg.pp() {
            1 => String::new(),
            pp => format!("pp {pp} x "),
        },
        weights.tp(),
        match &cfg.rank_weights {
            Some(w) => format!(", rank weights {w}"),
            None => String::new(),
        },
        cfg.backend,
        match cfg.sync {
            SyncMode::Exact => "",
            SyncMode::Q8 => ", q8 sync",
        }
    );
    for (r, m) in memory.iter().enumerate() {
        // Rank 0's line is the target's; the draft has its own.
        let target = match draft.filter(|_| r == 0) {
            Some(d) => without_draft(m, d),
            None => *m,
        };
        eprintln!(
            "# {}",
            session::describe_rank(ckpt, r, weights, cfg.load, &target, held, show_bytes)
        );
    }
    if let (Some(d), Some(m0)) = (draft, memory.first()) {
        eprintln!("# {}", d.describe(m0.total() as u64));
    }
}

/// Rank 0's plan less the draft model [`session::charge_draft`] added.
fn without_draft(m: &RankMemory, d: &DraftPlan) -> RankMemory {
    RankMemory {
        replicated: m
            .replicated
            .saturating_sub(usize::try_from(d.memory.weights).unwrap_or(usize::MAX)),
        kv_cache: m
            .kv_cache
            .saturating_sub(usize::try_from(d.kv_bytes()).unwrap_or(usize::MAX)),
        kv_block_bytes: m.kv_block_bytes.saturating_sub(d.memory.block_bytes),
        ..*m
    }
}

/// One rank: load its shard (timed, bytes counted, reported by rank 0), then lead (with
/// `tokenizer`, built before loading) or follow.
fn run_rank<T, E>(
    cfg: &SessionConfig,
    m: &Opened<'_>,
    g: Group,
    tokenizer: Option<Result<Tokenizer, SessionError>>,
    words: &impl Fn(StartError) -> E,
    lead: &impl Fn(&mut Session) -> Result<T, E>,
) -> Result<Option<T>, E> {
    let rank = g.rank();
    // Under pipelining: the stage's tp group and the pipeline group, before loading (a
    // collective every rank reaches).
    let (tp_group, pipe) =
        crate::pipeline::stage_groups(&g, m.weights.tp(), cfg.pp()).map_err(|e| words(e.into()))?;
    let counting = Counting::new(m.ckpt);
    let started = Instant::now();
    let mut model = ShardedModel::load_weighted(&counting, rank, &m.weights, cfg.load, m.ctx)
        .map_err(|source| {
            words(StartError::Load {
                rank,
                path: m.path.to_path_buf(),
                source: Box::new(source),
            })
        })?;
    model.set_sync(cfg.sync);
    let mine = LoadStats {
        bytes: counting.bytes(),
        time: started.elapsed(),
    };
    let all = load_stats::gather(&g, mine).map_err(|e| words(e.into()))?;
    // Every rank has its shard (the gather waited for all): what loading freed goes back now
    // (once per process under mpirun; rank threads share one heap and each trims it, cheaply).
    session::release_free_heap();
    if rank == 0 && cfg.report {
        for line in load_table(&all, m.file_bytes) {
            eprintln!("# {line}");
        }
    }
    let mut worker = Worker::staged(model, g.clone(), tp_group, pipe);
    // A server may load further models with the same layout (not yet across pipeline
    // stages); a rank that waits for its load longer than half the collective deadline gives
    // up before rank 0's gather does.
    if cfg.load.pipeline_stages == 1 {
        worker.enable_reload(ReloadSpec {
            weights: m.weights.clone(),
            load: cfg.load,
            ctx: m.ctx,
            sync: cfg.sync,
            deadline: cfg.timeout / 2,
        });
    }
    if rank != 0 {
        worker.follow().map_err(|e| words(e.into()))?;
        return Ok(None);
    }
    // Rank 0's was built before loading; building it here is only the type's other case.
    let tokenizer = tokenizer.unwrap_or_else(|| session::load_tokenizer(m.path, m.ckpt));
    let tokenizer = match tokenizer {
        Ok(t) => t,
        Err(e) => {
            let _ = worker.submit(Command::Exit);
            return Err(words(e.into()));
        }
    };
    let mut session = Session {
        worker,
        tokenizer,
        ctx_size: m.ctx,
        memory: m.memory.clone(),
        weights: m.weights.clone(),
        load: all,
        draft: m.draft.clone(),
    };
    let out = lead(&mut session);
    // Release the followers whatever happened (a broken group fails here too, harmlessly).
    let _ = session.worker.submit(Command::Exit);
    out.map(Some)
}
