//! Fine-tuning starts from a mixture of experts too (issues 33 and 34): a Mixtral GGUF (one
//! tensor per expert, interleaved RoPE rows) and a Qwen3-MoE GGUF (merged 3-D expert
//! tensors) open as training's initial weights (`tp train --init`), and the training forward
//! (tp-nn's layers: candle f32, router softmax in f32, tokens grouped by expert) gives the
//! inference engine's logits on the same file (tp-models: its own kernels, router in f64) at
//! tp 1 and tp 2, within 1e-4 of the largest logit: f32 summation order, and a top-2 choice
//! that flips only if two router probabilities tie within ~1e-7 (none does in these files).
//! Reading the experts in another order, or dropping the RoPE row permutation, moves the
//! logits by far more.
//!
//! And a Qwen2 (Q/K/V biases; 8 query heads over 2 KV heads), as a GGUF and as an HF
//! directory (`Qwen2ForCausalLM`, whose config.json has no bias flag), opens the same way and
//! gives inference's logits at tp 1 and 2 (measured 8.5e-7); the same weights without their
//! biases do not.

mod common;
use common::logits::{inference_logits, rel_diff, training_logits};
use tp_models::synthetic::{GgufTypes, HfDType, SyntheticModel};
use tp_spec::Arch;
use tp_train::Pretrained;

const TOKENS: [u32; 9] = [1, 17, 256, 999, 3, 512, 64, 8, 700];

#[test]
fn a_qwen2_file_with_qkv_biases_opens_as_initial_weights_and_trains_on_inference_logits() {
    let dir = tempfile::tempdir().unwrap();
    let model = SyntheticModel::small(Arch::Qwen2, 23);
    let gguf = dir.path().join("qwen2.gguf");
    model.write_gguf(&gguf, GgufTypes::F32).unwrap();
    let hf = dir.path().join("qwen2-hf");
    model.write_hf(&hf, 2, HfDType::F32).unwrap();
    // As Qwen2's own config.json files: no `attention_bias` (the class implies the biases).
    let cfg_path = hf.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("attention_bias");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    for path in [&gguf, &hf] {
        let init = Pretrained::open(path).expect("a Qwen2 model is trainable");
        assert!(init.config.qkv_bias && init.config.arch == Arch::Qwen2);
        let want = training_logits(&init.config, &init, &TOKENS);
        for tp in [1, 2] {
            let d = rel_diff(&inference_logits(path, tp, &TOKENS), &want);
            eprintln!("Qwen2 {path:?} at tp {tp}: max relative difference {d:.2e}");
            assert!(
                d <= 1e-4,
                "Qwen2 {path:?} tp {tp}: training and inference differ by {d:e}"
            );
        }
        // Without the biases (the rest read as a Llama) the logits move far beyond the
        // tolerance.
        let llama = tp_spec::ModelConfig {
            arch: Arch::Llama,
            qkv_bias: false,
            ..init.config.clone()
        };
        let d = rel_diff(&training_logits(&llama, &init, &TOKENS), &want);
        assert!(d > 1e-2, "the biases should change the logits, got {d:e}");
    }
}

#[test]
fn moe_files_open_as_initial_weights_and_train_on_inference_logits() {
    let dir = tempfile::tempdir().unwrap();
    for (arch, merged) in [(Arch::Llama, false), (Arch::Qwen3, true)] {
        let mut model = SyntheticModel::small_moe(arch, 8, 2, 21);
        model.merged_experts = merged;
        let path = dir.path().join(format!("{arch:?}.gguf"));
        model.write_gguf(&path, GgufTypes::F32).unwrap();
        let init = Pretrained::open(&path).expect("an MoE file is trainable");
        assert_eq!(init.config.experts.map(|e| e.count), Some(8));
        let want = training_logits(&init.config, &init, &TOKENS);
        for tp in [1, 2] {
            let d = rel_diff(&inference_logits(&path, tp, &TOKENS), &want);
            eprintln!("{arch:?} (merged {merged}) at tp {tp}: max relative difference {d:.2e}");
            assert!(
                d <= 1e-4,
                "{arch:?} tp {tp}: training and inference differ by {d:e}"
            );
        }
    }
}
