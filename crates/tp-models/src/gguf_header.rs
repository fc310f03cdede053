//! GGUF header parser that trusts no field of the file (docs/reliability.md R4): every length is
//! bounded by the bytes that remain before anything is allocated, all offset arithmetic is
//! checked, and the tensors' data must tile the data section: no overlap, no gap.
//!
//! Layout (GGUF v2/v3, little-endian; the ggml repository's spec, github.com/ggml-org/ggml;
//! the rules of this reader: docs/gguf.md):
//! `"GGUF" u32:version u64:tensor_count u64:kv_count`, then `kv_count` metadata pairs
//! (`string:key u32:value_type value`), then `tensor_count` tensor infos
//! (`string:name u32:n_dims u64[n_dims]:dims (innermost first) u32:ggml_type u64:offset`),
//! padding to `general.alignment` (default 32), then the tensor data. A string is
//! `u64:len` + bytes; an array is `u32:elem_type u64:len` + elements (arrays may nest).
//!
//! Metadata values are candle's [`Value`] so that the tokenizer and candle's models can use
//! them; [`GgufHeader::to_candle`] builds a candle [`Content`] for tools and test oracles.
//! On a valid file the result equals candle's `Content::read` (tested on SmolLM2); it is
//! stricter where candle trusts the file: duplicate keys or tensor names, `general.alignment`
//! that is not a power of two of at least 8, tensor offsets off the alignment, overlapping
//! tensors, gaps between tensors' data (or unused bytes after the last), tensors without
//! dimensions or with a zero one, and ggml types neither candle nor our kernels load
//! (Q8_1, Q8_K, the IQ* types other than IQ4_NL and IQ4_XS, ...) are errors here.

use crate::checkpoint::GgmlDType;
use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
use std::collections::HashMap;

/// Alignment of the tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Nesting limit of arrays inside arrays (real files nest at most once).
pub const MAX_ARRAY_DEPTH: usize = 8;
/// Cap on the metadata values of one file (a 256k-token vocabulary with scores, types and
/// merges has under a million); bounds the memory a header can claim to about 130 MB, since
/// one value takes 32 bytes in memory for as little as 1 byte on disk.
pub const MAX_METADATA_VALUES: usize = 1 << 22;

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

/// GGUF metadata value type ids.
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

/// Fewest bytes one value of type `t` occupies on disk (`None` for an unknown type).
fn min_disk_size(t: u32) -> Option<usize> {
    Some(match t {
        T_U8 | T_I8 | T_BOOL => 1,
        T_U16 | T_I16 => 2,
        T_U32 | T_I32 | T_F32 => 4,
        T_U64 | T_I64 | T_F64 | T_STRING => 8,
        T_ARRAY => 12,
        _ => return None,
    })
}

/// A bounds-checked little-endian cursor over the file.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Metadata values read so far (see [`MAX_METADATA_VALUES`]).
    values: usize,
}

/// Why parsing stopped, before the file's path is attached.
enum Fail {
    Corrupt(String),
    Unsupported { tensor: String, dtype: String },
}

type Parse<T> = std::result::Result<T, Fail>;

fn corrupt<T>(reason: impl Into<String>) -> Parse<T> {
    Err(Fail::Corrupt(reason.into()))
}

/// Prefixes a corruption reason with where it happened.
fn context<T>(r: Parse<T>, what: impl FnOnce() -> String) -> Parse<T> {
    r.map_err(|f| match f {
        Fail::Corrupt(reason) => Fail::Corrupt(format!("{}: {reason}", what())),
        other => other,
    })
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Parse<&'a [u8]> {
        if n > self.remaining() {
            return corrupt(format!(
                "needs {n} bytes at byte {} but the file ends after {} (truncated)",
                self.pos,
                self.remaining()
            ));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Parse<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Parse<u8> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Parse<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Parse<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Parse<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count or length field, bounded by the bytes left when each item needs at least
    /// `min_item` bytes.
    fn length(&mut self, min_item: usize, what: &str) -> Parse<usize> {
        let at = self.pos;
        let n = self.u64()?;
        let fits = usize::try_from(n).ok().filter(|&n| {
            n.checked_mul(min_item.max(1))
                .is_some_and(|b| b <= self.remaining())
        });
        match fits {
            Some(n) => Ok(n),
            None => corrupt(format!(
                "{what} {n} (at byte {at}) needs more than the {} bytes left in the file: it is truncated or corrupt",
                self.remaining()
            )),
        }
    }

    /// A string's raw bytes, trailing NULs removed (some writers add them).
    fn string_bytes(&mut self) -> Parse<&'a [u8]> {
        let len = self.length(1, "string length")?;
        let mut s = self.take(len)?;
        while let [rest @ .., 0] = s {
            s = rest;
        }
        Ok(s)
    }

    /// A key or tensor name: must be UTF-8, since it is matched exactly.
    fn name(&mut self) -> Parse<String> {
        let at = self.pos;
        let bytes = self.string_bytes()?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => corrupt(format!("the name at byte {at} is not UTF-8")),
        }
    }

    /// A metadata value of type `t` (arrays recurse up to [`MAX_ARRAY_DEPTH`]).
    fn value(&mut self, t: u32, depth: usize) -> Parse<Value> {
        self.values += 1;
        if self.values > MAX_METADATA_VALUES {
            return corrupt(format!(
                "the metadata holds more than {MAX_METADATA_VALUES} values"
            ));
        }
        Ok(match t {
            T_U8 => Value::U8(self.u8()?),
            T_I8 => Value::I8(self.u8()? as i8),
            T_U16 => Value::U16(self.u16()?),
            T_I16 => Value::I16(self.u16()? as i16),
            T_U32 => Value::U32(self.u32()?),
            T_I32 => Value::I32(self.u32()? as i32),
            T_U64 => Value::U64(self.u64()?),
            T_I64 => Value::I64(self.u64()? as i64),
            T_F32 => Value::F32(f32::from_bits(self.u32()?)),
            T_F64 => Value::F64(f64::from_bits(self.u64()?)),
            T_BOOL => match self.u8()? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return corrupt(format!("boolean byte {b} is neither 0 nor 1")),
            },
            // Values keep candle's reading: invalid UTF-8 is replaced, not rejected (some
            // vocabularies hold raw bytes).
            T_STRING => Value::String(String::from_utf8_lossy(self.string_bytes()?).into_owned()),
            T_ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return corrupt(format!("arrays nest deeper than {MAX_ARRAY_DEPTH}"));
                }
                let at = self.pos;
                let elem = self.u32()?;
                let Some(min) = min_disk_size(elem) else {
                    return corrupt(format!(
                        "array element type {elem} (at byte {at}) is not a GGUF value type"
                    ));
                };
                let len = self.length(min, "array length")?;
                if self.values.saturating_add(len) > MAX_METADATA_VALUES {
                    return corrupt(format!(
                        "an array of {len} values exceeds the limit of {MAX_METADATA_VALUES} metadata values"
                    ));
                }
                let mut items = Vec::with_capacity(len);
                for i in 0..len {
                    items.push(context(self.value(elem, depth + 1), || {
                        format!("array element {i}")
                    })?);
                }
                Value::Array(items)
            }
            other => return corrupt(format!("value type {other} is not a GGUF value type")),
        })
    }
}

impl GgufHeader {
    /// Parses and validates the header of the GGUF file `file`; `path` names it in errors.
    pub fn parse(file: &[u8], path: &str) -> Result<Self> {
        parse(file).map_err(|f| match f {
            Fail::Corrupt(reason) => ModelError::Corrupt {
                path: path.to_string(),
                reason,
            },
            Fail::Unsupported { tensor, dtype } => ModelError::UnsupportedDType {
                name: format!("{tensor} in {path}"),
                dtype,
            },
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

/// Shows the first bytes of a file that is not GGUF, to help tell what it is.
fn describe_start(file: &[u8]) -> String {
    let head = &file[..file.len().min(16)];
    if head.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
        format!("{:?}", String::from_utf8_lossy(head))
    } else {
        format!("{head:02x?}")
    }
}

fn parse(file: &[u8]) -> Parse<GgufHeader> {
    if file.is_empty() {
        return corrupt("the file is empty");
    }
    if file.len() < 4 || &file[..4] != b"GGUF" {
        return corrupt(format!(
            "it is not a GGUF file: it starts with {} instead of \"GGUF\"",
            describe_start(file)
        ));
    }
    let mut c = Cursor {
        buf: file,
        pos: 4,
        values: 0,
    };
    let version = c.u32()?;
    match version {
        2 | 3 => {}
        1 => {
            return corrupt(
                "GGUF version 1 is obsolete; convert the model again with a current llama.cpp",
            )
        }
        v if (1..=3).contains(&v.swap_bytes()) => {
            return corrupt(format!(
                "GGUF version {} is stored big-endian; only little-endian GGUF files are read",
                v.swap_bytes()
            ))
        }
        v => {
            return corrupt(format!(
                "GGUF version {v} is unknown; versions 2 and 3 are read"
            ))
        }
    }
    // Each metadata pair takes at least 13 bytes, each tensor info at least 32.
    let tensor_count = context(c.length(32, "tensor count"), || "header".into())?;
    let kv_count = context(c.length(13, "metadata count"), || "header".into())?;
    if tensor_count
        .checked_mul(32)
        .and_then(|t| t.checked_add(kv_count * 13))
        .is_none_or(|need| need > c.remaining())
    {
        return corrupt(format!(
            "the header declares {tensor_count} tensors and {kv_count} metadata pairs, more than the {} bytes left can hold",
            c.remaining()
        ));
    }

    let mut metadata = HashMap::with_capacity(kv_count);
    for i in 0..kv_count {
        let key = context(c.name(), || format!("metadata key #{i}"))?;
        let at = c.pos;
        let t = context(c.u32(), || format!("metadata key {key}"))?;
        if min_disk_size(t).is_none() {
            return corrupt(format!(
                "metadata key {key}: value type {t} (at byte {at}) is not a GGUF value type"
            ));
        }
        let value = context(c.value(t, 0), || format!("metadata key {key}"))?;
        if metadata.contains_key(&key) {
            return corrupt(format!("metadata key {key} appears twice"));
        }
        metadata.insert(key, value);
    }

    let mut tensors = Vec::with_capacity(tensor_count);
    let mut index = HashMap::with_capacity(tensor_count);
    for i in 0..tensor_count {
        let name = context(c.name(), || format!("tensor #{i}"))?;
        let t = context(read_tensor(&mut c, &name), || format!("tensor {name}"))?;
        if index.insert(name.clone(), tensors.len()).is_some() {
            return corrupt(format!("tensor {name} appears twice"));
        }
        tensors.push(t);
    }
    let header_bytes = c.pos as u64;

    // The spec asks for a multiple of 8; at least 8 also keeps every tensor's data aligned for
    // candle's `qtensor_from_ggml`, which reinterprets the bytes as f32/f16 blocks.
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => {
            let a = match v {
                Value::U8(x) => Some(u64::from(*x)),
                Value::U16(x) => Some(u64::from(*x)),
                Value::U32(x) => Some(u64::from(*x)),
                Value::I8(x) => u64::try_from(*x).ok(),
                Value::I16(x) => u64::try_from(*x).ok(),
                Value::I32(x) => u64::try_from(*x).ok(),
                _ => None,
            };
            match a {
                Some(a) if a.is_power_of_two() && a >= 8 => a,
                _ => {
                    return corrupt(format!(
                        "metadata key general.alignment is {v:?}; it must be a u32 power of two of at least 8"
                    ))
                }
            }
        }
    };
    let Some(data_offset) = header_bytes.checked_next_multiple_of(alignment) else {
        return corrupt("the data offset overflows");
    };

    let file_len = file.len() as u64;
    for t in &tensors {
        if t.offset % alignment != 0 {
            return corrupt(format!(
                "tensor {} starts at data offset {}, not a multiple of the alignment {alignment}",
                t.name, t.offset
            ));
        }
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.bytes));
        if end.is_none_or(|e| e > file_len) {
            return corrupt(format!(
                "tensor {} ({} bytes at data offset {}) ends past the end of the file ({file_len} bytes): the file is truncated",
                t.name, t.bytes, t.offset
            ));
        }
    }
    check_packing(&tensors, alignment, data_offset, file_len)?;

    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        index,
        alignment,
        data_offset,
        header_bytes,
    })
}

/// Tensor data must tile the data section: sorted by offset, the first starts at 0 and each
/// next one at the previous end rounded up to the alignment (what every writer produces), and
/// the file ends within one alignment of the last tensor. An overlap means two tensors share
/// bytes; a gap means bytes no tensor accounts for, which is how a retyped or reshaped tensor
/// (say a norm relabelled F32 -> Q4_0) shows up: both are refused.
fn check_packing(
    tensors: &[GgufTensor],
    alignment: u64,
    data_offset: u64,
    file_len: u64,
) -> Parse<()> {
    let mut order: Vec<&GgufTensor> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    let mut expected = 0u64;
    let mut prev: Option<&GgufTensor> = None;
    for t in order {
        // Every tensor is in bounds (checked by the caller), so these sums cannot overflow.
        if t.offset < expected {
            let p = prev.map_or("", |p| p.name.as_str());
            return corrupt(format!(
                "tensors {p} and {} overlap (data offsets {} and {}, the first ends at {expected})",
                t.name,
                prev.map_or(0, |p| p.offset),
                t.offset
            ));
        }
        if t.offset > expected {
            let after = prev.map_or("the start of the data".to_string(), |p| {
                format!("tensor {}", p.name)
            });
            return corrupt(format!(
                "{} unused bytes between {after} and tensor {} (data offset {}, expected {expected}): a tensor's type or shape does not match its data",
                t.offset - expected,
                t.name,
                t.offset
            ));
        }
        let end = t.offset + t.bytes;
        expected = end.next_multiple_of(alignment);
        prev = Some(t);
    }
    if let Some(last) = prev {
        let padded = data_offset + expected;
        if file_len > padded {
            return corrupt(format!(
                "{} unused bytes after the last tensor ({}): a tensor's type or shape does not match its data, or bytes were appended",
                file_len - padded,
                last.name
            ));
        }
    }
    Ok(())
}

/// The rest of a tensor info after its name: dims, type, offset; sizes checked.
fn read_tensor(c: &mut Cursor<'_>, name: &str) -> Parse<GgufTensor> {
    let n_dims = c.u32()? as usize;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return corrupt(format!(
            "{n_dims} dimensions; ggml tensors have 1 to {MAX_DIMS}"
        ));
    }
    let mut shape = Vec::with_capacity(n_dims);
    for _ in 0..n_dims {
        let d = c.u64()?;
        match usize::try_from(d) {
            Ok(d) if d > 0 => shape.push(d),
            _ => return corrupt(format!("dimension {d} is not a positive size")),
        }
    }
    let Some(elements) = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) else {
        return corrupt(format!("dimensions {shape:?} overflow"));
    };
    let inner = shape[0];
    shape.reverse(); // outermost first
    let at = c.pos;
    let id = c.u32()?;
    let dtype = match ggml_type(id) {
        TypeId::Loadable(t) => t,
        TypeId::Unsupported(n) => {
            return Err(Fail::Unsupported {
                tensor: name.to_string(),
                dtype: format!("{n} (ggml type {id})"),
            })
        }
        TypeId::Unknown => {
            return corrupt(format!("type {id} (at byte {at}) is not a ggml type"));
        }
    };
    let offset = c.u64()?;
    let block = dtype.block_size();
    if !inner.is_multiple_of(block) {
        return corrupt(format!(
            "rows of {inner} elements are not whole {dtype:?} blocks of {block}"
        ));
    }
    let bytes = (elements / block)
        .checked_mul(dtype.type_size())
        .and_then(|b| u64::try_from(b).ok());
    let Some(bytes) = bytes else {
        return corrupt(format!("{elements} elements of {dtype:?} overflow"));
    };
    Ok(GgufTensor {
        name: name.to_string(),
        shape,
        dtype,
        offset,
        bytes,
    })
}
