//! A model's shapes and the shard each rank gets at a layout (heads, KV heads and whether
//! they are shared, FFN columns, vocab rows, bytes, the KV cache per token, the balance), from
//! the checkpoint's metadata without loading weights: the report `tp inspect` prints. Under
//! pipelining each rank's row also names its stage and layers.

use crate::report::show_bytes;
use crate::session::memory_plan;
use tp_models::{world_plans, Checkpoint, LoadOptions, RankWeights, WeightName};

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
) -> tp_models::Result<String> {
    use std::fmt::Write;
    // Writing to a String cannot fail.
    let tp = weights.tp();
    let cfg = ckpt.config();
    let ctx = ctx_size.unwrap_or(cfg.context);
    let mut s = String::new();
    let _ = writeln!(s, "model      {}", ckpt.source());
    let _ = writeln!(
        s,
        "arch       {} ({} parameters)",
        cfg.arch.name(),
        cfg.parameter_count()
    );
    let _ = writeln!(
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
    );
    let _ = writeln!(
        s,
        "layout     rope {:?}, qkv bias {}, {}tied embeddings {}, rms eps {:e}, rope theta {}",
        cfg.rope_style,
        cfg.qkv_bias,
        match (cfg.qk_norm, cfg.block.qk_norm_whole) {
            (false, _) => "",
            (true, false) => "q/k norm per head, ",
            (true, true) => "q/k norm over all heads, ",
        },
        cfg.tied_embeddings,
        cfg.rms_eps,
        cfg.rope_theta
    );
    if let Some(block) = cfg.block.summary(cfg.layers) {
        let _ = writeln!(s, "block      {block}");
    }
    // The MLP's formats: expert 0's for a mixture of experts.
    let mlp = match cfg.experts {
        Some(_) => (
            WeightName::ExpertGate(0, 0),
            WeightName::ExpertUp(0, 0),
            WeightName::ExpertDown(0, 0),
        ),
        None => (WeightName::Gate(0), WeightName::Up(0), WeightName::Down(0)),
    };
    if let Some(e) = cfg.experts {
        let _ = writeln!(
            s,
            "experts    {} of FFN {}, {} per token ({}, top-k weights {}){}",
            e.count,
            cfg.ffn,
            e.per_token,
            match e.gating {
                tp_spec::Gating::Softmax => "softmax",
                tp_spec::Gating::Sigmoid => "sigmoid",
            },
            if e.normalize {
                "normalised"
            } else {
                "as gated"
            },
            e.shared_ffn
                .map_or(String::new(), |f| format!(", a shared expert of FFN {f}"))
        );
    }
    let _ = writeln!(
        s,
        "formats    q {}, k {}, v {}, o {}, gate {}, up {}, down {}, embedding {}, head {}",
        format_of(ckpt, WeightName::Q(0)),
        format_of(ckpt, WeightName::K(0)),
        format_of(ckpt, WeightName::V(0)),
        format_of(ckpt, WeightName::O(0)),
        format_of(ckpt, mlp.0),
        format_of(ckpt, mlp.1),
        format_of(ckpt, mlp.2),
        format_of(ckpt, WeightName::Embed),
        if cfg.tied_embeddings {
            "tied".to_string()
        } else {
            format_of(ckpt, WeightName::Output)
        },
    );
    let plan = memory_plan(ckpt, weights, ctx, opts)?;
    let weighted = if weights.is_even() {
        String::new()
    } else {
        format!(", rank weights {weights}")
    };
    let plans = world_plans(ckpt, weights, opts)?;
    let pp = opts.pipeline_stages;
    let staged = pp > 1;
    if staged {
        let stages = tp_models::checkpoint_stages(ckpt, opts)?;
        let counts: Vec<String> = stages
            .iter()
            .map(|st| st.layers.len().to_string())
            .collect();
        let _ = writeln!(
            s,
            "stages     {} layers, first stage first ({})",
            counts.join(","),
            match opts.stage_split {
                tp_spec::StageSplit::Layers(_) => "as given".to_string(),
                tp_spec::StageSplit::Balanced(w) =>
                    format!("balanced by multiply-adds per token, the last stage's weighted {w}"),
            }
        );
    }
    let _ = writeln!(
        s,
        "\n{}tp {tp}{weighted}: per rank (KV cache for {ctx} positions, {}; taken in blocks of {} as tokens arrive)",
        if staged { format!("pp {pp} x ") } else { String::new() },
        opts.kv_dtype,
        tp_models::BLOCK_POSITIONS
    );
    // Under pipelining: the stage, its layers and what else it holds.
    let stage_col = |p: &tp_models::ShardPlan| {
        if !staged {
            return String::new();
        }
        let st = &p.stage;
        let ends = match (st.is_first(), st.is_last()) {
            (true, _) => " +emb",
            (_, true) => " +head",
            _ => "",
        };
        format!(
            "{:>5}  {:>13}  ",
            st.index,
            format!("{}{ends}", range(st.layers.clone()))
        )
    };
    let _ = writeln!(
        s,
        "{:>4}  {}{:>9}  {:>9}  {:>11}  {:>13}  {:>10}  {:>10}  {:>10}  {:>10}",
        "rank",
        if staged {
            format!("{:>5}  {:>13}  ", "stage", "layers")
        } else {
            String::new()
        },
        "q heads",
        "kv heads",
        "ffn cols",
        "vocab rows",
        "sharded",
        "replicated",
        "kv cache",
        "total"
    );
    for (r, (m, p)) in plan.iter().zip(&plans).enumerate() {
        let kv = p.kv_heads();
        let shared = kv.len() * cfg.heads / cfg.kv_heads > p.q_heads().len();
        let _ = writeln!(
            s,
            "{:>4}  {}{:>9}  {:>9}  {:>11}  {:>13}  {:>10}  {:>10}  {:>10}  {:>10}",
            r,
            stage_col(p),
            range(p.q_heads()),
            format!("{}{}", range(kv), if shared { "*" } else { "" }),
            // A mixture of experts lists its experts per rank below.
            if cfg.experts.is_some() {
                "experts".to_string()
            } else {
                range(p.ffn_cols())
            },
            range(p.vocab_rows()),
            show_bytes(m.sharded as u64),
            show_bytes(m.replicated as u64),
            show_bytes(m.kv_cache as u64),
            show_bytes(m.total() as u64),
        );
    }
    if cfg.experts.is_some() {
        let _ = writeln!(
            s,
            "experts per rank (expert-parallel size {}):",
            opts.expert_groups
        );
        for r in 0..tp {
            let p = tp_models::rank_plan(ckpt, r, weights, opts.expert_groups)?;
            if let Some(x) = &p.experts {
                let cols = x.expert_cols(x.local.start);
                let _ = writeln!(
                    s,
                    "{r:>4}  experts {} ({} of {}), FFN columns {} of each{}",
                    range(x.local.clone()),
                    x.local.len(),
                    cfg.experts.map_or(0, |e| e.count),
                    range(cols),
                    match &x.shared {
                        Some(_) => format!(", shared expert {}", range(x.shared_cols(r))),
                        None => String::new(),
                    }
                );
            }
        }
    }
    if tp > cfg.kv_heads
        || plans
            .iter()
            .any(|p| p.kv_heads().len() * cfg.heads / cfg.kv_heads > p.q_heads().len())
    {
        let _ = writeln!(s, "* KV heads shared with a neighbouring rank (replicated: their weights and cache are held twice)");
    }
    let per_token = plans
        .iter()
        .map(|p| {
            tp_models::KvPool::bytes_per_block(
                p.stage.layers.len(),
                p.kv_heads().len(),
                cfg.head_dim,
                opts.kv_dtype,
            ) / tp_models::BLOCK_POSITIONS
        })
        .max()
        .unwrap_or(0);
    let _ = writeln!(
        s,
        "kv cache   {} per token held on the busiest rank ({})",
        show_bytes(per_token as u64),
        opts.kv_dtype
    );
    let total: usize = plan.iter().map(|m| m.total()).sum();
    let max = plan.iter().map(|m| m.total()).max().unwrap_or(0);
    let mean = total as f64 / plan.len().max(1) as f64;
    let _ = writeln!(
        s,
        "balance    busiest rank holds {:.1}% more than the mean; all ranks together {}",
        (max as f64 / mean.max(1.0) - 1.0) * 100.0,
        show_bytes(total as u64)
    );
    Ok(s)
}

fn range(r: std::ops::Range<usize>) -> String {
    format!("{}..{}", r.start, r.end)
}
