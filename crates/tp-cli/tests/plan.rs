//! `tp plan` is wired into the binary: a plan prints, a bad preset is a clear error.

mod common;
use common::TP;
use std::time::Duration;

#[test]
fn plans_a_known_model_and_keeps_tp_inside_the_node() {
    let f = common::run_with_deadline(
        TP,
        &[
            "plan",
            "--model",
            "llama-2-7b",
            "--gpus",
            "16",
            "--gpu",
            "a100-80",
            "--json",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(f.code, Some(0), "{}", f.output);
    let v: serde_json::Value = serde_json::from_str(&f.output).expect("JSON output");
    let text = v.to_string();
    assert!(text.contains("\"tp\""), "{text}");
}

#[test]
fn an_unknown_preset_lists_the_valid_ones() {
    let f = common::run_with_deadline(
        TP,
        &["plan", "--model", "gpt-17", "--gpus", "8"],
        Duration::from_secs(30),
    );
    assert_eq!(f.code, Some(2), "{}", f.output);
    assert!(f.output.contains("llama-2-70b"), "{}", f.output);
}

/// `tp bench link` (rank threads here; under mpirun across hosts in docs/multi-host.md) ends
/// with the `tp plan` flags of the slowest link, and `tp plan --serve` takes them as given.
#[test]
fn the_link_probe_prints_flags_tp_plan_takes() {
    let f = common::run_with_deadline(
        TP,
        &[
            "bench", "link", "--ranks", "3", "--rounds", "5", "--mib", "1",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(f.code, Some(0), "{}", f.output);
    let rows: Vec<&str> = f
        .stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim_start().starts_with("rank"))
        .collect();
    assert_eq!(rows.len(), 2, "a row per peer: {}", f.stdout);
    let flags = f
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("# for tp plan (the slowest link): "))
        .expect("the tp plan flags");
    let mut args = vec![
        "plan",
        "--model",
        "smollm2-135m",
        "--gpu",
        "cpu-2core",
        "--cores",
        "1",
        "--gpus",
        "2",
        "--serve",
    ];
    args.extend(flags.split_whitespace());
    let plan = common::run_with_deadline(TP, &args, Duration::from_secs(60));
    assert_eq!(plan.code, Some(0), "{args:?}: {}", plan.output);
    let bad = common::run_with_deadline(
        TP,
        &["bench", "link", "--ranks", "1"],
        Duration::from_secs(60),
    );
    assert_ne!(bad.code, Some(0));
    assert!(bad.output.contains("at least 2 ranks"), "{}", bad.output);
}
