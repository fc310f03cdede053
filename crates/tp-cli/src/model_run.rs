//! What every model command shares: the model flags, turned into tp-engine's
//! `SessionConfig`, and tp-engine's start and session errors in flag terms.

use anyhow::{anyhow, Context};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tp_engine::kv_budget::KvBudget;
use tp_engine::launch::{Backend, RanksFailed};
use tp_engine::report::{chain, parse_bytes, show_bytes};
use tp_engine::session::SessionError;
use tp_engine::start::{run_session, HeldPositions, SessionConfig, StartError};
use tp_models::{
    fetch, CapacityFactor, DenseDType, KvDtype, LastStageWeight, LayerCounts, LoadOptions,
    RankWeights, StageSplit, SyncMode,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DTypeArg {
    F32,
    F16,
    Bf16,
}

impl DTypeArg {
    pub fn dense(self) -> DenseDType {
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
    /// Pipeline stages: the ranks form pp stages of --tp ranks (tp innermost: a stage is
    /// consecutive ranks, so under mpirun give each host a stage's ranks), each stage holding
    /// a contiguous range of layers (the embedding on the first, the head on the last). The
    /// logits are the same bits as at tp 1. Under mpirun: mpirun -n pp*tp.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Layers per pipeline stage, first stage (the embedding's) first, e.g. 14,10: one count
    /// per --pp stage, each at least 1, summing to the model's layers [default: balanced by a
    /// compute model, docs/multi-host.md].
    #[arg(long, value_name = "N0,N1,..", value_parser = parse_pp_layers, conflicts_with = "pp_last_stage_weight")]
    pub pp_layers: Option<LayerCounts>,
    /// The default split's cost of the last stage (the head's, where rank 0 also samples,
    /// schedules and serves) relative to the others, 0.1 to 10: above 1 moves layers off it.
    #[arg(long, value_name = "W", value_parser = parse_last_stage_weight, default_value_t = LastStageWeight::DEFAULT)]
    pub pp_last_stage_weight: LastStageWeight,
    /// Uneven hosts: one weight per rank, e.g. 2,1 gives rank 0 two thirds of the heads, FFN
    /// blocks and vocabulary (contiguous shards; same logits as even shards). Default: even.
    #[arg(long, value_name = "W0,W1,..", value_parser = parse_rank_weights, allow_hyphen_values = true)]
    pub rank_weights: Option<RankWeights>,
    /// Ranks as threads of this process (local) or as processes under mpirun (mpi).
    #[arg(long, default_value_t = Backend::Local, value_parser = crate::model_run::backend_values())]
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
    /// docs/inference.md), bf16, or f32 (exact).
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
    /// all-reduce, for slow links between hosts; perplexity changes slightly, see
    /// docs/multi-host.md).
    #[arg(long, value_enum, default_value_t = SyncArg::Exact)]
    pub sync: SyncArg,
    /// Expert-parallel size of a mixture-of-experts model: the ranks form this many groups,
    /// each holding whole experts (1: every expert sliced over all ranks; --tp: whole experts
    /// per rank). Must divide --tp; the logits are the same bits either way (docs/moe.md).
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
    /// Mixture of experts: each expert takes at most ceil(F x tokens x top-k / experts) of a
    /// step's (token, expert) pairs, the later ones dropped and counted (GShard's capacity
    /// factor, a number above 0; the drops depend on what shares the step, docs/moe.md)
    /// [default: no token is dropped].
    #[arg(long, alias = "capacity-factor", value_name = "F", value_parser = parse_capacity_factor)]
    pub moe_capacity_factor: Option<CapacityFactor>,
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
            expert_groups: self.ep,
            expert_capacity: self.moe_capacity_factor,
            pipeline_stages: self.pp,
            stage_split: stage_split(self.pp_layers, self.pp_last_stage_weight),
        }
    }

    pub fn timeout(&self) -> anyhow::Result<Duration> {
        seconds("--timeout", self.timeout)
    }

    /// The model path: `--model` (a training checkpoint verified and resolved, see
    /// [`resolve_model_path`]), or the default model (fetched when missing).
    pub fn model_path(&self) -> anyhow::Result<PathBuf> {
        match &self.model {
            Some(p) => resolve_model_path(p),
            None => default_model(true),
        }
    }

    /// The session these flags describe. Under mpirun the model is looked for on this host
    /// only (the default model must be in its cache) and a failure travels to every rank.
    pub fn session_config(&self) -> anyhow::Result<SessionConfig> {
        let model = match self.backend {
            Backend::Local => Ok(self.model_path()?),
            Backend::Mpi => match &self.model {
                Some(p) => resolve_model_path(p).map_err(|e| chain(e.as_ref())),
                None => default_model(false).map_err(|e| chain(e.as_ref())),
            },
        };
        Ok(SessionConfig {
            model,
            shown: self
                .model
                .clone()
                .unwrap_or_else(|| PathBuf::from("(the default model)")),
            backend: self.backend,
            tp: self.tp,
            rank_weights: self.rank_weights.clone(),
            load: self.load_options(),
            ctx_size: self.ctx_size,
            max_rank_memory: self.max_rank_memory,
            held: None,
            kv_budget: None,
            draft: None,
            timeout: self.timeout()?,
            sync: self.sync.mode(),
            report: !self.quiet,
        })
    }
}

/// `--backend`'s values, with their help.
pub fn backend_values() -> impl clap::builder::TypedValueParser<Value = Backend> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new([
        PossibleValue::new("local").help("Rank threads in one process, shared memory"),
        PossibleValue::new("mpi")
            .help("One rank per process under mpirun (build with `--features mpi`)"),
    ])
    .map(|s| match s.as_str() {
        "mpi" => Backend::Mpi,
        _ => Backend::Local,
    })
}

/// The default model's path in the cache: fetched when missing (`fetch`), else it must be
/// there already (under mpirun).
pub fn default_model(fetch: bool) -> anyhow::Result<PathBuf> {
    let found = match fetch {
        true => fetch::ensure(&fetch::SMOLLM2),
        false => fetch::cached(&fetch::SMOLLM2),
    };
    found.map_err(|e| anyhow!("{} (--model gives another model)", chain(&e)))
}

/// `path` itself, unless it is a `tp train` checkpoint: a step directory (it holds
/// `manifest.json`) or a run directory (it holds `latest`, which is followed). The files
/// inference reads (config, weights, tokenizer) are verified against the manifest (size and
/// SHA-256, tp-train's own check) and the step directory is returned; the optimizer state,
/// which only `tp train --resume` reads, may be missing or damaged.
pub fn resolve_model_path(path: &Path) -> anyhow::Result<PathBuf> {
    use tp_train::checkpoint::{
        find_step_dir, Manifest, CONFIG_FILE, LATEST, MANIFEST, MODEL_FILE, TOKENIZER_CONFIG_FILE,
        TOKENIZER_FILE,
    };
    if !path.is_dir() || !(path.join(MANIFEST).is_file() || path.join(LATEST).is_file()) {
        return Ok(path.to_path_buf());
    }
    let dir = find_step_dir(path)?;
    Manifest::read(&dir)
        .and_then(|m| {
            let mut needed = vec![CONFIG_FILE, MODEL_FILE, TOKENIZER_FILE];
            if m.files.contains_key(TOKENIZER_CONFIG_FILE) {
                needed.push(TOKENIZER_CONFIG_FILE);
            }
            m.verify_files(&dir, &needed)
        })
        .with_context(|| format!("the checkpoint {} fails verification", dir.display()))?;
    Ok(dir)
}

/// `--moe-capacity-factor`'s value, refused in the library's words.
pub fn parse_capacity_factor(s: &str) -> Result<CapacityFactor, String> {
    s.parse::<CapacityFactor>().map_err(|e| e.to_string())
}

/// `--pp-layers`' value: whole numbers separated by commas (checked against the model later).
pub fn parse_pp_layers(s: &str) -> Result<LayerCounts, String> {
    s.parse::<LayerCounts>().map_err(|e| e.to_string())
}

/// `--pp-last-stage-weight`'s value.
pub fn parse_last_stage_weight(s: &str) -> Result<LastStageWeight, String> {
    s.parse::<LastStageWeight>().map_err(|e| e.to_string())
}

/// The stage split `--pp-layers` and `--pp-last-stage-weight` give.
pub fn stage_split(layers: Option<LayerCounts>, weight: LastStageWeight) -> StageSplit {
    match layers {
        Some(counts) => StageSplit::Layers(counts),
        None => StageSplit::Balanced(weight),
    }
}

/// The flags a pipeline the model cannot take names: `--pp-layers` for its counts.
pub fn stage_flags(e: &tp_models::ModelError) -> &'static str {
    match e {
        tp_models::ModelError::Shard(s) if s.is_stage_split() => "--pp, --pp-layers",
        _ => "--pp",
    }
}

/// `--rank-weights`' value: whole numbers separated by commas, each 1..=1000.
pub fn parse_rank_weights(s: &str) -> Result<RankWeights, String> {
    s.parse::<RankWeights>().map_err(|e| e.to_string())
}

/// What rank 0 holds to lead (tp-engine's; the memory plan travels with it).
pub use tp_engine::Session;

/// A start error in the CLI's words: the flag to change.
pub fn start_error(e: StartError, backend: Backend) -> anyhow::Error {
    match e {
        StartError::NoRanks => anyhow!("--tp must be at least 1"),
        StartError::TpNotWorld { tp, world } => anyhow!(
            "--tp {tp} but mpirun started {world} processes; run `mpirun -n {tp} ...` or drop --tp"
        ),
        StartError::WeightsCount { weights, tp } => {
            let what = match backend {
                Backend::Mpi => format!("mpirun started {tp} processes"),
                Backend::Local => format!("tp is {tp}"),
            };
            anyhow!(
                "--rank-weights {weights} has {} weights but {what}; give exactly one weight per rank",
                weights.tp()
            )
        }
        StartError::EmptyContext => anyhow!("--ctx-size must be at least 1"),
        StartError::ExpertGroups { source } => anyhow!("{source} (--ep)"),
        StartError::Capacity { source } => anyhow!("{source} (--moe-capacity-factor)"),
        StartError::Stages { source } => {
            anyhow!("{} ({})", chain(&*source), stage_flags(&source))
        }
        e @ StartError::PipelineNotWorld { .. } => anyhow!("{e} (--pp, --tp)"),
        StartError::Session(e) => session_error(*e),
        e @ StartError::Open { .. } => anyhow!("{} (--model)", chain(&e)),
        e @ StartError::Draft(_) => anyhow!("{} (--draft-model)", chain(&e)),
        e => anyhow::Error::new(e),
    }
}

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
            held,
            need,
            limit,
            uneven,
            fits,
            heads,
            fits_positions,
        } => {
            let hint = match fits {
                Some(t) => format!("the smallest tp that fits is {t}: use --tp {t}"),
                None => format!(
                    "no tp up to {heads} (the head count) fits; lower --ctx-size, or keep weights quantized"
                ),
            };
            // What fits without more ranks: fewer positions.
            let hint = match fits_positions {
                Some(p) if p > 0 && held < ctx => format!(
                    "{hint}; or at tp {tp}, a prompt and --max-tokens of {p} positions at most"
                ),
                Some(p) if p > 0 => format!("{hint}; or at tp {tp}, --ctx-size {p} at most"),
                _ => hint,
            };
            let (who, hint) = match uneven {
                None => ("a rank".to_string(), hint),
                Some((rank, weights)) => (
                    format!("rank {rank} (--rank-weights {weights})"),
                    format!("lower its weight, or with even shards {hint}"),
                ),
            };
            let kv = if held < ctx {
                format!("{held} positions: the prompt and --max-tokens")
            } else {
                format!("{ctx} positions")
            };
            anyhow!(
                "{who} needs {} at tp {tp} (weights and a KV cache of {kv}) but --max-rank-memory is {}; {hint}",
                show_bytes(need),
                show_bytes(limit)
            )
        }
        SessionError::DraftOverRankLimit {
            tp,
            need,
            limit,
            draft_weights,
            draft_kv,
            fits,
            heads,
        } => {
            let more = match fits {
                Some(t) => format!("a larger --tp (the model fits beside the draft at --tp {t})"),
                None => format!("(no --tp up to {heads} fits beside the draft)"),
            };
            anyhow!(
                "rank 0 needs {} at tp {tp} with the --draft-model ({} of weights and {} of KV cache) but --max-rank-memory is {}; use a smaller --draft-model, {more}, or no --draft-model",
                show_bytes(need),
                show_bytes(draft_weights),
                show_bytes(draft_kv),
                show_bytes(limit)
            )
        }
        SessionError::WeightsSplit { weights, source } => {
            anyhow::Error::new(*source).context(format!("--rank-weights {weights} cannot split the model"))
        }
        e => anyhow::Error::new(e),
    }
}

/// Loads the model on every rank and runs `lead` on rank 0 while the others follow its steps
/// (tp-engine's `run_session` with these flags).
pub fn run_model<T: Send>(
    args: &ModelArgs,
    lead: impl Fn(&mut Session) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<Result<Option<T>, RanksFailed>> {
    run_model_holding(args, None, None, lead)
}

/// [`run_model`] for a server whose sequences together hold at most the KV blocks `budget`
/// allows: the memory preflight and --max-rank-memory price those blocks, not one --ctx-size,
/// and the `draft` model rank 0 loads beside them (its pool as many blocks, from the budget).
pub fn run_model_serving<T: Send>(
    args: &ModelArgs,
    budget: KvBudget,
    draft: Option<PathBuf>,
    lead: impl Fn(&mut Session) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<Result<Option<T>, RanksFailed>> {
    let cfg = SessionConfig {
        kv_budget: Some(budget),
        draft,
        ..args.session_config()?
    };
    run_session(&cfg, |e| start_error(e, args.backend), lead)
}

/// [`run_model`] for a run whose sequence holds at most the positions `held` tells (from the
/// tokenizer): the memory preflight and --max-rank-memory price those KV blocks, not the whole
/// --ctx-size, and the `draft` model rank 0 loads (its weights and a cache as long).
pub fn run_model_holding<T: Send>(
    args: &ModelArgs,
    held: Option<HeldPositions>,
    draft: Option<PathBuf>,
    lead: impl Fn(&mut Session) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<Result<Option<T>, RanksFailed>> {
    let cfg = SessionConfig {
        held,
        draft,
        ..args.session_config()?
    };
    run_session(&cfg, |e| start_error(e, args.backend), lead)
}

/// A positive number of seconds for `flag`.
pub fn seconds(flag: &str, v: f64) -> anyhow::Result<Duration> {
    match Duration::try_from_secs_f64(v) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => anyhow::bail!("{flag} must be a positive number of seconds, got {v}"),
    }
}
