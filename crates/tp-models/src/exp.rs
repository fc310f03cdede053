//! `exp` from multiplies, adds and bit operations only ([`exp_det`]), with AVX2 and AVX-512
//! forms that compute the same bits lane by lane (libm's `expf` has no vector form that
//! matches it): what attention's softmax and the SiLU activation exponentiate with.

// exp_det's constants (Cody-Waite reduction by ln 2, then Cephes' expf polynomial).
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// 1.5 * 2^23: adding it rounds to an integer (to nearest, ties to even).
const MAGIC: f32 = 12_582_912.0;
/// ln 2 in two parts; the first has 9 significant bits, so `n * LN2_HI` is exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5, // Cephes: 5.0000001201e-1, which is 0.5 in f32
];
/// Below this, `exp_det` is 0 (e^-87 = 1.6e-38: nothing beside a softmax's largest term, 1).
const EXP_MIN: f32 = -87.0;

/// `e^x` for `x <= 0` within 2 ulp (0 below -87; NaN stays NaN), from multiplies, adds and
/// integer operations on the bits only, so that the vector paths compute the same bits.
#[inline(always)]
pub(crate) fn exp_det(x: f32) -> f32 {
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC; // round(x / ln 2)
    let r = x - n * LN2_HI;
    let r = r - n * LN2_LO;
    let z = r * r;
    let mut y = EXP_P[0];
    for &c in &EXP_P[1..] {
        y = y * r + c;
    }
    let y = y * z + r + 1.0;
    // 2^n from the integer in t's low bits.
    let bits = ((t.to_bits() as i32)
        .wrapping_sub(MAGIC.to_bits() as i32)
        .wrapping_add(127) as u32)
        << 23;
    let e = y * f32::from_bits(bits);
    if x < EXP_MIN {
        0.0
    } else {
        e
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! [`exp_det`](super::exp_det) in vector lanes: the same operations in the same order.

    use super::{EXP_MIN, EXP_P, LN2_HI, LN2_LO, LOG2E, MAGIC};
    use std::arch::x86_64::*;

    /// `exp_det` in 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn exp16(x: __m512) -> __m512 {
        let t = _mm512_add_ps(
            _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
            _mm512_set1_ps(MAGIC),
        );
        let n = _mm512_sub_ps(t, _mm512_set1_ps(MAGIC));
        let r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI)));
        let r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)));
        let z = _mm512_mul_ps(r, r);
        let mut y = _mm512_set1_ps(EXP_P[0]);
        for &c in &EXP_P[1..] {
            y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(c));
        }
        let y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(y, z), r), _mm512_set1_ps(1.0));
        let k = _mm512_sub_epi32(
            _mm512_castps_si512(t),
            _mm512_set1_epi32(MAGIC.to_bits() as i32),
        );
        let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(k, _mm512_set1_epi32(127)));
        let e = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
        let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_MIN));
        _mm512_maskz_mov_ps(!below, e)
    }

    /// `exp_det` in 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn exp8(x: __m256) -> __m256 {
        let t = _mm256_add_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
            _mm256_set1_ps(MAGIC),
        );
        let n = _mm256_sub_ps(t, _mm256_set1_ps(MAGIC));
        let r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI)));
        let r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
        let z = _mm256_mul_ps(r, r);
        let mut y = _mm256_set1_ps(EXP_P[0]);
        for &c in &EXP_P[1..] {
            y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), r), _mm256_set1_ps(1.0));
        let k = _mm256_sub_epi32(
            _mm256_castps_si256(t),
            _mm256_set1_epi32(MAGIC.to_bits() as i32),
        );
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(k, _mm256_set1_epi32(127)));
        let e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
        let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_MIN));
        _mm256_andnot_ps(below, e)
    }
}

#[cfg(test)]
mod tests;
