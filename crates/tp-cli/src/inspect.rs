//! `tp inspect`: a model's shapes and the shard each rank would get at a given tp (heads, KV
//! heads and whether they are shared, FFN columns, vocab rows, bytes), without loading weights;
//! the report is tp-engine's `inspect::describe`.

use crate::model_run::{start_error, DTypeArg, KvDtypeArg};
use anyhow::Context;
use std::path::PathBuf;
use std::process::ExitCode;
use tp_engine::draft_model::{draft_memory, DraftPlan};
use tp_engine::inspect::describe;
use tp_engine::launch::Backend;
use tp_engine::report::chain;
use tp_engine::session::memory_plan;
use tp_engine::start::weights_for;
use tp_models::{open_checkpoint, LastStageWeight, LayerCounts, LoadOptions, RankWeights};

#[derive(clap::Args, Clone, Debug)]
pub struct InspectArgs {
    /// GGUF file or HF directory (default: the default model, fetched when missing).
    #[arg(value_name = "MODEL", conflicts_with = "model_flag")]
    pub model: Option<PathBuf>,
    /// The same as the positional MODEL, spelled as every other command takes it.
    #[arg(long = "model", id = "model_flag", value_name = "MODEL")]
    pub model_flag: Option<PathBuf>,
    /// Ranks (default 1, or the count of --rank-weights).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Pipeline stages of --tp ranks each: each rank's row names its stage and layers.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Layers per pipeline stage, first stage first (e.g. 14,10), as the model commands'
    /// --pp-layers [default: balanced by a compute model].
    #[arg(long, value_name = "N0,N1,..", value_parser = crate::model_run::parse_pp_layers, conflicts_with = "pp_last_stage_weight")]
    pub pp_layers: Option<LayerCounts>,
    /// The default split's last-stage cost weight, as the model commands'.
    #[arg(long, value_name = "W", value_parser = crate::model_run::parse_last_stage_weight, default_value_t = LastStageWeight::DEFAULT)]
    pub pp_last_stage_weight: LastStageWeight,
    /// One weight per rank (e.g. 2,1): shards in proportion to them, as the model commands'
    /// --rank-weights.
    #[arg(long, value_name = "W0,W1,..", value_parser = crate::model_run::parse_rank_weights, allow_hyphen_values = true)]
    pub rank_weights: Option<RankWeights>,
    /// KV cache positions to budget per rank (default: the model's context).
    #[arg(long)]
    pub ctx_size: Option<usize>,
    /// Element type of weights that are not kept quantized.
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    pub dtype: DTypeArg,
    #[arg(long)]
    pub dequantize: bool,
    /// Element type of the KV cache.
    #[arg(long, value_enum, default_value_t = KvDtypeArg::F16)]
    pub kv_dtype: KvDtypeArg,
    /// Expert-parallel size of a mixture of experts (must divide --tp).
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
    /// A draft model for speculative decoding: one more line on what it takes on rank 0 (its
    /// weights whole and a KV pool of --ctx-size positions) and rank 0's total with it.
    #[arg(long, value_name = "FILE")]
    pub draft_model: Option<PathBuf>,
}

pub fn run(args: &InspectArgs) -> anyhow::Result<ExitCode> {
    let path = match args.model_flag.as_ref().or(args.model.as_ref()) {
        Some(p) => crate::model_run::resolve_model_path(p)?,
        None => crate::model_run::default_model(true)?,
    };
    let ckpt = open_checkpoint(&path).with_context(|| format!("cannot load {}", path.display()))?;
    let opts = LoadOptions {
        keep_quantized: !args.dequantize,
        dense: args.dtype.dense(),
        kv_dtype: args.kv_dtype.kv_dtype(),
        expert_groups: args.ep,
        expert_capacity: None,
        pipeline_stages: args.pp,
        stage_split: crate::model_run::stage_split(args.pp_layers, args.pp_last_stage_weight),
    };
    // The stages first: a pp (or a layer split) the model cannot take names the valid range.
    tp_models::checkpoint_stages(&*ckpt, opts)
        .map_err(|e| anyhow::anyhow!("{e} ({})", crate::model_run::stage_flags(&e)))?;
    let tp = match (args.tp, &args.rank_weights) {
        (Some(tp), _) => tp,
        (None, Some(w)) => w.tp(),
        (None, None) => 1,
    };
    let weights =
        weights_for(args.rank_weights.as_ref(), tp).map_err(|e| start_error(e, Backend::Local))?;
    let text = match describe(&*ckpt, &weights, args.ctx_size, opts) {
        Err(e) if args.rank_weights.is_some() && e.is_split_error() => {
            return Err(anyhow::Error::new(e).context(format!(
                "--rank-weights {weights} cannot split {}",
                path.display()
            )))
        }
        r => r?,
    };
    print!("{text}");
    if let Some(draft) = &args.draft_model {
        let memory = draft_memory(draft, opts)
            .map_err(|e| anyhow::anyhow!("{} (--draft-model)", chain(&e)))?;
        let ctx = args.ctx_size.unwrap_or(ckpt.config().context);
        let plan = DraftPlan {
            path: draft.clone(),
            memory,
            blocks: ctx.div_ceil(tp_models::BLOCK_POSITIONS),
        };
        let rank0 = memory_plan(&*ckpt, &weights, ctx, opts)?
            .first()
            .map_or(0, |m| m.total() as u64);
        println!(
            "draft      {}",
            plan.describe(rank0.saturating_add(plan.total()))
        );
    }
    println!("kernels    {}", tp_kernels::kernel_report());
    Ok(ExitCode::SUCCESS)
}
