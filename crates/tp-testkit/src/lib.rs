//! Helpers the workspace's tests share (a dev-dependency only, never published): the
//! workspace's seeded random generator ([`Rng`], tp-spec's, re-exported), child processes and `mpirun` jobs killed at a deadline
//! ([`process`]), JSON rows of command output ([`json`]), the installed real models and the
//! skip message when one is absent ([`models`]), scratch folders and fuzz case counts.
//!
//! It depends on no workspace crate but tp-spec, so a crate low in the graph (tp-kernels) can
//! use it as well as the `tp` binary's tests. Helpers that need a crate's own types stay in
//! that crate's `tests/common`.

pub mod json;
pub mod models;
pub mod process;

pub use json::json_rows;
pub use models::{gemma3, minilm, qwen25, smollm2};
pub use process::{mpirun, require_mpirun, run, run_with_deadline, Finished};
pub use tp_spec::Rng;

use std::path::PathBuf;
use std::str::FromStr;

/// How many random cases a fuzz test runs: `$FUZZ_CASES` when set (raise it for a longer run),
/// else `default`.
pub fn fuzz_cases<T: FromStr>(default: T) -> T {
    std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A fresh, empty folder `tp-{tag}-{pid}` under the system temp dir (emptied if a previous run
/// left it). Tests of one binary run in parallel: give each its own tag.
pub fn scratch_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tp-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

#[cfg(test)]
mod tests {
    #[test]
    fn scratch_dirs_start_empty() {
        let d = super::scratch_dir("testkit-scratch");
        std::fs::write(d.join("x"), b"x").unwrap();
        let again = super::scratch_dir("testkit-scratch");
        assert_eq!(d, again);
        assert_eq!(std::fs::read_dir(&again).unwrap().count(), 0);
        std::fs::remove_dir_all(again).unwrap();
    }
}
