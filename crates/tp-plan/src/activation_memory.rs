//! Activation memory per transformer layer, Korthikanti et al. 2022 ("Reducing
//! Activation Recomputation in Large Transformer Models") §4: sbh(34 + 5as/h)
//! bytes without parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor parallelism,
//! sbh(34/t + 5as/(ht)) with sequence parallelism, 34sbh/t with selective
//! recompute, 2sbh for full recompute — generalised to GQA, SwiGLU, MoE and
//! uneven head shards (the most loaded rank governs).

use crate::model::ModelSpec;
use crate::sharding::TensorShard;
use crate::workload::Recompute;
use serde::Serialize;

/// Activation bytes one layer keeps for backward on the most loaded rank,
/// split the way the paper splits them (for 2-byte activations; scaled otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LayerActivationBytes {
    /// Layer-norm inputs, attention and MLP inputs, dropout masks: 10·sbh,
    /// replicated across tensor ranks unless sequence parallelism splits them.
    pub unsharded: f64,
    /// Q, K, V, projection inputs and MLP intermediates: 24·sbh/t for GPT.
    pub head_sharded: f64,
    /// Softmax output, its dropout mask and the dropout output: 5·a·s²·b/t.
    pub attention_scores: f64,
    /// The layer's input, all full recomputation keeps: 2·sbh (/t with SP).
    pub layer_input: f64,
}

/// Shape inputs of the activation formulas.
#[derive(Debug, Clone, Copy)]
pub struct ActivationShape {
    pub micro_batch: u64,
    pub seq: u64,
    pub sequence_parallel: bool,
    /// Fused attention: the s×s scores are never stored.
    pub flash_attention: bool,
    /// Bytes per activation element (2 for bf16/fp16).
    pub element_bytes: f64,
}

pub fn layer_activation_bytes(
    model: &ModelSpec,
    shard: &TensorShard,
    shape: &ActivationShape,
) -> LayerActivationBytes {
    let sb = (shape.micro_batch * shape.seq) as f64;
    let h = model.hidden_size as f64;
    let t = shard.tp as f64;
    let scale = shape.element_bytes / 2.0;
    let sp_divisor = if shape.sequence_parallel { t } else { 1.0 };
    let q_rank = (shard.max_query_heads * model.head_dim) as f64;
    let kv_rank = (shard.max_kv_heads * model.head_dim) as f64;
    let f_rank = shard.max_ffn_columns as f64;
    // Attention: Q (2sbq) + K, V (2sb·kv each) + projection input (2sbq).
    let attention = 4.0 * sb * q_rank + 4.0 * sb * kv_rank;
    // MLP: GeLU input + fc2 input = 4sbf; SwiGLU: gate, up and down input = 6sbf.
    let mlp_per_expert = if model.gated_mlp { 6.0 } else { 4.0 } * sb * f_rank;
    let mlp = mlp_per_expert * model.experts_per_token as f64;
    let scores = if shape.flash_attention {
        0.0
    } else {
        5.0 * shard.max_query_heads as f64 * shape.seq as f64 * sb
    };
    LayerActivationBytes {
        unsharded: 10.0 * sb * h * scale / sp_divisor,
        head_sharded: (attention + mlp) * scale,
        attention_scores: scores * scale,
        layer_input: 2.0 * sb * h * scale / sp_divisor,
    }
}

impl LayerActivationBytes {
    /// Everything the forward pass produces (stored without recompute).
    pub fn all(&self) -> f64 {
        self.unsharded + self.head_sharded + self.attention_scores
    }

    /// What stays resident per layer per in-flight micro-batch.
    pub fn stored(&self, recompute: Recompute) -> f64 {
        match recompute {
            Recompute::None => self.all(),
            Recompute::Selective => self.unsharded + self.head_sharded,
            Recompute::Full => self.layer_input,
        }
    }
}

/// The paper's closed form for a GPT layer with t-way tensor parallelism
/// (Korthikanti et al. 2022 Table 2), bytes.
pub fn korthikanti_bytes_per_layer(
    s: f64,
    b: f64,
    h: f64,
    a: f64,
    t: f64,
    sequence_parallel: bool,
    recompute: Recompute,
) -> f64 {
    let sbh = s * b * h;
    match (sequence_parallel, recompute) {
        (_, Recompute::Full) if sequence_parallel => 2.0 * sbh / t,
        (_, Recompute::Full) => 2.0 * sbh,
        (false, Recompute::None) => sbh * (10.0 + 24.0 / t + 5.0 * a * s / (h * t)),
        (false, Recompute::Selective) => sbh * (10.0 + 24.0 / t),
        (true, Recompute::None) => sbh * (34.0 / t + 5.0 * a * s / (h * t)),
        (true, Recompute::Selective) => sbh * 34.0 / t,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_presets::model_preset;

    fn shape(sp: bool) -> ActivationShape {
        ActivationShape {
            micro_batch: 1,
            seq: 2048,
            sequence_parallel: sp,
            flash_attention: false,
            element_bytes: 2.0,
        }
    }

    #[test]
    fn gpt3_single_gpu_hand_computed() {
        // GPT-3: s=2048, b=1, h=12288, a=96, t=1.
        // sbh = 25_165_824; 5as/h = 5·96·2048/12288 = 80; total = 25_165_824·114 = 2_868_903_936 B.
        let v =
            korthikanti_bytes_per_layer(2048.0, 1.0, 12288.0, 96.0, 1.0, false, Recompute::None);
        assert_eq!(v, 2_868_903_936.0);
        // t=8 with SP and selective recompute: 34·sbh/8 = 106_954_752 B.
        let v = korthikanti_bytes_per_layer(
            2048.0,
            1.0,
            12288.0,
            96.0,
            8.0,
            true,
            Recompute::Selective,
        );
        assert_eq!(v, 106_954_752.0);
    }

    #[test]
    fn general_form_equals_paper_for_gpt_and_every_policy() {
        let m = model_preset("gpt3-175b").unwrap();
        for t in [1u64, 2, 4, 8] {
            let shard = TensorShard::new(&m, t);
            for sp in [false, true] {
                if sp && t == 1 {
                    continue;
                }
                let ours = layer_activation_bytes(&m, &shard, &shape(sp));
                for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
                    let paper =
                        korthikanti_bytes_per_layer(2048.0, 1.0, 12288.0, 96.0, t as f64, sp, rc);
                    assert!(
                        (ours.stored(rc) / paper - 1.0).abs() < 1e-12,
                        "t={t} sp={sp} {rc:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn uneven_shard_is_governed_by_the_largest_rank() {
        // SmolLM2 tp=2: rank 0 has 5 of 9 heads, so its score memory is 5·s²·b·5 (not 4.5).
        let m = model_preset("smollm2-135m").unwrap();
        let shard = TensorShard::new(&m, 2);
        let a = layer_activation_bytes(&m, &shard, &shape(false));
        assert_eq!(a.attention_scores, 5.0 * 5.0 * 2048.0 * 2048.0);
    }
}
