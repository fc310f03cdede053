//! Opening a checkpoint: find the step directory (`latest`), verify every file against the
//! manifest, parse and check every tensor's dtype and global shape against `config.json`
//! (R4: typed errors naming the file and tensor), then hand each rank its slices (R6).

use super::manifest::Manifest;
use super::shards::slice_global;
use super::{
    TrainerState, CONFIG_FILE, FORMAT, LATEST, MODEL_FILE, OPTIMIZER_FILE, TOKENIZER_FILE,
    TRAINER_FILE,
};
use crate::config::{ModelConfig, TrainModel};
use crate::error::{Result, TrainError};
use crate::init::WeightSource;
use crate::layout::{all_params, ParamSpec};
use candle_core::{Device, Tensor};
use safetensors::tensor::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};

/// A verified checkpoint in memory (read once per process, shared by its rank threads).
pub struct Checkpoint {
    pub dir: PathBuf,
    pub state: TrainerState,
    pub config: ModelConfig,
    pub tokenizer_json: String,
    model: Vec<u8>,
    optimizer: Vec<u8>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("step", &self.state.step)
            .finish()
    }
}

/// The step directory `path` names: `path` itself when it holds a manifest, else the one
/// its `latest` marker names.
pub fn find_step_dir(path: &Path) -> Result<PathBuf> {
    if path.join(super::MANIFEST).exists() {
        return Ok(path.to_path_buf());
    }
    if !path.exists() {
        return Err(TrainError::checkpoint(
            path,
            "does not exist; give the save directory of an earlier run",
        ));
    }
    let marker = path.join(LATEST);
    let name = std::fs::read_to_string(&marker).map_err(|e| {
        TrainError::checkpoint(
            path,
            format!("has no readable `latest` marker ({e}); no checkpoint was completed here"),
        )
    })?;
    let name = name.trim();
    if name.is_empty() || name.contains('/') || name.contains("..") {
        return Err(TrainError::checkpoint(
            &marker,
            format!("names {name:?}, not a step directory"),
        ));
    }
    Ok(path.join(name))
}

fn parse_safetensors<'a>(bytes: &'a [u8], path: &Path) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| TrainError::checkpoint(path, format!("not a valid safetensors file: {e}")))
}

/// The f32 data of `name`, checked to be F32 with `shape`.
fn tensor_f32(st: &SafeTensors<'_>, path: &Path, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let bad = |message: String| TrainError::Tensor {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        message,
    };
    let view = st
        .tensor(name)
        .map_err(|_| bad("missing; the file does not match config.json".into()))?;
    if view.dtype() != Dtype::F32 {
        return Err(bad(format!("dtype {:?}, expected F32", view.dtype())));
    }
    if view.shape() != shape {
        return Err(bad(format!(
            "shape {:?}, but config.json implies {shape:?}",
            view.shape()
        )));
    }
    let data = view.data();
    if data.len() != 4 * shape.iter().product::<usize>() {
        return Err(bad(format!("{} bytes for shape {shape:?}", data.len())));
    }
    Ok(data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

impl Checkpoint {
    /// Opens `path` (a `--save` directory or one step directory) and verifies it whole.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let dir = find_step_dir(path)?;
        let manifest = Manifest::read(&dir)?;
        let read = |name: &str| manifest.read_verified(&dir, name);
        let text = |name: &str| -> Result<String> {
            String::from_utf8(read(name)?)
                .map_err(|_| TrainError::checkpoint(dir.join(name), "is not UTF-8 text"))
        };
        let state: TrainerState = serde_json::from_str(&text(TRAINER_FILE)?).map_err(|e| {
            TrainError::checkpoint(dir.join(TRAINER_FILE), format!("cannot parse: {e}"))
        })?;
        if state.format != FORMAT {
            return Err(TrainError::checkpoint(
                dir.join(TRAINER_FILE),
                format!("format {:?}, this build reads {FORMAT:?}", state.format),
            ));
        }
        let config = ModelConfig::parse(&text(CONFIG_FILE)?)
            .map_err(|m| TrainError::checkpoint(dir.join(CONFIG_FILE), m))?;
        let ckpt = Checkpoint {
            tokenizer_json: text(TOKENIZER_FILE)?,
            model: read(MODEL_FILE)?,
            optimizer: read(OPTIMIZER_FILE)?,
            dir,
            state,
            config,
        };
        ckpt.check_tensors()?;
        Ok(ckpt)
    }

    /// Every tensor the config implies is present with the right dtype and shape.
    fn check_tensors(&self) -> Result<()> {
        let (mp, op) = (self.dir.join(MODEL_FILE), self.dir.join(OPTIMIZER_FILE));
        let model = parse_safetensors(&self.model, &mp)?;
        let optim = parse_safetensors(&self.optimizer, &op)?;
        for spec in all_params(&self.config)? {
            tensor_f32(&model, &mp, &spec.name, &spec.shape)?;
            for k in ["exp_avg", "exp_avg_sq"] {
                tensor_f32(&optim, &op, &format!("{}.{k}", spec.name), &spec.shape)?;
            }
        }
        Ok(())
    }

    /// This rank's slices of the AdamW moments for `specs`, as flat buffers in spec order.
    pub fn optimizer_shards(&self, specs: &[ParamSpec]) -> Result<(Vec<f32>, Vec<f32>)> {
        let op = self.dir.join(OPTIMIZER_FILE);
        let st = parse_safetensors(&self.optimizer, &op)?;
        let (mut m, mut v) = (Vec::new(), Vec::new());
        for spec in specs {
            for (k, out) in [("exp_avg", &mut m), ("exp_avg_sq", &mut v)] {
                let name = format!("{}.{k}", spec.name);
                let global = tensor_f32(&st, &op, &name, &spec.shape)?;
                out.extend(slice_global(&global, &spec.shape, &spec.placement));
            }
        }
        Ok((m, v))
    }
}

impl WeightSource for Checkpoint {
    fn global(&self, _w: tp_spec::WeightName, name: &str, shape: &[usize]) -> Result<Tensor> {
        let mp = self.dir.join(MODEL_FILE);
        let st = parse_safetensors(&self.model, &mp)?;
        let data = tensor_f32(&st, &mp, name, shape)?;
        Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
    }
}
