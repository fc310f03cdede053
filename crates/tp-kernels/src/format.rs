//! ggml block formats: sizes, names, and the scalar decoding of one ggml block.
//!
//! Layouts (little endian, 32 weights per block, `d`/`m` are IEEE f16):
//! - Q4_0, 18 bytes: `d`, then 16 bytes of nibbles. Byte `j` holds weight `j` in its low nibble
//!   and weight `j + 16` in its high nibble; weight = `d * (q - 8)`.
//! - Q4_1, 20 bytes: `d`, `m`, then the same 16 bytes of nibbles; weight = `d * q + m`.
//! - Q8_0, 34 bytes: `d`, then 32 signed bytes; weight = `d * q`.
//! - Q5_0, 22 bytes: `d`, a little-endian u32 `qh` of fifth bits (bit `j` for weight `j`),
//!   then nibbles as in Q4_0; weight = `d * ((nibble | fifth bit << 4) - 16)`.
//! - Q5_1, 24 bytes: `d`, `m`, `qh` and nibbles as in Q5_0; weight =
//!   `d * (nibble | fifth bit << 4) + m`.
//!
//! K-quants, 256 weights per super-block:
//! - Q4_K, 144 bytes: `d`, `dmin`, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32
//!   (see [`scale_min_k4`]), 128 bytes of nibbles: bytes `32c..32c + 32` hold sub-block `2c`
//!   in their low nibbles and sub-block `2c + 1` in their high nibbles;
//!   weight = `d * sc * q - dmin * m`.
//! - Q6_K, 210 bytes: 128 bytes `ql` (low 4 bits), 64 bytes `qh` (high 2 bits), 16 signed
//!   8-bit scales (one per 16 weights), then `d`; weight = `d * sc * (q - 32)`, for half
//!   `h`, `l < 32`: weights `128h + l + 32k` (k = 0..4) take the low nibble of `ql[64h + l]`,
//!   of `ql[64h + 32 + l]`, the high nibble of `ql[64h + l]`, of `ql[64h + 32 + l]`, and bits
//!   `2k..2k + 2` of `qh[32h + l]`, with scale `sc[8h + 2k + l / 16]`.
//! - Q5_K, 176 bytes: `d`, `dmin`, 12 scale bytes as Q4_K, 32 bytes `qh`, then 128 bytes of
//!   nibbles as Q4_K; weight = `d * sc * q - dmin * m` with `q` = nibble | fifth bit << 4,
//!   the fifth bit of weight `64c + l` (sub-block `2c`) being bit `2c` of `qh[l]` and of
//!   weight `64c + 32 + l` (sub-block `2c + 1`) bit `2c + 1` of `qh[l]` (`l < 32`).
//! - Q3_K, 110 bytes: 32 bytes `hmask`, 64 bytes `qs`, 12 bytes of 6-bit scales (one per 16
//!   weights, see [`scale_k3`]), then `d`. For half `h`, `k < 4`, `l < 32`: weight
//!   `128h + 32k + l` has low bits `2k..2k + 2` of `qs[32h + l]`, high bit `4h + k` of
//!   `hmask[l]`, so `q` in 0..8, and sub-block `8h + 2k + l / 16`; weight =
//!   `d * (sc - 32) * (q - 4)`.
//! - Q2_K, 84 bytes: 16 bytes of 4-bit scales (low nibble) and mins (high nibble), one per 16
//!   weights, 64 bytes `qs`, `d`, `dmin`. Weight `128h + 32k + l` is bits `2k..2k + 2` of
//!   `qs[32h + l]` (`q` in 0..4) in sub-block `8h + 2k + l / 16`; weight =
//!   `d * sc * q - dmin * m`.
//!
//! Non-linear 4-bit formats (weight = scale times [`KVALUES_IQ4`]`[nibble]`):
//! - IQ4_NL, 18 bytes per 32 weights: `d`, then 16 bytes of nibbles laid out as Q4_0's
//!   (byte `j`: weight `j` low, weight `j + 16` high); weight = `d * KVALUES_IQ4[q]`.
//! - IQ4_XS, 136 bytes per 256 weights: `d`, a little-endian u16 `scales_h`, 4 bytes
//!   `scales_l`, 128 bytes `qs`. Sub-block `j < 8` (weights `32j..32j + 32`) has the 6-bit
//!   scale `ls = (scales_l[j / 2] >> 4 (j % 2)) & 15 | ((scales_h >> 2j) & 3) << 4` and its
//!   nibbles in `qs[16j..16j + 16]` laid out as IQ4_NL's; weight =
//!   `d * (ls - 32) * KVALUES_IQ4[q]` (see [`scale_iq4xs`]).
use half::f16;
use std::fmt;

/// Elements per ggml block for the 32-wide formats.
pub(crate) const QK: usize = 32;
/// Elements per K-quant super-block.
pub(crate) const QK_K: usize = 256;

/// ggml's non-linear 4-bit table (`kvalues_iq4nl`), shared by IQ4_NL and IQ4_XS.
pub(crate) const KVALUES_IQ4: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Weight formats with kernels here (ggml block layouts: 32 elements per block, 256 per
/// super-block for the K-quants).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum QuantType {
    /// 4-bit, symmetric: `d * (q - 8)`.
    Q4_0,
    /// 4-bit with a per-block minimum: `d * q + m`.
    Q4_1,
    /// 8-bit, symmetric: `d * q`.
    Q8_0,
    /// 5-bit, symmetric: `d * (q - 16)`.
    Q5_0,
    /// 5-bit with a per-block minimum: `d * q + m`.
    Q5_1,
    /// 2-bit K-quant: 256-element super-blocks of 16 sub-blocks with 4-bit scales and mins.
    Q2_K,
    /// 3-bit K-quant: 256-element super-blocks of 16 sub-blocks with 6-bit signed scales.
    Q3_K,
    /// 4-bit K-quant: 256-element super-blocks of 8 sub-blocks with 6-bit scales and mins.
    Q4_K,
    /// 5-bit K-quant: 256-element super-blocks of 8 sub-blocks with 6-bit scales and mins.
    Q5_K,
    /// 6-bit K-quant: 256-element super-blocks with a signed 8-bit scale per 16 elements.
    Q6_K,
    /// 4-bit non-linear: `d * KVALUES_IQ4[q]`, 32-element blocks (ggml type 20).
    IQ4_NL,
    /// 4-bit non-linear: 256-element super-blocks of 8 sub-blocks with 6-bit scales,
    /// `d * (ls - 32) * KVALUES_IQ4[q]` (ggml type 23).
    IQ4_XS,
}

impl QuantType {
    /// Weights per block: 32, or 256 for the K-quants and IQ4_XS.
    pub fn block_len(self) -> usize {
        if self.is_k_quant() {
            QK_K
        } else {
            QK
        }
    }

    /// Bytes per ggml block: 18 (Q4_0), 20 (Q4_1), 34 (Q8_0), 22 (Q5_0), 24 (Q5_1),
    /// 84 (Q2_K), 110 (Q3_K), 144 (Q4_K), 176 (Q5_K), 210 (Q6_K), 18 (IQ4_NL), 136 (IQ4_XS).
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q4_0 => 2 + QK / 2,
            QuantType::Q4_1 => 4 + QK / 2,
            QuantType::Q8_0 => 2 + QK,
            QuantType::Q5_0 => 2 + 4 + QK / 2,
            QuantType::Q5_1 => 2 + 2 + 4 + QK / 2,
            QuantType::Q2_K => QK_K / 16 + QK_K / 4 + 2 + 2,
            QuantType::Q3_K => QK_K / 8 + QK_K / 4 + 12 + 2,
            QuantType::Q4_K => 2 + 2 + 12 + QK_K / 2,
            QuantType::Q5_K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            QuantType::Q6_K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
            QuantType::IQ4_NL => 2 + QK / 2,
            QuantType::IQ4_XS => 2 + 2 + QK_K / 64 + QK_K / 2,
        }
    }

    /// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS: 256-element super-blocks, activations
    /// quantized as Q8_K (IQ4_XS is no K-quant by name, but is one by shape: it takes their
    /// packing, kernels and sub-block form).
    pub(crate) fn is_k_quant(self) -> bool {
        matches!(
            self,
            QuantType::Q2_K
                | QuantType::Q3_K
                | QuantType::Q4_K
                | QuantType::Q5_K
                | QuantType::Q6_K
                | QuantType::IQ4_XS
        )
    }

    /// Q4_1 and Q5_1: a per-block minimum, activations quantized as Q8_1 (with `s`).
    pub(crate) fn has_min(self) -> bool {
        matches!(self, QuantType::Q4_1 | QuantType::Q5_1)
    }

    /// The ggml name, e.g. `"Q4_1"`.
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q5_0 => "Q5_0",
            QuantType::Q5_1 => "Q5_1",
            QuantType::Q2_K => "Q2_K",
            QuantType::Q3_K => "Q3_K",
            QuantType::Q4_K => "Q4_K",
            QuantType::Q5_K => "Q5_K",
            QuantType::Q6_K => "Q6_K",
            QuantType::IQ4_NL => "IQ4_NL",
            QuantType::IQ4_XS => "IQ4_XS",
        }
    }

    /// Bytes of f16 scales at the start of a 32-wide ggml block (`d`, plus `m` for Q4_1 and
    /// Q5_1).
    pub(crate) fn scale_bytes(self) -> usize {
        match self {
            QuantType::Q4_1 | QuantType::Q5_1 => 4,
            _ => 2,
        }
    }

    /// Bytes after the f16 scales of a 32-wide ggml block (Q5_0, Q5_1: `qh`, then the
    /// nibbles).
    pub(crate) fn quant_bytes(self) -> usize {
        self.block_bytes() - self.scale_bytes()
    }
}

impl fmt::Display for QuantType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reads the little-endian f16 at `bytes[at..at + 2]` as f32.
#[inline]
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Q4_K's packed 6-bit (scale, min) of sub-block `j` (0..8) from its 12 scale bytes.
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The inverse of [`scale_min_k4`]: packs 8 (scale, min) pairs of 6 bits into 12 bytes.
pub(crate) fn pack_scale_min_k4(sc: &[u8; 8], m: &[u8; 8], q: &mut [u8]) {
    for j in 0..4 {
        q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
}

/// Q3_K's 6-bit scale of sub-block `j` (0..16) from its 12 scale bytes, minus 32 (-32..32):
/// the low 4 bits are the low nibble of byte `j` (`j < 8`) or the high nibble of byte
/// `j - 8`, the high 2 bits are bits `2 (j / 4)..2 (j / 4) + 2` of byte `8 + j % 4`.
pub(crate) fn scale_k3(j: usize, q: &[u8]) -> i8 {
    let low = if j < 8 { q[j] & 0x0F } else { q[j - 8] >> 4 };
    let high = (q[8 + j % 4] >> (2 * (j / 4))) & 3;
    (low | (high << 4)) as i8 - 32
}

/// The inverse of [`scale_k3`]: packs 16 scales (each in -32..32) into 12 bytes.
pub(crate) fn pack_scale_k3(sc: &[i8; 16], q: &mut [u8]) {
    q[..12].fill(0);
    for (j, &s) in sc.iter().enumerate() {
        let v = (s as i32 + 32) as u8 & 63;
        if j < 8 {
            q[j] |= v & 0x0F;
        } else {
            q[j - 8] |= (v & 0x0F) << 4;
        }
        q[8 + j % 4] |= (v >> 4) << (2 * (j / 4));
    }
}

/// IQ4_XS's 6-bit scale of sub-block `j` (0..8) minus 32 (-32..32), from `scales_h` and the
/// 4 bytes of `scales_l`.
pub(crate) fn scale_iq4xs(j: usize, scales_h: u16, scales_l: &[u8]) -> i8 {
    let low = (scales_l[j / 2] >> (4 * (j % 2))) & 0x0F;
    let high = ((scales_h >> (2 * j)) & 3) as u8;
    (low | (high << 4)) as i8 - 32
}

/// The inverse of [`scale_iq4xs`]: packs 8 scales (each in -32..32) into `scales_h` and the
/// 4 bytes of `scales_l`.
pub(crate) fn pack_scale_iq4xs(sc: &[i8; 8], scales_l: &mut [u8]) -> u16 {
    scales_l[..4].fill(0);
    let mut scales_h = 0u16;
    for (j, &s) in sc.iter().enumerate() {
        let v = (s as i32 + 32) as u8 & 63;
        scales_l[j / 2] |= (v & 0x0F) << (4 * (j % 2));
        scales_h |= ((v >> 4) as u16) << (2 * j);
    }
    scales_h
}

/// Decodes one ggml block (`block.len() == qtype.block_bytes()`) into `block_len` weights,
/// with the same arithmetic as ggml's reference `dequantize_row_*` (bit-identical results).
pub(crate) fn dequantize_ggml_block(qtype: QuantType, block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    match qtype {
        QuantType::Q4_0 => {
            for (j, &byte) in block[2..2 + QK / 2].iter().enumerate() {
                out[j] = ((byte & 0x0F) as i32 - 8) as f32 * d;
                out[j + QK / 2] = ((byte >> 4) as i32 - 8) as f32 * d;
            }
        }
        QuantType::Q4_1 => {
            let m = f16_at(block, 2);
            for (j, &byte) in block[4..4 + QK / 2].iter().enumerate() {
                out[j] = (byte & 0x0F) as f32 * d + m;
                out[j + QK / 2] = (byte >> 4) as f32 * d + m;
            }
        }
        QuantType::Q8_0 => {
            for (o, &byte) in out[..QK].iter_mut().zip(&block[2..2 + QK]) {
                *o = byte as i8 as f32 * d;
            }
        }
        QuantType::Q5_0 => {
            let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
            for (j, &byte) in block[6..6 + QK / 2].iter().enumerate() {
                let h0 = ((qh >> j) & 1) as u8;
                let h1 = ((qh >> (j + 16)) & 1) as u8;
                out[j] = (((byte & 0x0F) | (h0 << 4)) as i32 - 16) as f32 * d;
                out[j + QK / 2] = (((byte >> 4) | (h1 << 4)) as i32 - 16) as f32 * d;
            }
        }
        QuantType::Q5_1 => {
            let m = f16_at(block, 2);
            let qh = u32::from_le_bytes([block[4], block[5], block[6], block[7]]);
            for (j, &byte) in block[8..8 + QK / 2].iter().enumerate() {
                let h0 = ((qh >> j) & 1) as u8;
                let h1 = ((qh >> (j + 16)) & 1) as u8;
                out[j] = ((byte & 0x0F) | (h0 << 4)) as f32 * d + m;
                out[j + QK / 2] = ((byte >> 4) | (h1 << 4)) as f32 * d + m;
            }
        }
        QuantType::Q2_K => {
            let (d, dmin) = (f16_at(block, 80), f16_at(block, 82));
            let (sc, qs) = (&block[..16], &block[16..80]);
            for h in 0..2 {
                for k in 0..4 {
                    for l in 0..32 {
                        let s = sc[8 * h + 2 * k + l / 16];
                        let (dl, ml) = (d * (s & 0x0F) as f32, dmin * (s >> 4) as f32);
                        let q = (qs[32 * h + l] >> (2 * k)) & 3;
                        out[128 * h + 32 * k + l] = dl * q as f32 - ml;
                    }
                }
            }
        }
        QuantType::Q3_K => {
            let d = f16_at(block, 108);
            let (hm, qs, sc) = (&block[..32], &block[32..96], &block[96..108]);
            for h in 0..2 {
                for k in 0..4 {
                    for l in 0..32 {
                        let dl = d * scale_k3(8 * h + 2 * k + l / 16, sc) as f32;
                        let low = ((qs[32 * h + l] >> (2 * k)) & 3) as i8;
                        let high = (hm[l] >> (4 * h + k)) & 1;
                        let q = low - if high == 0 { 4 } else { 0 };
                        out[128 * h + 32 * k + l] = dl * q as f32;
                    }
                }
            }
        }
        QuantType::Q5_K => {
            let dmin = f16_at(block, 2);
            let (scales, qh) = (&block[4..16], &block[16..48]);
            for c in 0..4 {
                let qs = &block[48 + 32 * c..48 + 32 * c + 32];
                let (sc0, m0) = scale_min_k4(2 * c, scales);
                let (sc1, m1) = scale_min_k4(2 * c + 1, scales);
                let (d0, min0) = (d * sc0 as f32, dmin * m0 as f32);
                let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
                for (l, &byte) in qs.iter().enumerate() {
                    let h0 = ((qh[l] >> (2 * c)) & 1) << 4;
                    let h1 = ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    out[64 * c + l] = d0 * ((byte & 0x0F) | h0) as f32 - min0;
                    out[64 * c + 32 + l] = d1 * ((byte >> 4) | h1) as f32 - min1;
                }
            }
        }
        QuantType::Q4_K => {
            let dmin = f16_at(block, 2);
            let scales = &block[4..16];
            for c in 0..4 {
                let qs = &block[16 + 32 * c..16 + 32 * c + 32];
                let (sc0, m0) = scale_min_k4(2 * c, scales);
                let (sc1, m1) = scale_min_k4(2 * c + 1, scales);
                let (d0, min0) = (d * sc0 as f32, dmin * m0 as f32);
                let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
                for (l, &byte) in qs.iter().enumerate() {
                    out[64 * c + l] = d0 * (byte & 0x0F) as f32 - min0;
                    out[64 * c + 32 + l] = d1 * (byte >> 4) as f32 - min1;
                }
            }
        }
        QuantType::IQ4_NL => {
            for (j, &byte) in block[2..2 + QK / 2].iter().enumerate() {
                out[j] = d * KVALUES_IQ4[(byte & 0x0F) as usize] as f32;
                out[j + QK / 2] = d * KVALUES_IQ4[(byte >> 4) as usize] as f32;
            }
        }
        QuantType::IQ4_XS => {
            let scales_h = u16::from_le_bytes([block[2], block[3]]);
            for j in 0..QK_K / QK {
                let dl = d * scale_iq4xs(j, scales_h, &block[4..8]) as f32;
                let qs = &block[8 + 16 * j..8 + 16 * j + 16];
                for (l, &byte) in qs.iter().enumerate() {
                    out[32 * j + l] = dl * KVALUES_IQ4[(byte & 0x0F) as usize] as f32;
                    out[32 * j + 16 + l] = dl * KVALUES_IQ4[(byte >> 4) as usize] as f32;
                }
            }
        }
        QuantType::Q6_K => {
            let d = f16_at(block, 208);
            let (ql, qh, sc) = (&block[..128], &block[128..192], &block[192..208]);
            for h in 0..2 {
                for l in 0..32 {
                    let a = ql[64 * h + l];
                    let b = ql[64 * h + 32 + l];
                    let hb = qh[32 * h + l];
                    let q = [
                        (a & 0x0F) | ((hb & 3) << 4),
                        (b & 0x0F) | (((hb >> 2) & 3) << 4),
                        (a >> 4) | (((hb >> 4) & 3) << 4),
                        (b >> 4) | (((hb >> 6) & 3) << 4),
                    ];
                    for (k, &qk) in q.iter().enumerate() {
                        let s = sc[8 * h + 2 * k + l / 16] as i8;
                        out[128 * h + 32 * k + l] = d * s as f32 * (qk as i8 - 32) as f32;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q3k_scales_round_trip_through_their_12_bytes() {
        let mut q = [0u8; 12];
        for seed in 0..64u32 {
            let bytes: Vec<u8> = (0..12).map(|i| (seed * 37 + i * 101) as u8).collect();
            let sc: [i8; 16] = std::array::from_fn(|j| scale_k3(j, &bytes));
            assert!(sc.iter().all(|&s| (-32..32).contains(&s)));
            pack_scale_k3(&sc, &mut q);
            assert_eq!(&q[..], &bytes[..]);
        }
    }

    #[test]
    fn iq4xs_scales_round_trip_through_their_6_bytes() {
        let mut l = [0u8; 4];
        for seed in 0..64u32 {
            let bytes: Vec<u8> = (0..6).map(|i| (seed * 37 + i * 101) as u8).collect();
            let h = u16::from_le_bytes([bytes[0], bytes[1]]);
            let sc: [i8; 8] = std::array::from_fn(|j| scale_iq4xs(j, h, &bytes[2..]));
            assert!(sc.iter().all(|&s| (-32..32).contains(&s)));
            assert_eq!(pack_scale_iq4xs(&sc, &mut l), h);
            assert_eq!(&l[..], &bytes[2..]);
        }
    }
}
