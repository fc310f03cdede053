//! AVX-512 VNNI products of a Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or IQ4_NL matrix with many tokens
//! at once (prefill chunks, batched decode): the 16 lanes of a register hold 16 tokens of one
//! row, where the per-group kernels (`dot_avx512`) hold 8 rows of one token twice over.
//!
//! Why: per 32-wide block each (row, token) output needs an f32 tail (scale, convert, fused
//! multiply-add, and for Q4_1/Q5_1 the minimum's term) after its integer dot product. With
//! rows in the lanes the tail runs 8 wide for 4 `vpdpbusd` of one token; with tokens in the
//! lanes it runs 16 wide for 8 `vpdpbusd` of 8 rows, and the weights are unpacked once per
//! group for all the tokens instead of once per tile of 4.
//!
//! Layouts (all in 64-byte vectors):
//! - Tokens (`transpose`), per chunk of 16 tokens and block `b`, [`ACT_VECS`] vectors: for
//!   each 4-column word `k < 8` of the block, lane `t` holds token `t`'s word `k` (its quants
//!   `4k..4k + 4`) as unsigned bytes `x + 128`; then the tokens' scales `d` (f32) and the
//!   Q8_1 sums `s` (f32). Tokens past the end of the call are zeros.
//! - Weights (`unpack`), per group block, [`W_VECS`] vectors: the quants of the 8 rows as
//!   signed bytes with the format's offset taken off, word `k` of row `r` at 32-bit index
//!   `8k + r` (Q4_0: nibble - 8; Q4_1: the nibbles; Q5_0: the 5-bit value - 16; Q5_1: the
//!   5-bit value; Q8_0: the quants as stored; IQ4_NL: the nibble's entry of the non-linear
//!   table, looked up 64 at a time by a byte shuffle); then the rows' `d` as f32 (lanes
//!   0..8) and `m` (lanes 8..16; Q4_1/Q5_1); then, as i32 in lanes 0..8, each row's `-128 *
//!   sum(w)` over the block's 32 signed quants `w`.
//!
//! The kernel broadcasts a row's word from memory (the signed operand of `vpdpbusd`, so the
//! broadcast folds into the instruction) against a token vector (the unsigned operand):
//! `vpdpbusd` adds each group of 4 exact byte products, so a lane's i32, started at the
//! row's `-128 * sum(w)` and after the block's 8 words, is `sum((x + 128) * w) - 128 *
//! sum(w)` = `sum(x * w)`, the scalar `isum` exactly (offset included). The f32
//! and f64 arithmetic per (row, token, block) is then the AVX2 tail's operation for
//! operation (`q4_block_tail`: `scale = d_w * d_x`, `acc = fma(isum as f32, scale, acc)`,
//! `acc_min = fma(m_w, s_x, acc_min)`, summed at the end; the wide form `c` as in `wide`), so
//! `matmul` gives the AVX2 bits and `matmul_wide_acc` the scalar bits, whatever the batch.

use crate::expand::Expanded;
use crate::format::{QuantType, KVALUES_IQ4};
use crate::pack::{group_block_bytes, group_scale_bytes, GROUP_ROWS};
use crate::quantize::ActBlock;
use std::arch::x86_64::*;

/// Tokens per chunk: one per 32-bit lane of a 512-bit register.
pub(crate) const LANES: usize = 16;
/// Vectors per (chunk, block) of transposed activations: 8 words, `d`, `s`.
pub(crate) const ACT_VECS: usize = 10;
/// Vectors per unpacked group block: 4 of quants (8 rows x 32 bytes), 1 of scales, 1 of
/// the rows' corrections `-128 * sum(w)`.
pub(crate) const W_VECS: usize = 6;

/// Whether this module has kernels for `qtype`.
pub(crate) fn supports(qtype: QuantType) -> bool {
    use QuantType::*;
    matches!(qtype, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | IQ4_NL)
}

/// One chunk's results: `f32s[r]` the 16 tokens' outputs of row `r` (`matmul`), or `f64s[r]`
/// their f64 sums of block contributions (`matmul_wide_acc`).
pub(crate) struct ChunkOut {
    pub f32s: [[f32; LANES]; GROUP_ROWS],
    pub f64s: [[f64; LANES]; GROUP_ROWS],
}

impl Default for ChunkOut {
    fn default() -> Self {
        ChunkOut {
            f32s: [[0.0; LANES]; GROUP_ROWS],
            f64s: [[0.0; LANES]; GROUP_ROWS],
        }
    }
}

/// The many-token kernels of one activation kind (Q8_0-style blocks here, Q8_K blocks in
/// `gemm_avx512_k`, `gemm_avx512_k4` and `gemm_avx512_k23`: Q2_K to Q6_K), as `QuantMatrix`
/// drives them: transpose a chunk of tokens, unpack a group, run a group against a chunk.
pub(crate) trait TokenLanes: Sized {
    /// Whether there are kernels for `qtype` (and for `form`: the sub-block form has none).
    fn supports(qtype: QuantType, form: crate::tile::Form) -> bool;
    /// Vectors per (chunk, block) of transposed activations.
    fn act_vecs(qtype: QuantType) -> usize;
    /// Vectors per unpacked group block.
    fn w_vecs(qtype: QuantType) -> usize;
    /// Lays out up to 16 tokens of `nb` blocks each into `out` (`nb * act_vecs` vectors).
    fn transpose(qtype: QuantType, acts: &[Self], nb: usize, out: &mut [Expanded]);
    /// Unpacks one group of `nb` blocks into `out` (`nb * w_vecs` vectors).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `supports(qtype)`;
    /// `group` holds `nb` group blocks of `qtype`; `out.len() >= nb * w_vecs(qtype)`.
    unsafe fn unpack(qtype: QuantType, group: &[u8], nb: usize, out: &mut [Expanded]);
    /// One unpacked group against one transposed chunk, into `out.f32s` or (`wide`)
    /// `out.f64s`.
    ///
    /// # Safety
    /// As for `unpack`; `w` and `x` are one group's and one chunk's vectors for `nb` blocks.
    unsafe fn group_chunk(
        qtype: QuantType,
        w: &[Expanded],
        x: &[Expanded],
        nb: usize,
        wide: bool,
        out: &mut ChunkOut,
    );
}

impl TokenLanes for ActBlock {
    fn supports(qtype: QuantType, _form: crate::tile::Form) -> bool {
        supports(qtype)
    }
    fn act_vecs(_: QuantType) -> usize {
        ACT_VECS
    }
    fn w_vecs(_: QuantType) -> usize {
        W_VECS
    }
    fn transpose(qtype: QuantType, acts: &[Self], nb: usize, out: &mut [Expanded]) {
        transpose(qtype, acts, nb, out)
    }
    unsafe fn unpack(qtype: QuantType, group: &[u8], nb: usize, out: &mut [Expanded]) {
        // SAFETY: the caller's promise.
        unsafe { unpack(qtype, group, nb, out) }
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
        unsafe { group_chunk(qtype, w, x, nb, wide, out) }
    }
}

/// Lays out `tokens` (1..=16) tokens of `nb` blocks each (`acts`, token-major) into `out`
/// (`nb * ACT_VECS` vectors), zeros for the missing lanes; the layout is the same for every
/// format (each format's offset is in its unpacked weights).
pub(crate) fn transpose(_qtype: QuantType, acts: &[ActBlock], nb: usize, out: &mut [Expanded]) {
    let tokens = acts.len() / nb.max(1);
    // `x + 128` as an unsigned byte: the sign bit flipped.
    let u = |q: i8| q as u8 ^ 0x80;
    for (b, o) in out.chunks_exact_mut(ACT_VECS).enumerate().take(nb) {
        o.fill(Expanded::default());
        for t in 0..tokens.min(LANES) {
            let a = &acts[t * nb + b];
            for (k, v) in o.iter_mut().enumerate().take(8) {
                let q = &a.qs[4 * k..4 * k + 4];
                v.0[t] = i32::from_le_bytes([u(q[0]), u(q[1]), u(q[2]), u(q[3])]);
            }
            o[8].0[t] = a.d.to_bits() as i32;
            o[9].0[t] = a.s.to_bits() as i32;
        }
    }
}

/// Unpacks one group (`nb` group blocks of `qtype` at `group`) into `out`
/// (`nb * W_VECS` vectors).
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `qtype` is one
/// [`supports`] accepts; `group.len() >= nb * group_block_bytes(qtype)`;
/// `out.len() >= nb * W_VECS`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn unpack(qtype: QuantType, group: &[u8], nb: usize, out: &mut [Expanded]) {
    let sb = group_scale_bytes(qtype);
    let low4 = _mm512_set1_epi8(0x0F);
    let fifth = _mm512_set1_epi8(0x10);
    let eight = _mm512_set1_epi8(8);
    // Q5: `spread[k]` copies byte `k` of each 32-bit lane (a row's fifth bits of columns
    // 8k..8k + 8) to its 4 bytes; byte j of the lane then tests bit j (lanes 0..8: word 2m
    // of the vector, columns 8k + j) or bit 4 + j (lanes 8..16: word 2m + 1, columns
    // 8k + 4 + j).
    let spread: [__m512i; 4] = std::array::from_fn(|k| {
        let k = 0x0101_0101 * k as i32;
        _mm512_set4_epi32(0x0C0C_0C0C + k, 0x0808_0808 + k, 0x0404_0404 + k, k)
    });
    let select = _mm512_mask_blend_epi32(
        0xFF00,
        _mm512_set1_epi32(0x0804_0201),
        _mm512_set1_epi32(0x8040_2010_u32 as i32),
    );
    // The closures below get `blk`, a group block of `qtype` inside `group` (the caller's
    // promise, passed on by `unpack_blocks`): its quants are the bytes from `sb` (Q5: the
    // 32 bytes of fifth bits, then 128 bytes of nibbles).
    let ld = |p: *const u8| {
        // SAFETY: called only with the start of 64 of a block's quant bytes (below).
        unsafe { _mm512_loadu_si512(p as *const __m512i) }
    };
    let nibbles = |blk: *const u8| -> [__m512i; 4] {
        // Q4_0 / Q4_1: words 2m, 2m + 1 of the low nibbles are words 2m, 2m + 1 of the
        // block (columns 8m..); of the high nibbles, words 4 + 2m, 5 + 2m.
        let q = blk.wrapping_add(sb);
        let (w0, w1) = (ld(q), ld(q.wrapping_add(64)));
        let hi = |w: __m512i| _mm512_and_si512(_mm512_srli_epi16::<4>(w), low4);
        [
            _mm512_and_si512(w0, low4),
            _mm512_and_si512(w1, low4),
            hi(w0),
            hi(w1),
        ]
    };
    // Q5: the nibbles and, per byte, whether the fifth bit is set.
    let five = |blk: *const u8, m: usize| {
        // SAFETY: the block's 32 bytes of fifth bits.
        let qh = unsafe { _mm256_loadu_si256(blk.wrapping_add(sb) as *const __m256i) };
        let qh = _mm512_broadcast_i64x4(qh);
        let w = ld(blk.wrapping_add(sb + 32 + 64 * m));
        let bits_lo = _mm512_shuffle_epi8(qh, spread[m]);
        let bits_hi = _mm512_shuffle_epi8(qh, spread[2 + m]);
        let lo = _mm512_and_si512(w, low4);
        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), low4);
        (lo, bits_lo, hi, bits_hi)
    };
    let o = out.as_mut_ptr() as *mut __m512i;
    // SAFETY: forwarded from the caller (features, `group` and `out` lengths).
    unsafe {
        match qtype {
            QuantType::Q8_0 => unpack_blocks(qtype, group, nb, o, |blk| {
                let q = blk.add(sb);
                std::array::from_fn(|j| ld(q.add(64 * j)))
            }),
            QuantType::Q5_0 => unpack_blocks(qtype, group, nb, o, |blk| {
                // value - 16: the nibble less 16 where the fifth bit is clear.
                let mut v = [_mm512_setzero_si512(); 4];
                for m in 0..2 {
                    let (lo, bits_lo, hi, bits_hi) = five(blk, m);
                    let sub = |x, bits| {
                        _mm512_mask_sub_epi8(x, _mm512_testn_epi8_mask(bits, select), x, fifth)
                    };
                    v[m] = sub(lo, bits_lo);
                    v[2 + m] = sub(hi, bits_hi);
                }
                v
            }),
            QuantType::Q5_1 => unpack_blocks(qtype, group, nb, o, |blk| {
                let mut v = [_mm512_setzero_si512(); 4];
                for m in 0..2 {
                    let (lo, bits_lo, hi, bits_hi) = five(blk, m);
                    let add = |x, bits| {
                        _mm512_mask_add_epi8(x, _mm512_test_epi8_mask(bits, select), x, fifth)
                    };
                    v[m] = add(lo, bits_lo);
                    v[2 + m] = add(hi, bits_hi);
                }
                v
            }),
            QuantType::Q4_0 => unpack_blocks(qtype, group, nb, o, |blk| {
                nibbles(blk).map(|v| _mm512_sub_epi8(v, eight))
            }),
            QuantType::IQ4_NL => {
                // The 16 table entries in each 128-bit lane: a byte shuffle by the nibble
                // (0..16, high bit clear) is the lookup.
                let table =
                    _mm512_broadcast_i32x4(_mm_loadu_si128(KVALUES_IQ4.as_ptr() as *const __m128i));
                unpack_blocks(qtype, group, nb, o, |blk| {
                    nibbles(blk).map(|v| _mm512_shuffle_epi8(table, v))
                })
            }
            _ => unpack_blocks(qtype, group, nb, o, nibbles),
        }
    }
}

/// How many group blocks ahead `unpack` prefetches the packed weights.
const PREFETCH_BLOCKS: usize = 4;

/// [`unpack`]'s loop over the blocks, `quants` giving a block's 4 vectors of signed quants
/// (the block's bytes at its argument); it adds the scales and the corrections.
///
/// # Safety
/// As for [`unpack`] (`o` is `out`'s start); `quants` reads only inside the block it gets.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_blocks(
    qtype: QuantType,
    group: &[u8],
    nb: usize,
    o: *mut __m512i,
    quants: impl Fn(*const u8) -> [__m512i; 4],
) {
    let gb = group_block_bytes(qtype);
    let has_min = qtype.has_min();
    let unsigned128 = _mm512_set1_epi8(-128);
    let g = group.as_ptr();
    // SAFETY: the caller guarantees the features and the lengths: block `b` reads
    // `gb` bytes at `g + b * gb` (scales at 0 and 16, quants from the scale bytes) and
    // writes the `W_VECS` vectors at `o + b * W_VECS`.
    unsafe {
        for b in 0..nb {
            let blk = g.add(b * gb);
            let dst = o.add(b * W_VECS);
            // The bytes of the block PREFETCH_BLOCKS ahead (maybe past the group: a hint).
            let ahead = blk.wrapping_add(PREFETCH_BLOCKS * gb);
            for line in (0..gb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
            }
            let v = quants(blk);
            for (j, &v) in v.iter().enumerate() {
                _mm512_store_si512(dst.add(j), v);
            }
            // Lane `l` of `t`: 128 times the sum of the 8 signed quants of 32-bit lanes `l`
            // of the 4 vectors; row `r` owns lanes `r` and `8 + r`.
            let dp = |a, b| {
                _mm512_dpbusd_epi32(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), unsigned128, a),
                    unsigned128,
                    b,
                )
            };
            let t = _mm512_add_epi32(dp(v[0], v[1]), dp(v[2], v[3]));
            let rows =
                _mm256_add_epi32(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64::<1>(t));
            let corr = _mm256_sub_epi32(_mm256_setzero_si256(), rows);
            _mm512_store_si512(dst.add(5), _mm512_zextsi256_si512(corr));
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let m = if has_min {
                _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i))
            } else {
                _mm256_setzero_ps()
            };
            let s = _mm512_insertf64x4::<1>(
                _mm512_castpd256_pd512(_mm256_castps_pd(d)),
                _mm256_castps_pd(m),
            );
            _mm512_store_pd(dst.add(4) as *mut f64, s);
        }
    }
}

/// One unpacked group (`w`, from [`unpack`]) against one chunk of 16 transposed tokens
/// (`x`, from [`transpose`]) over `nb` blocks, into `out.f32s` or (`wide`) `out.f64s`.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI;
/// `w.len() >= nb * W_VECS`, `x.len() >= nb * ACT_VECS`.
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
    // SAFETY: forwarded from the caller.
    unsafe {
        match (qtype.has_min(), wide) {
            (true, false) => chunk::<true, false>(w, x, nb, out),
            (true, true) => chunk::<true, true>(w, x, nb, out),
            (false, false) => chunk::<false, false>(w, x, nb, out),
            (false, true) => chunk::<false, true>(w, x, nb, out),
        }
    }
}

/// [`group_chunk`] for one format family: `MIN` (Q4_1, Q5_1), `WIDE` (f64 sums of
/// per-block contributions).
///
/// # Safety
/// As for [`group_chunk`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn chunk<const MIN: bool, const WIDE: bool>(
    w: *const Expanded,
    x: *const Expanded,
    nb: usize,
    out: &mut ChunkOut,
) {
    // SAFETY: block `b` reads the `W_VECS` vectors at `w + b * W_VECS` and the `ACT_VECS`
    // at `x + b * ACT_VECS`, inside the slices the caller passed.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); GROUP_ROWS];
        let mut acc_min = [_mm512_setzero_ps(); GROUP_ROWS];
        let mut wlo = [_mm512_setzero_pd(); GROUP_ROWS];
        let mut whi = [_mm512_setzero_pd(); GROUP_ROWS];
        for b in 0..nb {
            let wb = w.add(b * W_VECS) as *const i32;
            let xb = x.add(b * ACT_VECS) as *const __m512i;
            // Each row's sum starts at its correction `-128 * sum(w)`.
            let corr = wb.add(80);
            let mut s: [__m512i; GROUP_ROWS] =
                std::array::from_fn(|r| _mm512_set1_epi32(*corr.add(r)));
            for k in 0..8 {
                let xv = _mm512_load_si512(xb.add(k));
                for (r, s) in s.iter_mut().enumerate() {
                    let wv = _mm512_set1_epi32(*wb.add(8 * k + r));
                    *s = _mm512_dpbusd_epi32(*s, xv, wv);
                }
            }
            let dx = _mm512_load_ps(xb.add(8) as *const f32);
            let sx = _mm512_load_ps(xb.add(9) as *const f32);
            let scales = wb.add(64) as *const f32;
            for (r, &sr) in s.iter().enumerate() {
                let scale = _mm512_mul_ps(_mm512_set1_ps(*scales.add(r)), dx);
                if WIDE {
                    let mut c = _mm512_mul_ps(_mm512_cvtepi32_ps(sr), scale);
                    if MIN {
                        c = _mm512_fmadd_ps(_mm512_set1_ps(*scales.add(8 + r)), sx, c);
                    }
                    let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(c));
                    let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                        _mm512_castps_pd(c),
                    )));
                    wlo[r] = _mm512_add_pd(wlo[r], lo);
                    whi[r] = _mm512_add_pd(whi[r], hi);
                } else {
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), scale, acc[r]);
                    if MIN {
                        let m = _mm512_set1_ps(*scales.add(8 + r));
                        acc_min[r] = _mm512_fmadd_ps(m, sx, acc_min[r]);
                    }
                }
            }
        }
        for r in 0..GROUP_ROWS {
            if WIDE {
                let o = out.f64s[r].as_mut_ptr();
                _mm512_storeu_pd(o, wlo[r]);
                _mm512_storeu_pd(o.add(8), whi[r]);
            } else {
                let a = if MIN {
                    _mm512_add_ps(acc[r], acc_min[r])
                } else {
                    acc[r]
                };
                _mm512_storeu_ps(out.f32s[r].as_mut_ptr(), a);
            }
        }
    }
}
