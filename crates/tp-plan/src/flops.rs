//! FLOP counts: Narayanan et al. 2021 §5.1 eq. (3),
//! F = 96·B·s·l·h²·(1 + s/6h + V/16lh) with full recomputation, and the
//! per-layer forward count 24·b·s·h² + 4·b·s²·h generalised to GQA/SwiGLU/MoE.

use crate::model::ModelSpec;

/// The paper's FLOPs per iteration (GPT shape, includes the recompute forward pass).
pub fn narayanan_flops_per_iteration(
    batch: u64,
    seq: u64,
    layers: u64,
    hidden: u64,
    vocab: u64,
) -> f64 {
    let (b, s, l, h, v) = (
        batch as f64,
        seq as f64,
        layers as f64,
        hidden as f64,
        vocab as f64,
    );
    96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
}

/// Forward FLOPs of one layer for `tokens = b·s` tokens of sequence length `seq`:
/// 2·tokens·(active matmul params) + 4·tokens·seq·q_dim (QKᵀ and A·V, unmasked as in the paper).
pub fn layer_forward_flops(model: &ModelSpec, micro_batch: u64, seq: u64) -> f64 {
    let tokens = (micro_batch * seq) as f64;
    2.0 * tokens * model.active_matmul_params_per_layer() as f64
        + attention_score_forward_flops(model, micro_batch, seq)
}

/// QKᵀ and A·V: 2 matmuls of 2·b·s²·q_dim each.
pub fn attention_score_forward_flops(model: &ModelSpec, micro_batch: u64, seq: u64) -> f64 {
    4.0 * (micro_batch * seq) as f64 * seq as f64 * model.query_dim() as f64
}

/// LM-head forward FLOPs: 2·b·s·h·V.
pub fn logits_forward_flops(model: &ModelSpec, micro_batch: u64, seq: u64) -> f64 {
    2.0 * (micro_batch * seq) as f64 * (model.hidden_size * model.vocab_size) as f64
}

/// Model FLOPs of one training iteration: forward + backward (2×) of every
/// layer and the LM head; with `count_recompute` the extra layer forward pass
/// of full recomputation is included (the logits are never recomputed).
pub fn training_flops_per_iteration(
    model: &ModelSpec,
    batch: u64,
    seq: u64,
    count_recompute: bool,
) -> f64 {
    let layer_passes = if count_recompute { 4.0 } else { 3.0 };
    layer_passes * model.num_layers as f64 * layer_forward_flops(model, batch, seq)
        + 3.0 * logits_forward_flops(model, batch, seq)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_presets::model_preset;

    #[test]
    fn narayanan_formula_hand_computed() {
        // B=1, s=2048, l=1, h=2048, V=0: 96·2048·2048²·(1 + 2048/12288)
        // = 96·8_589_934_592·(7/6) = 962_072_674_304.
        let f = narayanan_flops_per_iteration(1, 2048, 1, 2048, 0);
        assert!((f - 962_072_674_304.0).abs() < 1.0);
    }

    #[test]
    fn general_count_equals_paper_formula_for_gpt_shapes() {
        // Exact algebraic identity for a GPT block (norm params carry no FLOPs).
        for name in ["megatron-1.7b", "megatron-145b", "megatron-1t"] {
            let m = model_preset(name).unwrap();
            let ours = training_flops_per_iteration(&m, 512, 2048, true);
            let paper =
                narayanan_flops_per_iteration(512, 2048, m.num_layers, m.hidden_size, m.vocab_size);
            assert!((ours / paper - 1.0).abs() < 1e-12, "{name}");
        }
    }

    #[test]
    fn six_n_d_rule_for_short_sequences() {
        // Without recompute and with s ≪ 6h, F ≈ 6·params·tokens (within 3% for Llama-2-7B, s=256).
        let m = model_preset("llama-2-7b").unwrap();
        let f = training_flops_per_iteration(&m, 1, 256, false);
        let six_nd = 6.0 * m.total_params() as f64 * 256.0;
        assert!((f / six_nd - 1.0).abs() < 0.03, "{}", f / six_nd);
    }
}
