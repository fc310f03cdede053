//! AVX-512 VNNI many-token kernels for Q6_K (`gemm_avx512`'s scheme on Q8_K activations):
//! 16 tokens in the lanes, a row's 4-column weight word broadcast from memory. The
//! `TokenLanes` impl for Q8_K activations also dispatches Q4_K and Q5_K to `gemm_avx512_k4`,
//! Q2_K and Q3_K to `gemm_avx512_k23` (which share this module's activation layout), and
//! runs IQ4_XS, unpacked by `gemm_avx512_iq4xs` into Q6_K's layout, on Q6_K's kernel with
//! 32-wide sub-blocks and an offset of 128.
//!
//! Per row and super-block, each 16-wide sub-block's exact `vpdpbusd` sum of the unsigned
//! 6-bit quants is multiplied by its signed scale (`vpmulld`) and added up; the offset of 32
//! is `32 * Σ sc · bsum16`, formed by `vpdpwssd` on i16 pairs (scales, activation sums) and
//! subtracted: the same exact integer as the AVX2 kernels' `offset_tail`, whose f32 tail
//! (`scale = d_w * d_x`, `fma(isum as f32, scale, acc)`, or the wide form's
//! `isum as f32 * scale` summed in f64) is repeated per lane. Rows run in two halves of 4 so
//! that the wide form's accumulators stay in registers; [`halves`], the chunk loop and that
//! tail, is shared by all the Q8_K many-token kernels (each gives a super-block's factors).
//!
//! Layouts (64-byte vectors):
//! - Tokens, per chunk and super-block, [`ACT_VECS`] vectors: words `K < 64` (lane `t` =
//!   token `t`'s quants `4K..4K + 4`), the tokens' `d` (f32), then for each pair `p < 8` of
//!   16-wide sub-blocks their `bsum16` as two i16 in one 32-bit lane.
//! - Weights, per group super-block, [`W_VECS`] vectors: the quants (0..=63) of word `K` of row
//!   `r` at 32-bit index `8K + r`; the scales as i32 at `512 + 8s + r`; the scale pairs as
//!   two i16 at `640 + 8p + r`; the rows' `d` as f32 at `704 + r`.

use crate::expand::Expanded;
use crate::format::{f16_at, QuantType};
use crate::gemm_avx512::{ChunkOut, TokenLanes, LANES};
use crate::gemm_avx512_iq4xs as iq4xs;
use crate::gemm_avx512_k23 as k23;
use crate::gemm_avx512_k4 as k4;
use crate::pack::{group_block_bytes, GROUP_ROWS};
use crate::pack_k::q6k;
use crate::quantize_k::ActBlockK;
use crate::tile::Form;
use std::arch::x86_64::*;

/// Vectors per (chunk, super-block) of transposed activations: 64 words, `d`, 8 sum pairs.
pub(crate) const ACT_VECS: usize = 73;
/// Vectors per unpacked group super-block: 32 of quants, 8 of scales, 4 of scale pairs, 1 of `d`.
pub(crate) const W_VECS: usize = 45;
/// 32-bit offsets inside an unpacked group super-block.
pub(crate) const SC: usize = 512;
pub(crate) const SC_PAIRS: usize = 640;
pub(crate) const D: usize = 704;

impl TokenLanes for ActBlockK {
    fn supports(qtype: QuantType, form: Form) -> bool {
        use QuantType::*;
        matches!(qtype, Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS) && form != Form::WideSub
    }
    fn act_vecs(qtype: QuantType) -> usize {
        match qtype {
            QuantType::Q4_K | QuantType::Q5_K => k4::ACT_VECS,
            _ => ACT_VECS,
        }
    }
    fn w_vecs(qtype: QuantType) -> usize {
        match qtype {
            QuantType::Q4_K | QuantType::Q5_K => k4::W_VECS,
            QuantType::Q2_K | QuantType::Q3_K => k23::W_VECS,
            _ => W_VECS,
        }
    }
    fn transpose(qtype: QuantType, acts: &[Self], nb: usize, out: &mut [Expanded]) {
        if matches!(qtype, QuantType::Q4_K | QuantType::Q5_K) {
            return k4::transpose(acts, nb, out);
        }
        let tokens = acts.len() / nb.max(1);
        for (b, o) in out.chunks_exact_mut(ACT_VECS).enumerate().take(nb) {
            o.fill(Expanded::default());
            for t in 0..tokens.min(LANES) {
                let a = &acts[t * nb + b];
                for (k, v) in o.iter_mut().enumerate().take(64) {
                    let q = &a.qs[4 * k..4 * k + 4];
                    v.0[t] = i32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8]);
                }
                o[64].0[t] = a.d.to_bits() as i32;
                for p in 0..8 {
                    let (lo, hi) = (a.bsum16[2 * p] as u16, a.bsum16[2 * p + 1] as u16);
                    o[65 + p].0[t] = (lo as u32 | (hi as u32) << 16) as i32;
                }
            }
        }
    }
    unsafe fn unpack(qtype: QuantType, group: &[u8], nb: usize, out: &mut [Expanded]) {
        // SAFETY: the caller's promise (features, `nb` group super-blocks of `qtype`, `out`
        // length `nb * w_vecs(qtype)`).
        unsafe {
            match qtype {
                QuantType::Q4_K => k4::unpack::<false>(group, nb, out),
                QuantType::Q5_K => k4::unpack::<true>(group, nb, out),
                QuantType::Q2_K => k23::unpack::<false>(group, nb, out),
                QuantType::Q3_K => k23::unpack::<true>(group, nb, out),
                QuantType::IQ4_XS => iq4xs::unpack(group, nb, out),
                _ => unpack_q6k(group, nb, out),
            }
        }
    }
    unsafe fn group_chunk(
        qtype: QuantType,
        w: &[Expanded],
        x: &[Expanded],
        nb: usize,
        wide: bool,
        out: &mut ChunkOut,
    ) {
        // SAFETY: the caller's promise.
        unsafe {
            if matches!(qtype, QuantType::Q4_K | QuantType::Q5_K) {
                return k4::group_chunk(w, x, nb, wide, out);
            }
            if matches!(qtype, QuantType::Q2_K | QuantType::Q3_K) {
                return k23::group_chunk(qtype, w, x, nb, wide, out);
            }
            if qtype == QuantType::IQ4_XS {
                return group_chunk_scaled::<8, 7>(w, x, nb, wide, out);
            }
            group_chunk_scaled::<16, 5>(w, x, nb, wide, out);
        }
    }
}

/// Unpacks `nb` Q6_K group super-blocks (see the module comment).
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `group.len() >= nb * group_block_bytes(Q6_K)`,
/// `out.len() >= nb * W_VECS`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_q6k(group: &[u8], nb: usize, out: &mut [Expanded]) {
    let gb = group_block_bytes(QuantType::Q6_K);
    let m4 = _mm256_set1_epi8(0x0F);
    let m3 = _mm256_set1_epi8(3);
    for b in 0..nb {
        let blk = &group[b * gb..(b + 1) * gb];
        let dst = &mut out[b * W_VECS..(b + 1) * W_VECS];
        let words = dst.as_mut_ptr() as *mut u8;
        // SAFETY: each triple's 96 bytes lie inside `blk` (`q6k::triple` < BYTES); each
        // 32-byte store at word `K < 64` lies inside the first 32 vectors of `dst`.
        unsafe {
            let ld = |off: usize| _mm256_loadu_si256(blk.as_ptr().add(off) as *const __m256i);
            let st =
                |k: usize, v: __m256i| _mm256_storeu_si256(words.add(32 * k) as *mut __m256i, v);
            let high = |h: __m256i| _mm256_slli_epi16::<4>(_mm256_and_si256(h, m3));
            for h in 0..2 {
                for i in 0..8 {
                    let t = q6k::triple(h, i);
                    let (a, bq, hb) = (ld(t), ld(t + 32), ld(t + 64));
                    let lo = |v: __m256i| _mm256_and_si256(v, m4);
                    let hi = |v: __m256i| _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                    st(32 * h + i, _mm256_or_si256(lo(a), high(hb)));
                    st(
                        32 * h + 8 + i,
                        _mm256_or_si256(lo(bq), high(_mm256_srli_epi16::<2>(hb))),
                    );
                    st(
                        32 * h + 16 + i,
                        _mm256_or_si256(hi(a), high(_mm256_srli_epi16::<4>(hb))),
                    );
                    st(
                        32 * h + 24 + i,
                        _mm256_or_si256(hi(bq), high(_mm256_srli_epi16::<6>(hb))),
                    );
                }
            }
        }
        let ints = |v: &mut [Expanded], at: usize, value: i32| v[at / 16].0[at % 16] = value;
        for r in 0..GROUP_ROWS {
            let sc = |s: usize| blk[q6k::SC + ((s / 2) * GROUP_ROWS + r) * 2 + s % 2] as i8;
            for s in 0..16 {
                ints(dst, SC + 8 * s + r, sc(s) as i32);
            }
            for p in 0..8 {
                let (lo, hi) = (sc(2 * p) as i16 as u16, sc(2 * p + 1) as i16 as u16);
                ints(
                    dst,
                    SC_PAIRS + 8 * p + r,
                    (lo as u32 | (hi as u32) << 16) as i32,
                );
            }
            ints(dst, D + r, f16_at(blk, q6k::D + 2 * r).to_bits() as i32);
        }
        for at in D + GROUP_ROWS..D + 16 {
            ints(dst, at, 0);
        }
    }
}

/// One unpacked group in Q6_K's layout (`w`) against one chunk of 16 transposed tokens (`x`)
/// over `nb` super-blocks, into `out.f32s` or (`wide`) `out.f64s`: [`block_scaled`] with
/// `SUBS` sub-blocks per super-block and an offset of `1 << SHIFT` (Q6_K: 16 and 5; IQ4_XS,
/// unpacked by `gemm_avx512_iq4xs`: 8 and 7).
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `w.len() >= nb * W_VECS`,
/// `x.len() >= nb * ACT_VECS`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn group_chunk_scaled<const SUBS: usize, const SHIFT: u32>(
    w: &[Expanded],
    x: &[Expanded],
    nb: usize,
    wide: bool,
    out: &mut ChunkOut,
) {
    let (w, x) = (w.as_ptr(), x.as_ptr());
    // SAFETY: `halves` asks only for super-blocks `b < nb` and `r0` 0 or 4, whose vectors lie
    // inside the caller's `w` and `x`; the features are the caller's promise.
    halves(nb, wide, out, |b, r0| unsafe {
        block_scaled::<SUBS, SHIFT>(w, x, b, r0)
    });
}

/// One super-block's f32 contributions to 4 rows' 16 token outputs, as factors: row `r`'s
/// contribution is `f[r][0] * f[r][1]`, the AVX2 tail's last product in its operand order.
pub(crate) type Factors = [[__m512; 2]; 4];

/// The chunk loop and tail shared by the Q8_K many-token kernels (Q6_K here, `gemm_avx512_k4`,
/// `gemm_avx512_k23`): for each half of 4 rows (`r0` = 0, 4, so that the wide form's
/// accumulators stay in registers) and each super-block `b < nb` in column order,
/// `block(b, r0)` gives the [`Factors`] of rows `r0..r0 + 4`, which are added as the AVX2
/// tails add them: `acc = fma(a, b, acc)` (`matmul`), or `a * b` widened to f64 and summed
/// (`wide`: `matmul_wide_acc`). The results go to `out.f32s` or `out.f64s`. `block` is only
/// called with `b < nb` and `r0` 0 or 4.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn halves(
    nb: usize,
    wide: bool,
    out: &mut ChunkOut,
    mut block: impl FnMut(usize, usize) -> Factors,
) {
    for r0 in [0, 4] {
        if wide {
            half::<true>(nb, r0, out, &mut block);
        } else {
            half::<false>(nb, r0, out, &mut block);
        }
    }
}

/// [`halves`] for rows `r0..r0 + 4`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn half<const WIDE: bool>(
    nb: usize,
    r0: usize,
    out: &mut ChunkOut,
    block: &mut impl FnMut(usize, usize) -> Factors,
) {
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut wlo = [_mm512_setzero_pd(); 4];
    let mut whi = [_mm512_setzero_pd(); 4];
    for b in 0..nb {
        let f = block(b, r0);
        for r in 0..4 {
            if WIDE {
                let c = _mm512_castps_pd(_mm512_mul_ps(f[r][0], f[r][1]));
                let lo = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_castpd512_pd256(c)));
                let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(c)));
                wlo[r] = _mm512_add_pd(wlo[r], lo);
                whi[r] = _mm512_add_pd(whi[r], hi);
            } else {
                acc[r] = _mm512_fmadd_ps(f[r][0], f[r][1], acc[r]);
            }
        }
    }
    for r in 0..4 {
        if WIDE {
            let (lo, hi) = out.f64s[r0 + r].split_at_mut(8);
            // SAFETY: `lo` and `hi` hold 8 f64 each.
            unsafe {
                _mm512_storeu_pd(lo.as_mut_ptr(), wlo[r]);
                _mm512_storeu_pd(hi.as_mut_ptr(), whi[r]);
            }
        } else {
            // SAFETY: a row of `out.f32s` holds 16 f32.
            unsafe { _mm512_storeu_ps(out.f32s[r0 + r].as_mut_ptr(), acc[r]) };
        }
    }
}

/// Super-block `b`'s [`Factors`] for rows `r0..r0 + 4` (see the module comment): `(isum as
/// f32, d_w * d_x)`, `isum = Σ sc · raw - (Σ sc · bsum16 pairs) << SHIFT` over `SUBS`
/// sub-blocks of `64 / SUBS` words (Q6_K: 16 of 16 columns, each pair of scales its own;
/// IQ4_XS: 8 of 32, a pair holding one scale twice).
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `w` holds at least `(b + 1) * W_VECS` vectors
/// unpacked in this layout, `x` `(b + 1) * ACT_VECS`; `r0 + 4 <= 8`; `SUBS` divides 64.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block_scaled<const SUBS: usize, const SHIFT: u32>(
    w: *const Expanded,
    x: *const Expanded,
    b: usize,
    r0: usize,
) -> Factors {
    // SAFETY: super-block `b` reads the vectors at `w + b * W_VECS` and `x + b * ACT_VECS`
    // (offsets below `W_VECS * 16` 32-bit values and `ACT_VECS` vectors), inside the
    // caller's slices.
    unsafe {
        let wb = w.add(b * W_VECS) as *const i32;
        let xb = x.add(b * ACT_VECS) as *const __m512i;
        let mut isum = [_mm512_setzero_si512(); 4];
        for s in 0..SUBS {
            let mut raw = [_mm512_setzero_si512(); 4];
            for kk in 0..64 / SUBS {
                let k = 64 / SUBS * s + kk;
                let xv = _mm512_load_si512(xb.add(k));
                for (r, raw) in raw.iter_mut().enumerate() {
                    let wv = _mm512_set1_epi32(*wb.add(8 * k + r0 + r));
                    *raw = _mm512_dpbusd_epi32(*raw, wv, xv);
                }
            }
            for r in 0..4 {
                let sc = _mm512_set1_epi32(*wb.add(SC + 8 * s + r0 + r));
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(raw[r], sc));
            }
        }
        let mut off = [_mm512_setzero_si512(); 4];
        for p in 0..8 {
            let bp = _mm512_load_si512(xb.add(65 + p));
            for (r, o) in off.iter_mut().enumerate() {
                let scp = _mm512_set1_epi32(*wb.add(SC_PAIRS + 8 * p + r0 + r));
                *o = _mm512_dpwssd_epi32(*o, scp, bp);
            }
        }
        let dx = _mm512_load_ps(xb.add(64) as *const f32);
        let dw = wb.add(D) as *const f32;
        let mut f = [[_mm512_setzero_ps(); 2]; 4];
        for (r, f) in f.iter_mut().enumerate() {
            let is = _mm512_sub_epi32(isum[r], _mm512_slli_epi32::<SHIFT>(off[r]));
            let scale = _mm512_mul_ps(_mm512_set1_ps(*dw.add(r0 + r)), dx);
            *f = [_mm512_cvtepi32_ps(is), scale];
        }
        f
    }
}
