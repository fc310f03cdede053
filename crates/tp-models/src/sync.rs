//! How the row-parallel partial sums are summed over the tp group: exactly (f64 all-reduce, the
//! same bits at every tp) or compressed (8-bit blocks, all-gathered, summed in rank order).
//!
//! The compressed form is distributed-llama's idea for slow links: each rank quantizes its
//! partial sums in blocks of [`Q8_BLOCK`] values to one f32 scale plus one i8 per value
//! (1.125 bytes per value instead of 8), the blocks are all-gathered, and every rank
//! dequantizes and adds all ranks' blocks in rank order, its own included. Every rank therefore
//! holds the same bits (R10 across ranks), but the result depends on tp (quantization error),
//! so logits are not tp-invariant in this mode.

use crate::error::Result;
use crate::profile::Profile;
use tp_comm::{CommExt, Group, ReduceOp};

/// Values per quantization block (one scale each).
pub const Q8_BLOCK: usize = 32;

/// How partial sums of row-parallel products travel between ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SyncMode {
    /// f64 all-reduce: exact, the same bits at every tp (the default).
    #[default]
    Exact,
    /// 8-bit blocks with an f32 scale, all-gathered: ~7x fewer bytes than f64, lossy.
    Q8,
}

impl SyncMode {
    /// Bytes one rank contributes for `values` partial sums.
    pub fn bytes_per_rank(self, values: usize) -> usize {
        match self {
            SyncMode::Exact => values * 8,
            SyncMode::Q8 => q8_len(values),
        }
    }
}

/// Length in bytes of `values` quantized: per block a 4-byte scale and one byte per value.
pub fn q8_len(values: usize) -> usize {
    values.div_ceil(Q8_BLOCK) * 4 + values
}

/// Quantizes `x` into `out` (`q8_len(x.len())` bytes): per block of up to [`Q8_BLOCK`] values
/// the f32 scale `max|x| / 127` (little-endian), then `round(x / scale)` as i8.
pub fn quantize_q8(x: &[f64], out: &mut [u8]) {
    debug_assert_eq!(out.len(), q8_len(x.len()));
    let mut at = 0;
    for block in x.chunks(Q8_BLOCK) {
        let amax = block.iter().fold(0f64, |m, v| m.max(v.abs()));
        let scale = (amax / 127.0) as f32;
        out[at..at + 4].copy_from_slice(&scale.to_le_bytes());
        at += 4;
        let inv = if scale > 0.0 {
            1.0 / f64::from(scale)
        } else {
            0.0
        };
        for v in block {
            // |v * inv| <= 127 up to the f32 rounding of the scale; clamp keeps it in range.
            let q = (v * inv).round().clamp(-127.0, 127.0) as i8;
            out[at] = q as u8;
            at += 1;
        }
    }
}

/// Adds the dequantized values of `q` (as written by [`quantize_q8`] for `out.len()` values)
/// to `out`.
pub fn add_dequantized_q8(q: &[u8], out: &mut [f64]) {
    debug_assert_eq!(q.len(), q8_len(out.len()));
    let mut at = 0;
    for block in out.chunks_mut(Q8_BLOCK) {
        let scale = f32::from_le_bytes([q[at], q[at + 1], q[at + 2], q[at + 3]]);
        at += 4;
        let scale = f64::from(scale);
        for v in block {
            *v += f64::from(q[at] as i8) * scale;
            at += 1;
        }
    }
}

/// g of a row-parallel product: sums every rank's `partial` over `group` into `partial`.
pub(crate) fn sum_partials(
    mode: SyncMode,
    partial: &mut [f64],
    group: &Group,
    prof: &mut Profile,
) -> Result<()> {
    let ranks = group.size();
    if ranks == 1 {
        return Ok(());
    }
    match mode {
        SyncMode::Exact => {
            prof.all_reduce(group, |g| g.all_reduce(partial, ReduceOp::Sum))?;
            prof.sent_all_reduce(std::mem::size_of_val(partial), ranks);
        }
        SyncMode::Q8 => {
            let len = q8_len(partial.len());
            let mut mine = vec![0u8; len]; // [blocks, 4 + Q8_BLOCK] bytes
            quantize_q8(partial, &mut mine);
            let mut all = vec![0u8; len * ranks]; // [ranks, len]
            prof.all_reduce(group, |g| g.all_gather(&mine, &mut all))?;
            prof.sent_all_gather(mine.len(), ranks);
            partial.fill(0.0);
            for q in all.chunks_exact(len) {
                add_dequantized_q8(q, partial);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_count_one_scale_per_block() {
        assert_eq!(q8_len(0), 0);
        assert_eq!(q8_len(1), 5);
        assert_eq!(q8_len(32), 36);
        assert_eq!(q8_len(33), 41);
        assert_eq!(SyncMode::Q8.bytes_per_rank(576), 648);
        assert_eq!(SyncMode::Exact.bytes_per_rank(576), 4608);
    }

    #[test]
    fn round_trip_error_is_within_half_a_step_per_block() {
        let mut rng = tp_spec::Rng::new(0x2545_f491_4f6c_dd1d);
        let mut next = || rng.unit_f64() * 2.0 - 1.0;
        for len in [1, 7, 32, 33, 100, 576] {
            let x: Vec<f64> = (0..len).map(|i| next() * (1.0 + i as f64)).collect();
            let mut q = vec![0u8; q8_len(len)];
            quantize_q8(&x, &mut q);
            let mut back = vec![0f64; len];
            add_dequantized_q8(&q, &mut back);
            for (b, (xs, ys)) in x.chunks(Q8_BLOCK).zip(back.chunks(Q8_BLOCK)).enumerate() {
                let amax = xs.iter().fold(0f64, |m, v| m.max(v.abs()));
                let step = amax / 127.0;
                for (a, c) in xs.iter().zip(ys) {
                    assert!(
                        (a - c).abs() <= step * 0.5 + amax * 1e-6,
                        "len {len} block {b}: {a} -> {c} (step {step})"
                    );
                }
            }
        }
    }

    #[test]
    fn zeros_stay_zero_and_extremes_keep_their_sign() {
        let x = [0.0, -3.0, 3.0, 1e-30];
        let mut q = vec![0u8; q8_len(x.len())];
        quantize_q8(&x, &mut q);
        let mut back = vec![0f64; x.len()];
        add_dequantized_q8(&q, &mut back);
        assert_eq!(back[0], 0.0);
        assert!((back[1] + 3.0).abs() < 1e-6 && (back[2] - 3.0).abs() < 1e-6);
        let zero = [0.0; 40];
        let mut q = vec![0xffu8; q8_len(zero.len())];
        quantize_q8(&zero, &mut q);
        let mut back = vec![0f64; zero.len()];
        add_dequantized_q8(&q, &mut back);
        assert!(back.iter().all(|v| *v == 0.0));
    }
}
