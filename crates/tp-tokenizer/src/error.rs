//! The error type of tp-tokenizer: every message names the key or file involved and says what to do.
//!
//! A variant wrapping another error returns it from `source()` and does not repeat it in its
//! message (ARCHITECTURE.md, "Errors"); print the chain to see both.

use std::path::PathBuf;

/// Everything that can go wrong while loading a tokenizer, encoding, decoding or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required GGUF metadata key is absent.
    #[error("GGUF metadata has no `{key}`: {hint}")]
    MissingKey { key: String, hint: String },

    /// A GGUF metadata key holds a value of the wrong type or an invalid value.
    #[error("GGUF metadata `{key}` is invalid: {reason}; re-export the model with a current llama.cpp converter")]
    InvalidKey { key: String, reason: String },

    /// `tokenizer.ggml.model` names a tokenizer this crate does not implement.
    #[error("unsupported tokenizer.ggml.model `{model}`: supported are {supported}; convert the model with one of them or load it from its HF directory (tokenizer.json)")]
    UnsupportedModel { model: String, supported: String },

    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not implement.
    #[error("unsupported tokenizer.ggml.pre `{pre}`: supported are {supported}; load the model from its HF directory (tokenizer.json) instead")]
    UnsupportedPreTokenizer { pre: String, supported: String },

    /// A file of an HF model directory could not be read.
    #[error("cannot read {} ({hint})", path.display())]
    Io {
        path: PathBuf,
        hint: String,
        #[source]
        source: std::io::Error,
    },

    /// A JSON file of an HF model directory is malformed.
    #[error("{} is not valid: {reason}; fix or regenerate the file (e.g. with `save_pretrained`)", path.display())]
    InvalidFile { path: PathBuf, reason: String },

    /// The `tokenizers` library refused to build or run the tokenizer.
    #[error("tokenizer {context}: {reason}")]
    Backend { context: String, reason: String },

    /// A token id passed to `decode` or a stream is not in the vocabulary.
    #[error("token id {id} is out of range: the vocabulary has {vocab_size} tokens; check that the ids come from this model")]
    IdOutOfRange { id: u32, vocab_size: usize },

    /// The chat template failed to parse or render, or called `raise_exception`.
    #[error(
        "chat template: {message}; check the messages (roles, their order) against what the model's template accepts"
    )]
    Template { message: String },

    /// A chat message has a role the chat template does not know.
    #[error("message {index} has the role {role:?}, which the chat template does not know; use one of {known}")]
    UnknownRole {
        index: usize,
        role: String,
        known: String,
    },

    /// The chat template rewrites message text so that it cannot be kept apart from the
    /// template's own text (and special tokens).
    #[error("chat template: cannot keep message text apart from the template's special tokens: {reason}; remove special-token text (such as <|im_start|>) from the messages")]
    Inseparable { reason: String },
}

impl TokenizerError {
    /// Wraps an error of the `tokenizers` library with what was being done.
    pub(crate) fn backend(context: &str, err: impl std::fmt::Display) -> Self {
        Self::Backend {
            context: context.to_string(),
            reason: err.to_string(),
        }
    }

    /// A key of the wrong type or value.
    pub(crate) fn invalid(key: &str, reason: impl Into<String>) -> Self {
        Self::InvalidKey {
            key: key.to_string(),
            reason: reason.into(),
        }
    }
}
