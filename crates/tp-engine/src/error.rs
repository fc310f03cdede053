//! Typed errors of the engine; messages say what to do.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum EngineError {
    /// Boxed: model and collective errors carry flight records and would bloat every `Result`.
    #[error(transparent)]
    Model(Box<tp_models::ModelError>),
    #[error(transparent)]
    Comm(Box<tp_comm::CommError>),
    #[error("invalid {name}: {message}")]
    Param { name: &'static str, message: String },
    #[error("rank {rank} received a malformed command from rank 0: {message}")]
    Protocol { rank: usize, message: String },
    /// A prompt that does not fit its sequence's KV cache.
    #[error("the prompt's {tokens} tokens after {cached} cached do not fit the context of {capacity} positions")]
    PromptTooLong {
        tokens: usize,
        cached: usize,
        capacity: usize,
    },
    #[error("the prompt has no tokens")]
    EmptyPrompt,
    /// A prompt that leaves no room in the context for a generated token.
    #[error("the prompt has {tokens} tokens but the context holds {ctx}")]
    PromptOverContext { tokens: usize, ctx: usize },
    /// The generated text could not be written where it goes.
    #[error("cannot write the output")]
    Output(#[source] std::io::Error),
    /// The model's logits hold NaN: a broken model file or a dtype that overflows.
    #[error("the model produced NaN logits; check the model file and the weights' dtype")]
    NanLogits,
    /// A sampled token the tokenizer cannot turn into text.
    #[error("cannot decode token {token}")]
    Decode {
        token: u32,
        #[source]
        source: tp_tokenizer::TokenizerError,
    },
    /// A collective failed because a rank of a pipeline stage left or stalled: names the
    /// stage, that rank and its host; the collective's own error follows as the cause.
    #[error("pipeline stage {stage} of {stages} (rank {rank} on {host}) is lost or not answering")]
    Stage {
        stage: usize,
        stages: usize,
        rank: usize,
        host: String,
        #[source]
        source: Box<EngineError>,
    },
    /// A draft model's KV pool has no room for what a sequence would draft now: that step
    /// drafts nothing (the target decodes on unspeculated), the request is unaffected.
    #[error(
        "the draft model's KV pool has {free} of {limit} blocks free but drafting needs {needed}"
    )]
    DraftKvFull {
        needed: usize,
        free: usize,
        limit: usize,
    },
    #[error("{0}")]
    Internal(String),
}

impl EngineError {
    /// The world rank a failed collective names as gone, or as the first it still waits
    /// for; `None` for other errors.
    pub fn culprit(&self) -> Option<usize> {
        use tp_comm::CommError as C;
        let comm = match self {
            EngineError::Comm(c) => c,
            EngineError::Model(m) => match &**m {
                tp_models::ModelError::Comm(c) => c,
                _ => return None,
            },
            _ => return None,
        };
        match &**comm {
            C::PeerLost { lost_rank, .. } => Some(*lost_rank),
            C::Timeout { missing, .. } => missing.first().copied(),
            _ => None,
        }
    }
}

impl From<tp_models::ModelError> for EngineError {
    fn from(e: tp_models::ModelError) -> Self {
        EngineError::Model(Box::new(e))
    }
}

impl From<tp_comm::CommError> for EngineError {
    fn from(e: tp_comm::CommError) -> Self {
        EngineError::Comm(Box::new(e))
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;
