//! Shared by the kernel tests and benchmarks: deterministic weights and activations (from
//! tp-testkit's seeded stream) and the candle dtype of each quantization format.
#![allow(dead_code)]

use candle_core::quantized::GgmlDType;
use tp_kernels::QuantType;
use tp_testkit::Rng;

/// `len` values uniform in [-0.5, 0.5) from `seed` (tp-testkit's stream).
pub fn uniform_values(len: usize, seed: u64) -> Vec<f32> {
    Rng::new(seed).uniform_vec(len, -0.5, 0.5)
}

/// Roughly N(0, 1) values (a sum of 4 uniforms) times `scale`, whose magnitude changes per
/// 32-block by up to 16x so blocks get different quantization scales; with `outliers`, an
/// occasional value 20x larger (activations of real models have such columns).
pub fn block_scaled_values(len: usize, seed: u64, scale: f32, outliers: bool) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let mut uniform = move || rng.uniform(-0.5, 0.5);
    let mut block_mag = 1.0;
    (0..len)
        .map(|i| {
            if i % 32 == 0 {
                block_mag = 0.25 + 3.75 * (uniform() + 0.5);
            }
            let g = (uniform() + uniform() + uniform() + uniform()) * 1.7;
            let outlier = if outliers && uniform() > 0.499 {
                20.0
            } else {
                1.0
            };
            g * block_mag * scale * outlier
        })
        .collect()
}

/// candle's name for a quantization format.
pub fn ggml_dtype(q: QuantType) -> GgmlDType {
    match q {
        QuantType::Q4_0 => GgmlDType::Q4_0,
        QuantType::Q4_1 => GgmlDType::Q4_1,
        QuantType::Q8_0 => GgmlDType::Q8_0,
        QuantType::Q5_0 => GgmlDType::Q5_0,
        QuantType::Q5_1 => GgmlDType::Q5_1,
        QuantType::Q2_K => GgmlDType::Q2K,
        QuantType::Q3_K => GgmlDType::Q3K,
        QuantType::Q4_K => GgmlDType::Q4K,
        QuantType::Q5_K => GgmlDType::Q5K,
        QuantType::Q6_K => GgmlDType::Q6K,
    }
}
