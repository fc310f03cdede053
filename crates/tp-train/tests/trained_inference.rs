//! A Qwen2, Qwen3, Gemma-3 or Mixtral trained here is a model that inference runs (issues 14,
//! 33, 34; Qwen2's safetensors hold every layer's `self_attn.{q,k,v}_proj.bias`): saved at
//! tp 2 x pp 2, its directory (config.json of `qwen3` / `Qwen3ForCausalLM` or `gemma3_text` /
//! `Gemma3ForCausalLM`, safetensors holding every layer's `self_attn.q_norm.weight` and
//! `k_norm.weight`, and Gemma's post norms) opens in tp-models' HF reader — the loader behind
//! `tp generate --model DIR` — and the inference logits of every position, at tp 1 and tp 2,
//! equal the training model's forward (tp-nn layers) on the same weights.
//!
//! Two independent code paths: candle ops with autograd (training) against tp-models' own f32
//! kernels with f64 row-parallel sums (inference; its Gemma-3 forward is checked against
//! candle-transformers' gemma3 in tp-models' tests); measured max difference ~1e-6 of the
//! largest logit, checked at 1e-4. Ignoring the q/k norms (Qwen3), or reading the Gemma-3 as
//! a Qwen3 of the same weights, moves the logits by more than 1e-2 of the largest one
//! (checked below), so the comparison can fail.

mod common;
use common::logits::{inference_logits, rel_diff, training_logits, training_logits_biased};
use common::*;
use safetensors::SafeTensors;
use tp_models::open_checkpoint;
use tp_train::fixtures::{gemma3_spec, moe_spec, qwen2_spec, qwen3_spec};
use tp_train::TrainSpec;
use tp_train::{Checkpoint, ModelConfig};

const TOL: f32 = 1e-4;

/// Issue 32: a training rank's shard is the inference rank's. For every tp the model splits
/// to (up to 4), the plan inference makes for the saved directory is training's plan, and
/// every parameter a training rank holds sits where that plan places it.
fn same_shards_as_inference(step: &std::path::Path, cfg: &ModelConfig) {
    use tp_models::CheckpointPlan;
    let ckpt = open_checkpoint(step).expect("the checkpoint opens for inference");
    let table = tp_spec::model_params(cfg);
    for tp in 1..=cfg.heads.min(4) {
        for r in 0..tp {
            let inference = tp_models::ShardPlan::for_checkpoint(&*ckpt, r, tp).unwrap();
            let training = tp_train::layout::shard_plan(cfg, r, tp).unwrap();
            assert_eq!(inference, training, "tp {tp} rank {r}");
            let specs = tp_train::layout::stage_params(cfg, 0, 1, r, tp).unwrap();
            assert_eq!(specs.len(), table.len());
            for (spec, p) in specs.iter().zip(&table) {
                assert_eq!(spec.weight, p.name);
                assert_eq!(
                    spec.placement,
                    inference.place(p),
                    "tp {tp} rank {r} {}",
                    spec.name
                );
            }
        }
    }
}

/// Trains `s` at tp 2 x pp 2 for 6 steps, saves it, checks config.json names `model_type` /
/// `class` and that each layer's `extra` vectors (`self_attn.q_norm.weight`: the name after
/// `model.layers.L.`, with the length) were stored and trained (moved off `init`),
/// then compares inference logits at tp 1 and 2 with the training forward. Returns the
/// checkpoint directory, its config and the training logits of [`TOKENS`].
fn train_save_and_compare(
    tag: &str,
    mut s: TrainSpec,
    model_type: &str,
    class: &str,
    extra: &[(&str, usize)],
    init: f32,
) -> (std::path::PathBuf, Checkpoint, Vec<f32>) {
    let dir = scratch(tag);
    s.dims = dims(2, 2, 1);
    s.steps = 6;
    s.micro_batches = 4;
    s.save_dir = Some(dir.clone());
    let reports = train(&s, None);
    assert_eq!(reports.len(), 6);
    let step = dir.join("step-00000006");

    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(step.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], model_type);
    assert_eq!(cfg["architectures"][0], class);
    let bytes = std::fs::read(step.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for l in 0..s.model.layers {
        for (which, len) in extra {
            let name = format!("model.layers.{l}.{which}");
            let t = st
                .tensor(&name)
                .unwrap_or_else(|_| panic!("{name} missing"));
            assert_eq!(t.shape(), [*len], "{name}");
            // Initialized to `init` and trained: six AdamW steps moved them.
            let moved = t
                .data()
                .chunks_exact(4)
                .any(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != init);
            assert!(moved, "{name} never trained");
        }
    }

    let ck = Checkpoint::open(&step).unwrap();
    assert_eq!(ck.config, s.model);
    same_shards_as_inference(&step, &ck.config);
    // With the aux-loss-free router bias, training chose experts with the saved bias.
    let want = training_logits_biased(&ck.config, &ck, &ck.state.moe_bias, &TOKENS);
    for tp in [1, 2] {
        let got = inference_logits(&step, tp, &TOKENS);
        let d = rel_diff(&got, &want);
        eprintln!(
            "{tag}: inference at tp {tp} vs training forward: max relative difference {d:.2e}"
        );
        assert!(
            d <= TOL,
            "{tag} tp {tp}: inference logits differ by {d:e} (> {TOL:e})"
        );
    }
    (dir, ck, want)
}

/// "And God said, Let there be light" as bytes.
const TOKENS: [u32; 32] = {
    let b = b"And God said, Let there be light";
    let mut t = [0u32; 32];
    let mut i = 0;
    while i < 32 {
        t[i] = b[i] as u32;
        i += 1;
    }
    t
};

#[test]
fn trained_qwen3_loads_in_inference_and_its_logits_match_training() {
    let hd = qwen3_spec(dims(1, 1, 1), 1, 1).model.head_dim;
    let (dir, ck, want) = train_save_and_compare(
        "qwen3-inference",
        qwen3_spec(dims(1, 1, 1), 1, 1),
        "qwen3",
        "Qwen3ForCausalLM",
        &[
            ("self_attn.q_norm.weight", hd),
            ("self_attn.k_norm.weight", hd),
        ],
        1.0,
    );
    // The norms matter: the same weights read as a Llama (no q/k norms) give other logits.
    let llama = ModelConfig {
        arch: tp_spec::Arch::Llama,
        qk_norm: false,
        ..ck.config.clone()
    };
    let without = training_logits(&llama, &ck, &TOKENS);
    let d = rel_diff(&without, &want);
    assert!(d > 1e-2, "q/k norms should change the logits, got {d:e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn trained_qwen2_loads_in_inference_and_its_logits_match_training() {
    let m = qwen2_spec(dims(1, 1, 1), 1, 1).model;
    let (q, kv) = (m.heads * m.head_dim, m.kv_heads * m.head_dim);
    let (dir, ck, want) = train_save_and_compare(
        "qwen2-inference",
        qwen2_spec(dims(1, 1, 1), 1, 1),
        "qwen2",
        "Qwen2ForCausalLM",
        &[
            ("self_attn.q_proj.bias", q),
            ("self_attn.k_proj.bias", kv),
            ("self_attn.v_proj.bias", kv),
        ],
        // Fresh biases are 0, as HF initializes them.
        0.0,
    );
    // The biases matter: the same weights without them (a Llama of the rest) give other
    // logits, so the comparison can fail on them.
    let llama = ModelConfig {
        arch: tp_spec::Arch::Llama,
        qkv_bias: false,
        ..ck.config.clone()
    };
    let without = training_logits(&llama, &ck, &TOKENS);
    let d = rel_diff(&without, &want);
    assert!(d > 1e-3, "the biases should change the logits, got {d:e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn trained_gemma3_loads_in_inference_and_its_logits_match_training() {
    let m = gemma3_spec(dims(1, 1, 1), 1, 1).model;
    let (hd, h) = (m.head_dim, m.hidden);
    // 32 tokens: the window of 6 cuts the local layers' attention.
    let (dir, ck, want) = train_save_and_compare(
        "gemma3-inference",
        gemma3_spec(dims(1, 1, 1), 1, 1),
        "gemma3_text",
        "Gemma3ForCausalLM",
        &[
            ("self_attn.q_norm.weight", hd),
            ("self_attn.k_norm.weight", hd),
            ("post_attention_layernorm.weight", h),
            ("pre_feedforward_layernorm.weight", h),
            ("post_feedforward_layernorm.weight", h),
        ],
        // Gemma stores its norms minus one: a norm scaling by 1 is stored as 0.
        0.0,
    );
    // Gemma's block matters: the same config without its sliding window (every layer
    // global) gives other logits.
    let mut global = ck.config.clone();
    if let Some(s) = global.block.sliding.as_mut() {
        s.window = 1 << 20;
    }
    let d = rel_diff(&training_logits(&global, &ck, &TOKENS), &want);
    assert!(
        d > 1e-3,
        "the sliding window should change the logits, got {d:e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn trained_mixtral_loads_in_inference_and_its_logits_match_training() {
    // The router (softmax, top-2 of 4, normalised weights) and every expert are trained and
    // stored under Mixtral's names; inference routes with its own f64 router and grouped
    // experts (tp-models' moe.rs).
    let (dir, ck, want) = train_save_and_compare(
        "mixtral-inference",
        moe_spec(dims(1, 1, 1), 1, 1),
        "mixtral",
        "MixtralForCausalLM",
        &[],
        1.0,
    );
    let bytes = std::fs::read(dir.join("step-00000006").join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for name in [
        "model.layers.3.block_sparse_moe.gate.weight",
        "model.layers.3.block_sparse_moe.experts.3.w2.weight",
    ] {
        assert!(st.tensor(name).is_ok(), "{name} missing");
    }
    // The experts matter: the same weights routed to the top-1 expert give other logits.
    let mut top1 = ck.config.clone();
    top1.experts = top1.experts.map(|e| tp_spec::Experts { per_token: 1, ..e });
    let d = rel_diff(&training_logits(&top1, &ck, &TOKENS), &want);
    assert!(
        d > 1e-2,
        "routing to one expert should change the logits, got {d:e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Mixtral trained with the aux-loss-free router bias (rate 0.1, the balance loss off)
/// stores each layer's bias beside its router (`block_sparse_moe.gate.e_score_correction_bias`,
/// DeepSeek-V3's name), and inference chooses experts with it as training did: its logits at
/// tp 1 and 2 equal the training forward with the saved bias (`train_save_and_compare`), and
/// the same forward without the bias differs (a loader that ignored the tensor would fail).
#[test]
fn trained_router_bias_routes_inference_as_training_did() {
    let s = TrainSpec {
        moe_bias_rate: Some(0.1),
        moe_aux_coef: 0.0,
        ..moe_spec(dims(1, 1, 1), 1, 1)
    };
    let (dir, ck, want) = train_save_and_compare(
        "mixtral-router-bias",
        s,
        "mixtral",
        "MixtralForCausalLM",
        &[],
        1.0,
    );
    let bytes = std::fs::read(dir.join("step-00000006").join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let count = ck.config.experts.map_or(0, |e| e.count);
    for l in 0..ck.config.layers {
        let name = format!("model.layers.{l}.block_sparse_moe.gate.e_score_correction_bias");
        let t = st
            .tensor(&name)
            .unwrap_or_else(|_| panic!("{name} missing"));
        assert_eq!(t.shape(), [count], "{name}");
    }
    assert!(ck.state.moe_bias.iter().flatten().any(|&b| b != 0.0));
    let d = rel_diff(&training_logits(&ck.config, &ck, &TOKENS), &want);
    assert!(d > 1e-3, "the bias should change the routing, got {d:e}");
    let _ = std::fs::remove_dir_all(&dir);
}
