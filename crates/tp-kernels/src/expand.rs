//! Activation words laid out for the AVX-512 kernels, built once per product call: one
//! 64-byte vector per pair of 4-byte activation words `(a, b)`, word `a` repeated in 32-bit
//! lanes 0..8 and word `b` in lanes 8..16, matching a 64-byte weight load that holds two
//! 4-column words of the 8 rows of a group. Every group of the matrix reuses them, so the
//! kernels' inner loop needs no shuffle: `vpdpbusd` takes the vector straight from memory.

use crate::format::QuantType;
use crate::quantize::ActBlock;
use crate::quantize_k::ActBlockK;

/// One 64-byte, 64-aligned vector of 16 activation words (4 i8 each, as i32 bit patterns).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(64))]
pub(crate) struct Expanded(pub [i32; 16]);

/// Vectors per 32-wide activation block: pairs (0, 1), (2, 3), (4, 5), (6, 7).
pub(crate) const PER_BLOCK: usize = 4;
/// Vectors per Q8_K block: 32 pairs (see [`expand_k`]).
pub(crate) const PER_BLOCK_K: usize = 32;

#[inline]
fn word(qs: &[i8], w: usize) -> i32 {
    i32::from_le_bytes([
        qs[4 * w] as u8,
        qs[4 * w + 1] as u8,
        qs[4 * w + 2] as u8,
        qs[4 * w + 3] as u8,
    ])
}

#[inline]
fn pair(qs: &[i8], a: usize, b: usize) -> Expanded {
    let (wa, wb) = (word(qs, a), word(qs, b));
    let mut e = [wa; 16];
    e[8..].fill(wb);
    Expanded(e)
}

/// `out[k]` = pair `(2k, 2k + 1)` of the block's 8 words (`out.len() == PER_BLOCK`).
pub(crate) fn expand(a: &ActBlock, out: &mut [Expanded]) {
    for (k, o) in out.iter_mut().enumerate().take(PER_BLOCK) {
        *o = pair(&a.qs, 2 * k, 2 * k + 1);
    }
}

/// `out[k]` (`out.len() == PER_BLOCK_K`) for a Q8_K block: Q2_K, Q3_K, Q4_K and Q5_K read
/// pair `(2k, 2k + 1)` of the block's 64 words; Q6_K reads, for 64-byte chunk `q < 4` and `i < 8`, pair
/// `(16q + i, 16q + 8 + i)` at `k = 8q + i`.
pub(crate) fn expand_k(qtype: QuantType, a: &ActBlockK, out: &mut [Expanded]) {
    for (k, o) in out.iter_mut().enumerate().take(PER_BLOCK_K) {
        *o = if qtype == QuantType::Q6_K {
            let (q, i) = (k / 8, k % 8);
            pair(&a.qs, 16 * q + i, 16 * q + 8 + i)
        } else {
            pair(&a.qs, 2 * k, 2 * k + 1)
        };
    }
}
