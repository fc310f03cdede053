//! tp-nn: Megatron-style tensor-parallel layers on candle tensors (Shoeybi et al. 2019, §3;
//! sequence parallelism after Korthikanti et al. 2022, §4.2.2).
//!
//! Layers are built from the GLOBAL weights by slicing each rank's part
//! (`from_global(.., tp_rank, tp)`) and run with the tp [`Group`](tp_comm::Group) in
//! `forward`. The conjugate mappings in [`mappings`] join candle's autograd, so
//! `loss.backward()` issues the backward collectives. Convention, fixed once: the loss is
//! computed on replicated values and counted once, so g's backward is the identity.

pub mod attention;
mod attention_core;
pub mod block;
pub mod cross_entropy;
pub mod dispatch;
pub mod embedding;
pub mod error;
mod host;
pub mod linear;
pub mod mappings;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod packing;
pub mod recording;
pub mod reference;
pub mod rng;
pub mod rope;
pub mod sequence;

pub use attention::ParallelAttention;
pub use block::{BlockConfig, BlockOutput, BlockWeights, LayerStyle, MlpWeights, ParallelBlock};
pub use cross_entropy::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_weighted};
pub use embedding::VocabParallelEmbedding;
pub use error::{Result, TpError};
pub use linear::{ColumnParallelLinear, PartialSum, RowParallelLinear};
pub use mappings::{
    copy_to_tp, gather_from_sequence_parallel, gather_last_dim, reduce_from_tp,
    reduce_scatter_to_sequence_parallel, scatter_last_dim,
};
pub use mlp::ParallelMlp;
pub use moe::{MoeOutput, ParallelMoe, RouteOptions};
pub use norm::RmsNorm;
pub use packing::Segments;
pub use recording::RecordingComm;
pub use reference::DenseBlock;
pub use rng::{RandomTensor, Rng};
pub use rope::{Rope, RopeLayout};
pub use sequence::{SeqLayout, SeqSplit};
/// The shard arithmetic lives in tp-spec; re-exported for the layers' callers.
pub use tp_spec::{
    Activation, HeadPlan, Partition, Placement, RankWeights, ShardError, ShardPlan, MAX_RANK_WEIGHT,
};
