//! Typed errors of model loading and execution; every message says what to do.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("cannot open model file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a readable model file: {reason}. Check that the download completed (compare its sha256) or pass another --model")]
    Corrupt { path: String, reason: String },
    #[error("model architecture {0:?} is not supported; supported: llama, qwen2 (GGUF) and LlamaForCausalLM, Qwen2ForCausalLM (config.json)")]
    UnsupportedArch(String),
    #[error("model metadata lacks {key}: {hint}")]
    MissingMetadata { key: String, hint: String },
    #[error("tensor {name} is missing from the checkpoint; the file is incomplete or not a {arch} model")]
    MissingTensor { name: String, arch: String },
    #[error("tensor {name} has shape {found:?}, expected {expected:?}; the checkpoint does not match its config")]
    TensorShape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tensor {name} has unsupported type {dtype}; re-export the model with F32, F16, BF16 or a ggml quantization")]
    UnsupportedDType { name: String, dtype: String },
    #[error("invalid model config: {0}")]
    Config(String),
    #[error("tensor parallelism: {0}")]
    Tp(#[from] tp_nn::TpError),
    #[error("collective failed: {0}")]
    Comm(#[from] tp_comm::CommError),
    #[error("kernel: {0}")]
    Kernel(#[from] tp_kernels::KernelError),
    #[error("tensor op failed: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("context full: position {pos} + {len} tokens exceeds the KV cache of {cap} positions; raise --ctx-size or shorten the input")]
    ContextFull { pos: usize, len: usize, cap: usize },
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("{0}")]
    Input(String),
}

pub type Result<T> = std::result::Result<T, ModelError>;
