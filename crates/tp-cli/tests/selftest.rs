//! `tp selftest` on the local backend passes and prints the closing line.

mod common;
use std::time::Duration;

#[test]
fn selftest_passes_at_three_ranks() {
    let f = common::run_with_deadline(
        env!("CARGO_BIN_EXE_tp"),
        &["selftest", "--ranks", "3"],
        Duration::from_secs(120),
    );
    assert_eq!(f.code, Some(0), "{}", f.output);
    assert!(f.output.contains(" passed, 0 failed"), "{}", f.output);
}
