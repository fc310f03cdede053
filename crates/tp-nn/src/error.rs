//! Typed errors of the parallel layers (docs/design.md "Style": messages say what to do).

use tp_comm::CommError;

pub type Result<T> = std::result::Result<T, TpError>;

#[derive(Debug, thiserror::Error)]
pub enum TpError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Comm(#[from] CommError),
    /// tp is 0 or above the number of units to split.
    #[error("{units} {what} cannot give every rank a {unit} at tp={tp}; use 1 <= tp <= {units}")]
    InvalidTp {
        units: usize,
        what: &'static str,
        unit: &'static str,
        tp: usize,
    },
    #[error("tp_rank {tp_rank} is out of range for tp={tp}; use 0 <= tp_rank < {tp}")]
    InvalidRank { tp_rank: usize, tp: usize },
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
