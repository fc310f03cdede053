//! How one parallel layout cuts the model, with tp-spec's shard arithmetic (the runtime's):
//! contiguous balanced (possibly uneven) head ranges per tensor-parallel rank with KV-head
//! replication, FFN columns in quant-block units, and balanced contiguous layer ranges per
//! pipeline stage (Narayanan et al. 2021 §2).

use crate::model::ModelSpec;
use serde::Serialize;
use tp_spec::{HeadPlan, Partition};

use crate::workload::Recompute;

/// One candidate layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ParallelConfig {
    pub tp: u64,
    pub pp: u64,
    pub dp: u64,
    /// Expert parallelism, carved out of the data-parallel ranks (1 for dense).
    pub ep: u64,
    pub micro_batch: u64,
    pub sequence_parallel: bool,
    pub recompute: Recompute,
    /// Model chunks per pipeline stage (Narayanan et al. 2021 §2.2.2, Megatron's
    /// `--num-layers-per-virtual-pipeline-stage`): 1 is plain 1F1B; `v` chunks shrink the
    /// bubble by `v` for `v` times the stage-boundary sends.
    pub virtual_stages: u64,
}

/// What the slowest tensor-parallel rank holds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TensorShard {
    pub tp: u64,
    /// ceil(heads / tp): query heads on the most loaded rank.
    pub max_query_heads: u64,
    /// KV heads the most KV-loaded rank must hold (its query range may touch
    /// several KV groups; with tp > kv heads a KV head is replicated).
    pub max_kv_heads: u64,
    /// Sum over ranks of held KV heads (≥ kv heads; > when replicated).
    pub total_kv_heads_held: u64,
    /// ceil(ffn / tp) columns of the MLP on the most loaded rank.
    pub max_ffn_columns: u64,
    /// max_query_heads · tp / heads: 1.0 when tp divides heads.
    pub head_imbalance: f64,
}

impl TensorShard {
    /// Through tp-spec's shard arithmetic (the runtime's): query heads by [`HeadPlan`] with
    /// KV heads following them, FFN columns in units of `model.ffn_unit` when it divides the
    /// FFN into at least `tp` units. `tp` must be at most the query heads (the search's range).
    pub fn new(model: &ModelSpec, tp: u64) -> Self {
        let heads = model.num_query_heads as usize;
        let kv_heads = model.num_kv_heads as usize;
        let ranks = tp.max(1) as usize;
        let (mut max_q, mut max_kv, mut total_kv) = (0u64, 0u64, 0u64);
        for r in 0..ranks {
            if let Ok(p) = HeadPlan::new(heads, kv_heads, r, ranks) {
                let kv = p.kv_range().len() as u64;
                max_q = max_q.max(p.q_range().len() as u64);
                max_kv = max_kv.max(kv);
                total_kv += kv;
            }
        }
        let ffn = model.ffn_hidden_size as usize;
        let unit = model.ffn_unit.max(1) as usize;
        let unit = if ffn.is_multiple_of(unit) && ffn / unit >= ranks {
            unit
        } else {
            1
        };
        let max_ffn = Partition::new(ffn / unit, ranks, "FFN columns", "FFN column")
            .map_or(ffn.div_ceil(ranks), |p| p.len(0) * unit);
        TensorShard {
            tp,
            max_query_heads: max_q,
            max_kv_heads: max_kv,
            total_kv_heads_held: total_kv,
            max_ffn_columns: max_ffn as u64,
            head_imbalance: (max_q * tp) as f64 / heads as f64,
        }
    }

    /// Fraction of a head-sharded tensor held by the most loaded rank.
    pub fn query_fraction(&self, model: &ModelSpec) -> f64 {
        self.max_query_heads as f64 / model.num_query_heads as f64
    }
}

/// Layers of each pipeline stage (balanced, contiguous, first stages larger).
pub fn stage_layer_counts(num_layers: u64, pp: u64) -> Vec<u64> {
    match Partition::new(num_layers as usize, pp as usize, "layers", "layer") {
        Ok(p) => p.sizes().into_iter().map(|n| n as u64).collect(),
        // More stages than layers: the later stages get none.
        Err(_) => (0..pp)
            .map(|s| num_layers / pp.max(1) + u64::from(s < num_layers % pp.max(1)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_presets::model_preset;

    #[test]
    fn balanced_ranges_cover_everything() {
        assert_eq!(stage_layer_counts(105, 35), vec![3; 35]);
        assert_eq!(stage_layer_counts(30, 4), vec![8, 8, 7, 7]);
    }

    #[test]
    fn smollm2_uneven_shards() {
        // 9 query heads, 3 kv heads (groups of 3).
        let m = model_preset("smollm2-135m").unwrap();
        // tp=2: rank0 heads 0..5 touches groups 0,1 (2 kv); rank1 heads 5..9 touches 1,2 (2 kv).
        let s = TensorShard::new(&m, 2);
        assert_eq!(
            (s.max_query_heads, s.max_kv_heads, s.total_kv_heads_held),
            (5, 2, 4)
        );
        // imbalance 5·2/9 = 1.111
        assert!((s.head_imbalance - 10.0 / 9.0).abs() < 1e-12);
        // tp=3 divides evenly: one group each, no replication.
        let s = TensorShard::new(&m, 3);
        assert_eq!(
            (s.max_query_heads, s.max_kv_heads, s.total_kv_heads_held),
            (3, 1, 3)
        );
        // tp=9 > 3 kv heads: every rank holds one kv head, 9 held in total (3x replication).
        let s = TensorShard::new(&m, 9);
        assert_eq!((s.max_kv_heads, s.total_kv_heads_held), (1, 9));
    }
}
