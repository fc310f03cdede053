//! AVX2 integer dot products of one 8-row group of packed K-quant weights (Q2_K, Q3_K, Q4_K,
//! Q5_K, Q6_K, and IQ4_XS) with 1 to 4 tokens' Q8_K activations; the same one-row-per-32-bit-lane
//! scheme, and the same f32 (`WIDE = false`) and wide (`WIDE = true`) forms, as `dot_avx2`.
//!
//! Per-sub-block scales are applied in the integer domain: the i16 pair sums of a sub-block
//! are `madd`-ed with the row's scale replicated in both i16 halves of its lane.
//! - Q4_K: 8 nibble products per i16 stay below 8 * 2 * 15 * 127; the minimums contribute
//!   `sum_s m_s * bsum32_s`, one `madd` per pair of sub-blocks against the broadcast sums.
//! - Q5_K: as Q4_K with the fifth bit set from `qh` (0..=31); four products per i16 stay
//!   below 4 * 2 * 31 * 127 = 31496.
//! - Q6_K: 6-bit values (0..=63) are the unsigned side; two products per i16 stay below
//!   2 * 2 * 63 * 128 = 32256; the `-32` offset is `-32 * sum_s sc_s * bsum16_s`.
//! - Q2_K: 2-bit values (0..=3), one 16-column sub-block (4 products per i16, below
//!   4 * 2 * 3 * 127) per `madd` with its scale; the minimums are
//!   `sum_s m_s * bsum16_s`, as Q4_K's with 16-wide sub-blocks.
//! - Q3_K: the 2 low bits and the `hmask` bit make 0..=7, the unsigned side (4 products per
//!   i16 below 4 * 2 * 7 * 127); the `-4` offset is `-4 * sum_s sc_s * bsum16_s`, as Q6_K's.
//! - IQ4_XS: nibbles become signed table values by a `vpshufb` lookup, then IQ4_NL's
//!   abs/sign `maddubs` (one pair sum per i16, at most 2 * 127 * 127), `madd`-ed at once with
//!   the row's sub-block scale (minus 32) in both i16 halves; no offset.
//!
//! Each kernel keeps its scale-weighted i32 sums per token in 8 registers, one per 32-wide
//! sub-block in the sub-block form (`SUB`), otherwise all in the first; [`block_end`] then
//! forms the super-block's contribution, or the 8 sub-blocks' (shared with AVX-512).

use crate::dot_avx2::{add_wide, iq4_table, ptrs, store};
use crate::format::QuantType;
use crate::pack_k::{iq4xs, q2k, q3k, q4k, q5k, q6k};
use crate::quantize_k::ActBlockK;
use crate::tile::{Form, TileOut};
use std::arch::x86_64::*;

/// `k::<T, c..>(g, nb, ptrs(a, nb), out)` with `T` = `tile` (1 to 4; larger values run 4).
macro_rules! by_tokens {
    ($tile:expr, $k:ident, [$($c:literal),*], $g:expr, $nb:expr, $a:expr, $out:expr) => {
        match $tile {
            1 => $k::<1, $($c),*>($g, $nb, ptrs($a, $nb), $out),
            2 => $k::<2, $($c),*>($g, $nb, ptrs($a, $nb), $out),
            3 => $k::<3, $($c),*>($g, $nb, ptrs($a, $nb), $out),
            _ => $k::<4, $($c),*>($g, $nb, ptrs($a, $nb), $out),
        }
    };
}

/// Outputs of one group for `tile` tokens into `out.f32s[..tile]` or, for the wide forms, the
/// f64 sums of the super-block (sub-block) contributions into `out.f64s[..tile]`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `group.len() >= nb * group_block_bytes(qtype)`
/// for a K-quant `qtype`; `acts.len() >= tile * nb`; `1 <= tile <= MAX_TILE`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn group_dot(
    qtype: QuantType,
    group: &[u8],
    nb: usize,
    acts: &[ActBlockK],
    tile: usize,
    form: Form,
    out: &mut TileOut,
) {
    let g = group.as_ptr();
    let a = acts.as_ptr();
    // SAFETY: the caller guarantees the CPU features, that the group holds `nb` group
    // super-blocks and that `acts` holds `tile` tokens of `nb` blocks.
    unsafe {
        // `k::<tile, c.., wide, sub>` for the tile size and form of this call.
        macro_rules! by_tile {
            ($k:ident $(, $c:literal)*) => {
                match form {
                    Form::F32 => by_tokens!(tile, $k, [$($c,)* false, false], g, nb, a, out),
                    Form::Wide => by_tokens!(tile, $k, [$($c,)* true, false], g, nb, a, out),
                    Form::WideSub => by_tokens!(tile, $k, [$($c,)* true, true], g, nb, a, out),
                }
            };
        }
        match qtype {
            QuantType::Q2_K => by_tile!(q2k),
            QuantType::Q3_K => by_tile!(q3k),
            QuantType::Q4_K => by_tile!(q4k, false),
            QuantType::Q5_K => by_tile!(q4k, true),
            QuantType::Q6_K => by_tile!(q6k),
            QuantType::IQ4_XS => by_tile!(iq4xs),
            _ => {}
        }
    }
}

/// `k::<T, c.., WIDE, SUB>(args..)` for a form (`Form`) and a `match` on the tile size whose
/// arms give the argument tuples (tokens `T` = the length of the third argument, 1 to 4).
macro_rules! by_form {
    ($form:expr, $k:ident, [$($c:tt),*], match $tile:ident {
        1 => ($($a1:expr),*), 2 => ($($a2:expr),*), 3 => ($($a3:expr),*), _ => ($($a4:expr),*),
    }) => {
        match ($form, $tile) {
            (Form::F32, 1) => $k::<1, $($c,)* false, false>($($a1),*),
            (Form::F32, 2) => $k::<2, $($c,)* false, false>($($a2),*),
            (Form::F32, 3) => $k::<3, $($c,)* false, false>($($a3),*),
            (Form::F32, _) => $k::<4, $($c,)* false, false>($($a4),*),
            (Form::Wide, 1) => $k::<1, $($c,)* true, false>($($a1),*),
            (Form::Wide, 2) => $k::<2, $($c,)* true, false>($($a2),*),
            (Form::Wide, 3) => $k::<3, $($c,)* true, false>($($a3),*),
            (Form::Wide, _) => $k::<4, $($c,)* true, false>($($a4),*),
            (Form::WideSub, 1) => $k::<1, $($c,)* true, true>($($a1),*),
            (Form::WideSub, 2) => $k::<2, $($c,)* true, true>($($a2),*),
            (Form::WideSub, 3) => $k::<3, $($c,)* true, true>($($a3),*),
            (Form::WideSub, _) => $k::<4, $($c,)* true, true>($($a4),*),
        }
    };
}
pub(crate) use by_form;

/// Which tail a K-quant kernel's super-block ends with.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tail {
    /// Q4_K and Q5_K: minimums per 32-wide sub-block.
    Q4K,
    /// Q2_K: minimums per 16-wide sub-block.
    Q2K,
    /// Q3_K: offset 4 per 16-wide sub-block.
    Q3K,
    /// Q6_K: offset 32 per 16-wide sub-block.
    Q6K,
    /// IQ4_XS: no offset, no minimum (`isum * (d_w * d_x)`).
    Iq4Xs,
}

/// The end of super-block `blk` for one token (activation block `x`): from `s`, the exact
/// scale-weighted integer sums (offsets not yet applied), all in `s[0]` (`SUB = false`: the
/// super-block's contribution into `acc` or, `WIDE`, `wide`) or per 32-wide sub-block (`SUB`:
/// the 8 sub-blocks' contributions, in column order, into `wide`; see `wide`). Shared by the
/// AVX2 and AVX-512 kernels: this f32 arithmetic is what makes their bits agree.
///
/// # Safety
/// `blk` points at a whole packed super-block of the format `tail` belongs to.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn block_end<const WIDE: bool, const SUB: bool>(
    tail: Tail,
    blk: *const u8,
    s: &[__m256i; 8],
    x: &ActBlockK,
    acc: &mut __m256,
    wide: &mut [__m256d; 2],
) {
    // SAFETY: every offset is inside the super-block (the caller's promise).
    unsafe {
        if !SUB {
            match tail {
                Tail::Q4K => q4k_block_tail::<WIDE>(blk, s[0], x, acc, wide),
                Tail::Q2K => q2k_block_tail::<WIDE>(blk, s[0], x, acc, wide),
                Tail::Q3K => {
                    offset_tail::<2, WIDE>(blk.add(q3k::SC), blk.add(q3k::D), s[0], x, acc, wide)
                }
                Tail::Q6K => {
                    offset_tail::<5, WIDE>(blk.add(q6k::SC), blk.add(q6k::D), s[0], x, acc, wide)
                }
                Tail::Iq4Xs => {
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(iq4xs::D) as *const __m128i));
                    crate::dot_avx2::plain_block_tail::<WIDE>(s[0], dw, x.d, acc, wide)
                }
            }
            return;
        }
        let (dw, dmin) = sub_scales(tail, blk);
        for (j, &sj) in s.iter().enumerate() {
            add_wide(wide, sub_value(tail, blk, j, sj, x, dw, dmin));
        }
    }
}

/// The rows' `d` and (formats with minimums, otherwise zeros) `dmin` of super-block `blk`, as
/// the sub-block form's tails ([`sub_value`]) take them.
///
/// # Safety
/// `blk` points at a whole packed super-block of the format `tail` belongs to.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn sub_scales(tail: Tail, blk: *const u8) -> (__m256, __m256) {
    // SAFETY: the scale fields lie inside the super-block (the caller's promise).
    unsafe {
        let f16s = |off: usize| _mm256_cvtph_ps(_mm_loadu_si128(blk.add(off) as *const __m128i));
        match tail {
            Tail::Q4K => (f16s(q4k::D), f16s(q4k::DMIN)),
            Tail::Q2K => (f16s(q2k::D), f16s(q2k::DMIN)),
            Tail::Q3K => (f16s(q3k::D), _mm256_setzero_ps()),
            Tail::Q6K => (f16s(q6k::D), _mm256_setzero_ps()),
            Tail::Iq4Xs => (f16s(iq4xs::D), _mm256_setzero_ps()),
        }
    }
}

/// The sub-block form's contribution of 32-wide sub-block `j` (< 8) of super-block `blk` to a
/// token's 8 rows, from `sj`, its exact scale-weighted integer sum (offsets not yet applied),
/// the token's activation block `x`, and `(dw, dmin)` from [`sub_scales`] (formulas in
/// `wide`). Every kernel's sub-block form ends here: this f32 arithmetic is what makes their
/// bits agree.
///
/// # Safety
/// `blk` points at a whole packed super-block of the format `tail` belongs to; `j < 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn sub_value(
    tail: Tail,
    blk: *const u8,
    j: usize,
    sj: __m256i,
    x: &ActBlockK,
    dw: __m256,
    dmin: __m256,
) -> __m256 {
    // SAFETY: the scale and min fields of sub-block `j` lie inside the super-block (the
    // caller's promise); the activation reads are inside `x`.
    unsafe {
        // Pair `j` of 16-wide sub-blocks (2j, 2j + 1) against their activation sums.
        let bs16 = bcast4(x.bsum16.as_ptr().add(2 * j));
        let v = match tail {
            Tail::Q4K => {
                // Sub-block j is one i16 of pair j / 2: the other one meets a zero sum.
                let bsum = x.bsum32[j] as u16 as i32;
                let bs = _mm256_set1_epi32(bsum << (16 * (j % 2)));
                min_value(
                    dw,
                    dmin,
                    sj,
                    _mm256_madd_epi16(pairs_u8(blk.add(q4k::MIN + 16 * (j / 2))), bs),
                )
            }
            Tail::Q2K => {
                let m32 = _mm256_madd_epi16(pairs_u8(blk.add(q2k::MIN + 16 * j)), bs16);
                min_value(dw, dmin, sj, m32)
            }
            Tail::Q3K => {
                offset_value::<2>(dw, sj, pairs_i8(blk.add(q3k::SC + 16 * j)), bs16, x.ds[j])
            }
            Tail::Q6K => {
                offset_value::<5>(dw, sj, pairs_i8(blk.add(q6k::SC + 16 * j)), bs16, x.ds[j])
            }
            Tail::Iq4Xs => _mm256_mul_ps(
                _mm256_cvtepi32_ps(sj),
                _mm256_mul_ps(dw, _mm256_set1_ps(x.ds[j])),
            ),
        };
        match tail {
            Tail::Q4K | Tail::Q2K => _mm256_mul_ps(_mm256_set1_ps(x.ds[j]), v),
            Tail::Q3K | Tail::Q6K | Tail::Iq4Xs => v,
        }
    }
}

/// `fma(d_w, s32, -(dmin_w * m32))`, the minimum formats' value before the activation scale.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn min_value(dw: __m256, dmin: __m256, s32: __m256i, m32: __m256i) -> __m256 {
    let mins = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m32));
    _mm256_fmsub_ps(dw, _mm256_cvtepi32_ps(s32), mins)
}

/// The offset formats' `(s32 - (1 << SHIFT) * madd(scp, bs)) * (d_w * d_x)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn offset_value<const SHIFT: i32>(
    dw: __m256,
    s32: __m256i,
    scp: __m256i,
    bs: __m256i,
    d_x: f32,
) -> __m256 {
    let o32 = _mm256_madd_epi16(scp, bs);
    let isum = _mm256_sub_epi32(s32, _mm256_sll_epi32(o32, _mm_cvtsi32_si128(SHIFT)));
    _mm256_mul_ps(
        _mm256_cvtepi32_ps(isum),
        _mm256_mul_ps(dw, _mm256_set1_ps(d_x)),
    )
}

/// Asks for the next group super-block (`bytes` long, right after `blk`) to be brought into
/// cache while this one is computed: the hardware prefetchers alone leave these kernels
/// waiting on memory. A prefetch never faults, even past the end of the matrix.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn prefetch_next(blk: *const u8, bytes: usize) {
    let next = blk.wrapping_add(bytes);
    let mut off = 0;
    while off < bytes {
        // Newer toolchains treat this intrinsic as safe here; older ones may not.
        #[allow(unused_unsafe)]
        // SAFETY: a prefetch is only a hint: it never faults, whatever the address.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(off) as *const i8)
        };
        off += 64;
    }
}

/// One Q4_K or Q5_K super-block's contribution to a token's 8 row sums, from `s32`, the exact
/// scale-weighted integer products of the rows' quants with the token's activation block `x`:
/// the mins (`dmin` x the sub-block mins x the activation sub-block sums) and the scales `d`.
/// Shared by the AVX2 and AVX-512 kernels: this f32 arithmetic is what makes their bits agree.
///
/// # Safety
/// `blk` points at a whole packed Q4_K or Q5_K super-block of an 8-row group.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4k_block_tail<const WIDE: bool>(
    blk: *const u8,
    s32: __m256i,
    x: &ActBlockK,
    acc: &mut __m256,
    wide: &mut [__m256d; 2],
) {
    // SAFETY: the scale, min and d/dmin fields lie inside the super-block (the caller's promise).
    unsafe {
        let mut m32 = _mm256_setzero_si256();
        for c in 0..4 {
            let mp = pairs_u8(blk.add(q4k::MIN + 16 * c));
            let bs = bcast4(x.bsum32.as_ptr().add(2 * c));
            m32 = _mm256_add_epi32(m32, _mm256_madd_epi16(mp, bs));
        }
        min_tail::<WIDE>(blk.add(q4k::D), blk.add(q4k::DMIN), s32, m32, x, acc, wide);
    }
}

/// The Q2_K counterpart of [`q4k_block_tail`] (16 sub-blocks, minimums against `bsum16`).
///
/// # Safety
/// `blk` points at a whole packed Q2_K super-block of an 8-row group.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q2k_block_tail<const WIDE: bool>(
    blk: *const u8,
    s32: __m256i,
    x: &ActBlockK,
    acc: &mut __m256,
    wide: &mut [__m256d; 2],
) {
    // SAFETY: the min and d/dmin fields lie inside the super-block (the caller's promise).
    unsafe {
        let mut m32 = _mm256_setzero_si256();
        for p in 0..8 {
            let mp = pairs_u8(blk.add(q2k::MIN + 16 * p));
            let bs = bcast4(x.bsum16.as_ptr().add(2 * p));
            m32 = _mm256_add_epi32(m32, _mm256_madd_epi16(mp, bs));
        }
        min_tail::<WIDE>(blk.add(q2k::D), blk.add(q2k::DMIN), s32, m32, x, acc, wide);
    }
}

/// `d_x * fma(d_w, s32, -(dmin_w * m32))` (see `wide::block_q4_k`) added to `acc`, or
/// widened into `wide`; `d`/`dmin` point at the group's 8 f16 scales.
///
/// # Safety
/// `d` and `dmin` point at 16 readable bytes each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn min_tail<const WIDE: bool>(
    d: *const u8,
    dmin: *const u8,
    s32: __m256i,
    m32: __m256i,
    x: &ActBlockK,
    acc: &mut __m256,
    wide: &mut [__m256d; 2],
) {
    // SAFETY: the caller's promise.
    unsafe {
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(d as *const __m128i));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(dmin as *const __m128i));
        let v = min_value(dw, dmin, s32, m32);
        if WIDE {
            add_wide(wide, _mm256_mul_ps(_mm256_set1_ps(x.d), v));
        } else {
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(x.d), v, *acc);
        }
    }
}

/// One Q3_K (`SHIFT = 2`) or Q6_K (`SHIFT = 5`) super-block's contribution to a token's 8 row
/// sums, from `s32`, the exact scale-weighted products of the unsigned quants with `x`: the
/// offset `-(1 << SHIFT) * sum_s sc_s * bsum16_s`, then `isum * (d_w * d_x)`. Shared by the
/// AVX2 and AVX-512 kernels.
///
/// # Safety
/// `sc` points at the 128 bytes of signed scale pairs, `d` at the 8 f16 scales.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn offset_tail<const SHIFT: i32, const WIDE: bool>(
    sc: *const u8,
    d: *const u8,
    s32: __m256i,
    x: &ActBlockK,
    acc: &mut __m256,
    wide: &mut [__m256d; 2],
) {
    // SAFETY: the caller's promise.
    unsafe {
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(d as *const __m128i));
        let mut o32 = _mm256_setzero_si256();
        for p in 0..8 {
            let scp = pairs_i8(sc.add(16 * p));
            let bs = bcast4(x.bsum16.as_ptr().add(2 * p));
            o32 = _mm256_add_epi32(o32, _mm256_madd_epi16(scp, bs));
        }
        let isum = _mm256_sub_epi32(s32, _mm256_sll_epi32(o32, _mm_cvtsi32_si128(SHIFT)));
        let scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d));
        if WIDE {
            add_wide(wide, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), scale));
        } else {
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, *acc);
        }
    }
}

/// Broadcasts the 4 bytes at `p` (activation quants or a pair of i16 sums) to all lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn bcast4<T>(p: *const T) -> __m256i {
    // SAFETY: the caller keeps the 4 bytes inside an activation block.
    unsafe { _mm256_set1_epi32((p as *const i32).read_unaligned()) }
}

/// 16 bytes at `p` widened to 16 i16 (8 rows x a pair of scales), unsigned or signed.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn pairs_u8(p: *const u8) -> __m256i {
    // SAFETY: the caller keeps the 16 bytes inside a group super-block.
    unsafe { _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i)) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn pairs_i8(p: *const u8) -> __m256i {
    // SAFETY: as for `pairs_u8`.
    unsafe { _mm256_cvtepi8_epi16(_mm_loadu_si128(p as *const __m128i)) }
}

/// From lanes holding an i16 pair `(a, b)`: lanes `(a, a)` (`HI = false`) or `(b, b)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dup_half<const HI: bool>(v: __m256i) -> __m256i {
    {
        let idx = if HI {
            _mm256_setr_epi8(
                2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6, 7, 6, 7, 10,
                11, 10, 11, 14, 15, 14, 15,
            )
        } else {
            _mm256_setr_epi8(
                0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9,
                8, 9, 12, 13, 12, 13,
            )
        };
        _mm256_shuffle_epi8(v, idx)
    }
}

/// The 6-bit values of quarters 0..4 of Q6_K word `i` of half `h` (8 rows x 4 columns each).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q6_quarters(blk: *const u8, h: usize, i: usize) -> [__m256i; 4] {
    // SAFETY: the caller passes a group super-block; the words are inside it.
    unsafe {
        let t = blk.add(q6k::triple(h, i));
        let a = load(t);
        let b = load(t.add(32));
        let hb = load(t.add(64));
        [
            six_bits(a, _mm256_slli_epi16::<4>(hb)),
            six_bits(b, _mm256_slli_epi16::<2>(hb)),
            six_bits(_mm256_srli_epi16::<4>(a), hb),
            six_bits(_mm256_srli_epi16::<4>(b), _mm256_srli_epi16::<2>(hb)),
        ]
    }
}

/// Words `i` and `i + 1` of half `h` of Q6_K super-block `b` against `T` tokens: per quarter,
/// two `maddubs` summed in i16, then `madd` with the quarter's sub-block scales, into
/// `s32[t][4h + quarter]` (`SUB`) or `s32[t][0]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn q6_words<const T: usize, const SUB: bool>(
    blk: *const u8,
    h: usize,
    i: usize,
    sc: &[__m256i; 4],
    acts: &[*const ActBlockK; T],
    b: usize,
    s32: &mut [[__m256i; 8]; T],
) {
    // SAFETY: weight words are inside the group super-block; activation reads are at
    // `128h + 32k + 4i + 0..8 < 256` inside block `b` of each token.
    unsafe {
        let q0 = q6_quarters(blk, h, i);
        let q1 = q6_quarters(blk, h, i + 1);
        for t in 0..T {
            let xq = (*acts[t].add(b)).qs.as_ptr().add(128 * h + 4 * i);
            let mut s = s32[t];
            macro_rules! quarter {
                ($k:literal) => {
                    let p0 = _mm256_maddubs_epi16(q0[$k], bcast4(xq.add(32 * $k)));
                    let p1 = _mm256_maddubs_epi16(q1[$k], bcast4(xq.add(32 * $k + 4)));
                    let p = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), sc[$k]);
                    let j = if SUB { 4 * h + $k } else { 0 };
                    s[j] = _mm256_add_epi32(s[j], p);
                };
            }
            quarter!(0);
            quarter!(1);
            quarter!(2);
            quarter!(3);
            s32[t] = s;
        }
    }
}

/// Q6_K values: the low nibble of each byte of `low` with bits 4..6 of each byte of `high`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn six_bits(low: __m256i, high: __m256i) -> __m256i {
    _mm256_or_si256(
        _mm256_and_si256(low, _mm256_set1_epi8(0x0F)),
        _mm256_and_si256(high, _mm256_set1_epi8(0x30)),
    )
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load(p: *const u8) -> __m256i {
    // SAFETY: the caller keeps the 32 bytes inside a group super-block.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// The bytes of `v` that have any bit of `bit` set become `to`, the others 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn bit_to(v: __m256i, bit: __m256i, to: __m256i) -> __m256i {
    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), to)
}

/// Q4_K (`FIFTH = false`) or Q5_K (`FIFTH = true`) group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k<const T: usize, const FIFTH: bool, const WIDE: bool, const SUB: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlockK; T],
    out: &mut TileOut,
) {
    let bytes = if FIFTH { q5k::BYTES } else { q4k::BYTES };
    // SAFETY: all weight reads are inside group super-block `b < nb` (offsets from `pack_k`
    // ending at `q4k::BYTES`, or `q5k::BYTES` for the `qh` words); activation reads are
    // inside block `b` of each token.
    unsafe {
        let low4 = _mm256_set1_epi8(0x0F);
        let fifth = _mm256_set1_epi8(0x10);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * bytes);
            prefetch_next(blk, bytes);
            let mut s32 = [[_mm256_setzero_si256(); 8]; T];
            for c in 0..4 {
                let scp = pairs_u8(blk.add(q4k::SC + 16 * c));
                for hi in [false, true] {
                    let sc = if hi {
                        dup_half::<true>(scp)
                    } else {
                        dup_half::<false>(scp)
                    };
                    // Q5_K: the fifth bits of sub-block `2c + hi` are bit `2c + hi` of `qh`.
                    let bit = _mm256_set1_epi8(1 << (2 * c + hi as usize));
                    let j = if SUB { 2 * c + hi as usize } else { 0 };
                    let mut s16 = [_mm256_setzero_si256(); T];
                    for w8 in 0..8 {
                        let v = load(blk.add(q4k::QS + 32 * (8 * c + w8)));
                        let mut q = if hi {
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4)
                        } else {
                            _mm256_and_si256(v, low4)
                        };
                        if FIFTH {
                            let h = load(blk.add(q5k::QH + 32 * w8));
                            q = _mm256_or_si256(q, bit_to(h, bit, fifth));
                        }
                        let at = 64 * c + 32 * hi as usize + 4 * w8;
                        for t in 0..T {
                            let x = bcast4((*acts[t].add(b)).qs.as_ptr().add(at));
                            s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(q, x));
                        }
                        if FIFTH && w8 == 3 {
                            // Four 5-bit products per i16 at most.
                            for t in 0..T {
                                let p = _mm256_madd_epi16(s16[t], sc);
                                s32[t][j] = _mm256_add_epi32(s32[t][j], p);
                                s16[t] = _mm256_setzero_si256();
                            }
                        }
                    }
                    for t in 0..T {
                        s32[t][j] = _mm256_add_epi32(s32[t][j], _mm256_madd_epi16(s16[t], sc));
                    }
                }
            }
            for t in 0..T {
                let x = &*acts[t].add(b);
                block_end::<WIDE, SUB>(Tail::Q4K, blk, &s32[t], x, &mut acc[t], &mut wide[t]);
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}

/// Q6_K group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k<const T: usize, const WIDE: bool, const SUB: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlockK; T],
    out: &mut TileOut,
) {
    // SAFETY: all weight reads are inside group super-block `b < nb` (offsets from `pack_k`
    // ending at `q6k::BYTES`); activation reads are inside block `b` of each token.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * q6k::BYTES);
            prefetch_next(blk, q6k::BYTES);
            let mut s32 = [[_mm256_setzero_si256(); 8]; T];
            for h in 0..2 {
                for half in 0..2 {
                    // Scales of sub-blocks 8h + 2k + half (quarter k, 16 columns each).
                    let mut sc = [_mm256_setzero_si256(); 4];
                    for (k, sck) in sc.iter_mut().enumerate() {
                        let scp = pairs_i8(blk.add(q6k::SC + 16 * (4 * h + k)));
                        *sck = if half == 1 {
                            dup_half::<true>(scp)
                        } else {
                            dup_half::<false>(scp)
                        };
                    }
                    let i0 = 4 * half;
                    q6_words::<T, SUB>(blk, h, i0, &sc, &acts, b, &mut s32);
                    q6_words::<T, SUB>(blk, h, i0 + 2, &sc, &acts, b, &mut s32);
                }
            }
            for t in 0..T {
                let x = &*acts[t].add(b);
                block_end::<WIDE, SUB>(Tail::Q6K, blk, &s32[t], x, &mut acc[t], &mut wide[t]);
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}

/// The 8 rows' IQ4_XS scales (minus 32) of sub-block `j`, each in both i16 halves of its
/// row's lane.
///
/// # Safety
/// `blk` points at a whole packed IQ4_XS group super-block; `j < 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn iq4xs_scales(blk: *const u8, j: usize) -> __m256i {
    // SAFETY: the 8 scale bytes of sub-block `j` lie inside the super-block.
    unsafe {
        let sc =
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(blk.add(iq4xs::SC + 8 * j) as *const __m128i));
        _mm256_or_si256(
            _mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF)),
            _mm256_slli_epi32::<16>(sc),
        )
    }
}

/// IQ4_XS group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4xs<const T: usize, const WIDE: bool, const SUB: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlockK; T],
    out: &mut TileOut,
) {
    // SAFETY: all weight reads are inside group super-block `b < nb` (offsets from `pack_k`
    // ending at `iq4xs::BYTES`); activation reads are inside block `b` of each token.
    unsafe {
        let low4 = _mm256_set1_epi8(0x0F);
        let table = _mm256_broadcastsi128_si256(iq4_table());
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * iq4xs::BYTES);
            prefetch_next(blk, iq4xs::BYTES);
            let mut s32 = [[_mm256_setzero_si256(); 8]; T];
            for j in 0..8 {
                let scp = iq4xs_scales(blk, j);
                let k = if SUB { j } else { 0 };
                for w4 in 0..4 {
                    let v = load(blk.add(iq4xs::QS + 32 * (4 * j + w4)));
                    let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low4));
                    let hi = _mm256_shuffle_epi8(
                        table,
                        _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4),
                    );
                    let (alo, ahi) = (_mm256_abs_epi8(lo), _mm256_abs_epi8(hi));
                    for t in 0..T {
                        let xq = (*acts[t].add(b)).qs.as_ptr().add(32 * j + 4 * w4);
                        let pl = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(bcast4(xq), lo));
                        let ph =
                            _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(bcast4(xq.add(16)), hi));
                        let p = _mm256_add_epi32(
                            _mm256_madd_epi16(pl, scp),
                            _mm256_madd_epi16(ph, scp),
                        );
                        s32[t][k] = _mm256_add_epi32(s32[t][k], p);
                    }
                }
            }
            for t in 0..T {
                let x = &*acts[t].add(b);
                block_end::<WIDE, SUB>(Tail::Iq4Xs, blk, &s32[t], x, &mut acc[t], &mut wide[t]);
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}

/// Q2_K (`HMASK = false`) or Q3_K (`HMASK = true`) unsigned quants of word `w8` (0..8) of half
/// `h` at bit pair `k`: `(qs >> 2k) & 3`, plus 4 where `hmask` bit `4h + k` is set (Q3_K).
///
/// # Safety
/// `qs` (and `hm` for Q3_K) point at the packed `qs` (`hmask`) words of a group super-block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn k23_quants<const HMASK: bool>(
    qs: *const u8,
    hm: *const u8,
    h: usize,
    k: usize,
    w8: usize,
) -> __m256i {
    // SAFETY: words `8h + w8 < 16` of `qs` and `w8 < 8` of `hmask` are inside the block.
    unsafe {
        let v = load(qs.add(32 * (8 * h + w8)));
        let q = _mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * k as i32));
        let q = _mm256_and_si256(q, _mm256_set1_epi8(3));
        if HMASK {
            let bit = _mm256_set1_epi8((1u8 << (4 * h + k)) as i8);
            _mm256_or_si256(q, bit_to(load(hm.add(32 * w8)), bit, _mm256_set1_epi8(4)))
        } else {
            q
        }
    }
}

/// Q2_K (`HMASK = false`) or Q3_K: the exact scale-weighted sums `sum_s sc_s * (q · x)_s` of
/// super-block `blk` for each token (Q3_K's `-4` offset not yet applied), per 32-wide
/// sub-block (`SUB`) or all in the first.
///
/// # Safety
/// `blk` points at a whole packed super-block of the format; `acts[t].add(b)` at token `t`'s
/// activation block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k23_sums<const T: usize, const HMASK: bool, const SUB: bool>(
    blk: *const u8,
    acts: &[*const ActBlockK; T],
    b: usize,
) -> [[__m256i; 8]; T] {
    let (qs, hm, sc) = if HMASK {
        (q3k::QS, q3k::HM, q3k::SC)
    } else {
        (q2k::QS, 0, q2k::SC)
    };
    // SAFETY: the offsets come from `pack_k` for this format; activation reads are at
    // `128h + 32k + 4 w8 + 0..4 < 256`.
    unsafe {
        let mut s32 = [[_mm256_setzero_si256(); 8]; T];
        for h in 0..2 {
            for k in 0..4 {
                let j = if SUB { 4 * h + k } else { 0 };
                // Sub-blocks 8h + 2k (columns 0..16 of the 32) and 8h + 2k + 1.
                let p = blk.add(sc + 16 * (4 * h + k));
                let scp = if HMASK { pairs_i8(p) } else { pairs_u8(p) };
                for half in 0..2 {
                    let scale = if half == 1 {
                        dup_half::<true>(scp)
                    } else {
                        dup_half::<false>(scp)
                    };
                    let mut s16 = [_mm256_setzero_si256(); T];
                    for w8 in 4 * half..4 * half + 4 {
                        let q = k23_quants::<HMASK>(blk.add(qs), blk.add(hm), h, k, w8);
                        let at = 128 * h + 32 * k + 4 * w8;
                        for t in 0..T {
                            let x = bcast4((*acts[t].add(b)).qs.as_ptr().add(at));
                            s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(q, x));
                        }
                    }
                    for t in 0..T {
                        s32[t][j] = _mm256_add_epi32(s32[t][j], _mm256_madd_epi16(s16[t], scale));
                    }
                }
            }
        }
        s32
    }
}

/// Q2_K group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q2k<const T: usize, const WIDE: bool, const SUB: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlockK; T],
    out: &mut TileOut,
) {
    // SAFETY: all weight reads are inside group super-block `b < nb` (offsets from `pack_k`
    // ending at `q2k::BYTES`); activation reads are inside block `b` of each token.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * q2k::BYTES);
            prefetch_next(blk, q2k::BYTES);
            let s32 = k23_sums::<T, false, SUB>(blk, &acts, b);
            for t in 0..T {
                let x = &*acts[t].add(b);
                block_end::<WIDE, SUB>(Tail::Q2K, blk, &s32[t], x, &mut acc[t], &mut wide[t]);
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}

/// Q3_K group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q3k<const T: usize, const WIDE: bool, const SUB: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlockK; T],
    out: &mut TileOut,
) {
    // SAFETY: all weight reads are inside group super-block `b < nb` (offsets from `pack_k`
    // ending at `q3k::BYTES`); activation reads are inside block `b` of each token.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * q3k::BYTES);
            prefetch_next(blk, q3k::BYTES);
            let s32 = k23_sums::<T, true, SUB>(blk, &acts, b);
            for t in 0..T {
                let x = &*acts[t].add(b);
                block_end::<WIDE, SUB>(Tail::Q3K, blk, &s32[t], x, &mut acc[t], &mut wide[t]);
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}
