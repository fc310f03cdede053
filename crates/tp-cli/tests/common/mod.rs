//! The CLI tests' kit: the `tp` binary Cargo built for them, run with a deadline (a test that
//! hangs is a failing test) directly or under mpirun, and the `(step, loss)` rows of
//! `tp train --json`. Processes, JSON rows and model fixtures come from tp-testkit.
#![allow(dead_code)] // each test binary uses a different subset

use std::time::Duration;
#[allow(unused_imports)] // each test binary uses a subset
pub use tp_testkit::{gemma3, json_rows, run, run_with_deadline, smollm2, Finished};

/// The `tp` binary under test.
pub const TP: &str = env!("CARGO_BIN_EXE_tp");

/// `tp args...`, failing the test if it outlives `deadline`.
pub fn tp(args: &[&str], deadline: Duration) -> Finished {
    run_with_deadline(TP, args, deadline)
}

/// `mpirun -n N tp args...` (fails the test when mpirun is not installed or past `deadline`).
pub fn mpirun_tp(n: usize, args: &[&str], deadline: Duration) -> Finished {
    tp_testkit::run(tp_testkit::mpirun(n).arg(TP).args(args), deadline)
}

/// `(step, loss)` of each JSON row of `tp train --json` output.
pub fn losses(out: &str) -> Vec<(u64, f64)> {
    json_rows(out)
        .iter()
        .filter_map(|v| Some((v.get("step")?.as_u64()?, v.get("loss")?.as_f64()?)))
        .collect()
}

/// Seeded top-k/top-p sampling of 24 tokens with a table of 3 alternatives per token.
pub const SEEDED_SAMPLING: [&str; 12] = [
    "--temperature",
    "0.8",
    "--top-k",
    "40",
    "--top-p",
    "0.9",
    "--seed",
    "3",
    "--max-tokens",
    "24",
    "--logprobs",
    "3",
];

/// A successful `tp generate`'s text and its log-probability table (stderr without the `#`
/// timing lines).
pub fn text_and_logprobs(f: &Finished) -> (String, Vec<String>) {
    assert_eq!(f.code, Some(0), "{}", f.output);
    let table = f
        .stderr
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    (f.stdout.clone(), table)
}
