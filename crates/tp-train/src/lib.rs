//! tp-train: training a Llama-style transformer (Llama, or Qwen3 with its per-head q/k norms)
//! with tensor, pipeline and data parallelism
//! (3D parallelism after Narayanan et al. 2021, "Efficient Large-Scale Language Model
//! Training on GPU Clusters Using Megatron-LM").
//!
//! - [`model`]: one pipeline stage on one tp rank, built from tp-nn's layers.
//! - [`pipeline`] and [`schedule`]: micro-batches on the 1F1B schedule over send/recv.
//! - [`grads`]: the flat gradient buffer, tp completion, bucketed dp all-reduce, global norm.
//! - [`recompute`]: full activation recomputation (selective lives in tp-nn's attention).
//! - [`optim`]: AdamW with state sharded like the weights; learning-rate schedule.
//! - [`zero`]: the distributed optimizer (ZeRO-1): optimizer state sharded over dp too.
//! - [`data`]: text to token windows; [`checkpoint`]: atomic, checksummed, any-layout resume.
//! - [`trainer`]: the loop that ties them together; [`run`]: a prepared run on its ranks
//!   (`tp train`); [`bench`]: training speed per layout (`tp bench train`).
//!
//! Conventions: every tensor is f32 on the CPU; the tp1 run is the oracle every layout is
//! tested against.

pub mod activations;
pub mod alloc_count;
pub mod bench;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod fixtures;
pub mod flops;
pub mod grads;
pub mod init;
pub mod layout;
pub mod model;
pub mod optim;
pub mod p2p;
pub mod pipeline;
pub mod plot;
pub mod pretrained;
pub mod recompute;
pub mod router_bias;
pub mod run;
pub mod schedule;
pub mod setup;
pub mod trainer;
pub mod zero;

pub use checkpoint::{Checkpoint, SaveHook, SavePoint};
pub use config::{ModelConfig, TrainModel};
pub use data::{Corpus, PackStats, TextTokenizer};
pub use error::{Result, TrainError};
pub use optim::AdamWConfig;
pub use pretrained::Pretrained;
/// Activation recomputation policy of a run (tp-plan's: the planner models the same three).
pub use tp_plan::workload::Recompute;
pub use trainer::{Start, StepReport, TrainOptions, TrainSpec, Trainer, DEFAULT_MOE_AUX_COEF};
