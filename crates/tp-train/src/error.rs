//! Typed errors of training (docs/design.md "Style": every message says what to do).

use std::path::PathBuf;
use tp_comm::CommError;
use tp_nn::TpError;

pub type Result<T> = std::result::Result<T, TrainError>;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Boxed: collective errors carry flight records and are large.
    #[error(transparent)]
    Nn(Box<TpError>),
    #[error(transparent)]
    Comm(Box<CommError>),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The model or training configuration cannot work (the message names the fix).
    #[error("bad configuration: {0}")]
    Config(String),
    /// The training data cannot be used (missing, empty, too short for the sequence length).
    #[error("bad training data: {0}")]
    Data(String),
    #[error("tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("cannot {action} {path}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// A checkpoint is unusable; the message says which part and what to do.
    #[error("checkpoint {path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    /// A checkpoint file's bytes differ from its manifest entry (bit flip, truncation, edit).
    #[error(
        "checkpoint file {path} is corrupt: its SHA-256 is {actual} but the manifest says \
         {expected}; resume from an earlier checkpoint (the step-* directories beside it)"
    )]
    Checksum {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    /// A tensor in a checkpoint file is missing or has the wrong dtype or shape.
    #[error("checkpoint file {path}, tensor {tensor}: {message}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        message: String,
    },
    /// The model to fine-tune cannot be opened (not a GGUF file or HF directory, damaged).
    #[error("cannot open the model to fine-tune, {path}")]
    InitModel {
        path: PathBuf,
        #[source]
        source: Box<tp_models::ModelError>,
    },
    /// The model to fine-tune is one the trainer cannot train; `what` names the architecture,
    /// feature or tensor.
    #[error("the model {path} cannot be fine-tuned: {what}")]
    Untrainable { path: PathBuf, what: String },
    /// A fault injected by a test or drill (`TrainOptions::save_hook`).
    #[error("injected fault: {0}")]
    Injected(String),
}

impl From<TpError> for TrainError {
    fn from(e: TpError) -> Self {
        match e {
            TpError::Comm(c) => TrainError::Comm(Box::new(c)),
            other => TrainError::Nn(Box::new(other)),
        }
    }
}

/// A split that cannot be made (tp-spec's shard arithmetic), as tp-nn reports it.
impl From<tp_spec::ShardError> for TrainError {
    fn from(e: tp_spec::ShardError) -> Self {
        TrainError::Nn(Box::new(TpError::Shard(e)))
    }
}

impl From<CommError> for TrainError {
    fn from(e: CommError) -> Self {
        TrainError::Comm(Box::new(e))
    }
}

impl TrainError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        TrainError::Io {
            action,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn checkpoint(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        TrainError::Checkpoint {
            path: path.into(),
            message: message.into(),
        }
    }

    /// The collective error underneath, if this is one (its flight record is worth printing).
    pub fn as_comm(&self) -> Option<&CommError> {
        match self {
            TrainError::Comm(c) => Some(c),
            TrainError::Nn(e) => match e.as_ref() {
                TpError::Comm(c) => Some(c),
                _ => None,
            },
            _ => None,
        }
    }

    /// The collective error underneath, by value.
    pub fn into_comm(self) -> std::result::Result<CommError, TrainError> {
        match self {
            TrainError::Comm(c) => Ok(*c),
            TrainError::Nn(e) => match *e {
                TpError::Comm(c) => Ok(c),
                other => Err(TrainError::Nn(Box::new(other))),
            },
            other => Err(other),
        }
    }
}
