//! Logits of the sharded SmolLM2 at tp 1..4 against candle-transformers' quantized llama, an
//! independent implementation, on the same GGUF file.
//!
//! Both sides dequantize every weight to f32 (`CANDLE_DEQUANTIZE_ALL=1` for the oracle,
//! `keep_quantized: false` here), so the only differences are f32 summation order and the
//! all-reduce: the tolerance is 1e-4 of the logits' spread (measured about 1.5e-6).

mod common;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use common::{argmax, spread};
use tp_models::{GgufCheckpoint, LoadOptions};

/// Arbitrary token ids spread over the vocabulary (ids, not text: no tokenizer involved here).
const PROMPT: [u32; 12] = [
    11_339, 2_402, 253, 655, 28, 665, 436, 253, 1_165, 30_000, 7, 49_000,
];

fn oracle_logits(path: &std::path::Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    // The oracle reads this variable once per thread; set it before its first use.
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut model = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    // Feed the prompt whole, then a second time token by token: the last-position logits of
    // every prefix (the oracle only returns the last position).
    let mut out = Vec::new();
    let x = Tensor::new(tokens, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    out.push(
        model
            .forward(&x, 0)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
    );
    let mut model2 = {
        let mut file = std::fs::File::open(path).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap()
    };
    for (i, &t) in tokens.iter().enumerate() {
        let x = Tensor::new(&[t], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        out.push(
            model2
                .forward(&x, i)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
        );
    }
    out
}

/// The sharded model's logits, every weight dequantized to f32 like the oracle's.
fn ours(path: &std::path::Path, tokens: &[u32], tp: usize) -> Vec<Vec<f32>> {
    let ckpt = GgufCheckpoint::open(path).unwrap();
    let opts = LoadOptions {
        keep_quantized: false,
        ..LoadOptions::default()
    };
    common::sharded_logits(&ckpt, tokens, tp, opts)
}

#[test]
fn dequantized_logits_match_candle_quantized_llama_at_tp_1_to_4() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let want = oracle_logits(&path, &PROMPT);
    for tp in 1..=4 {
        let got = ours(&path, &PROMPT, tp);
        assert_eq!(got.len(), want.len());
        let mut worst = 0f32;
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.len(), w.len());
            let tol = 1e-4 * spread(w);
            let err = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            worst = worst.max(err / spread(w));
            assert!(err <= tol, "tp={tp}: max |logit diff| {err} > {tol}");
            assert_eq!(argmax(g), argmax(w), "tp={tp}: greedy token differs");
        }
        eprintln!("tp={tp}: worst max|diff| / spread = {worst:.2e}");
    }
}
