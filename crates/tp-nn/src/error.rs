//! Typed errors of the parallel layers (docs/design.md "Style": messages say what to do).

use tp_comm::CommError;
use tp_spec::ShardError;

pub type Result<T> = std::result::Result<T, TpError>;

#[derive(Debug, thiserror::Error)]
pub enum TpError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A split of heads, FFN columns or vocabulary rows that cannot be made (tp-spec).
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error("layer was built for tp_rank {built_rank} of tp={built_tp} but the group is rank {rank} of {size}; pass the tp group the layer was sliced for")]
    GroupMismatch {
        built_rank: usize,
        built_tp: usize,
        rank: usize,
        size: usize,
    },
    #[error("bad shape: {0}")]
    Shape(String),
    #[error("bad config: {0}")]
    Config(String),
}
