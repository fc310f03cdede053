//! tp-models: Llama-family models (llama, qwen2) sharded over tensor-parallel ranks: configs,
//! checkpoint readers that hand each rank only its slice, and the sharded forward pass.

mod attention;
pub mod checkpoint;
pub mod config;
pub mod error;
mod exp;
pub mod fetch;
pub mod gguf;
pub mod gguf_header;
pub mod hf;
pub mod kv_cache;
pub mod limits;
pub mod matrix;
pub mod model;
mod moe;
pub mod open;
pub mod ops;
mod path;
pub mod profile;
mod qk_norm;
pub mod shard;
pub mod sync;
#[cfg(feature = "test-support")]
pub mod synthetic;
#[cfg(test)]
mod testutil;

pub use checkpoint::{Checkpoint, WeightName, WeightSlice};
pub use config::{Arch, Experts, ModelConfig, RopeStyle};
pub use error::{ModelError, Result};
pub use gguf::GgufCheckpoint;
pub use gguf_header::{GgufHeader, GgufTensor};
pub use hf::HfCheckpoint;
pub use kv_cache::{BlockId, BlockTable, KvDtype, KvPool, BLOCK_POSITIONS};
pub use matrix::{DenseDType, LoadOptions, Matrix};
pub use model::{Chunk, ShardedModel};
pub use open::open_checkpoint;
pub use profile::Profile;
pub use shard::{
    checkpoint_stages, rank_memory, rank_plan, world_plans, world_rank_plan, CheckpointPlan,
    RankMemory, ShardPlan,
};
pub use sync::SyncMode;
pub use tp_spec::{
    check_capacity, CapacityError, CapacityFactor, LastStageWeight, LayerCounts, RankWeights,
    Stage, StageSplit,
};
