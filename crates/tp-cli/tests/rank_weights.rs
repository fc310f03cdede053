//! `--rank-weights` (uneven hosts) end to end on the real SmolLM2: `tp inspect` shows the larger
//! shard on the heavier rank, greedy text is the same as tp 1 at 2,1, 1,2 and 3,2,1 (local
//! threads and under mpirun), the start-up report prints each rank's own shard and bytes, and
//! every bad value is a clear error before anything loads; `tp serve`'s KV budget fits the
//! heavier rank.

mod common;
use common::TP;
mod serve_util;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(300);

fn tp(args: &[&str]) -> common::Finished {
    common::run_with_deadline(TP, args, DEADLINE)
}

const PROMPT: &str = "The three primary colors are";

fn greedy(model: &str, extra: &[&str]) -> common::Finished {
    let mut args = vec![
        "generate",
        "--model",
        model,
        "--greedy",
        "--max-tokens",
        "32",
    ];
    args.extend_from_slice(extra);
    args.push(PROMPT);
    tp(&args)
}

/// The `heads A..B` of each `# rank N: heads ...` line of the start-up report.
fn reported_heads(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("# rank "))
        .filter_map(|l| l.split("heads ").nth(1))
        .filter_map(|l| l.split(',').next())
        .map(str::to_string)
        .collect()
}

#[test]
fn inspect_gives_the_heavier_rank_the_larger_shard() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy().to_string();
    let f = tp(&["inspect", &m, "--rank-weights", "2,1"]);
    assert_eq!(f.code, Some(0), "{}", f.output);
    let out = &f.stdout;
    assert!(out.contains("tp 2, rank weights 2,1: per rank"), "{out}");
    // Two thirds of the 9 heads, 48 FFN blocks and 49152 vocabulary rows on rank 0.
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.trim_start().starts_with("0 ") || l.trim_start().starts_with("1 "))
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    for (row, want) in rows.iter().zip([
        ["0..6", "0..2", "0..1024", "0..32768"],
        ["6..9", "2..3", "1024..1536", "32768..49152"],
    ]) {
        for w in want {
            assert!(row.contains(w), "{w} missing from {row:?}: {out}");
        }
    }
    // 1,2 mirrors it; --tp with matching weights is accepted.
    let f = tp(&["inspect", &m, "--tp", "2", "--rank-weights", "1,2"]);
    assert_eq!(f.code, Some(0), "{}", f.output);
    assert!(
        f.stdout.contains("0..3") && f.stdout.contains("3..9") && f.stdout.contains("16384..49152"),
        "{}",
        f.stdout
    );
    // Even weights are the plain balanced split.
    let even = tp(&["inspect", &m, "--tp", "3"]);
    let ones = tp(&["inspect", &m, "--rank-weights", "1,1,1"]);
    assert_eq!(even.code, Some(0), "{}", even.output);
    assert_eq!(ones.stdout, even.stdout);
}

#[test]
fn greedy_text_with_rank_weights_is_tp_1_text() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy().to_string();
    let want = greedy(&m, &["-q"]);
    assert_eq!(want.code, Some(0), "{}", want.output);
    assert!(want.stdout.trim().len() > 20, "{:?}", want.stdout);
    for (tp_size, weights, heads) in [
        ("2", "2,1", vec!["0..6", "6..9"]),
        ("2", "1,2", vec!["0..3", "3..9"]),
        ("3", "3,2,1", vec!["0..5", "5..8", "8..9"]),
    ] {
        let got = greedy(&m, &["--tp", tp_size, "--rank-weights", weights]);
        assert_eq!(got.code, Some(0), "{weights}: {}", got.output);
        assert_eq!(
            got.stdout, want.stdout,
            "--rank-weights {weights} differs from tp 1"
        );
        assert!(
            got.stderr.contains(&format!(
                "tp {tp_size}, rank weights {weights} (Local backend"
            )),
            "{}",
            got.stderr
        );
        assert_eq!(reported_heads(&got.stderr), heads, "{}", got.stderr);
    }
}

#[test]
fn bad_rank_weights_are_refused_before_loading() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy().to_string();
    for (args, want) in [
        (
            vec!["--tp", "3", "--rank-weights", "2,1"],
            "--rank-weights 2,1 has 2 weights but tp is 3; give exactly one weight per rank",
        ),
        (
            vec!["--tp", "1", "--rank-weights", "2,1"],
            "--rank-weights 2,1 has 2 weights but tp is 1",
        ),
        (
            vec!["--tp", "2", "--rank-weights", "2,0"],
            "rank 1 has weight 0",
        ),
        (
            vec!["--tp", "2", "--rank-weights", "2,x"],
            "are not whole numbers separated by commas, like 2,1",
        ),
        (
            vec!["--tp", "2", "--rank-weights", "-1,2"],
            "are not whole numbers separated by commas",
        ),
        (
            vec!["--tp", "2", "--rank-weights", "5000,1"],
            "rank 0 has weight 5000, more than the largest allowed (1000)",
        ),
        // 9 heads at 1:1:20: rank 1's share is 0.41 of a head.
        (
            vec!["--tp", "3", "--rank-weights", "1,1,20"],
            "rank 1's share of the 9 heads is 0.41, less than one head",
        ),
    ] {
        let mut all = vec!["generate", "--model", &m, "--max-tokens", "2"];
        all.extend_from_slice(&args);
        all.push("hi");
        let f = tp(&all);
        assert_ne!(f.code, Some(0), "{args:?} was accepted: {}", f.output);
        assert!(
            f.stderr.contains(want),
            "{args:?}: want {want:?} in {}",
            f.stderr
        );
        assert!(!f.stderr.contains("panicked"), "{args:?}: {}", f.stderr);
        assert!(
            !f.stderr.contains("# load"),
            "{args:?} loaded weights: {}",
            f.stderr
        );
    }
    let f = tp(&["inspect", &m, "--tp", "3", "--rank-weights", "1,1"]);
    assert_ne!(f.code, Some(0), "{}", f.output);
    assert!(
        f.stderr.contains("has 2 weights but tp is 3"),
        "{}",
        f.stderr
    );
}

#[test]
fn busiest_weighted_rank_is_named_by_the_memory_check() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy().to_string();
    // At 2,1 rank 0 holds about 66 MB of weights, rank 1 about 33 MB; 60MB fits only rank 1.
    let f = tp(&[
        "generate",
        "--model",
        &m,
        "--rank-weights",
        "2,1",
        "--tp",
        "2",
        "--ctx-size",
        "16",
        "--max-rank-memory",
        "60MB",
        "hi",
    ]);
    assert_ne!(f.code, Some(0), "{}", f.output);
    assert!(
        f.stderr.contains("rank 0 (--rank-weights 2,1) needs")
            && f.stderr.contains("lower its weight"),
        "{}",
        f.stderr
    );
    let f = tp(&[
        "generate",
        "--model",
        &m,
        "--rank-weights",
        "1,2",
        "--tp",
        "2",
        "--ctx-size",
        "16",
        "--max-rank-memory",
        "60MB",
        "hi",
    ]);
    assert!(
        f.stderr.contains("rank 1 (--rank-weights 1,2) needs"),
        "{}",
        f.stderr
    );
}

/// The `= N positions` of `tp serve`'s KV budget line.
fn budget_positions(stderr: &str) -> usize {
    stderr
        .lines()
        .find(|l| l.starts_with("# KV budget:"))
        .and_then(|l| l.split("= ").nth(1))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no KV budget line in {stderr}"))
}

#[test]
fn serve_budgets_kv_for_the_heavier_rank_and_answers_as_tp_1() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy().to_string();
    let want = greedy(&m, &["-q"]);
    assert_eq!(want.code, Some(0), "{}", want.output);
    let mut positions = Vec::new();
    for weights in ["1,1", "2,1"] {
        let mut server = serve_util::ServerProc::start_with(
            serve_util::TP,
            &[],
            &model,
            &[
                "--rank-weights",
                weights,
                "--ctx-size",
                "2048",
                "--max-rank-memory",
                "200MB",
            ],
        );
        let body = serde_json::json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 0});
        let r = server.client.post_json("/v1/completions", &body).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let text = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
        // 12 of tp 1's 32 greedy tokens.
        assert!(
            text.len() > 10 && want.stdout.starts_with(&text),
            "--rank-weights {weights}: {text:?} is not how {:?} starts",
            want.stdout
        );
        positions.push(budget_positions(&server.stderr()));
        server.signal("TERM");
        server.wait(Duration::from_secs(60));
    }
    // 2,1: rank 0 holds 2 of 3 KV heads and two thirds of the weights, so fewer positions fit
    // its 200 MB than either rank's at 1,1.
    assert!(
        positions[1] < positions[0],
        "KV positions at 1,1 and 2,1: {positions:?}"
    );
}

/// `mpirun -n 2 tp generate --backend mpi --rank-weights 2,1` gives tp 1's greedy text and
/// each process loads its own (uneven) shard.
#[cfg(feature = "mpi")]
#[test]
fn rank_weights_under_mpirun_give_the_local_text() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy().to_string();
    let want = greedy(&m, &["-q"]);
    assert_eq!(want.code, Some(0), "{}", want.output);
    let args = [
        "generate",
        "--backend",
        "mpi",
        "--rank-weights",
        "2,1",
        "--model",
        &m,
        "--greedy",
        "--max-tokens",
        "32",
        PROMPT,
    ];
    let got = common::mpirun_tp(2, &args, DEADLINE);
    assert_eq!(got.code, Some(0), "{}", got.output);
    assert_eq!(got.stdout, want.stdout, "mpirun with 2,1 differs from tp 1");
    assert_eq!(
        reported_heads(&got.stderr),
        ["0..6", "6..9"],
        "{}",
        got.stderr
    );
    // Rank 0 reads about twice rank 1's bytes.
    let read: Vec<f64> = got
        .stderr
        .lines()
        .filter_map(|l| l.strip_prefix("#"))
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.len() >= 5 && (w[0] == "0" || w[0] == "1") && w[w.len() - 3] == "MB")
        .filter_map(|w| w[w.len() - 4].parse().ok())
        .collect();
    assert_eq!(read.len(), 2, "{}", got.stderr);
    assert!(
        read[0] > 1.7 * read[1],
        "rank 0 read {read:?}: {}",
        got.stderr
    );
    let bad = common::mpirun_tp(
        2,
        &[
            "generate",
            "--backend",
            "mpi",
            "--rank-weights",
            "2,1,1",
            "--model",
            &m,
            "hi",
        ],
        DEADLINE,
    );
    assert_ne!(bad.code, Some(0), "{}", bad.output);
    assert!(
        bad.output
            .contains("--rank-weights 2,1,1 has 3 weights but mpirun started 2 processes"),
        "{}",
        bad.output
    );
}

#[test]
fn plan_turns_host_speeds_into_rank_weights() {
    let f = tp(&["plan", "--host-speeds", "25,12"]);
    assert_eq!(f.code, Some(0), "{}", f.output);
    assert!(
        f.stdout
            .contains("--rank-weights 2,1: shares 66.7%,33.3% (largest difference 0.9 points)"),
        "{}",
        f.stdout
    );
    let f = tp(&["plan", "--host-speeds", "10,7,3.4"]);
    assert_eq!(f.code, Some(0), "{}", f.output);
    assert!(f.stdout.contains("--rank-weights 3,2,1:"), "{}", f.stdout);
    for bad in ["25,0", "-3,1", "x"] {
        let f = tp(&["plan", "--host-speeds", bad]);
        assert_ne!(f.code, Some(0), "{bad}: {}", f.output);
        assert!(
            f.stderr.contains("give one positive number per host"),
            "{bad}: {}",
            f.stderr
        );
    }
}
