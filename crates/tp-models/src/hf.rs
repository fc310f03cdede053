//! HF-style model directories: `config.json` plus `model.safetensors` or shards listed in
//! `model.safetensors.index.json`. Files are memory-mapped; a rank copies out only its slices.

use crate::checkpoint::{
    check_layer_count, copy_region, expected_by_name, expected_weights, slice_from_bytes,
    unused_tensor_reason, validate_weights, Checkpoint, FloatKind, Storage, TensorMeta, WeightName,
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
    /// The float encoding, or the name of a type weights cannot have.
    kind: std::result::Result<FloatKind, String>,
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

pub use tp_spec::hf_name;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.display().to_string(),
        source,
    }
}

const INDEX: &str = "model.safetensors.index.json";

impl HfCheckpoint {
    /// Opens `dir`: reads `config.json`, maps every `.safetensors` file (validating its
    /// header), checks the shard index against the files, and checks that every weight the
    /// config calls for is present with its shape and a float type.
    pub fn open(dir: &Path) -> Result<Self> {
        let shown = dir.display().to_string();
        if !dir.is_dir() {
            return Err(ModelError::Input(format!(
                "{shown} is not a directory; give an HF model directory (config.json + *.safetensors) or a GGUF file"
            )));
        }
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(ModelError::Input(format!(
                "{shown} has no config.json, so it is not an HF model directory; give a GGUF file, or a directory with config.json and *.safetensors"
            )));
        }
        let config_shown = config_path.display().to_string();
        let text = std::fs::read_to_string(&config_path).map_err(io_err(&config_path))?;
        let mut config = ModelConfig::from_hf_json(&text)
            .map_err(|e| ModelError::from(e).in_file(&config_shown))?;
        config
            .check_runnable()
            .map_err(|e| ModelError::from(e).in_file(&config_shown))?;
        let (files, weight_map) = shard_files(dir)?;
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors: HashMap<String, Entry> = HashMap::new();
        for (i, path) in files.iter().enumerate() {
            let (shard, entries) = map_shard(path, i)?;
            for (name, e) in entries {
                if let Some(prev) = tensors.get(&name) {
                    return Err(ModelError::Corrupt {
                        path: shard.path.clone(),
                        reason: format!(
                            "tensor {name} is also in {}; the shards overlap: download the model again",
                            shards
                                .get(prev.shard)
                                .map_or(String::new(), |s: &Shard| s.path.clone())
                        ),
                    });
                }
                tensors.insert(name, e);
            }
            shards.push(shard);
        }
        if let Some((index, weight_map)) = weight_map {
            for (name, file) in &weight_map {
                let in_file = tensors
                    .get(name)
                    .and_then(|e| shards.get(e.shard))
                    .is_some_and(|s| Path::new(&s.path).file_name() == Some(file.as_ref()));
                if !in_file {
                    return Err(ModelError::Corrupt {
                        path: index.display().to_string(),
                        reason: format!(
                            "it places tensor {name} in {file}, which does not hold it; the index and the shards come from different downloads"
                        ),
                    });
                }
            }
        }
        if !tensors.contains_key("lm_head.weight") {
            config.tied_embeddings = true;
        }
        check_layer_count(&config, tensors.len(), &shown)?;
        check_unused(&config, &tensors, &shown)?;
        let ckpt = HfCheckpoint {
            dir: shown,
            shards,
            tensors,
            config,
        };
        ckpt.check_weight_types()?;
        validate_weights(&ckpt)?;
        Ok(ckpt)
    }

    /// A weight's tensor name in this model's HF spelling.
    fn key(&self, name: WeightName) -> String {
        hf_name(self.config.arch, name)
    }

    /// Weights the model uses must be floats; other tensors (buffers) may be anything.
    fn check_weight_types(&self) -> Result<()> {
        for (name, _) in expected_weights(&self.config) {
            let key = self.key(name);
            if let Some(e) = self.tensors.get(&key) {
                if let Err(dtype) = &e.kind {
                    return Err(ModelError::UnsupportedDType {
                        name: format!("{key} in {}", self.shards[e.shard].path),
                        dtype: dtype.clone(),
                    });
                }
            }
        }
        Ok(())
    }

    fn entry(&self, name: WeightName) -> Result<(&Entry, FloatKind, String)> {
        let key = self.key(name);
        match self.tensors.get(&key) {
            Some(e) => match &e.kind {
                Ok(kind) => Ok((e, *kind, key)),
                Err(dtype) => Err(ModelError::UnsupportedDType {
                    name: format!("{key} in {}", self.shards[e.shard].path),
                    dtype: dtype.clone(),
                }),
            },
            None => Err(ModelError::MissingTensor {
                name: format!("{key} in {}", self.dir),
                arch: self.config.arch.name().into(),
            }),
        }
    }

    fn data(&self, name: WeightName) -> Result<(&[u8], TensorMeta, FloatKind)> {
        let meta = self.meta(name)?;
        let (e, kind, _) = self.entry(name)?;
        let shard = &self.shards[e.shard];
        let start = shard.data_start + e.offsets.0;
        let end = shard.data_start + e.offsets.1;
        Ok((&shard.map[start..end], meta, kind))
    }
}

/// Refuses tensors the config does not use (they would be ignored), except RoPE's
/// `rotary_emb.inv_freq` buffers (recomputed from `rope_theta`) and `lm_head.weight` of a
/// tied model (transformers ties it to the embedding on load, ignoring the stored copy).
fn check_unused(cfg: &ModelConfig, tensors: &HashMap<String, Entry>, dir: &str) -> Result<()> {
    let expected = expected_by_name(cfg, |w| hf_name(cfg.arch, w));
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort_unstable();
    for name in names {
        let ignorable = name.ends_with("rotary_emb.inv_freq")
            || (cfg.tied_embeddings && name == "lm_head.weight");
        if expected.contains_key(name) || ignorable {
            continue;
        }
        let layer = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse().ok());
        return Err(ModelError::Inconsistent {
            path: dir.to_string(),
            reason: unused_tensor_reason(cfg, name, layer),
        });
    }
    Ok(())
}

/// A shard index: its path and `tensor -> file name`.
type WeightMap = (PathBuf, Vec<(String, String)>);

/// The `.safetensors` files of `dir`: the index's files (sorted, deduplicated, each a plain
/// file name inside `dir`) or the single `model.safetensors`.
fn shard_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<WeightMap>)> {
    let index = dir.join(INDEX);
    if index.is_file() {
        let shown = index.display().to_string();
        let bad = |reason: String| ModelError::Corrupt {
            path: shown.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&index).map_err(io_err(&index))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON ({e})")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("it has no weight_map object".into()))?;
        let mut pairs = Vec::with_capacity(map.len());
        for (tensor, file) in map {
            let Some(file) = file.as_str() else {
                return Err(bad(format!(
                    "weight_map entry {tensor} is {file}, not a file name"
                )));
            };
            let plain = matches!(
                Path::new(file).components().collect::<Vec<_>>().as_slice(),
                [std::path::Component::Normal(_)]
            );
            if !plain || file.contains('\\') || file.starts_with('.') {
                return Err(bad(format!(
                    "shard file name {file:?} (for {tensor}) leaves the model directory; only plain file names are followed"
                )));
            }
            pairs.push((tensor.clone(), file.to_string()));
        }
        let mut files: Vec<&str> = pairs.iter().map(|(_, f)| f.as_str()).collect();
        files.sort_unstable();
        files.dedup();
        if files.is_empty() {
            return Err(bad("its weight_map lists no shard files".into()));
        }
        let mut out = Vec::with_capacity(files.len());
        for f in files {
            let path = dir.join(f);
            if !path.is_file() {
                return Err(ModelError::Input(format!(
                    "{} is missing: {shown} lists it as a shard; the download is incomplete, fetch that file again",
                    path.display()
                )));
            }
            out.push(path);
        }
        return Ok((out, Some((index, pairs))));
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok((vec![single], None));
    }
    Err(ModelError::Input(format!(
        "{} has config.json but neither model.safetensors nor {INDEX}; download the weights into it",
        dir.display()
    )))
}

/// What a rejected safetensors header means for the user.
fn safetensors_reason(e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall => "it is shorter than a safetensors header (empty or truncated)".into(),
        E::InvalidHeaderLength | E::HeaderTooLarge => {
            "its header length field points past the end of the file (truncated, or not a safetensors file)".into()
        }
        E::MetadataIncompleteBuffer => {
            "its tensor data does not fill the file exactly (truncated, or bytes appended)".into()
        }
        other => format!("its safetensors header is invalid ({other})"),
    }
}

fn map_shard(path: &Path, index: usize) -> Result<(Shard, Vec<(String, Entry)>)> {
    let shown = path.display().to_string();
    let file = File::open(path).map_err(io_err(path))?;
    // SAFETY: the map is read-only and every access is bounds-checked against the header,
    // which `read_metadata` validated against the file length (tensors contiguous, sizes
    // matching shapes and dtypes, data filling the file exactly).
    let map = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
    let (header_len, metadata) =
        SafeTensors::read_metadata(&map).map_err(|e| ModelError::Corrupt {
            path: shown.clone(),
            reason: safetensors_reason(&e),
        })?;
    let mut entries = Vec::new();
    for (name, info) in metadata.tensors() {
        let kind = match info.dtype {
            Dtype::F32 => Ok(FloatKind::F32),
            Dtype::F16 => Ok(FloatKind::F16),
            Dtype::BF16 => Ok(FloatKind::BF16),
            other => Err(format!("{other:?}")),
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
    fn release_pages(&self) {
        // SAFETY: read-only shared file mappings: after MADV_DONTNEED a read faults the page
        // back in from the file, so no data is lost. A failure only leaves the pages resident.
        for shard in &self.shards {
            let _ = unsafe {
                shard
                    .map
                    .unchecked_advise(memmap2::UncheckedAdvice::DontNeed)
            };
        }
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn source(&self) -> &str {
        &self.dir
    }

    fn describe(&self, name: WeightName) -> String {
        let key = self.key(name);
        match self.tensors.get(&key) {
            Some(e) => format!("{key} in {}", self.shards[e.shard].path),
            None => format!("{key} in {}", self.dir),
        }
    }

    fn meta(&self, name: WeightName) -> Result<TensorMeta> {
        let (e, kind, key) = self.entry(name)?;
        let (rows, cols) = match e.shape.as_slice() {
            [n] => (*n, 1),
            [r, c] => (*r, *c),
            dims => {
                return Err(ModelError::Corrupt {
                    path: self.shards[e.shard].path.clone(),
                    reason: format!(
                    "tensor {key} has shape {dims:?}; a Llama-family weight has 1 or 2 dimensions"
                ),
                })
            }
        };
        let bytes = kind.bytes();
        if rows
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(bytes))
            .is_none_or(|n| e.offsets.1.checked_sub(e.offsets.0) != Some(n))
        {
            return Err(ModelError::Corrupt {
                path: self.shards[e.shard].path.clone(),
                reason: format!(
                    "tensor {key} holds bytes {:?} for shape {:?}",
                    e.offsets, e.shape
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
        check_range("rows", &rows, meta.rows, &self.key(name))?;
        let n = rows.len();
        let bytes = copy_region(data, &meta, rows, 0..meta.cols);
        Ok(slice_from_bytes(meta.storage, n, meta.cols, bytes, kind))
    }

    fn cols(&self, name: WeightName, cols: Range<usize>) -> Result<WeightSlice> {
        let (data, meta, kind) = self.data(name)?;
        check_range("columns", &cols, meta.cols, &self.key(name))?;
        let n = cols.len();
        let bytes = copy_region(data, &meta, 0..meta.rows, cols);
        Ok(slice_from_bytes(meta.storage, meta.rows, n, bytes, kind))
    }

    fn vector(&self, name: WeightName, range: Option<Range<usize>>) -> Result<Vec<f32>> {
        let (data, meta, kind) = self.data(name)?;
        let len = meta.rows * meta.cols;
        let r = range.unwrap_or(0..len);
        check_range("elements", &r, len, &self.key(name))?;
        let b = kind.bytes();
        let mut v = kind.decode(&data[r.start * b..r.end * b]);
        if self.config.block.hf_norm_minus_one && name.is_norm() {
            // Gemma's checkpoints store w - 1 of a norm computing x * w (GGUF stores w).
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(v)
    }
}
