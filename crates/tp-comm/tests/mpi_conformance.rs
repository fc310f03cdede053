//! The MPI backend under `mpirun`: the conformance suite at 2, 3 and 4 ranks, and the three
//! failure drills (R1 lost peer: panic and early exit, R2 desync, R3 deadline) at 3 ranks, on
//! all_reduce and on all_to_all_v (whose desync is disagreeing counts), and the
//! `TP_NET_DELAY_US` hook (bad values refused, results right with it on). Needs `mpirun` on PATH
//! (Debian/Ubuntu: `apt-get install openmpi-bin libopenmpi-dev`); without it the tests fail.
#![cfg(feature = "mpi")]

use std::time::Duration;
use tp_testkit::{mpirun, run, run_with_deadline, Finished};

const CHECK: &str = env!("CARGO_BIN_EXE_tp-comm-mpi-check");

/// `mpirun -n k CHECK extra...`, killed and failing the test after `limit`.
fn mpi(k: usize, extra: &[&str], limit: Duration) -> Finished {
    run(mpirun(k).arg(CHECK).args(extra), limit)
}

fn conformance(k: usize, extra: &[&str]) {
    let r = mpi(k, extra, Duration::from_secs(60));
    assert_eq!(
        r.code,
        Some(0),
        "conformance at {k} ranks failed:\n{}",
        r.output
    );
    let last = r
        .output
        .lines()
        .rev()
        .find(|l| l.ends_with(" failed") && !l.starts_with("rank "))
        .unwrap_or_else(|| panic!("no summary line in:\n{}", r.output));
    assert!(
        last.ends_with(" passed, 0 failed"),
        "summary {last:?}:\n{}",
        r.output
    );
    assert_eq!(
        r.output
            .lines()
            .filter(|l| l.starts_with("rank ") && l.contains(" passed, "))
            .count(),
        k,
        "one summary line per rank expected:\n{}",
        r.output
    );
}

#[test]
fn conformance_2_ranks() {
    conformance(2, &[]);
}

#[test]
fn conformance_3_ranks() {
    conformance(3, &[]);
}

#[test]
fn conformance_4_ranks() {
    conformance(4, &[]);
}

#[test]
fn conformance_2_ranks_without_fingerprint_exchange() {
    conformance(2, &["--no-verify"]);
}

fn drill(name: &str, expect: &[&str]) {
    drill_on(&["--drill", name], expect);
}

/// A drill with the command-line `args`: it fails within 30 s, the call after the failure is
/// refused, and every line of `expect` is in the output.
fn drill_on(args: &[&str], expect: &[&str]) {
    let name = args.join(" ");
    let r = mpi(3, args, Duration::from_secs(30));
    assert_ne!(r.code, Some(0), "drill {name} exited 0:\n{}", r.output);
    assert!(
        r.took < Duration::from_secs(30),
        "drill {name} took {:?}",
        r.took
    );
    let poisoned = "this group is unusable after an earlier failure";
    assert!(
        r.output.contains(poisoned),
        "drill {name}: the call after the failure was not refused:\n{}",
        r.output
    );
    for e in expect {
        assert!(
            r.output.contains(e),
            "drill {name}: {e:?} missing from:\n{}",
            r.output
        );
    }
}

#[test]
fn drill_panic_names_the_lost_rank_op_and_seq() {
    drill(
        "panic",
        &[
            "rank 1 is gone (panicked: drill: rank 1 panics",
            "waited in all_reduce #2",
        ],
    );
}

#[test]
fn drill_mismatch_shows_both_fingerprints() {
    drill(
        "mismatch",
        &[
            "collective mismatch",
            "all_reduce #2 dtype=f32 count=5",
            "all_reduce #2 dtype=f32 count=4",
        ],
    );
}

#[test]
fn drill_slow_times_out_naming_the_missing_rank() {
    drill(
        "slow",
        &[
            "timed out after 2s in all_reduce #2",
            "still waiting for ranks [1]",
        ],
    );
}

#[test]
fn drill_exit_names_the_rank_that_returned() {
    drill(
        "exit",
        &[
            "rank 1 is gone (exited: its work returned",
            "waited in all_reduce #2",
        ],
    );
}

#[test]
fn all_to_all_drills_name_the_lost_rank_the_late_rank_and_the_disagreeing_pair() {
    let a2a = |d: &'static str| ["--drill", d, "--op", "all_to_all"];
    drill_on(
        &a2a("panic"),
        &[
            "rank 1 is gone (panicked: drill: rank 1 panics",
            "waited in all_to_all #2",
        ],
    );
    drill_on(
        &a2a("slow"),
        &[
            "timed out after 2s in all_to_all #2",
            "still waiting for ranks [1]",
        ],
    );
    // Rank 1 sends one element more to every peer than they expect: every rank (rank 1
    // included) names the first pair of the table.
    let expect = "counts disagree (desync) in all_to_all #2 of a 3-rank group: rank 1 sends 3 \
                  elements to rank 0, which expects 2";
    drill_on(&a2a("mismatch"), &[expect]);
    // Rank 1 calls a barrier where the others call all_to_all: both fingerprints are named.
    drill_on(
        &a2a("barrier"),
        &[
            "collective mismatch",
            "all_to_all #2 dtype=f32 count=0",
            "barrier #2 dtype=u8 count=0",
        ],
    );
    let r = mpi(3, &a2a("mismatch"), Duration::from_secs(30));
    let per_rank = format!("drill mismatch: {expect}");
    assert_eq!(r.output.matches(&per_rank).count(), 3, "{}", r.output);
}

#[test]
fn without_mpirun_the_binary_is_a_world_of_one() {
    let r = run_with_deadline(CHECK, &[], Duration::from_secs(60));
    assert_eq!(r.code, Some(0), "{}", r.output);
    assert!(r.output.contains("rank 0/1: "), "{}", r.output);
}

#[test]
fn init_twice_is_an_error_and_a_singleton_world_works() {
    use tp_comm::mpi::{MpiOptions, MpiRuntime};
    use tp_comm::{CommExt, ReduceOp};
    let rt = MpiRuntime::init(MpiOptions::default()).expect("first init");
    let world = rt.world();
    assert_eq!((world.rank(), world.size(), world.backend()), (0, 1, "mpi"));
    let mut x = [1.5f32, 2.0];
    world.all_reduce(&mut x, ReduceOp::Sum).expect("all_reduce");
    assert_eq!(x, [1.5, 2.0]);
    let err = MpiRuntime::init(MpiOptions::default()).expect_err("second init must fail");
    assert!(err.to_string().contains("already"), "{err}");
    let mut big = [0u8; 8];
    world.send(&big[..4], 0, 9).expect("send to self");
    let e = world
        .recv(&mut big[..3], 0, 9)
        .expect_err("length mismatch");
    assert!(e.to_string().contains("mismatch"), "{e}");
    world
        .recv(&mut big[..4], 0, 9)
        .expect("the message was not consumed");
}

/// Runs `mpirun -n k -x TP_NET_DELAY_US=delay CHECK` (the variable set in the ranks only, so
/// tests running at the same time are not affected).
fn mpi_delayed(k: usize, delay: &str, limit: Duration) -> Finished {
    let var = format!("TP_NET_DELAY_US={delay}");
    run(mpirun(k).args(["-x", &var]).arg(CHECK), limit)
}

#[test]
fn a_bad_net_delay_is_refused_at_init_and_a_delay_keeps_results_right() {
    let r = mpi_delayed(2, "2ms", Duration::from_secs(60));
    assert_ne!(r.code, Some(0), "{}", r.output);
    assert!(
        r.output.contains("TP_NET_DELAY_US=\"2ms\"") && r.output.contains("microseconds"),
        "{}",
        r.output
    );
    // With the hook on (1 us per message step) the whole suite still passes.
    let r = mpi_delayed(2, "1", Duration::from_secs(60));
    assert_eq!(r.code, Some(0), "{}", r.output);
    assert!(r.output.contains(" passed, 0 failed"), "{}", r.output);
}
