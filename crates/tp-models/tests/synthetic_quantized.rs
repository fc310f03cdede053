//! Quantized against quantized: our sharded model keeping ggml blocks (`keep_quantized`) vs
//! candle-transformers' quantized llama / qwen2 with its quantized matmuls, on synthetic GGUFs
//! at tp 1..4. A separate test binary, because candle fixes `CANDLE_DEQUANTIZE_ALL` per thread
//! from the process environment, which `synthetic_oracle` sets.
//!
//! The two sides use different quantized kernels (activation quantization, block dot
//! products, summation order, partial sums over ranks), so agreement is looser than the f32
//! comparison: 2e-2 of each row's logit spread (measured: 0 at tp 1 for every type, 0 at every
//! tp for Q4_0 and Q4_1 blocks, 8.8e-3 at tp 2..4 for Q8_0 blocks, where a last-bit change of
//! a partial sum flips the int8 rounding of later activations; Q5_1 6.4e-3 at every tp; the
//! K-quants Q5_K, Q3_K, Q2_K at most 2.3e-7 at tp 1 and 8.6e-3..1.3e-2 at tp 2..4, where
//! row-parallel shards that cut a 256-wide super-block are dequantized to f32 at load), and
//! the greedy token may differ only where the top two logits are within that tolerance.

mod common;

use common::{argmax, prompt, sharded_logits, spread, GgufOracle};
use tp_models::checkpoint::GgmlDType;
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{Arch, GgufCheckpoint, LoadOptions};

const TOL: f32 = 2e-2;

/// Changes the test shape of a case.
type Shape = fn(&mut tp_models::ModelConfig);

#[test]
fn quantized_logits_match_candle_quantized_models_at_tp_1_to_4() {
    // Must hold before the first quantized matmul of any thread of this process.
    std::env::remove_var("CANDLE_DEQUANTIZE_ALL");
    // candle's Q4_1 and Q5_1 dot products debug-assert an even number of blocks per row (it is
    // written for SIMD pairs), so the Q4_1 model has head_dim 64 and FFN 768: every shard
    // at tp 1..4 has an even block count. The others keep the uneven test shape.
    let q4_1_shape: Shape = |m| (m.heads, m.kv_heads, m.head_dim, m.ffn) = (4, 2, 64, 768);
    let keep: Shape = |_| {};
    // K-quant rows are 256 wide: FFN 768 (the down projection's columns). Row-parallel shards
    // that cut a super-block (FFN at tp 2 and 4, attention output at tp 2..4) are
    // dequantized at load; the others run on our K-quant kernels.
    let k_shape: Shape = |m| m.ffn = 768;
    let cases = [
        (Arch::Llama, GgmlDType::Q8_0, GgmlDType::Q8_0, keep),
        (Arch::Llama, GgmlDType::Q4_0, GgmlDType::Q8_0, keep),
        (Arch::Llama, GgmlDType::Q4_1, GgmlDType::Q4_1, q4_1_shape),
        (Arch::Qwen2, GgmlDType::Q4_1, GgmlDType::Q8_0, q4_1_shape),
        (Arch::Llama, GgmlDType::Q5_1, GgmlDType::Q5_1, q4_1_shape),
        (Arch::Llama, GgmlDType::Q5K, GgmlDType::Q6K, k_shape),
        (Arch::Qwen2, GgmlDType::Q3K, GgmlDType::Q8_0, k_shape),
        (Arch::Llama, GgmlDType::Q2K, GgmlDType::Q3K, k_shape),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (i, (arch, linear, embed, shape)) in cases.into_iter().enumerate() {
        let mut cfg = SyntheticModel::small(arch, 0).cfg;
        shape(&mut cfg);
        let model = SyntheticModel::new(cfg, 70 + i as u64);
        let path = dir.path().join(format!("q{i}.gguf"));
        model
            .write_gguf(&path, GgufTypes { linear, embed })
            .unwrap();
        let tokens = prompt(model.cfg.vocab, 10);
        let want = GgufOracle::logits(&path, arch, &tokens);
        let ckpt = GgufCheckpoint::open(&path).unwrap();
        for tp in 1..=4 {
            let got = sharded_logits(&ckpt, &tokens, tp, LoadOptions::default());
            let mut worst = 0f32;
            for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                let s = spread(w);
                let err = g
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                worst = worst.max(err / s);
                assert!(
                    err <= TOL * s,
                    "{arch:?} {linear:?}/{embed:?} tp={tp} row {r}: {err} > {}",
                    TOL * s
                );
                let (ga, wa) = (argmax(g), argmax(w));
                if ga != wa {
                    // Allowed only for a near tie in the oracle.
                    assert!(
                        w[wa] - w[ga] <= TOL * s,
                        "{arch:?} tp={tp} row {r}: greedy {ga} vs {wa}"
                    );
                }
            }
            eprintln!(
                "{arch:?} {linear:?}/{embed:?} tp={tp}: worst max|diff|/spread = {worst:.2e}"
            );
        }
    }
}

/// IQ4_NL and IQ4_XS (candle has no IQ4 types): synthetic GGUFs written by the reference
/// IQ4 quantizer (`synthetic::quantize_iq4`) load and run on the kernels; logits at tp 1..4
/// are bitwise those of tp 1, and close to tp-models' own f32 forward of the same file with
/// every weight dequantized at load (`keep_quantized: false`), the error being the 8-bit
/// activation rounding of the quantized products.
#[test]
fn iq4_models_are_tp_invariant_and_match_the_dequantized_f32_forward() {
    std::env::remove_var("CANDLE_DEQUANTIZE_ALL");
    // IQ4_XS rows are 256 wide: FFN 1024 (4 super-blocks, split whole at tp 1..4, as
    // tp_invariance's K-quant models); the attention output's 256 columns are cut inside
    // their super-block at tp 2..4 and take the sub-block form (at every tp).
    let k_shape: Shape = |m| m.ffn = 1024;
    let keep: Shape = |_| {};
    let cases = [
        (Arch::Llama, GgmlDType::IQ4_NL, GgmlDType::Q8_0, keep),
        (Arch::Qwen2, GgmlDType::IQ4_NL, GgmlDType::IQ4_NL, keep),
        (Arch::Llama, GgmlDType::IQ4_XS, GgmlDType::Q8_0, k_shape),
        (Arch::Qwen2, GgmlDType::IQ4_XS, GgmlDType::IQ4_NL, k_shape),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (i, (arch, linear, embed, shape)) in cases.into_iter().enumerate() {
        let mut cfg = SyntheticModel::small(arch, 0).cfg;
        shape(&mut cfg);
        let model = SyntheticModel::new(cfg, 90 + i as u64);
        let path = dir.path().join(format!("iq{i}.gguf"));
        model
            .write_gguf(&path, GgufTypes { linear, embed })
            .unwrap();
        let tokens = prompt(model.cfg.vocab, 10);
        let ckpt = GgufCheckpoint::open(&path).unwrap();
        let dense = LoadOptions {
            keep_quantized: false,
            ..LoadOptions::default()
        };
        let want = sharded_logits(&ckpt, &tokens, 1, dense);
        let base = sharded_logits(&ckpt, &tokens, 1, LoadOptions::default());
        for tp in 1..=4 {
            let got = sharded_logits(&ckpt, &tokens, tp, LoadOptions::default());
            let bits = |v: &[Vec<f32>]| {
                v.iter()
                    .flat_map(|r| r.iter().map(|x| x.to_bits()))
                    .collect::<Vec<_>>()
            };
            assert_eq!(
                bits(&got),
                bits(&base),
                "{arch:?} {linear:?}/{embed:?}: tp {tp} logits differ from tp 1"
            );
            let mut worst = 0f32;
            for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                let s = spread(w);
                let err = g
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                worst = worst.max(err / s);
                assert!(
                    err <= TOL * s,
                    "{arch:?} {linear:?}/{embed:?} tp={tp} row {r}: {err} > {}",
                    TOL * s
                );
            }
            eprintln!(
                "{arch:?} {linear:?}/{embed:?} tp={tp}: worst max|diff|/spread vs f32 = {worst:.2e}"
            );
        }
    }
}
