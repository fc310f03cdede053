//! Gemma-3 (GeGLU, q/k norms, post norms, scaled embeddings, a sliding-window layer with its
//! own RoPE base beside a global one, MQA) at tp 1..4 against candle-transformers' plain
//! gemma3 model on the same HF directory, and our GGUF and HF readers on the same weights.
//!
//! candle's quantized_gemma3 is no oracle: its MLP computes SiLU where Gemma computes GELU.
//! The plain model is, with two conventions stated here: its prefill mask lets a local layer
//! see `window + 1` positions (`j + window < i` masked; HF and llama.cpp see `window`), so it
//! is given `window - 1`; and its step-by-step cache keeps `window` positions, disagreeing
//! with its own prefill, so every oracle row is a fresh prefill of a prefix.
//!
//! Both sides hold the same f32 weights: differences are f32 summation order and GELU's
//! formula arranged differently, so the tolerance is 1e-5 of each row's logit spread
//! (measured: 2.7e-7 at tp 1..4; GGUF vs HF 0) and every greedy token agrees. A wrong window, RoPE base, norm offset or
//! head mapping moves logits by orders of magnitude more.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::gemma3;
use common::{assert_close, prompt, sharded_logits};
use std::path::Path;
use tp_models::synthetic::{GgufTypes, HfDType, SyntheticModel};
use tp_models::{Arch, GgufCheckpoint, HfCheckpoint, LoadOptions};

const TOL: f32 = 1e-5;

fn dense() -> LoadOptions {
    LoadOptions {
        keep_quantized: false,
        ..LoadOptions::default()
    }
}

/// candle's rows in [`sharded_logits`]'s order: the whole prompt, then each prefix, every
/// one a fresh prefill (the last position's logits).
fn candle_gemma3_logits(dir: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let window = v["sliding_window"].as_u64().unwrap();
    v["sliding_window"] = (window - 1).into();
    let cfg: gemma3::Config = serde_json::from_value(v).unwrap();
    let files = [dir.join("model.safetensors")];
    // SAFETY: the file is written by this test and not modified while mapped.
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu) }.unwrap();
    let mut model = gemma3::Model::new(false, &cfg, vb).unwrap();
    let mut run = |t: &[u32]| -> Vec<f32> {
        model.clear_kv_cache();
        let x = Tensor::new(t, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let y = model.forward(&x, 0).unwrap();
        y.flatten_all().unwrap().to_vec1().unwrap()
    };
    let mut out = vec![run(tokens)];
    for k in 1..=tokens.len() {
        out.push(run(&tokens[..k]));
    }
    out
}

#[test]
fn hf_gemma3_matches_candle_gemma3_at_tp_1_to_4() {
    let model = SyntheticModel::small(Arch::Gemma3, 70);
    let dir = tempfile::tempdir().unwrap();
    model.write_hf(dir.path(), 1, HfDType::F32).unwrap();
    // Longer than the window of 4: the local layer's window cuts.
    let tokens = prompt(model.cfg.vocab, 10);
    let want = candle_gemma3_logits(dir.path(), &tokens);
    let ckpt = HfCheckpoint::open(dir.path()).unwrap();
    assert_eq!(tp_models::Checkpoint::config(&ckpt), &model.cfg);
    for tp in 1..=4 {
        let got = sharded_logits(&ckpt, &tokens, tp, dense());
        assert_close(&format!("Gemma-3 HF tp={tp}"), &got, &want, TOL, true);
    }
}

/// The window is what the oracle agreement rests on: without it the logits past the window
/// move far beyond the tolerance (so the test above cannot pass with the window ignored).
#[test]
fn the_sliding_window_changes_what_the_local_layer_sees() {
    let model = SyntheticModel::small(Arch::Gemma3, 71);
    let mut wide = model.clone();
    if let Some(s) = wide.cfg.block.sliding.as_mut() {
        s.window = 1000;
    }
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    model.write_hf(&a, 1, HfDType::F32).unwrap();
    wide.write_hf(&b, 1, HfDType::F32).unwrap();
    let tokens = prompt(model.cfg.vocab, 10);
    let x = sharded_logits(&HfCheckpoint::open(&a).unwrap(), &tokens, 2, dense());
    let y = sharded_logits(&HfCheckpoint::open(&b).unwrap(), &tokens, 2, dense());
    // Rows 1..=4 are prefixes within the window: the same; row 0 (all 10 tokens) is not.
    for (i, (r, s)) in x.iter().zip(&y).enumerate() {
        let diff = r
            .iter()
            .zip(s)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max);
        if (1..=4).contains(&i) {
            assert_eq!(diff, 0.0, "row {i}: inside the window");
        } else {
            assert!(diff > 1e-3 * common::spread(s), "row {i}: {diff}");
        }
    }
}

/// One model as a gemma3 GGUF (norms store w, rotate-half RoPE, the window keys) and as an HF
/// directory (norms store w - 1): the two readers agree, at tp 1 and at tp 4 > 1 KV head.
#[test]
fn gemma3_gguf_and_hf_dir_of_the_same_weights_agree() {
    let model = SyntheticModel::small(Arch::Gemma3, 72);
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("model.gguf");
    model.write_gguf(&gguf, GgufTypes::F32).unwrap();
    let hf = dir.path().join("hf");
    model.write_hf(&hf, 1, HfDType::F32).unwrap();
    let tokens = prompt(model.cfg.vocab, 9);
    let g = GgufCheckpoint::open(&gguf).unwrap();
    let h = HfCheckpoint::open(&hf).unwrap();
    assert_eq!(tp_models::Checkpoint::config(&g).block, model.cfg.block);
    for tp in [1, 4] {
        let a = sharded_logits(&g, &tokens, tp, dense());
        let b = sharded_logits(&h, &tokens, tp, dense());
        assert_close(&format!("GGUF vs HF tp={tp}"), &a, &b, TOL, true);
    }
}
