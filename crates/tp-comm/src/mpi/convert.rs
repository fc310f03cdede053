//! Half-precision buffers widened to f32 for MPI reductions and rounded back: the same
//! result as the local backend (which accumulates halves in f32) for exactly representable
//! values.

use crate::dtype::DType;
use half::{bf16, f16};

pub(crate) fn is_half(d: DType) -> bool {
    matches!(d, DType::F16 | DType::BF16)
}

/// Widens f16/bf16 bytes into f32 bytes (`out` holds 2x the bytes).
pub(crate) fn widen(src: &[u8], dtype: DType, out: &mut [u8]) {
    for (s, o) in src.chunks_exact(2).zip(out.chunks_exact_mut(4)) {
        let bits = u16::from_le_bytes([s[0], s[1]]);
        let v = if dtype == DType::F16 {
            f16::from_bits(bits).to_f32()
        } else {
            bf16::from_bits(bits).to_f32()
        };
        o.copy_from_slice(&v.to_le_bytes());
    }
}

/// Rounds f32 bytes back into f16/bf16 bytes.
pub(crate) fn narrow(src: &[u8], dtype: DType, out: &mut [u8]) {
    for (s, o) in src.chunks_exact(4).zip(out.chunks_exact_mut(2)) {
        let v = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let bits = if dtype == DType::F16 {
            f16::from_f32(v).to_bits()
        } else {
            bf16::from_f32(v).to_bits()
        };
        o.copy_from_slice(&bits.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_widen_and_round_back_exactly() {
        for dtype in [DType::F16, DType::BF16] {
            let vals = [0.0f32, 1.0, -3.0, 108.0, 0.5];
            let src: Vec<u8> = vals
                .iter()
                .flat_map(|&v| {
                    if dtype == DType::F16 {
                        f16::from_f32(v).to_bits().to_le_bytes()
                    } else {
                        bf16::from_f32(v).to_bits().to_le_bytes()
                    }
                })
                .collect();
            let mut wide = vec![0u8; src.len() * 2];
            widen(&src, dtype, &mut wide);
            let back: Vec<f32> = wide
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(back, vals);
            let mut narrow_out = vec![0u8; src.len()];
            narrow(&wide, dtype, &mut narrow_out);
            assert_eq!(narrow_out, src);
        }
    }
}
