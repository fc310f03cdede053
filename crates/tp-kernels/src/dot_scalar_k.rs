//! Portable integer dot products of one 8-row group of packed K-quant weights (Q2_K, Q3_K,
//! Q4_K, Q5_K, Q6_K)
//! with one token's Q8_K activations (f32 accumulation, or f64 sums of per-super-block f32
//! contributions). The reference the AVX2 K-quant kernels are tested against.

use crate::format::{f16_at, QuantType};
use crate::pack::{group_block_bytes, GROUP_ROWS};
use crate::pack_k::{q2k, q3k, q4k, q5k, q6k};
use crate::quantize_k::ActBlockK;
use crate::wide;

#[inline]
fn word(base: usize, w: usize, lane: usize) -> usize {
    base + (w * GROUP_ROWS + lane) * 4
}

#[inline]
fn pair_byte(blk: &[u8], base: usize, sub: usize, lane: usize) -> u8 {
    blk[base + ((sub / 2) * GROUP_ROWS + lane) * 2 + sub % 2]
}

/// Q4_K (`FIFTH = false`) or Q5_K: `lane`'s exact integer sums over super-block `blk`:
/// `Σ_sub sc · (q · x)` and `Σ_sub m · bsum32`.
fn q4k_sums<const FIFTH: bool>(blk: &[u8], a: &ActBlockK, lane: usize) -> (i32, i32) {
    let (mut isum, mut msum) = (0i32, 0i32);
    for c in 0..4 {
        let (mut lo, mut hi) = (0i32, 0i32);
        for w8 in 0..8 {
            let at = word(q4k::QS, 8 * c + w8, lane);
            let ah = word(q5k::QH, w8, lane);
            for (j, &byte) in blk[at..at + 4].iter().enumerate() {
                let l = 64 * c + 4 * w8 + j;
                let (mut ql, mut qh) = ((byte & 0x0F) as i32, (byte >> 4) as i32);
                if FIFTH {
                    let h = blk[ah + j] as i32;
                    ql |= ((h >> (2 * c)) & 1) << 4;
                    qh |= ((h >> (2 * c + 1)) & 1) << 4;
                }
                lo += ql * a.qs[l] as i32;
                hi += qh * a.qs[l + 32] as i32;
            }
        }
        isum += pair_byte(blk, q4k::SC, 2 * c, lane) as i32 * lo;
        isum += pair_byte(blk, q4k::SC, 2 * c + 1, lane) as i32 * hi;
        msum += pair_byte(blk, q4k::MIN, 2 * c, lane) as i32 * a.bsum32[2 * c] as i32;
        msum += pair_byte(blk, q4k::MIN, 2 * c + 1, lane) as i32 * a.bsum32[2 * c + 1] as i32;
    }
    (isum, msum)
}

/// Q2_K: `lane`'s exact integer sums over super-block `blk`: `Σ_sub sc · (q · x)` and
/// `Σ_sub m · bsum16`.
fn q2k_sums(blk: &[u8], a: &ActBlockK, lane: usize) -> (i32, i32) {
    let (mut isum, mut msum) = (0i32, 0i32);
    for h in 0..2 {
        for k in 0..4 {
            for half in 0..2 {
                let sub = 8 * h + 2 * k + half;
                let mut s = 0i32;
                for w8 in 4 * half..4 * half + 4 {
                    let at = word(q2k::QS, 8 * h + w8, lane);
                    for (j, &byte) in blk[at..at + 4].iter().enumerate() {
                        let q = ((byte >> (2 * k)) & 3) as i32;
                        s += q * a.qs[128 * h + 32 * k + 4 * w8 + j] as i32;
                    }
                }
                isum += pair_byte(blk, q2k::SC, sub, lane) as i32 * s;
                msum += pair_byte(blk, q2k::MIN, sub, lane) as i32 * a.bsum16[sub] as i32;
            }
        }
    }
    (isum, msum)
}

/// Q3_K: `lane`'s exact integer sum `Σ_sub sc · ((q - 4) · x)` over super-block `blk`
/// (`sc` the stored scale minus 32).
fn q3k_isum(blk: &[u8], a: &ActBlockK, lane: usize) -> i32 {
    let mut isum = 0i32;
    for h in 0..2 {
        for k in 0..4 {
            for half in 0..2 {
                let sub = 8 * h + 2 * k + half;
                let mut s = 0i32;
                for w8 in 4 * half..4 * half + 4 {
                    let at = word(q3k::QS, 8 * h + w8, lane);
                    let ah = word(q3k::HM, w8, lane);
                    for (j, &byte) in blk[at..at + 4].iter().enumerate() {
                        let low = ((byte >> (2 * k)) & 3) as i32;
                        let high = ((blk[ah + j] >> (4 * h + k)) & 1) as i32;
                        let q = (low | (high << 2)) - 4;
                        s += q * a.qs[128 * h + 32 * k + 4 * w8 + j] as i32;
                    }
                }
                isum += pair_byte(blk, q3k::SC, sub, lane) as i8 as i32 * s;
            }
        }
    }
    isum
}

/// Q6_K: `lane`'s exact integer sum `Σ_sub sc · ((q - 32) · x)` over super-block `blk`.
fn q6k_isum(blk: &[u8], a: &ActBlockK, lane: usize) -> i32 {
    let mut isum = 0i32;
    for h in 0..2 {
        for i in 0..8 {
            let wa = q6k::ql_word(16 * h + i) + 4 * lane;
            let wb = q6k::ql_word(16 * h + 8 + i) + 4 * lane;
            let wh = q6k::qh_word(8 * h + i) + 4 * lane;
            for j in 0..4 {
                let (a8, b8, h8) = (blk[wa + j], blk[wb + j], blk[wh + j]);
                let q = [
                    (a8 & 0x0F) | ((h8 & 3) << 4),
                    (b8 & 0x0F) | (((h8 >> 2) & 3) << 4),
                    (a8 >> 4) | (((h8 >> 4) & 3) << 4),
                    (b8 >> 4) | (((h8 >> 6) & 3) << 4),
                ];
                let l = 4 * i + j;
                for (k, &qk) in q.iter().enumerate() {
                    let sc = pair_byte(blk, q6k::SC, 8 * h + 2 * k + l / 16, lane);
                    let x = a.qs[128 * h + 32 * k + l] as i32;
                    isum += sc as i8 as i32 * (qk as i32 - 32) * x;
                }
            }
        }
    }
    isum
}

/// The formats with minimums (Q2_K, Q4_K, Q5_K): `lane`'s `(isum, msum, d, dmin)`.
fn min_sums(qtype: QuantType, blk: &[u8], a: &ActBlockK, lane: usize) -> (i32, i32, f32, f32) {
    let ((isum, msum), d, dmin) = match qtype {
        QuantType::Q2_K => (q2k_sums(blk, a, lane), q2k::D, q2k::DMIN),
        QuantType::Q5_K => (q4k_sums::<true>(blk, a, lane), q4k::D, q4k::DMIN),
        _ => (q4k_sums::<false>(blk, a, lane), q4k::D, q4k::DMIN),
    };
    (
        isum,
        msum,
        f16_at(blk, d + 2 * lane),
        f16_at(blk, dmin + 2 * lane),
    )
}

/// The 8 outputs (one per row of the group) for one token.
pub(crate) fn group_dot(qtype: QuantType, group: &[u8], acts: &[ActBlockK]) -> [f32; GROUP_ROWS] {
    let mut acc = [0.0f32; GROUP_ROWS];
    match qtype {
        QuantType::Q2_K | QuantType::Q4_K | QuantType::Q5_K => {
            for (blk, a) in group.chunks_exact(group_block_bytes(qtype)).zip(acts) {
                for (lane, out) in acc.iter_mut().enumerate() {
                    let (isum, msum, d, dmin) = min_sums(qtype, blk, a, lane);
                    *out += a.d * (d * isum as f32 - dmin * msum as f32);
                }
            }
        }
        QuantType::Q3_K => {
            for (blk, a) in group.chunks_exact(q3k::BYTES).zip(acts) {
                for (lane, out) in acc.iter_mut().enumerate() {
                    let isum = q3k_isum(blk, a, lane);
                    *out += a.d * f16_at(blk, q3k::D + 2 * lane) * isum as f32;
                }
            }
        }
        QuantType::Q6_K => {
            for (blk, a) in group.chunks_exact(q6k::BYTES).zip(acts) {
                for (lane, out) in acc.iter_mut().enumerate() {
                    let isum = q6k_isum(blk, a, lane);
                    *out += a.d * f16_at(blk, q6k::D + 2 * lane) * isum as f32;
                }
            }
        }
        _ => {}
    }
    acc
}

/// The 8 f64 sums of one token's per-super-block contributions (see `wide`), in order.
pub(crate) fn group_dot_wide(
    qtype: QuantType,
    group: &[u8],
    acts: &[ActBlockK],
) -> [f64; GROUP_ROWS] {
    let mut acc = [0.0f64; GROUP_ROWS];
    match qtype {
        QuantType::Q2_K | QuantType::Q4_K | QuantType::Q5_K => {
            for (blk, a) in group.chunks_exact(group_block_bytes(qtype)).zip(acts) {
                for (lane, out) in acc.iter_mut().enumerate() {
                    let (isum, msum, d, dmin) = min_sums(qtype, blk, a, lane);
                    *out += wide::block_q4_k(isum, msum, d, dmin, a.d) as f64;
                }
            }
        }
        QuantType::Q3_K => {
            for (blk, a) in group.chunks_exact(q3k::BYTES).zip(acts) {
                for (lane, out) in acc.iter_mut().enumerate() {
                    let isum = q3k_isum(blk, a, lane);
                    let d = f16_at(blk, q3k::D + 2 * lane);
                    *out += wide::block_plain(isum, d, a.d) as f64;
                }
            }
        }
        QuantType::Q6_K => {
            for (blk, a) in group.chunks_exact(q6k::BYTES).zip(acts) {
                for (lane, out) in acc.iter_mut().enumerate() {
                    let isum = q6k_isum(blk, a, lane);
                    let d = f16_at(blk, q6k::D + 2 * lane);
                    *out += wide::block_plain(isum, d, a.d) as f64;
                }
            }
        }
        _ => {}
    }
    acc
}
