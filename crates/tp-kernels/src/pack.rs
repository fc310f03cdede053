//! The interleaved in-memory layout of a quantized matrix: groups of 8 rows whose blocks are
//! stored side by side, so one 32-byte load holds the same 4 columns (Q8_0) or the same 4+4
//! columns (Q4_0/Q4_1 low and high nibbles) of all 8 rows, and one 16-byte load holds their
//! 8 scales.
//!
//! A group block (8 rows x 32 columns) is `8 * block_bytes` long, exactly the size of the 8
//! ggml blocks it came from:
//! - scales: `d` of rows 0..8 as 8 f16, then (Q4_1, Q5_1) `m` of rows 0..8 as 8 f16;
//! - quants: for each 4-byte word `w` of a ggml block's quants, the word of rows 0..8 in turn
//!   (`offset = (w * 8 + row) * 4`).
//!
//! Q5_0 is stored as Q4_0 with its `qh` as quant word 0, Q5_1 as Q4_1 likewise; IQ4_NL is
//! stored exactly as Q4_0 (its nibbles index a table instead of being offset by 8). K-quants have their own group
//! layout (see `pack_k`); groups and blocks are ordered the same way.
//!
//! Groups are laid out one after the other, each with all its blocks along the columns. When
//! `rows` is not a multiple of 8 the last group is padded with zero rows (scale 0).

use crate::format::QuantType;
use crate::pack_k;

/// Rows per interleaved group (one f32 lane per row in a 256-bit register).
pub(crate) const GROUP_ROWS: usize = 8;

/// Bytes of one group block (8 rows x one block of columns: 32, or 256 for K-quants).
pub(crate) fn group_block_bytes(qtype: QuantType) -> usize {
    match qtype {
        QuantType::Q2_K => pack_k::q2k::BYTES,
        QuantType::Q3_K => pack_k::q3k::BYTES,
        QuantType::Q4_K => pack_k::q4k::BYTES,
        QuantType::Q5_K => pack_k::q5k::BYTES,
        QuantType::Q6_K => pack_k::q6k::BYTES,
        QuantType::IQ4_XS => pack_k::iq4xs::BYTES,
        _ => GROUP_ROWS * qtype.block_bytes(),
    }
}

/// Bytes of the scale region at the start of a group block.
pub(crate) fn group_scale_bytes(qtype: QuantType) -> usize {
    GROUP_ROWS * qtype.scale_bytes()
}

/// Number of 8-row groups for `rows` rows.
pub(crate) fn groups(rows: usize) -> usize {
    rows.div_ceil(GROUP_ROWS)
}

/// Byte offsets, inside a group block, of `lane`'s f16 scale number `s` and its quant word `w`.
#[inline]
fn scale_offset(s: usize, lane: usize) -> usize {
    (s * GROUP_ROWS + lane) * 2
}

#[inline]
fn word_offset(qtype: QuantType, w: usize, lane: usize) -> usize {
    group_scale_bytes(qtype) + (w * GROUP_ROWS + lane) * 4
}

/// Repacks row-major ggml blocks (`rows * nb` blocks of `block_len` columns, already
/// length-checked) into groups.
pub(crate) fn pack(qtype: QuantType, rows: usize, nb: usize, ggml: &[u8]) -> Vec<u8> {
    let mut packed = vec![0u8; groups(rows) * nb * group_block_bytes(qtype)];
    pack_into(qtype, rows, nb, ggml, &mut packed);
    packed
}

/// [`pack`] into `packed` (`groups(rows) * nb` group blocks): rows packed in parts whose
/// starts are multiples of [`GROUP_ROWS`] fill consecutive parts of the whole's layout.
pub(crate) fn pack_into(qtype: QuantType, rows: usize, nb: usize, ggml: &[u8], packed: &mut [u8]) {
    let bb = qtype.block_bytes();
    let gb = group_block_bytes(qtype);
    for row in 0..rows {
        let (g, lane) = (row / GROUP_ROWS, row % GROUP_ROWS);
        for b in 0..nb {
            let src = &ggml[(row * nb + b) * bb..][..bb];
            let dst = &mut packed[(g * nb + b) * gb..][..gb];
            if qtype.is_k_quant() {
                pack_k::pack_block(qtype, lane, src, dst);
                continue;
            }
            for s in 0..qtype.scale_bytes() / 2 {
                let at = scale_offset(s, lane);
                dst[at..at + 2].copy_from_slice(&src[2 * s..2 * s + 2]);
            }
            for w in 0..qtype.quant_bytes() / 4 {
                let at = word_offset(qtype, w, lane);
                let from = qtype.scale_bytes() + 4 * w;
                dst[at..at + 4].copy_from_slice(&src[from..from + 4]);
            }
        }
    }
}

/// Rebuilds the ggml block `b` of `row` from the packed layout into `out` (`block_bytes` long).
pub(crate) fn unpack_block(
    qtype: QuantType,
    packed: &[u8],
    nb: usize,
    row: usize,
    b: usize,
    out: &mut [u8],
) {
    let gb = group_block_bytes(qtype);
    let (g, lane) = (row / GROUP_ROWS, row % GROUP_ROWS);
    let src = &packed[(g * nb + b) * gb..][..gb];
    if qtype.is_k_quant() {
        pack_k::unpack_block(qtype, lane, src, out);
        return;
    }
    for s in 0..qtype.scale_bytes() / 2 {
        let at = scale_offset(s, lane);
        out[2 * s..2 * s + 2].copy_from_slice(&src[at..at + 2]);
    }
    for w in 0..qtype.quant_bytes() / 4 {
        let at = word_offset(qtype, w, lane);
        let to = qtype.scale_bytes() + 4 * w;
        out[to..to + 4].copy_from_slice(&src[at..at + 4]);
    }
}

/// Rebuilds the row-major ggml bytes of the whole matrix.
pub(crate) fn unpack(qtype: QuantType, rows: usize, nb: usize, packed: &[u8]) -> Vec<u8> {
    let bb = qtype.block_bytes();
    let mut out = vec![0u8; rows * nb * bb];
    for row in 0..rows {
        for b in 0..nb {
            unpack_block(
                qtype,
                packed,
                nb,
                row,
                b,
                &mut out[(row * nb + b) * bb..][..bb],
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_unpack_round_trips_for_every_format_and_ragged_rows() {
        for qtype in crate::matrix::tests::ALL {
            for rows in [1usize, 3, 8, 9, 17] {
                let nb = 3;
                let bytes: Vec<u8> = (0..rows * nb * qtype.block_bytes())
                    .map(|i| (i * 7 + 3 + i / 251) as u8)
                    .collect();
                let packed = pack(qtype, rows, nb, &bytes);
                assert_eq!(packed.len(), groups(rows) * nb * group_block_bytes(qtype));
                assert_eq!(unpack(qtype, rows, nb, &packed), bytes);
            }
        }
    }
}
