//! `tp inspect`: a model's shapes and the shard each rank would get at a given tp (heads, KV
//! heads and whether they are shared, FFN columns, vocab rows, bytes), without loading weights.

use crate::model_run::{start_error, DTypeArg, KvDtypeArg};
use anyhow::Context;
use std::path::PathBuf;
use std::process::ExitCode;
use tp_engine::launch::Backend;
use tp_engine::report::show_bytes;
use tp_engine::session::memory_plan;
use tp_engine::start::weights_for;
use tp_models::{
    open_checkpoint, Checkpoint, CheckpointPlan, DenseDType, LoadOptions, RankWeights, ShardPlan,
    WeightName,
};

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
}

pub fn run(args: &InspectArgs) -> anyhow::Result<ExitCode> {
    let path = match args.model_flag.as_ref().or(args.model.as_ref()) {
        Some(p) => crate::model_run::resolve_model_path(p)?,
        None => crate::model_run::default_model(true)?,
    };
    let ckpt = open_checkpoint(&path).with_context(|| format!("cannot load {}", path.display()))?;
    let dense = match args.dtype {
        DTypeArg::F32 => DenseDType::F32,
        DTypeArg::F16 => DenseDType::F16,
        DTypeArg::Bf16 => DenseDType::BF16,
    };
    let opts = LoadOptions {
        keep_quantized: !args.dequantize,
        dense,
        kv_dtype: args.kv_dtype.kv_dtype(),
    };
    let tp = match (args.tp, &args.rank_weights) {
        (Some(tp), _) => tp,
        (None, Some(w)) => w.tp(),
        (None, None) => 1,
    };
    let weights =
        weights_for(args.rank_weights.as_ref(), tp).map_err(|e| start_error(e, Backend::Local))?;
    let text = match describe(&*ckpt, &weights, args.ctx_size, opts) {
        Err(e)
            if args.rank_weights.is_some()
                && e.downcast_ref::<tp_models::ModelError>()
                    .is_some_and(|e| e.is_split_error()) =>
        {
            return Err(e.context(format!(
                "--rank-weights {weights} cannot split {}",
                path.display()
            )))
        }
        r => r?,
    };
    print!("{text}");
    println!("kernels    {}", tp_kernels::kernel_report());
    Ok(ExitCode::SUCCESS)
}

fn format_of(ckpt: &dyn Checkpoint, name: WeightName) -> String {
    match ckpt.meta(name) {
        Ok(m) => match m.storage {
            tp_models::checkpoint::Storage::Quant(t) => format!("{t:?}"),
            tp_models::checkpoint::Storage::Float { bytes } => format!("float{}", bytes * 8),
        },
        Err(_) => "-".into(),
    }
}

/// The report `tp inspect` prints.
pub fn describe(
    ckpt: &dyn Checkpoint,
    weights: &RankWeights,
    ctx_size: Option<usize>,
    opts: LoadOptions,
) -> anyhow::Result<String> {
    use std::fmt::Write;
    let tp = weights.tp();
    let cfg = ckpt.config();
    let ctx = ctx_size.unwrap_or(cfg.context);
    let mut s = String::new();
    writeln!(s, "model      {}", ckpt.source())?;
    writeln!(
        s,
        "arch       {} ({} parameters)",
        cfg.arch.name(),
        cfg.parameter_count()
    )?;
    writeln!(
        s,
        "shapes     {} layers, hidden {}, FFN {}, {} heads x {} dims, {} KV heads (groups of {}), vocab {}, context {}",
        cfg.layers,
        cfg.hidden,
        cfg.ffn,
        cfg.heads,
        cfg.head_dim,
        cfg.kv_heads,
        cfg.heads / cfg.kv_heads,
        cfg.vocab,
        cfg.context
    )?;
    writeln!(
        s,
        "layout     rope {:?}, qkv bias {}, {}tied embeddings {}, rms eps {:e}, rope theta {}",
        cfg.rope_style,
        cfg.qkv_bias,
        if cfg.qk_norm {
            "q/k norm per head, "
        } else {
            ""
        },
        cfg.tied_embeddings,
        cfg.rms_eps,
        cfg.rope_theta
    )?;
    if let Some(block) = cfg.block.summary(cfg.layers) {
        writeln!(s, "block      {block}")?;
    }
    writeln!(
        s,
        "formats    q {}, k {}, v {}, o {}, gate {}, up {}, down {}, embedding {}, head {}",
        format_of(ckpt, WeightName::Q(0)),
        format_of(ckpt, WeightName::K(0)),
        format_of(ckpt, WeightName::V(0)),
        format_of(ckpt, WeightName::O(0)),
        format_of(ckpt, WeightName::Gate(0)),
        format_of(ckpt, WeightName::Up(0)),
        format_of(ckpt, WeightName::Down(0)),
        format_of(ckpt, WeightName::Embed),
        if cfg.tied_embeddings {
            "tied".to_string()
        } else {
            format_of(ckpt, WeightName::Output)
        },
    )?;
    let plan = memory_plan(ckpt, weights, ctx, opts)?;
    let weighted = if weights.is_even() {
        String::new()
    } else {
        format!(", rank weights {weights}")
    };
    writeln!(
        s,
        "\ntp {tp}{weighted}: per rank (KV cache for {ctx} positions, {}; taken in blocks of {} as tokens arrive)",
        opts.kv_dtype,
        tp_models::BLOCK_POSITIONS
    )?;
    writeln!(
        s,
        "{:>4}  {:>9}  {:>9}  {:>11}  {:>13}  {:>10}  {:>10}  {:>10}  {:>10}",
        "rank",
        "q heads",
        "kv heads",
        "ffn cols",
        "vocab rows",
        "sharded",
        "replicated",
        "kv cache",
        "total"
    )?;
    for (r, m) in plan.iter().enumerate() {
        let p = ShardPlan::for_checkpoint_weighted(ckpt, r, weights)?;
        let kv = p.kv_heads();
        let shared = kv.len() * cfg.heads / cfg.kv_heads > p.q_heads().len();
        writeln!(
            s,
            "{:>4}  {:>9}  {:>9}  {:>11}  {:>13}  {:>10}  {:>10}  {:>10}  {:>10}",
            r,
            range(p.q_heads()),
            format!("{}{}", range(kv), if shared { "*" } else { "" }),
            range(p.ffn_cols()),
            range(p.vocab_rows()),
            show_bytes(m.sharded as u64),
            show_bytes(m.replicated as u64),
            show_bytes(m.kv_cache as u64),
            show_bytes(m.total() as u64),
        )?;
    }
    if tp > cfg.kv_heads
        || (0..tp).any(|r| {
            ShardPlan::for_checkpoint_weighted(ckpt, r, weights)
                .is_ok_and(|p| p.kv_heads().len() * cfg.heads / cfg.kv_heads > p.q_heads().len())
        })
    {
        writeln!(s, "* KV heads shared with a neighbouring rank (replicated: their weights and cache are held twice)")?;
    }
    let per_token = (0..tp)
        .filter_map(|r| ShardPlan::for_checkpoint(ckpt, r, tp).ok())
        .map(|p| {
            tp_models::KvPool::bytes_per_block(
                cfg.layers,
                p.kv_heads().len(),
                cfg.head_dim,
                opts.kv_dtype,
            ) / tp_models::BLOCK_POSITIONS
        })
        .max()
        .unwrap_or(0);
    writeln!(
        s,
        "kv cache   {} per token held on the busiest rank ({})",
        show_bytes(per_token as u64),
        opts.kv_dtype
    )?;
    let total: usize = plan.iter().map(|m| m.total()).sum();
    let max = plan.iter().map(|m| m.total()).max().unwrap_or(0);
    let mean = total as f64 / plan.len().max(1) as f64;
    writeln!(
        s,
        "balance    busiest rank holds {:.1}% more than the mean; all ranks together {}",
        (max as f64 / mean.max(1.0) - 1.0) * 100.0,
        show_bytes(total as u64)
    )?;
    Ok(s)
}

fn range(r: std::ops::Range<usize>) -> String {
    format!("{}..{}", r.start, r.end)
}
