//! `tp generate --spec ngram` end to end on the real SmolLM2: greedy text identical to plain
//! decoding at tp 1 and 2 (local ranks) and under `mpirun -n 2`, seeded sampling equal to plain,
//! and errors that name the flag and its valid values for bad speculation flags.

mod common;
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
