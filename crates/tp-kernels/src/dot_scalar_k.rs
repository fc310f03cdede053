//! Portable integer dot products of one 8-row group of packed K-quant weights (Q2_K, Q3_K,
//! Q4_K, Q5_K, Q6_K, and IQ4_XS)
//! with one token's Q8_K activations (f32 accumulation, f64 sums of per-super-block f32
//! contributions, or f64 sums of per-32-wide-sub-block contributions for the sub-block
//! form). The reference the SIMD K-quant kernels are tested against.

use crate::format::{f16_at, QuantType, KVALUES_IQ4};
use crate::pack::{group_block_bytes, GROUP_ROWS};
use crate::pack_k::{iq4xs, q2k, q3k, q4k, q5k, q6k};
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

/// Per 32-wide sub-block `j` of a super-block: the exact `Σ sc · (q · x)` (Q3_K and Q6_K with
/// their offsets applied) and `Σ m · bsum` over the sub-block's one (Q4_K, Q5_K) or two
/// (Q2_K, 16-wide scales) sub-blocks of scales.
type SubSums = ([i32; 8], [i32; 8]);

/// Q4_K (`FIFTH = false`) or Q5_K: `lane`'s sums over super-block `blk`.
fn q4k_sums<const FIFTH: bool>(blk: &[u8], a: &ActBlockK, lane: usize) -> SubSums {
    let (mut isum, mut msum) = ([0i32; 8], [0i32; 8]);
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
        for (s, dot) in [(2 * c, lo), (2 * c + 1, hi)] {
            isum[s] = pair_byte(blk, q4k::SC, s, lane) as i32 * dot;
            msum[s] = pair_byte(blk, q4k::MIN, s, lane) as i32 * a.bsum32[s] as i32;
        }
    }
    (isum, msum)
}

/// Q2_K: `lane`'s sums over super-block `blk` (minimums against `bsum16`).
fn q2k_sums(blk: &[u8], a: &ActBlockK, lane: usize) -> SubSums {
    let (mut isum, mut msum) = ([0i32; 8], [0i32; 8]);
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
                isum[sub / 2] += pair_byte(blk, q2k::SC, sub, lane) as i32 * s;
                msum[sub / 2] += pair_byte(blk, q2k::MIN, sub, lane) as i32 * a.bsum16[sub] as i32;
            }
        }
    }
    (isum, msum)
}

/// Q3_K: `lane`'s `Σ sc · ((q - 4) · x)` per 32-wide sub-block of `blk` (`sc` the stored
/// scale minus 32).
fn q3k_isum(blk: &[u8], a: &ActBlockK, lane: usize) -> [i32; 8] {
    let mut isum = [0i32; 8];
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
                isum[sub / 2] += pair_byte(blk, q3k::SC, sub, lane) as i8 as i32 * s;
            }
        }
    }
    isum
}

/// Q6_K: `lane`'s `Σ sc · ((q - 32) · x)` per 32-wide sub-block of `blk`.
fn q6k_isum(blk: &[u8], a: &ActBlockK, lane: usize) -> [i32; 8] {
    let mut isum = [0i32; 8];
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
                    isum[4 * h + k] += sc as i8 as i32 * (qk as i32 - 32) * x;
                }
            }
        }
    }
    isum
}

/// IQ4_XS: `lane`'s `Σ sc · (KVALUES_IQ4[q] · x)` per 32-wide sub-block of `blk` (`sc` the
/// stored 6-bit scale minus 32).
fn iq4xs_isum(blk: &[u8], a: &ActBlockK, lane: usize) -> [i32; 8] {
    let mut isum = [0i32; 8];
    for (j, out) in isum.iter_mut().enumerate() {
        let mut s = 0i32;
        for w4 in 0..4 {
            let at = word(iq4xs::QS, 4 * j + w4, lane);
            for (i, &byte) in blk[at..at + 4].iter().enumerate() {
                let l = 32 * j + 4 * w4 + i;
                s += KVALUES_IQ4[(byte & 0x0F) as usize] as i32 * a.qs[l] as i32;
                s += KVALUES_IQ4[(byte >> 4) as usize] as i32 * a.qs[l + 16] as i32;
            }
        }
        *out = blk[iq4xs::SC + GROUP_ROWS * j + lane] as i8 as i32 * s;
    }
    isum
}

/// `lane`'s sums over super-block `blk` and its f16 `d` and (formats with minimums) `dmin`
/// (0 for Q3_K, Q6_K and IQ4_XS, whose `msum`s are 0).
fn sub_sums(qtype: QuantType, blk: &[u8], a: &ActBlockK, lane: usize) -> (SubSums, f32, f32) {
    let at = |off: usize| f16_at(blk, off + 2 * lane);
    match qtype {
        QuantType::Q2_K => (q2k_sums(blk, a, lane), at(q2k::D), at(q2k::DMIN)),
        QuantType::Q4_K => (q4k_sums::<false>(blk, a, lane), at(q4k::D), at(q4k::DMIN)),
        QuantType::Q5_K => (q4k_sums::<true>(blk, a, lane), at(q4k::D), at(q4k::DMIN)),
        QuantType::Q3_K => ((q3k_isum(blk, a, lane), [0; 8]), at(q3k::D), 0.0),
        QuantType::IQ4_XS => ((iq4xs_isum(blk, a, lane), [0; 8]), at(iq4xs::D), 0.0),
        _ => ((q6k_isum(blk, a, lane), [0; 8]), at(q6k::D), 0.0),
    }
}

/// The formats with minimums (Q2_K, Q4_K, Q5_K).
fn has_min(qtype: QuantType) -> bool {
    matches!(qtype, QuantType::Q2_K | QuantType::Q4_K | QuantType::Q5_K)
}

/// Calls `f(lane, block, sums, d, dmin)` for every lane of every super-block of `group`.
fn each_block(
    qtype: QuantType,
    group: &[u8],
    acts: &[ActBlockK],
    mut f: impl FnMut(usize, &ActBlockK, SubSums, f32, f32),
) {
    for (blk, a) in group.chunks_exact(group_block_bytes(qtype)).zip(acts) {
        for lane in 0..GROUP_ROWS {
            let (sums, d, dmin) = sub_sums(qtype, blk, a, lane);
            f(lane, a, sums, d, dmin);
        }
    }
}

/// The 8 outputs (one per row of the group) for one token. The f32 tail is the AVX2
/// kernels' (`dot_avx2_k::min_tail`, `offset_tail`, `plain_block_tail`) operation for
/// operation, fused multiply-adds included (`mul_add`), so every path gives these bits.
pub(crate) fn group_dot(qtype: QuantType, group: &[u8], acts: &[ActBlockK]) -> [f32; GROUP_ROWS] {
    let mut acc = [0.0f32; GROUP_ROWS];
    each_block(qtype, group, acts, |lane, a, (is, ms), d, dmin| {
        let (isum, msum) = (is.iter().sum::<i32>(), ms.iter().sum::<i32>());
        acc[lane] = if has_min(qtype) {
            // fma(d_w, isum, -(dmin_w * msum)), then fma(d_x, that, acc).
            let v = d.mul_add(isum as f32, -(dmin * msum as f32));
            a.d.mul_add(v, acc[lane])
        } else {
            (isum as f32).mul_add(d * a.d, acc[lane])
        };
    });
    acc
}

/// The 8 f64 sums of one token's per-super-block contributions (see `wide`), or with `sub`
/// its per-32-wide-sub-block contributions (the sub-block form), in column order.
pub(crate) fn group_dot_wide(
    qtype: QuantType,
    group: &[u8],
    acts: &[ActBlockK],
    sub: bool,
) -> [f64; GROUP_ROWS] {
    let mut acc = [0.0f64; GROUP_ROWS];
    each_block(qtype, group, acts, |lane, a, (is, ms), d, dmin| {
        if sub {
            for j in 0..8 {
                acc[lane] += contribution(qtype, is[j], ms[j], d, dmin, a.ds[j]) as f64;
            }
        } else {
            let (isum, msum) = (is.iter().sum::<i32>(), ms.iter().sum::<i32>());
            acc[lane] += contribution(qtype, isum, msum, d, dmin, a.d) as f64;
        }
    });
    acc
}

/// One super-block's (or sub-block's) f32 contribution (see `wide`).
fn contribution(qtype: QuantType, isum: i32, msum: i32, d: f32, dmin: f32, d_x: f32) -> f32 {
    if has_min(qtype) {
        wide::block_q4_k(isum, msum, d, dmin, d_x)
    } else {
        wide::block_plain(isum, d, d_x)
    }
}
