//! Typed errors of model loading and execution; every message says what to do.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("cannot read {path} (check the path and its permissions)")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a readable model file: {reason}. Check that the download completed (compare its sha256) or use another model file")]
    Corrupt { path: String, reason: String },
    #[error("{}model architecture {arch:?} is not supported; supported: {} (a GGUF of one, or an HF directory of one)", located(path), tp_spec::supported_list())]
    UnsupportedArch { arch: String, path: String },
    #[error("{}model metadata lacks {key}: {hint}", located(path))]
    MissingMetadata {
        key: String,
        hint: String,
        path: String,
    },
    #[error("tensor {name} is missing from the checkpoint; the file is incomplete or not a {arch} model: download or convert it again")]
    MissingTensor { name: String, arch: String },
    #[error("tensor {name} has shape {found:?}, expected {expected:?} from the model's config; the checkpoint does not match its config: re-export it or fix the config")]
    TensorShape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tensor {name} has unsupported type {dtype}; re-export the model with F32, F16, BF16 or a ggml quantization (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K)")]
    UnsupportedDType { name: String, dtype: String },
    #[error("invalid model config: {0}")]
    Config(String),
    #[error(transparent)]
    Shard(#[from] tp_spec::ShardError),
    /// A model described correctly that no engine here runs (a mixture of experts).
    #[error("{}{reason}", located(path))]
    Unsupported {
        reason: tp_spec::SpecError,
        path: String,
    },
    #[error(transparent)]
    Comm(Box<tp_comm::CommError>),
    #[error(transparent)]
    Kernel(#[from] tp_kernels::KernelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("context full: position {pos} + {len} tokens exceeds the KV cache of {cap} positions; raise the context size or shorten the input")]
    ContextFull { pos: usize, len: usize, cap: usize },
    #[error("unknown KV cache dtype {0:?}; choose f16, bf16, f32 or q8")]
    UnknownKvDtype(String),
    #[error("the KV cache needs {needed} more blocks but {free} of its {limit} are free; finish or cancel sequences, or give the cache more memory")]
    OutOfBlocks {
        needed: usize,
        free: usize,
        limit: usize,
    },
    #[error("cannot allocate a KV cache block of {bytes} bytes: {source}")]
    KvMemory {
        bytes: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid KV block assignment: {0}")]
    BadBlocks(String),
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("{what} {value} would take {cost}; {hint}")]
    TooLarge {
        what: String,
        value: String,
        /// `N bytes (..), more than the M bytes (..) this machine has`.
        cost: String,
        hint: &'static str,
    },
    #[error("{path}: {reason}; the file does not match the model its metadata describes: download or convert it again")]
    Inconsistent { path: String, reason: String },
    #[error("{0}")]
    Input(String),
    #[error(transparent)]
    Capacity(#[from] tp_spec::CapacityError),
}

/// `"PATH: "`, or nothing when the path is not known yet.
fn located(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!("{path}: ")
    }
}

impl ModelError {
    /// Names the file a config-level error came from (errors of `ModelConfig` parsing do not
    /// know it); other errors are returned unchanged.
    pub fn in_file(self, file: &str) -> Self {
        match self {
            ModelError::Config(m) => ModelError::Config(format!("{file}: {m}")),
            ModelError::UnsupportedArch { arch, path } if path.is_empty() => {
                ModelError::UnsupportedArch {
                    arch,
                    path: file.to_string(),
                }
            }
            ModelError::MissingMetadata { key, hint, path } if path.is_empty() => {
                ModelError::MissingMetadata {
                    key,
                    hint,
                    path: file.to_string(),
                }
            }
            ModelError::Unsupported { reason, path } if path.is_empty() => {
                ModelError::Unsupported {
                    reason,
                    path: file.to_string(),
                }
            }
            other => other,
        }
    }

    /// The split itself failed: more ranks than units, or rank weights that leave a rank
    /// without a unit (the tp or the weights are what to change, not the context).
    pub fn is_split_error(&self) -> bool {
        match self {
            ModelError::Shard(e) => e.is_split_error(),
            _ => false,
        }
    }
}

pub type Result<T> = std::result::Result<T, ModelError>;

/// Boxed: a collective's error carries every rank's flight record.
impl From<tp_comm::CommError> for ModelError {
    fn from(e: tp_comm::CommError) -> Self {
        ModelError::Comm(Box::new(e))
    }
}
