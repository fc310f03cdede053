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
        QuantType::IQ4_NL | QuantType::IQ4_XS => panic!("candle 0.11.1 has no {q}"),
    }
}

/// ggml's IQ4 table (`kvalues_iq4nl`), written out here from the format definition.
pub const KVALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The library's reference IQ4 quantizer (test data), for a valid `qtype` and length.
pub fn quantize_iq4(qtype: QuantType, values: &[f32]) -> Vec<u8> {
    tp_kernels::quantize_iq4(qtype, values).expect("IQ4 test data: whole blocks")
}

/// The reference dequantization of IQ4_NL / IQ4_XS bytes, straight from the format
/// definition: IQ4_NL `d * KVALUES[q]`; IQ4_XS `(d * (ls - 32)) * KVALUES[q]` with
/// `ls = (scales_l[j / 2] >> 4 (j % 2)) & 15 | ((scales_h >> 2j) & 3) << 4`.
pub fn dequantize_iq4(qtype: QuantType, bytes: &[u8]) -> Vec<f32> {
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    let mut out = Vec::new();
    let nibbles = |qs: &[u8], scale: f32, out: &mut Vec<f32>| {
        let vals: Vec<f32> = (0..32)
            .map(|i| {
                let q = if i < 16 { qs[i] & 15 } else { qs[i - 16] >> 4 };
                scale * KVALUES[q as usize] as f32
            })
            .collect();
        out.extend(vals);
    };
    match qtype {
        QuantType::IQ4_NL => {
            for b in bytes.chunks_exact(18) {
                nibbles(&b[2..], f16(b), &mut out);
            }
        }
        QuantType::IQ4_XS => {
            for b in bytes.chunks_exact(136) {
                let d = f16(b);
                let h = u16::from_le_bytes([b[2], b[3]]);
                for j in 0..8 {
                    let ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) as i32
                        | (((h >> (2 * j)) & 3) as i32) << 4;
                    nibbles(&b[8 + 16 * j..], d * (ls - 32) as f32, &mut out);
                }
            }
        }
        _ => panic!("dequantize_iq4 takes IQ4_NL or IQ4_XS, not {qtype}"),
    }
    out
}
