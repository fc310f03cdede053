//! Activation quantization for the K-quants: f32 rows to ggml's Q8_K blocks of 256 (one f32
//! scale per block, plus sums of each 16 and each 32 quants), as ggml's reference
//! `quantize_row_q8_K`: `max` = the value of largest magnitude, `iscale = -127 / max`,
//! `q = nearest(iscale * x)` (ties to even, like ggml's `nearest_int`), `d = 1 / iscale`.
//! Portable code, and the same steps on AVX2 for whole blocks (the search for the largest
//! magnitude and the rounding in 8 lanes, same bits: it was 8% of a Qwen2.5 prefill).
//!
//! The sub-block form ([`quantize_sub`], for matrices whose tensor-parallel shards cut
//! super-blocks) quantizes each 32 values on their own in the same way (`ds`, one scale per
//! 32), so a 32-wide sub-block's quants depend on its own 32 values only, whichever rank
//! holds them; sub-blocks outside the matrix's columns are zero.

use crate::cpu::Simd;
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
pub(crate) fn quantize(simd: Simd, x: &[f32], out: &mut [ActBlockK]) {
    if x.len() != out.len() * QK_K {
        return;
    }
    for (xs, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        match simd {
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 | Simd::Avx2Vnni | Simd::Avx512 => {
                *b = ActBlockK::default();
                // SAFETY: the AVX2 paths and `Simd::Avx512` are only chosen after runtime
                // detection of AVX2 (and FMA, F16C); `xs` and `b.qs` hold 256 each.
                b.d = unsafe { avx2::quantize_run(xs, &mut b.qs) };
                fill_sums(b);
            }
            _ => quantize_block(xs, b),
        }
    }
}

/// [`quantize_run`] on AVX2, for whole 256-blocks.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::format::QK_K;
    use std::arch::x86_64::*;

    /// [`super::quantize_run`] of the 256 values of `x` into `qs`: the same scale and quants.
    ///
    /// # Safety
    /// The CPU must support AVX2; `x` and `qs` must hold at least 256 values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_run(x: &[f32], qs: &mut [i8]) -> f32 {
        const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23, as in `nearest_int`
        debug_assert!(x.len() >= QK_K && qs.len() >= QK_K);
        let p = x.as_ptr();
        let sign = _mm256_set1_ps(-0.0);
        // SAFETY (every block below): 32 unaligned 8-lane loads of `x`'s first 256 values and
        // 8 unaligned 32-byte stores into `qs`'s first 256 bytes; AVX2 is enabled.
        // The largest magnitude: `max(|v|, acc)` returns `acc` for a NaN `|v|`, so NaNs are
        // skipped as the scalar `|v| > amax` skips them.
        let mut acc = _mm256_setzero_ps();
        for i in 0..QK_K / 8 {
            let v = unsafe { _mm256_loadu_ps(p.add(8 * i)) };
            acc = _mm256_max_ps(_mm256_andnot_ps(sign, v), acc);
        }
        let mut lanes = [0f32; 8];
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        let amax = lanes.iter().fold(0f32, |m, &v| m.max(v));
        if amax == 0.0 {
            qs[..QK_K].fill(0);
            return 0.0;
        }
        // The first value of that magnitude (ggml keeps the first).
        let want = _mm256_set1_ps(amax);
        let mut max = amax;
        for i in 0..QK_K / 8 {
            let v = unsafe { _mm256_loadu_ps(p.add(8 * i)) };
            let hit =
                _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, v), want));
            if hit != 0 {
                max = x[8 * i + hit.trailing_zeros() as usize];
                break;
            }
        }
        let iscale = -127.0 / max;
        let (vs, magic) = (_mm256_set1_ps(iscale), _mm256_set1_ps(MAGIC));
        // Each 32 values: four 8-lane roundings, packed to bytes in order.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let q = qs.as_mut_ptr();
        for j in 0..QK_K / 32 {
            let mut r = [_mm256_setzero_si256(); 4];
            for (k, r) in r.iter_mut().enumerate() {
                let v = unsafe { _mm256_loadu_ps(p.add(32 * j + 8 * k)) };
                // `(iscale * v + MAGIC) - MAGIC`, then exact to i32; a NaN (from a NaN or
                // infinite input) becomes 0 as Rust's `as i32` makes it.
                let t = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(vs, v), magic), magic);
                let t = _mm256_and_ps(t, _mm256_cmp_ps::<_CMP_ORD_Q>(t, t));
                *r = _mm256_cvttps_epi32(t);
            }
            // Saturating packs clamp to [-128, 127] like the scalar `clamp`; the packs work
            // within 128-bit halves, the permute restores the order.
            let ab = _mm256_packs_epi32(r[0], r[1]);
            let cd = _mm256_packs_epi32(r[2], r[3]);
            let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order);
            unsafe { _mm256_storeu_si256(q.add(32 * j).cast(), bytes) };
        }
        1.0 / iscale
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
    fn every_path_quantizes_to_the_scalar_bits() {
        // Random blocks at many scales, plus ties of opposite signs, NaNs, infinities,
        // subnormals, all-zero and single-value blocks.
        let mut rng = tp_testkit::Rng::new(0x9e37_79b9_7f4a_7c15);
        let mut next = move || rng.uniform(-0.5, 0.5);
        let mut x = Vec::new();
        for case in 0..64 {
            let scale = [1e-30, 1e-3, 1.0, 37.0, 1e30][case % 5];
            let mut b: Vec<f32> = (0..QK_K).map(|_| next() * scale).collect();
            match case % 8 {
                1 => (b[3], b[5], b[200]) = (-2.0 * scale, 2.0 * scale, 2.0 * scale),
                2 => b[17] = f32::NAN,
                3 => b[99] = f32::INFINITY,
                4 => b.iter_mut().for_each(|v| *v = 0.0),
                5 => b.iter_mut().for_each(|v| *v = 1e-45),
                6 => (b.iter_mut().for_each(|v| *v = 0.0), b[255] = -3.5).0,
                _ => {}
            }
            x.extend(b);
        }
        let n = x.len() / QK_K;
        let mut want = vec![ActBlockK::default(); n];
        quantize(Simd::Scalar, &x, &mut want);
        for simd in crate::cpu::available() {
            let mut got = vec![ActBlockK::default(); n];
            quantize(simd, &x, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.qs, w.qs, "{simd:?} block {i} quants");
                assert_eq!(g.d.to_bits(), w.d.to_bits(), "{simd:?} block {i} scale");
                assert_eq!(
                    (g.bsum16, g.bsum32),
                    (w.bsum16, w.bsum32),
                    "{simd:?} block {i}"
                );
            }
        }
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
