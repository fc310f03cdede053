//! tp-plan: an analytical planner that ranks tensor/pipeline/data/expert-parallel
//! layouts for training (by step time) and serving (by cost per token under a
//! latency target). The cost model is documented in `docs/planner.md`.

pub mod activation_memory;
pub mod cli;
pub mod cluster_file;
pub mod collectives;
pub mod error;
pub mod flops;
pub mod gguf;
pub mod hardware;
pub mod hf_config;
pub mod korthikanti_table;
pub mod llama3_run;
pub mod megatron_table;
pub mod model;
pub mod model_presets;
pub mod rank_weights;
pub mod report;
pub mod search;
pub mod serving_model;
pub mod sharding;
pub mod state_memory;
pub mod training_model;
pub mod workload;

pub use error::PlanError;
