//! Typed errors of the model description and of the shard arithmetic; messages say what to do.

use thiserror::Error;

/// A model description that cannot be read or is not one this project runs.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SpecError {
    #[error("invalid model config: {0}")]
    Config(String),
    #[error("model metadata lacks {key}: {hint}")]
    MissingMetadata { key: String, hint: String },
    #[error(
        "model architecture {arch:?} is not supported; supported: {}",
        crate::arch::supported_list()
    )]
    UnsupportedArch { arch: String },
    /// A mixture-of-experts model of a kind no engine here runs.
    #[error("{arch} is a mixture-of-experts model{} that this engine cannot run; mixtures of experts run for Mixtral (llama with experts), qwen2moe and qwen3moe (dense: {})", counts(*experts, *used), crate::arch::supported_list())]
    Experts {
        arch: String,
        experts: usize,
        used: usize,
    },
}

/// ` (8 experts, 2 per token)`, or nothing when the file's counts could not be read (0).
fn counts(experts: usize, used: usize) -> String {
    if experts == 0 {
        String::new()
    } else {
        format!(" ({experts} experts, {used} per token)")
    }
}

/// `1, 2, 4` for 4.
fn divisors(n: usize) -> String {
    (1..=n.max(1))
        .filter(|d| n.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A split of heads, FFN columns or vocabulary rows over ranks that cannot be made.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ShardError {
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
    /// Expert groups that do not divide the tensor-parallel ranks.
    #[error("{ep} expert-parallel groups cannot split {tp} ranks; the expert-parallel size must divide tp (valid: {})", divisors(*tp))]
    ExpertGroups { ep: usize, tp: usize },
    /// An expert-parallel size that neither divides tp nor spans whole data-parallel
    /// replicas (`crate::ep`).
    #[error("an expert-parallel size of {ep} fits neither rule at tp={tp} x dp={dp}: it must divide tp (expert groups inside the tp group) or be tp times a divisor of dp (whole experts over data-parallel replicas), at most the {experts} experts; valid: {valid}")]
    ExpertParallel {
        ep: usize,
        tp: usize,
        dp: usize,
        experts: usize,
        valid: String,
    },
    /// More expert groups than experts.
    #[error("{experts} experts cannot give each of {ep} expert-parallel groups an expert; use an expert-parallel size of at most {experts}")]
    TooFewExperts { experts: usize, ep: usize },
    /// Expert groups asked of a dense model.
    #[error("an expert-parallel size of {ep} was asked for, but the model has no experts (it is dense); use 1")]
    NoExperts { ep: usize },
    /// More pipeline stages than layers (or none).
    #[error("{pp} pipeline stages cannot give each stage a layer of a model with {layers} layers; use 1 <= pp <= {layers}")]
    InvalidPp { pp: usize, layers: usize },
    /// An explicit layer split with another number of stages than the pipeline has.
    #[error("the layer split {split} names {given} stage(s) for {pp} pipeline stages; give {pp} layer counts, each at least 1, summing to the model's {layers} layers (e.g. {example})")]
    StageSplitCount {
        split: String,
        given: usize,
        pp: usize,
        layers: usize,
        example: String,
    },
    /// An explicit layer split that leaves a stage without a layer.
    #[error("the layer split {split} gives stage {stage} no layers; every stage needs at least 1 of the model's {layers} layers (e.g. {example})")]
    StageSplitEmpty {
        split: String,
        stage: usize,
        layers: usize,
        example: String,
    },
    /// An explicit layer split that does not cover the model's layers exactly.
    #[error("the layer split {split} covers {sum} layers but the model has {layers}; give {pp} layer counts, each at least 1, summing to {layers} (e.g. {example})")]
    StageSplitSum {
        split: String,
        sum: usize,
        pp: usize,
        layers: usize,
        example: String,
    },
    #[error("the layer split '{text}' is not whole numbers separated by commas, like 14,10")]
    StageSplitSyntax { text: String },
    #[error(
        "a layer split of {given} stages cannot be taken; give 1 to {max} layer counts, like 14,10"
    )]
    StageSplitLength { given: usize, max: usize },
    #[error("the last stage's weight '{text}' is not a number from 0.1 to 10 (at most 3 decimals, like 1.25)")]
    LastStageWeight { text: String },
    /// Query heads that KV heads cannot group.
    #[error("bad config: {0}")]
    Groups(String),
}

impl ShardError {
    /// An explicit layer split that the model or the pipeline cannot take.
    pub fn is_stage_split(&self) -> bool {
        matches!(
            self,
            ShardError::StageSplitCount { .. }
                | ShardError::StageSplitEmpty { .. }
                | ShardError::StageSplitSum { .. }
        )
    }

    /// The split itself failed: more ranks than units, or rank weights that leave a rank
    /// without a unit (the tp or the weights are what to change).
    pub fn is_split_error(&self) -> bool {
        matches!(
            self,
            ShardError::EmptyWeightedShare { .. } | ShardError::InvalidTp { .. }
        )
    }
}
