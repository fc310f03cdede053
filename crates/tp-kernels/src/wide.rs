//! Split-invariant accumulation (`matmul_wide_acc`): each block's contribution to an output
//! is one f32 value that depends only on that block's weights and activations, and the
//! contributions are summed in f64. Splitting the columns at block boundaries (tensor-parallel
//! row-parallel layers) and adding the parts' f64 sums then gives the same values at every
//! split, up to f64 rounding, which in practice does not happen: `k` f32 values (24-bit
//! significands) whose magnitudes lie within a factor `2^s` of each other are multiples of the
//! smallest one's ulp and sum to less than `k · 2^s` times it, so every partial sum is exact in
//! f64 while `24 + s + log2 k <= 53`, e.g. `s <= 20` for 512 blocks. Even when a sum is
//! inexact, the f32 rounding of the result changes only if the f64 value lies within about
//! 2^-52 (relative) of an f32 rounding boundary.
//!
//! The exact per-block formulas, per output row, shared bit for bit by the AVX2 kernels and
//! the portable ones (`fma(a, b, c)` is one fused multiply-add with a single rounding; every
//! other operation is one IEEE f32 operation in the order written; `as f32` rounds to
//! nearest even; all integer sums are exact i32):
//! - Q4_0, Q8_0, Q5_0, IQ4_NL: `c = (isum as f32) * (d_w * d_x)` with `isum` the integer dot
//!   product of the weight quants (offsets `-8`/`-16` included, IQ4_NL's table values) and the
//!   Q8_0 activation quants;
//!   `d_w` the weight block's f16 scale, `d_x` the activation block's f16 scale (as f32).
//! - Q4_1, Q5_1: `c = fma(m_w, s_x, (isum as f32) * (d_w * d_x))` with `m_w` the block's f16
//!   minimum and `s_x = f16(d * Σq)` of the Q8_1 activation block.
//! - Q4_K, Q5_K, Q2_K: `c = d_x * fma(d_w, isum as f32, -(dmin_w * (msum as f32)))` with
//!   `isum = Σ_sub sc_sub · (q · x)_sub`, `msum = Σ_sub m_sub · bsum_sub` (`bsum32` for Q4_K
//!   and Q5_K, `bsum16` for Q2_K's 16-wide sub-blocks), `d_x` Q8_K's f32 scale.
//! - Q6_K, Q3_K, IQ4_XS: `c = (isum as f32) * (d_w * d_x)`,
//!   `isum = Σ_sub sc_sub · ((q - o) · x)_sub` with `o = 32` (Q6_K) or 4 (Q3_K, `sc` the
//!   stored 6-bit scale minus 32); IQ4_XS: `isum = Σ_sub sc_sub · (KVALUES_IQ4[q] · x)_sub`,
//!   `sc` the 6-bit scale minus 32.
//! - Dense f32/f16 (chunks of 32 columns from column 0 of the matrix; the last may be
//!   shorter, as if zero padded): 8 lanes, lane `i` = `fma` chain over the chunk's columns
//!   `i, i + 8, i + 16, i + 24` in that order starting from `+0.0`, then
//!   `c = ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`.
//!
//! Then per output: `acc = 0.0f64; for each block in column order { acc += c as f64 }`,
//! and finally `y += acc`.
//!
//! The K-quants' sub-block form (`QuantMatrix::from_ggml_sub_blocks`, for weights whose
//! shards start or end inside a super-block) forms one contribution per 32-wide sub-block
//! `j` of each super-block instead, with the same formulas restricted to the sub-block
//! (`isum_j`, `msum_j`: its one 32-wide (Q4_K, Q5_K, IQ4_XS), or for Q2_K, Q3_K and Q6_K its
//! two 16-wide scales)
//! and `d_x` replaced by the sub-block's own activation scale `ds_j` (activations quantized
//! per 32, as Q8_K does per 256). Sub-blocks outside the matrix's columns have `ds_j = 0` and
//! zero quants, so they contribute `±0`, which leaves an f64 sum that starts at `+0` unchanged.

/// Q4_0, Q8_0, Q5_0, IQ4_NL, Q3_K, Q6_K, IQ4_XS block contribution.
#[inline]
pub(crate) fn block_plain(isum: i32, d_w: f32, d_x: f32) -> f32 {
    isum as f32 * (d_w * d_x)
}

/// Q4_1 and Q5_1 block contribution.
#[inline]
pub(crate) fn block_q4_1(isum: i32, d_w: f32, d_x: f32, m_w: f32, s_x: f32) -> f32 {
    m_w.mul_add(s_x, isum as f32 * (d_w * d_x))
}

/// Q2_K, Q4_K and Q5_K super-block contribution.
#[inline]
pub(crate) fn block_q4_k(isum: i32, msum: i32, d_w: f32, dmin_w: f32, d_x: f32) -> f32 {
    d_x * d_w.mul_add(isum as f32, -(dmin_w * msum as f32))
}

/// Dense chunk contribution from the 8 lane sums.
#[inline]
pub(crate) fn chunk_sum(l: &[f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}
