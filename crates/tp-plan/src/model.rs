//! Transformer shape description and parameter counting (dense GPT/Llama-style
//! blocks and top-k mixture-of-experts MLPs), following the parameter count of
//! Narayanan et al. 2021 §3 (12·l·h² for a GPT block) generalised to GQA and SwiGLU.

use crate::PlanError;
use serde::Serialize;
use std::collections::HashMap;
use tp_spec::{rank_weight_bytes, Dims, Layout, ShardPlan, WeightName};

/// Largest accepted value of any single model dimension.
pub const MAX_DIMENSION: u64 = 1 << 24;
/// Largest accepted parameter count.
pub const MAX_PARAMS: u128 = 1_000_000_000_000_000;

/// The shape of a decoder-only transformer. Biases and learned position
/// embeddings are ignored (they are < 0.1% of the parameters of every preset).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSpec {
    pub name: String,
    pub num_layers: u64,
    pub hidden_size: u64,
    /// Hidden size of one MLP (of one expert for MoE).
    pub ffn_hidden_size: u64,
    pub num_query_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub vocab_size: u64,
    pub tied_embeddings: bool,
    /// SwiGLU-style MLP with three matrices (gate, up, down) instead of two.
    pub gated_mlp: bool,
    /// 1 for a dense model.
    pub num_experts: u64,
    pub experts_per_token: u64,
    /// FFN columns are split in units of this many, as the runtime does (the quant block of a
    /// file's down projection, at least 32); 1 for presets.
    pub ffn_unit: u64,
    /// A model file's weights as stored: per-rank bytes come from tp-spec's shard arithmetic
    /// (the runtime's), not from parameters times a precision.
    #[serde(skip)]
    pub stored: Option<StoredWeights>,
}

/// The layout of every weight of a model file of a supported architecture.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredWeights {
    pub config: tp_spec::ModelConfig,
    pub layouts: HashMap<WeightName, Layout>,
}

impl StoredWeights {
    /// Weight bytes (sharded + replicated) rank `rank` of `tp` holds once loaded, with
    /// unquantized weights at `dense_bytes` per element: exactly what the runtime's memory
    /// report (`tp inspect`) gives. `None` when the model cannot be split `tp` ways.
    pub fn rank_bytes(&self, tp: usize, rank: usize, dense_bytes: usize) -> Option<u64> {
        let stage = tp_spec::Stage::whole(self.config.layers);
        Some(self.stage_rank_bytes(&stage, tp, rank, dense_bytes)?.held)
    }

    /// The weight bytes tensor rank `rank` of pipeline stage `stage` holds
    /// ([`StoredWeights::rank_bytes`]'s count), and those of them a decode step reads: all
    /// but an embedding only looked up (rows per token), not also used as the (tied) head here.
    pub fn stage_rank_bytes(
        &self,
        stage: &tp_spec::Stage,
        tp: usize,
        rank: usize,
        dense_bytes: usize,
    ) -> Option<RankBytes> {
        let unit = self
            .layouts
            .get(&WeightName::Down(0))
            .copied()
            .unwrap_or(Layout::Float)
            .ffn_unit();
        let plan = ShardPlan::new(&self.config, unit, rank, tp)
            .ok()?
            .with_stage(stage.clone());
        let bytes = |w: tp_spec::WeightBytes| u64::try_from(w.sharded + w.replicated).ok();
        let held = bytes(
            rank_weight_bytes(&self.config, &plan, &mut self.layout::<()>(), dense_bytes).ok()?,
        )?;
        let looked_up = stage.is_first() && !(self.config.tied_embeddings && stage.is_last());
        let read = if looked_up {
            let embed = tp_spec::embed_params(&self.config);
            let w =
                tp_spec::params_weight_bytes(&plan, &embed, &mut self.layout::<()>(), dense_bytes)
                    .ok()?;
            held.checked_sub(bytes(w)?)?
        } else {
            held
        };
        Some(RankBytes { held, read })
    }

    /// The runtime's pipeline stages over `pp` (its default split, tp-spec's
    /// [`tp_spec::StageSplit`]: balanced by the cost model): `None` when the layers cannot
    /// take `pp`.
    pub fn stages(&self, pp: usize) -> Option<Vec<tp_spec::Stage>> {
        tp_spec::pipeline_stages(&self.config, pp, tp_spec::StageSplit::default()).ok()
    }

    /// Each weight's layout in the file (float where the file has none recorded).
    fn layout<E>(&self) -> impl FnMut(WeightName) -> Result<Layout, E> + '_ {
        |name| Ok(self.layouts.get(&name).copied().unwrap_or(Layout::Float))
    }
}

/// One rank's weight bytes: held, and read by a decode step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankBytes {
    pub held: u64,
    pub read: u64,
}

impl ModelSpec {
    /// A GPT-style model: MHA, 4h GeLU MLP, tied embeddings.
    pub fn gpt(name: &str, num_layers: u64, hidden: u64, heads: u64, vocab: u64) -> Self {
        ModelSpec {
            name: name.to_string(),
            num_layers,
            hidden_size: hidden,
            ffn_hidden_size: 4 * hidden,
            num_query_heads: heads,
            num_kv_heads: heads,
            head_dim: hidden / heads,
            vocab_size: vocab,
            tied_embeddings: true,
            gated_mlp: false,
            num_experts: 1,
            experts_per_token: 1,
            ffn_unit: 1,
            stored: None,
        }
    }

    /// The planner's view of a model read by tp-spec (from a GGUF header or a config.json).
    pub fn from_dims(name: &str, d: &Dims, ffn_unit: u64) -> Self {
        let (experts, per_token) = d.experts.map_or((1, 1), |e| (e.count, e.per_token));
        ModelSpec {
            name: name.to_string(),
            num_layers: d.layers as u64,
            hidden_size: d.hidden as u64,
            ffn_hidden_size: d.ffn as u64,
            num_query_heads: d.heads as u64,
            num_kv_heads: d.kv_heads as u64,
            head_dim: d.head_dim as u64,
            vocab_size: d.vocab as u64,
            tied_embeddings: d.tied_embeddings,
            gated_mlp: d.gated_mlp,
            num_experts: experts as u64,
            experts_per_token: per_token as u64,
            ffn_unit,
            stored: None,
        }
    }

    /// Rejects shapes the cost model cannot describe (zero sizes, kv heads
    /// that do not group the query heads, top-k larger than the expert count).
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |message: &str| PlanError::InvalidModel {
            name: self.name.clone(),
            message: message.to_string(),
        };
        let sizes = [
            self.num_layers,
            self.hidden_size,
            self.ffn_hidden_size,
            self.num_query_heads,
            self.num_kv_heads,
            self.head_dim,
            self.vocab_size,
            self.num_experts,
            self.experts_per_token,
        ];
        if sizes.contains(&0) {
            return Err(bad("every size must be positive"));
        }
        if sizes.iter().any(|&v| v > MAX_DIMENSION) {
            return Err(bad("a size exceeds 2^24"));
        }
        if !self.num_query_heads.is_multiple_of(self.num_kv_heads) {
            return Err(bad("query heads must be a multiple of kv heads"));
        }
        if self.experts_per_token > self.num_experts {
            return Err(bad("experts per token exceeds the number of experts"));
        }
        // Checked in u128 so the u64 arithmetic elsewhere cannot overflow.
        let (h, l, e) = (
            u128::from(self.hidden_size),
            u128::from(self.num_layers),
            u128::from(self.num_experts),
        );
        let per_layer = 2 * h * u128::from(self.query_dim() + self.kv_dim())
            + e * u128::from(self.mlp_matrices()) * h * u128::from(self.ffn_hidden_size)
            + h * (e + 2);
        let total = l * per_layer + 2 * u128::from(self.vocab_size) * h + h;
        if total > MAX_PARAMS {
            return Err(bad("more than 10^15 parameters"));
        }
        Ok(())
    }

    pub fn is_moe(&self) -> bool {
        self.num_experts > 1
    }
    pub fn query_dim(&self) -> u64 {
        self.num_query_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> u64 {
        self.num_kv_heads * self.head_dim
    }
    /// Query heads sharing one KV head.
    pub fn query_group_size(&self) -> u64 {
        self.num_query_heads / self.num_kv_heads
    }
    /// Matrices of one MLP (expert): 2 for GeLU, 3 for SwiGLU.
    pub fn mlp_matrices(&self) -> u64 {
        if self.gated_mlp {
            3
        } else {
            2
        }
    }
    /// Q, K, V and output projections: h·q + 2·h·kv + q·h.
    pub fn attention_params_per_layer(&self) -> u64 {
        let h = self.hidden_size;
        2 * h * self.query_dim() + 2 * h * self.kv_dim()
    }
    pub fn params_per_expert(&self) -> u64 {
        self.mlp_matrices() * self.hidden_size * self.ffn_hidden_size
    }
    /// All experts plus the router (h·E) for MoE.
    pub fn mlp_params_per_layer(&self) -> u64 {
        let router = if self.is_moe() {
            self.hidden_size * self.num_experts
        } else {
            0
        };
        self.num_experts * self.params_per_expert() + router
    }
    /// Two norms of h each.
    pub fn norm_params_per_layer(&self) -> u64 {
        2 * self.hidden_size
    }
    pub fn params_per_layer(&self) -> u64 {
        self.attention_params_per_layer()
            + self.mlp_params_per_layer()
            + self.norm_params_per_layer()
    }
    pub fn embedding_params(&self) -> u64 {
        self.vocab_size * self.hidden_size
    }
    /// Total parameters: layers, input embedding, LM head unless tied, final norm.
    pub fn total_params(&self) -> u64 {
        let head = if self.tied_embeddings {
            0
        } else {
            self.embedding_params()
        };
        self.num_layers * self.params_per_layer()
            + self.embedding_params()
            + head
            + self.hidden_size
    }
    /// Matrix parameters a token touches in one layer (top-k experts only).
    pub fn active_matmul_params_per_layer(&self) -> u64 {
        self.attention_params_per_layer() + self.experts_per_token * self.params_per_expert()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt_layer_has_twelve_h_squared_params_plus_norms() {
        // h = 1024: attention 4h² = 4_194_304, MLP 8h² = 8_388_608, norms 2h = 2048.
        let m = ModelSpec::gpt("t", 2, 1024, 16, 1000);
        assert_eq!(m.params_per_layer(), 12 * 1024 * 1024 + 2048);
        // total = 2 layers + V·h (tied) + h = 25_169_920 + 1_024_000 + 1024.
        assert_eq!(
            m.total_params(),
            2 * (12 * 1024 * 1024 + 2048) + 1_024_000 + 1024
        );
    }

    #[test]
    fn llama2_7b_has_6_7b_params() {
        // Published count 6.74e9; tolerance 0.5%.
        let m = crate::model_presets::model_preset("llama-2-7b").unwrap();
        let p = m.total_params() as f64;
        assert!((p / 6.738e9 - 1.0).abs() < 0.005, "{p}");
    }

    #[test]
    fn validate_rejects_absurd_sizes() {
        let mut m = ModelSpec::gpt("t", 2, 1024, 16, 1000);
        m.num_layers = 1 << 30;
        assert!(m.validate().is_err());
        let mut m = ModelSpec::gpt("t", 1 << 20, 1 << 20, 16, 1000);
        m.ffn_hidden_size = 1 << 24;
        assert!(m.validate().unwrap_err().to_string().contains("10^15"));
    }

    #[test]
    fn validate_rejects_bad_grouping() {
        let mut m = ModelSpec::gpt("t", 2, 1024, 16, 1000);
        m.num_kv_heads = 3;
        assert!(m.validate().is_err());
    }
}
