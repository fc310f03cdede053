//! `tp` under mpirun: the sweep and the selftest pass at 2 and 3 processes, and a panicking
//! rank ends the job within seconds with an error that names it (R1 across processes).
#![cfg(feature = "mpi")]

mod common;
use common::TP;
use std::time::Duration;

#[test]
fn selftest_passes_under_mpirun() {
    for n in [2, 3] {
        let f = common::mpirun_tp(
            n,
            &["selftest", "--backend", "mpi"],
            Duration::from_secs(120),
        );
        assert_eq!(f.code, Some(0), "{}", f.output);
        assert!(f.output.contains(" passed, 0 failed"), "{}", f.output);
    }
}

#[test]
fn a_small_sweep_is_correct_under_mpirun() {
    let args = [
        "bench",
        "collectives",
        "--backend",
        "mpi",
        "--max-bytes",
        "256K",
        "--factor",
        "8",
        "--samples",
        "1",
        "--json",
    ];
    let f = common::mpirun_tp(3, &args, Duration::from_secs(120));
    assert_eq!(f.code, Some(0), "{}", f.output);
    let rows = tp_testkit::json::rows_with(&f.output, "op");
    // 5 ops (all_reduce, all_gather, reduce_scatter, broadcast, all_to_all) x 6 sizes.
    assert_eq!(rows.len(), 30, "{}", f.output);
    assert!(
        rows.iter()
            .all(|r| r["wrong"] == 0 && r["backend"] == "mpi"),
        "{}",
        f.output
    );
}

#[test]
fn a_panicking_process_is_named_and_the_job_ends() {
    let args = [
        "bench",
        "collectives",
        "--backend",
        "mpi",
        "--max-bytes",
        "4K",
        "--samples",
        "1",
        "--timeout",
        "20",
        "--fault",
        "panic:1@6",
    ];
    let f = common::mpirun_tp(3, &args, Duration::from_secs(40));
    assert_ne!(f.code, Some(0), "{}", f.output);
    assert!(f.took < Duration::from_secs(25), "took {:?}", f.took);
    assert!(
        f.output.contains("rank 1 is gone (panicked"),
        "{}",
        f.output
    );
}

#[test]
fn a_desync_across_processes_shows_both_fingerprints() {
    let args = [
        "bench",
        "collectives",
        "--backend",
        "mpi",
        "--max-bytes",
        "4K",
        "--samples",
        "1",
        "--timeout",
        "20",
        "--fault",
        "mismatch:1@5",
    ];
    let f = common::mpirun_tp(2, &args, Duration::from_secs(40));
    assert_ne!(f.code, Some(0), "{}", f.output);
    assert!(f.output.contains("collective mismatch"), "{}", f.output);
}

/// `mpirun -n 3 tp generate --backend mpi` gives the same greedy text as 3 local rank threads.
#[test]
fn generate_under_mpirun_matches_local_ranks() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let model = model.to_string_lossy().to_string();
    let prompt = "The three primary colors are";
    let args = [
        "generate",
        "--model",
        &model,
        "--greedy",
        "--max-tokens",
        "32",
        "-q",
    ];
    let mut local: Vec<&str> = args.to_vec();
    local.extend(["--tp", "3", prompt]);
    let want = common::run_with_deadline(TP, &local, Duration::from_secs(300));
    assert_eq!(want.code, Some(0), "{}", want.output);
    let mut mpi: Vec<&str> = args.to_vec();
    mpi.extend(["--backend", "mpi", prompt]);
    let got = common::mpirun_tp(3, &mpi, Duration::from_secs(300));
    assert_eq!(got.code, Some(0), "{}", got.output);
    assert_eq!(
        got.stdout, want.stdout,
        "mpirun -n 3 differs from --tp 3 local"
    );
    assert!(want.stdout.trim().len() > 20, "{:?}", want.stdout);
}

/// `mpirun -n 2 tp bench decode --backend mpi` measures at the world's size (tp 2) without
/// --tps or --tp; a --tps that is not the world's size is still refused.
#[test]
fn bench_decode_under_mpirun_takes_the_world_size() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let model = model.to_string_lossy().to_string();
    let args = [
        "bench",
        "decode",
        "--backend",
        "mpi",
        "--model",
        &model,
        "--prompt-tokens",
        "4",
        "--gen-tokens",
        "2",
        "--repeats",
        "1",
        "--json",
    ];
    let f = common::mpirun_tp(2, &args, Duration::from_secs(300));
    assert_eq!(f.code, Some(0), "{}", f.output);
    let rows = tp_testkit::json::rows_with(&f.stdout, "tp");
    assert_eq!(rows.len(), 1, "{}", f.output);
    assert_eq!(rows[0]["tp"], 2, "{}", f.output);
    assert!(
        rows[0]["decode_tok_s"].as_f64().is_some_and(|v| v > 0.0),
        "{}",
        f.output
    );
    let mut wrong = args.to_vec();
    wrong.extend(["--tps", "1"]);
    let f = common::mpirun_tp(2, &wrong, Duration::from_secs(120));
    assert_ne!(f.code, Some(0), "{}", f.output);
    assert!(
        f.output.contains("mpirun started 2 processes"),
        "{}",
        f.output
    );
}

/// `mpirun -n 3 tp generate` with seeded top-k/top-p sampling and `--logprobs 3`: the ranks'
/// merged candidates give the text and table of the gathered rows (`TP_GATHER_LOGITS=1`).
#[test]
fn sampling_from_candidates_under_mpirun_is_the_gathered_paths() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let model = model.to_string_lossy().to_string();
    let run = |gather: &str| {
        let f = common::run(
            tp_testkit::mpirun(3)
                .args(["-x", &format!("TP_GATHER_LOGITS={gather}")])
                .arg(TP)
                .args(["generate", "--model", &model, "--backend", "mpi"])
                .args(common::SEEDED_SAMPLING)
                .arg("The three primary colors are"),
            Duration::from_secs(300),
        );
        common::text_and_logprobs(&f)
    };
    let want = run("1");
    assert!(want.0.trim().len() > 5 && want.1.len() > 10, "{want:?}");
    assert_eq!(run("0"), want);
}
