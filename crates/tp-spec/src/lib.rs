//! tp-spec: the one description of a transformer that inference, training, `tp inspect` and
//! `tp plan` share: architecture families and their names, hyper-parameters read from GGUF
//! metadata or an HF `config.json`, the canonical weights with their GGUF and HF names, and
//! the shard arithmetic (head-granular ranges with KV replication, FFN split in quant-block
//! units, vocabulary rows, rank weights, the bytes a rank holds). No tensors, no candle. It
//! also holds the one GGUF header reader ([`gguf`]) and the workspace's one seeded random
//! generator ([`Rng`]).

pub mod arch;
pub mod block;
pub mod capacity;
pub mod config;
pub mod ep;
pub mod error;
pub mod gguf;
pub mod params;
pub mod partition;
pub mod rng;
pub mod rope_rows;
pub mod shard;
pub mod stage;
pub mod stage_split;
pub mod weights;

pub use arch::{is_moe_name, is_unsupported_moe_name, supported_list, Arch, RopeStyle};
pub use block::{Activation, BlockStyle, SlidingWindow};
pub use capacity::{check_capacity, drop_over, CapacityError, CapacityFactor};
pub use config::{Dims, Experts, Gating, MetaValue, Metadata, ModelConfig};
pub use ep::{EpLayout, ReplicaExperts};
pub use error::{ShardError, SpecError};
pub use gguf::{GgufError, GgufHeader, GgufValue, TensorInfo};
pub use params::{
    embed_params, head_params, model_params, stage_params, AttentionSpec, LayerSpec, MlpSpec,
    Param, Placement, Split, Units,
};
pub use partition::{HeadPlan, Partition, RankWeights, MAX_RANK_WEIGHT};
pub use rng::{mix64, Rng};
pub use shard::{
    ffn_split, params_weight_bytes, rank_weight_bytes, ExpertShard, Layout, ShardPlan, WeightBytes,
    DENSE_CHUNK,
};
pub use stage::{
    balanced_stages, balanced_stages_weighted, rank_of_stage, stage_of_rank, stages, Stage,
};
pub use stage_split::{
    pipeline_stages, LastStageWeight, LayerCounts, StageSplit, MAX_SPLIT_STAGES,
};
pub use weights::{
    expected_weights, gguf_merged_name, gguf_name, hf_name, is_expert_tensor, optional_weights,
    parse_gguf_name, parse_hf_name, Expected, WeightName, TENSORS_PER_LAYER,
};
