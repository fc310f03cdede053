//! tp-engine: inference over a tensor-parallel group. Rank 0 (the leader) decides every step
//! and broadcasts it; the other ranks (followers) execute the same step on their shards.

pub mod bench;
pub mod bench_spec;
pub mod candidates;
pub mod decoder;
pub mod draft_model;
pub mod error;
pub mod executor;
pub mod generate;
pub mod handle;
pub mod inspect;
pub mod kv_budget;
/// Starting ranks: tp-comm's launcher, here for the engine's callers.
pub mod launch {
    pub use tp_comm::launch::*;
}
pub mod load_stats;
pub mod logits;
pub mod model_check;
pub mod perplexity;
pub mod pipeline;
pub mod protocol;
pub mod report;
pub mod sampling;
pub mod session;
pub mod slots;
pub mod spec;
pub mod start;
pub mod stop;
pub mod swap;
pub mod worker;

pub use candidates::{Candidates, Row, RowNeed, StepLogits, MAX_CANDIDATES};
pub use decoder::{
    DecodeParams, Emitted, Finished, LogprobEntry, SequenceDecoder, Step, TokenInfo,
    MAX_TOP_LOGPROBS,
};
pub use error::{EngineError, Result};
pub use executor::{ScriptedExecutor, StepExecutor};
pub use generate::{generate, FinishReason, Flow, GenerationStats};
pub use handle::{Engine, PromptIds, Reply};
pub use logits::{
    candidate_logprobs, log_softmax, log_sum_exp, top_logprobs, Penalties, TokenLogprobs,
};
pub use protocol::{ChunkSpec, Command};
pub use sampling::{argmax, Sampler, SamplingParams};
pub use session::{Placement, Session, SessionError};
pub use slots::Slots;
pub use spec::{
    DraftAhead, DraftTokens, Drafter, DrafterSource, NgramDrafter, SpecMethod, SpecStats,
    Speculator, MAX_DRAFT_TOKENS,
};
pub use stop::StopMatcher;
pub use swap::ModelCommand;
pub use worker::{RankProfile, ReloadSpec, Worker};
