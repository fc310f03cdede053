//! AVX-512 VNNI integer dot products of one 8-row group of packed weights (Q4_0, Q4_1, Q8_0,
//! Q5_0, Q5_1, IQ4_NL) with 1 to 4 tokens' quantized activations.
//!
//! The packed layout (see `pack`) stores quant word `w` of rows 0..8 in 32 bytes, followed by
//! word `w + 1`; one 64-byte load therefore holds 8 columns of all 8 rows: 32-bit lane `r`
//! holds columns `4w..4w + 4` of row `r` and lane `8 + r` columns `4w + 4..4w + 8`. The
//! matching activation words are laid out once per call by `expand` (lanes 0..8 hold word
//! `w`, lanes 8..16 word `w + 1`; every group reuses them), and `vpdpbusd` (VNNI) multiplies the unsigned
//! weight bytes by the signed activation bytes and adds each group of 4 products into the
//! lane's i32 accumulator in one instruction (AVX2 needs `maddubs`, `madd` and `add`).
//!
//! Every integer sum is exact (no i16 intermediate, no saturation: `vpdpbusd`, not
//! `vpdpbusds`), so lanes `r` and `8 + r` added together are the same i32 as the scalar
//! `isum`; from there the f32 arithmetic is the AVX2 kernels' instruction for instruction, so
//! `matmul` gives the AVX2 bits and `matmul_wide_acc` the scalar (and AVX2) bits.
//! - Q4_0 / Q4_1: nibbles are the unsigned side; Q4_0's `-8` is `-8 * sum(x)` per block.
//! - Q8_0: signed weights become unsigned as `w + 128` (`w ^ 0x80`); the offset is removed
//!   as `-128 * sum(x)` per block.
//! - Q5_0 / Q5_1: nibbles with the fifth bit (0..=31) are the unsigned side (the fifth bits
//!   are set through a byte mask), then `-16 * sum(x)` (Q5_0) or Q4_1's minimum (Q5_1).
//! - IQ4_NL: nibbles become table values plus 128 (1..=241, unsigned) by a `vpshufb`
//!   lookup; the offset is removed as `-128 * sum(x)` per block, as Q8_0's.

use crate::dot_avx2::{
    add_wide, iq4_table, plain_block_tail, prefetch_ahead, q4_block_tail, store,
};
use crate::expand::{Expanded, PER_BLOCK};
use crate::format::QuantType;
use crate::pack::{group_block_bytes, group_scale_bytes};
use crate::quantize::ActBlock;
use crate::tile::TileOut;
use std::arch::x86_64::*;

/// Outputs of one group for `tile` tokens into `out.f32s[..tile]` or, when `wide`, the f64
/// sums of the block contributions into `out.f64s[..tile]`.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL and AVX-512 VNNI;
/// `group.len() >= nb * group_block_bytes(qtype)`; `acts.len() >= tile * nb` (token `t`'s
/// blocks are `acts[t * nb..(t + 1) * nb]`); `ex.len() >= tile * nb * PER_BLOCK`, `ex`
/// expanded from those blocks (`expand::expand`); `1 <= tile <= MAX_TILE`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn group_dot(
    qtype: QuantType,
    group: &[u8],
    nb: usize,
    acts: &[ActBlock],
    ex: &[Expanded],
    tile: usize,
    wide: bool,
    out: &mut TileOut,
) {
    let g = group.as_ptr();
    let a = acts.as_ptr();
    let x = ex.as_ptr();
    // SAFETY: the caller guarantees the CPU features, that the group holds `nb` group
    // blocks and that `acts` holds `tile` tokens of `nb` blocks; the pointers below stay
    // inside those slices.
    unsafe {
        let p = |t: usize| a.add(t * nb);
        let e = |t: usize| x.add(t * nb * PER_BLOCK);
        macro_rules! by_tile {
            ($k:ident $(, $c:literal)*) => {
                match (tile, wide) {
                    (1, false) => $k::<1, $($c,)* false>(g, nb, [p(0)], [e(0)], out),
                    (2, false) => $k::<2, $($c,)* false>(g, nb, [p(0), p(1)], [e(0), e(1)], out),
                    (3, false) => $k::<3, $($c,)* false>(g, nb, [p(0), p(1), p(2)], [e(0), e(1), e(2)], out),
                    (_, false) => $k::<4, $($c,)* false>(g, nb, [p(0), p(1), p(2), p(3)], [e(0), e(1), e(2), e(3)], out),
                    (1, true) => $k::<1, $($c,)* true>(g, nb, [p(0)], [e(0)], out),
                    (2, true) => $k::<2, $($c,)* true>(g, nb, [p(0), p(1)], [e(0), e(1)], out),
                    (3, true) => $k::<3, $($c,)* true>(g, nb, [p(0), p(1), p(2)], [e(0), e(1), e(2)], out),
                    (_, true) => $k::<4, $($c,)* true>(g, nb, [p(0), p(1), p(2), p(3)], [e(0), e(1), e(2), e(3)], out),
                }
            };
        }
        match qtype {
            QuantType::Q4_0 => by_tile!(q4, false),
            QuantType::Q4_1 => by_tile!(q4, true),
            QuantType::Q8_0 => by_tile!(q8),
            QuantType::Q5_0 => by_tile!(q5, false),
            QuantType::Q5_1 => by_tile!(q5, true),
            QuantType::IQ4_NL => by_tile!(iq4nl),
            // K-quants (and IQ4_XS) have their own kernels (`dot_avx512_k`).
            QuantType::Q2_K
            | QuantType::Q3_K
            | QuantType::Q4_K
            | QuantType::Q5_K
            | QuantType::Q6_K
            | QuantType::IQ4_XS => {}
        }
    }
}

/// The `vpermd` index putting 32-bit word `a` of a source in lanes 0..8 and word `b` in
/// lanes 8..16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn pair_index(a: i32, b: i32) -> __m512i {
    _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(a), _mm512_set1_epi32(b))
}

/// Adds the two 256-bit halves of `v` (lanes `r` and `8 + r` hold parts of row `r`'s sum).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn fold(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// One expanded activation vector (see `expand`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn ld(e: *const Expanded) -> __m512i {
    // SAFETY: the caller passes a valid vector; `Expanded` is 64 bytes, 64-aligned.
    unsafe { _mm512_load_si512(e as *const __m512i) }
}

/// 64 bytes at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn load64(p: *const u8) -> __m512i {
    // SAFETY: the caller keeps the 64 bytes inside one group block.
    unsafe { _mm512_loadu_si512(p as *const __m512i) }
}

/// Q4_0 (`MIN = false`) or Q4_1 (`MIN = true`) group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4<const T: usize, const MIN: bool, const WIDE: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlock; T],
    ex: [*const Expanded; T],
    out: &mut TileOut,
) {
    let qtype = if MIN {
        QuantType::Q4_1
    } else {
        QuantType::Q4_0
    };
    let gb = group_block_bytes(qtype);
    let sb = group_scale_bytes(qtype);
    // SAFETY: every load reads inside group block `b < nb` (scales at 0 and 16, quants at
    // `sb + 64 * m` for m < 2, ending at `gb`) or inside activation block `b < nb` of a token.
    unsafe {
        let low4 = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut acc_min = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * gb);
            prefetch_ahead(blk, gb);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let q = blk.add(sb);
            let mut s_lo = [_mm512_setzero_si512(); T];
            let mut s_hi = [_mm512_setzero_si512(); T];
            for m in 0..2 {
                let v = load64(q.add(64 * m));
                let lo = _mm512_and_si512(v, low4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4);
                for t in 0..T {
                    // Words 2m, 2m + 1 of the low nibbles (columns 8m..8m + 8) and of the
                    // high ones (columns 16 + 8m..): pairs m and 2 + m.
                    let xe = ex[t].add(b * PER_BLOCK);
                    s_lo[t] = _mm512_dpbusd_epi32(s_lo[t], lo, ld(xe.add(m)));
                    s_hi[t] = _mm512_dpbusd_epi32(s_hi[t], hi, ld(xe.add(2 + m)));
                }
            }
            let mw = if MIN {
                _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i))
            } else {
                _mm256_setzero_ps()
            };
            for t in 0..T {
                let s32 = fold(_mm512_add_epi32(s_lo[t], s_hi[t]));
                q4_block_tail::<MIN, WIDE>(
                    s32,
                    dw,
                    mw,
                    &*acts[t].add(b),
                    &mut acc[t],
                    &mut acc_min[t],
                    &mut wide[t],
                );
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, _mm256_add_ps(acc[t], acc_min[t]), wide[t]);
        }
    }
}

/// The IQ4 table plus 128 (unsigned bytes 1..=241) in every 128-bit lane, a `vpshufb`
/// lookup by nibble.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn iq4_table_u8() -> __m512i {
    _mm512_xor_si512(_mm512_broadcast_i32x4(iq4_table()), _mm512_set1_epi8(-128))
}

/// IQ4_NL group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn iq4nl<const T: usize, const WIDE: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlock; T],
    ex: [*const Expanded; T],
    out: &mut TileOut,
) {
    let gb = group_block_bytes(QuantType::IQ4_NL);
    let sb = group_scale_bytes(QuantType::IQ4_NL);
    // SAFETY: every load reads inside group block `b < nb` (scales at 0, nibble words at
    // `sb + 64 * m` for m < 2, ending at `gb`) or inside activation block `b` of a token.
    unsafe {
        let low4 = _mm512_set1_epi8(0x0F);
        let table = iq4_table_u8();
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * gb);
            prefetch_ahead(blk, gb);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let q = blk.add(sb);
            let mut s_lo = [_mm512_setzero_si512(); T];
            let mut s_hi = [_mm512_setzero_si512(); T];
            for m in 0..2 {
                let v = load64(q.add(64 * m));
                let lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
                let hi =
                    _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4));
                for t in 0..T {
                    // As Q4_0: pairs m (low nibbles) and 2 + m (high nibbles).
                    let xe = ex[t].add(b * PER_BLOCK);
                    s_lo[t] = _mm512_dpbusd_epi32(s_lo[t], lo, ld(xe.add(m)));
                    s_hi[t] = _mm512_dpbusd_epi32(s_hi[t], hi, ld(xe.add(2 + m)));
                }
            }
            for t in 0..T {
                let xb = &*acts[t].add(b);
                let s32 = fold(_mm512_add_epi32(s_lo[t], s_hi[t]));
                let s32 = _mm256_sub_epi32(s32, _mm256_set1_epi32(128 * xb.sum));
                plain_block_tail::<WIDE>(s32, dw, xb.d, &mut acc[t], &mut wide[t]);
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}

/// Q8_0 group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8<const T: usize, const WIDE: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlock; T],
    ex: [*const Expanded; T],
    out: &mut TileOut,
) {
    let gb = group_block_bytes(QuantType::Q8_0);
    let sb = group_scale_bytes(QuantType::Q8_0);
    // SAFETY: every load reads inside group block `b < nb` (scales at 0, quants at
    // `sb + 64 * m` for m < 4, ending at `gb`) or inside activation block `b` of a token.
    unsafe {
        let flip = _mm512_set1_epi8(-128);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * gb);
            prefetch_ahead(blk, gb);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let q = blk.add(sb);
            let mut s0 = [_mm512_setzero_si512(); T];
            let mut s1 = [_mm512_setzero_si512(); T];
            for m in 0..2 {
                // w + 128 as unsigned bytes.
                let w0 = _mm512_xor_si512(load64(q.add(128 * m)), flip);
                let w1 = _mm512_xor_si512(load64(q.add(128 * m + 64)), flip);
                for t in 0..T {
                    let xe = ex[t].add(b * PER_BLOCK + 2 * m);
                    s0[t] = _mm512_dpbusd_epi32(s0[t], w0, ld(xe));
                    s1[t] = _mm512_dpbusd_epi32(s1[t], w1, ld(xe.add(1)));
                }
            }
            for t in 0..T {
                let xb = &*acts[t].add(b);
                let s32 = fold(_mm512_add_epi32(s0[t], s1[t]));
                let s32 = _mm256_sub_epi32(s32, _mm256_set1_epi32(128 * xb.sum));
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(xb.d));
                if WIDE {
                    add_wide(&mut wide[t], _mm256_mul_ps(_mm256_cvtepi32_ps(s32), scale));
                } else {
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), scale, acc[t]);
                }
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}

/// Q5_0 (`MIN = false`) or Q5_1 (`MIN = true`) group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q5<const T: usize, const MIN: bool, const WIDE: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlock; T],
    ex: [*const Expanded; T],
    out: &mut TileOut,
) {
    let qtype = if MIN {
        QuantType::Q5_1
    } else {
        QuantType::Q5_0
    };
    let gb = group_block_bytes(qtype);
    let sb = group_scale_bytes(qtype);
    // SAFETY: every load reads inside group block `b < nb` (scales at 0 and (Q5_1) 16, `qh`
    // words at `sb`, nibble words at `sb + 32 + 64 * m` for m < 2, ending at `gb`) or inside
    // activation block `b` of a token.
    unsafe {
        let low4 = _mm512_set1_epi8(0x0F);
        let fifth = _mm512_set1_epi8(0x10);
        // Byte j of each 32-bit lane tests bit j of the lane's low byte.
        let spread = _mm512_set4_epi32(0x0C0C_0C0C, 0x0808_0808, 0x0404_0404, 0);
        let select = _mm512_set1_epi32(0x0804_0201);
        // Bits of `qh` for columns 8m.. (lanes 0..8) and 8m + 4.. (lanes 8..16); +16 for the
        // high nibbles.
        let shift_lo = [pair_index(0, 4), pair_index(8, 12)];
        let shift_hi = [pair_index(16, 20), pair_index(24, 28)];
        let mut acc = [_mm256_setzero_ps(); T];
        let mut acc_min = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * gb);
            prefetch_ahead(blk, gb);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(blk.add(sb) as *const __m256i));
            let mut s_lo = [_mm512_setzero_si512(); T];
            let mut s_hi = [_mm512_setzero_si512(); T];
            for m in 0..2 {
                let v = load64(blk.add(sb + 32 + 64 * m));
                let bits_lo = _mm512_shuffle_epi8(_mm512_srlv_epi32(qh, shift_lo[m]), spread);
                let bits_hi = _mm512_shuffle_epi8(_mm512_srlv_epi32(qh, shift_hi[m]), spread);
                let lo = _mm512_and_si512(v, low4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4);
                let lo =
                    _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(bits_lo, select), lo, fifth);
                let hi =
                    _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(bits_hi, select), hi, fifth);
                for t in 0..T {
                    // Words 2m, 2m + 1 of the low nibbles (columns 8m..8m + 8) and of the
                    // high ones (columns 16 + 8m..): pairs m and 2 + m.
                    let xe = ex[t].add(b * PER_BLOCK);
                    s_lo[t] = _mm512_dpbusd_epi32(s_lo[t], lo, ld(xe.add(m)));
                    s_hi[t] = _mm512_dpbusd_epi32(s_hi[t], hi, ld(xe.add(2 + m)));
                }
            }
            if MIN {
                let mw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i));
                for t in 0..T {
                    let xb = &*acts[t].add(b);
                    let s32 = fold(_mm512_add_epi32(s_lo[t], s_hi[t]));
                    let (acc, acc_min) = (&mut acc[t], &mut acc_min[t]);
                    q4_block_tail::<true, WIDE>(s32, dw, mw, xb, acc, acc_min, &mut wide[t]);
                }
                continue;
            }
            for t in 0..T {
                let xb = &*acts[t].add(b);
                let s32 = fold(_mm512_add_epi32(s_lo[t], s_hi[t]));
                let s = _mm256_sub_epi32(s32, _mm256_set1_epi32(16 * xb.sum));
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(xb.d));
                if WIDE {
                    add_wide(&mut wide[t], _mm256_mul_ps(_mm256_cvtepi32_ps(s), scale));
                } else {
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[t]);
                }
            }
        }
        for t in 0..T {
            let a = if MIN {
                _mm256_add_ps(acc[t], acc_min[t])
            } else {
                acc[t]
            };
            store::<WIDE>(out, t, a, wide[t]);
        }
    }
}
