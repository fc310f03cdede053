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
    /// Rank weights that are not one per rank (`tp` is `None` when none were given at all).
    #[error("{count} rank weight(s) {}; give exactly one weight per rank", match tp { Some(tp) => format!("for {tp} ranks"), None => "given".to_string() })]
    RankWeightCount { count: usize, tp: Option<usize> },
    #[error("rank {rank} has weight 0; every rank's weight must be at least 1")]
    RankWeightZero { rank: usize },
    #[error("rank {rank} has weight {weight}, more than the largest allowed ({max}); weights are ratios, so scale them down (2,1 is the same split as 200,100)")]
    RankWeightTooLarge { rank: usize, weight: u64, max: u32 },
    #[error("rank weights '{text}' are not whole numbers separated by commas, like 2,1")]
    RankWeightSyntax { text: String },
    /// A weighted split that would leave a rank without a unit.
    #[error("with rank weights {weights}, rank {rank}'s share of the {units} {what} is {share:.2}, less than one {unit}; raise its weight, lower the others' or use fewer ranks")]
    EmptyWeightedShare {
        rank: usize,
        weights: String,
        units: usize,
        what: &'static str,
        unit: &'static str,
        share: f64,
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
