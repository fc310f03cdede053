//! The interleaved layout of K-quant matrices (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and IQ4_XS): like `pack`,
//! 8 rows per group and quants as 4-byte words interleaved row by row, with the packed
//! scales and mins decoded at load into bytes laid out for the kernels. A group super-block
//! (8 rows x 256 columns):
//!
//! - Q2_K, 800 bytes (ggml: 8 x 84): `d` x 8 (f16), `dmin` x 8 (f16), the 4-bit scales as
//!   `[pair p < 8][row][2]` u8 (sub-blocks `2p`, `2p + 1`), the mins in the same layout, then
//!   the 64 `qs` bytes of each row as 16 words `[w][row][4]`.
//! - Q3_K, 912 bytes (ggml: 8 x 110): `d` x 8 (f16), the scales minus 32 as
//!   `[pair p < 8][row][2]` i8, the 32 `hmask` bytes of each row as 8 words `[w][row][4]`,
//!   then the 64 `qs` bytes as 16 words.
//! - Q4_K, 1184 bytes (ggml: 8 x 144): `d` x 8 (f16), `dmin` x 8 (f16), scales as
//!   `[pair p < 4][row][2]` u8 (sub-blocks `2p`, `2p + 1`), mins in the same layout, then the
//!   128 quant bytes of each row as 32 words `[w][row][4]`.
//! - Q5_K, 1440 bytes (ggml: 8 x 176): Q4_K's layout, then the 32 `qh` bytes of each row as
//!   8 words `[w][row][4]`.
//! - Q6_K, 1680 bytes (same as ggml): `d` x 8 (f16), scales as `[pair p < 8][row][2]` i8,
//!   then the `ql` and `qh` words (each `[row][4]`) in the order the kernel reads them (see
//!   `q6k::triple`), so the weights stream sequentially.
//!
//! - IQ4_XS, 1104 bytes (ggml: 8 x 136): `d` x 8 (f16), the 6-bit scales minus 32 as
//!   `[sub-block j < 8][row]` i8, then the 128 `qs` bytes of each row as 32 words
//!   `[w][row][4]` (words `4j..4j + 4` are sub-block `j`'s).
//!
//! Both directions are exact, so the ggml bytes can always be rebuilt.

use crate::format::{
    pack_scale_iq4xs, pack_scale_k3, pack_scale_min_k4, scale_iq4xs, scale_k3, scale_min_k4,
    QuantType,
};
use crate::pack::GROUP_ROWS;

/// Offsets inside a Q2_K group super-block.
pub(crate) mod q2k {
    pub const D: usize = 0;
    pub const DMIN: usize = 16;
    pub const SC: usize = 32;
    pub const MIN: usize = 160;
    pub const QS: usize = 288;
    pub const BYTES: usize = 288 + 512;
}

/// Offsets inside a Q3_K group super-block.
pub(crate) mod q3k {
    pub const D: usize = 0;
    pub const SC: usize = 16;
    pub const HM: usize = 144;
    pub const QS: usize = 400;
    pub const BYTES: usize = 400 + 512;
}

/// Offsets inside a Q5_K group super-block (Q4_K's, then `qh`).
pub(crate) mod q5k {
    pub const QH: usize = super::q4k::BYTES;
    pub const BYTES: usize = QH + 256;
}

/// Offsets inside a Q4_K group super-block.
pub(crate) mod q4k {
    pub const D: usize = 0;
    pub const DMIN: usize = 16;
    pub const SC: usize = 32;
    pub const MIN: usize = 96;
    pub const QS: usize = 160;
    pub const BYTES: usize = 160 + 1024;
}

/// Offsets inside an IQ4_XS group super-block.
pub(crate) mod iq4xs {
    pub const D: usize = 0;
    pub const SC: usize = 16;
    pub const QS: usize = 80;
    pub const BYTES: usize = 80 + 1024;
}

/// Offsets inside a Q6_K group super-block.
pub(crate) mod q6k {
    pub const D: usize = 0;
    pub const SC: usize = 16;
    /// Quants, in the order the kernels read them: for half `h < 2` and `i < 8`, the
    /// 96-byte triple (`ql` word `16h + i`, `ql` word `16h + 8 + i`, `qh` word `8h + i`),
    /// each word as 8 rows x 4 bytes.
    pub const Q: usize = 144;
    pub const BYTES: usize = 144 + 1024 + 512;

    /// Offset of the triple holding half `h`, word `i`.
    pub const fn triple(h: usize, i: usize) -> usize {
        Q + (8 * h + i) * 96
    }

    /// Offset of ggml `ql` word `w` (0..32) for row 0 of the group.
    pub const fn ql_word(w: usize) -> usize {
        let (h, r) = (w / 16, w % 16);
        if r < 8 {
            triple(h, r)
        } else {
            triple(h, r - 8) + 32
        }
    }

    /// Offset of ggml `qh` word `w` (0..16) for row 0 of the group.
    pub const fn qh_word(w: usize) -> usize {
        triple(w / 8, w % 8) + 64
    }
}

#[inline]
fn word(base: usize, w: usize, lane: usize) -> usize {
    base + (w * GROUP_ROWS + lane) * 4
}

#[inline]
fn pair(base: usize, p: usize, lane: usize) -> usize {
    base + (p * GROUP_ROWS + lane) * 2
}

/// Copies one row's ggml super-block `src` into its lane of the group super-block `dst`.
pub(crate) fn pack_block(qtype: QuantType, lane: usize, src: &[u8], dst: &mut [u8]) {
    match qtype {
        QuantType::Q2_K => {
            dst[q2k::D + 2 * lane..][..2].copy_from_slice(&src[80..82]);
            dst[q2k::DMIN + 2 * lane..][..2].copy_from_slice(&src[82..84]);
            for (j, &s) in src[..16].iter().enumerate() {
                dst[pair(q2k::SC, j / 2, lane) + j % 2] = s & 0x0F;
                dst[pair(q2k::MIN, j / 2, lane) + j % 2] = s >> 4;
            }
            for w in 0..16 {
                dst[word(q2k::QS, w, lane)..][..4].copy_from_slice(&src[16 + 4 * w..][..4]);
            }
        }
        QuantType::Q3_K => {
            dst[q3k::D + 2 * lane..][..2].copy_from_slice(&src[108..110]);
            for j in 0..16 {
                dst[pair(q3k::SC, j / 2, lane) + j % 2] = scale_k3(j, &src[96..108]) as u8;
            }
            for w in 0..8 {
                dst[word(q3k::HM, w, lane)..][..4].copy_from_slice(&src[4 * w..][..4]);
            }
            for w in 0..16 {
                dst[word(q3k::QS, w, lane)..][..4].copy_from_slice(&src[32 + 4 * w..][..4]);
            }
        }
        QuantType::Q5_K => {
            // Q4_K's fields from the same bytes, the nibbles starting after `qh`.
            dst[q4k::D + 2 * lane..][..2].copy_from_slice(&src[0..2]);
            dst[q4k::DMIN + 2 * lane..][..2].copy_from_slice(&src[2..4]);
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, &src[4..16]);
                dst[pair(q4k::SC, j / 2, lane) + j % 2] = sc;
                dst[pair(q4k::MIN, j / 2, lane) + j % 2] = m;
            }
            for w in 0..32 {
                dst[word(q4k::QS, w, lane)..][..4].copy_from_slice(&src[48 + 4 * w..][..4]);
            }
            for w in 0..8 {
                dst[word(q5k::QH, w, lane)..][..4].copy_from_slice(&src[16 + 4 * w..][..4]);
            }
        }
        QuantType::Q4_K => {
            dst[q4k::D + 2 * lane..][..2].copy_from_slice(&src[0..2]);
            dst[q4k::DMIN + 2 * lane..][..2].copy_from_slice(&src[2..4]);
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, &src[4..16]);
                dst[pair(q4k::SC, j / 2, lane) + j % 2] = sc;
                dst[pair(q4k::MIN, j / 2, lane) + j % 2] = m;
            }
            for w in 0..32 {
                dst[word(q4k::QS, w, lane)..][..4].copy_from_slice(&src[16 + 4 * w..][..4]);
            }
        }
        QuantType::Q6_K => {
            dst[q6k::D + 2 * lane..][..2].copy_from_slice(&src[208..210]);
            for j in 0..16 {
                dst[pair(q6k::SC, j / 2, lane) + j % 2] = src[192 + j];
            }
            for w in 0..32 {
                dst[q6k::ql_word(w) + 4 * lane..][..4].copy_from_slice(&src[4 * w..][..4]);
            }
            for w in 0..16 {
                dst[q6k::qh_word(w) + 4 * lane..][..4].copy_from_slice(&src[128 + 4 * w..][..4]);
            }
        }
        QuantType::IQ4_XS => {
            dst[iq4xs::D + 2 * lane..][..2].copy_from_slice(&src[0..2]);
            let scales_h = u16::from_le_bytes([src[2], src[3]]);
            for j in 0..8 {
                dst[iq4xs::SC + GROUP_ROWS * j + lane] = scale_iq4xs(j, scales_h, &src[4..8]) as u8;
            }
            for w in 0..32 {
                dst[word(iq4xs::QS, w, lane)..][..4].copy_from_slice(&src[8 + 4 * w..][..4]);
            }
        }
        _ => {}
    }
}

/// Rebuilds one row's ggml super-block from its lane of a group super-block.
pub(crate) fn unpack_block(qtype: QuantType, lane: usize, src: &[u8], out: &mut [u8]) {
    match qtype {
        QuantType::Q2_K => {
            out[80..82].copy_from_slice(&src[q2k::D + 2 * lane..][..2]);
            out[82..84].copy_from_slice(&src[q2k::DMIN + 2 * lane..][..2]);
            for j in 0..16 {
                let sc = src[pair(q2k::SC, j / 2, lane) + j % 2];
                let m = src[pair(q2k::MIN, j / 2, lane) + j % 2];
                out[j] = sc | (m << 4);
            }
            for w in 0..16 {
                out[16 + 4 * w..][..4].copy_from_slice(&src[word(q2k::QS, w, lane)..][..4]);
            }
        }
        QuantType::Q3_K => {
            out[108..110].copy_from_slice(&src[q3k::D + 2 * lane..][..2]);
            let sc: [i8; 16] =
                std::array::from_fn(|j| src[pair(q3k::SC, j / 2, lane) + j % 2] as i8);
            pack_scale_k3(&sc, &mut out[96..108]);
            for w in 0..8 {
                out[4 * w..][..4].copy_from_slice(&src[word(q3k::HM, w, lane)..][..4]);
            }
            for w in 0..16 {
                out[32 + 4 * w..][..4].copy_from_slice(&src[word(q3k::QS, w, lane)..][..4]);
            }
        }
        QuantType::Q5_K => {
            out[0..2].copy_from_slice(&src[q4k::D + 2 * lane..][..2]);
            out[2..4].copy_from_slice(&src[q4k::DMIN + 2 * lane..][..2]);
            let mut sc = [0u8; 8];
            let mut m = [0u8; 8];
            for j in 0..8 {
                sc[j] = src[pair(q4k::SC, j / 2, lane) + j % 2];
                m[j] = src[pair(q4k::MIN, j / 2, lane) + j % 2];
            }
            pack_scale_min_k4(&sc, &m, &mut out[4..16]);
            for w in 0..8 {
                out[16 + 4 * w..][..4].copy_from_slice(&src[word(q5k::QH, w, lane)..][..4]);
            }
            for w in 0..32 {
                out[48 + 4 * w..][..4].copy_from_slice(&src[word(q4k::QS, w, lane)..][..4]);
            }
        }
        QuantType::Q4_K => {
            out[0..2].copy_from_slice(&src[q4k::D + 2 * lane..][..2]);
            out[2..4].copy_from_slice(&src[q4k::DMIN + 2 * lane..][..2]);
            let mut sc = [0u8; 8];
            let mut m = [0u8; 8];
            for j in 0..8 {
                sc[j] = src[pair(q4k::SC, j / 2, lane) + j % 2];
                m[j] = src[pair(q4k::MIN, j / 2, lane) + j % 2];
            }
            pack_scale_min_k4(&sc, &m, &mut out[4..16]);
            for w in 0..32 {
                out[16 + 4 * w..][..4].copy_from_slice(&src[word(q4k::QS, w, lane)..][..4]);
            }
        }
        QuantType::Q6_K => {
            out[208..210].copy_from_slice(&src[q6k::D + 2 * lane..][..2]);
            for j in 0..16 {
                out[192 + j] = src[pair(q6k::SC, j / 2, lane) + j % 2];
            }
            for w in 0..32 {
                out[4 * w..][..4].copy_from_slice(&src[q6k::ql_word(w) + 4 * lane..][..4]);
            }
            for w in 0..16 {
                out[128 + 4 * w..][..4].copy_from_slice(&src[q6k::qh_word(w) + 4 * lane..][..4]);
            }
        }
        QuantType::IQ4_XS => {
            out[0..2].copy_from_slice(&src[iq4xs::D + 2 * lane..][..2]);
            let sc: [i8; 8] = std::array::from_fn(|j| src[iq4xs::SC + GROUP_ROWS * j + lane] as i8);
            let scales_h = pack_scale_iq4xs(&sc, &mut out[4..8]);
            out[2..4].copy_from_slice(&scales_h.to_le_bytes());
            for w in 0..32 {
                out[8 + 4 * w..][..4].copy_from_slice(&src[word(iq4xs::QS, w, lane)..][..4]);
            }
        }
        _ => {}
    }
}
