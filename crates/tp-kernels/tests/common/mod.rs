//! Shared by the kernel tests and benchmarks: a deterministic uniform stream (xorshift64) and
//! the candle dtype of each quantization format.
#![allow(dead_code)]

use candle_core::quantized::GgmlDType;
use tp_kernels::QuantType;

/// A xorshift64 stream of f32 values uniform in [-0.5, 0.5); the same seed, the same values.
pub struct Uniform(u64);

impl Uniform {
    pub fn new(seed: u64) -> Self {
        Uniform(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn sample(&mut self) -> f32 {
        let s = &mut self.0;
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        (*s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

/// `len` values of [`Uniform`] from `seed`.
pub fn uniform_values(len: usize, seed: u64) -> Vec<f32> {
    let mut u = Uniform::new(seed);
    (0..len).map(|_| u.sample()).collect()
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
