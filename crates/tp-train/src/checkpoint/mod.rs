//! Checkpoints: an HF model directory (`config.json`, `model.safetensors` with HF names and
//! GLOBAL shapes, `tokenizer.json`) plus `optimizer.safetensors` (AdamW moments, global
//! shapes), `trainer.json` (step, data position, seed, training settings, loss history,
//! shard metadata of the saving layout) and `manifest.json` (SHA-256 of each file).
//! Saved atomically (R5); loadable at any tp, pp, dp (R6).
//!
//! ```text
//! DIR/latest                 "step-00000020"
//! DIR/step-00000020/         config.json model.safetensors tokenizer.json
//!                            optimizer.safetensors trainer.json manifest.json
//! DIR/loss.svg               the loss curve so far
//! ```

mod atomic;
mod load;
mod manifest;
mod save;
pub mod shards;

pub use atomic::{replace_file, SaveHook, SavePoint};
pub use load::{find_step_dir, Checkpoint};
pub use manifest::{sha256_hex, Manifest, MANIFEST};
pub use save::{save, saved_layout, SaveInputs};

use crate::optim::AdamWConfig;
use serde::{Deserialize, Serialize};

pub const FORMAT: &str = "tp-train checkpoint v1";
pub const LATEST: &str = "latest";
pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const CONFIG_FILE: &str = "config.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TRAINER_FILE: &str = "trainer.json";
/// The chat template and special tokens, when the tokenizer has a template.
pub const TOKENIZER_CONFIG_FILE: &str = crate::data::TOKENIZER_CONFIG;

/// Name of the directory of step `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Everything besides tensors needed to continue a run exactly (`trainer.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub format: String,
    /// Optimizer steps completed.
    pub step: u64,
    /// Global sequences consumed: the next step's first sequence index.
    pub data_position: u64,
    /// Seed of the initialization and of the data order.
    pub seed: u64,
    pub global_batch: usize,
    pub seq: usize,
    /// The documents were packed several to a sequence (the data position counts packed
    /// windows); absent in checkpoints of earlier versions: not packed.
    #[serde(default)]
    pub pack: bool,
    /// The run's step target when saved (sets the learning-rate schedule's length).
    pub steps_target: u64,
    pub optim: AdamWConfig,
    /// Where the data came from and how it was tokenized (informational).
    pub data: String,
    /// (step, loss) of every step so far, for the loss curve.
    pub loss_history: Vec<(u64, f64)>,
    /// The aux-loss-free router bias of every MoE layer (`[layers][experts]`,
    /// [`crate::router_bias`]); empty when it was off (and in earlier checkpoints).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub moe_bias: Vec<Vec<f32>>,
    /// How the saving run was split; tensors are stored whole, so any layout can load.
    pub saved_layout: SavedLayout,
}

/// The saving layout and each tensor's shards in it (informational: loading re-slices).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedLayout {
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
    /// Model chunks per pipeline rank (interleaved 1F1B); absent in checkpoints of earlier
    /// versions: 1.
    #[serde(default = "one")]
    pub virtual_stages: usize,
    pub tensors: Vec<TensorShards>,
}

fn one() -> usize {
    1
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorShards {
    pub name: String,
    pub shape: Vec<usize>,
    /// The pipeline rank that held it.
    pub pp_stage: usize,
    /// `None`: replicated on every tp rank; else the dim split and each tp rank's range.
    pub split_dim: Option<usize>,
    pub tp_ranges: Vec<(usize, usize)>,
}
