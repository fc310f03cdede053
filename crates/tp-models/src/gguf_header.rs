//! The loader's view of a GGUF header: tp-spec's one header reader ([`tp_spec::gguf`]: every
//! length bounded, strings and metadata capped, typed errors naming the key or tensor), then
//! what loading needs on top: each tensor's ggml type must be one the kernels or candle load
//! ([`GgmlDType`]; Q8_1, Q8_K, the IQ* types other than IQ4_NL and IQ4_XS, ... are refused by
//! name), its rows whole blocks of that type, and the tensors' data must tile the data section
//! of the file (no overlap, no gap). Metadata values become candle's [`Value`] so that the
//! tokenizer and candle's models can use them; [`GgufHeader::to_candle`] builds a candle
//! [`Content`] for tools and test oracles. On a valid file the result equals candle's
//! `Content::read` (tested on SmolLM2); where candle trusts the file, this one is stricter
//! (docs/gguf.md).

use crate::checkpoint::GgmlDType;
use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
use std::collections::HashMap;
use tp_spec::gguf::{GgufError, GgufValue};

pub use tp_spec::gguf::{
    DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS, MAX_METADATA_VALUES, MAX_STRING_BYTES,
    MAX_TENSORS,
};

/// One tensor's entry in the header, checked against the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensor {
    pub name: String,
    /// Outermost dimension first (a matrix is `[rows, cols]`); the file lists them innermost
    /// first.
    pub shape: Vec<usize>,
    pub dtype: GgmlDType,
    /// Start of the data relative to [`GgufHeader::data_offset`].
    pub offset: u64,
    /// Bytes of the data.
    pub bytes: u64,
}

impl GgufTensor {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A parsed and validated GGUF header.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    /// Tensors in file order.
    pub tensors: Vec<GgufTensor>,
    index: HashMap<String, usize>,
    pub alignment: u64,
    /// Where tensor data starts in the file.
    pub data_offset: u64,
    /// Bytes of the header proper (before the alignment padding).
    pub header_bytes: u64,
}

/// A ggml tensor type id: loadable here, known to ggml but not loadable, or unknown.
enum TypeId {
    Loadable(GgmlDType),
    Unsupported(&'static str),
    Unknown,
}

fn ggml_type(id: u32) -> TypeId {
    use GgmlDType as T;
    use TypeId::{Loadable, Unsupported};
    match id {
        0 => Loadable(T::F32),
        1 => Loadable(T::F16),
        2 => Loadable(T::Q4_0),
        3 => Loadable(T::Q4_1),
        6 => Loadable(T::Q5_0),
        7 => Loadable(T::Q5_1),
        8 => Loadable(T::Q8_0),
        10 => Loadable(T::Q2K),
        11 => Loadable(T::Q3K),
        12 => Loadable(T::Q4K),
        13 => Loadable(T::Q5K),
        14 => Loadable(T::Q6K),
        30 => Loadable(T::BF16),
        9 => Unsupported("Q8_1"),
        15 => Unsupported("Q8_K"),
        16 => Unsupported("IQ2_XXS"),
        17 => Unsupported("IQ2_XS"),
        18 => Unsupported("IQ3_XXS"),
        19 => Unsupported("IQ1_S"),
        20 => Loadable(T::IQ4_NL),
        21 => Unsupported("IQ3_S"),
        22 => Unsupported("IQ2_S"),
        23 => Loadable(T::IQ4_XS),
        24 => Unsupported("I8"),
        25 => Unsupported("I16"),
        26 => Unsupported("I32"),
        27 => Unsupported("I64"),
        28 => Unsupported("F64"),
        29 => Unsupported("IQ1_M"),
        34 => Unsupported("TQ1_0"),
        35 => Unsupported("TQ2_0"),
        39 => Unsupported("MXFP4"),
        _ => TypeId::Unknown,
    }
}

/// Why a tensor cannot be loaded, before the file's path is attached.
enum Fail {
    Corrupt(String),
    Unsupported { tensor: String, dtype: String },
}

/// A metadata value as candle holds it.
fn candle_value(v: GgufValue) -> Value {
    match v {
        GgufValue::U8(x) => Value::U8(x),
        GgufValue::I8(x) => Value::I8(x),
        GgufValue::U16(x) => Value::U16(x),
        GgufValue::I16(x) => Value::I16(x),
        GgufValue::U32(x) => Value::U32(x),
        GgufValue::I32(x) => Value::I32(x),
        GgufValue::U64(x) => Value::U64(x),
        GgufValue::I64(x) => Value::I64(x),
        GgufValue::F32(x) => Value::F32(x),
        GgufValue::F64(x) => Value::F64(x),
        GgufValue::Bool(x) => Value::Bool(x),
        GgufValue::String(s) => Value::String(s),
        GgufValue::Array(a) => Value::Array(a.into_iter().map(candle_value).collect()),
    }
}

/// A tensor's loadable type and data bytes: its ggml type must load and its rows be whole
/// blocks of it.
fn loadable(t: &tp_spec::TensorInfo) -> std::result::Result<GgufTensor, Fail> {
    let id = t.ggml_type;
    let dtype = match ggml_type(id) {
        TypeId::Loadable(d) => d,
        TypeId::Unsupported(n) => {
            return Err(Fail::Unsupported {
                tensor: t.name.clone(),
                dtype: format!("{n} (ggml type {id})"),
            })
        }
        TypeId::Unknown => {
            return Err(Fail::Corrupt(format!(
                "tensor {}: type {id} is not a ggml type",
                t.name
            )))
        }
    };
    // The reader checked that the shape is not empty and its product fits.
    let inner = t.shape.last().copied().unwrap_or(0);
    let block = dtype.block_size();
    if !inner.is_multiple_of(block) {
        return Err(Fail::Corrupt(format!(
            "tensor {}: rows of {inner} elements are not whole {dtype:?} blocks of {block}",
            t.name
        )));
    }
    let elements = t.elements();
    let bytes = (elements / block)
        .checked_mul(dtype.type_size())
        .and_then(|b| u64::try_from(b).ok());
    let Some(bytes) = bytes else {
        return Err(Fail::Corrupt(format!(
            "tensor {}: {elements} elements of {dtype:?} overflow",
            t.name
        )));
    };
    Ok(GgufTensor {
        name: t.name.clone(),
        shape: t.shape.clone(),
        dtype,
        offset: t.offset,
        bytes,
    })
}

impl GgufHeader {
    /// Parses and validates the header of the GGUF file `file`; `path` names it in errors.
    pub fn parse(file: &[u8], path: &str) -> Result<Self> {
        let corrupt = |reason: String| ModelError::Corrupt {
            path: path.to_string(),
            reason,
        };
        let header = tp_spec::GgufHeader::read(file, file.len() as u64).map_err(|e| match e {
            GgufError::Corrupt { reason } => corrupt(reason),
            // The whole file was given: the header cannot continue past it.
            other => corrupt(other.to_string()),
        })?;
        let tensors = header
            .tensors
            .iter()
            .map(loadable)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|f| match f {
                Fail::Corrupt(reason) => corrupt(reason),
                Fail::Unsupported { tensor, dtype } => ModelError::UnsupportedDType {
                    name: format!("{tensor} in {path}"),
                    dtype,
                },
            })?;
        let bytes: Vec<u64> = tensors.iter().map(|t| t.bytes).collect();
        header
            .check_data(&bytes, file.len() as u64)
            .map_err(|e| corrupt(e.to_string()))?;
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufHeader {
            version: header.version,
            metadata: header
                .metadata
                .into_iter()
                .map(|(k, v)| (k, candle_value(v)))
                .collect(),
            tensors,
            index,
            alignment: header.alignment,
            data_offset: header.data_offset,
            header_bytes: header.header_bytes,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Absolute byte range of a tensor's data (inside the file: checked by `parse`).
    pub fn data_range(&self, t: &GgufTensor) -> std::ops::Range<usize> {
        let start = (self.data_offset + t.offset) as usize;
        start..start + t.bytes as usize
    }

    /// The same header as candle's `Content` (metadata cloned), for candle's GGUF models;
    /// tensors of types candle cannot hold (IQ4_NL, IQ4_XS) are left out.
    pub fn to_candle(&self) -> Content {
        Content {
            magic: if self.version == 2 {
                VersionedMagic::GgufV2
            } else {
                VersionedMagic::GgufV3
            },
            metadata: self.metadata.clone(),
            tensor_infos: self
                .tensors
                .iter()
                .filter_map(|t| {
                    Some((
                        t.name.clone(),
                        TensorInfo {
                            ggml_dtype: t.dtype.candle()?,
                            shape: candle_core::Shape::from(t.shape.clone()),
                            offset: t.offset,
                        },
                    ))
                })
                .collect(),
            tensor_data_offset: self.data_offset,
        }
    }
}
