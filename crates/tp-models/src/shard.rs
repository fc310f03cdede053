//! Which heads, FFN columns and vocabulary rows each rank holds, and what that costs in
//! memory (docs/design.md "Uneven and head-granular shards").

use crate::checkpoint::{Checkpoint, Storage, WeightName};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv_cache::{KvDtype, KvPool};
use std::ops::Range;
use tp_nn::{HeadPlan, Partition, RankWeights};

/// Columns a dense row-parallel product sums in f32 before widening to f64.
pub const DENSE_CHUNK: usize = 32;

/// One rank's share of a model.
#[derive(Clone, Debug)]
pub struct ShardPlan {
    pub tp_rank: usize,
    pub tp: usize,
    pub heads: HeadPlan,
    /// FFN columns in units of `ffn_unit` (the down projection's quant block, so shards of
    /// quantized weights stay block aligned).
    pub ffn: Partition,
    pub ffn_unit: usize,
    pub vocab: Partition,
}

impl ShardPlan {
    /// The balanced split over `tp` ranks.
    pub fn new(cfg: &ModelConfig, ffn_unit: usize, tp_rank: usize, tp: usize) -> Result<Self> {
        let heads = HeadPlan::new(cfg.heads, cfg.kv_heads, tp_rank, tp)?;
        let unit = if ffn_unit > 0 && cfg.ffn.is_multiple_of(ffn_unit) && cfg.ffn / ffn_unit >= tp {
            ffn_unit
        } else {
            1
        };
        let ffn = Partition::new(cfg.ffn / unit, tp, "FFN columns", "FFN column")?;
        let vocab = Partition::new(cfg.vocab, tp, "vocabulary rows", "vocabulary row")?;
        Ok(ShardPlan {
            tp_rank,
            tp,
            heads,
            ffn,
            ffn_unit: unit,
            vocab,
        })
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
    ) -> Result<Self> {
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
        Ok(ShardPlan {
            tp_rank,
            tp,
            heads,
            ffn,
            ffn_unit: unit,
            vocab,
        })
    }

    /// For a checkpoint: the FFN unit is the quant block of its down projection (32 columns
    /// for float weights: the chunk the f64-accumulating product sums in f32, so shards of
    /// dense weights also split at chunk boundaries and stay tp-invariant).
    pub fn for_checkpoint(ckpt: &dyn Checkpoint, tp_rank: usize, tp: usize) -> Result<Self> {
        Self::new(ckpt.config(), Self::ffn_unit_of(ckpt)?, tp_rank, tp)
    }

    /// [`ShardPlan::for_checkpoint`] with shares in proportion to `weights`.
    pub fn for_checkpoint_weighted(
        ckpt: &dyn Checkpoint,
        tp_rank: usize,
        weights: &RankWeights,
    ) -> Result<Self> {
        Self::weighted(ckpt.config(), Self::ffn_unit_of(ckpt)?, tp_rank, weights)
    }

    fn ffn_unit_of(ckpt: &dyn Checkpoint) -> Result<usize> {
        Ok(ckpt
            .meta(WeightName::Down(0))?
            .storage
            .block()
            .max(DENSE_CHUNK))
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

/// Bytes one rank holds, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankMemory {
    /// Weights split across ranks (including KV heads it shares with a neighbour).
    pub sharded: usize,
    /// What every rank holds whole: norm weights and the RoPE table of the context.
    pub replicated: usize,
    /// KV cache at the context length.
    pub kv_cache: usize,
}

impl RankMemory {
    pub fn total(&self) -> usize {
        self.sharded + self.replicated + self.kv_cache
    }
}

/// Bytes a weight slice will occupy once loaded: quantized shards keep their blocks when
/// aligned (K-quants: the super-blocks a range on 32-wide sub-blocks touches), everything
/// else becomes `dense_bytes` per element.
fn slice_bytes(
    storage: Storage,
    rows: usize,
    cols: usize,
    col_start: usize,
    dense_bytes: usize,
) -> usize {
    match storage {
        Storage::Quant(t) => {
            let b = t.block_size();
            if col_start.is_multiple_of(b) && cols.is_multiple_of(b) {
                rows * (cols / b) * t.type_size()
            } else if b == 256 && col_start.is_multiple_of(32) && cols.is_multiple_of(32) {
                // A K-quant range on 32-wide sub-blocks keeps the super-blocks it touches.
                rows * ((col_start + cols).div_ceil(b) - col_start / b) * t.type_size()
            } else {
                rows * cols * dense_bytes
            }
        }
        Storage::Float { .. } => rows * cols * dense_bytes,
    }
}

/// What rank `plan.tp_rank` needs for the weights of `ckpt` and a KV cache of `ctx` positions.
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
    let q_rows = plan.q_heads().len() * hd;
    let kv_rows = plan.kv_heads().len() * hd;
    let ffn = plan.ffn_cols();
    let vocab = plan.vocab_rows().len();
    let mut m = RankMemory::default();
    let size = |name: WeightName, rows: usize, cols: usize, col_start: usize| -> Result<usize> {
        let meta = ckpt.meta(name)?;
        let storage = if quantized {
            meta.storage
        } else {
            Storage::Float { bytes: dense_bytes }
        };
        Ok(slice_bytes(storage, rows, cols, col_start, dense_bytes))
    };
    for l in 0..cfg.layers {
        m.sharded += size(WeightName::Q(l), q_rows, cfg.hidden, 0)?;
        m.sharded += 2 * size(WeightName::K(l), kv_rows, cfg.hidden, 0)?;
        m.sharded += size(
            WeightName::O(l),
            cfg.hidden,
            q_rows,
            plan.q_heads().start * hd,
        )?;
        m.sharded += 2 * size(WeightName::Gate(l), ffn.len(), cfg.hidden, 0)?;
        m.sharded += size(WeightName::Down(l), cfg.hidden, ffn.len(), ffn.start)?;
        if cfg.qkv_bias {
            m.sharded += (q_rows + 2 * kv_rows) * 4;
        }
        m.replicated += 2 * cfg.hidden * 4;
    }
    m.sharded += size(WeightName::Embed, vocab, cfg.hidden, 0)?;
    if !cfg.tied_embeddings {
        m.sharded += size(WeightName::Output, vocab, cfg.hidden, 0)?;
    }
    m.replicated += cfg.hidden * 4;
    let limit = crate::limits::memory_limit();
    let hint = "ask for a shorter context";
    // Every rank builds the RoPE table whole (replicated).
    m.replicated += crate::limits::check_bytes(
        "a RoPE table for a context length of",
        ctx,
        crate::ops::RopeTable::bytes_for(hd, ctx),
        limit,
        hint,
    )? as usize;
    m.kv_cache = crate::limits::check_bytes(
        "a KV cache for a context length of",
        ctx,
        KvPool::checked_bytes_for(cfg.layers, plan.kv_heads().len(), hd, ctx, kv_dtype),
        limit,
        hint,
    )? as usize;
    Ok(m)
}
