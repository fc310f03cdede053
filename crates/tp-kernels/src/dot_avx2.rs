//! AVX2 integer dot products of one 8-row group of packed weights with 1 to 4 tokens'
//! quantized activations: each 32-byte weight load serves all 8 rows (one 32-bit lane per
//! row) and every token of the tile, so a block is unpacked once per tile.
//!
//! The trick: `maddubs` multiplies unsigned bytes by signed bytes and adds adjacent pairs to
//! i16; a second `madd` with ones adds pairs of i16 to i32. With the packed layout each 32-bit
//! lane holds 4 consecutive columns of one row, and the matching 4 activation bytes are
//! broadcast to every lane, so lane `r` accumulates row `r`'s dot product.
//! - Q4_0/Q4_1: nibbles (0..=15) are the unsigned side. Eight products summed in i16 stay
//!   below 8 * 2 * 15 * 127 = 30480 < 32767. Q4_0's `-8` is `-8 * sum(x)` per block, in i32.
//! - Q8_0: signed times signed, so `|w|` is the unsigned side and `x` takes `w`'s sign;
//!   each pair sum is at most 2 * 128 * 127 = 32512 and goes to i32 at once. With 256-bit
//!   VNNI (`crate::vnni`, the `avx2+vnni` path) one `vpdpbusd` replaces `maddubs`, `madd`
//!   and `add`: the same exact i32 sums.
//! - Q5_0/Q5_1: nibbles plus the fifth bit (0..=31) are the unsigned side; four products per
//!   i16 stay below 4 * 2 * 31 * 127 = 31496; Q5_0's `-16` is `-16 * sum(x)` per block, in
//!   i32; Q5_1's minimum is added as Q4_1's.
//! - IQ4_NL: nibbles become signed table values (-127..=113) by a `vpshufb` lookup, then the
//!   Q8_0 trick (`|w|` unsigned, `x` takes `w`'s sign); a pair sum is at most
//!   2 * 127 * 127 = 32258, so each `maddubs` result goes to i32 at once.

use crate::format::QuantType;
use crate::pack::{group_block_bytes, group_scale_bytes};
use crate::quantize::ActBlock;
use crate::tile::TileOut;
use std::arch::x86_64::*;

/// Outputs of one group for `tile` tokens into `out.f32s[..tile]` or, when `wide`, the f64
/// sums of the block contributions into `out.f64s[..tile]`. `vnni`: the `vpdpbusd ymm`
/// encoding Q8_0 uses (`crate::vnni::NONE`: the plain AVX2 code); the same bits either way.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and `vnni` ([`crate::vnni::encoding`] returned
/// it, or `NONE`); `group.len() >= nb * group_block_bytes(qtype)`;
/// `acts.len() >= tile * nb` (token `t`'s blocks are `acts[t * nb..(t + 1) * nb]`);
/// `1 <= tile <= MAX_TILE`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn group_dot(
    qtype: QuantType,
    group: &[u8],
    nb: usize,
    acts: &[ActBlock],
    tile: usize,
    wide: bool,
    vnni: u8,
    out: &mut TileOut,
) {
    let g = group.as_ptr();
    let a = acts.as_ptr();
    // SAFETY: the caller guarantees the CPU features, that the group holds `nb` group
    // blocks and that `acts` holds `tile` tokens of `nb` blocks; the pointers below stay
    // inside those slices.
    unsafe {
        // `k::<tile, c.., wide>` for the tile size and `wide` of this call.
        macro_rules! by_tile {
            ($k:ident $(, $c:tt)*) => {
                match (tile, wide) {
                    (1, false) => $k::<1, $($c,)* false>(g, nb, ptrs(a, nb), out),
                    (2, false) => $k::<2, $($c,)* false>(g, nb, ptrs(a, nb), out),
                    (3, false) => $k::<3, $($c,)* false>(g, nb, ptrs(a, nb), out),
                    (_, false) => $k::<4, $($c,)* false>(g, nb, ptrs(a, nb), out),
                    (1, true) => $k::<1, $($c,)* true>(g, nb, ptrs(a, nb), out),
                    (2, true) => $k::<2, $($c,)* true>(g, nb, ptrs(a, nb), out),
                    (3, true) => $k::<3, $($c,)* true>(g, nb, ptrs(a, nb), out),
                    (_, true) => $k::<4, $($c,)* true>(g, nb, ptrs(a, nb), out),
                }
            };
        }
        match qtype {
            QuantType::Q4_0 => by_tile!(q4, false),
            QuantType::Q4_1 => by_tile!(q4, true),
            QuantType::Q8_0 => match vnni {
                crate::vnni::EVEX => by_tile!(q8, { crate::vnni::EVEX }),
                crate::vnni::VEX => by_tile!(q8, { crate::vnni::VEX }),
                _ => by_tile!(q8, { crate::vnni::NONE }),
            },
            QuantType::Q5_0 => by_tile!(q5, false),
            QuantType::Q5_1 => by_tile!(q5, true),
            QuantType::IQ4_NL => by_tile!(iq4nl),
            // K-quants (and IQ4_XS) have their own kernels (`dot_avx2_k`).
            QuantType::Q2_K
            | QuantType::Q3_K
            | QuantType::Q4_K
            | QuantType::Q5_K
            | QuantType::Q6_K
            | QuantType::IQ4_XS => {}
        }
    }
}

/// Pointers to the first block of each of `T` tokens whose `nb` blocks follow each other from
/// `a` (pure address arithmetic: nothing is read).
#[inline]
pub(crate) fn ptrs<A, const T: usize>(a: *const A, nb: usize) -> [*const A; T] {
    std::array::from_fn(|t| a.wrapping_add(t * nb))
}

/// Widens the 8 f32 block contributions `c` (one per row) to f64 and adds them to `acc`
/// (rows 0..4, 4..8).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn add_wide(acc: &mut [__m256d; 2], c: __m256) {
    acc[0] = _mm256_add_pd(acc[0], _mm256_cvtps_pd(_mm256_castps256_ps128(c)));
    acc[1] = _mm256_add_pd(acc[1], _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(c)));
}

/// One Q4_0 / Q4_1 block's contribution to a token's 8 row sums, from `s32`, the exact integer
/// products of the 8 rows' quants with the token's activation block `x`; `dw`/`mw` are the
/// rows' scales and (Q4_1) mins. Shared by the AVX2 and AVX-512 kernels: this f32 arithmetic
/// is what makes their bits agree.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn q4_block_tail<const MIN: bool, const WIDE: bool>(
    mut s32: __m256i,
    dw: __m256,
    mw: __m256,
    x: &ActBlock,
    acc: &mut __m256,
    acc_min: &mut __m256,
    wide: &mut [__m256d; 2],
) {
    if !MIN {
        s32 = _mm256_sub_epi32(s32, _mm256_set1_epi32(8 * x.sum));
    }
    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d));
    if WIDE {
        let mut c = _mm256_mul_ps(_mm256_cvtepi32_ps(s32), scale);
        if MIN {
            c = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s), c);
        }
        add_wide(wide, c);
    } else {
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), scale, *acc);
        if MIN {
            *acc_min = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s), *acc_min);
        }
    }
}

/// One block's contribution without offset or minimum (Q8_0, IQ4_NL): `s32`, the exact
/// integer products of the 8 rows' quants with the token's block, times `dw * d_x`, added to
/// `acc` or (`WIDE`) widened into `wide` (see `wide::block_plain`). Shared by the AVX2 and
/// AVX-512 kernels.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn plain_block_tail<const WIDE: bool>(
    s32: __m256i,
    dw: __m256,
    d_x: f32,
    acc: &mut __m256,
    wide: &mut [__m256d; 2],
) {
    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(d_x));
    if WIDE {
        add_wide(wide, _mm256_mul_ps(_mm256_cvtepi32_ps(s32), scale));
    } else {
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), scale, *acc);
    }
}

/// The IQ4 table (`KVALUES_IQ4`) as 16 signed bytes, a `pshufb` lookup by nibble.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn iq4_table() -> __m128i {
    _mm_setr_epi8(
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
    )
}

/// Stores token `t`'s results: `acc` into `out.f32s[t]`, or (`WIDE`) `wide` into `out.f64s[t]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn store<const WIDE: bool>(
    out: &mut TileOut,
    t: usize,
    acc: __m256,
    wide: [__m256d; 2],
) {
    if WIDE {
        let o = &mut out.f64s[t];
        // SAFETY: `o` is 8 f64: two unaligned 4-lane stores fill it.
        unsafe {
            _mm256_storeu_pd(o.as_mut_ptr(), wide[0]);
            _mm256_storeu_pd(o.as_mut_ptr().add(4), wide[1]);
        }
    } else {
        // SAFETY: `out.f32s[t]` is 8 f32: one unaligned store fills it.
        unsafe { _mm256_storeu_ps(out.f32s[t].as_mut_ptr(), acc) }
    }
}

/// Bytes ahead of the current block that `prefetch_ahead` asks for.
const PREFETCH_DISTANCE: usize = 1024;

/// Asks for the group block `PREFETCH_DISTANCE` bytes ahead (`gb` bytes, one prefetch per
/// cache line it may touch) to be brought into cache: the hardware prefetchers alone leave
/// a streamed matvec waiting on memory. A prefetch never faults, even past the end.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn prefetch_ahead(blk: *const u8, gb: usize) {
    let ahead = blk.wrapping_add(PREFETCH_DISTANCE);
    let mut off = 0;
    while off < gb + 64 {
        // Newer toolchains treat this intrinsic as safe here; older ones may not.
        #[allow(unused_unsafe)]
        // SAFETY: a prefetch is only a hint: it never faults, whatever the address.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(off) as *const i8)
        };
        off += 64;
    }
}

/// Broadcasts the 4 activation bytes starting at `qs + at` to all 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bcast4(qs: *const i8, at: usize) -> __m256i {
    // SAFETY: the caller keeps `at + 4 <= 32` inside a block's quants.
    unsafe { _mm256_set1_epi32((qs.add(at) as *const i32).read_unaligned()) }
}

/// Q4_0 (`MIN = false`) or Q4_1 (`MIN = true`) group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4<const T: usize, const MIN: bool, const WIDE: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlock; T],
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
    // `sb + 32 * l` for l < 4, ending at `gb`) or inside activation block `b < nb` of a token.
    unsafe {
        let low4 = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut acc_min = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * gb);
            prefetch_ahead(blk, gb);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let q = blk.add(sb);
            let mut s16 = [_mm256_setzero_si256(); T];
            for l in 0..4 {
                let v = _mm256_loadu_si256(q.add(32 * l) as *const __m256i);
                let lo = _mm256_and_si256(v, low4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4);
                for t in 0..T {
                    let xq = (*acts[t].add(b)).qs.as_ptr();
                    let pl = _mm256_maddubs_epi16(lo, bcast4(xq, 4 * l));
                    let ph = _mm256_maddubs_epi16(hi, bcast4(xq, 16 + 4 * l));
                    s16[t] = _mm256_add_epi16(s16[t], _mm256_add_epi16(pl, ph));
                }
            }
            let mw = if MIN {
                _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i))
            } else {
                _mm256_setzero_ps()
            };
            for t in 0..T {
                let s32 = _mm256_madd_epi16(s16[t], ones);
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

/// Q8_0 group against `T` tokens, with `vpdpbusd` in VNNI encoding `V` (or the plain AVX2
/// code: `crate::vnni::NONE`).
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8<const T: usize, const V: u8, const WIDE: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlock; T],
    out: &mut TileOut,
) {
    let gb = group_block_bytes(QuantType::Q8_0);
    let sb = group_scale_bytes(QuantType::Q8_0);
    // SAFETY: every load reads inside group block `b < nb` (scales at 0, quants at
    // `sb + 32 * c` for c < 8, ending at `gb`) or inside activation block `b` of a token.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * gb);
            prefetch_ahead(blk, gb);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let q = blk.add(sb);
            let mut s32 = [_mm256_setzero_si256(); T];
            if V == crate::vnni::NONE {
                for c in 0..8 {
                    let w = _mm256_loadu_si256(q.add(32 * c) as *const __m256i);
                    let aw = _mm256_abs_epi8(w);
                    for t in 0..T {
                        let xq = (*acts[t].add(b)).qs.as_ptr();
                        let sx = _mm256_sign_epi8(bcast4(xq, 4 * c), w);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones);
                        s32[t] = _mm256_add_epi32(s32[t], p);
                    }
                }
            } else {
                // Two `vpdpbusd` chains per token (even and odd words): one chain is bound by
                // its latency at 1 token (decode).
                let mut odd = [_mm256_setzero_si256(); T];
                for c in (0..8).step_by(2) {
                    let w0 = _mm256_loadu_si256(q.add(32 * c) as *const __m256i);
                    let w1 = _mm256_loadu_si256(q.add(32 * c + 32) as *const __m256i);
                    let (a0, a1) = (_mm256_abs_epi8(w0), _mm256_abs_epi8(w1));
                    for t in 0..T {
                        let xq = (*acts[t].add(b)).qs.as_ptr();
                        let s0 = _mm256_sign_epi8(bcast4(xq, 4 * c), w0);
                        let s1 = _mm256_sign_epi8(bcast4(xq, 4 * c + 4), w1);
                        s32[t] = crate::vnni::dpbusd::<V>(s32[t], a0, s0);
                        odd[t] = crate::vnni::dpbusd::<V>(odd[t], a1, s1);
                    }
                }
                for t in 0..T {
                    s32[t] = _mm256_add_epi32(s32[t], odd[t]);
                }
            }
            for t in 0..T {
                let x = &*acts[t].add(b);
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d));
                if WIDE {
                    add_wide(
                        &mut wide[t],
                        _mm256_mul_ps(_mm256_cvtepi32_ps(s32[t]), scale),
                    );
                } else {
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[t]), scale, acc[t]);
                }
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}

/// IQ4_NL group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4nl<const T: usize, const WIDE: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlock; T],
    out: &mut TileOut,
) {
    let gb = group_block_bytes(QuantType::IQ4_NL);
    let sb = group_scale_bytes(QuantType::IQ4_NL);
    // SAFETY: every load reads inside group block `b < nb` (scales at 0, nibble words at
    // `sb + 32 * l` for l < 4, ending at `gb`) or inside activation block `b` of a token.
    unsafe {
        let low4 = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let table = _mm256_broadcastsi128_si256(iq4_table());
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * gb);
            prefetch_ahead(blk, gb);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let q = blk.add(sb);
            let mut s32 = [_mm256_setzero_si256(); T];
            for l in 0..4 {
                let v = _mm256_loadu_si256(q.add(32 * l) as *const __m256i);
                let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low4));
                let hi =
                    _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4));
                let (alo, ahi) = (_mm256_abs_epi8(lo), _mm256_abs_epi8(hi));
                for t in 0..T {
                    let xq = (*acts[t].add(b)).qs.as_ptr();
                    let pl = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(bcast4(xq, 4 * l), lo));
                    let ph =
                        _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(bcast4(xq, 16 + 4 * l), hi));
                    let p =
                        _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones));
                    s32[t] = _mm256_add_epi32(s32[t], p);
                }
            }
            for t in 0..T {
                let x = &*acts[t].add(b);
                plain_block_tail::<WIDE>(s32[t], dw, x.d, &mut acc[t], &mut wide[t]);
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}

/// The fifth bits of 4 columns per row: byte `j` of lane `r` becomes 0x10 when bit `j` of
/// lane `r` of `bits` is set (bits above 3 are ignored).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits(bits: __m256i) -> __m256i {
    {
        let low_byte = _mm256_setr_epi8(
            0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8,
            12, 12, 12, 12,
        );
        let select = _mm256_set1_epi32(0x0804_0201);
        let b = _mm256_and_si256(_mm256_shuffle_epi8(bits, low_byte), select);
        _mm256_and_si256(_mm256_cmpeq_epi8(b, select), _mm256_set1_epi8(0x10))
    }
}

/// Q5_0 (`MIN = false`) or Q5_1 (`MIN = true`) group against `T` tokens.
///
/// # Safety
/// As for [`group_dot`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5<const T: usize, const MIN: bool, const WIDE: bool>(
    group: *const u8,
    nb: usize,
    acts: [*const ActBlock; T],
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
    // words at `sb`, nibble words at `sb + 32 * (1 + l)` for l < 4, ending at `gb`) or inside
    // activation block `b` of a token.
    unsafe {
        let low4 = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut acc_min = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * gb);
            prefetch_ahead(blk, gb);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let qh = _mm256_loadu_si256(blk.add(sb) as *const __m256i);
            let mut s32 = [_mm256_setzero_si256(); T];
            for half in 0..2 {
                let mut s16 = [_mm256_setzero_si256(); T];
                for l in 2 * half..2 * half + 2 {
                    let v = _mm256_loadu_si256(blk.add(sb + 32 * (1 + l)) as *const __m256i);
                    let hl = fifth_bits(_mm256_srl_epi32(qh, _mm_cvtsi32_si128(4 * l as i32)));
                    let hh = fifth_bits(_mm256_srl_epi32(qh, _mm_cvtsi32_si128(16 + 4 * l as i32)));
                    let lo = _mm256_or_si256(_mm256_and_si256(v, low4), hl);
                    let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(v), low4), hh);
                    for t in 0..T {
                        let xq = (*acts[t].add(b)).qs.as_ptr();
                        let pl = _mm256_maddubs_epi16(lo, bcast4(xq, 4 * l));
                        let ph = _mm256_maddubs_epi16(hi, bcast4(xq, 16 + 4 * l));
                        s16[t] = _mm256_add_epi16(s16[t], _mm256_add_epi16(pl, ph));
                    }
                }
                for t in 0..T {
                    s32[t] = _mm256_add_epi32(s32[t], _mm256_madd_epi16(s16[t], ones));
                }
            }
            if MIN {
                let mw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i));
                for t in 0..T {
                    let x = &*acts[t].add(b);
                    let (acc, acc_min) = (&mut acc[t], &mut acc_min[t]);
                    q4_block_tail::<true, WIDE>(s32[t], dw, mw, x, acc, acc_min, &mut wide[t]);
                }
                continue;
            }
            for t in 0..T {
                let x = &*acts[t].add(b);
                let s = _mm256_sub_epi32(s32[t], _mm256_set1_epi32(16 * x.sum));
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d));
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

/// Bytes of one unpacked Q4_0/Q4_1/Q5_0/Q5_1 group block ([`unpack_group`]): for each `l` in
/// 0..4, the 8 rows' unsigned quants (0..=15, or 0..=31 with the fifth bit) of columns
/// `4l..4l + 4` (32 bytes, one row per 32-bit lane, as the packed words), then of columns
/// `16 + 4l..16 + 4l + 4`.
pub(crate) const UNPACKED_BLOCK: usize = 256;

/// Whether [`unpack_group`] and [`group_dot_unpacked`] handle `qtype`.
pub(crate) fn unpacks(qtype: QuantType) -> bool {
    matches!(
        qtype,
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1
    )
}

/// Unpacks the `nb` group blocks of `group` (a Q4_0/Q4_1/Q5_0/Q5_1 group) into `out`
/// (`nb * UNPACKED_BLOCK` bytes): the nibbles (with the fifth bits) the kernels above form in
/// registers for every tile, formed once for all tiles of a product. Other formats leave
/// `out` untouched.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `group.len() >= nb * group_block_bytes(qtype)`;
/// `out.len() >= nb * UNPACKED_BLOCK`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unpack_group(qtype: QuantType, group: &[u8], nb: usize, out: &mut [u8]) {
    let five = matches!(qtype, QuantType::Q5_0 | QuantType::Q5_1);
    if !unpacks(qtype) {
        return;
    }
    let gb = group_block_bytes(qtype);
    let sb = group_scale_bytes(qtype);
    let low4 = _mm256_set1_epi8(0x0F);
    // SAFETY: block `b < nb` of the group spans `b * gb..(b + 1) * gb` (Q5: `qh` words at
    // `sb`, nibble words at `sb + 32 * (1 + l)`; Q4: nibble words at `sb + 32 * l`), and
    // unpacked block `b` spans `b * UNPACKED_BLOCK..(b + 1) * UNPACKED_BLOCK` of `out`, both
    // inside the slices (the caller's promise).
    unsafe {
        for b in 0..nb {
            let blk = group.as_ptr().add(b * gb);
            prefetch_ahead(blk, gb);
            let dst = out.as_mut_ptr().add(b * UNPACKED_BLOCK);
            for l in 0..4 {
                let (lo, hi) = if five {
                    let qh = _mm256_loadu_si256(blk.add(sb) as *const __m256i);
                    let v = _mm256_loadu_si256(blk.add(sb + 32 * (1 + l)) as *const __m256i);
                    let hl = fifth_bits(_mm256_srl_epi32(qh, _mm_cvtsi32_si128(4 * l as i32)));
                    let hh = fifth_bits(_mm256_srl_epi32(qh, _mm_cvtsi32_si128(16 + 4 * l as i32)));
                    (
                        _mm256_or_si256(_mm256_and_si256(v, low4), hl),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(v), low4), hh),
                    )
                } else {
                    let v = _mm256_loadu_si256(blk.add(sb + 32 * l) as *const __m256i);
                    (
                        _mm256_and_si256(v, low4),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4),
                    )
                };
                _mm256_storeu_si256(dst.add(64 * l) as *mut __m256i, lo);
                _mm256_storeu_si256(dst.add(64 * l + 32) as *mut __m256i, hi);
            }
        }
    }
}

/// [`group_dot`] for a group already unpacked by [`unpack_group`] (`unpacked`): the same
/// integer sums and the same f32 / f64 arithmetic per token, hence the same bits; only the
/// unpacking is not repeated per tile.
///
/// # Safety
/// As for [`group_dot`], `qtype` one of [`unpacks`]'s formats, and
/// `unpacked.len() >= nb * UNPACKED_BLOCK`, unpacked from `group`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn group_dot_unpacked(
    qtype: QuantType,
    group: &[u8],
    unpacked: &[u8],
    nb: usize,
    acts: &[ActBlock],
    tile: usize,
    wide: bool,
    out: &mut TileOut,
) {
    let (g, u, a) = (group.as_ptr(), unpacked.as_ptr(), acts.as_ptr());
    // SAFETY: the caller guarantees the CPU features and the slice lengths.
    unsafe {
        macro_rules! by_tile {
            ($($c:literal),*) => {
                match (tile, wide) {
                    (1, false) => q45u::<1, $($c,)* false>(g, u, nb, ptrs(a, nb), out),
                    (2, false) => q45u::<2, $($c,)* false>(g, u, nb, ptrs(a, nb), out),
                    (3, false) => q45u::<3, $($c,)* false>(g, u, nb, ptrs(a, nb), out),
                    (_, false) => q45u::<4, $($c,)* false>(g, u, nb, ptrs(a, nb), out),
                    (1, true) => q45u::<1, $($c,)* true>(g, u, nb, ptrs(a, nb), out),
                    (2, true) => q45u::<2, $($c,)* true>(g, u, nb, ptrs(a, nb), out),
                    (3, true) => q45u::<3, $($c,)* true>(g, u, nb, ptrs(a, nb), out),
                    (_, true) => q45u::<4, $($c,)* true>(g, u, nb, ptrs(a, nb), out),
                }
            };
        }
        match qtype {
            QuantType::Q4_0 => by_tile!(false, false),
            QuantType::Q4_1 => by_tile!(true, false),
            QuantType::Q5_0 => by_tile!(false, true),
            QuantType::Q5_1 => by_tile!(true, true),
            _ => {}
        }
    }
}

/// Q4_0 / Q4_1 / Q5_0 / Q5_1 (`MIN`: with minimums; `FIVE`: 5-bit) unpacked group against `T`
/// tokens: [`q4`] and [`q5`] with the quants read from `unpacked`. The integer sums are the
/// same exact values (Q4: 8 products per i16, then one `madd`; Q5: 4 per i16 in each half),
/// and the tails and final stores are those of `q4` (Q4_0, Q4_1) and `q5` (Q5_0, Q5_1).
///
/// # Safety
/// As for [`group_dot_unpacked`], with `acts[t]` pointing at token `t`'s `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q45u<const T: usize, const MIN: bool, const FIVE: bool, const WIDE: bool>(
    group: *const u8,
    unpacked: *const u8,
    nb: usize,
    acts: [*const ActBlock; T],
    out: &mut TileOut,
) {
    let qtype = match (MIN, FIVE) {
        (false, false) => QuantType::Q4_0,
        (true, false) => QuantType::Q4_1,
        (false, true) => QuantType::Q5_0,
        (true, true) => QuantType::Q5_1,
    };
    let gb = group_block_bytes(qtype);
    // SAFETY: scales are read at 0 and 16 of group block `b < nb`, quants at `64 * l + 0..64`
    // of unpacked block `b`, activations inside block `b` of each token.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut acc_min = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * gb);
            let q = unpacked.add(b * UNPACKED_BLOCK);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let mut s32 = [_mm256_setzero_si256(); T];
            let mut s16 = [_mm256_setzero_si256(); T];
            for l in 0..4 {
                let lo = _mm256_loadu_si256(q.add(64 * l) as *const __m256i);
                let hi = _mm256_loadu_si256(q.add(64 * l + 32) as *const __m256i);
                for t in 0..T {
                    let xq = (*acts[t].add(b)).qs.as_ptr();
                    let pl = _mm256_maddubs_epi16(lo, bcast4(xq, 4 * l));
                    let ph = _mm256_maddubs_epi16(hi, bcast4(xq, 16 + 4 * l));
                    s16[t] = _mm256_add_epi16(s16[t], _mm256_add_epi16(pl, ph));
                }
                if FIVE && l % 2 == 1 {
                    // Four 5-bit products per i16 at most.
                    for t in 0..T {
                        s32[t] = _mm256_add_epi32(s32[t], _mm256_madd_epi16(s16[t], ones));
                        s16[t] = _mm256_setzero_si256();
                    }
                }
            }
            if !FIVE {
                for t in 0..T {
                    s32[t] = _mm256_madd_epi16(s16[t], ones);
                }
            }
            let mw = if MIN {
                _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i))
            } else {
                _mm256_setzero_ps()
            };
            for t in 0..T {
                let x = &*acts[t].add(b);
                if FIVE && !MIN {
                    let s = _mm256_sub_epi32(s32[t], _mm256_set1_epi32(16 * x.sum));
                    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d));
                    if WIDE {
                        add_wide(&mut wide[t], _mm256_mul_ps(_mm256_cvtepi32_ps(s), scale));
                    } else {
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[t]);
                    }
                } else {
                    let (acc, acc_min) = (&mut acc[t], &mut acc_min[t]);
                    q4_block_tail::<MIN, WIDE>(s32[t], dw, mw, x, acc, acc_min, &mut wide[t]);
                }
            }
        }
        for t in 0..T {
            // As `q4` (Q4_0 too adds its zero `acc_min`) and `q5` (only Q5_1 adds it).
            let a = if !FIVE || MIN {
                _mm256_add_ps(acc[t], acc_min[t])
            } else {
                acc[t]
            };
            store::<WIDE>(out, t, a, wide[t]);
        }
    }
}
