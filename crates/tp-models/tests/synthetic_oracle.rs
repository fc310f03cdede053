//! Sharded logits of small random models (8 heads, 2 KV heads, FFN 544, vocab 1000: tp 4 >
//! KV heads, uneven FFN and vocab shards) at tp 1..4 against independent implementations:
//! candle-transformers' quantized llama / qwen2 / qwen3 on the same GGUF, and its plain
//! llama / qwen2 / qwen3 on the same HF directory through candle-nn's VarBuilder.
//!
//! Both sides see identical f32 weights (GGUF: every weight dequantized, the oracle with
//! `CANDLE_DEQUANTIZE_ALL=1`, ours with `keep_quantized: false`), so the differences are f32
//! summation order, the all-reduce and RoPE tables computed in another order: the tolerance
//! is 1e-5 of each row's logit spread (measured: at most 5.1e-7 over all cases here) and
//! every greedy token agrees. A wrong shard, head mapping or RoPE layout moves logits by
//! orders of magnitude more.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::{llama, qwen2, qwen3};
use common::{assert_close, prompt, sharded_logits, GgufOracle};
use std::path::Path;
use tp_models::synthetic::{GgufTypes, HfDType, SyntheticModel};
use tp_models::{Arch, DenseDType, GgufCheckpoint, HfCheckpoint, LoadOptions};

const TOL: f32 = 1e-5;

fn dense() -> LoadOptions {
    LoadOptions {
        keep_quantized: false,
        ..LoadOptions::default()
    }
}

/// candle-transformers' GGUF models, every weight dequantized.
fn gguf_oracle_logits(path: &Path, arch: Arch, tokens: &[u32]) -> Vec<Vec<f32>> {
    // The oracle reads this variable once per thread, at its first quantized matmul.
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    GgufOracle::logits(path, arch, tokens)
}

/// candle-transformers' plain (safetensors) models.
enum HfOracle {
    Llama(llama::Llama, llama::Cache),
    Qwen2(qwen2::ModelForCausalLM),
    Qwen3(qwen3::ModelForCausalLM),
}

impl HfOracle {
    fn load(dir: &Path) -> Self {
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        // SAFETY: the files are written by this test and not modified while mapped.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu) }
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        if v["model_type"] == "qwen3" {
            let cfg: qwen3::Config = serde_json::from_str(&text).unwrap();
            HfOracle::Qwen3(qwen3::ModelForCausalLM::new(&cfg, vb).unwrap())
        } else if v["model_type"] == "qwen2" {
            let cfg: qwen2::Config = serde_json::from_str(&text).unwrap();
            HfOracle::Qwen2(qwen2::ModelForCausalLM::new(&cfg, vb).unwrap())
        } else {
            let cfg: llama::LlamaConfig = serde_json::from_str(&text).unwrap();
            let cfg = cfg.into_config(false);
            let cache = llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu).unwrap();
            HfOracle::Llama(llama::Llama::load(vb, &cfg).unwrap(), cache)
        }
    }

    fn forward(&mut self, tokens: &[u32], pos: usize) -> Vec<f32> {
        let x = Tensor::new(tokens, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let y = match self {
            HfOracle::Llama(m, cache) => m.forward(&x, pos, cache),
            HfOracle::Qwen2(m) => m.forward(&x, pos),
            HfOracle::Qwen3(m) => m.forward(&x, pos),
        };
        y.unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }
}

fn hf_oracle_logits(dir: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut out = vec![HfOracle::load(dir).forward(tokens, 0)];
    let mut m = HfOracle::load(dir);
    for (i, t) in tokens.iter().enumerate() {
        out.push(m.forward(std::slice::from_ref(t), i));
    }
    out
}

fn gguf_case(arch: Arch, types: GgufTypes, seed: u64) {
    let model = SyntheticModel::small(arch, seed);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    model.write_gguf(&path, types).unwrap();
    let tokens = prompt(model.cfg.vocab, 10);
    let want = gguf_oracle_logits(&path, arch, &tokens);
    let ckpt = GgufCheckpoint::open(&path).unwrap();
    for tp in 1..=4 {
        let got = sharded_logits(&ckpt, &tokens, tp, dense());
        let what = format!("{arch:?} GGUF {:?}/{:?} tp={tp}", types.linear, types.embed);
        assert_close(&what, &got, &want, TOL, true);
    }
}

#[test]
fn gguf_llama_matches_candle_quantized_llama_at_tp_1_to_4() {
    use tp_models::checkpoint::GgmlDType::*;
    for (i, (linear, embed)) in [(F32, F32), (Q8_0, Q8_0), (Q4_0, Q8_0), (Q4_1, Q4_0)]
        .into_iter()
        .enumerate()
    {
        gguf_case(Arch::Llama, GgufTypes { linear, embed }, 10 + i as u64);
    }
}

#[test]
fn gguf_qwen2_matches_candle_quantized_qwen2_at_tp_1_to_4() {
    use tp_models::checkpoint::GgmlDType::*;
    for (i, (linear, embed)) in [(F32, F32), (Q4_1, Q8_0)].into_iter().enumerate() {
        gguf_case(Arch::Qwen2, GgufTypes { linear, embed }, 20 + i as u64);
    }
}

/// Qwen3: per-head q/k RMSNorm before RoPE, no biases, head_dim given apart from hidden/heads.
#[test]
fn gguf_qwen3_matches_candle_quantized_qwen3_at_tp_1_to_4() {
    use tp_models::checkpoint::GgmlDType::*;
    for (i, (linear, embed)) in [(F32, F32), (Q8_0, Q4_1)].into_iter().enumerate() {
        gguf_case(Arch::Qwen3, GgufTypes { linear, embed }, 25 + i as u64);
    }
}

#[test]
fn hf_llama_qwen2_and_qwen3_match_candle_at_tp_1_to_4() {
    for (arch, seed) in [(Arch::Llama, 30), (Arch::Qwen2, 31), (Arch::Qwen3, 32)] {
        let model = SyntheticModel::small(arch, seed);
        let dir = tempfile::tempdir().unwrap();
        model.write_hf(dir.path(), 1, HfDType::F32).unwrap();
        let tokens = prompt(model.cfg.vocab, 10);
        let want = hf_oracle_logits(dir.path(), &tokens);
        let ckpt = HfCheckpoint::open(dir.path()).unwrap();
        for tp in 1..=4 {
            let got = sharded_logits(&ckpt, &tokens, tp, dense());
            assert_close(&format!("{arch:?} HF tp={tp}"), &got, &want, TOL, true);
        }
    }
}

#[test]
fn hf_bf16_and_f16_dirs_match_candle_at_tp_3() {
    for (arch, dtype, seed) in [
        (Arch::Llama, HfDType::BF16, 40),
        (Arch::Qwen2, HfDType::F16, 41),
    ] {
        let model = SyntheticModel::small(arch, seed);
        let dir = tempfile::tempdir().unwrap();
        model.write_hf(dir.path(), 1, dtype).unwrap();
        let tokens = prompt(model.cfg.vocab, 6);
        let want = hf_oracle_logits(dir.path(), &tokens);
        let ckpt = HfCheckpoint::open(dir.path()).unwrap();
        let got = sharded_logits(&ckpt, &tokens, 3, dense());
        assert_close(
            &format!("{arch:?} HF {dtype:?} tp=3"),
            &got,
            &want,
            TOL,
            true,
        );
    }
}

/// A bf16 HF directory kept as bf16 (`DenseDType::BF16`, our dense kernels widen each weight
/// exactly) gives the bits of the same weights held as f32, at every tp: the 16-bit store
/// changes the bytes streamed, not the arithmetic. (bf16 had gone through candle, which also
/// rounded the activations and was not split-invariant.)
#[test]
fn bf16_weights_kept_as_bf16_give_the_f32_bits_at_every_tp() {
    let model = SyntheticModel::small(Arch::Qwen2, 42);
    let dir = tempfile::tempdir().unwrap();
    model.write_hf(dir.path(), 1, HfDType::BF16).unwrap();
    let tokens = prompt(model.cfg.vocab, 7);
    let ckpt = HfCheckpoint::open(dir.path()).unwrap();
    let want = sharded_logits(&ckpt, &tokens, 1, dense());
    for tp in 1..=4 {
        let opts = LoadOptions {
            dense: DenseDType::BF16,
            ..dense()
        };
        let got = sharded_logits(&ckpt, &tokens, tp, opts);
        assert!(got == want, "bf16 store at tp={tp}: other logits than f32");
    }
}

#[test]
fn hf_two_shard_dir_gives_the_same_logits_as_one_file() {
    for (arch, seed) in [(Arch::Llama, 50), (Arch::Qwen2, 51)] {
        let model = SyntheticModel::small(arch, seed);
        let one = tempfile::tempdir().unwrap();
        let two = tempfile::tempdir().unwrap();
        model.write_hf(one.path(), 1, HfDType::F32).unwrap();
        model.write_hf(two.path(), 2, HfDType::F32).unwrap();
        assert!(two.path().join("model.safetensors.index.json").is_file());
        assert!(two
            .path()
            .join("model-00002-of-00002.safetensors")
            .is_file());
        let tokens = prompt(model.cfg.vocab, 6);
        let a = HfCheckpoint::open(one.path()).unwrap();
        let b = HfCheckpoint::open(two.path()).unwrap();
        for tp in 1..=4 {
            let x = sharded_logits(&a, &tokens, tp, dense());
            let y = sharded_logits(&b, &tokens, tp, dense());
            assert!(x == y, "{arch:?} tp={tp}: sharded dir gives other logits");
        }
    }
}

/// One model written as an HF directory (rotate-half RoPE) and as a llama GGUF (Q/K rows
/// permuted by llama.cpp's rule, interleaved RoPE): the two readers and RoPE styles must
/// agree. A wrong permutation or RoPE style moves logits by far more than the tolerance.
#[test]
fn llama_gguf_and_hf_dir_of_the_same_weights_agree() {
    let model = SyntheticModel::small(Arch::Llama, 60);
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("model.gguf");
    model.write_gguf(&gguf, GgufTypes::F32).unwrap();
    let hf = dir.path().join("hf");
    model.write_hf(&hf, 1, HfDType::F32).unwrap();
    let tokens = prompt(model.cfg.vocab, 8);
    let g = GgufCheckpoint::open(&gguf).unwrap();
    let h = HfCheckpoint::open(&hf).unwrap();
    for tp in [1, 4] {
        let a = sharded_logits(&g, &tokens, tp, dense());
        let b = sharded_logits(&h, &tokens, tp, dense());
        assert_close(&format!("GGUF vs HF tp={tp}"), &a, &b, TOL, true);
    }
}
