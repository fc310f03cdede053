//! AVX-512 VNNI many-token kernels for Q2_K and Q3_K (`gemm_avx512_k`'s scheme on Q8_K
//! activations): 16 tokens in the lanes, a row's 4-column weight word broadcast from memory.
//! The activations are laid out as for Q6_K (`gemm_avx512_k::ACT_VECS`: the 64 words, `d`,
//! and the `bsum16` pairs), since all three formats have 16-wide sub-blocks.
//!
//! - Q2_K: the unpacking multiplies each 2-bit quant by its sub-block's 4-bit scale (at most
//!   3 * 15 = 45, still an unsigned byte), so one `vpdpbusd` chain per row gives
//!   `isum = Σ sc · (q · x)` over the whole super-block with no per-sub-block multiply. The
//!   minimums' `msum = Σ m · bsum16` is formed by `vpdpwssd` on i16 pairs (mins, activation
//!   sums). Both are the exact integers of the AVX2 kernels (`q2k_block_tail`), whose f32
//!   tail (`v = fma(d_w, isum as f32, -(dmin_w * (msum as f32)))`, then `fma(d_x, v, acc)`,
//!   or the wide form's `d_x * v` summed in f64; see `wide::block_q4_k`) is repeated per
//!   lane.
//! - Q3_K: the unpacked quants are the unsigned 0..=7 (low bits, plus 4 where the `hmask`
//!   bit is set). Each pair `p` of 16-wide sub-blocks gets two `vpdpbusd` sums (at most
//!   16 * 7 * 128 = 14336 in magnitude, so each fits an i16); the odd one is shifted into
//!   the high i16 of its lane, `4 * bsum16` of both is subtracted as i16 (the `-4` offset:
//!   `(q - 4) · x` is at most 16 * 4 * 128 = 8192 in magnitude), and one `vpdpwssd` with the
//!   signed scale pair adds `sc_2p · (q - 4) · x_2p + sc_2p+1 · (q - 4) · x_2p+1`. The total
//!   is the AVX2 kernels' exact `s32 - 4 Σ sc · bsum16` (`offset_tail`), whose f32 tail
//!   (`scale = d_w * d_x`, `fma(isum as f32, scale, acc)`, or the wide form's
//!   `isum as f32 * scale` summed in f64) is repeated per lane.
//!
//! The chunk loop and the f32 tails run in `gemm_avx512_k::halves` (shared with Q4_K to
//! Q6_K): rows in two halves of 4, so that the wide form's accumulators stay in registers.
//! No i32 can overflow: Q2_K's `isum` is at most 256 * 45 * 128 < 2^21 and its `msum`
//! 16 * 15 * 2048 < 2^19; Q3_K's `isum` at most 16 * 32 * 8192 < 2^23.
//!
//! Weights, per group super-block, [`W_VECS`] vectors: the bytes of word `K < 64` (columns
//! `4K..4K + 4`, in sub-block `K / 4`) of row `r` at 32-bit index `8K + r` (Q2_K: `q * sc`,
//! Q3_K: `q`, 0..=7); the pairs (Q2_K: mins, Q3_K: signed scales) of sub-blocks `2p`,
//! `2p + 1` as two i16 at `512 + 8p + r`; the rows' `d` as f32 at `576 + r` and (Q2_K)
//! `dmin` at `584 + r`.

use crate::expand::Expanded;
use crate::format::QuantType;
use crate::gemm_avx512::ChunkOut;
use crate::gemm_avx512_k::{halves, Factors, ACT_VECS};
use crate::pack::group_block_bytes;
use crate::pack_k::{q2k, q3k};
use std::arch::x86_64::*;

/// Vectors per unpacked group super-block: 32 of quants, 4 of pairs, 1 of `d` and `dmin`.
pub(crate) const W_VECS: usize = 37;
/// 32-bit offsets inside an unpacked group super-block.
const PAIRS: usize = 512;
const D: usize = 576;
const DMIN: usize = 584;

/// Unpacks `nb` Q2_K (`HMASK = false`) or Q3_K group super-blocks (see the module comment).
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `group` holds `nb` group super-blocks of the
/// format (`group_block_bytes` each), `out.len() >= nb * W_VECS`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn unpack<const HMASK: bool>(group: &[u8], nb: usize, out: &mut [Expanded]) {
    let qtype = if HMASK {
        QuantType::Q3_K
    } else {
        QuantType::Q2_K
    };
    let gb = group_block_bytes(qtype);
    let (qs, sc, d) = if HMASK {
        (q3k::QS, q3k::SC, q3k::D)
    } else {
        (q2k::QS, q2k::SC, q2k::D)
    };
    let three = _mm512_set1_epi8(3);
    let four = _mm512_set1_epi8(4);
    let bytes4 = _mm512_set1_epi32(0x0101_0101);
    // Lane `i` takes row `i % 8`'s scale of the even (`e = 0`) or odd sub-block of a pair
    // widened to 16 dwords (dword `2r + e` = row `r`, sub-block `2p + e`).
    let rows_of = |e: i32| {
        _mm512_set_epi32(
            14 + e,
            12 + e,
            10 + e,
            8 + e,
            6 + e,
            4 + e,
            2 + e,
            e,
            14 + e,
            12 + e,
            10 + e,
            8 + e,
            6 + e,
            4 + e,
            2 + e,
            e,
        )
    };
    let pick = [rows_of(0), rows_of(1)];
    for b in 0..nb {
        let blk = &group[b * gb..(b + 1) * gb];
        let dst = &mut out[b * W_VECS..(b + 1) * W_VECS];
        let words = dst.as_mut_ptr() as *mut u8;
        // SAFETY: the loads read `qs` words `8h + 2m`, `8h + 2m + 1` (64 bytes at
        // `QS + 32 (8h + 2m)`, at most `QS + 512 = BYTES`), (Q3_K) `hmask` words `2m`,
        // `2m + 1` (64 bytes at `HM + 64m`, at most `HM + 256 = QS`), the 16 scale (Q2_K:
        // also min) bytes of pair `p < 8` at `SC + 16p` (`MIN + 16p`), the 16 bytes of `d`
        // (`dmin`), all inside `blk`; each 64-byte store at word `K = 32h + 8k + 2m < 64`
        // lies inside the first 32 vectors of `dst`, each 32-byte store at
        // `PAIRS + 8p`, `D`, `DMIN` inside the last 5.
        unsafe {
            let ld = |at: usize| _mm512_loadu_si512(blk.as_ptr().add(at) as *const __m512i);
            let ld16 = |at: usize| _mm_loadu_si128(blk.as_ptr().add(at) as *const __m128i);
            let ints = words as *mut i32;
            let st256 =
                |at: usize, v: __m256i| _mm256_storeu_si256(ints.add(at) as *mut __m256i, v);
            // Q2_K: each sub-block's scale, as a byte repeated in the 4 bytes of each lane.
            let mut scb = [_mm512_setzero_si512(); 16];
            if !HMASK {
                for p in 0..8 {
                    let wide = _mm512_cvtepu8_epi32(ld16(sc + 16 * p));
                    for e in 0..2 {
                        let v = _mm512_permutexvar_epi32(pick[e], wide);
                        scb[2 * p + e] = _mm512_mullo_epi32(v, bytes4);
                    }
                }
            }
            for h in 0..2 {
                for m in 0..4 {
                    let v = ld(qs + 32 * (8 * h + 2 * m));
                    let hm = if HMASK {
                        ld(q3k::HM + 64 * m)
                    } else {
                        _mm512_setzero_si512()
                    };
                    for k in 0..4 {
                        let word = 32 * h + 8 * k + 2 * m;
                        let q = if HMASK {
                            let low = _mm512_and_si512(
                                _mm512_srl_epi16(v, _mm_cvtsi32_si128(2 * k as i32)),
                                three,
                            );
                            let bit = _mm512_set1_epi8((1u8 << (4 * h + k)) as i8);
                            _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(hm, bit), low, four)
                        } else {
                            // `q * sc` from the two bits of `q`: `sc` where bit 0 is set,
                            // plus `2 sc` where bit 1 is.
                            let s = scb[word / 4];
                            let b0 = _mm512_set1_epi8((1u8 << (2 * k)) as i8);
                            let b1 = _mm512_set1_epi8((2u8 << (2 * k)) as i8);
                            let q = _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(v, b0), s);
                            let s2 = _mm512_add_epi8(s, s);
                            _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(v, b1), q, s2)
                        };
                        _mm512_storeu_si512(words.add(32 * word) as *mut __m512i, q);
                    }
                }
            }
            for p in 0..8 {
                let pairs = if HMASK {
                    _mm256_cvtepi8_epi16(ld16(sc + 16 * p))
                } else {
                    _mm256_cvtepu8_epi16(ld16(q2k::MIN + 16 * p))
                };
                st256(PAIRS + 8 * p, pairs);
            }
            st256(D, _mm256_castps_si256(_mm256_cvtph_ps(ld16(d))));
            let dmin = if HMASK {
                _mm256_setzero_si256()
            } else {
                _mm256_castps_si256(_mm256_cvtph_ps(ld16(q2k::DMIN)))
            };
            st256(DMIN, dmin);
        }
    }
}

/// One unpacked group (`w`, from [`unpack`]) against one chunk of 16 transposed tokens (`x`,
/// laid out as for Q6_K) over `nb` super-blocks, into `out.f32s` or (`wide`) `out.f64s`.
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `w.len() >= nb * W_VECS` unpacked for
/// `qtype` (Q2_K or Q3_K), `x.len() >= nb * ACT_VECS`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn group_chunk(
    qtype: QuantType,
    w: &[Expanded],
    x: &[Expanded],
    nb: usize,
    wide: bool,
    out: &mut ChunkOut,
) {
    let (w, x) = (w.as_ptr(), x.as_ptr());
    // SAFETY: `halves` asks only for super-blocks `b < nb` and `r0` 0 or 4, whose vectors lie
    // inside the caller's `w` and `x`, unpacked for `qtype`; the features are the caller's
    // promise.
    if qtype == QuantType::Q3_K {
        halves(nb, wide, out, |b, r0| unsafe { block_q3k(w, x, b, r0) });
    } else {
        halves(nb, wide, out, |b, r0| unsafe { block_q2k(w, x, b, r0) });
    }
}

/// Q2_K: super-block `b`'s [`Factors`] for rows `r0..r0 + 4` (see the module comment):
/// `(d_x, fma(d_w, isum as f32, -(dmin_w * (msum as f32))))`.
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `w` holds at least `(b + 1) * W_VECS` vectors
/// unpacked for Q2_K, `x` `(b + 1) * ACT_VECS`; `r0 + 4 <= 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block_q2k(w: *const Expanded, x: *const Expanded, b: usize, r0: usize) -> Factors {
    // SAFETY: super-block `b` reads the vectors at `w + b * W_VECS` and `x + b * ACT_VECS`
    // (offsets below `W_VECS * 16` 32-bit values and `ACT_VECS` vectors), inside the
    // caller's slices.
    unsafe {
        let wb = w.add(b * W_VECS) as *const i32;
        let xb = x.add(b * ACT_VECS) as *const __m512i;
        // Two chains per row (even and odd words), so that 8 sums are in flight.
        let mut s = [[_mm512_setzero_si512(); 2]; 4];
        for k2 in 0..32 {
            for e in 0..2 {
                let k = 2 * k2 + e;
                let xv = _mm512_load_si512(xb.add(k));
                for (r, s) in s.iter_mut().enumerate() {
                    let wv = _mm512_set1_epi32(*wb.add(8 * k + r0 + r));
                    s[e] = _mm512_dpbusd_epi32(s[e], wv, xv);
                }
            }
        }
        let mut msum = [_mm512_setzero_si512(); 4];
        for p in 0..8 {
            let bp = _mm512_load_si512(xb.add(65 + p));
            for (r, m) in msum.iter_mut().enumerate() {
                let mp = _mm512_set1_epi32(*wb.add(PAIRS + 8 * p + r0 + r));
                *m = _mm512_dpwssd_epi32(*m, mp, bp);
            }
        }
        let dx = _mm512_load_ps(xb.add(64) as *const f32);
        let dw = wb.add(D) as *const f32;
        let dmin = wb.add(DMIN) as *const f32;
        let mut f = [[_mm512_setzero_ps(); 2]; 4];
        for (r, f) in f.iter_mut().enumerate() {
            let isum = _mm512_add_epi32(s[r][0], s[r][1]);
            let mins = _mm512_mul_ps(
                _mm512_set1_ps(*dmin.add(r0 + r)),
                _mm512_cvtepi32_ps(msum[r]),
            );
            let v = _mm512_fmsub_ps(
                _mm512_set1_ps(*dw.add(r0 + r)),
                _mm512_cvtepi32_ps(isum),
                mins,
            );
            *f = [dx, v];
        }
        f
    }
}

/// Q3_K: super-block `b`'s [`Factors`] for rows `r0..r0 + 4` (see the module comment):
/// `(isum as f32, d_w * d_x)`.
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `w` holds at least `(b + 1) * W_VECS` vectors
/// unpacked for Q3_K, `x` `(b + 1) * ACT_VECS`; `r0 + 4 <= 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block_q3k(w: *const Expanded, x: *const Expanded, b: usize, r0: usize) -> Factors {
    // SAFETY: super-block `b` reads the vectors at `w + b * W_VECS` and `x + b * ACT_VECS`
    // (offsets below `W_VECS * 16` 32-bit values and `ACT_VECS` vectors), inside the
    // caller's slices.
    unsafe {
        let wb = w.add(b * W_VECS) as *const i32;
        let xb = x.add(b * ACT_VECS) as *const __m512i;
        let mut isum = [_mm512_setzero_si512(); 4];
        for p in 0..8 {
            // Sub-blocks 2p (words 8p..8p + 4) and 2p + 1 (words 8p + 4..8p + 8).
            let mut raw = [[_mm512_setzero_si512(); 2]; 4];
            for kk in 0..8 {
                let k = 8 * p + kk;
                let xv = _mm512_load_si512(xb.add(k));
                for (r, raw) in raw.iter_mut().enumerate() {
                    let wv = _mm512_set1_epi32(*wb.add(8 * k + r0 + r));
                    raw[kk / 4] = _mm512_dpbusd_epi32(raw[kk / 4], wv, xv);
                }
            }
            let off = _mm512_slli_epi16::<2>(_mm512_load_si512(xb.add(65 + p)));
            for (r, raw) in raw.iter().enumerate() {
                let pair =
                    _mm512_mask_blend_epi16(0xAAAA_AAAA, raw[0], _mm512_slli_epi32::<16>(raw[1]));
                let pair = _mm512_sub_epi16(pair, off);
                let scp = _mm512_set1_epi32(*wb.add(PAIRS + 8 * p + r0 + r));
                isum[r] = _mm512_dpwssd_epi32(isum[r], pair, scp);
            }
        }
        let dx = _mm512_load_ps(xb.add(64) as *const f32);
        let dw = wb.add(D) as *const f32;
        let mut f = [[_mm512_setzero_ps(); 2]; 4];
        for (r, f) in f.iter_mut().enumerate() {
            let scale = _mm512_mul_ps(_mm512_set1_ps(*dw.add(r0 + r)), dx);
            *f = [_mm512_cvtepi32_ps(isum[r]), scale];
        }
        f
    }
}
