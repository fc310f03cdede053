//! AVX-512 VNNI many-token kernels for Q4_K and Q5_K (`gemm_avx512_k`'s scheme on Q8_K
//! activations): 16 tokens in the lanes, a row's 4-column weight word broadcast from memory.
//! The two formats differ only in the unpacking (Q5_K ORs in its fifth bits from `qh`).
//!
//! Per row and super-block, each 32-wide sub-block's exact `vpdpbusd` sum of the unsigned
//! 4-bit (Q5_K: 5-bit) quants is multiplied by its 6-bit scale (`vpmulld`) and added up
//! (`isum`); the minimums' `msum = Σ m · bsum32` is formed by `vpdpwssd` on i16 pairs (mins,
//! activation sums). Both are the exact integers of the AVX2 kernels (`q4k_block_tail`), whose
//! f32 tail (`v = fma(d_w, isum as f32, -(dmin_w * (msum as f32)))`, then `fma(d_x, v, acc)`,
//! or the wide form's `d_x * v` summed in f64; see `wide::block_q4_k`) is repeated per lane.
//! Rows run in two halves of 4 (`gemm_avx512_k::halves`, which also runs the f32 tail), so
//! that the wide form's accumulators stay in registers (all 8 rows at once for `matmul`
//! measured no faster on the Intel kind).
//!
//! No i32 can overflow: a sub-block's sum is at most 32 * 31 * 128 = 126976 in magnitude,
//! `isum` at most 8 * 63 * 126976 < 2^26, and `msum` at most 8 * 63 * 32 * 128 < 2^21 (a
//! `bsum32` fits an i16).
//!
//! Layouts (64-byte vectors):
//! - Tokens, per chunk and super-block, [`ACT_VECS`] vectors: words `K < 64` (lane `t` =
//!   token `t`'s quants `4K..4K + 4`), the tokens' `d` (f32), then for each pair `p < 4` of
//!   32-wide sub-blocks their `bsum32` as two i16 in one 32-bit lane.
//! - Weights, per group super-block, [`W_VECS`] vectors: the quants (0..=15, Q5_K 0..=31) of
//!   word `K` of row `r` at 32-bit index `8K + r` (word `K` lies in sub-block `K / 8`); the
//!   scales as i32 at `512 + 8s + r`; the min pairs as two i16 at `576 + 8p + r`; the rows'
//!   `d` as f32 at `608 + r` and `dmin` at `616 + r`.

use crate::expand::Expanded;
use crate::format::{f16_at, QuantType};
use crate::gemm_avx512::{ChunkOut, LANES};
use crate::gemm_avx512_k::{halves, Factors};
use crate::pack::{group_block_bytes, GROUP_ROWS};
use crate::pack_k::{q4k, q5k};
use crate::quantize_k::ActBlockK;
use std::arch::x86_64::*;

/// Vectors per (chunk, super-block) of transposed activations: 64 words, `d`, 4 sum pairs.
pub(crate) const ACT_VECS: usize = 69;
/// Vectors per unpacked group super-block: 32 of quants, 4 of scales, 2 of min pairs, 1 of
/// `d` and `dmin`.
pub(crate) const W_VECS: usize = 39;
/// 32-bit offsets inside an unpacked group super-block.
const SC: usize = 512;
const MIN_PAIRS: usize = 576;
const D: usize = 608;
const DMIN: usize = 616;

/// Lays out up to 16 tokens of `nb` Q8_K blocks each (`acts`, token-major) into `out`
/// (`nb * ACT_VECS` vectors), zeros for the missing lanes.
pub(crate) fn transpose(acts: &[ActBlockK], nb: usize, out: &mut [Expanded]) {
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
            for p in 0..4 {
                let (lo, hi) = (a.bsum32[2 * p] as u16, a.bsum32[2 * p + 1] as u16);
                o[65 + p].0[t] = (lo as u32 | (hi as u32) << 16) as i32;
            }
        }
    }
}

/// Unpacks `nb` Q4_K (`FIFTH = false`) or Q5_K group super-blocks (see the module comment).
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `group` holds `nb` group super-blocks of the
/// format (`group_block_bytes` each), `out.len() >= nb * W_VECS`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn unpack<const FIFTH: bool>(group: &[u8], nb: usize, out: &mut [Expanded]) {
    let qtype = if FIFTH {
        QuantType::Q5_K
    } else {
        QuantType::Q4_K
    };
    let gb = group_block_bytes(qtype);
    let low4 = _mm512_set1_epi8(0x0F);
    let fifth = _mm512_set1_epi8(0x10);
    for b in 0..nb {
        let blk = &group[b * gb..(b + 1) * gb];
        let dst = &mut out[b * W_VECS..(b + 1) * W_VECS];
        let words = dst.as_mut_ptr() as *mut u8;
        // SAFETY: packed words `8c + 2m`, `8c + 2m + 1` (64 bytes at `QS + 32 (8c + 2m)`, at
        // most `QS + 1024 = q4k::BYTES`) and (Q5_K) `qh` words `2m`, `2m + 1` (64 bytes at
        // `QH + 64m`, at most `QH + 256 = q5k::BYTES`) lie inside `blk`; each 64-byte store
        // at word `K = 8s + 2m < 64` lies inside the first 32 vectors of `dst`.
        unsafe {
            let ld = |at: usize| _mm512_loadu_si512(blk.as_ptr().add(at) as *const __m512i);
            for m in 0..4 {
                let qh = if FIFTH {
                    ld(q5k::QH + 64 * m)
                } else {
                    _mm512_setzero_si512()
                };
                for c in 0..4 {
                    let v = ld(q4k::QS + 32 * (8 * c + 2 * m));
                    // Low nibbles: sub-block 2c (words 16c + 2m, + 1); high: sub-block 2c + 1.
                    let lo = _mm512_and_si512(v, low4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4);
                    for (s, q) in [(2 * c, lo), (2 * c + 1, hi)] {
                        // Q5_K: the fifth bit of sub-block `s` is bit `s` of the `qh` byte.
                        let q = if FIFTH {
                            let bit = _mm512_set1_epi8((1u8 << s) as i8);
                            _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(qh, bit), q, fifth)
                        } else {
                            q
                        };
                        _mm512_storeu_si512(words.add(32 * (8 * s + 2 * m)) as *mut __m512i, q);
                    }
                }
            }
        }
        let ints = |v: &mut [Expanded], at: usize, value: i32| v[at / 16].0[at % 16] = value;
        for r in 0..GROUP_ROWS {
            let byte = |base: usize, s: usize| blk[base + ((s / 2) * GROUP_ROWS + r) * 2 + s % 2];
            for s in 0..8 {
                ints(dst, SC + 8 * s + r, byte(q4k::SC, s) as i32);
            }
            for p in 0..4 {
                let (lo, hi) = (
                    byte(q4k::MIN, 2 * p) as u32,
                    byte(q4k::MIN, 2 * p + 1) as u32,
                );
                ints(dst, MIN_PAIRS + 8 * p + r, (lo | hi << 16) as i32);
            }
            ints(dst, D + r, f16_at(blk, q4k::D + 2 * r).to_bits() as i32);
            ints(
                dst,
                DMIN + r,
                f16_at(blk, q4k::DMIN + 2 * r).to_bits() as i32,
            );
        }
    }
}

/// One unpacked group (`w`, from [`unpack`]) against one chunk of 16 transposed tokens (`x`,
/// from [`transpose`]) over `nb` super-blocks, into `out.f32s` or (`wide`) `out.f64s`.
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `w.len() >= nb * W_VECS`,
/// `x.len() >= nb * ACT_VECS`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn group_chunk(
    w: &[Expanded],
    x: &[Expanded],
    nb: usize,
    wide: bool,
    out: &mut ChunkOut,
) {
    let (w, x) = (w.as_ptr(), x.as_ptr());
    // SAFETY: `halves` asks only for super-blocks `b < nb` and `r0` 0 or 4, whose vectors lie
    // inside the caller's `w` and `x`; the features are the caller's promise.
    halves(nb, wide, out, |b, r0| unsafe { block(w, x, b, r0) });
}

/// Super-block `b`'s [`Factors`] for rows `r0..r0 + 4` (see the module comment):
/// `(d_x, fma(d_w, isum as f32, -(dmin_w * (msum as f32))))`.
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `w` holds at least `(b + 1) * W_VECS` vectors,
/// `x` `(b + 1) * ACT_VECS`; `r0 + 4 <= 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block(w: *const Expanded, x: *const Expanded, b: usize, r0: usize) -> Factors {
    // SAFETY: super-block `b` reads the vectors at `w + b * W_VECS` and `x + b * ACT_VECS`
    // (offsets below `W_VECS * 16` 32-bit values and `ACT_VECS` vectors), inside the
    // caller's slices.
    unsafe {
        let wb = w.add(b * W_VECS) as *const i32;
        let xb = x.add(b * ACT_VECS) as *const __m512i;
        let mut isum = [_mm512_setzero_si512(); 4];
        for s in 0..8 {
            let mut raw = [_mm512_setzero_si512(); 4];
            for kk in 0..8 {
                let k = 8 * s + kk;
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
        let mut msum = [_mm512_setzero_si512(); 4];
        for p in 0..4 {
            let bp = _mm512_load_si512(xb.add(65 + p));
            for (r, m) in msum.iter_mut().enumerate() {
                let mp = _mm512_set1_epi32(*wb.add(MIN_PAIRS + 8 * p + r0 + r));
                *m = _mm512_dpwssd_epi32(*m, mp, bp);
            }
        }
        let dx = _mm512_load_ps(xb.add(64) as *const f32);
        let dw = wb.add(D) as *const f32;
        let dmin = wb.add(DMIN) as *const f32;
        let mut f = [[_mm512_setzero_ps(); 2]; 4];
        for (r, f) in f.iter_mut().enumerate() {
            let mins = _mm512_mul_ps(
                _mm512_set1_ps(*dmin.add(r0 + r)),
                _mm512_cvtepi32_ps(msum[r]),
            );
            let v = _mm512_fmsub_ps(
                _mm512_set1_ps(*dw.add(r0 + r)),
                _mm512_cvtepi32_ps(isum[r]),
                mins,
            );
            *f = [dx, v];
        }
        f
    }
}
