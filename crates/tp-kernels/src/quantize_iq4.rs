//! A simple reference quantizer of weights to IQ4_NL and IQ4_XS (for synthetic checkpoints and
//! tests; the model files users bring are quantized by llama.cpp): per 32 values
//! `d = max / -127` (the value of largest magnitude maps to the table's end, -127), nibble =
//! the table entry nearest to `x / d`; IQ4_XS takes its super-block `d` as the largest
//! sub-block `|d_j|` over 31 and each sub-block's 6-bit scale as the nearest integer to
//! `d_j / d`.

use crate::error::KernelError;
use crate::format::{QuantType, KVALUES_IQ4};
use half::f16;

/// `values` (a whole number of blocks) as the ggml bytes of `qtype` (IQ4_NL or IQ4_XS).
pub fn quantize_iq4(qtype: QuantType, values: &[f32]) -> Result<Vec<u8>, KernelError> {
    let block = qtype.block_len();
    if !matches!(qtype, QuantType::IQ4_NL | QuantType::IQ4_XS)
        || !values.len().is_multiple_of(block)
    {
        return Err(KernelError::NotIq4Blocks {
            qtype,
            values: values.len(),
        });
    }
    let mut out = Vec::with_capacity(values.len() / block * qtype.block_bytes());
    for xs in values.chunks_exact(block) {
        if qtype == QuantType::IQ4_NL {
            let d = f16::from_f32(signed_max(xs) / -127.0);
            out.extend_from_slice(&d.to_le_bytes());
            nibbles(xs, d.to_f32(), &mut out);
            continue;
        }
        let dj: Vec<f32> = xs
            .chunks_exact(32)
            .map(|s| signed_max(s) / -127.0)
            .collect();
        let dmax = dj.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
        let d = f16::from_f32(dmax / 31.0);
        let df = d.to_f32();
        let ls: Vec<i32> = dj
            .iter()
            .map(|&v| {
                if df == 0.0 {
                    0
                } else {
                    (v / df).round() as i32
                }
                .clamp(-32, 31)
            })
            .collect();
        let (mut h, mut l) = (0u16, [0u8; 4]);
        for (j, &s) in ls.iter().enumerate() {
            let v = (s + 32) as u8;
            l[j / 2] |= (v & 15) << (4 * (j % 2));
            h |= ((v >> 4) as u16) << (2 * j);
        }
        out.extend_from_slice(&d.to_le_bytes());
        out.extend_from_slice(&h.to_le_bytes());
        out.extend_from_slice(&l);
        for (s, &sc) in xs.chunks_exact(32).zip(&ls) {
            nibbles(s, df * sc as f32, &mut out);
        }
    }
    Ok(out)
}

/// The index of the table entry nearest to `v` (in table units; the first on a tie).
fn nearest(v: f32) -> u8 {
    let mut best = 0;
    for (i, &k) in KVALUES_IQ4.iter().enumerate() {
        if (v - k as f32).abs() < (v - KVALUES_IQ4[best] as f32).abs() {
            best = i;
        }
    }
    best as u8
}

/// 16 bytes of nibbles for 32 values at scale `d`: byte `j` holds value `j` low, `j + 16` high.
fn nibbles(xs: &[f32], d: f32, out: &mut Vec<u8>) {
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for j in 0..16 {
        out.push(nearest(xs[j] * id) | (nearest(xs[j + 16] * id) << 4));
    }
}

/// The value of largest magnitude (signed).
fn signed_max(xs: &[f32]) -> f32 {
    xs.iter()
        .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}
