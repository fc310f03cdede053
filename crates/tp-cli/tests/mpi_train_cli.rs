//! `tp train` under mpirun (one rank per process): the loss curve matches the same layout on
//! the local backend, and a checkpoint saved under MPI resumes on the local backend at
//! another tp onto the same curve.
#![cfg(feature = "mpi")]

mod common;
use common::{losses, TP};
use std::time::Duration;

fn close(got: &[(u64, f64)], want: &[(u64, f64)]) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.0, w.0);
        assert!(
            (g.1 - w.1).abs() <= 1e-4 * w.1.abs(),
            "step {}: {} vs {}",
            g.0,
            g.1,
            w.1
        );
    }
}

#[test]
fn train_under_mpirun_matches_local_and_resumes_locally_at_another_tp() {
    // Constant learning rate, so runs of different lengths share the schedule.
    let base = [
        "train", "--tp", "2", "--seq", "32", "--batch", "4", "--json", "--warmup", "0", "--lr",
        "3e-3", "--min-lr", "3e-3",
    ];
    let mut local_args = base.to_vec();
    local_args.extend(["--steps", "6"]);
    let local = common::run_with_deadline(TP, &local_args, Duration::from_secs(120));
    assert_eq!(local.code, Some(0), "{}", local.output);
    let want = losses(&local.output);
    assert_eq!(want.len(), 6, "{}", local.output);

    let dir = tp_testkit::scratch_dir("cli-mpi-train");
    let d = dir.to_str().unwrap();
    let mut mpi_args = base.to_vec();
    mpi_args.extend(["--backend", "mpi", "--steps", "4", "--save", d]);
    let mpi = common::mpirun_tp(2, &mpi_args, Duration::from_secs(180));
    assert_eq!(mpi.code, Some(0), "{}", mpi.output);
    close(&losses(&mpi.output), &want[..4]);

    let mut resume = base.to_vec();
    resume[2] = "1";
    resume.extend(["--steps", "6", "--resume", d]);
    let resumed = common::run_with_deadline(TP, &resume, Duration::from_secs(120));
    assert_eq!(resumed.code, Some(0), "{}", resumed.output);
    close(&losses(&resumed.output), &want[4..]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Mixtral at dp 2 with a capacity factor and the router bias under mpirun: each step's
/// dropped pairs and load imbalance (summed over the replicas through MPI) are the local
/// backend's, and so are the losses.
#[test]
fn moe_capacity_and_router_bias_under_mpirun_match_local() {
    let base = [
        "train",
        "--arch",
        "mixtral",
        "--dp",
        "2",
        "--seq",
        "16",
        "--batch",
        "4",
        "--steps",
        "4",
        "--json",
        "--moe-capacity-factor",
        "0.75",
        "--moe-bias-update-rate",
        "0.1",
    ];
    let local = common::run_with_deadline(TP, &base, Duration::from_secs(120));
    assert_eq!(local.code, Some(0), "{}", local.output);
    let mut mpi_args = base.to_vec();
    mpi_args.extend(["--backend", "mpi"]);
    let mpi = common::mpirun_tp(2, &mpi_args, Duration::from_secs(180));
    assert_eq!(mpi.code, Some(0), "{}", mpi.output);
    let moe = |out: &str| -> Vec<(serde_json::Value, serde_json::Value)> {
        common::json_rows(out)
            .iter()
            .filter(|v| v.get("step").is_some())
            .map(|v| (v["moe_dropped"].clone(), v["moe_imbalance"].clone()))
            .collect()
    };
    let want = moe(&local.output);
    assert_eq!(want.len(), 4, "{}", local.output);
    assert!(
        want.iter().all(|(d, i)| d.as_u64() > Some(0) && i.is_f64()),
        "{want:?}"
    );
    assert_eq!(moe(&mpi.output), want);
    close(&losses(&mpi.output), &losses(&local.output));
}
