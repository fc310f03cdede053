//! Which heads, FFN columns and vocabulary rows each rank holds, and what that costs in
//! memory (docs/design.md "Uneven and head-granular shards").

use crate::checkpoint::{Checkpoint, WeightName};
use crate::error::Result;
use crate::kv_cache::{KvDtype, KvPool};
use crate::matrix::LoadOptions;
use tp_spec::{RankWeights, Stage};

pub use tp_spec::{ShardPlan, DENSE_CHUNK};

/// [`ShardPlan`]s for a checkpoint: the FFN unit is the quant block of its down projection
/// ([`DENSE_CHUNK`] columns for float weights: the chunk the f64-accumulating product sums in
/// f32, so shards of dense weights also split at chunk boundaries and stay tp-invariant).
pub trait CheckpointPlan: Sized {
    /// The balanced split of `ckpt` over `tp` ranks.
    fn for_checkpoint(ckpt: &dyn Checkpoint, tp_rank: usize, tp: usize) -> Result<Self>;
    /// The split of `ckpt` with shares in proportion to `weights`.
    fn for_checkpoint_weighted(
        ckpt: &dyn Checkpoint,
        tp_rank: usize,
        weights: &RankWeights,
    ) -> Result<Self>;
}

impl CheckpointPlan for ShardPlan {
    fn for_checkpoint(ckpt: &dyn Checkpoint, tp_rank: usize, tp: usize) -> Result<Self> {
        Ok(Self::new(ckpt.config(), ffn_unit_of(ckpt)?, tp_rank, tp)?)
    }

    fn for_checkpoint_weighted(
        ckpt: &dyn Checkpoint,
        tp_rank: usize,
        weights: &RankWeights,
    ) -> Result<Self> {
        Ok(Self::weighted(
            ckpt.config(),
            ffn_unit_of(ckpt)?,
            tp_rank,
            weights,
        )?)
    }
}

/// Rank `tp_rank`'s plan of `ckpt`: shares in proportion to `weights`, a mixture of experts
/// split over `expert_groups` groups. What the rank loads and what the memory plan prices.
pub fn rank_plan(
    ckpt: &dyn Checkpoint,
    tp_rank: usize,
    weights: &RankWeights,
    expert_groups: usize,
) -> Result<ShardPlan> {
    Ok(ShardPlan::for_checkpoint_weighted(ckpt, tp_rank, weights)?
        .with_expert_groups(ckpt.config(), expert_groups)?)
}

/// The pipeline stages of `ckpt` over `opts.pipeline_stages` stages, divided as
/// `opts.stage_split` says ([`tp_spec::pipeline_stages`]: by default balanced by the cost
/// model). Every rank computes the same.
pub fn checkpoint_stages(ckpt: &dyn Checkpoint, opts: LoadOptions) -> Result<Vec<Stage>> {
    Ok(tp_spec::pipeline_stages(
        ckpt.config(),
        opts.pipeline_stages,
        opts.stage_split,
    )?)
}

/// The storage of weight `name` as a rank holds it: as in the file, or dense when
/// dequantized.
fn layout_of(ckpt: &dyn Checkpoint, name: WeightName, quantized: bool) -> Result<tp_spec::Layout> {
    Ok(if quantized {
        ckpt.meta(name)?.storage.layout()
    } else {
        tp_spec::Layout::Float
    })
}

/// Every rank's plan of `ckpt` in world-rank order: `opts.pipeline_stages` stages of
/// `weights.tp()` consecutive tensor-parallel ranks, the last stage first
/// ([`tp_spec::stage_of_rank`]: rank 0 holds the head), each stage's ranks splitting its
/// layers with shares in proportion to `weights`.
pub fn world_plans(
    ckpt: &dyn Checkpoint,
    weights: &RankWeights,
    opts: LoadOptions,
) -> Result<Vec<ShardPlan>> {
    let stages = checkpoint_stages(ckpt, opts)?;
    let (tp, pp) = (weights.tp(), stages.len());
    (0..tp * pp)
        .map(|rank| {
            let (stage, t) = tp_spec::stage_of_rank(rank, tp, pp);
            Ok(rank_plan(ckpt, t, weights, opts.expert_groups)?.with_stage(stages[stage].clone()))
        })
        .collect()
}

/// World rank `rank`'s plan ([`world_plans`]).
pub fn world_rank_plan(
    ckpt: &dyn Checkpoint,
    rank: usize,
    weights: &RankWeights,
    opts: LoadOptions,
) -> Result<ShardPlan> {
    let tp = weights.tp();
    let stages = checkpoint_stages(ckpt, opts)?;
    let pp = stages.len();
    if rank >= tp * pp {
        return Err(crate::ModelError::Input(format!(
            "rank {rank} is outside {pp} stages of {tp} ranks"
        )));
    }
    let (stage, t) = tp_spec::stage_of_rank(rank, tp, pp);
    Ok(rank_plan(ckpt, t, weights, opts.expert_groups)?.with_stage(stages[stage].clone()))
}

/// The FFN unit of a checkpoint's shards.
pub fn ffn_unit_of(ckpt: &dyn Checkpoint) -> Result<usize> {
    // A mixture of experts: the experts' down projection (all experts share one format).
    let down = match ckpt.config().experts {
        Some(_) => WeightName::ExpertDown(0, 0),
        None => WeightName::Down(0),
    };
    Ok(ckpt.meta(down)?.storage.block().max(DENSE_CHUNK))
}

/// Bytes one rank holds, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankMemory {
    /// Weights split across ranks (including KV heads it shares with a neighbour).
    pub sharded: usize,
    /// What every rank holds whole: the norm weights.
    pub replicated: usize,
    /// KV cache at the context length.
    pub kv_cache: usize,
    /// Bytes of one KV block (`BLOCK_POSITIONS` positions of this rank's heads of its stage's
    /// layers): what a server's per-rank budget is divided by.
    pub kv_block_bytes: usize,
}

impl RankMemory {
    pub fn total(&self) -> usize {
        self.sharded + self.replicated + self.kv_cache
    }
}

/// What rank `plan.tp_rank` (of its stage) needs for the weights of `ckpt` and a KV cache of `ctx` positions.
/// Sizes that depend on `ctx` are checked: one that cannot be computed or exceeds the
/// machine's memory is a [`crate::ModelError::TooLarge`] naming `ctx` and the bytes.
/// `dense_bytes` is the element size of unquantized weights (4 for f32, 2 for f16/bf16);
/// `quantized` false means every weight is dequantized; `kv_dtype` is the KV cache's element
/// type (a cache of `ctx` positions is the most one sequence can hold; blocks are taken as
/// tokens arrive).
pub fn rank_memory(
    ckpt: &dyn Checkpoint,
    plan: &ShardPlan,
    ctx: usize,
    dense_bytes: usize,
    quantized: bool,
    kv_dtype: KvDtype,
) -> Result<RankMemory> {
    let cfg = ckpt.config();
    let hd = cfg.head_dim;
    let mut layout = |name: WeightName| layout_of(ckpt, name, quantized);
    let w = tp_spec::rank_weight_bytes(cfg, plan, &mut layout, dense_bytes)?;
    let mut m = RankMemory {
        sharded: w.sharded,
        replicated: w.replicated,
        kv_cache: 0,
        kv_block_bytes: KvPool::bytes_per_block(
            plan.stage.layers.len(),
            plan.kv_heads().len(),
            hd,
            kv_dtype,
        ),
    };
    let limit = crate::limits::memory_limit();
    let hint = "ask for a shorter context";
    m.kv_cache = crate::limits::check_bytes(
        "a KV cache for a context length of",
        ctx,
        KvPool::checked_bytes_for(
            plan.stage.layers.len(),
            plan.kv_heads().len(),
            hd,
            ctx,
            kv_dtype,
        ),
        limit,
        hint,
    )? as usize;
    Ok(m)
}
