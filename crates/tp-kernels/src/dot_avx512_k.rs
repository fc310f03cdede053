//! AVX-512 VNNI integer dot products of one 8-row group of packed K-quant weights (Q2_K,
//! Q3_K, Q4_K, Q5_K, Q6_K, and IQ4_XS) with 1 to 4 tokens' Q8_K activations; the two-words-per-register scheme of
//! `dot_avx512` (lanes 0..8 and 8..16 hold two 4-column words of the 8 rows), with the
//! activation words laid out once per call by `expand`.
//!
//! Each sub-block's exact i32 dot products are accumulated by `vpdpbusd` into their own
//! register and multiplied by the sub-block scales with `vpmulld` (per lane, the scale of
//! that lane's row and sub-block), so `isum` is the scalar kernels' exact integer; the f32
//! tail is the AVX2 kernels' instruction for instruction (same bits as AVX2 for `matmul`,
//! as scalar and AVX2 for `matmul_wide_acc`).
//! - Q4_K: a 64-byte load holds words `w`, `w + 1` of one 32-byte chunk `c`; low nibbles
//!   belong to sub-block `2c`, high nibbles to `2c + 1`. The minimums and the Q6_K offset
//!   use the AVX2 code's `madd` against the activation block sums.
//! - Q6_K: the 64 bytes at a packed triple are `ql` words `16h + i` and `16h + 8 + i`; with
//!   the `qh` word duplicated in both halves and shifted per half (`vpsllvd` / `vpsrlvd`),
//!   one register holds quarters 0 and 1 of word `i`, another quarters 2 and 3.
//! - Q5_K: Q4_K's scheme; the fifth bits come from the `qh` words `2m`, `2m + 1` (one 64-byte
//!   load), added as 16 through a byte mask.
//! - Q2_K / Q3_K: a 64-byte load holds `qs` words `8h + 2m`, `8h + 2m + 1` (columns
//!   `8m..8m + 8` of each 32-wide slice), shifted by `2k` for slice `k`; Q3_K adds 4 where the
//!   `hmask` bit is set (the `hmask` words `2m`, `2m + 1`). The tails (Q2_K's minimums, Q3_K's
//!   `-4` offset) are the AVX2 kernels'.
//! - IQ4_XS: a 64-byte load holds words `4j + 2m`, `4j + 2m + 1` of sub-block `j`; nibbles
//!   become table values plus 128 (unsigned) by a `vpshufb` lookup, each sub-block's sum
//!   gets `-128 * bsum32_j` and is multiplied by its scale with `vpmulld`.
//!
//! In the sub-block form (`SUB`) each 32-wide sub-block's scaled sums are folded on their own
//! and handed to the AVX2 kernels' `block_end`, as the whole super-block's are otherwise.

use crate::dot_avx2::store;
use crate::dot_avx2_k::{block_end, by_form, pairs_i8, pairs_u8, prefetch_next, Tail};
use crate::dot_avx512::{fold, iq4_table_u8, ld, load64, pair_index};
use crate::expand::{Expanded, PER_BLOCK_K};
use crate::format::QuantType;
use crate::pack_k::{iq4xs, q2k, q3k, q4k, q5k, q6k};
use crate::quantize_k::ActBlockK;
use crate::tile::{Form, TileOut};
use std::arch::x86_64::*;

/// Outputs of one group for `tile` tokens into `out.f32s[..tile]` or, for the wide forms, the
/// f64 sums of the super-block (sub-block) contributions into `out.f64s[..tile]`.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL and AVX-512 VNNI;
/// `group.len() >= nb * group_block_bytes(qtype)` for a K-quant `qtype`;
/// `acts.len() >= tile * nb`; `ex.len() >= tile * nb * PER_BLOCK_K`, expanded from those
/// blocks for this `qtype` (`expand::expand_k`); `1 <= tile <= MAX_TILE`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn group_dot(
    qtype: QuantType,
    group: &[u8],
    nb: usize,
    acts: &[ActBlockK],
    ex: &[Expanded],
    tile: usize,
    form: Form,
    out: &mut TileOut,
) {
    let g = group.as_ptr();
    let a = acts.as_ptr();
    let x = ex.as_ptr();
    // SAFETY: the caller guarantees the CPU features, that the group holds `nb` group
    // super-blocks and that `acts` holds `tile` tokens of `nb` blocks.
    unsafe {
        let p = |t: usize| a.add(t * nb);
        let e = |t: usize| x.add(t * nb * PER_BLOCK_K);
        let p1 = [p(0)];
        let p2 = [p(0), p(1)];
        let p3 = [p(0), p(1), p(2)];
        let p4 = [p(0), p(1), p(2), p(3)];
        let e1 = [e(0)];
        let e2 = [e(0), e(1)];
        let e3 = [e(0), e(1), e(2)];
        let e4 = [e(0), e(1), e(2), e(3)];
        // `k::<tile, c.., wide, sub>` for the tile size and form of this call.
        macro_rules! by_tile {
            ($k:ident $(, $c:literal)*) => {
                by_form!(form, $k, [$($c),*], match tile {
                    1 => (g, nb, p1, e1, out),
                    2 => (g, nb, p2, e2, out),
                    3 => (g, nb, p3, e3, out),
                    _ => (g, nb, p4, e4, out),
                })
            };
        }
        match qtype {
            QuantType::Q2_K => by_tile!(k23, false),
            QuantType::Q3_K => by_tile!(k23, true),
            QuantType::Q4_K => by_tile!(q4k, false),
            QuantType::Q5_K => by_tile!(q4k, true),
            QuantType::Q6_K => by_tile!(q6k),
            QuantType::IQ4_XS => by_tile!(iq4xs),
            _ => {}
        }
    }
}

/// Q4_K (`FIFTH = false`) or Q5_K (`FIFTH = true`) group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4k<const T: usize, const FIFTH: bool, const WIDE: bool, const SUB: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlockK; T],
    ex: [*const Expanded; T],
    out: &mut TileOut,
) {
    let bytes = if FIFTH { q5k::BYTES } else { q4k::BYTES };
    // SAFETY: all weight reads are inside group super-block `b < nb` (offsets from `pack_k`
    // ending at `q4k::BYTES`, or `q5k::BYTES` for the `qh` words); activation reads are
    // inside block `b` of each token.
    unsafe {
        let low4 = _mm512_set1_epi8(0x0F);
        let low16 = _mm512_set1_epi32(0xFFFF);
        let fifth = _mm512_set1_epi8(0x10);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * bytes);
            prefetch_next(blk, bytes);
            let mut s = [_mm512_setzero_si512(); T];
            let mut sub = [[_mm256_setzero_si256(); 8]; T];
            for c in 0..4 {
                // Lanes r and 8 + r: row r's scales of sub-blocks 2c (low i16), 2c + 1.
                let scp = _mm512_broadcast_i64x4(pairs_u8(blk.add(q4k::SC + 16 * c)));
                let sc_lo = _mm512_and_si512(scp, low16);
                let sc_hi = _mm512_srli_epi32::<16>(scp);
                let mut a_lo = [_mm512_setzero_si512(); T];
                let mut a_hi = [_mm512_setzero_si512(); T];
                for m in 0..4 {
                    let v = load64(blk.add(q4k::QS + 32 * (8 * c + 2 * m)));
                    let mut lo = _mm512_and_si512(v, low4);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4);
                    if FIFTH {
                        // Bits 2c (low nibbles) and 2c + 1 (high) of `qh` words 2m, 2m + 1.
                        let h = load64(blk.add(q5k::QH + 64 * m));
                        let bl = _mm512_test_epi8_mask(h, _mm512_set1_epi8(1 << (2 * c)));
                        let bh = _mm512_test_epi8_mask(h, _mm512_set1_epi8(2 << (2 * c)));
                        lo = _mm512_mask_add_epi8(lo, bl, lo, fifth);
                        hi = _mm512_mask_add_epi8(hi, bh, hi, fifth);
                    }
                    for t in 0..T {
                        // Pairs (16c + 2m, +1) (low nibbles) and (16c + 8 + 2m, +1) (high).
                        let xe = ex[t].add(b * PER_BLOCK_K + 8 * c + m);
                        a_lo[t] = _mm512_dpbusd_epi32(a_lo[t], lo, ld(xe));
                        a_hi[t] = _mm512_dpbusd_epi32(a_hi[t], hi, ld(xe.add(4)));
                    }
                }
                for t in 0..T {
                    let (lo, hi) = (
                        _mm512_mullo_epi32(a_lo[t], sc_lo),
                        _mm512_mullo_epi32(a_hi[t], sc_hi),
                    );
                    if SUB {
                        sub[t][2 * c] = fold(lo);
                        sub[t][2 * c + 1] = fold(hi);
                    } else {
                        s[t] = _mm512_add_epi32(s[t], _mm512_add_epi32(lo, hi));
                    }
                }
            }
            for t in 0..T {
                if !SUB {
                    sub[t][0] = fold(s[t]);
                }
                let x = &*acts[t].add(b);
                block_end::<WIDE, SUB>(Tail::Q4K, blk, &sub[t], x, &mut acc[t], &mut wide[t]);
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}

/// IQ4_XS group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn iq4xs<const T: usize, const WIDE: bool, const SUB: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlockK; T],
    ex: [*const Expanded; T],
    out: &mut TileOut,
) {
    // SAFETY: all weight reads are inside group super-block `b < nb` (offsets from `pack_k`
    // ending at `iq4xs::BYTES`); activation reads are inside block `b` of each token.
    unsafe {
        let low4 = _mm512_set1_epi8(0x0F);
        let table = iq4_table_u8();
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * iq4xs::BYTES);
            prefetch_next(blk, iq4xs::BYTES);
            let mut sub = [[_mm256_setzero_si256(); 8]; T];
            for j in 0..8 {
                // Row r's scale (minus 32) of sub-block j in lane r.
                let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    blk.add(iq4xs::SC + 8 * j) as *const __m128i
                ));
                let mut a = [_mm512_setzero_si512(); T];
                for m in 0..2 {
                    let v = load64(blk.add(iq4xs::QS + 32 * (4 * j + 2 * m)));
                    let lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
                    let hi = _mm512_shuffle_epi8(
                        table,
                        _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4),
                    );
                    for t in 0..T {
                        // Pairs (8j + 2m, +1) (low nibbles) and (8j + 4 + 2m, +1) (high).
                        let xe = ex[t].add(b * PER_BLOCK_K + 4 * j + m);
                        a[t] = _mm512_dpbusd_epi32(a[t], lo, ld(xe));
                        a[t] = _mm512_dpbusd_epi32(a[t], hi, ld(xe.add(2)));
                    }
                }
                for t in 0..T {
                    let x = &*acts[t].add(b);
                    let off = _mm256_set1_epi32(128 * x.bsum32[j] as i32);
                    let v = _mm256_mullo_epi32(_mm256_sub_epi32(fold(a[t]), off), sc);
                    let k = if SUB { j } else { 0 };
                    sub[t][k] = _mm256_add_epi32(sub[t][k], v);
                }
            }
            for t in 0..T {
                let x = &*acts[t].add(b);
                block_end::<WIDE, SUB>(Tail::Iq4Xs, blk, &sub[t], x, &mut acc[t], &mut wide[t]);
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}

/// Sub-block scales as i32 per lane from 32 signed scale bytes (pairs `p`, `p + 1`, each
/// `[row][2]`): lanes 0..8 pair `p`, lanes 8..16 pair `p + 1`; `[first, second]` of the pair.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6_scales(p: *const u8) -> [__m512i; 2] {
    // SAFETY: the caller keeps the 32 bytes inside a group super-block.
    unsafe {
        let v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(p as *const __m256i));
        [
            _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(v)),
            _mm512_srai_epi32::<16>(v),
        ]
    }
}

/// Q6_K group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6k<const T: usize, const WIDE: bool, const SUB: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlockK; T],
    ex: [*const Expanded; T],
    out: &mut TileOut,
) {
    // SAFETY: all weight reads are inside group super-block `b < nb` (offsets from `pack_k`
    // ending at `q6k::BYTES`); activation reads are inside block `b` of each token.
    unsafe {
        let low4 = _mm512_set1_epi8(0x0F);
        let bits45 = _mm512_set1_epi8(0x30);
        // qh bits 0-1 (quarter 0) and 2-3 (quarter 1) to bits 4-5; 4-5 (quarter 2) and 6-7
        // (quarter 3) likewise.
        let shl = pair_index(4, 2);
        let shr = pair_index(0, 2);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * q6k::BYTES);
            prefetch_next(blk, q6k::BYTES);
            let mut s = [_mm512_setzero_si512(); T];
            let mut sub = [[_mm256_setzero_si256(); 8]; T];
            for h in 0..2 {
                // Quarters 0 | 1 use pairs 4h | 4h + 1, quarters 2 | 3 pairs 4h + 2 | 4h + 3;
                // words 0..4 the first sub-block of a pair, words 4..8 the second.
                let sc01 = q6_scales(blk.add(q6k::SC + 16 * (4 * h)));
                let sc23 = q6_scales(blk.add(q6k::SC + 16 * (4 * h + 2)));
                let mut a01 = [[_mm512_setzero_si512(); T]; 2];
                let mut a23 = [[_mm512_setzero_si512(); T]; 2];
                for i in 0..8 {
                    let tr = blk.add(q6k::triple(h, i));
                    let v = load64(tr);
                    let hb =
                        _mm512_broadcast_i64x4(_mm256_loadu_si256(tr.add(64) as *const __m256i));
                    let q01 = _mm512_or_si512(
                        _mm512_and_si512(v, low4),
                        _mm512_and_si512(_mm512_sllv_epi32(hb, shl), bits45),
                    );
                    let q23 = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4),
                        _mm512_and_si512(_mm512_srlv_epi32(hb, shr), bits45),
                    );
                    let half = i / 4;
                    for t in 0..T {
                        // Chunks 2h (quarters 0, 1) and 2h + 1 (quarters 2, 3), word i.
                        let xe = ex[t].add(b * PER_BLOCK_K + 16 * h + i);
                        let (x0, x1) = (ld(xe), ld(xe.add(8)));
                        a01[half][t] = _mm512_dpbusd_epi32(a01[half][t], q01, x0);
                        a23[half][t] = _mm512_dpbusd_epi32(a23[half][t], q23, x1);
                    }
                }
                for t in 0..T {
                    let p01 = _mm512_add_epi32(
                        _mm512_mullo_epi32(a01[0][t], sc01[0]),
                        _mm512_mullo_epi32(a01[1][t], sc01[1]),
                    );
                    let p23 = _mm512_add_epi32(
                        _mm512_mullo_epi32(a23[0][t], sc23[0]),
                        _mm512_mullo_epi32(a23[1][t], sc23[1]),
                    );
                    if SUB {
                        // p01: lanes 0..8 quarter 0 (sub-block 4h), 8..16 quarter 1; p23: 2, 3.
                        sub[t][4 * h] = _mm512_castsi512_si256(p01);
                        sub[t][4 * h + 1] = _mm512_extracti64x4_epi64::<1>(p01);
                        sub[t][4 * h + 2] = _mm512_castsi512_si256(p23);
                        sub[t][4 * h + 3] = _mm512_extracti64x4_epi64::<1>(p23);
                    } else {
                        s[t] = _mm512_add_epi32(s[t], _mm512_add_epi32(p01, p23));
                    }
                }
            }
            for t in 0..T {
                if !SUB {
                    sub[t][0] = fold(s[t]);
                }
                let x = &*acts[t].add(b);
                block_end::<WIDE, SUB>(Tail::Q6K, blk, &sub[t], x, &mut acc[t], &mut wide[t]);
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}

/// Q2_K (`HMASK = false`) or Q3_K (`HMASK = true`) group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k23<const T: usize, const HMASK: bool, const WIDE: bool, const SUB: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlockK; T],
    ex: [*const Expanded; T],
    out: &mut TileOut,
) {
    let (bytes, qs, sc) = if HMASK {
        (q3k::BYTES, q3k::QS, q3k::SC)
    } else {
        (q2k::BYTES, q2k::QS, q2k::SC)
    };
    // SAFETY: all weight reads are inside group super-block `b < nb` (offsets from `pack_k`
    // ending at `bytes`); activation reads are inside block `b` of each token.
    unsafe {
        let low2 = _mm512_set1_epi8(3);
        let four = _mm512_set1_epi8(4);
        let low16 = _mm512_set1_epi32(0xFFFF);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * bytes);
            prefetch_next(blk, bytes);
            let mut s = [_mm512_setzero_si512(); T];
            let mut sub = [[_mm256_setzero_si256(); 8]; T];
            for h in 0..2 {
                for k in 0..4 {
                    // Lanes r and 8 + r: row r's scales of sub-blocks 8h + 2k (low i16) and
                    // 8h + 2k + 1, signed for Q3_K.
                    let p = blk.add(sc + 16 * (4 * h + k));
                    let (sc_lo, sc_hi) = if HMASK {
                        let v = _mm512_broadcast_i64x4(pairs_i8(p));
                        (
                            _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(v)),
                            _mm512_srai_epi32::<16>(v),
                        )
                    } else {
                        let v = _mm512_broadcast_i64x4(pairs_u8(p));
                        (_mm512_and_si512(v, low16), _mm512_srli_epi32::<16>(v))
                    };
                    let bit = _mm512_set1_epi8((1u8 << (4 * h + k)) as i8);
                    let shift = _mm_cvtsi32_si128(2 * k as i32);
                    let mut a = [[_mm512_setzero_si512(); T]; 2];
                    for m in 0..4 {
                        let v = load64(blk.add(qs + 32 * (8 * h + 2 * m)));
                        let mut q = _mm512_and_si512(_mm512_srl_epi16(v, shift), low2);
                        if HMASK {
                            let hm = load64(blk.add(q3k::HM + 64 * m));
                            q = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(hm, bit), q, four);
                        }
                        for t in 0..T {
                            // Activation words 32h + 8k + 2m, + 1: pair 16h + 4k + m.
                            let xe = ex[t].add(b * PER_BLOCK_K + 16 * h + 4 * k + m);
                            a[m / 2][t] = _mm512_dpbusd_epi32(a[m / 2][t], q, ld(xe));
                        }
                    }
                    for t in 0..T {
                        let p = _mm512_add_epi32(
                            _mm512_mullo_epi32(a[0][t], sc_lo),
                            _mm512_mullo_epi32(a[1][t], sc_hi),
                        );
                        if SUB {
                            sub[t][4 * h + k] = fold(p);
                        } else {
                            s[t] = _mm512_add_epi32(s[t], p);
                        }
                    }
                }
            }
            let tail = if HMASK { Tail::Q3K } else { Tail::Q2K };
            for t in 0..T {
                if !SUB {
                    sub[t][0] = fold(s[t]);
                }
                let x = &*acts[t].add(b);
                block_end::<WIDE, SUB>(tail, blk, &sub[t], x, &mut acc[t], &mut wide[t]);
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}
