//! The one GGUF header reader (the loader in tp-models and the planner in tp-plan both call
//! it). It trusts no field of the file (docs/reliability.md R4): every count and length is
//! bounded by the bytes that remain in the file before anything is allocated, strings and the
//! metadata have caps, all offset arithmetic is checked, and errors name the key or tensor.
//!
//! Layout (GGUF v2/v3, little-endian; the ggml repository's spec, github.com/ggml-org/ggml;
//! the rules of this reader: docs/gguf.md):
//! `"GGUF" u32:version u64:tensor_count u64:kv_count`, then `kv_count` metadata pairs
//! (`string:key u32:value_type value`), then `tensor_count` tensor infos
//! (`string:name u32:n_dims u64[n_dims]:dims (innermost first) u32:ggml_type u64:offset`),
//! padding to `general.alignment` (default 32), then the tensor data. A string is
//! `u64:len` + bytes; an array is `u32:elem_type u64:len` + elements (arrays may nest).
//!
//! [`GgufHeader::read`] parses the header from the file's first bytes (a prefix is enough: it
//! says [`GgufError::Incomplete`] when it needs more); it refuses duplicate keys or tensor
//! names, a `general.alignment` that is not a power of two of at least 8, tensors without
//! dimensions or with a zero one. The tensor types stay ggml ids: which types load, and their
//! sizes, are the caller's. [`GgufHeader::check_data`] then checks the data section against
//! the file's length given each tensor's byte count: offsets on the alignment, every tensor
//! inside the file, and the tensors tiling the data with no overlap and no gap.

use crate::config::{MetaValue, Metadata};
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use thiserror::Error;

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
/// Most tensors of one file (the largest models have a few thousand per file); with the
/// metadata cap, bounds what the counts of a header can make the reader allocate.
pub const MAX_TENSORS: usize = 1 << 20;
/// Bytes of a file [`GgufHeader::read_file`] reads first; it doubles the read while the header
/// goes on.
pub const FIRST_READ: u64 = 1 << 20;
/// Longest string (key, value or tensor name) read: the largest real ones are chat templates
/// and embedded tokenizer.json documents of a few MB.
pub const MAX_STRING_BYTES: u64 = 1 << 26;

/// A GGUF metadata value, as stored.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    /// Invalid UTF-8 is replaced, not rejected (some vocabularies hold raw bytes), as
    /// llama.cpp's and candle's readers do.
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The value as the config readers see it (arrays keep only their length).
    pub fn to_meta(&self) -> MetaValue {
        match self {
            GgufValue::U8(x) => MetaValue::Uint(u64::from(*x)),
            GgufValue::U16(x) => MetaValue::Uint(u64::from(*x)),
            GgufValue::U32(x) => MetaValue::Uint(u64::from(*x)),
            GgufValue::U64(x) => MetaValue::Uint(*x),
            GgufValue::I8(x) => MetaValue::Int(i64::from(*x)),
            GgufValue::I16(x) => MetaValue::Int(i64::from(*x)),
            GgufValue::I32(x) => MetaValue::Int(i64::from(*x)),
            GgufValue::I64(x) => MetaValue::Int(*x),
            GgufValue::F32(x) => MetaValue::Float(f64::from(*x)),
            GgufValue::F64(x) => MetaValue::Float(*x),
            GgufValue::Bool(x) => MetaValue::Bool(*x),
            GgufValue::String(s) => MetaValue::Text(s.clone()),
            GgufValue::Array(a) => MetaValue::Array { len: a.len() },
        }
    }
}

impl Metadata for HashMap<String, GgufValue> {
    fn meta(&self, key: &str) -> Option<MetaValue> {
        self.get(key).map(GgufValue::to_meta)
    }
}

/// Why a GGUF header cannot be read.
#[derive(Debug, Error)]
pub enum GgufError {
    /// The file cannot be opened or read ([`GgufHeader::read_file`]).
    #[error("cannot read it: {0}")]
    Io(#[from] std::io::Error),
    /// The bytes given end inside the header of a longer file: read more of it and try again.
    #[error("the header continues past the first {have} bytes read (it needs {needed} more)")]
    Incomplete { have: u64, needed: u64 },
    /// Not a GGUF file, or a header that contradicts itself or the file's length; the reason
    /// names the key or tensor and the byte where reading stopped.
    #[error("{reason}")]
    Corrupt { reason: String },
}

type Parse<T> = Result<T, GgufError>;

fn corrupt<T>(reason: impl Into<String>) -> Parse<T> {
    Err(GgufError::Corrupt {
        reason: reason.into(),
    })
}

/// Prefixes a corruption reason with where it happened.
fn context<T>(r: Parse<T>, what: impl FnOnce() -> String) -> Parse<T> {
    r.map_err(|e| match e {
        GgufError::Corrupt { reason } => GgufError::Corrupt {
            reason: format!("{}: {reason}", what()),
        },
        other => other,
    })
}

/// One tensor's entry in the header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Outermost dimension first (a matrix is `[rows, cols]`); the file lists them innermost
    /// first. Every dimension is positive and their product fits a `usize`.
    pub shape: Vec<usize>,
    /// The ggml type id as stored (`Layout::of_ggml_type` and the loader's table read it).
    pub ggml_type: u32,
    /// Start of the data relative to [`GgufHeader::data_offset`].
    pub offset: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A parsed GGUF header.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: HashMap<String, GgufValue>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    pub alignment: u64,
    /// Where tensor data starts in the file.
    pub data_offset: u64,
    /// Bytes of the header proper (before the alignment padding).
    pub header_bytes: u64,
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

/// A bounds-checked little-endian cursor over the first bytes of a file of `file_len` bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    file_len: u64,
    /// Metadata values read so far (see [`MAX_METADATA_VALUES`]).
    values: usize,
}

impl<'a> Cursor<'a> {
    /// Bytes of the file after the cursor (not only those given).
    fn remaining(&self) -> usize {
        usize::try_from(self.file_len.saturating_sub(self.pos as u64)).unwrap_or(usize::MAX)
    }

    fn take(&mut self, n: usize) -> Parse<&'a [u8]> {
        if n > self.remaining() {
            return corrupt(format!(
                "needs {n} bytes at byte {} but the file ends after {} (truncated)",
                self.pos,
                self.remaining()
            ));
        }
        let have = self.buf.len() - self.pos;
        if n > have {
            return Err(GgufError::Incomplete {
                have: self.buf.len() as u64,
                needed: (n - have) as u64,
            });
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

    /// A count or length field, bounded by the bytes left in the file when each item needs at
    /// least `min_item` bytes.
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
        let at = self.pos;
        let len = self.u64()?;
        if len > MAX_STRING_BYTES {
            return corrupt(format!(
                "string length {len} (at byte {at}) is implausibly large: strings are read up to {MAX_STRING_BYTES} bytes"
            ));
        }
        self.pos = at;
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
    fn value(&mut self, t: u32, depth: usize) -> Parse<GgufValue> {
        self.values += 1;
        if self.values > MAX_METADATA_VALUES {
            return corrupt(format!(
                "the metadata holds more than {MAX_METADATA_VALUES} values"
            ));
        }
        Ok(match t {
            T_U8 => GgufValue::U8(self.u8()?),
            T_I8 => GgufValue::I8(self.u8()? as i8),
            T_U16 => GgufValue::U16(self.u16()?),
            T_I16 => GgufValue::I16(self.u16()? as i16),
            T_U32 => GgufValue::U32(self.u32()?),
            T_I32 => GgufValue::I32(self.u32()? as i32),
            T_U64 => GgufValue::U64(self.u64()?),
            T_I64 => GgufValue::I64(self.u64()? as i64),
            T_F32 => GgufValue::F32(f32::from_bits(self.u32()?)),
            T_F64 => GgufValue::F64(f64::from_bits(self.u64()?)),
            T_BOOL => match self.u8()? {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return corrupt(format!("boolean byte {b} is neither 0 nor 1")),
            },
            T_STRING => {
                GgufValue::String(String::from_utf8_lossy(self.string_bytes()?).into_owned())
            }
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
                GgufValue::Array(items)
            }
            other => return corrupt(format!("value type {other} is not a GGUF value type")),
        })
    }

    /// The rest of a tensor info after its name: dims, type, offset.
    fn tensor(&mut self, name: String) -> Parse<TensorInfo> {
        let n_dims = self.u32()? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return corrupt(format!(
                "{n_dims} dimensions; ggml tensors have 1 to {MAX_DIMS}"
            ));
        }
        let mut shape = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            let d = self.u64()?;
            match usize::try_from(d) {
                Ok(d) if d > 0 => shape.push(d),
                _ => return corrupt(format!("dimension {d} is not a positive size")),
            }
        }
        if shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .is_none()
        {
            return corrupt(format!("dimensions {shape:?} overflow"));
        }
        shape.reverse(); // outermost first
        let ggml_type = self.u32()?;
        let offset = self.u64()?;
        Ok(TensorInfo {
            name,
            shape,
            ggml_type,
            offset,
        })
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

impl GgufHeader {
    /// Parses the header of a GGUF file of `file_len` bytes from its first bytes `start`
    /// (the whole file, or a prefix: [`GgufError::Incomplete`] asks for more).
    pub fn read(start: &[u8], file_len: u64) -> Result<GgufHeader, GgufError> {
        let start = &start[..start
            .len()
            .min(usize::try_from(file_len).unwrap_or(usize::MAX))];
        if file_len == 0 {
            return corrupt("the file is empty");
        }
        if start.len() < 4 && (start.len() as u64) < file_len {
            return Err(GgufError::Incomplete {
                have: start.len() as u64,
                needed: 4 - start.len() as u64,
            });
        }
        if start.len() < 4 || &start[..4] != b"GGUF" {
            return corrupt(format!(
                "it is not a GGUF file: it starts with {} instead of \"GGUF\"",
                describe_start(start)
            ));
        }
        let mut c = Cursor {
            buf: start,
            pos: 4,
            file_len,
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
        if tensor_count > MAX_TENSORS || kv_count > MAX_METADATA_VALUES {
            return corrupt(format!(
                "the header declares {tensor_count} tensors and {kv_count} metadata pairs; at most {MAX_TENSORS} tensors and {MAX_METADATA_VALUES} pairs are read"
            ));
        }
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

        // Capacities grow with what is read, not with what the counts claim.
        let mut metadata = HashMap::with_capacity(kv_count.min(1024));
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

        let mut tensors = Vec::with_capacity(tensor_count.min(4096));
        let mut index = HashMap::with_capacity(tensor_count.min(4096));
        for i in 0..tensor_count {
            let name = context(c.name(), || format!("tensor #{i}"))?;
            let shown = name.clone();
            let t = context(c.tensor(name), || format!("tensor {shown}"))?;
            if index.insert(shown.clone(), tensors.len()).is_some() {
                return corrupt(format!("tensor {shown} appears twice"));
            }
            tensors.push(t);
        }
        let header_bytes = c.pos as u64;

        // The spec asks for a multiple of 8; at least 8 also keeps every tensor's data aligned
        // for readers that reinterpret the bytes as f32/f16 blocks.
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => {
                let a = match v {
                    GgufValue::U8(x) => Some(u64::from(*x)),
                    GgufValue::U16(x) => Some(u64::from(*x)),
                    GgufValue::U32(x) => Some(u64::from(*x)),
                    GgufValue::I8(x) => u64::try_from(*x).ok(),
                    GgufValue::I16(x) => u64::try_from(*x).ok(),
                    GgufValue::I32(x) => u64::try_from(*x).ok(),
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

    /// Reads the header of the GGUF file at `path`, never its tensor data: the first
    /// [`FIRST_READ`] bytes, then twice as many while the header goes on (never more than the
    /// file holds; every length in it is bounded by the file's).
    pub fn read_file(path: &Path) -> Result<GgufHeader, GgufError> {
        let mut file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        let mut start = Vec::new();
        let mut want = FIRST_READ.min(len);
        loop {
            let more = want - start.len() as u64;
            (&mut file).take(more).read_to_end(&mut start)?;
            // A file that shrank while being read is a shorter file.
            let len = if (start.len() as u64) < want {
                start.len() as u64
            } else {
                len
            };
            match GgufHeader::read(&start, len) {
                Err(GgufError::Incomplete { .. }) if (start.len() as u64) < len => {
                    want = want.saturating_mul(2).min(len);
                }
                done => return done,
            }
        }
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Checks the data section of a file of `file_len` bytes, `bytes[i]` being the data bytes
    /// of `tensors[i]`: every offset on the alignment, every tensor inside the file, and the
    /// data tiled without overlap or gap ([`check_packing`]).
    pub fn check_data(&self, bytes: &[u64], file_len: u64) -> Result<(), GgufError> {
        if bytes.len() != self.tensors.len() {
            return corrupt(format!(
                "{} tensor sizes given for {} tensors",
                bytes.len(),
                self.tensors.len()
            ));
        }
        let alignment = self.alignment;
        for (t, &size) in self.tensors.iter().zip(bytes) {
            if t.offset % alignment != 0 {
                return corrupt(format!(
                    "tensor {} starts at data offset {}, not a multiple of the alignment {alignment}",
                    t.name, t.offset
                ));
            }
            let end = self
                .data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(size));
            if end.is_none_or(|e| e > file_len) {
                return corrupt(format!(
                    "tensor {} ({size} bytes at data offset {}) ends past the end of the file ({file_len} bytes): the file is truncated",
                    t.name, t.offset
                ));
            }
        }
        check_packing(self, bytes, file_len)
    }
}

/// Tensor data must tile the data section: sorted by offset, the first starts at 0 and each
/// next one at the previous end rounded up to the alignment (what every writer produces), and
/// the file ends within one alignment of the last tensor. An overlap means two tensors share
/// bytes; a gap means bytes no tensor accounts for, which is how a retyped or reshaped tensor
/// (say a norm relabelled F32 -> Q4_0) shows up: both are refused.
fn check_packing(h: &GgufHeader, bytes: &[u64], file_len: u64) -> Parse<()> {
    let mut order: Vec<(&TensorInfo, u64)> = h.tensors.iter().zip(bytes.iter().copied()).collect();
    order.sort_by_key(|(t, _)| t.offset);
    let mut expected = 0u64;
    let mut prev: Option<&TensorInfo> = None;
    for (t, size) in order {
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
        expected = (t.offset + size).next_multiple_of(h.alignment);
        prev = Some(t);
    }
    if let Some(last) = prev {
        let padded = h.data_offset + expected;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    /// A header with a u32 key, a string array and one F32 tensor `[2, 8]` (no data).
    fn header() -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&1u64.to_le_bytes());
        out.extend_from_slice(&2u64.to_le_bytes());
        string(&mut out, "llama.block_count");
        out.extend_from_slice(&4u32.to_le_bytes());
        out.extend_from_slice(&30u32.to_le_bytes());
        string(&mut out, "tokenizer.ggml.tokens");
        out.extend_from_slice(&9u32.to_le_bytes());
        out.extend_from_slice(&8u32.to_le_bytes());
        out.extend_from_slice(&2u64.to_le_bytes());
        string(&mut out, "a");
        string(&mut out, "bc");
        string(&mut out, "w");
        out.extend_from_slice(&2u32.to_le_bytes());
        out.extend_from_slice(&8u64.to_le_bytes());
        out.extend_from_slice(&2u64.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes());
        out
    }

    #[test]
    fn reads_metadata_and_tensor_infos_without_the_data() {
        let h = header();
        let g = GgufHeader::read(&h, h.len() as u64).unwrap();
        assert_eq!(
            g.metadata.meta("llama.block_count"),
            Some(MetaValue::Uint(30))
        );
        assert_eq!(
            g.metadata.meta("tokenizer.ggml.tokens"),
            Some(MetaValue::Array { len: 2 })
        );
        let w = g.tensor("w").unwrap();
        assert_eq!(
            (w.shape.clone(), w.ggml_type, w.elements()),
            (vec![2, 8], 0, 16)
        );
        assert_eq!(g.header_bytes, h.len() as u64);
        assert_eq!(g.data_offset, (h.len() as u64).next_multiple_of(32));
        // The data is missing: the data check says so, naming the tensor.
        let e = g.check_data(&[64], h.len() as u64).unwrap_err().to_string();
        assert!(e.contains("tensor w") && e.contains("past the end"), "{e}");
        let mut file = h.clone();
        file.resize(g.data_offset as usize + 64, 0);
        g.check_data(&[64], file.len() as u64).unwrap();
        let e = g
            .check_data(&[32], file.len() as u64)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unused bytes after the last tensor"), "{e}");
    }

    #[test]
    fn a_prefix_asks_for_more_and_the_whole_header_reads_the_same() {
        let h = header();
        let file_len = h.len() as u64 + 4096;
        for cut in 0..h.len() {
            match GgufHeader::read(&h[..cut], file_len) {
                Err(GgufError::Incomplete { have, needed }) => {
                    assert_eq!(have, cut as u64);
                    assert!(needed > 0);
                }
                other => panic!("cut {cut}: {other:?}"),
            }
            // The same bytes as a whole file are truncated: a corrupt header, never a panic.
            assert!(matches!(
                GgufHeader::read(&h[..cut], cut as u64),
                Err(GgufError::Corrupt { .. })
            ));
        }
        let whole = GgufHeader::read(&h, file_len).unwrap();
        assert_eq!(
            whole.tensors,
            GgufHeader::read(&h, h.len() as u64).unwrap().tensors
        );
    }

    #[test]
    fn lengths_are_bounded_before_anything_is_allocated() {
        let mut h = header();
        // The first key's length: larger than the string cap, then larger than the file.
        h[24..32].copy_from_slice(&(MAX_STRING_BYTES + 1).to_le_bytes());
        let e = GgufHeader::read(&h, u64::MAX).unwrap_err().to_string();
        assert!(
            e.contains("metadata key #0") && e.contains("implausibly large"),
            "{e}"
        );
        h[24..32].copy_from_slice(&1000u64.to_le_bytes());
        let e = GgufHeader::read(&h, h.len() as u64)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("string length 1000") && e.contains("bytes left"),
            "{e}"
        );
        // Counts that the file cannot hold.
        let mut h = header();
        h[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let e = GgufHeader::read(&h, u64::MAX).unwrap_err().to_string();
        assert!(
            e.contains("1099511627776 tensors") && e.contains("at most"),
            "{e}"
        );
        let e = GgufHeader::read(&h, h.len() as u64)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tensor count") && e.contains("bytes left"),
            "{e}"
        );
    }
}
