//! GGUF checkpoints: the file is memory-mapped and a rank copies out only its byte ranges.

use crate::checkpoint::GgmlDType;
use crate::checkpoint::{
    check_layer_count, copy_region, expected_by_name, slice_from_bytes, unused_tensor_reason,
    validate_shapes, Checkpoint, Expected, FloatKind, Storage, TensorMeta, WeightName, WeightSlice,
};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::gguf_header::{GgufHeader, GgufTensor};
use crate::matrix::dequantize_blocks;
use candle_core::quantized::gguf_file::Value;
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::Path;

/// An opened GGUF model: header parsed and validated, tensor data mapped (not read).
pub struct GgufCheckpoint {
    path: String,
    map: Mmap,
    header: GgufHeader,
    config: ModelConfig,
}

impl std::fmt::Debug for GgufCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufCheckpoint")
            .field("path", &self.path)
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

pub use tp_spec::gguf_name;

impl GgufCheckpoint {
    /// Maps `path` and runs every check of [`check_gguf`] on it.
    pub fn open(path: &Path) -> Result<Self> {
        let shown = path.display().to_string();
        let io = |source| ModelError::Io {
            path: shown.clone(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            return Err(ModelError::Corrupt {
                path: shown,
                reason: "the file is empty".into(),
            });
        }
        // SAFETY: the map is read-only and every access goes through ranges that
        // `GgufHeader::parse` checked against the mapped length. A file truncated by another
        // process while mapped would fault; models are not rewritten while being served.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let (header, config) = check_gguf(&map, &shown)?;
        Ok(GgufCheckpoint {
            path: shown,
            map,
            header,
            config,
        })
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.header.metadata
    }

    /// The tokenizer's metadata (`tokenizer.*` keys), to give another file this model's
    /// tokenizer.
    pub fn tokenizer_metadata(&self) -> Vec<(String, Value)> {
        self.header
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The validated header (tensor infos, alignment, data offset).
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// Size of the mapped file in bytes.
    pub fn file_bytes(&self) -> usize {
        self.map.len()
    }

    fn info(&self, name: WeightName) -> Result<Located<'_>> {
        info(&self.header, &self.path, self.config.arch.name(), name)
    }

    /// The weight's bytes in the map (bounds checked at open): an expert of a merged 3-D
    /// tensor is its own run of rows, read without touching the other experts.
    fn data(&self, name: WeightName) -> Result<(&[u8], TensorMeta, GgmlDType)> {
        let meta = self.meta(name)?;
        let found = self.info(name)?;
        let all = &self.map[self.header.data_range(found.info)];
        let data = match found.expert {
            Some(e) => {
                let bytes = meta.rows * meta.storage.row_bytes(meta.cols);
                all.get(e * bytes..(e + 1) * bytes)
                    .ok_or_else(|| ModelError::Corrupt {
                        path: self.path.clone(),
                        reason: format!(
                            "{} holds {} bytes, too few for expert {e} of {bytes} bytes",
                            found.key,
                            all.len()
                        ),
                    })?
            }
            None => all,
        };
        Ok((data, meta, found.info.dtype))
    }
}

/// Everything [`GgufCheckpoint::open`] checks, on the file's bytes: the header (every length
/// bounded, tensors inside the file, tiling the data section without gap or overlap), the
/// config, a layer count the tensor count can hold, every tensor one the config uses (no
/// layer beyond the layer count, no unknown name), norm and bias vectors stored as floats,
/// and every weight present with its shape. Stops at the first inconsistency.
pub fn check_gguf(file: &[u8], path: &str) -> Result<(GgufHeader, ModelConfig)> {
    let header = GgufHeader::parse(file, path)?;
    let embed_rows = header
        .tensor("token_embd.weight")
        .and_then(|t| t.shape.first().copied());
    let has_output = header.tensor("output.weight").is_some();
    let config = crate::config::config_from_gguf(&header.metadata, embed_rows, has_output)
        .map_err(|e| e.in_file(path))?;
    config
        .check_runnable()
        .map_err(|e| ModelError::from(e).in_file(path))?;
    check_layer_count(&config, header.tensors.len(), path)?;
    let expected = expected_by_name(&config, gguf_name);
    // Merged expert tensors (`blk.N.ffn_gate_exps.weight`) stand for every expert's weight.
    let merged: HashMap<String, usize> = expected
        .values()
        .filter_map(|(w, _)| tp_spec::gguf_merged_name(*w))
        .map(|(key, _)| (key, config.experts.map_or(0, |e| e.count)))
        .collect();
    for t in &header.tensors {
        if let Some(&count) = merged.get(&t.name) {
            if t.shape.len() != 3 || t.shape[0] != count {
                return Err(ModelError::Inconsistent {
                    path: path.to_string(),
                    reason: format!(
                        "tensor {} has shape {:?}; merged expert weights are [experts, rows, cols] with {count} experts",
                        t.name, t.shape
                    ),
                });
            }
            continue;
        }
        match expected.get(&t.name) {
            None => {
                let layer = t
                    .name
                    .strip_prefix("blk.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|n| n.parse().ok());
                return Err(ModelError::Inconsistent {
                    path: path.to_string(),
                    reason: unused_tensor_reason(&config, &t.name, layer),
                });
            }
            Some((_, Expected::Vector { .. })) if t.shape.len() != 1 => {
                return Err(ModelError::Inconsistent {
                    path: path.to_string(),
                    reason: format!(
                        "tensor {} has shape {:?}; norm and bias vectors are 1-dimensional",
                        t.name, t.shape
                    ),
                });
            }
            Some((_, Expected::Vector { .. })) if float_kind(t.dtype).is_none() => {
                return Err(ModelError::Inconsistent {
                    path: path.to_string(),
                    reason: format!(
                        "tensor {} is stored as {:?}, but norm and bias vectors are F32, F16 or BF16",
                        t.name, t.dtype
                    ),
                });
            }
            Some(_) => {}
        }
    }
    let arch = config.arch.name();
    validate_shapes(
        &config,
        &|name| tensor_meta(&header, path, arch, name),
        &|name| format!("{} in {path}", gguf_name(name)),
    )?;
    Ok((header, config))
}

/// Where a weight lies in a GGUF: its tensor, its name, and for an expert of a merged 3-D
/// tensor its index there.
struct Located<'h> {
    info: &'h GgufTensor,
    key: String,
    expert: Option<usize>,
}

/// A weight's tensor: by its own name, or an expert's slot in the merged 3-D tensor.
fn info<'h>(
    header: &'h GgufHeader,
    path: &str,
    arch: &str,
    name: WeightName,
) -> Result<Located<'h>> {
    let key = gguf_name(name);
    if let Some(info) = header.tensor(&key) {
        return Ok(Located {
            info,
            key,
            expert: None,
        });
    }
    if let Some((merged, e)) = tp_spec::gguf_merged_name(name) {
        if let Some(info) = header.tensor(&merged) {
            return Ok(Located {
                info,
                key: format!("{merged} (expert {e})"),
                expert: Some(e),
            });
        }
        return Err(ModelError::MissingTensor {
            name: format!("{key} (or {merged}) in {path}"),
            arch: arch.into(),
        });
    }
    Err(ModelError::MissingTensor {
        name: format!("{key} in {path}"),
        arch: arch.into(),
    })
}

/// Shape `[rows, cols]` and storage of a weight from its tensor info.
fn tensor_meta(
    header: &GgufHeader,
    path: &str,
    arch: &str,
    name: WeightName,
) -> Result<TensorMeta> {
    let Located { info, key, expert } = info(header, path, arch, name)?;
    let (rows, cols) = match (info.shape.as_slice(), expert) {
        ([n], None) => (*n, 1),
        ([r, c], None) => (*r, *c),
        // An expert of a merged tensor (the expert count was checked at open).
        ([e, r, c], Some(i)) if i < *e => (*r, *c),
        (dims, _) => {
            return Err(ModelError::Corrupt {
                path: path.to_string(),
                reason: format!(
                    "tensor {key} has shape {dims:?}; a Llama-family weight has 1 or 2 dimensions"
                ),
            })
        }
    };
    let storage = match float_kind(info.dtype) {
        Some(k) => Storage::Float { bytes: k.bytes() },
        None => Storage::Quant(info.dtype),
    };
    Ok(TensorMeta {
        rows,
        cols,
        storage,
    })
}

fn float_kind(t: GgmlDType) -> Option<FloatKind> {
    match t {
        GgmlDType::F32 => Some(FloatKind::F32),
        GgmlDType::F16 => Some(FloatKind::F16),
        GgmlDType::BF16 => Some(FloatKind::BF16),
        _ => None,
    }
}

/// For a K-quant range starting and ending on 32-wide sub-blocks (but not on super-blocks):
/// where it starts in its first super-block.
fn sub_block_lead(dtype: GgmlDType, cols: &Range<usize>) -> Option<usize> {
    // IQ4_XS has the K-quants' shape (8 sub-blocks of 32 with integer scales) and their
    // sub-block form in tp-kernels.
    let k_quant = matches!(
        dtype,
        GgmlDType::Q2K
            | GgmlDType::Q3K
            | GgmlDType::Q4K
            | GgmlDType::Q5K
            | GgmlDType::Q6K
            | GgmlDType::IQ4_XS
    );
    let sub = dtype.block_size() / 8;
    (k_quant && cols.start.is_multiple_of(sub) && cols.end.is_multiple_of(sub))
        .then_some(cols.start % dtype.block_size())
}

fn check_range(what: &str, r: &Range<usize>, len: usize, key: &str) -> Result<()> {
    if r.start > r.end || r.end > len {
        return Err(ModelError::Config(format!(
            "{what} {}..{} out of range for {key} with {len}",
            r.start, r.end
        )));
    }
    Ok(())
}

impl Checkpoint for GgufCheckpoint {
    fn forget_tokenizer_metadata(&mut self) {
        let meta = &mut self.header.metadata;
        meta.retain(|key, _| !key.starts_with("tokenizer.ggml."));
        meta.shrink_to_fit();
    }

    fn release_pages(&self) {
        // SAFETY: a read-only shared file mapping: after MADV_DONTNEED a read faults the page
        // back in from the file, so no data is lost. A failure only leaves the pages resident.
        let _ = unsafe {
            self.map
                .unchecked_advise(memmap2::UncheckedAdvice::DontNeed)
        };
    }

    fn mapped_rows(
        &self,
        name: WeightName,
        rows: Range<usize>,
    ) -> Result<Option<(GgmlDType, &[u8])>> {
        let (data, meta, dtype) = self.data(name)?;
        check_range("rows", &rows, meta.rows, &gguf_name(name))?;
        let row_bytes = meta.storage.row_bytes(meta.cols);
        Ok(Some((
            dtype,
            &data[rows.start * row_bytes..rows.end * row_bytes],
        )))
    }

    fn release_bytes(&self, bytes: &[u8]) {
        let base = self.map.as_ptr() as usize;
        let at = bytes.as_ptr() as usize;
        if at < base || at + bytes.len() > base + self.map.len() || bytes.is_empty() {
            return;
        }
        // SAFETY: as in `release_pages`, on a range inside the map (just checked); memmap2
        // widens it to whole pages, which are read back from the file if touched again.
        let _ = unsafe {
            self.map.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                at - base,
                bytes.len(),
            )
        };
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn source(&self) -> &str {
        &self.path
    }

    fn describe(&self, name: WeightName) -> String {
        match self.info(name) {
            Ok(found) => format!("{} in {}", found.key, self.path),
            Err(_) => format!("{} in {}", gguf_name(name), self.path),
        }
    }

    fn meta(&self, name: WeightName) -> Result<TensorMeta> {
        tensor_meta(&self.header, &self.path, self.config.arch.name(), name)
    }

    fn rows(&self, name: WeightName, rows: Range<usize>) -> Result<WeightSlice> {
        let (data, meta, dtype) = self.data(name)?;
        check_range("rows", &rows, meta.rows, &gguf_name(name))?;
        let n = rows.len();
        let bytes = copy_region(data, &meta, rows, 0..meta.cols);
        Ok(slice_from_bytes(
            meta.storage,
            n,
            meta.cols,
            bytes,
            float_kind(dtype).unwrap_or(FloatKind::F32),
        ))
    }

    fn cols(&self, name: WeightName, cols: Range<usize>) -> Result<WeightSlice> {
        let (data, meta, dtype) = self.data(name)?;
        check_range("columns", &cols, meta.cols, &gguf_name(name))?;
        let block = meta.storage.block();
        let aligned = cols.start.is_multiple_of(block) && cols.end.is_multiple_of(block);
        if aligned {
            let bytes = copy_region(data, &meta, 0..meta.rows, cols.clone());
            return Ok(slice_from_bytes(
                meta.storage,
                meta.rows,
                cols.len(),
                bytes,
                float_kind(dtype).unwrap_or(FloatKind::F32),
            ));
        }
        if let Some(lead) = sub_block_lead(dtype, &cols) {
            // A K-quant range on 32-wide sub-blocks: keep the super-blocks it touches.
            let sb = meta.storage.block();
            let blocks = cols.start / sb * sb..cols.end.div_ceil(sb) * sb;
            let bytes = copy_region(data, &meta, 0..meta.rows, blocks);
            return Ok(WeightSlice::QuantSub {
                dtype,
                rows: meta.rows,
                cols: cols.len(),
                lead,
                bytes,
            });
        }
        // Not block aligned (a 32-wide format, or a K-quant range that cuts a 32-wide
        // sub-block): dequantize the whole weight once and keep the columns. Row-parallel
        // products over such shards are not tp-invariant.
        let full = dequantize_blocks(dtype, data, meta.rows, meta.cols)?; // [rows, cols]
        let values = full
            .chunks_exact(meta.cols.max(1))
            .flat_map(|row| &row[cols.clone()])
            .copied()
            .collect(); // [rows, cols_local]
        Ok(WeightSlice::Dense {
            rows: meta.rows,
            cols: cols.len(),
            values,
        })
    }

    fn vector(&self, name: WeightName, range: Option<Range<usize>>) -> Result<Vec<f32>> {
        let (data, meta, dtype) = self.data(name)?;
        let len = meta.rows * meta.cols;
        let values = match float_kind(dtype) {
            Some(k) => k.decode(data),
            None => dequantize_blocks(dtype, data, 1, len)?,
        };
        match range {
            None => Ok(values),
            Some(r) => {
                check_range("elements", &r, len, &gguf_name(name))?;
                Ok(values[r].to_vec())
            }
        }
    }
}
