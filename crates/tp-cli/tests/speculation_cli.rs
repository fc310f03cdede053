//! `tp generate --spec ngram` end to end on the real SmolLM2: greedy text identical to plain
//! decoding at tp 1 and 2 (local ranks) and under `mpirun -n 2`, seeded sampling equal to plain,
//! and errors that name the flag and its valid values for bad speculation flags; a draft model
//! in the memory preflight (reported, refused past --max-rank-memory, a server's KV budget
//! split between the two pools).

mod common;
mod serve_util;
use common::TP;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(300);

/// A prompt whose answer quotes it: long accepted runs.
const QUOTE: &str =
    "Repeat this list exactly: apples, bananas, cherries, dates, figs, grapes, kiwis, \
lemons. Now repeat the same list exactly: apples, bananas,";

fn generate(model: &str, extra: &[&str]) -> common::Finished {
    let mut args = vec!["generate", "--model", model, "--max-tokens", "40"];
    args.extend_from_slice(extra);
    args.push(QUOTE);
    common::run_with_deadline(TP, &args, DEADLINE)
}

fn ok_stdout(f: &common::Finished) -> String {
    assert_eq!(f.code, Some(0), "{}", f.output);
    f.stdout.clone()
}

#[test]
fn greedy_text_is_unchanged_by_ngram_speculation() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let model = model.to_string_lossy().to_string();
    let want = ok_stdout(&generate(&model, &["--greedy", "-q"]));
    assert!(want.trim().len() > 20, "{want:?}");
    for (tp, k) in [("1", None), ("1", Some("8")), ("2", None), ("2", Some("3"))] {
        let mut args = vec!["--greedy", "--tp", tp, "--spec", "ngram"];
        if let Some(k) = k {
            args.extend(["--draft-tokens", k]);
        }
        let f = generate(&model, &args);
        assert_eq!(ok_stdout(&f), want, "tp {tp}, --draft-tokens {k:?}");
        // The report says what speculation did.
        assert!(f.stderr.contains("# speculation: "), "{}", f.stderr);
    }
}

/// Sampling with a seed: speculation draws one random number per token as plain decoding
/// does and keeps a draft only when the sampled token is the draft, so the text is plain
/// sampling's with that seed (at tp 1 and 2), and repeats.
#[test]
fn seeded_speculative_sampling_is_plain_sampling() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let model = model.to_string_lossy().to_string();
    let seeded = ["--temperature", "0.7", "--seed", "5", "-q"];
    let want = ok_stdout(&generate(&model, &seeded));
    for extra in [
        vec!["--spec", "ngram"],
        vec!["--spec", "ngram", "--draft-tokens", "6"],
        vec!["--spec", "ngram", "--tp", "2"],
    ] {
        let mut args = seeded.to_vec();
        args.extend(extra.iter().copied());
        assert_eq!(ok_stdout(&generate(&model, &args)), want, "{extra:?}");
    }
}

#[test]
fn bad_speculation_flags_name_the_flag_and_the_valid_values() {
    // Checked before any model is read: a missing model file would be another error.
    for (args, want) in [
        (
            vec!["--spec", "ngram", "--draft-tokens", "0"],
            "--draft-tokens",
        ),
        (vec!["--spec", "ngram", "--draft-tokens", "33"], "1 to 32"),
        (vec!["--spec", "medusa"], "ngram"),
        (vec!["--draft-tokens", "4"], "--spec ngram"),
        (
            vec!["--spec", "ngram", "--draft-model", "/x.gguf"],
            "give one of them",
        ),
        (
            vec!["--draft-ahead", "on"],
            "--draft-ahead needs --spec ngram",
        ),
        (
            vec!["--spec", "ngram", "--draft-ahead", "maybe"],
            "auto, on, off",
        ),
    ] {
        let mut all = vec!["generate", "--model", "/nonexistent/model.gguf"];
        all.extend_from_slice(&args);
        all.push("hello");
        let f = common::run_with_deadline(TP, &all, Duration::from_secs(30));
        assert_ne!(f.code, Some(0), "{args:?} was accepted");
        assert!(!f.output.contains("panicked"), "{}", f.output);
        assert!(f.stderr.contains(want), "{args:?}: {}", f.stderr);
    }
}

/// `tp chat --spec ngram`: two turns (the second reuses the first's cache and the drafter
/// sees the whole conversation) print the plain chat's text.
#[test]
fn chat_with_speculation_prints_the_plain_text() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let chat = |extra: &str| {
        let script = format!(
            "printf 'Repeat exactly: red, green, blue, yellow.\\nAgain, exactly the same.\\n' | {TP} chat --model '{}' --greedy --max-tokens 30 -q {extra}",
            model.display()
        );
        ok_stdout(&common::run_with_deadline(
            "bash",
            &["-c", &script],
            DEADLINE,
        ))
    };
    let want = chat("");
    // Two replies, then the prompt that met the end of input.
    assert!(want.matches("> ").count() >= 3, "{want:?}");
    assert_eq!(chat("--spec ngram"), want);
    assert_eq!(chat("--spec ngram --draft-tokens 4 --tp 2"), want);
}

/// A draft model whose vocabulary is not the target's: an error naming the flag and what
/// differs (Qwen2.5-Coder-0.5B drafting for SmolLM2), no panic.
#[test]
fn a_draft_model_with_another_vocabulary_is_an_error() {
    let (Some(model), Some(qwen)) = (common::smollm2(), tp_testkit::qwen25()) else {
        return;
    };
    let (model, qwen) = (model.to_string_lossy(), qwen.to_string_lossy());
    let f = generate(&model, &["--draft-model", &qwen, "--greedy"]);
    assert_ne!(f.code, Some(0));
    assert!(!f.output.contains("panicked"), "{}", f.output);
    assert!(
        f.stderr.contains("--draft-model") && f.stderr.contains("another vocabulary"),
        "{}",
        f.stderr
    );
}

/// `mpirun -n 2 tp generate --spec ngram --backend mpi`: the plain greedy text.
#[cfg(feature = "mpi")]
#[test]
fn greedy_speculation_under_mpirun_matches_plain() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let model = model.to_string_lossy().to_string();
    let want = ok_stdout(&generate(&model, &["--greedy", "-q"]));
    let args = [
        "generate",
        "--model",
        &model,
        "--max-tokens",
        "40",
        "--greedy",
        "-q",
        "--spec",
        "ngram",
        "--backend",
        "mpi",
        QUOTE,
    ];
    let got = common::mpirun_tp(2, &args, DEADLINE);
    assert_eq!(ok_stdout(&got), want, "mpirun -n 2 with --spec ngram");
}

/// Megabytes in a size as the reports show it ("105.3 MB").
fn mb(shown: &str) -> f64 {
    let (n, unit) = shown.trim().split_once(' ').expect("a number and a unit");
    let n: f64 = n.parse().unwrap();
    match unit {
        "GB" => n * 1e3,
        "MB" => n,
        "kB" => n / 1e3,
        _ => n / 1e6,
    }
}

/// `--draft-model` in the memory preflight (SmolLM2 drafting for itself): the report has a
/// line on what the draft takes on rank 0 and the text is the plain greedy one (its pool
/// bounded by the plan); a --max-rank-memory the target fits alone but not beside the draft is
/// refused before loading, naming the bytes and what to do; `tp serve --max-kv-memory` gives
/// the draft's pool as many blocks as the target's and says so.
#[test]
fn the_draft_model_is_in_the_memory_preflight() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy().to_string();
    let want = ok_stdout(&generate(&m, &["--greedy", "-q"]));
    let f = generate(&m, &["--greedy", "--draft-model", &m]);
    assert_eq!(ok_stdout(&f), want);
    // Drafting ahead on another thread while the model verifies (forced on: the test
    // machine may have one core): the same text, and the drafts made ahead are used (the
    // draft is the model itself, so every draft and every guess is right).
    let ahead = generate(
        &m,
        &["--greedy", "--draft-model", &m, "--draft-ahead", "on"],
    );
    assert_eq!(ok_stdout(&ahead), want);
    let used = ahead
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("# speculation: drafted ahead during "))
        .and_then(|l| l.rsplit("used in ").next())
        .and_then(|n| n.trim().parse::<usize>().ok());
    assert!(used.is_some_and(|n| n > 0), "{}", ahead.stderr);
    let off = generate(
        &m,
        &["--greedy", "--draft-model", &m, "--draft-ahead", "off"],
    );
    assert_eq!(ok_stdout(&off), want);
    assert!(!off.stderr.contains("drafted ahead"), "{}", off.stderr);
    let line = |start: &str| {
        f.stderr
            .lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no {start:?} line in {}", f.stderr))
            .to_string()
    };
    let draft = line("# draft model ");
    assert!(
        draft.contains("on rank 0:") && draft.contains("blocks of 32 positions at most"),
        "{draft}"
    );
    // The target alone: its rank 0 line's total; 1 MB more is room for it but not the draft.
    let target = mb(line("# rank 0:").rsplit("= ").next().unwrap());
    let limit = format!("{:.1}MB", target + 1.0);
    let alone = generate(&m, &["--greedy", "-q", "--max-rank-memory", &limit]);
    assert_eq!(ok_stdout(&alone), want);
    let refused = generate(
        &m,
        &[
            "--greedy",
            "-q",
            "--draft-model",
            &m,
            "--max-rank-memory",
            &limit,
        ],
    );
    assert_ne!(refused.code, Some(0), "{}", refused.output);
    assert!(!refused.output.contains("panicked"), "{}", refused.output);
    for words in [
        "rank 0 needs",
        "with the --draft-model",
        "of weights and",
        "--max-rank-memory is",
        "use a smaller --draft-model",
        "or no --draft-model",
    ] {
        assert!(
            refused.stderr.contains(words),
            "{words:?}: {}",
            refused.stderr
        );
    }
    // `tp inspect --draft-model`: the same line, for a pool of --ctx-size positions.
    let inspect = common::tp(
        &["inspect", &m, "--ctx-size", "64", "--draft-model", &m],
        DEADLINE,
    );
    let row = ok_stdout(&inspect)
        .lines()
        .find(|l| l.starts_with("draft      draft model "))
        .map(str::to_string)
        .unwrap_or_else(|| panic!("no draft line in {}", inspect.stdout));
    let weights = |l: &str| {
        l.split(" weights")
            .next()
            .unwrap()
            .rsplit(": ")
            .next()
            .unwrap()
            .to_string()
    };
    assert!(row.contains("(2 blocks of 32 positions at most"), "{row}");
    assert_eq!(weights(&row), weights(&draft), "{row}\n{draft}");
    // A server: one budget, the same blocks for both pools (12 MB: 8 of each). Four
    // requests with one prompt decode together (all of them draft): the target shares the
    // prompt's first block between them, the drafts' caches do not, so the draft pool (3
    // blocks a request) runs full and requests decode on without drafts; every text is still
    // the plain greedy one.
    let mut server = serve_util::ServerProc::start_with(
        serve_util::TP,
        &[],
        &model,
        &[
            "--draft-model",
            &m,
            "--max-kv-memory",
            "12MB",
            "--ctx-size",
            "512",
            "--spec-max-batch",
            "4",
        ],
    );
    let body = serde_json::json!({"prompt": QUOTE, "max_tokens": 40, "temperature": 0});
    let texts: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let (c, body) = (server.client.clone(), body.clone());
                s.spawn(move || {
                    let r = c.post_json("/v1/completions", &body).unwrap();
                    assert_eq!(r.status, 200, "{}", r.text());
                    r.json()["choices"][0]["text"].as_str().unwrap().to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for text in &texts {
        assert!(
            text.len() > 20 && want.starts_with(text.as_str()),
            "{text:?} is not how {want:?} starts"
        );
    }
    assert!(
        server
            .metric("tp_spec_accepted_tokens_total")
            .unwrap_or(0.0)
            > 0.0
    );
    let full = server.metric("tp_spec_draft_kv_full_total").unwrap_or(0.0);
    eprintln!("the draft pool was full in {full} request steps");
    assert!(full > 0.0, "the draft pool never ran full");
    assert_eq!(server.metric("tp_spec_draft_errors_total"), Some(0.0));
    let stderr = server.stderr();
    let blocks = |prefix: &str, before: &str| -> usize {
        let l = stderr
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} line in {stderr}"));
        let head = l.split(before).next().unwrap();
        head.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let target_blocks = blocks("# KV budget: ", " blocks of 32 positions");
    let draft_blocks = blocks("# KV budget with --draft-model: ", " blocks of the draft");
    assert_eq!(target_blocks, draft_blocks, "{stderr}");
    // 12 MB pays for 8 blocks of each (SmolLM2's f16 block: 0.74 MB), not 16 of one.
    assert_eq!(target_blocks, 8, "{stderr}");
    server.signal("TERM");
    server.wait(Duration::from_secs(60));
}

/// `mpirun -n 2` with `--draft-model`: every process prices the draft (rank 0 holds it), so
/// the text is the plain greedy one, and a --max-rank-memory the tp 2 target fits alone but
/// not beside the draft is refused by every process before loading (no rank waits for another).
#[cfg(feature = "mpi")]
#[test]
fn a_draft_model_under_mpirun() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy().to_string();
    let want = ok_stdout(&generate(&m, &["--greedy", "-q"]));
    let args = |extra: &[&'static str]| {
        let mut a = vec![
            "generate",
            "--model",
            &m,
            "--max-tokens",
            "40",
            "--greedy",
            "-q",
            "--draft-model",
            &m,
            "--backend",
            "mpi",
        ];
        a.extend_from_slice(extra);
        a.push(QUOTE);
        a
    };
    let got = common::mpirun_tp(2, &args(&[]), DEADLINE);
    assert_eq!(ok_stdout(&got), want, "mpirun -n 2 with --draft-model");
    // At tp 2 each rank holds about 50 MB of SmolLM2; the draft is 97 MB more on rank 0.
    let refused = common::mpirun_tp(2, &args(&["--max-rank-memory", "80MB"]), DEADLINE);
    assert_ne!(refused.code, Some(0), "{}", refused.output);
    assert!(
        refused.stderr.contains("with the --draft-model") && !refused.output.contains("panicked"),
        "{}",
        refused.output
    );
}
