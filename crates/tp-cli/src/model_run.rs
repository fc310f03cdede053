//! What every model command shares: the model flags, the per-rank memory plan and budget
//! check (tp-engine's `session`, in flag terms here), and starting the ranks (rank 0 leads,
//! the others follow its steps).

use anyhow::{anyhow, bail, Context};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tp_engine::launch::{run_ranks, Backend, RanksFailed};
use tp_engine::load_stats::{self, Counting, LoadStats};
use tp_engine::model_check::{check_same_model, open_and_identify};
use tp_engine::report::load_table;
use tp_engine::report::{parse_bytes, show_bytes};
use tp_engine::session::{self, Placement, SessionError};
use tp_engine::{Command, Worker};
use tp_models::fetch;
use tp_models::{
    open_checkpoint, Checkpoint, DenseDType, KvDtype, LoadOptions, RankMemory, RankWeights,
    ShardedModel, SyncMode,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DTypeArg {
    F32,
    F16,
    Bf16,
}

impl DTypeArg {
    fn dense(self) -> DenseDType {
        match self {
            DTypeArg::F32 => DenseDType::F32,
            DTypeArg::F16 => DenseDType::F16,
            DTypeArg::Bf16 => DenseDType::BF16,
        }
    }
}

/// How the tensor-parallel all-reduces of partial sums travel (`--sync`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SyncArg {
    /// f64 partial sums: exact, the same logits at every tp.
    Exact,
    /// 8-bit blocks (~7x fewer bytes): for slow links between hosts; lossy.
    Q8,
}

impl SyncArg {
    fn mode(self) -> SyncMode {
        match self {
            SyncArg::Exact => SyncMode::Exact,
            SyncArg::Q8 => SyncMode::Q8,
        }
    }
}

/// How the KV cache stores keys and values (`--kv-dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KvDtypeArg {
    F16,
    Bf16,
    F32,
    /// Signed bytes with an f16 scale per 32 values.
    Q8,
}

impl KvDtypeArg {
    pub fn kv_dtype(self) -> KvDtype {
        match self {
            KvDtypeArg::F16 => KvDtype::F16,
            KvDtypeArg::Bf16 => KvDtype::Bf16,
            KvDtypeArg::F32 => KvDtype::F32,
            KvDtypeArg::Q8 => KvDtype::Q8,
        }
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF file or HF directory (config.json + *.safetensors). Default: SmolLM2-135M-Instruct,
    /// downloaded on first use into the cache directory ($TP_CACHE_DIR or ~/.cache/tensor-parallel).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Tensor-parallel ranks (default 1, or the count of --rank-weights; under mpirun, the
    /// number of processes).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Uneven hosts: one weight per rank, e.g. 2,1 gives rank 0 two thirds of the heads, FFN
    /// blocks and vocabulary (contiguous shards; same logits as even shards). Default: even.
    #[arg(long, value_name = "W0,W1,..", value_parser = parse_rank_weights, allow_hyphen_values = true)]
    pub rank_weights: Option<RankWeights>,
    /// Ranks as threads of this process (local) or as processes under mpirun (mpi).
    #[arg(long, default_value_t = Backend::Local)]
    pub backend: Backend,
    /// Element type of weights that are not kept quantized.
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    pub dtype: DTypeArg,
    /// Dequantize every weight to --dtype (slower; the exact reference numerics).
    #[arg(long)]
    pub dequantize: bool,
    /// Context length: KV cache positions per sequence (default: the model's).
    #[arg(long)]
    pub ctx_size: Option<usize>,
    /// Element type of the KV cache: f16 (half the bytes of f32; perplexity within 0.1%, see
    /// the README), bf16, or f32 (exact).
    #[arg(long, value_enum, default_value_t = KvDtypeArg::F16)]
    pub kv_dtype: KvDtypeArg,
    /// Memory each rank may use, e.g. 300MB or 2GiB: refuse to start, naming the smallest tp
    /// that fits, when a rank's weights plus KV cache would exceed it.
    #[arg(long, value_parser = parse_bytes)]
    pub max_rank_memory: Option<u64>,
    /// Deadline of every collective, in seconds.
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
    /// How ranks sum partial results: exact (f64) or q8 (8-bit blocks, ~7x fewer bytes per
    /// all-reduce, for slow links between hosts; perplexity changes slightly, see the README).
    #[arg(long, value_enum, default_value_t = SyncArg::Exact)]
    pub sync: SyncArg,
    /// Print only the generated text (no model and speed report on stderr).
    #[arg(long, short)]
    pub quiet: bool,
}

impl ModelArgs {
    pub fn load_options(&self) -> LoadOptions {
        LoadOptions {
            keep_quantized: !self.dequantize,
            dense: self.dtype.dense(),
            kv_dtype: self.kv_dtype.kv_dtype(),
        }
    }

    pub fn timeout(&self) -> anyhow::Result<Duration> {
        Duration::try_from_secs_f64(self.timeout)
            .ok()
            .filter(|d| !d.is_zero())
            .context("--timeout must be a positive number of seconds")
    }

    /// The model path: `--model` (a training checkpoint verified and resolved, see
    /// [`resolve_model_path`]), or the default model (fetched when missing).
    pub fn model_path(&self) -> anyhow::Result<PathBuf> {
        match &self.model {
            Some(p) => resolve_model_path(p),
            None => Ok(fetch::ensure(&fetch::SMOLLM2)?),
        }
    }

    /// Each rank's weight at `tp`: `--rank-weights` (one per rank), else even.
    pub fn weights_for(&self, tp: usize) -> anyhow::Result<RankWeights> {
        rank_weights_for(self.rank_weights.as_ref(), tp, self.backend)
    }

    /// The tp size for `world` ranks: under MPI the world, else `--tp` (default 1).
    fn tp_for(&self, world: usize) -> anyhow::Result<usize> {
        match (self.backend, self.tp) {
            (Backend::Mpi, Some(tp)) if tp != world => bail!(
                "--tp {tp} but mpirun started {world} processes; run `mpirun -n {tp} ...` or drop --tp"
            ),
            (Backend::Mpi, _) => Ok(world),
            (Backend::Local, Some(0)) => bail!("--tp must be at least 1"),
            // --rank-weights alone sets the rank count.
            (Backend::Local, None) => Ok(self.rank_weights.as_ref().map_or(1, RankWeights::tp)),
            (Backend::Local, Some(tp)) => Ok(tp),
        }
    }
}

/// `path` itself, unless it is a `tp train` checkpoint: a step directory (it holds
/// `manifest.json`) or a run directory (it holds `latest`, which is followed). Those are
/// verified against their manifest (size and SHA-256 of every file, tp-train's own check, as
/// `tp train --resume` does) and the step directory is returned.
pub fn resolve_model_path(path: &Path) -> anyhow::Result<PathBuf> {
    use tp_train::checkpoint::{
        find_step_dir, Manifest, CONFIG_FILE, LATEST, MANIFEST, MODEL_FILE,
    };
    if !path.is_dir() || !(path.join(MANIFEST).is_file() || path.join(LATEST).is_file()) {
        return Ok(path.to_path_buf());
    }
    let dir = find_step_dir(path)?;
    Manifest::read(&dir)
        .and_then(|m| m.verify_all(&dir, &[CONFIG_FILE, MODEL_FILE]))
        .with_context(|| format!("the checkpoint {} fails verification", dir.display()))?;
    Ok(dir)
}

/// `--rank-weights`' value: whole numbers separated by commas, each 1..=1000.
pub fn parse_rank_weights(s: &str) -> Result<RankWeights, String> {
    s.parse::<RankWeights>().map_err(|e| e.to_string())
}

/// `weights` checked against `tp` (one per rank), or even weights when none were given.
pub fn rank_weights_for(
    weights: Option<&RankWeights>,
    tp: usize,
    backend: Backend,
) -> anyhow::Result<RankWeights> {
    match weights {
        None => Ok(RankWeights::even(tp)),
        Some(w) if w.tp() != tp => {
            let what = match backend {
                Backend::Mpi => format!("mpirun started {tp} processes"),
                Backend::Local => format!("tp is {tp}"),
            };
            bail!(
                "--rank-weights {w} has {} weights but {what}; give exactly one weight per rank",
                w.tp()
            )
        }
        Some(w) => Ok(w.clone()),
    }
}

/// What rank 0 holds to lead (tp-engine's; the memory plan travels with it).
pub use tp_engine::Session;

/// A session error in the CLI's words: the flag to change (--ctx-size, --tp,
/// --max-rank-memory).
pub fn session_error(e: SessionError) -> anyhow::Error {
    match e {
        SessionError::Context { ctx, source } => anyhow::Error::new(*source).context(format!(
            "a context of {ctx} positions does not fit (--ctx-size, default: the model's context length)"
        )),
        e @ SessionError::ContextTooLong { .. } => anyhow!("{e}; lower --ctx-size"),
        e @ SessionError::OverMachine { .. } => {
            anyhow!("{e}; lower --ctx-size, or use more machines")
        }
        SessionError::OverRankLimit {
            tp,
            ctx,
            need,
            limit,
            uneven,
            fits,
            heads,
        } => {
            let hint = match fits {
                Some(t) => format!("the smallest tp that fits is {t}: use --tp {t}"),
                None => format!(
                    "no tp up to {heads} (the head count) fits; lower --ctx-size, or keep weights quantized"
                ),
            };
            let (who, hint) = match uneven {
                None => ("a rank".to_string(), hint),
                Some((rank, weights)) => (
                    format!("rank {rank} (--rank-weights {weights})"),
                    format!("lower its weight, or with even shards {hint}"),
                ),
            };
            anyhow!(
                "{who} needs {} at tp {tp} (weights and a KV cache of {ctx} positions) but --max-rank-memory is {}; {hint}",
                show_bytes(need),
                show_bytes(limit)
            )
        }
        SessionError::WeightsSplit { weights, source } => {
            anyhow::Error::new(*source).context(format!("--rank-weights {weights} cannot split the model"))
        }
        e => anyhow::Error::new(e),
    }
}

/// Loads the model on every rank and runs `lead` on rank 0 while the others follow its steps.
/// Under mpirun every rank opens the model on its own host and the ranks check, before
/// loading, that all hosts hold the same file (`model_check`). Rank 0 prints what each rank
/// read and how long its load took.
pub fn run_model<T: Send>(
    args: &ModelArgs,
    lead: impl Fn(&mut Session) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<Result<Option<T>, RanksFailed>> {
    let timeout = args.timeout()?;
    if args.ctx_size == Some(0) {
        bail!("--ctx-size must be at least 1");
    }
    match args.backend {
        Backend::Local => {
            // The layout is known now: check it once, before starting any rank.
            let path = args.model_path()?;
            let ckpt = open_checkpoint(&path)
                .with_context(|| format!("cannot load the model {}", path.display()))?;
            let ctx = args.ctx_size.unwrap_or(ckpt.config().context);
            let tp = args.tp_for(1)?;
            let weights = args.weights_for(tp)?;
            let memory = plan_and_check(args, &*ckpt, &path, &weights, ctx, true)?;
            let file_bytes = std::fs::metadata(&path)
                .ok()
                .filter(|m| m.is_file())
                .map(|m| m.len());
            let model = Opened {
                path: &path,
                ckpt: &*ckpt,
                ctx,
                memory,
                file_bytes,
            };
            run_ranks(Backend::Local, tp, timeout, |g| {
                run_rank(args, &model, g, &lead)
            })
        }
        Backend::Mpi => run_ranks(Backend::Mpi, 0, timeout, |g| {
            // Each host's own copy; every rank learns whether all hosts have the same.
            let path = match &args.model {
                Some(p) => resolve_model_path(p),
                None => Ok(fetch::cached(&fetch::SMOLLM2)?),
            };
            let opened = path.and_then(|p| {
                open_and_identify(&p)
                    .map(|(c, id)| (p, c, id))
                    .map_err(anyhow::Error::from)
            });
            let mine = opened
                .as_ref()
                .map(|(_, _, id)| *id)
                .map_err(|e| tp_engine::report::chain(e.as_ref()));
            let shown = args
                .model
                .clone()
                .unwrap_or_else(|| PathBuf::from("(the default model)"));
            check_same_model(&g, &shown, &mine)?;
            // Every rank opened the same file: an error here cannot happen on one rank alone.
            let (path, ckpt, id) = opened?;
            let ctx = args.ctx_size.unwrap_or(ckpt.config().context);
            let tp = args.tp_for(g.size())?;
            let weights = args.weights_for(tp)?;
            let memory = plan_and_check(args, &*ckpt, &path, &weights, ctx, g.rank() == 0)?;
            let model = Opened {
                path: &path,
                ckpt: &*ckpt,
                ctx,
                memory,
                file_bytes: Some(id.bytes),
            };
            run_rank(args, &model, g, &lead)
        }),
    }
    .map(|r| r.map(Option::flatten))
    .map_err(Into::into)
}

/// The model as a rank sees it, once opened and checked.
struct Opened<'a> {
    path: &'a Path,
    ckpt: &'a dyn Checkpoint,
    ctx: usize,
    /// Every rank's memory plan.
    memory: Vec<RankMemory>,
    file_bytes: Option<u64>,
}

/// One rank: load its shard (timed, bytes counted, reported by rank 0), then lead or follow.
fn run_rank<T>(
    args: &ModelArgs,
    m: &Opened<'_>,
    g: tp_comm::Group,
    lead: &(impl Fn(&mut Session) -> anyhow::Result<T> + Sync),
) -> anyhow::Result<Option<T>> {
    let tp = args.tp_for(g.size())?;
    let weights = args.weights_for(tp)?;
    let rank = g.rank();
    // Rank 0's tokenizer first, while nothing else is held: building it (Qwen2.5's 151k-token
    // vocabulary and merges) takes ~150 MB for a moment, which then goes back to the system
    // instead of peaking beside the weights. An error is reported once the followers can be
    // released.
    let tokenizer = (rank == 0).then(|| {
        let tokenizer = session::load_tokenizer(m.path, m.ckpt);
        session::release_free_heap();
        tokenizer
    });
    let counting = Counting::new(m.ckpt);
    let started = Instant::now();
    let mut model =
        ShardedModel::load_weighted(&counting, rank, &weights, args.load_options(), m.ctx)
            .with_context(|| {
                format!("rank {rank} cannot load its shard of {}", m.path.display())
            })?;
    model.set_sync(args.sync.mode());
    let mine = LoadStats {
        bytes: counting.bytes(),
        time: started.elapsed(),
    };
    let all = load_stats::gather(&g, mine)?;
    // Every rank has its shard (the gather waited for all): what loading freed goes back now
    // (once per process under mpirun; rank threads share one heap and each trims it, cheaply).
    session::release_free_heap();
    if rank == 0 && !args.quiet {
        for line in load_table(&all, m.file_bytes) {
            eprintln!("# {line}");
        }
    }
    let mut worker = Worker::new(model, g.clone());
    if rank != 0 {
        worker.follow()?;
        return Ok(None);
    }
    let tokenizer = match tokenizer.transpose() {
        Ok(Some(t)) => t,
        Ok(None) => anyhow::bail!("rank 0 has no tokenizer (an internal error)"),
        Err(e) => {
            let _ = worker.submit(Command::Exit);
            return Err(session_error(e));
        }
    };
    let mut session = Session {
        worker,
        tokenizer,
        ctx_size: m.ctx,
        memory: m.memory.clone(),
        weights,
    };
    let out = lead(&mut session);
    // Release the followers whatever happened (a broken group fails here too, harmlessly).
    let _ = session.worker.submit(Command::Exit);
    out.map(Some)
}

/// Prints the per-rank memory plan (when `show`) and refuses a layout over the budget.
fn plan_and_check(
    args: &ModelArgs,
    ckpt: &dyn Checkpoint,
    path: &Path,
    weights: &RankWeights,
    ctx: usize,
    show: bool,
) -> anyhow::Result<Vec<RankMemory>> {
    let tp = weights.tp();
    let opts = args.load_options();
    let cfg = ckpt.config();
    let placement = match args.backend {
        Backend::Local => Placement::OneProcess,
        Backend::Mpi => Placement::ProcessPerRank,
    };
    let plan =
        session::checked_memory_plan(ckpt, weights, ctx, opts, placement).map_err(session_error)?;
    if show && !args.quiet {
        eprintln!(
            "# {}: {} {} layers, hidden {}, {} heads / {} KV heads, vocab {}; tp {tp}{} ({:?} backend{})",
            path.display(),
            cfg.arch.name(),
            cfg.layers,
            cfg.hidden,
            cfg.heads,
            cfg.kv_heads,
            cfg.vocab,
            match &args.rank_weights {
                Some(w) => format!(", rank weights {w}"),
                None => String::new(),
            },
            args.backend,
            match args.sync {
                SyncArg::Exact => "",
                SyncArg::Q8 => ", q8 sync",
            }
        );
        for (r, m) in plan.iter().enumerate() {
            eprintln!(
                "# {}",
                session::describe_rank(ckpt, r, weights, m, ctx, show_bytes)
            );
        }
    }
    if let Some(budget) = args.max_rank_memory {
        session::check_rank_limit(ckpt, weights, ctx, opts, budget, &plan)
            .map_err(session_error)?;
    }
    Ok(plan)
}
