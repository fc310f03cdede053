//! Activation quantization for the K-quants: f32 rows to ggml's Q8_K blocks of 256 (one f32
//! scale per block, plus sums of each 16 and each 32 quants), as ggml's reference
//! `quantize_row_q8_K`: `max` = the value of largest magnitude, `iscale = -127 / max`,
//! `q = nearest(iscale * x)` (ties to even, like ggml's `nearest_int`), `d = 1 / iscale`.
//! Portable code only: it is O(cols) per token against the matmul's O(rows * cols).

use crate::format::QK_K;

/// One Q8_K block of activations.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub(crate) struct ActBlockK {
    /// The 256 quants.
    pub qs: [i8; QK_K],
    /// The scale (f32, as in ggml's Q8_K).
    pub d: f32,
    /// Sum of each 16 consecutive quants (Q6_K's offset of 32, Q3_K's of 4, Q2_K's minimums).
    pub bsum16: [i16; QK_K / 16],
    /// Sum of each 32 consecutive quants (Q4_K's and Q5_K's minimums).
    pub bsum32: [i16; QK_K / 32],
}

impl Default for ActBlockK {
    fn default() -> Self {
        ActBlockK {
            qs: [0; QK_K],
            d: 0.0,
            bsum16: [0; QK_K / 16],
            bsum32: [0; QK_K / 32],
        }
    }
}

/// Rounds to the nearest integer, ties to even, for |v| < 2^22 (here |v| <= 127): adding
/// and removing 1.5 * 2^23 leaves no fraction bits, so the addition itself rounds. The same
/// trick as ggml's `nearest_int`; unlike `f32::round_ties_even` it needs no SSE4.1 or libm
/// call on baseline x86-64, so the loop vectorizes.
#[inline]
fn nearest_int(v: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    ((v + MAGIC) - MAGIC) as i32
}

/// Quantizes one block of 256 values.
pub(crate) fn quantize_block(x: &[f32], out: &mut ActBlockK) {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in &x[..QK_K] {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        *out = ActBlockK::default();
        return;
    }
    let iscale = -127.0 / max;
    for (q, &v) in out.qs.iter_mut().zip(x) {
        *q = nearest_int(iscale * v).clamp(-128, 127) as i8;
    }
    for (j, s) in out.bsum16.iter_mut().enumerate() {
        *s = out.qs[16 * j..16 * j + 16].iter().map(|&q| q as i16).sum();
    }
    for (j, s) in out.bsum32.iter_mut().enumerate() {
        *s = out.bsum16[2 * j] + out.bsum16[2 * j + 1];
    }
    out.d = 1.0 / iscale;
}

/// Quantizes `x` (a whole number of 256-blocks) into `out`; no-op if the lengths disagree.
pub(crate) fn quantize(x: &[f32], out: &mut [ActBlockK]) {
    if x.len() != out.len() * QK_K {
        return;
    }
    for (xs, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        quantize_block(xs, b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        for (v, want) in [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (126.6, 127),
        ] {
            assert_eq!(nearest_int(v), want, "{v}");
        }
        for i in -12_700..12_700 {
            let v = i as f32 * 0.01;
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
        }
    }

    #[test]
    fn largest_magnitude_maps_to_minus_127_and_sums_add_up() {
        let x: Vec<f32> = (0..QK_K).map(|i| (i as f32 - 100.0) * 0.01).collect();
        let mut b = ActBlockK::default();
        quantize_block(&x, &mut b);
        assert_eq!(b.qs[QK_K - 1], -127); // x = 1.55 is the largest magnitude
        assert!((b.d - 1.55 / -127.0).abs() < 1e-7);
        assert_eq!(
            b.bsum16[3],
            b.qs[48..64].iter().map(|&q| q as i16).sum::<i16>()
        );
        assert_eq!(b.bsum32[1], b.bsum16[2] + b.bsum16[3]);
        let mut z = ActBlockK::default();
        quantize_block(&[0.0; QK_K], &mut z);
        assert_eq!(z, ActBlockK::default());
    }
}
