//! HF-style model directories: `config.json` plus `model.safetensors` or shards listed in
//! `model.safetensors.index.json`. Files are memory-mapped; a rank copies out only its slices.

use crate::checkpoint::{
    copy_region, slice_from_bytes, Checkpoint, FloatKind, Storage, TensorMeta, WeightName,
    WeightSlice,
};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// One mapped `.safetensors` file.
struct Shard {
    path: String,
    map: Mmap,
    /// Where tensor data starts (8 + header length).
    data_start: usize,
}

/// A tensor's place: which shard, byte range inside its data section, shape and element type.
#[derive(Clone, Debug)]
struct Entry {
    shard: usize,
    offsets: (usize, usize),
    shape: Vec<usize>,
    kind: FloatKind,
}

/// An opened HF directory.
pub struct HfCheckpoint {
    dir: String,
    shards: Vec<Shard>,
    tensors: HashMap<String, Entry>,
    config: ModelConfig,
}

impl std::fmt::Debug for HfCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfCheckpoint")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// The HF tensor name of a weight.
pub fn hf_name(name: WeightName) -> String {
    let layer = |i: usize, rest: &str| format!("model.layers.{i}.{rest}");
    match name {
        WeightName::Embed => "model.embed_tokens.weight".into(),
        WeightName::Output => "lm_head.weight".into(),
        WeightName::OutputNorm => "model.norm.weight".into(),
        WeightName::AttnNorm(i) => layer(i, "input_layernorm.weight"),
        WeightName::Q(i) => layer(i, "self_attn.q_proj.weight"),
        WeightName::K(i) => layer(i, "self_attn.k_proj.weight"),
        WeightName::V(i) => layer(i, "self_attn.v_proj.weight"),
        WeightName::QBias(i) => layer(i, "self_attn.q_proj.bias"),
        WeightName::KBias(i) => layer(i, "self_attn.k_proj.bias"),
        WeightName::VBias(i) => layer(i, "self_attn.v_proj.bias"),
        WeightName::O(i) => layer(i, "self_attn.o_proj.weight"),
        WeightName::FfnNorm(i) => layer(i, "post_attention_layernorm.weight"),
        WeightName::Gate(i) => layer(i, "mlp.gate_proj.weight"),
        WeightName::Up(i) => layer(i, "mlp.up_proj.weight"),
        WeightName::Down(i) => layer(i, "mlp.down_proj.weight"),
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl HfCheckpoint {
    /// Opens `dir`, checks every tensor's header entry and reads the config.
    pub fn open(dir: &Path) -> Result<Self> {
        let shown = dir.display().to_string();
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(io_err(&config_path))?;
        let mut config = ModelConfig::from_hf_json(&text).map_err(|e| match e {
            ModelError::Config(m) => ModelError::Config(format!("{}: {m}", config_path.display())),
            other => other,
        })?;
        let files = shard_files(dir)?;
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = HashMap::new();
        for (i, path) in files.iter().enumerate() {
            let (shard, entries) = map_shard(path, i)?;
            for (name, e) in entries {
                tensors.insert(name, e);
            }
            shards.push(shard);
        }
        if !tensors.contains_key("lm_head.weight") {
            config.tied_embeddings = true;
        }
        Ok(HfCheckpoint {
            dir: shown,
            shards,
            tensors,
            config,
        })
    }

    fn entry(&self, name: WeightName) -> Result<(&Entry, String)> {
        let key = hf_name(name);
        match self.tensors.get(&key) {
            Some(e) => Ok((e, key)),
            None => Err(ModelError::MissingTensor {
                name: format!("{key} in {}", self.dir),
                arch: self.config.arch.name().into(),
            }),
        }
    }

    fn data(&self, name: WeightName) -> Result<(&[u8], TensorMeta, FloatKind)> {
        let meta = self.meta(name)?;
        let (e, _) = self.entry(name)?;
        let shard = &self.shards[e.shard];
        let start = shard.data_start + e.offsets.0;
        let end = shard.data_start + e.offsets.1;
        Ok((&shard.map[start..end], meta, e.kind))
    }
}

/// The `.safetensors` files of `dir`: the index's files (sorted, deduplicated) or the single
/// `model.safetensors`.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(io_err(&index))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ModelError::Corrupt {
                path: index.display().to_string(),
                reason: format!("not valid JSON ({e})"),
            })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::Corrupt {
                path: index.display().to_string(),
                reason: "it has no weight_map object".into(),
            })?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(str::to_string))
            .collect();
        files.sort();
        files.dedup();
        let mut out = Vec::with_capacity(files.len());
        for f in files {
            if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                return Err(ModelError::Corrupt {
                    path: index.display().to_string(),
                    reason: format!("shard file name {f:?} leaves the model directory"),
                });
            }
            out.push(dir.join(f));
        }
        return Ok(out);
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    Err(ModelError::Input(format!(
        "{} has config.json but neither model.safetensors nor model.safetensors.index.json",
        dir.display()
    )))
}

fn map_shard(path: &Path, index: usize) -> Result<(Shard, Vec<(String, Entry)>)> {
    let shown = path.display().to_string();
    let file = File::open(path).map_err(io_err(path))?;
    // SAFETY: the map is read-only and every access is bounds-checked against the header,
    // which `read_metadata` validated against the file length.
    let map = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
    let (header_len, metadata) =
        SafeTensors::read_metadata(&map).map_err(|e| ModelError::Corrupt {
            path: shown.clone(),
            reason: format!("safetensors header rejected ({e})"),
        })?;
    let mut entries = Vec::new();
    for (name, info) in metadata.tensors() {
        let kind = match info.dtype {
            Dtype::F32 => FloatKind::F32,
            Dtype::F16 => FloatKind::F16,
            Dtype::BF16 => FloatKind::BF16,
            other => {
                if !name.starts_with("model.") && name != "lm_head.weight" {
                    continue; // unrelated buffers (e.g. rotary inv_freq) may use any type
                }
                return Err(ModelError::UnsupportedDType {
                    name: format!("{name} in {shown}"),
                    dtype: format!("{other:?}"),
                });
            }
        };
        entries.push((
            name.clone(),
            Entry {
                shard: index,
                offsets: info.data_offsets,
                shape: info.shape.clone(),
                kind,
            },
        ));
    }
    Ok((
        Shard {
            path: shown,
            map,
            data_start: 8 + header_len,
        },
        entries,
    ))
}

fn check_range(what: &str, r: &Range<usize>, len: usize, key: &str) -> Result<()> {
    if r.start > r.end || r.end > len {
        return Err(ModelError::Input(format!(
            "{what} {}..{} out of range for {key} with {len}",
            r.start, r.end
        )));
    }
    Ok(())
}

impl Checkpoint for HfCheckpoint {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn source(&self) -> &str {
        &self.dir
    }

    fn meta(&self, name: WeightName) -> Result<TensorMeta> {
        let (e, key) = self.entry(name)?;
        let (rows, cols) = match e.shape.as_slice() {
            [n] => (*n, 1),
            [r, c] => (*r, *c),
            dims => {
                return Err(ModelError::TensorShape {
                    name: key,
                    found: dims.to_vec(),
                    expected: vec![0, 0],
                })
            }
        };
        let bytes = e.kind.bytes();
        if e.offsets.1 - e.offsets.0 != rows * cols * bytes {
            return Err(ModelError::Corrupt {
                path: self.shards[e.shard].path.clone(),
                reason: format!(
                    "tensor {key} holds {} bytes for shape {:?}",
                    e.offsets.1 - e.offsets.0,
                    e.shape
                ),
            });
        }
        Ok(TensorMeta {
            rows,
            cols,
            storage: Storage::Float { bytes },
        })
    }

    fn rows(&self, name: WeightName, rows: Range<usize>) -> Result<WeightSlice> {
        let (data, meta, kind) = self.data(name)?;
        check_range("rows", &rows, meta.rows, &hf_name(name))?;
        let n = rows.len();
        let bytes = copy_region(data, &meta, rows, 0..meta.cols);
        Ok(slice_from_bytes(meta.storage, n, meta.cols, bytes, kind))
    }

    fn cols(&self, name: WeightName, cols: Range<usize>) -> Result<WeightSlice> {
        let (data, meta, kind) = self.data(name)?;
        check_range("columns", &cols, meta.cols, &hf_name(name))?;
        let n = cols.len();
        let bytes = copy_region(data, &meta, 0..meta.rows, cols);
        Ok(slice_from_bytes(meta.storage, meta.rows, n, bytes, kind))
    }

    fn vector(&self, name: WeightName, range: Option<Range<usize>>) -> Result<Vec<f32>> {
        let (data, meta, kind) = self.data(name)?;
        let len = meta.rows * meta.cols;
        let r = range.unwrap_or(0..len);
        check_range("elements", &r, len, &hf_name(name))?;
        let b = kind.bytes();
        Ok(kind.decode(&data[r.start * b..r.end * b]))
    }
}
