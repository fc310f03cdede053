//! Fine-tuning's starting point: a pretrained model (a GGUF file, dequantized to f32, or an
//! HF directory) read by tp-models' checkpoint readers and handed to the stages as global f32
//! tensors in training's conventions: HF's rotate-half RoPE (a GGUF Llama's Q/K rows, and
//! their biases' entries if any, are moved back from llama.cpp's interleaved order), Gemma's norms stored minus one (training's
//! `x * (1 + w)` parameter), and the embedding standing in for a tied LM head.

use crate::config::{ModelConfig, TrainModel, TRAINABLE_ARCHS};
use crate::error::{Result, TrainError};
use crate::init::WeightSource;
use candle_core::{Device, Tensor};
use std::path::{Path, PathBuf};
use tp_models::Checkpoint as ModelCheckpoint;
use tp_spec::rope_rows::unpermute_rows;
use tp_spec::{RopeStyle, WeightName};

/// An opened pretrained model and the config training runs it as.
pub struct Pretrained {
    pub path: PathBuf,
    /// The model as training sees it (rotate-half RoPE; everything else the file's).
    pub config: ModelConfig,
    /// Whether the file keeps a Llama's Q/K rows in llama.cpp's interleaved order.
    interleaved: bool,
    ckpt: Box<dyn ModelCheckpoint>,
}

impl std::fmt::Debug for Pretrained {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pretrained")
            .field("path", &self.path)
            .finish()
    }
}

impl Pretrained {
    /// Opens `path` (a GGUF file, an HF directory or its config.json) and checks that
    /// training can run the model; the error names the architecture, feature or tensor.
    pub fn open(path: &Path) -> Result<Pretrained> {
        let ckpt = tp_models::open_checkpoint(path).map_err(|e| TrainError::InitModel {
            path: path.to_path_buf(),
            source: Box::new(e),
        })?;
        let file = ckpt.config().clone();
        let untrainable = |what: String| TrainError::Untrainable {
            path: path.to_path_buf(),
            what,
        };
        if !TRAINABLE_ARCHS.contains(&file.arch) {
            return Err(untrainable(format!(
                "its architecture is {}; training supports {}",
                file.arch.name(),
                TRAINABLE_ARCHS.map(|a| a.name()).join(", ")
            )));
        }
        let interleaved = file.rope_style == RopeStyle::Interleaved;
        let config = ModelConfig {
            rope_style: RopeStyle::RotateHalf,
            ..file
        };
        config
            .check_trainable()
            .map_err(|e| untrainable(e.to_string()))?;
        // Every weight training will read is there with its shape, before any rank starts.
        for p in tp_spec::model_params(&config) {
            let meta = ckpt
                .meta(p.name)
                .map_err(|e| untrainable(format!("{}: {e}", ckpt.describe(p.name))))?;
            let want = p.dims();
            let got = match want.len() {
                1 => vec![meta.rows * meta.cols],
                _ => vec![meta.rows, meta.cols],
            };
            if got != want {
                return Err(untrainable(format!(
                    "{} has shape {got:?}, the config implies {want:?}",
                    ckpt.describe(p.name)
                )));
            }
        }
        Ok(Pretrained {
            path: path.to_path_buf(),
            config,
            interleaved,
            ckpt,
        })
    }

    /// The whole weight `w` as f32 in training's conventions.
    pub fn weight_f32(&self, w: WeightName, shape: &[usize]) -> Result<Vec<f32>> {
        let bad = |e: tp_models::ModelError| TrainError::Untrainable {
            path: self.path.clone(),
            what: format!("{}: {e}", self.ckpt.describe(w)),
        };
        let mut values = if shape.len() == 1 {
            let mut v = self.ckpt.vector(w, None).map_err(bad)?;
            if self.config.block.hf_norm_minus_one && w.is_norm() {
                // The readers give the scale a norm multiplies by; training's parameter is
                // the `w` of `x * (1 + w)`.
                v.iter_mut().for_each(|x| *x -= 1.0);
            }
            v
        } else {
            let rows = shape[0];
            self.ckpt
                .rows(w, 0..rows)
                .and_then(|s| s.into_f32())
                .map_err(bad)?
        };
        if self.interleaved
            && matches!(
                w,
                WeightName::Q(_) | WeightName::K(_) | WeightName::QBias(_) | WeightName::KBias(_)
            )
        {
            // A bias's entries follow its projection's rows.
            values = unpermute_rows(&values, shape, self.config.head_dim);
        }
        let n: usize = shape.iter().product();
        if values.len() != n {
            return Err(TrainError::Untrainable {
                path: self.path.clone(),
                what: format!(
                    "{} holds {} values, the config implies {shape:?}",
                    self.ckpt.describe(w),
                    values.len()
                ),
            });
        }
        Ok(values)
    }
}

impl WeightSource for Pretrained {
    fn global(&self, w: WeightName, _name: &str, shape: &[usize]) -> Result<Tensor> {
        let values = self.weight_f32(w, shape)?;
        Ok(Tensor::from_vec(values, shape, &Device::Cpu)?)
    }
}
