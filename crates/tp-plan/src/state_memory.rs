//! Parameters held per rank and per pipeline stage, and the memory they cost as
//! weights, gradients and optimizer state (ZeRO §3.1: 2 + 2 + 12 bytes per param
//! for mixed-precision Adam; optimizer state / dp with a distributed optimizer),
//! plus the serving KV cache 2·layers·kv_heads·head_dim·context·bytes per sequence.

use crate::model::ModelSpec;
use crate::sharding::{stage_layer_counts, TensorShard};
use serde::Serialize;

/// Parameters of the most loaded rank of one stage; expert parameters are kept
/// apart because their data-parallel group is dp/ep.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct RankParams {
    pub dense: f64,
    pub expert: f64,
}

impl RankParams {
    pub fn total(&self) -> f64 {
        self.dense + self.expert
    }
}

/// One layer on the most loaded tensor rank: its heads' Q/O columns, the KV
/// heads it holds (replicated when tp > kv heads), ceil(ffn/tp) MLP columns of
/// its E/ep experts, replicated norms and router.
pub fn rank_layer_params(model: &ModelSpec, shard: &TensorShard, ep: u64) -> RankParams {
    let h = model.hidden_size as f64;
    let d = model.head_dim as f64;
    let attention = 2.0 * h * d * (shard.max_query_heads + shard.max_kv_heads) as f64;
    let norms = model.norm_params_per_layer() as f64;
    let mlp_per_expert = (model.mlp_matrices() * model.hidden_size * shard.max_ffn_columns) as f64;
    if model.is_moe() {
        let local_experts = model.num_experts.div_ceil(ep) as f64;
        RankParams {
            dense: attention + norms + h * model.num_experts as f64,
            expert: local_experts * mlp_per_expert,
        }
    } else {
        RankParams {
            dense: attention + norms + mlp_per_expert,
            expert: 0.0,
        }
    }
}

/// Parameters of each stage's most loaded rank: its layers, the vocab-parallel
/// embedding on the first stage, the LM head (a tied copy when pp > 1) and the
/// final norm on the last stage.
pub fn stage_rank_params(
    model: &ModelSpec,
    shard: &TensorShard,
    ep: u64,
    pp: u64,
) -> Vec<RankParams> {
    let per_layer = rank_layer_params(model, shard, ep);
    let vocab_shard = (model.vocab_size.div_ceil(shard.tp) * model.hidden_size) as f64;
    let counts = stage_layer_counts(model.num_layers, pp);
    let last = counts.len().saturating_sub(1);
    counts
        .iter()
        .enumerate()
        .map(|(stage, &layers)| {
            let mut p = RankParams {
                dense: per_layer.dense * layers as f64,
                expert: per_layer.expert * layers as f64,
            };
            if stage == 0 {
                p.dense += vocab_shard;
            }
            if stage == last {
                p.dense += model.hidden_size as f64;
                let head_separate = !model.tied_embeddings || pp > 1;
                if head_separate {
                    p.dense += vocab_shard;
                }
            }
            p
        })
        .collect()
}

/// Per-device memory, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct MemoryBreakdown {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer_state: f64,
    pub activations: f64,
    pub kv_cache: f64,
}

impl MemoryBreakdown {
    pub fn total(&self) -> f64 {
        self.weights + self.gradients + self.optimizer_state + self.activations + self.kv_cache
    }
}

/// KV-cache bytes on the most loaded rank: 2 (K and V) · layers · held kv heads ·
/// head_dim · context · sequences · bytes.
pub fn kv_cache_bytes(
    model: &ModelSpec,
    shard: &TensorShard,
    layers: u64,
    context: u64,
    sequences: u64,
    element_bytes: f64,
) -> f64 {
    2.0 * (layers * shard.max_kv_heads * model.head_dim * context * sequences) as f64
        * element_bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_presets::model_preset;

    #[test]
    fn llama2_70b_kv_cache_hand_computed() {
        // 80 layers, 8 kv heads of 128, tp=8 → 1 kv head per rank.
        // One 4096-token bf16 sequence: 2·80·1·128·4096·2 = 167_772_160 B per rank.
        let m = model_preset("llama-2-70b").unwrap();
        let s = TensorShard::new(&m, 8);
        assert_eq!(kv_cache_bytes(&m, &s, 80, 4096, 1, 2.0), 167_772_160.0);
        // tp=16 > 8 kv heads: still one (replicated) kv head per rank, no saving.
        let s16 = TensorShard::new(&m, 16);
        assert_eq!(kv_cache_bytes(&m, &s16, 80, 4096, 1, 2.0), 167_772_160.0);
    }

    #[test]
    fn stages_sum_to_model_when_unsharded() {
        // tp=1: all stages together hold every parameter once (untied Llama).
        let m = model_preset("llama-2-7b").unwrap();
        let s = TensorShard::new(&m, 1);
        let total: f64 = stage_rank_params(&m, &s, 1, 4)
            .iter()
            .map(RankParams::total)
            .sum();
        assert_eq!(total, m.total_params() as f64);
    }

    #[test]
    fn gpt_rank_layer_is_twelve_h_squared_over_t() {
        // h=12288, t=8: (12·12288²)/8 + 2·12288 = 226_492_416 + 24_576.
        let m = model_preset("gpt3-175b").unwrap();
        let p = rank_layer_params(&m, &TensorShard::new(&m, 8), 1);
        assert_eq!(p.dense, 226_492_416.0 + 24_576.0);
    }
}
