//! Typed errors of the engine; messages say what to do.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] tp_models::ModelError),
    #[error("collective failed: {0}")]
    Comm(#[from] tp_comm::CommError),
    #[error("invalid {name}: {message}")]
    Param { name: &'static str, message: String },
    #[error("rank {rank} received a malformed command from rank 0: {message}")]
    Protocol { rank: usize, message: String },
    #[error("{0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, EngineError>;
