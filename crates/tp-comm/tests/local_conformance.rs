//! The conformance suite on the local backend at 1..8 ranks.

use tp_comm::local::{self, LocalOptions};

fn conformance(n: usize) {
    let reports = local::run(n, LocalOptions::default(), |world| {
        tp_comm::conformance::run(&world)
    })
    .expect("world starts");
    for (rank, outcome) in reports.into_iter().enumerate() {
        let report = outcome.unwrap_or_else(|p| panic!("rank {rank} panicked: {p}"));
        assert!(
            report.failed.is_empty(),
            "rank {rank} of {n}: {} failures, first: {:?}",
            report.failed.len(),
            &report.failed[..report.failed.len().min(5)]
        );
        assert!(
            report.passed > 100,
            "rank {rank} ran only {} checks",
            report.passed
        );
    }
}

#[test]
fn one_rank() {
    conformance(1);
}
#[test]
fn two_ranks() {
    conformance(2);
}
#[test]
fn three_ranks() {
    conformance(3);
}
#[test]
fn four_ranks() {
    conformance(4);
}
#[test]
fn five_ranks() {
    conformance(5);
}
#[test]
fn six_ranks() {
    conformance(6);
}
#[test]
fn seven_ranks() {
    conformance(7);
}
#[test]
fn eight_ranks() {
    conformance(8);
}
