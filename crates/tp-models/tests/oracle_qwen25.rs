//! Opt-in: the real Qwen2.5-Coder-0.5B-Instruct GGUF (qwen2: QKV biases, rotate-half RoPE,
//! 14 heads / 2 KV heads, K-quants) at tp 4 > 2 KV heads and tp 3 against candle-transformers'
//! quantized qwen2. Skips with a message when the file is absent (docs/models.md, "Mid-size").
//!
//! Both sides dequantize every weight to f32 (`CANDLE_DEQUANTIZE_ALL=1`, `keep_quantized:
//! false`): tolerance 1e-4 of each row's logit spread, as for SmolLM2, and the same greedy
//! tokens.

mod common;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_qwen2::ModelWeights;
use common::{assert_close, sharded_logits};
use tp_models::{GgufCheckpoint, LoadOptions};

/// Arbitrary ids spread over the 151936-token vocabulary.
const PROMPT: [u32; 8] = [3_555, 374, 264, 1_273, 90_000, 11, 151_000, 42];

fn run(m: &mut ModelWeights, tokens: &[u32], pos: usize) -> Vec<f32> {
    let x = Tensor::new(tokens, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    m.forward(&x, pos)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn qwen25_dequantized_logits_match_candle_quantized_qwen2_at_tp_3_and_4() {
    let Some(path) = common::qwen25() else {
        return;
    };
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let want = {
        let mut file = std::fs::File::open(&path).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let mut m = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
        let mut out = vec![run(&mut m, &PROMPT, 0)];
        m.clear_kv_cache();
        for (i, t) in PROMPT.iter().enumerate() {
            out.push(run(&mut m, std::slice::from_ref(t), i));
        }
        out
    };
    let ckpt = GgufCheckpoint::open(&path).unwrap();
    let cfg = tp_models::Checkpoint::config(&ckpt);
    assert_eq!((cfg.heads, cfg.kv_heads, cfg.head_dim), (14, 2, 64));
    assert!(cfg.qkv_bias);
    let opts = LoadOptions {
        keep_quantized: false,
        ..LoadOptions::default()
    };
    for tp in [4, 3] {
        let got = sharded_logits(&ckpt, &PROMPT, tp, opts);
        assert_close(&format!("Qwen2.5-0.5B tp={tp}"), &got, &want, 1e-4, true);
    }
}
