//! Which heads, FFN columns and vocabulary rows each rank holds, and the bytes of weights that
//! makes (docs/design.md "Uneven and head-granular shards"): the one shard calculator that
//! loading, `tp inspect` and `tp plan` share.

use crate::config::ModelConfig;
use crate::error::ShardError;
use crate::params::{Placement, Split};
use crate::partition::{HeadPlan, Partition, RankWeights};
use crate::stage::Stage;
use crate::weights::{Expected, WeightName};
use std::ops::Range;

/// Columns a dense row-parallel product sums in f32 before widening to f64: the FFN unit of
/// float weights, so their shards also split at chunk boundaries and stay tp-invariant.
pub const DENSE_CHUNK: usize = 32;

/// One rank's share of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    pub tp_rank: usize,
    pub tp: usize,
    pub heads: HeadPlan,
    /// FFN columns in units of `ffn_unit` (the down projection's quant block, so shards of
    /// quantized weights stay block aligned).
    pub ffn: Partition,
    pub ffn_unit: usize,
    pub vocab: Partition,
    /// Rows (or columns) of one head in the attention matrices.
    pub head_dim: usize,
    /// How a mixture of experts is split (`None` for a dense model).
    pub experts: Option<ExpertShard>,
    /// The pipeline stage this rank belongs to: the layers it holds, whether it holds the
    /// embedding and the head ([`Stage::whole`] without pipelining).
    pub stage: Stage,
}

/// One rank's share of the experts of every MoE layer (docs/moe.md). The tp ranks form `ep`
/// expert groups of `tp / ep` consecutive ranks; the experts are split over the groups
/// (balanced, whole experts: 8 over 3 groups is 3|3|2), and inside a group every expert is
/// sliced by FFN columns like the dense MLP (expert-TP). `ep = 1` slices every expert over all
/// ranks; `ep = tp` gives each rank whole experts. The router is replicated, and a shared
/// expert is split over all tp ranks like a dense MLP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertShard {
    pub ep: usize,
    /// This rank's experts.
    pub local: Range<usize>,
    /// One expert's FFN units over the ranks of a group, and the unit.
    pub ffn: Partition,
    pub ffn_unit: usize,
    /// This rank's index in its expert group.
    pub rank_in_group: usize,
    /// The shared expert's FFN units over all tp ranks, and the unit.
    pub shared: Option<(Partition, usize)>,
}

impl ExpertShard {
    /// The split of `cfg`'s experts for rank `tp_rank` of `tp` in `ep` expert groups.
    pub fn new(
        cfg: &ModelConfig,
        ffn_unit: usize,
        tp_rank: usize,
        tp: usize,
        ep: usize,
    ) -> Result<Option<Self>, ShardError> {
        match cfg.experts {
            Some(e) => Self::for_experts(e, cfg.ffn, ffn_unit, tp_rank, tp, ep).map(Some),
            None => Ok(None),
        }
    }

    /// The split of `e` (experts of FFN `ffn`) alone, for a layer built outside a model.
    pub fn for_experts(
        e: crate::config::Experts,
        ffn: usize,
        ffn_unit: usize,
        tp_rank: usize,
        tp: usize,
        ep: usize,
    ) -> Result<Self, ShardError> {
        if ep == 0 || tp == 0 || !tp.is_multiple_of(ep) {
            return Err(ShardError::ExpertGroups { ep, tp });
        }
        if ep > e.count {
            return Err(ShardError::TooFewExperts {
                experts: e.count,
                ep,
            });
        }
        let per_group = tp / ep;
        let groups = Partition::new(e.count, ep, "experts", "expert")?;
        let (ffn, unit) = ffn_split(ffn, ffn_unit, per_group)?;
        let shared = match e.shared_ffn {
            Some(f) => Some(ffn_split(f, ffn_unit, tp)?),
            None => None,
        };
        Ok(ExpertShard {
            ep,
            local: groups.range(tp_rank / per_group),
            ffn,
            ffn_unit: unit,
            rank_in_group: tp_rank % per_group,
            shared,
        })
    }

    /// The columns of an expert this rank holds (empty for an expert of another group).
    pub fn expert_cols(&self, expert: usize) -> Range<usize> {
        if !self.local.contains(&expert) {
            return 0..0;
        }
        let r = self.ffn.range(self.rank_in_group);
        r.start * self.ffn_unit..r.end * self.ffn_unit
    }

    /// The shared expert's columns this rank holds.
    pub fn shared_cols(&self, tp_rank: usize) -> Range<usize> {
        match &self.shared {
            Some((p, unit)) => {
                let r = p.range(tp_rank);
                r.start * unit..r.end * unit
            }
            None => 0..0,
        }
    }
}

/// The balanced split of `ffn` columns over `tp` ranks and its unit: `ffn_unit` columns when
/// that unit divides the width into at least `tp` units, else single columns. The one rule
/// both executors split the MLP by, so a training rank's shard is an inference rank's.
pub fn ffn_split(ffn: usize, ffn_unit: usize, tp: usize) -> Result<(Partition, usize), ShardError> {
    let unit = if ffn_unit > 0 && ffn.is_multiple_of(ffn_unit) && ffn / ffn_unit >= tp {
        ffn_unit
    } else {
        1
    };
    Ok((
        Partition::new(ffn / unit, tp, "FFN columns", "FFN column")?,
        unit,
    ))
}

impl ShardPlan {
    /// The balanced split over `tp` ranks. The FFN is cut in units of `ffn_unit` when it
    /// divides the FFN width into at least `tp` units, else in single columns.
    pub fn new(
        cfg: &ModelConfig,
        ffn_unit: usize,
        tp_rank: usize,
        tp: usize,
    ) -> Result<Self, ShardError> {
        let block = Self::for_block(
            cfg.heads,
            cfg.kv_heads,
            cfg.head_dim,
            cfg.ffn,
            ffn_unit,
            tp_rank,
            tp,
        )?;
        let vocab = Partition::new(cfg.vocab, tp, "vocabulary rows", "vocabulary row")?;
        let experts = ExpertShard::new(cfg, ffn_unit, tp_rank, tp, 1)?;
        Ok(ShardPlan {
            vocab,
            experts,
            stage: Stage::whole(cfg.layers),
            ..block
        })
    }

    /// This plan with the experts split over `ep` expert groups ([`ExpertShard`]); a dense
    /// model takes only `ep = 1`.
    pub fn with_expert_groups(self, cfg: &ModelConfig, ep: usize) -> Result<Self, ShardError> {
        if ep == 0 || !self.tp.is_multiple_of(ep) {
            return Err(ShardError::ExpertGroups { ep, tp: self.tp });
        }
        if cfg.experts.is_none() && ep != 1 {
            return Err(ShardError::NoExperts { ep });
        }
        let unit = self.experts.as_ref().map_or(self.ffn_unit, |e| e.ffn_unit);
        let experts = ExpertShard::new(cfg, unit, self.tp_rank, self.tp, ep)?;
        Ok(ShardPlan { experts, ..self })
    }

    /// This plan for pipeline stage `stage` (from [`crate::stages`]): the same tensor-parallel
    /// split of the stage's layers.
    pub fn with_stage(self, stage: Stage) -> Self {
        ShardPlan { stage, ..self }
    }

    /// Expert groups of the plan (1 for a dense model).
    pub fn ep(&self) -> usize {
        self.experts.as_ref().map_or(1, |e| e.ep)
    }

    /// Every split (query heads, FFN blocks, vocabulary rows) in proportion to `weights`, one
    /// per rank ([`Partition::weighted`]); equal weights give [`ShardPlan::new`]'s plan. The
    /// FFN stays in units of `ffn_unit` when every rank's share is at least one unit, as in
    /// the balanced plan; KV heads follow the query heads.
    pub fn weighted(
        cfg: &ModelConfig,
        ffn_unit: usize,
        tp_rank: usize,
        weights: &RankWeights,
    ) -> Result<Self, ShardError> {
        let tp = weights.tp();
        let heads = HeadPlan::weighted(cfg.heads, cfg.kv_heads, tp_rank, weights)?;
        let in_blocks = (ffn_unit > 0 && cfg.ffn.is_multiple_of(ffn_unit))
            .then(|| Partition::weighted(cfg.ffn / ffn_unit, weights, "FFN blocks", "FFN block"))
            .and_then(|p| p.ok());
        let (ffn, unit) = match in_blocks {
            Some(p) => (p, ffn_unit),
            None => (
                Partition::weighted(cfg.ffn, weights, "FFN columns", "FFN column")?,
                1,
            ),
        };
        let vocab = Partition::weighted(cfg.vocab, weights, "vocabulary rows", "vocabulary row")?;
        // Experts are split evenly whatever the weights (an expert is not divisible by a
        // rank's speed without breaking its blocks).
        let experts = ExpertShard::new(cfg, ffn_unit, tp_rank, tp, 1)?;
        Ok(ShardPlan {
            tp_rank,
            tp,
            heads,
            ffn,
            ffn_unit: unit,
            vocab,
            head_dim: cfg.head_dim,
            experts,
            stage: Stage::whole(cfg.layers),
        })
    }

    /// The balanced plan of one transformer block alone (no vocabulary rows: its vocabulary
    /// range is empty), for a block built outside a model: the same heads and FFN split as
    /// [`ShardPlan::new`] gives a model of these sizes.
    pub fn for_block(
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        ffn: usize,
        ffn_unit: usize,
        tp_rank: usize,
        tp: usize,
    ) -> Result<Self, ShardError> {
        let heads = HeadPlan::new(heads, kv_heads, tp_rank, tp)?;
        let (ffn, unit) = ffn_split(ffn, ffn_unit, tp)?;
        Ok(ShardPlan {
            tp_rank,
            tp,
            heads,
            ffn,
            ffn_unit: unit,
            vocab: Partition::empty(tp),
            head_dim,
            experts: None,
            stage: Stage::whole(1),
        })
    }

    pub fn q_heads(&self) -> Range<usize> {
        self.heads.q_range()
    }
    pub fn kv_heads(&self) -> Range<usize> {
        self.heads.kv_range()
    }
    pub fn ffn_cols(&self) -> Range<usize> {
        let r = self.ffn.range(self.tp_rank);
        r.start * self.ffn_unit..r.end * self.ffn_unit
    }
    pub fn vocab_rows(&self) -> Range<usize> {
        self.vocab.range(self.tp_rank)
    }
}

/// How a 2-D weight's rows are stored, as far as its bytes go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Blocks of `block` elements in `block_bytes` bytes along each row (ggml quantizations).
    Blocks { block: usize, block_bytes: usize },
    /// Floats, converted at load to the dense element size.
    Float,
}

impl Layout {
    /// The layout of a ggml tensor type id (as in a GGUF header): block size and bytes of the
    /// quantizations the kernels run, `Float` for F32/F16/BF16, `None` for the rest.
    pub fn of_ggml_type(type_id: u32) -> Option<Layout> {
        let (block, block_bytes) = match type_id {
            0 | 1 | 30 => return Some(Layout::Float),
            2 => (32, 18),   // Q4_0
            3 => (32, 20),   // Q4_1
            6 => (32, 22),   // Q5_0
            7 => (32, 24),   // Q5_1
            8 => (32, 34),   // Q8_0
            10 => (256, 84), // Q2_K
            11 => (256, 110),
            12 => (256, 144),
            13 => (256, 176),
            14 => (256, 210), // Q6_K
            20 => (32, 18),   // IQ4_NL
            23 => (256, 136), // IQ4_XS
            _ => return None,
        };
        Some(Layout::Blocks { block, block_bytes })
    }

    /// The FFN unit of shards whose down projection is stored this way: its block, at least
    /// [`DENSE_CHUNK`].
    pub fn ffn_unit(self) -> usize {
        match self {
            Layout::Blocks { block, .. } => block.max(DENSE_CHUNK),
            Layout::Float => DENSE_CHUNK,
        }
    }
}

/// Width of a K-quant super-block, and of the sub-blocks a shard may cut it at.
const SUPER_BLOCK: usize = 256;
const SUB_BLOCK: usize = 32;

impl Layout {
    /// Bytes a `[rows, cols]` slice starting at column `col_start` occupies once loaded:
    /// quantized shards keep their blocks when aligned (K-quants: the super-blocks a range on
    /// 32-wide sub-blocks touches), everything else becomes `dense_bytes` per element.
    pub fn slice_bytes(
        self,
        rows: usize,
        cols: usize,
        col_start: usize,
        dense_bytes: usize,
    ) -> usize {
        match self {
            Layout::Blocks { block, block_bytes } => {
                if col_start.is_multiple_of(block) && cols.is_multiple_of(block) {
                    rows * (cols / block) * block_bytes
                } else if block == SUPER_BLOCK
                    && col_start.is_multiple_of(SUB_BLOCK)
                    && cols.is_multiple_of(SUB_BLOCK)
                {
                    rows * ((col_start + cols).div_ceil(block) - col_start / block) * block_bytes
                } else {
                    rows * cols * dense_bytes
                }
            }
            Layout::Float => rows * cols * dense_bytes,
        }
    }
}

/// Bytes of weights one rank holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightBytes {
    /// Weights split across ranks (including KV heads it shares with a neighbour, and biases).
    pub sharded: usize,
    /// What every rank holds whole: the norm weights (f32), Qwen3's q/k norms included.
    pub replicated: usize,
}

/// The weight bytes of rank `plan.tp_rank` of its pipeline stage, from the parameter table: `layout` gives each
/// matrix's storage (an error from it is returned as is), `dense_bytes` the element size of
/// unquantized weights (4 for f32, 2 for f16/bf16). Vectors (norms, biases) are f32: split ones
/// count as sharded, whole ones as replicated.
pub fn rank_weight_bytes<E>(
    cfg: &ModelConfig,
    plan: &ShardPlan,
    layout: &mut dyn FnMut(WeightName) -> Result<Layout, E>,
    dense_bytes: usize,
) -> Result<WeightBytes, E> {
    params_weight_bytes(plan, &plan.stage.params(cfg), layout, dense_bytes)
}

/// The bytes rank `plan.tp_rank` holds of `params` (as [`rank_weight_bytes`] counts them).
pub fn params_weight_bytes<E>(
    plan: &ShardPlan,
    params: &[crate::params::Param],
    layout: &mut dyn FnMut(WeightName) -> Result<Layout, E>,
    dense_bytes: usize,
) -> Result<WeightBytes, E> {
    let mut m = WeightBytes::default();
    for p in params {
        let place = plan.place(p);
        let local = |extent: usize, dim: usize| match &place {
            Placement::Sharded { dim: d, range } if *d == dim => (range.len(), range.start),
            _ => (extent, 0),
        };
        match p.shape {
            Expected::Vector { len } => {
                let bytes = local(len, 0).0 * 4;
                match p.split {
                    Split::Replicated => m.replicated += bytes,
                    _ => m.sharded += bytes,
                }
            }
            Expected::Matrix { rows, cols } => {
                let (rows, _) = local(rows, 0);
                let (cols, col_start) = local(cols, 1);
                let bytes =
                    layout(p.name).map(|l| l.slice_bytes(rows, cols, col_start, dense_bytes))?;
                match p.split {
                    // A router: every rank holds it whole.
                    Split::Replicated => m.replicated += bytes,
                    _ => m.sharded += bytes,
                }
            }
        }
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{Arch, RopeStyle};

    fn cfg() -> ModelConfig {
        ModelConfig {
            arch: Arch::Qwen2,
            layers: 2,
            hidden: 1536,
            ffn: 8960,
            heads: 12,
            kv_heads: 2,
            head_dim: 128,
            vocab: 1000,
            rms_eps: 1e-6,
            rope_theta: 1e6,
            rope_style: RopeStyle::RotateHalf,
            context: 64,
            qkv_bias: true,
            qk_norm: false,
            tied_embeddings: true,
            block: crate::BlockStyle::LLAMA,
            experts: None,
        }
    }

    #[test]
    fn stages_hold_every_weight_once_and_a_tied_head_twice() {
        let mut c = cfg();
        c.layers = 5;
        let f32s = &mut |_| Ok::<_, ()>(Layout::Float);
        for tied in [true, false] {
            c.tied_embeddings = tied;
            for tp in 1..=2 {
                for r in 0..tp {
                    let plan = ShardPlan::new(&c, 32, r, tp).unwrap();
                    let whole = rank_weight_bytes(&c, &plan, f32s, 4).unwrap();
                    let embed = plan.vocab_rows().len() * c.hidden * 4;
                    for pp in 1..=5 {
                        let layer = |_| 1u64;
                        let staged: Vec<WeightBytes> = crate::stages(&c, pp, layer, 0)
                            .unwrap()
                            .into_iter()
                            .map(|s| {
                                rank_weight_bytes(&c, &plan.clone().with_stage(s), f32s, 4).unwrap()
                            })
                            .collect();
                        let sharded: usize = staged.iter().map(|w| w.sharded).sum();
                        let replicated: usize = staged.iter().map(|w| w.replicated).sum();
                        let extra = if tied && pp > 1 { embed } else { 0 };
                        assert_eq!(
                            sharded,
                            whole.sharded + extra,
                            "tied {tied} tp {tp} pp {pp}"
                        );
                        assert_eq!(replicated, whole.replicated);
                    }
                }
            }
        }
    }

    #[test]
    fn k_quant_row_shards_keep_the_super_blocks_they_touch() {
        let q4k = Layout::Blocks {
            block: 256,
            block_bytes: 144,
        };
        // Qwen2.5-1.5B o_proj at tp 4: 384 columns from 384 touch super-blocks 1 and 2.
        assert_eq!(q4k.slice_bytes(10, 384, 384, 4), 10 * 2 * 144);
        assert_eq!(q4k.slice_bytes(10, 512, 0, 4), 10 * 2 * 144);
        // Off the 32-wide sub-blocks: dequantized.
        assert_eq!(q4k.slice_bytes(10, 48, 16, 4), 10 * 48 * 4);
        assert_eq!(Layout::Float.slice_bytes(3, 5, 1, 2), 30);
    }

    #[test]
    fn shards_cover_the_model_once_but_replicate_kv_heads() {
        let c = cfg();
        let q8 = Layout::Blocks {
            block: 32,
            block_bytes: 34,
        };
        let total = |tp: usize| -> usize {
            (0..tp)
                .map(|r| {
                    let plan = ShardPlan::new(&c, 32, r, tp).unwrap();
                    let mut l = |_| Ok::<_, ()>(q8);
                    rank_weight_bytes(&c, &plan, &mut l, 4).unwrap().sharded
                })
                .sum()
        };
        // tp 2: KV heads split once; tp 4: the 2 KV heads (K and V rows, biases) are each
        // held twice in every layer.
        let kv = c.layers * 2 * (2 * 128 * 1536 / 32 * 34 + 2 * 128 * 4);
        assert_eq!(total(2), total(1));
        assert_eq!(total(4), total(1) + kv);
        assert!(
            ShardPlan::new(&c, 32, 0, 13).is_err(),
            "more ranks than heads"
        );
    }
}
