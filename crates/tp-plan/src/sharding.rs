//! How one parallel layout cuts the model: contiguous balanced (possibly uneven)
//! head ranges per tensor-parallel rank with KV-head replication, and balanced
//! contiguous layer ranges per pipeline stage (Narayanan et al. 2021 §2).

use crate::model::ModelSpec;
use serde::Serialize;

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
}

/// Contiguous balanced split of `items` over `parts`: the first `items % parts`
/// parts get one extra. Returns the (start, len) of part `index`.
pub fn balanced_range(items: u64, parts: u64, index: u64) -> (u64, u64) {
    let base = items / parts;
    let extra = items % parts;
    let len = base + u64::from(index < extra);
    let start = index * base + index.min(extra);
    (start, len)
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
    pub fn new(model: &ModelSpec, tp: u64) -> Self {
        let heads = model.num_query_heads;
        let group = model.query_group_size();
        let mut max_kv = 0;
        let mut total_kv = 0;
        for rank in 0..tp {
            let (start, len) = balanced_range(heads, tp, rank);
            let kv = if len == 0 {
                0
            } else {
                (start + len - 1) / group - start / group + 1
            };
            max_kv = max_kv.max(kv);
            total_kv += kv;
        }
        let max_q = heads.div_ceil(tp);
        TensorShard {
            tp,
            max_query_heads: max_q,
            max_kv_heads: max_kv,
            total_kv_heads_held: total_kv,
            max_ffn_columns: model.ffn_hidden_size.div_ceil(tp),
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
    (0..pp)
        .map(|s| balanced_range(num_layers, pp, s).1)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_presets::model_preset;

    #[test]
    fn balanced_ranges_cover_everything() {
        // 9 heads over 2 ranks: [0,5) and [5,9).
        assert_eq!(balanced_range(9, 2, 0), (0, 5));
        assert_eq!(balanced_range(9, 2, 1), (5, 4));
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
