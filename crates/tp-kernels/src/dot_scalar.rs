//! Portable integer dot products of one 8-row group of packed weights with one token's
//! quantized activations, with f32 accumulation (`matmul`) or per-block f32 contributions
//! summed in f64 (`matmul_wide_acc`). The reference the AVX2 kernels are tested against.

use crate::format::{f16_at, QuantType, KVALUES_IQ4, QK};
use crate::pack::{group_block_bytes, group_scale_bytes, GROUP_ROWS};
use crate::quantize::ActBlock;
use crate::wide;

/// The exact integer dot product of `lane`'s weights in group block `blk` with the
/// activation block `a` (Q4_0's `-8` and Q5_0's `-16` offsets included, IQ4_NL's nibbles
/// mapped through its table; Q4_1's and Q5_1's
/// minimum is applied by the caller).
fn block_isum(qtype: QuantType, blk: &[u8], a: &ActBlock, lane: usize) -> i32 {
    let qs = &blk[group_scale_bytes(qtype)..];
    match qtype {
        QuantType::Q4_0 | QuantType::Q4_1 => {
            let mut s = 0i32;
            for l in 0..4 {
                let word = &qs[(l * GROUP_ROWS + lane) * 4..][..4];
                for (j, &byte) in word.iter().enumerate() {
                    s += (byte & 0x0F) as i32 * a.qs[4 * l + j] as i32;
                    s += (byte >> 4) as i32 * a.qs[QK / 2 + 4 * l + j] as i32;
                }
            }
            if qtype == QuantType::Q4_0 {
                s - 8 * a.sum
            } else {
                s
            }
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let qh = u32::from_le_bytes([
                qs[lane * 4],
                qs[lane * 4 + 1],
                qs[lane * 4 + 2],
                qs[lane * 4 + 3],
            ]);
            let mut s = 0i32;
            for l in 0..4 {
                let word = &qs[((1 + l) * GROUP_ROWS + lane) * 4..][..4];
                for (j, &byte) in word.iter().enumerate() {
                    let e = 4 * l + j;
                    let h0 = ((qh >> e) & 1) as i32;
                    let h1 = ((qh >> (e + 16)) & 1) as i32;
                    s += ((byte & 0x0F) as i32 | (h0 << 4)) * a.qs[e] as i32;
                    s += ((byte >> 4) as i32 | (h1 << 4)) * a.qs[e + QK / 2] as i32;
                }
            }
            if qtype == QuantType::Q5_0 {
                s - 16 * a.sum
            } else {
                s
            }
        }
        QuantType::IQ4_NL => {
            let mut s = 0i32;
            for l in 0..4 {
                let word = &qs[(l * GROUP_ROWS + lane) * 4..][..4];
                for (j, &byte) in word.iter().enumerate() {
                    s += KVALUES_IQ4[(byte & 0x0F) as usize] as i32 * a.qs[4 * l + j] as i32;
                    s += KVALUES_IQ4[(byte >> 4) as usize] as i32 * a.qs[QK / 2 + 4 * l + j] as i32;
                }
            }
            s
        }
        QuantType::Q8_0 => {
            let mut s = 0i32;
            for c in 0..QK / 4 {
                let word = &qs[(c * GROUP_ROWS + lane) * 4..][..4];
                for (j, &byte) in word.iter().enumerate() {
                    s += byte as i8 as i32 * a.qs[4 * c + j] as i32;
                }
            }
            s
        }
        // K-quants have their own kernels (`dot_scalar_k`).
        QuantType::Q2_K
        | QuantType::Q3_K
        | QuantType::Q4_K
        | QuantType::Q5_K
        | QuantType::Q6_K
        | QuantType::IQ4_XS => 0,
    }
}

/// The 8 outputs (one per row of the group) for one token. `group` holds the group's
/// `acts.len()` group blocks; a shorter `group` just contributes fewer blocks. The f32 tail
/// is the AVX2 kernels' (`dot_avx2::q4_block_tail`, `plain_block_tail`) operation for
/// operation, fused multiply-adds included (`mul_add`), so every path gives these bits.
pub(crate) fn group_dot(qtype: QuantType, group: &[u8], acts: &[ActBlock]) -> [f32; GROUP_ROWS] {
    let gb = group_block_bytes(qtype);
    let mut acc = [0.0f32; GROUP_ROWS];
    let mut acc_min = [0.0f32; GROUP_ROWS];
    for (blk, a) in group.chunks_exact(gb).zip(acts) {
        for lane in 0..GROUP_ROWS {
            let isum = block_isum(qtype, blk, a, lane);
            let scale = f16_at(blk, 2 * lane) * a.d;
            acc[lane] = (isum as f32).mul_add(scale, acc[lane]);
            if qtype.has_min() {
                let m_w = f16_at(blk, 2 * (GROUP_ROWS + lane));
                acc_min[lane] = m_w.mul_add(a.s, acc_min[lane]);
            }
        }
    }
    for (a, m) in acc.iter_mut().zip(acc_min) {
        *a += m;
    }
    acc
}

/// The 8 f64 sums of one token's per-block contributions (see `wide`), blocks in order.
pub(crate) fn group_dot_wide(
    qtype: QuantType,
    group: &[u8],
    acts: &[ActBlock],
) -> [f64; GROUP_ROWS] {
    let gb = group_block_bytes(qtype);
    let mut acc = [0.0f64; GROUP_ROWS];
    for (blk, a) in group.chunks_exact(gb).zip(acts) {
        for (lane, out) in acc.iter_mut().enumerate() {
            let isum = block_isum(qtype, blk, a, lane);
            let d_w = f16_at(blk, 2 * lane);
            let c = if qtype.has_min() {
                let m_w = f16_at(blk, 2 * (GROUP_ROWS + lane));
                wide::block_q4_1(isum, d_w, a.d, m_w, a.s)
            } else {
                wide::block_plain(isum, d_w, a.d)
            };
            *out += c as f64;
        }
    }
    acc
}
