//! Activation quantization: f32 rows to 8-bit blocks of 32 (ggml's Q8_0 / Q8_1), the form the
//! integer dot products consume.
//!
//! Per block, exactly as ggml's reference `quantize_row_q8_0` / `quantize_row_q8_1`:
//! `amax = max |x|`, `d = amax / 127`, `q = round(x / d)` (computed as `x * (1/d)`, rounding
//! half away from zero, `q = 0` when `d = 0`), `d` stored as f16; Q8_1 also stores
//! `s = f16(d * sum(q))` with the unrounded `d`. The AVX2 and AVX-512 paths produce
//! bit-identical blocks.

use crate::cpu::Simd;
use crate::format::QK;
use half::f16;

/// One quantized block of activations, with everything any weight format needs.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub(crate) struct ActBlock {
    /// The 32 quants, each in -127..=127.
    pub qs: [i8; QK],
    /// The scale after its round trip through f16 (what ggml's block holds).
    pub d: f32,
    /// Q8_1's `s`: `f16(d * sum(qs))` as f32 (used against Q4_1's per-block minimum).
    pub s: f32,
    /// `sum(qs)`, exact (used against Q4_0's offset of 8).
    pub sum: i32,
}

impl Default for ActBlock {
    fn default() -> Self {
        ActBlock {
            qs: [0; QK],
            d: 0.0,
            s: 0.0,
            sum: 0,
        }
    }
}

/// The scale and its inverse for a block whose largest magnitude is `amax`.
#[inline]
fn scale_of(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    (d, id)
}

#[inline]
fn finish(block: &mut ActBlock, d: f32, sum: i32) {
    block.d = f16::from_f32(d).to_f32();
    block.s = f16::from_f32(sum as f32 * d).to_f32();
    block.sum = sum;
}

/// Quantizes one block of 32 values, portable code.
pub(crate) fn quantize_block_scalar(x: &[f32], block: &mut ActBlock) {
    let amax = x[..QK].iter().fold(0.0f32, |a, &v| a.max(v.abs()));
    let (d, id) = scale_of(amax);
    let mut sum = 0i32;
    for (q, &v) in block.qs.iter_mut().zip(x) {
        // `as` saturates (and maps NaN to 0): no overflow is possible for finite input.
        *q = (v * id).round() as i8;
        sum += *q as i32;
    }
    finish(block, d, sum);
}

/// Quantizes `x` (a whole number of blocks) into `out` (`x.len() / 32` blocks).
/// Returns without writing if the lengths disagree (callers size them; never panics).
pub(crate) fn quantize(simd: Simd, x: &[f32], out: &mut [ActBlock]) {
    if x.len() != out.len() * QK {
        return;
    }
    match simd {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 | Simd::Avx2Vnni => {
            // SAFETY: the AVX2 paths are only chosen after runtime detection of AVX2, FMA and
            // F16C, and the lengths were checked just above.
            unsafe { avx2::quantize(x, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 => {
            // SAFETY: `Simd::Avx512` is only chosen after runtime detection of AVX-512
            // F/BW/VL (and AVX2, FMA, F16C), and the lengths were checked just above.
            unsafe { avx512::quantize(x, out) }
        }
        _ => {
            for (xs, block) in x.chunks_exact(QK).zip(out.iter_mut()) {
                quantize_block_scalar(xs, block);
            }
        }
    }
}

/// [`finish`] with F16C's conversions (round to nearest even, as the `half` crate, whose
/// calls per value had been a third of a block's quantization on the AVX-512 path).
///
/// # Safety
/// The CPU must support AVX and F16C.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx,f16c")]
unsafe fn finish_f16c(block: &mut ActBlock, d: f32, sum: i32) {
    use std::arch::x86_64::*;
    let v = _mm_setr_ps(d, sum as f32 * d, 0.0, 0.0);
    let r = _mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
    block.d = _mm_cvtss_f32(r);
    block.s = _mm_cvtss_f32(_mm_movehdup_ps(r));
    block.sum = sum;
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{finish_f16c, scale_of, ActBlock};
    use crate::format::QK;
    use std::arch::x86_64::*;

    /// Rounds each lane to the nearest integer, halves away from zero (like `f32::round`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn round_half_away(v: __m256) -> __m256 {
        let sign = _mm256_set1_ps(-0.0);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        // v - trunc(v) is exact for |v| < 2^23.
        let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(v, t));
        let up = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
        let step = _mm256_or_ps(_mm256_and_ps(v, sign), _mm256_set1_ps(1.0));
        _mm256_add_ps(t, _mm256_and_ps(up, step))
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C, and `x.len() == out.len() * 32`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize(x: &[f32], out: &mut [ActBlock]) {
        for (xs, block) in x.chunks_exact(QK).zip(out.iter_mut()) {
            // SAFETY: `xs` has exactly 32 f32 (four unaligned 8-lane loads) and `block.qs`
            // has exactly 32 bytes (one unaligned 32-byte store); the features are enabled.
            unsafe {
                let p = xs.as_ptr();
                let sign = _mm256_set1_ps(-0.0);
                let v = [
                    _mm256_loadu_ps(p),
                    _mm256_loadu_ps(p.add(8)),
                    _mm256_loadu_ps(p.add(16)),
                    _mm256_loadu_ps(p.add(24)),
                ];
                let m01 = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
                let m23 = _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]));
                let m = _mm256_max_ps(m01, m23);
                let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
                let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
                let m = _mm_max_ss(m, _mm_movehdup_ps(m));
                let (d, id) = scale_of(_mm_cvtss_f32(m));
                let vid = _mm256_set1_ps(id);
                let mut q = [_mm256_setzero_si256(); 4];
                for (qk, &vk) in q.iter_mut().zip(&v) {
                    *qk = _mm256_cvtps_epi32(round_half_away(_mm256_mul_ps(vk, vid)));
                }
                // Sum of the 32 quants.
                let s =
                    _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
                let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
                let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s));
                let sum = _mm_cvtsi128_si32(s);
                // Narrow to bytes; the packs interleave 128-bit lanes, the permute restores order.
                let q01 = _mm256_packs_epi32(q[0], q[1]);
                let q23 = _mm256_packs_epi32(q[2], q[3]);
                let q8 = _mm256_packs_epi16(q01, q23);
                let q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256(block.qs.as_mut_ptr() as *mut __m256i, q8);
                finish_f16c(block, d, sum);
            }
        }
    }
}

/// AVX-512: a block is two registers, the same operations as `avx2` on 16 lanes.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{finish_f16c, scale_of, ActBlock};
    use crate::format::QK;
    use std::arch::x86_64::*;

    /// Rounds each lane to the nearest integer, halves away from zero (like `f32::round`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn round_half_away(v: __m512) -> __m512 {
        let sign = _mm512_set1_epi32(i32::MIN);
        let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        // v - trunc(v) is exact for |v| < 2^23.
        let frac = _mm512_abs_ps(_mm512_sub_ps(v, t));
        let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5));
        // +-1 with v's sign.
        let step = _mm512_or_si512(
            _mm512_and_si512(_mm512_castps_si512(v), sign),
            _mm512_castps_si512(_mm512_set1_ps(1.0)),
        );
        _mm512_mask_add_ps(t, up, t, _mm512_castsi512_ps(step))
    }

    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL (and AVX2, FMA, F16C), and `x.len() ==
    /// out.len() * 32`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn quantize(x: &[f32], out: &mut [ActBlock]) {
        for (xs, block) in x.chunks_exact(QK).zip(out.iter_mut()) {
            // SAFETY: `xs` has exactly 32 f32 (two unaligned 16-lane loads) and `block.qs`
            // exactly 32 bytes (two unaligned 16-byte stores); the features are enabled.
            unsafe {
                let p = xs.as_ptr();
                let v = [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))];
                let m = _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1]));
                let (d, id) = scale_of(_mm512_reduce_max_ps(m));
                let vid = _mm512_set1_ps(id);
                let q = v.map(|vk| _mm512_cvtps_epi32(round_half_away(_mm512_mul_ps(vk, vid))));
                let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
                // Narrow to bytes (each quant is within -127..=127: no saturation happens).
                let qs = block.qs.as_mut_ptr() as *mut __m128i;
                _mm_storeu_si128(qs, _mm512_cvtsepi32_epi8(q[0]));
                _mm_storeu_si128(qs.add(1), _mm512_cvtsepi32_epi8(q[1]));
                finish_f16c(block, d, sum);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(seed: u32, len: usize) -> Vec<f32> {
        tp_testkit::Rng::new(u64::from(seed)).uniform_vec(len, -3.0, 3.0)
    }

    #[test]
    fn scalar_block_matches_the_reference_formula() {
        let x = values(1, QK);
        let mut b = ActBlock::default();
        quantize_block_scalar(&x, &mut b);
        let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        assert_eq!(b.d, f16::from_f32(amax / 127.0).to_f32());
        assert_eq!(b.sum, b.qs.iter().map(|&q| q as i32).sum::<i32>());
        assert!(b.qs.iter().any(|&q| q == 127 || q == -127));
    }

    #[test]
    fn zero_block_quantizes_to_zero() {
        let mut b = ActBlock::default();
        quantize_block_scalar(&[0.0; QK], &mut b);
        assert_eq!(b, ActBlock::default());
    }

    #[test]
    fn halves_round_away_from_zero() {
        // amax 127 gives d = 1, so x * id keeps the .5 exactly.
        let mut x = [0.0f32; QK];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = 0.5;
        x[4] = -0.49999997;
        let mut b = ActBlock::default();
        quantize_block_scalar(&x, &mut b);
        assert_eq!(&b.qs[..5], &[127, 3, -3, 1, 0]);
        #[cfg(target_arch = "x86_64")]
        for simd in [Simd::Avx2, Simd::Avx512] {
            if crate::cpu::supports(simd) {
                let mut v = [ActBlock::default()];
                quantize(simd, &x, &mut v);
                assert_eq!(v[0], b, "{simd:?}");
            }
        }
    }

    #[test]
    fn simd_quantization_is_bit_identical_to_scalar() {
        #[cfg(target_arch = "x86_64")]
        for simd in [Simd::Avx2, Simd::Avx512]
            .into_iter()
            .filter(|&s| crate::cpu::supports(s))
        {
            for seed in 0..50 {
                let mut x = values(seed, QK * 7);
                x[5] *= 1000.0; // one large outlier block
                x[40] = 0.0;
                x[64..96].fill(0.0); // an all-zero block
                let mut a = vec![ActBlock::default(); 7];
                let mut s = vec![ActBlock::default(); 7];
                quantize(simd, &x, &mut a);
                quantize(Simd::Scalar, &x, &mut s);
                assert_eq!(a, s, "{simd:?}");
            }
        }
    }

    #[test]
    fn f16c_finish_rounds_as_the_half_crate() {
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::supports(Simd::Avx2) {
            // Scales from f16's subnormals to past its largest value, and sums of both signs.
            let mut bits = 0x2F00_0000u32;
            while bits < 0x4800_0000 {
                let d = f32::from_bits(bits);
                for sum in [-4064, -127, -1, 0, 1, 3, 127, 4064] {
                    let (mut a, mut b) = (ActBlock::default(), ActBlock::default());
                    finish(&mut a, d, sum);
                    // SAFETY: AVX2 (and so AVX and F16C, see `cpu`) was detected just above.
                    unsafe { finish_f16c(&mut b, d, sum) };
                    assert_eq!(
                        (a.d.to_bits(), a.s.to_bits()),
                        (b.d.to_bits(), b.s.to_bits()),
                        "d {d:e} sum {sum}"
                    );
                }
                bits += 0x1357;
            }
        }
    }
}
