//! `--pp` (pipeline stages) end to end: greedy text and its log-probabilities at pp 2, pp 3
//! and pp 2 x tp 2 are tp 1's (printed to 4 decimals; tp-models' `tests/pipeline.rs` checks
//! the logits bit for bit) on SmolLM2 and on a synthetic model of 5 layers (stages of uneven
//! length) with SmolLM2's tokenizer; perplexity is tp 1's to every printed digit; `tp inspect
//! --pp 2 --tp 2` names each rank's stage and layers; an explicit `--pp-layers` split gives
//! the stages it names and tp 1's text; bad values are refused before anything loads; under
//! mpirun each process holds one stage and prints the local text; `tp serve --pp 2` under 6
//! concurrent requests gives each the text a tp 1 server gives it alone, with steps in
//! flight on both stages at once (their compute seconds add up to more than the wall time).

mod common;
use common::TP;
mod serve_util;
use std::time::Duration;
use tp_models::checkpoint::GgmlDType;
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{Checkpoint, GgufCheckpoint};

const DEADLINE: Duration = Duration::from_secs(300);
const PROMPT: &str = "The three primary colors are";
const HELDOUT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/heldout.txt");

fn tp(args: &[&str]) -> common::Finished {
    common::run_with_deadline(TP, args, DEADLINE)
}

/// Greedy text (stdout) and the `--logprobs 2` table (stderr lines without `#`).
fn greedy(model: &str, extra: &[&str]) -> (String, String) {
    let mut args = vec![
        "generate",
        "--model",
        model,
        "--greedy",
        "--max-tokens",
        "24",
        "--logprobs",
        "2",
    ];
    args.extend_from_slice(extra);
    args.push(PROMPT);
    let f = tp(&args);
    assert_eq!(f.code, Some(0), "{extra:?}: {}", f.output);
    let table: Vec<&str> = f.stderr.lines().filter(|l| !l.starts_with('#')).collect();
    assert!(table.len() > 10, "no logprobs table: {}", f.stderr);
    (f.stdout, table.join("\n"))
}

fn assert_layouts_give_tp_1(model: &str, what: &str) {
    let want = greedy(model, &[]);
    assert!(want.0.trim().len() > 5, "{what}: {:?}", want.0);
    for extra in [
        &["--pp", "2"][..],
        &["--pp", "3"],
        &["--pp", "2", "--tp", "2"],
    ] {
        let got = greedy(model, extra);
        assert_eq!(got.0, want.0, "{what} {extra:?}: text differs from tp 1");
        assert_eq!(got.1, want.1, "{what} {extra:?}: logprobs differ from tp 1");
    }
}

/// A synthetic 5-layer model of SmolLM2's vocabulary, with its tokenizer, in `dir`.
fn five_layer_file(dense: &std::path::Path, dir: &std::path::Path) -> std::path::PathBuf {
    let ckpt = GgufCheckpoint::open(dense).unwrap();
    let mut cfg = SyntheticModel::small(tp_models::Arch::Llama, 36).cfg;
    cfg.layers = 5;
    cfg.vocab = ckpt.config().vocab;
    let path = dir.join("five.gguf");
    SyntheticModel::new(cfg, 36)
        .write_gguf_with(
            &path,
            GgufTypes {
                linear: GgmlDType::Q8_0,
                embed: GgmlDType::Q8_0,
            },
            ckpt.tokenizer_metadata(),
        )
        .unwrap();
    path
}

#[test]
fn smollm2_text_and_logprobs_at_pp_2_3_and_2x2_are_tp_1s() {
    let Some(model) = common::smollm2() else {
        return;
    };
    assert_layouts_give_tp_1(&model.to_string_lossy(), "SmolLM2");
}

#[test]
fn an_uneven_five_layer_model_gives_tp_1_text_at_every_layout() {
    let Some(dense) = common::smollm2() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let m = five_layer_file(&dense, dir.path());
    let m = m.to_string_lossy();
    // The stages are uneven: 5 layers over 2 and over 3.
    let f = tp(&["inspect", &m, "--pp", "3"]);
    assert_eq!(f.code, Some(0), "{}", f.output);
    assert!(f.stdout.contains("pp 3 x tp 1"), "{}", f.stdout);
    assert_layouts_give_tp_1(&m, "5 layers");
}

/// `--pp-layers`: the stages `tp inspect` shows are the ones named, and generation at
/// uneven explicit splits (pp 2, pp 3, pp 2 x tp 2) is tp 1's text and log-probabilities.
#[test]
fn explicit_layer_splits_give_their_stages_and_tp_1_text() {
    let Some(dense) = common::smollm2() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let m = five_layer_file(&dense, dir.path());
    let m = m.to_string_lossy();
    let f = tp(&["inspect", &m, "--pp", "3", "--pp-layers", "1,1,3"]);
    assert_eq!(f.code, Some(0), "{}", f.output);
    assert!(
        f.stdout
            .contains("stages     1,1,3 layers, first stage first (as given)"),
        "{}",
        f.stdout
    );
    // Rank 0 is the last stage: layers 2..5 with the head; rank 2 the first, layer 0.
    let row = |r: &str| {
        f.stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(r))
            .unwrap_or_default()
            .to_string()
    };
    assert!(row("0").contains("2..5 +head"), "{}", f.stdout);
    assert!(row("1").contains(" 1..2 "), "{}", f.stdout);
    assert!(row("2").contains("0..1 +emb"), "{}", f.stdout);
    let want = greedy(&m, &[]);
    for extra in [
        &["--pp", "2", "--pp-layers", "4,1"][..],
        &["--pp", "3", "--pp-layers", "1,1,3"],
        &["--pp", "2", "--tp", "2", "--pp-layers", "1,4"],
    ] {
        let got = greedy(&m, extra);
        assert_eq!(got.0, want.0, "{extra:?}: text differs from tp 1");
        assert_eq!(got.1, want.1, "{extra:?}: logprobs differ from tp 1");
    }
}

fn perplexity(model: &str, extra: &[&str]) -> String {
    let mut args = vec!["perplexity", "--model", model, "--window", "128", "-q"];
    args.extend_from_slice(extra);
    args.push(HELDOUT);
    let f = tp(&args);
    assert_eq!(f.code, Some(0), "{}", f.output);
    assert!(f.stdout.contains("perplexity "), "{}", f.stdout);
    f.stdout
}

#[test]
fn perplexity_at_pp_2_and_2x2_is_tp_1s() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy();
    let want = perplexity(&m, &[]);
    for extra in [&["--pp", "2"][..], &["--pp", "2", "--tp", "2"]] {
        assert_eq!(perplexity(&m, extra), want, "{extra:?}");
    }
}

#[test]
fn inspect_names_each_ranks_stage_layers_and_bytes() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy();
    let f = tp(&["inspect", &m, "--pp", "2", "--tp", "2"]);
    assert_eq!(f.code, Some(0), "{}", f.output);
    let out = &f.stdout;
    assert!(out.contains("pp 2 x tp 2: per rank"), "{out}");
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            w.len() > 3 && w[0].parse::<usize>().is_ok() && (w[1] == "0" || w[1] == "1")
        })
        .collect();
    assert_eq!(rows.len(), 4, "{out}");
    // Ranks 0, 1 (the leader's) are the last stage, to layer 30 with the head; 2, 3 are
    // stage 0 from layer 0 with the embedding; both stages' tp ranks split the heads alike.
    for (r, row) in rows.iter().enumerate() {
        let w: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(w[0], r.to_string(), "{row}");
        assert_eq!(w[1], (1 - r / 2).to_string(), "{row}");
        if r >= 2 {
            assert!(w[2].starts_with("0..") && w[3] == "+emb", "{row}");
        } else {
            assert!(w[2].ends_with("..30") && w[3] == "+head", "{row}");
        }
    }
    let cut = |r: usize| rows[r].split_whitespace().nth(2).unwrap().to_string();
    assert_eq!(cut(0), cut(1));
    assert_eq!(cut(2).split("..").nth(1), cut(0).split("..").next());
}

#[test]
fn serve_at_pp_2_under_load_gives_every_request_its_lone_text() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let prompts = [
        "The three primary colors are",
        "Water boils at",
        "A haiku about autumn:",
        "def fibonacci(n):",
        "The capital of Japan is",
        "List three fruits:",
    ];
    let body = |p: &str| serde_json::json!({"prompt": p, "max_tokens": 16, "temperature": 0});
    let ask = |client: &tp_serve::client::Client, p: &str| -> String {
        let r = client.post_json("/v1/completions", &body(p)).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    // The oracle: a tp 1 server, one request at a time.
    let mut alone_server = serve_util::ServerProc::start_with(serve_util::TP, &[], &model, &[]);
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| ask(&alone_server.client, p))
        .collect();
    alone_server.signal("TERM");
    alone_server.wait(Duration::from_secs(60));
    let mut server =
        serve_util::ServerProc::start_with(serve_util::TP, &[], &model, &["--pp", "2"]);
    let before = compute_seconds(&server.client);
    let t0 = std::time::Instant::now();
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let c = server.client.clone();
                let ask = &ask;
                s.spawn(move || ask(&c, p))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let wall = t0.elapsed().as_secs_f64();
    // The ranks' figures are polled once a second: wait for a poll after the load.
    std::thread::sleep(Duration::from_millis(1500));
    let after = compute_seconds(&server.client);
    for (i, p) in prompts.iter().enumerate() {
        assert!(alone[i].len() > 5, "{p}: {:?}", alone[i]);
        assert_eq!(
            together[i], alone[i],
            "{p}: pp 2 under load differs from tp 1 alone"
        );
    }
    assert!(
        server.stderr().contains("pp 2 x tp 1"),
        "{}",
        server.stderr()
    );
    // Steps were in flight on both stages at once: steps launched while another was in
    // flight, and the two stages' compute time adds up to more than the wall time (one
    // step at a time, the stages take turns and it cannot).
    let pipelined = server.metric("tp_pipelined_steps_total").unwrap_or(0.0);
    assert!(pipelined >= 5.0, "{pipelined} pipelined steps");
    // A rank the first poll had not reported yet had computed nothing.
    let at = |v: &[f64], r: usize| v.get(r).copied().unwrap_or(0.0);
    let busy: f64 = (0..after.len())
        .map(|r| at(&after, r) - at(&before, r))
        .sum();
    assert!(
        busy > 1.05 * wall,
        "stages computed {busy:.2} s in {wall:.2} s: no overlap ({before:?} -> {after:?})"
    );
    server.signal("TERM");
    server.wait(Duration::from_secs(60));
}

/// Each rank's compute seconds so far, as the dashboard last polled them.
fn compute_seconds(client: &tp_serve::client::Client) -> Vec<f64> {
    let d = client.get("/dashboard.json").unwrap().json();
    d["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| {
            r["compute_seconds_total"]
                .as_f64()
                .expect("compute seconds")
        })
        .collect()
}

#[test]
fn bad_pp_values_are_refused_before_loading() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy();
    for cmd in [
        &["generate", "--model", &m, "--pp", "31", "hi"][..],
        &["perplexity", "--model", &m, "--pp", "31", HELDOUT],
        &["inspect", &m, "--pp", "31"],
    ] {
        let f = tp(cmd);
        assert_ne!(f.code, Some(0), "{cmd:?}: {}", f.output);
        assert!(
            f.stderr.contains("1 <= pp <= 30") && f.stderr.contains("--pp"),
            "{cmd:?}: {}",
            f.stderr
        );
        assert!(!f.stderr.contains("# load"), "{cmd:?} loaded: {}", f.stderr);
    }
    let f = tp(&["generate", "--model", &m, "--pp", "0", "hi"]);
    assert_ne!(f.code, Some(0), "{}", f.output);
    assert!(f.stderr.contains("1 <= pp <= 30"), "{}", f.stderr);
    let f = tp(&["serve", "--model", &m, "--pp", "31", "--port", "0"]);
    assert_ne!(f.code, Some(0), "{}", f.output);
    assert!(f.stderr.contains("1 <= pp <= 30"), "{}", f.stderr);
}

/// `--pp-layers` that the model or the pipeline cannot take is refused before anything
/// loads, naming a split that fits; malformed values are refused by the parser.
#[test]
fn bad_layer_splits_are_refused_before_loading() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy();
    for (cmd, words) in [
        (
            &["generate", "--model", &m, "--pp", "2", "--pp-layers", "14,10", "hi"][..],
            "covers 24 layers but the model has 30; give 2 layer counts, each at least 1, summing to 30 (e.g. 15,15)",
        ),
        (
            &["perplexity", "--model", &m, "--pp", "3", "--pp-layers", "15,15", HELDOUT],
            "names 2 stage(s) for 3 pipeline stages; give 3 layer counts",
        ),
        (
            &["inspect", &m, "--pp", "2", "--pp-layers", "30,0"],
            "gives stage 1 no layers",
        ),
        (
            &["serve", "--model", &m, "--pp-layers", "15,15", "--port", "0"],
            "names 2 stage(s) for 1 pipeline stages",
        ),
    ] {
        let f = tp(cmd);
        assert_ne!(f.code, Some(0), "{cmd:?}: {}", f.output);
        assert!(
            f.stderr.contains(words) && f.stderr.contains("(--pp, --pp-layers)"),
            "{cmd:?}: {}",
            f.stderr
        );
        assert!(!f.stderr.contains("# load"), "{cmd:?} loaded: {}", f.stderr);
    }
    for (cmd, words) in [
        (
            &[
                "generate",
                "--model",
                &m,
                "--pp",
                "2",
                "--pp-layers",
                "15;15",
                "hi",
            ][..],
            "not whole numbers separated by commas, like 14,10",
        ),
        (
            &["inspect", &m, "--pp", "2", "--pp-last-stage-weight", "0"],
            "not a number from 0.1 to 10",
        ),
        (
            &[
                "generate",
                "--model",
                &m,
                "--pp",
                "2",
                "--pp-layers",
                "15,15",
                "--pp-last-stage-weight",
                "2",
                "hi",
            ],
            "cannot be used with",
        ),
    ] {
        let f = tp(cmd);
        assert_eq!(f.code, Some(2), "{cmd:?}: {}", f.output);
        assert!(f.stderr.contains(words), "{cmd:?}: {}", f.stderr);
    }
}

/// `mpirun -n 2 tp generate --backend mpi --pp 2`: one stage per process, tp 1's text; a
/// world that pp x tp does not make is refused naming the valid values.
#[cfg(feature = "mpi")]
#[test]
fn pp_under_mpirun_gives_the_local_text() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy().to_string();
    let want = greedy(&m, &[]);
    let args = |extra: &[&'static str]| {
        let mut a = vec![
            "generate".to_string(),
            "--backend".into(),
            "mpi".into(),
            "--model".into(),
            m.clone(),
            "--greedy".into(),
            "--max-tokens".into(),
            "24".into(),
            "--logprobs".into(),
            "2".into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a.push(PROMPT.into());
        a
    };
    for (n, extra) in [
        (2, &["--pp", "2"][..]),
        (4, &["--pp", "2", "--tp", "2"]),
        (2, &["--pp", "2", "--pp-layers", "26,4"]),
    ] {
        let a = args(extra);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let got = common::mpirun_tp(n, &a, DEADLINE);
        assert_eq!(got.code, Some(0), "{extra:?}: {}", got.output);
        assert_eq!(got.stdout, want.0, "mpirun {extra:?} differs from tp 1");
        let table: Vec<&str> = got.stderr.lines().filter(|l| !l.starts_with('#')).collect();
        assert!(
            table.join("\n").contains(&want.1),
            "{extra:?}: {}",
            got.stderr
        );
        assert!(got.stderr.contains("stage 1 layers"), "{}", got.stderr);
    }
    let a = args(&["--pp", "2"]);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let bad = common::mpirun_tp(3, &a, DEADLINE);
    assert_ne!(bad.code, Some(0), "{}", bad.output);
    assert!(
        bad.output.contains("use a pp that divides 3 (valid: 1, 3)"),
        "{}",
        bad.output
    );
}

/// Seeded top-k/top-p sampling with `--logprobs 3` at pp 2 x tp 2: the text and table from
/// each rank's candidates (the last stage's tp group merges them) are those of the gathered
/// rows (`TP_GATHER_LOGITS=1`).
#[test]
fn sampling_from_candidates_is_the_gathered_paths_at_pp_2_tp_2() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let model = model.to_string_lossy().to_string();
    let run = |gather: &str| {
        let f = common::run(
            std::process::Command::new(TP)
                .env("TP_GATHER_LOGITS", gather)
                .args(["generate", "--model", &model, "--pp", "2", "--tp", "2"])
                .args(common::SEEDED_SAMPLING)
                .arg(PROMPT),
            DEADLINE,
        );
        common::text_and_logprobs(&f)
    };
    let want = run("1");
    assert!(want.0.trim().len() > 5 && want.1.len() > 10, "{want:?}");
    assert_eq!(run("0"), want);
}
