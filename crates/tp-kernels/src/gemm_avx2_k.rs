//! AVX2 many-token kernels for Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (prefill chunks, batched
//! decode, speculative verification): each 8-row group's super-blocks are unpacked once per
//! product into one layout shared by the five formats, then every tile of up to 4 tokens runs
//! against it with its accumulators in registers.
//!
//! The per-group kernels (`dot_avx2_k`) form the quants (nibbles, fifth bits, 2-bit pairs
//! with `hmask`, 6-bit values) and the scale vectors again for every tile of 4 tokens, and in
//! the sub-block form keep 8 sums per token until the super-block ends (32 registers at 4
//! tokens, twice the 16 there are). Here the unpacked group holds, per super-block,
//! [`UNPACKED`] bytes:
//! - for 32-wide sub-block `j < 8` and word `w < 8` (columns `32j + 4w..32j + 4w + 4`), the 8
//!   rows' unsigned quants (one row per 32-bit lane) at `(8j + w) * 32`: Q4_K the nibble,
//!   Q5_K the nibble plus 16 where the fifth bit is set, Q2_K 0..=3, Q3_K 0..=7 (plus 4 where
//!   the `hmask` bit is set), Q6_K 0..=63;
//! - for 16-wide half `e < 2` of sub-block `j`, the rows' scale in both i16 halves of their
//!   lane at `QUANTS + (2j + e) * 32` (Q4_K, Q5_K: the 32-wide sub-block's scale twice).
//!
//! The integer sums are the per-group kernels' exactly: `maddubs` of the unsigned quants
//! against the token's broadcast quants, summed in i16 over as many words as those kernels
//! sum ([`words_per_madd`]: 8 for Q4_K, 4 for Q5_K, Q2_K and Q3_K, 2 for Q6_K, so no i16 can
//! saturate where theirs did not), then `madd` with the scale into i32. The f32 (and f64)
//! tails are the same functions (`dot_avx2_k::block_end`, and for the sub-block form
//! `sub_value`, called as each sub-block ends, in column order): every output has the
//! per-group kernels' bits, hence the scalar path's.
//!
//! On the `avx2+vnni` path (`crate::vnni`) one `vpdpbusd` per word and token replaces the
//! `maddubs` and the i16 `add`: the words of one scale ([`words_per_scale`]: a 32-wide
//! sub-block for Q4_K and Q5_K, a 16-wide half for the others) are summed exactly in i32,
//! then multiplied by the scale (`mullo`). No i16 sum saturates on the plain path, so the
//! i32 sums, and every output, are the same.

use crate::cpu::Simd;
use crate::dot_avx2::{add_wide, ptrs, store};
use crate::dot_avx2_k::{
    block_end, by_form, dup_half, k23_quants, pairs_i8, pairs_u8, q6_quarters, sub_scales,
    sub_value, Tail,
};
use crate::format::QuantType;
use crate::pack::group_block_bytes;
use crate::pack_k::{q2k, q3k, q4k, q5k, q6k};
use crate::quantize_k::ActBlockK;
use crate::tile::{Form, TileOut};
use std::arch::x86_64::*;

/// Bytes of the unpacked quants of one group super-block (64 words of 8 rows x 4 bytes).
const QUANTS: usize = 2048;
/// Bytes of one unpacked group super-block: the quants, then 16 scale vectors.
pub(crate) const UNPACKED: usize = QUANTS + 16 * 32;

/// Whether the driver runs `qtype` on these kernels on path `simd` (an AVX2 one). Q4_K has
/// them (and the tests check them) but stays on the per-group kernels on the plain AVX2
/// path: unpacked, its 4-bit quants take twice the bytes (2560 a super-block against 1184
/// packed), and the many-token products measured 0.81-1.03x the per-group kernels at 8 to
/// 128 tokens (Q2_K 1.00-1.15x, Q3_K 1.27-1.51x, Q5_K 1.02-1.26x, Q6_K 1.04-1.38x;
/// `cargo bench -p tp-kernels --bench gemm`, AMD EPYC).
pub(crate) fn supports(qtype: QuantType, simd: Simd) -> bool {
    use QuantType::*;
    let q4k = Q4K_ON_VNNI && simd == Simd::Avx2Vnni && qtype == Q4_K;
    simd.is_avx2() && (matches!(qtype, Q2_K | Q3_K | Q5_K | Q6_K) || q4k)
}

/// Whether Q4_K takes these kernels on the `avx2+vnni` path (see [`supports`]).
const Q4K_ON_VNNI: bool = true;

/// Fewest tokens of a product the driver runs on these kernels: from two tiles, but Q4_K
/// (only on the `avx2+vnni` path) from 32: it measured 1.06-1.17x the per-group kernels at
/// 128 tokens and 0.90-0.96x at 16 (`cargo bench -p tp-kernels --bench gemm`, AMD EPYC).
pub(crate) fn min_tokens(qtype: QuantType) -> usize {
    if qtype == QuantType::Q4_K {
        32
    } else {
        crate::tile::MAX_TILE + 1
    }
}

/// Whether [`unpack`] and [`group_dot`] take `qtype` (Q4_K too, which the driver does not
/// send here on the plain AVX2 path: see [`supports`]).
#[cfg(test)]
pub(crate) fn has_kernels(qtype: QuantType) -> bool {
    supports(qtype, Simd::Avx2) || qtype == QuantType::Q4_K
}

/// Words that share one scale per row: a 32-wide sub-block (8) for Q4_K and Q5_K, a 16-wide
/// half (4) for Q2_K, Q3_K and Q6_K; the VNNI kernels sum them in i32 before the scale.
const fn words_per_scale(qtype: QuantType) -> usize {
    match qtype {
        QuantType::Q4_K | QuantType::Q5_K => 8,
        _ => 4,
    }
}

/// Words whose `maddubs` pair sums the per-group kernels add in i16 before one `madd` with the
/// scale: 8 quants of at most 15 (Q4_K), 4 of at most 31 (Q5_K) or 7 (Q3_K; Q2_K's 3 as well,
/// a 16-wide sub-block being 4 words), 2 of at most 63 (Q6_K).
const fn words_per_madd(qtype: QuantType) -> usize {
    match qtype {
        QuantType::Q4_K => 8,
        QuantType::Q6_K => 2,
        _ => 4,
    }
}

/// Unpacks the `nb` group super-blocks of `group` (of `qtype`, Q2_K to Q6_K)
/// into `out` (`nb * UNPACKED` bytes; see the module comment).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `group.len() >= nb * group_block_bytes(qtype)`;
/// `out.len() >= nb * UNPACKED`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unpack(qtype: QuantType, group: &[u8], nb: usize, out: &mut [u8]) {
    let gb = group_block_bytes(qtype);
    // SAFETY: super-block `b < nb` spans `b * gb..(b + 1) * gb` of `group` and
    // `b * UNPACKED..(b + 1) * UNPACKED` of `out` (the caller's promise); every read below
    // is at a `pack_k` offset inside the super-block, every store inside its unpacked form
    // (word `8j + w < 64` of the quants, scale vector `2j + e < 16`).
    unsafe {
        for b in 0..nb {
            let blk = group.as_ptr().add(b * gb);
            crate::dot_avx2_k::prefetch_next(blk, gb);
            let dst = out.as_mut_ptr().add(b * UNPACKED);
            let put = |j: usize, w: usize, v: __m256i| {
                _mm256_storeu_si256(dst.add((8 * j + w) * 32) as *mut __m256i, v)
            };
            let put_scale = |j: usize, e: usize, v: __m256i| {
                _mm256_storeu_si256(dst.add(QUANTS + (2 * j + e) * 32) as *mut __m256i, v)
            };
            let ld = |off: usize| _mm256_loadu_si256(blk.add(off) as *const __m256i);
            match qtype {
                QuantType::Q4_K | QuantType::Q5_K => {
                    let low4 = _mm256_set1_epi8(0x0F);
                    for c in 0..4 {
                        let scp = pairs_u8(blk.add(q4k::SC + 16 * c));
                        for hi in 0..2 {
                            // Sub-block `2c + hi`: the low (high) nibbles of words 8c..8c + 8;
                            // Q5_K's fifth bits are bit `2c + hi` of the `qh` words.
                            let j = 2 * c + hi;
                            let sc = if hi == 1 {
                                dup_half::<true>(scp)
                            } else {
                                dup_half::<false>(scp)
                            };
                            put_scale(j, 0, sc);
                            put_scale(j, 1, sc);
                            let bit = _mm256_set1_epi8(1 << j);
                            for w in 0..8 {
                                let v = ld(q4k::QS + 32 * (8 * c + w));
                                let mut q = if hi == 1 {
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4)
                                } else {
                                    _mm256_and_si256(v, low4)
                                };
                                if qtype == QuantType::Q5_K {
                                    let h = ld(q5k::QH + 32 * w);
                                    let five =
                                        crate::dot_avx2_k::bit_to(h, bit, _mm256_set1_epi8(0x10));
                                    q = _mm256_or_si256(q, five);
                                }
                                put(j, w, q);
                            }
                        }
                    }
                }
                QuantType::Q6_K => {
                    for h in 0..2 {
                        // Sub-block `4h + k` is quarter `k` of half `h`; its 16-wide halves
                        // are words 0..4 and 4..8.
                        for k in 0..4 {
                            let scp = pairs_i8(blk.add(q6k::SC + 16 * (4 * h + k)));
                            put_scale(4 * h + k, 0, dup_half::<false>(scp));
                            put_scale(4 * h + k, 1, dup_half::<true>(scp));
                        }
                        for i in 0..8 {
                            let q = q6_quarters(blk, h, i);
                            for (k, &qk) in q.iter().enumerate() {
                                put(4 * h + k, i, qk);
                            }
                        }
                    }
                }
                _ => {
                    let q3 = qtype == QuantType::Q3_K;
                    let (qs, hm, sc) = if q3 {
                        (q3k::QS, q3k::HM, q3k::SC)
                    } else {
                        (q2k::QS, 0, q2k::SC)
                    };
                    for h in 0..2 {
                        for k in 0..4 {
                            let j = 4 * h + k;
                            let p = blk.add(sc + 16 * j);
                            let scp = if q3 { pairs_i8(p) } else { pairs_u8(p) };
                            put_scale(j, 0, dup_half::<false>(scp));
                            put_scale(j, 1, dup_half::<true>(scp));
                            for w in 0..8 {
                                let q = if q3 {
                                    k23_quants::<true>(blk.add(qs), blk.add(hm), h, k, w)
                                } else {
                                    k23_quants::<false>(blk.add(qs), blk.add(hm), h, k, w)
                                };
                                put(j, w, q);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Outputs of one group, unpacked by [`unpack`] into `unpacked`, for `tile` tokens into
/// `out.f32s[..tile]` or, for the wide forms, the f64 sums into `out.f64s[..tile]`: the bits
/// of `dot_avx2_k::group_dot` on the packed group. `vnni`: the `vpdpbusd ymm` encoding to use
/// (`crate::vnni::NONE`: the plain AVX2 code).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and `vnni` ([`crate::vnni::encoding`] returned
/// it, or `NONE`); `qtype` one of Q2_K to Q6_K;
/// `group.len() >= nb * group_block_bytes(qtype)`; `unpacked.len() >= nb * UNPACKED`,
/// unpacked from `group`; `acts.len() >= tile * nb`; `1 <= tile <= MAX_TILE`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn group_dot(
    qtype: QuantType,
    group: &[u8],
    unpacked: &[u8],
    nb: usize,
    acts: &[ActBlockK],
    tile: usize,
    form: Form,
    vnni: u8,
    out: &mut TileOut,
) {
    use crate::vnni::{EVEX, NONE, VEX};
    let (g, u, a) = (group.as_ptr(), unpacked.as_ptr(), acts.as_ptr());
    let gb = group_block_bytes(qtype);
    let tail = match qtype {
        QuantType::Q2_K => Tail::Q2K,
        QuantType::Q3_K => Tail::Q3K,
        QuantType::Q6_K => Tail::Q6K,
        _ => Tail::Q4K,
    };
    // SAFETY: the caller guarantees the CPU features and the slice lengths.
    unsafe {
        macro_rules! run {
            ($wpm:literal, $v:ident) => {
                by_form!(
                    form,
                    kernel,
                    [$wpm, $v],
                    match tile {
                        1 => (tail, gb, g, u, nb, ptrs(a, nb), out),
                        2 => (tail, gb, g, u, nb, ptrs(a, nb), out),
                        3 => (tail, gb, g, u, nb, ptrs(a, nb), out),
                        _ => (tail, gb, g, u, nb, ptrs(a, nb), out),
                    }
                )
            };
        }
        match (vnni, words_per_scale(qtype), words_per_madd(qtype)) {
            (EVEX, 8, _) => run!(8, EVEX),
            (EVEX, _, _) => run!(4, EVEX),
            (VEX, 8, _) => run!(8, VEX),
            (VEX, _, _) => run!(4, VEX),
            (_, _, 8) => run!(8, NONE),
            (_, _, 2) => run!(2, NONE),
            _ => run!(4, NONE),
        }
    }
}

/// One unpacked group against `T` tokens (`acts[t]`: token `t`'s `nb` blocks), `WPM` words
/// summed in i16 per `madd` (plain AVX2, `V == NONE`) or, with `vpdpbusd` in encoding `V`,
/// in i32 per scale multiply (`WPM` is then [`words_per_scale`]).
///
/// # Safety
/// As for [`group_dot`]: `group` holds `nb` group super-blocks of `gb` bytes of the format
/// `tail` belongs to, `unpacked` their unpacked form.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel<
    const T: usize,
    const WPM: usize,
    const V: u8,
    const WIDE: bool,
    const SUB: bool,
>(
    tail: Tail,
    gb: usize,
    group: *const u8,
    unpacked: *const u8,
    nb: usize,
    acts: [*const ActBlockK; T],
    out: &mut TileOut,
) {
    // SAFETY: weight reads are inside group super-block `b < nb` and its unpacked form
    // (quant word `8j + w < 64`, scale vector `2j + e < 16`); activation reads are at
    // `32j + 4w + 0..4 < 256` inside block `b` of each token.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); T];
        let mut wide = [[_mm256_setzero_pd(); 2]; T];
        for b in 0..nb {
            let blk = group.add(b * gb);
            let u = unpacked.add(b * UNPACKED);
            let x: [&ActBlockK; T] = std::array::from_fn(|t| &*acts[t].add(b));
            let (dw, dmin) = if SUB {
                sub_scales(tail, blk)
            } else {
                (_mm256_setzero_ps(), _mm256_setzero_ps())
            };
            let mut s32 = [_mm256_setzero_si256(); T];
            for j in 0..8 {
                let mut sj = [_mm256_setzero_si256(); T];
                for m in 0..8 / WPM {
                    if V != crate::vnni::NONE {
                        // Two sums per token (even and odd words): twice the independent
                        // `vpdpbusd` chains, to cover its latency. Each token's 16 activation
                        // bytes of 4 words are loaded once (both 128-bit halves) and each word
                        // broadcast within the halves by `pshufd`: a quarter of the loads of
                        // one broadcast load per word and token, which bound this loop.
                        let (mut s0, mut s1) =
                            ([_mm256_setzero_si256(); T], [_mm256_setzero_si256(); T]);
                        for h in (m * WPM / 4)..((m + 1) * WPM / 4) {
                            let at = |w: usize| u.add((8 * j + 4 * h + w) * 32) as *const __m256i;
                            let q = [0, 1, 2, 3].map(|w| _mm256_loadu_si256(at(w)));
                            for t in 0..T {
                                let xq = x[t].qs.as_ptr().add(32 * j + 16 * h);
                                let xv = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                                    xq as *const __m128i,
                                ));
                                let x0 = _mm256_shuffle_epi32::<0x00>(xv);
                                let x1 = _mm256_shuffle_epi32::<0x55>(xv);
                                let x2 = _mm256_shuffle_epi32::<0xAA>(xv);
                                let x3 = _mm256_shuffle_epi32::<0xFF>(xv);
                                s0[t] = crate::vnni::dpbusd::<V>(s0[t], q[0], x0);
                                s1[t] = crate::vnni::dpbusd::<V>(s1[t], q[1], x1);
                                s0[t] = crate::vnni::dpbusd::<V>(s0[t], q[2], x2);
                                s1[t] = crate::vnni::dpbusd::<V>(s1[t], q[3], x3);
                            }
                        }
                        let s: [__m256i; T] =
                            std::array::from_fn(|t| _mm256_add_epi32(s0[t], s1[t]));
                        // The scale, in both i16 halves of each lane: the high one, widened.
                        let e = m * WPM / 4;
                        let sc =
                            _mm256_loadu_si256(u.add(QUANTS + (2 * j + e) * 32) as *const __m256i);
                        let sc = _mm256_srai_epi32::<16>(sc);
                        for t in 0..T {
                            sj[t] = _mm256_add_epi32(sj[t], _mm256_mullo_epi32(s[t], sc));
                        }
                        continue;
                    }
                    let mut s16 = [_mm256_setzero_si256(); T];
                    for w in m * WPM..(m + 1) * WPM {
                        let q = _mm256_loadu_si256(u.add((8 * j + w) * 32) as *const __m256i);
                        for t in 0..T {
                            let xq =
                                crate::dot_avx2_k::bcast4(x[t].qs.as_ptr().add(32 * j + 4 * w));
                            s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(q, xq));
                        }
                    }
                    let e = m * WPM / 4;
                    let sc = _mm256_loadu_si256(u.add(QUANTS + (2 * j + e) * 32) as *const __m256i);
                    for t in 0..T {
                        sj[t] = _mm256_add_epi32(sj[t], _mm256_madd_epi16(s16[t], sc));
                    }
                }
                for t in 0..T {
                    if SUB {
                        add_wide(&mut wide[t], sub_value(tail, blk, j, sj[t], x[t], dw, dmin));
                    } else {
                        s32[t] = _mm256_add_epi32(s32[t], sj[t]);
                    }
                }
            }
            if !SUB {
                for t in 0..T {
                    let mut s = [_mm256_setzero_si256(); 8];
                    s[0] = s32[t];
                    block_end::<WIDE, false>(tail, blk, &s, x[t], &mut acc[t], &mut wide[t]);
                }
            }
        }
        for t in 0..T {
            store::<WIDE>(out, t, acc[t], wide[t]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu;
    use crate::matrix::tests::random_ggml;
    use crate::pack::GROUP_ROWS;
    use crate::tile::MAX_TILE;
    use crate::QuantMatrix;

    const FORMATS: [QuantType; 5] = {
        use QuantType::*;
        [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K]
    };

    /// The call sizes the issue asks for: one tile, partial tiles, one token past 8, 16, 32.
    const SIZES: [usize; 8] = [1, 2, 7, 8, 15, 16, 17, 33];

    fn values(len: usize, seed: u64) -> Vec<f32> {
        tp_testkit::Rng::new(seed ^ 0x5EED).uniform_vec(len, -2.0, 2.0)
    }

    fn f32_bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    fn f64_bits(v: &[f64]) -> Vec<u64> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    /// The AVX2 variants this CPU runs (plain, and with VNNI where it has it); a printed
    /// line for each it cannot run.
    fn avx2_paths() -> Vec<Simd> {
        cpu::available()
            .into_iter()
            .filter(|s| s.is_avx2())
            .collect()
    }

    /// `matmul` and `matmul_wide_acc` (from non-zero sums) on each AVX2 variant and on the
    /// scalar path give the same bits.
    fn assert_scalar_bits(m: &QuantMatrix, x: &[f32], n: usize, what: &str) {
        let rows = m.rows();
        let mut ys = vec![0.0f32; n * rows];
        m.matmul_with(Simd::Scalar, x, n, &mut ys).unwrap();
        let y0: Vec<f64> = (0..n * rows).map(|i| i as f64 * 0.25 - 3.0).collect();
        let mut ws = y0.clone();
        m.matmul_wide_acc_with(Simd::Scalar, x, n, &mut ws).unwrap();
        for simd in avx2_paths() {
            let mut ya = vec![0.0f32; n * rows];
            m.matmul_with(simd, x, n, &mut ya).unwrap();
            assert_eq!(f32_bits(&ya), f32_bits(&ys), "{what} {simd:?} f32");
            let mut wa = y0.clone();
            m.matmul_wide_acc_with(simd, x, n, &mut wa).unwrap();
            assert_eq!(f64_bits(&wa), f64_bits(&ws), "{what} {simd:?} wide");
        }
    }

    /// Whole super-blocks (`sub = false`) or the sub-block form from column 32 to 64 before
    /// the end.
    fn matrix(qtype: QuantType, rows: usize, nb: usize, sub: bool, seed: u64) -> QuantMatrix {
        let bytes = random_ggml(qtype, rows, nb * 256, seed);
        if sub {
            QuantMatrix::from_ggml_sub_blocks(qtype, rows, 32, nb * 256 - 64, bytes).unwrap()
        } else {
            QuantMatrix::from_ggml_bytes(qtype, rows, nb * 256, bytes).unwrap()
        }
    }

    #[test]
    fn many_token_products_give_the_scalar_bits_at_every_call_size() {
        if !cpu::supports(Simd::Avx2) {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        // Odd row counts (a partial last group at the tensor's end), 1 to 5 super-blocks,
        // plain and sub-block forms; and 70 tokens over 25 super-blocks.
        let cases = [
            (9usize, 1usize, &SIZES[..]),
            (17, 3, &SIZES),
            (3, 2, &SIZES),
        ];
        let cases = cases
            .into_iter()
            .chain([(40, 5, &SIZES[..]), (9, 25, &[70][..])]);
        for qtype in FORMATS {
            for (rows, nb, sizes) in cases.clone() {
                for sub in [false, true] {
                    let seed = (rows * 131 + nb) as u64;
                    let m = matrix(qtype, rows, nb, sub, seed);
                    for &n in sizes {
                        let x = values(n * m.cols(), seed + n as u64);
                        let what = format!("{qtype} [{rows},{}] sub={sub} n={n}", m.cols());
                        assert_scalar_bits(&m, &x, n, &what);
                    }
                }
            }
        }
    }

    #[test]
    fn many_token_products_of_extreme_quants_give_the_scalar_bits() {
        // Every quant, scale and min byte at its extremes and activations at +-127: the i16
        // sums are where a different grouping would saturate.
        if !cpu::supports(Simd::Avx2) {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        use QuantType::*;
        for qtype in FORMATS {
            let (rows, nb) = (9, 3);
            for fill in [0x00u8, 0xFF, 0x7F, 0x80] {
                let mut bytes = random_ggml(qtype, rows, nb * 256, 3);
                let bb = qtype.block_bytes();
                for blk in bytes.chunks_exact_mut(bb) {
                    let q = match qtype {
                        Q4_K | Q5_K if fill != 0 => 4..bb,
                        Q4_K | Q5_K => 16..bb,
                        Q6_K => 0..208,
                        Q3_K => 0..108,
                        Q2_K if fill != 0 => 0..80,
                        _ => 16..80,
                    };
                    blk[q].fill(fill);
                }
                let m = QuantMatrix::from_ggml_bytes(qtype, rows, nb * 256, bytes.clone());
                let s = QuantMatrix::from_ggml_sub_blocks(qtype, rows, 0, nb * 256, bytes);
                for (m, sub) in [(m.unwrap(), false), (s.unwrap(), true)] {
                    for (sign, n) in [8, 17, 33]
                        .into_iter()
                        .flat_map(|n| [(1.0f32, n), (-1.0, n)])
                    {
                        let x: Vec<f32> = (0..n * m.cols())
                            .map(|i| if i % 3 == 0 { sign } else { -sign * 0.5 })
                            .collect();
                        let what = format!("{qtype} fill {fill:#x} sign {sign} sub={sub} n={n}");
                        assert_scalar_bits(&m, &x, n, &what);
                    }
                }
            }
        }
    }

    #[test]
    fn unpacked_kernels_give_the_per_group_kernels_bits_for_every_tile_and_form() {
        // The kernels themselves, called directly (the products above would also pass if the
        // driver never took them): one group, tiles of 1 to 4 tokens, each form, plain and
        // (where the CPU has it) with VNNI.
        if !cpu::supports(Simd::Avx2) {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        let nb = 3;
        for qtype in FORMATS {
            let m = matrix(qtype, GROUP_ROWS, nb, false, 11);
            let group = &m.packed_for_tests()[..nb * group_block_bytes(qtype)];
            let x = values(MAX_TILE * nb * 256, 5);
            let mut acts = vec![ActBlockK::default(); MAX_TILE * nb];
            crate::quantize_k::quantize(Simd::Avx2, &x, &mut acts);
            let mut subs = vec![ActBlockK::default(); MAX_TILE * nb];
            crate::quantize_k::quantize_sub(&x, MAX_TILE, nb * 256, 0, &mut subs);
            let mut unpacked = vec![0u8; nb * UNPACKED];
            assert!(has_kernels(qtype));
            // SAFETY: AVX2 (checked above); `group` holds `nb` group super-blocks and
            // `unpacked` `nb * UNPACKED` bytes.
            unsafe { unpack(qtype, group, nb, &mut unpacked) };
            let encodings = avx2_paths().into_iter().map(|s| s.vnni());
            for (form, v) in [Form::F32, Form::Wide, Form::WideSub]
                .into_iter()
                .flat_map(|f| encodings.clone().map(move |v| (f, v)))
            {
                let acts = if form == Form::WideSub { &subs } else { &acts };
                for tile in 1..=MAX_TILE {
                    let (mut a, mut b) = (TileOut::default(), TileOut::default());
                    let acts = &acts[..tile * nb];
                    // SAFETY: as above, and the CPU runs VNNI encoding `v` (`avx2_paths`);
                    // `acts` holds `tile` tokens of `nb` blocks.
                    unsafe {
                        group_dot(qtype, group, &unpacked, nb, acts, tile, form, v, &mut a);
                        crate::dot_avx2_k::group_dot(qtype, group, nb, acts, tile, form, &mut b);
                    }
                    for t in 0..tile {
                        let what = format!("{qtype} {form:?} vnni {v} tile {tile} token {t}");
                        if form == Form::F32 {
                            assert_eq!(f32_bits(&a.f32s[t]), f32_bits(&b.f32s[t]), "{what}");
                        } else {
                            assert_eq!(f64_bits(&a.f64s[t]), f64_bits(&b.f64s[t]), "{what}");
                        }
                    }
                }
            }
        }
    }
}
