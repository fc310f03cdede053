//! `tp train` end to end on the local backend: it learns and writes a checkpoint with a loss
//! curve; a process aborted in the middle of a save resumes from the previous checkpoint
//! and continues the same loss curve; bad inputs end with a clear error, never a panic.

mod common;
use common::{losses, TP};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn tp(args: &[&str]) -> common::Finished {
    common::run_with_deadline(TP, args, Duration::from_secs(300))
}

fn scratch(name: &str) -> PathBuf {
    tp_testkit::scratch_dir(&format!("cli-train-{name}"))
}

const RUN: [&str; 10] = [
    "train", "--tp", "2", "--steps", "12", "--seq", "32", "--batch", "4", "--json",
];

fn with(extra: &[&str]) -> Vec<String> {
    RUN.iter().chain(extra).map(|s| s.to_string()).collect()
}

fn run(args: &[String]) -> common::Finished {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    tp(&refs)
}

#[test]
fn trains_saves_and_survives_an_abort_during_save() {
    let dir = scratch("full");
    let d = dir.to_str().unwrap();
    let full = run(&with(&["--save", d, "--save-every", "4"]));
    assert_eq!(full.code, Some(0), "{}", full.output);
    let want = losses(&full.output);
    assert_eq!(want.len(), 12, "{}", full.output);
    assert!(want[11].1 < want[0].1 - 0.3, "did not learn: {want:?}");
    let step = dir.join("step-00000012");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "optimizer.safetensors",
        "trainer.json",
        "manifest.json",
    ] {
        assert!(step.join(f).exists(), "{f} missing");
    }
    assert!(std::fs::read_to_string(dir.join("loss.svg"))
        .unwrap()
        .contains("<polyline"));
    assert!(full.output.contains("checkpoint "), "{}", full.output);

    // The same run, aborted (SIGABRT, no cleanup) half-way through writing step 8's weights.
    let crash = scratch("crash");
    let c = crash.to_str().unwrap();
    let died = run(&with(&[
        "--save",
        c,
        "--save-every",
        "4",
        "--crash-during-save",
        "8:part:model.safetensors",
    ]));
    assert_ne!(died.code, Some(0), "{}", died.output);
    assert!(
        died.output.contains("aborting the process"),
        "{}",
        died.output
    );
    assert_eq!(latest(&crash), "step-00000004");
    let before: Vec<_> = losses(&died.output);
    assert_eq!(before, want[..8].to_vec());

    let resumed = run(&with(&["--save", c, "--save-every", "4", "--resume", c]));
    assert_eq!(resumed.code, Some(0), "{}", resumed.output);
    assert_eq!(
        losses(&resumed.output),
        want[4..].to_vec(),
        "the curve must continue exactly"
    );
    assert_eq!(latest(&crash), "step-00000012");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&crash);
}

/// Issue 34: `--distributed-optimizer` reaches the run (the start-up line reports rank 0's
/// optimizer arrays halved at dp 2) and trains the same losses as without it.
#[test]
fn distributed_optimizer_flag_halves_the_optimizer_state_with_the_same_losses() {
    let base = [
        "train", "--dp", "2", "--steps", "6", "--seq", "32", "--batch", "4", "--json",
    ];
    let plain = tp(&base);
    assert_eq!(plain.code, Some(0), "{}", plain.output);
    let mut args = base.to_vec();
    args.push("--distributed-optimizer");
    let sharded = tp(&args);
    assert_eq!(sharded.code, Some(0), "{}", sharded.output);
    let want = losses(&plain.output);
    assert_eq!(want.len(), 6, "{}", plain.output);
    let got = losses(&sharded.output);
    assert_eq!(got.len(), 6, "{}", sharded.output);
    for ((s, g), (_, w)) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-4 * w.abs(), "step {s}: {g} vs {w}");
    }
    // The tiny preset: P = 853120 elements on each replica, 426560 in each slice.
    assert!(
        plain.output.contains("3 x 853120 elements") && plain.output.contains("not sharded"),
        "{}",
        plain.output
    );
    assert!(
        sharded.output.contains("3 x 426560 elements")
            && sharded.output.contains("sharded over dp=2"),
        "{}",
        sharded.output
    );
}

/// `--sequence-parallel` reaches the trainer and changes no loss (issue 34; the oracle tests
/// are tp-train's tests/sequence_parallel.rs).
#[test]
fn sequence_parallel_gives_the_losses_without_it() {
    let plain = run(&with(&[]));
    let sp = run(&with(&["--sequence-parallel"]));
    assert_eq!(plain.code, Some(0), "{}", plain.output);
    assert_eq!(sp.code, Some(0), "{}", sp.output);
    let (want, got) = (losses(&plain.output), losses(&sp.output));
    assert_eq!(got.len(), 12, "{}", sp.output);
    for ((s, w), (_, g)) in want.iter().zip(&got) {
        assert!((g - w).abs() <= 1e-4 * w.abs(), "step {s}: {g} vs {w}");
    }
}

/// `--virtual-stages` reaches the trainer (interleaved 1F1B at pp 2: the tiny preset's 4
/// layers in 4 chunks) and changes no loss; counts the run cannot take are refused naming
/// the valid ones (issue 34; the oracle tests are tp-train's tests/interleaved.rs).
#[test]
fn virtual_stages_give_the_losses_without_them_and_bad_counts_are_refused() {
    let base = [
        "train",
        "--pp",
        "2",
        "--steps",
        "6",
        "--seq",
        "32",
        "--batch",
        "4",
        "--micro-batches",
        "2",
        "--json",
    ];
    let with_v = |v: &str| {
        let mut a = base.to_vec();
        a.extend(["--virtual-stages", v]);
        tp(&a)
    };
    let plain = tp(&base);
    let v2 = with_v("2");
    assert_eq!(plain.code, Some(0), "{}", plain.output);
    assert_eq!(v2.code, Some(0), "{}", v2.output);
    assert!(
        v2.output
            .contains("interleaved 1F1B, 2 virtual stages (4 chunks of the 4 layers)"),
        "{}",
        v2.output
    );
    let (want, got) = (losses(&plain.output), losses(&v2.output));
    assert_eq!(got.len(), 6, "{}", v2.output);
    for ((s, w), (_, g)) in want.iter().zip(&got) {
        assert!((g - w).abs() <= 1e-4 * w.abs(), "step {s}: {g} vs {w}");
    }
    let bad = with_v("3");
    assert_ne!(bad.code, Some(0), "{}", bad.output);
    assert!(
        bad.output.contains("use 1 to 2 virtual stages at pp=2"),
        "{}",
        bad.output
    );
    assert!(!bad.output.contains("panicked"), "{}", bad.output);
}

/// Issue 33: `--ep 2` at dp 2 puts whole experts on each replica and dispatches the tokens by
/// all-to-all: the first steps' losses are expert-TP's (tp 1: the same products, summed in
/// another order; later steps may route a near-tied token differently, docs/moe.md). With
/// `--distributed-optimizer` (dense state over dp, the experts' over their edp group) the
/// losses are ep 2's bit for bit (the same sums, tests/distributed_optimizer.rs).
#[test]
fn experts_over_replicas_give_the_losses_of_expert_tp() {
    let base = [
        "train", "--arch", "mixtral", "--dp", "2", "--steps", "3", "--seq", "32", "--batch", "4",
        "--json",
    ];
    let at = |ep: &str| {
        let mut a = base.to_vec();
        a.extend(["--ep", ep]);
        tp(&a)
    };
    let (one, two) = (at("1"), at("2"));
    let mut a = base.to_vec();
    a.extend(["--ep", "2", "--distributed-optimizer"]);
    let sharded = tp(&a);
    assert_eq!(sharded.code, Some(0), "{}", sharded.output);
    assert!(
        sharded
            .output
            .contains("sharded over dp=2, its experts over edp=1"),
        "{}",
        sharded.output
    );
    assert_eq!(losses(&sharded.output), losses(&two.output));
    assert_eq!(one.code, Some(0), "{}", one.output);
    assert_eq!(two.code, Some(0), "{}", two.output);
    assert!(
        two.output
            .contains("ep 2: whole experts over blocks of 2 replicas, tokens sent by all-to-all"),
        "{}",
        two.output
    );
    // Each rank's expert load in the step's JSON (none at ep 1).
    assert!(two.output.contains("\"expert_rows\":["), "{}", two.output);
    assert!(
        one.output.contains("\"expert_rows\":null"),
        "{}",
        one.output
    );
    let (want, got) = (losses(&one.output), losses(&two.output));
    assert_eq!(got.len(), 3, "{}", two.output);
    for ((s, w), (_, g)) in want.iter().zip(&got) {
        assert!((g - w).abs() <= 1e-4 * w.abs(), "step {s}: {g} vs {w}");
    }
}

fn latest(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("latest"))
        .unwrap()
        .trim()
        .to_string()
}

#[test]
fn recompute_keeps_the_loss_curve_and_the_bench_reports_activation_memory() {
    let curve = |mode: &str| {
        let f = tp(&[
            "train",
            "--tp",
            "2",
            "--steps",
            "4",
            "--seq",
            "32",
            "--batch",
            "4",
            "--json",
            "--recompute",
            mode,
        ]);
        assert_eq!(f.code, Some(0), "{mode}: {}", f.output);
        losses(&f.output)
    };
    let want = curve("none");
    assert_eq!(want.len(), 4);
    for mode in ["selective", "full"] {
        let got = curve(mode);
        assert_eq!(got.len(), want.len(), "{mode}");
        for ((_, g), (step, w)) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-4 * w, "{mode} step {step}: {g} vs {w}");
        }
    }
    let bench = tp(&[
        "bench",
        "train",
        "--config",
        "tiny",
        "--layouts",
        "2x1x1",
        "--recompute",
        "none,selective,full",
        "--batch",
        "2",
        "--seq",
        "32",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--rounds",
        "1",
    ]);
    assert_eq!(bench.code, Some(0), "{}", bench.output);
    assert!(bench.output.contains("act_MiB(f)"), "{}", bench.output);
    // Full recomputation: the counted layer inputs (4 layers x 2 x 32 x 128 x 4 bytes) are
    // the formula's 2sbh per layer in f32.
    let full = bench
        .output
        .lines()
        .find(|l| !l.starts_with('#') && l.contains(" full "))
        .unwrap_or_else(|| panic!("no full row: {}", bench.output));
    let cols: Vec<&str> = full.split_whitespace().collect();
    assert_eq!(cols[cols.len() - 1], cols[cols.len() - 2], "{full}");
    let counted: f64 = cols[cols.len() - 1].parse().expect("MiB");
    assert!((counted - 0.125).abs() < 0.006, "{full}");
    assert!(bench.output.contains(" selective "), "{}", bench.output);
}

/// `--moe-capacity-factor` on a Mixtral: each step's JSON counts the dropped (token, expert)
/// pairs (at 0.25 each expert keeps a quarter of its even share of a micro-batch's pairs,
/// so most are dropped); without the flag the field is null.
#[test]
fn moe_capacity_drops_are_in_the_step_report() {
    let dropped = |extra: &[&str]| -> Vec<serde_json::Value> {
        let mut args = vec![
            "train", "--arch", "mixtral", "--steps", "2", "--seq", "16", "--batch", "2", "--json",
        ];
        args.extend(extra);
        let f = tp(&args);
        assert_eq!(f.code, Some(0), "{extra:?}: {}", f.output);
        f.stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v.get("step").is_some())
            .map(|v| v["moe_dropped"].clone())
            .collect()
    };
    let capped = dropped(&[
        "--moe-capacity-factor",
        "0.25",
        "--moe-bias-update-rate",
        "0.001",
    ]);
    assert_eq!(capped.len(), 2, "{capped:?}");
    assert!(capped.iter().all(|d| d.as_u64() > Some(0)), "{capped:?}");
    assert!(dropped(&[]).iter().all(serde_json::Value::is_null));
}

#[test]
fn bad_inputs_get_clear_errors() {
    let dir = scratch("bad");
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let short = dir.join("short.txt");
    std::fs::write(&short, "In the beginning was a short file.").unwrap();
    let bad_config = dir.join("config.json");
    std::fs::write(&bad_config, "{\"hidden_size\": \"big\"}").unwrap();
    let (e, s, b) = (
        empty.to_str().unwrap(),
        short.to_str().unwrap(),
        bad_config.to_str().unwrap(),
    );
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--data", "/no/such/corpus.txt"], "does not exist"),
        (vec!["--data", e], "the data is empty"),
        (
            vec!["--data", s, "--seq", "64"],
            "use a sequence length of 33 or less",
        ),
        (vec!["--tp", "5"], "use 1 <= tp <= 4"),
        (vec!["--pp", "5"], "use 1 <= pp <= 4"),
        (vec!["--dp", "3"], "multiple of 3"),
        (vec!["--config", "enormous"], "no such preset or file"),
        (
            vec!["--config", b],
            "not a Llama, Qwen2, Qwen3 or Gemma-3 config.json",
        ),
        (
            vec!["--arch", "qwen2moe"],
            "use one of llama, qwen2, qwen3, gemma3",
        ),
        (vec!["--resume", "/no/such/checkpoint"], "does not exist"),
        (vec!["--seq", "4096"], "max_position_embeddings"),
        (
            vec!["--tp", "2", "--seq", "17", "--sequence-parallel"],
            "17 positions do not divide by tp=2",
        ),
        (
            vec!["--recompute", "sometimes"],
            "possible values: none, selective, full",
        ),
        (vec!["--pack"], "plain text, without documents to pack"),
        (
            vec!["--ep", "2"],
            "the model has no experts (it is dense); use 1",
        ),
        (
            vec!["--arch", "mixtral", "--tp", "2", "--dp", "2", "--ep", "3"],
            "valid: 1, 2, 4",
        ),
        (vec!["--moe-capacity-factor", "0"], "give a number above 0"),
        (
            vec!["--moe-capacity-factor", "1.25"],
            "the model has no experts (it is dense); leave it unset",
        ),
        (
            vec!["--moe-bias-update-rate", "0.001"],
            "a router bias update rate was given, but the model has no experts",
        ),
        (
            vec!["--arch", "mixtral", "--moe-bias-update-rate", "-1"],
            "the router bias update rate must be a number >= 0",
        ),
    ];
    for (extra, want) in cases {
        let mut args = vec!["train", "--steps", "2", "--batch", "4"];
        args.extend(&extra);
        let f = tp(&args);
        assert_eq!(f.code, Some(2), "{extra:?}: {}", f.output);
        assert!(
            f.output.contains(want),
            "{extra:?}: wanted '{want}' in: {}",
            f.output
        );
        assert!(!f.output.contains("panicked"), "{extra:?}: {}", f.output);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 33: `tp bench train --arch mixtral --ep 1,2` measures each ep at the layouts it is
/// valid for (ep 2 needs tp 2 or dp 2: not at 1x1x1) and names the arch and ep in the table
/// and the JSON rows; an ep valid for no layout is refused with the valid values.
#[test]
fn bench_train_measures_the_arch_and_each_valid_ep() {
    let args = |ep: &'static str, json: bool| {
        let mut a = vec![
            "bench",
            "train",
            "--config",
            "tiny",
            "--arch",
            "mixtral",
            "--layouts",
            "1x1x1,1x1x2",
            "--ep",
            ep,
            "--batch",
            "2",
            "--seq",
            "16",
            "--warmup",
            "0",
            "--steps",
            "1",
            "--rounds",
            "1",
        ];
        if json {
            a.push("--json");
        }
        a
    };
    let f = tp(&args("1,2", true));
    assert_eq!(f.code, Some(0), "{}", f.output);
    let rows: Vec<(String, u64, u64)> = tp_testkit::json::rows_with(&f.output, "ep")
        .iter()
        .map(|r| {
            (
                r["arch"].as_str().unwrap_or_default().to_string(),
                r["dp"].as_u64().unwrap_or(0),
                r["ep"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    let m = "mixtral".to_string();
    assert_eq!(
        rows,
        [(m.clone(), 1, 1), (m.clone(), 2, 1), (m, 2, 2)],
        "{}",
        f.output
    );
    let table = tp(&args("2", false));
    assert_eq!(table.code, Some(0), "{}", table.output);
    assert!(table.output.contains("    arch ep  tp"), "{}", table.output);
    assert!(
        table
            .output
            .lines()
            .any(|l| l.starts_with("   mixtral  2   1   1   2 ")),
        "{}",
        table.output
    );
    let bad = tp(&args("3", false));
    assert_ne!(bad.code, Some(0), "{}", bad.output);
    assert!(bad.output.contains("valid: 1"), "{}", bad.output);
    assert!(!bad.output.contains("panicked"), "{}", bad.output);
}
