//! GGUF checkpoints: the file is memory-mapped and a rank copies out only its byte ranges.

use crate::checkpoint::{
    copy_region, slice_from_bytes, Checkpoint, FloatKind, Storage, TensorMeta, WeightName,
    WeightSlice,
};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
use candle_core::Device;
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::Path;

/// An opened GGUF model: header parsed, tensor data mapped (not read).
pub struct GgufCheckpoint {
    path: String,
    map: Mmap,
    content: Content,
    config: ModelConfig,
}

impl std::fmt::Debug for GgufCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufCheckpoint")
            .field("path", &self.path)
            .field("tensors", &self.content.tensor_infos.len())
            .finish()
    }
}

/// The GGUF tensor name of a weight.
pub fn gguf_name(name: WeightName) -> String {
    match name {
        WeightName::Embed => "token_embd.weight".into(),
        WeightName::Output => "output.weight".into(),
        WeightName::OutputNorm => "output_norm.weight".into(),
        WeightName::AttnNorm(i) => format!("blk.{i}.attn_norm.weight"),
        WeightName::Q(i) => format!("blk.{i}.attn_q.weight"),
        WeightName::K(i) => format!("blk.{i}.attn_k.weight"),
        WeightName::V(i) => format!("blk.{i}.attn_v.weight"),
        WeightName::QBias(i) => format!("blk.{i}.attn_q.bias"),
        WeightName::KBias(i) => format!("blk.{i}.attn_k.bias"),
        WeightName::VBias(i) => format!("blk.{i}.attn_v.bias"),
        WeightName::O(i) => format!("blk.{i}.attn_output.weight"),
        WeightName::FfnNorm(i) => format!("blk.{i}.ffn_norm.weight"),
        WeightName::Gate(i) => format!("blk.{i}.ffn_gate.weight"),
        WeightName::Up(i) => format!("blk.{i}.ffn_up.weight"),
        WeightName::Down(i) => format!("blk.{i}.ffn_down.weight"),
    }
}

impl GgufCheckpoint {
    /// Maps `path`, parses the header and checks that every tensor lies inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        let shown = path.display().to_string();
        let file = File::open(path).map_err(|source| ModelError::Io {
            path: shown.clone(),
            source,
        })?;
        // SAFETY: the map is read-only; a file truncated under us would fault, which the
        // size checks below make unlikely for a file not being rewritten while we run.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io {
            path: shown.clone(),
            source,
        })?;
        if map.len() < 4 || &map[..4] != b"GGUF" {
            return Err(ModelError::Corrupt {
                path: shown,
                reason: "it does not start with the GGUF magic".into(),
            });
        }
        let mut cursor = std::io::Cursor::new(&map[..]);
        let content = Content::read(&mut cursor).map_err(|e| ModelError::Corrupt {
            path: shown.clone(),
            reason: format!("header unreadable ({e})"),
        })?;
        for (name, info) in &content.tensor_infos {
            let elems = info.shape.elem_count();
            let block = info.ggml_dtype.block_size();
            if !elems.is_multiple_of(block) {
                return Err(ModelError::Corrupt {
                    path: shown,
                    reason: format!(
                        "tensor {name} has {elems} elements, not whole blocks of {block}"
                    ),
                });
            }
            let size = (elems / block * info.ggml_dtype.type_size()) as u64;
            let end = content
                .tensor_data_offset
                .checked_add(info.offset)
                .and_then(|s| s.checked_add(size));
            if end.is_none_or(|e| e > map.len() as u64) {
                return Err(ModelError::Corrupt {
                    path: shown,
                    reason: format!(
                        "tensor {name} ends past the end of the file ({} bytes): the file is truncated",
                        map.len()
                    ),
                });
            }
        }
        let embed_rows = content
            .tensor_infos
            .get("token_embd.weight")
            .and_then(|i| i.shape.dims().first().copied());
        let has_output = content.tensor_infos.contains_key("output.weight");
        let config = ModelConfig::from_gguf(&content.metadata, embed_rows, has_output)?;
        Ok(GgufCheckpoint {
            path: shown,
            map,
            content,
            config,
        })
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Size of the mapped file in bytes.
    pub fn file_bytes(&self) -> usize {
        self.map.len()
    }

    fn info(
        &self,
        name: WeightName,
    ) -> Result<(&candle_core::quantized::gguf_file::TensorInfo, String)> {
        let key = gguf_name(name);
        match self.content.tensor_infos.get(&key) {
            Some(info) => Ok((info, key)),
            None => Err(ModelError::MissingTensor {
                name: key,
                arch: self.config.arch.name().into(),
            }),
        }
    }

    /// The tensor's bytes in the map (bounds checked at open).
    fn data(&self, name: WeightName) -> Result<(&[u8], TensorMeta, GgmlDType)> {
        let meta = self.meta(name)?;
        let (info, _) = self.info(name)?;
        let start = (self.content.tensor_data_offset + info.offset) as usize;
        let len = meta.rows * meta.storage.row_bytes(meta.cols);
        Ok((&self.map[start..start + len], meta, info.ggml_dtype))
    }
}

fn float_kind(t: GgmlDType) -> Option<FloatKind> {
    match t {
        GgmlDType::F32 => Some(FloatKind::F32),
        GgmlDType::F16 => Some(FloatKind::F16),
        GgmlDType::BF16 => Some(FloatKind::BF16),
        _ => None,
    }
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
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn source(&self) -> &str {
        &self.path
    }

    fn meta(&self, name: WeightName) -> Result<TensorMeta> {
        let (info, key) = self.info(name)?;
        let dims = info.shape.dims();
        let (rows, cols) = match dims {
            [n] => (*n, 1),
            [r, c] => (*r, *c),
            _ => {
                return Err(ModelError::TensorShape {
                    name: key,
                    found: dims.to_vec(),
                    expected: vec![0, 0],
                })
            }
        };
        let storage = match float_kind(info.ggml_dtype) {
            Some(k) => Storage::Float { bytes: k.bytes() },
            None => Storage::Quant(info.ggml_dtype),
        };
        Ok(TensorMeta {
            rows,
            cols,
            storage,
        })
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
        // Not block aligned: dequantize the whole weight once and keep the columns.
        let q = qtensor_from_ggml(dtype, data, vec![meta.rows, meta.cols], &Device::Cpu)?;
        let full = q.dequantize(&Device::Cpu)?; // [rows, cols]
        let part = full.narrow(1, cols.start, cols.len())?.contiguous()?; // [rows, cols_local]
        Ok(WeightSlice::Dense {
            rows: meta.rows,
            cols: cols.len(),
            values: part.flatten_all()?.to_vec1::<f32>()?,
        })
    }

    fn vector(&self, name: WeightName, range: Option<Range<usize>>) -> Result<Vec<f32>> {
        let (data, meta, dtype) = self.data(name)?;
        let len = meta.rows * meta.cols;
        let values = match float_kind(dtype) {
            Some(k) => k.decode(data),
            None => qtensor_from_ggml(dtype, data, vec![len], &Device::Cpu)?
                .dequantize(&Device::Cpu)?
                .to_vec1::<f32>()?,
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
