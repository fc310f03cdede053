//! ggml block formats: sizes, names, and the scalar decoding of one ggml block.
//!
//! Layouts (little endian, 32 weights per block, `d`/`m` are IEEE f16):
//! - Q4_0, 18 bytes: `d`, then 16 bytes of nibbles. Byte `j` holds weight `j` in its low nibble
//!   and weight `j + 16` in its high nibble; weight = `d * (q - 8)`.
//! - Q4_1, 20 bytes: `d`, `m`, then the same 16 bytes of nibbles; weight = `d * q + m`.
//! - Q8_0, 34 bytes: `d`, then 32 signed bytes; weight = `d * q`.

use half::f16;
use std::fmt;

/// Elements per ggml block for the formats here.
pub(crate) const QK: usize = 32;

/// Weight formats with kernels here (ggml block layouts, 32 elements per block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum QuantType {
    /// 4-bit, symmetric: `d * (q - 8)`.
    Q4_0,
    /// 4-bit with a per-block minimum: `d * q + m`.
    Q4_1,
    /// 8-bit, symmetric: `d * q`.
    Q8_0,
}

impl QuantType {
    /// Weights per block (32 for every format here).
    pub fn block_len(self) -> usize {
        QK
    }

    /// Bytes per ggml block: 18 (Q4_0), 20 (Q4_1), 34 (Q8_0).
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q4_0 => 2 + QK / 2,
            QuantType::Q4_1 => 4 + QK / 2,
            QuantType::Q8_0 => 2 + QK,
        }
    }

    /// The ggml name, e.g. `"Q4_1"`.
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q8_0 => "Q8_0",
        }
    }

    /// Bytes of scales at the start of a ggml block (`d`, plus `m` for Q4_1).
    pub(crate) fn scale_bytes(self) -> usize {
        match self {
            QuantType::Q4_1 => 4,
            QuantType::Q4_0 | QuantType::Q8_0 => 2,
        }
    }

    /// Bytes of quants in a ggml block.
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

/// Decodes one ggml block (`block.len() == qtype.block_bytes()`) into 32 weights, with the
/// same arithmetic as ggml's reference `dequantize_row_*` (so results are bit-identical).
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
    }
}
