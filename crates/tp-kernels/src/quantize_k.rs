//! Activation quantization for the K-quants: f32 rows to ggml's Q8_K blocks of 256 (one f32
//! scale per block, plus sums of each 16 and each 32 quants), as ggml's reference
//! `quantize_row_q8_K`: `max` = the value of largest magnitude, `iscale = -127 / max`,
//! `q = nearest(iscale * x)` (ties to even, like ggml's `nearest_int`), `d = 1 / iscale`.
//! Portable code only: it is O(cols) per token against the matmul's O(rows * cols).
//!
//! The sub-block form ([`quantize_sub`], for matrices whose tensor-parallel shards cut
//! super-blocks) quantizes each 32 values on their own in the same way (`ds`, one scale per
//! 32), so a 32-wide sub-block's quants depend on its own 32 values only, whichever rank
//! holds them; sub-blocks outside the matrix's columns are zero.

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
    /// Sub-block form only: the scale of each 32 quants (`d` is then unused).
    pub ds: [f32; QK_K / 32],
}

impl Default for ActBlockK {
    fn default() -> Self {
        ActBlockK {
            qs: [0; QK_K],
            d: 0.0,
            bsum16: [0; QK_K / 16],
            bsum32: [0; QK_K / 32],
            ds: [0.0; QK_K / 32],
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

/// Quantizes `x` into `qs` (same length) with one scale, returned (0 for all-zero `x`).
fn quantize_run(x: &[f32], qs: &mut [i8]) -> f32 {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        qs.fill(0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = nearest_int(iscale * v).clamp(-128, 127) as i8;
    }
    1.0 / iscale
}

/// Fills the block sums from the quants.
fn fill_sums(out: &mut ActBlockK) {
    for (j, s) in out.bsum16.iter_mut().enumerate() {
        *s = out.qs[16 * j..16 * j + 16].iter().map(|&q| q as i16).sum();
    }
    for (j, s) in out.bsum32.iter_mut().enumerate() {
        *s = out.bsum16[2 * j] + out.bsum16[2 * j + 1];
    }
}

/// Quantizes one block of 256 values.
pub(crate) fn quantize_block(x: &[f32], out: &mut ActBlockK) {
    *out = ActBlockK::default();
    out.d = quantize_run(&x[..QK_K], &mut out.qs);
    fill_sums(out);
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

/// The sub-block form: `x` is `[n, cols]` (`cols` a multiple of 32), laid out in `out` as
/// `n` tokens of `out.len() / n` blocks with `lead` zero columns first (`lead` a multiple of
/// 32 below 256) and zeros after the last column; each 32 columns get their own scale
/// (`ds`). No-op if the lengths disagree.
pub(crate) fn quantize_sub(x: &[f32], n: usize, cols: usize, lead: usize, out: &mut [ActBlockK]) {
    const SUB: usize = QK_K / 8;
    let nb = out.len().checked_div(n).unwrap_or(0);
    if x.len() != n * cols || out.len() != n * nb || lead + cols > nb * QK_K {
        return;
    }
    for (xt, blocks) in x
        .chunks_exact(cols.max(1))
        .zip(out.chunks_exact_mut(nb.max(1)))
    {
        for (b, blk) in blocks.iter_mut().enumerate() {
            *blk = ActBlockK::default();
            for j in 0..QK_K / SUB {
                let at = (b * QK_K + j * SUB).checked_sub(lead);
                if let Some(xs) = at.and_then(|c| xt.get(c..c + SUB)) {
                    blk.ds[j] = quantize_run(xs, &mut blk.qs[j * SUB..(j + 1) * SUB]);
                }
            }
            fill_sums(blk);
        }
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

    #[test]
    fn sub_blocks_quantize_on_their_own_and_padding_is_zero() {
        let cols = 256;
        let x: Vec<f32> = (0..2 * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.03)
            .collect();
        let mut out = vec![ActBlockK::default(); 4];
        quantize_sub(&x, 2, cols, 128, &mut out);
        for t in 0..2 {
            let (b0, b1) = (&out[2 * t], &out[2 * t + 1]);
            assert!(b0.qs[..128].iter().all(|&q| q == 0) && b0.ds[..4] == [0.0; 4]);
            for j in 0..8 {
                // Padded column 128 + 32 j' is column 32 j' of the token.
                let (blk, sub) = if j < 4 { (b0, j + 4) } else { (b1, j - 4) };
                let mut alone = [0i8; 32];
                let c = t * cols + 32 * j;
                let d = quantize_run(&x[c..c + 32], &mut alone);
                assert_eq!(blk.ds[sub], d);
                assert_eq!(&blk.qs[32 * sub..32 * sub + 32], &alone[..]);
                let sum: i16 = alone.iter().map(|&q| q as i16).sum();
                assert_eq!(blk.bsum32[sub], sum);
            }
            assert!(b1.qs[128..].iter().all(|&q| q == 0) && b1.ds[4..] == [0.0; 4]);
        }
    }
}
