//! `tp generate` end to end on the real SmolLM2: greedy text identical at every tp (R10), the
//! known continuation, and a clear error for every bad input (never a panic, never a hang).

mod common;
use common::TP;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(300);

fn tp(args: &[&str]) -> common::Finished {
    common::run_with_deadline(TP, args, DEADLINE)
}

fn greedy(model: &str, tp_size: usize, prompt: &str, tokens: usize) -> String {
    greedy_with(model, tp_size, prompt, tokens, &[])
}

fn greedy_with(model: &str, tp_size: usize, prompt: &str, tokens: usize, extra: &[&str]) -> String {
    let n = tp_size.to_string();
    let t = tokens.to_string();
    let mut args = vec![
        "generate",
        "--model",
        model,
        "--tp",
        &n,
        "--greedy",
        "--max-tokens",
        &t,
        "-q",
    ];
    args.extend_from_slice(extra);
    args.push(prompt);
    let f = tp(&args);
    assert_eq!(f.code, Some(0), "tp {tp_size}: {}", f.output);
    f.stdout
}

/// Prompts of different kinds; 48 greedy tokens each.
const PROMPTS: [&str; 4] = [
    "Once upon a time, there was a little",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "Photosynthesis is the process by which",
];

#[test]
fn greedy_text_is_identical_at_tp_1_to_4() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let model = model.to_string_lossy().to_string();
    for prompt in PROMPTS {
        let want = greedy(&model, 1, prompt, 48);
        assert!(
            want.trim().len() > 20,
            "too little text for {prompt:?}: {want:?}"
        );
        for tp_size in 2..=4 {
            let got = greedy(&model, tp_size, prompt, 48);
            assert_eq!(got, want, "tp {tp_size} differs from tp 1 for {prompt:?}");
        }
    }
}

/// The continuation docs/models.md gives (llama.cpp's too), with the exact numerics (f32
/// weights and cache), where it is the model's: " loved" leads " lived" by 0.09 nats. The
/// quantized kernels' 8-bit activations move these two by about 0.1 nats whichever way their
/// roundings fall (llama.cpp: 0.04 ahead; f16 against f32 cache: 0.1 apart), so on the
/// default path only the words before that near tie are pinned.
#[test]
fn known_continuation_of_the_smoke_prompt() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let model = model.to_string_lossy();
    let exact = ["--dequantize", "--kv-dtype", "f32"];
    let text = greedy_with(&model, 1, PROMPTS[0], 8, &exact);
    assert!(
        text.starts_with(" girl named Emma who loved to play"),
        "{text:?}"
    );
    let text = greedy(&model, 1, PROMPTS[0], 8);
    assert!(text.starts_with(" girl named Emma who"), "{text:?}");
}

/// Gemma-3-270M (opt-in): one KV head, so tp 2..4 all replicate it; 5 of every 6 layers
/// attend through a window of 512, which the longer prompt crosses. Greedy text is identical
/// at every tp, and the story prompt continues as the independent numpy reference of
/// docs/models.md does.
#[test]
fn gemma3_greedy_text_is_identical_at_tp_1_to_4_and_matches_the_reference() {
    let Some(model) = common::gemma3() else {
        return;
    };
    let model = model.to_string_lossy().to_string();
    // The reference's continuation with exact numerics (f32 weights), at tp 1 and 4; on the
    // default path " named" and " who" are 0.1 nats apart after " girl", so only " girl" is
    // pinned there (see the SmolLM2 smoke test).
    let story = "Once upon a time there was a little";
    for tp_size in [1, 4] {
        let text = greedy_with(&model, tp_size, story, 12, &["--dequantize"]);
        assert!(
            text.starts_with(" girl named Mary. She was a very pretty girl, and"),
            "tp {tp_size}: {text:?}"
        );
    }
    let text = greedy(&model, 1, story, 12);
    assert!(text.starts_with(" girl"), "{text:?}");
    let long = PROMPTS[1].repeat(40); // ~1000 tokens: past the window of 512
    for prompt in [PROMPTS[2], long.as_str()] {
        let want = greedy(&model, 1, prompt, 24);
        assert!(want.trim().len() > 10, "too little text: {want:?}");
        for tp_size in 2..=4 {
            let got = greedy(&model, tp_size, prompt, 24);
            assert_eq!(got, want, "tp {tp_size} differs from tp 1");
        }
    }
}

/// One row of the `--logprobs` table: the token's text, its log-probability and the
/// alternatives with theirs.
type LogprobRow = (String, f64, Vec<(String, f64)>);

/// A JSON string at the start of `s` and the rest after it.
fn json_string(s: &str) -> (String, &str) {
    let mut it = serde_json::Deserializer::from_str(s).into_iter::<String>();
    let text = it.next().expect("a token").expect("a JSON string");
    (text, &s[it.byte_offset()..])
}

/// The rows of the `--logprobs` table on stderr.
fn logprob_rows(stderr: &str) -> Vec<LogprobRow> {
    let mut rows = Vec::new();
    let mut lines = stderr.lines().skip_while(|l| !l.starts_with("# logprobs:"));
    assert!(lines.next().is_some(), "no logprobs table in: {stderr}");
    for line in lines {
        let line = line.trim_start();
        let Some((index, rest)) = line.split_once("  ") else {
            continue;
        };
        if index.parse::<usize>() != Ok(rows.len()) {
            continue;
        }
        let (token, rest) = json_string(rest.trim_start());
        let rest = rest.trim_start();
        let (logprob, mut rest) = rest.split_once(' ').unwrap_or((rest, ""));
        let logprob: f64 = logprob.parse().expect("a logprob");
        let mut alternatives = Vec::new();
        loop {
            rest = rest.trim_start();
            if rest.is_empty() {
                break;
            }
            let (alt, after) = json_string(rest);
            let after = after.strip_prefix('=').expect("token=logprob");
            let (value, after) = after.split_once(' ').unwrap_or((after, ""));
            alternatives.push((alt, value.parse().expect("an alternative's logprob")));
            rest = after;
        }
        rows.push((token, logprob, alternatives));
    }
    rows
}

#[test]
fn logprobs_and_penalties_on_smollm2() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let m = model.to_string_lossy().to_string();
    let prompt = "Repeat after me: cat cat cat cat cat cat cat cat";
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            &m,
            "--greedy",
            "--max-tokens",
            "24",
            "-q",
        ];
        args.extend_from_slice(extra);
        args.push(prompt);
        let f = tp(&args);
        assert_eq!(f.code, Some(0), "{extra:?}: {}", f.output);
        f
    };
    let plain = run(&["--logprobs", "3"]);
    let penalized = run(&["--logprobs", "3", "--frequency-penalty", "0.5"]);
    assert_ne!(
        plain.stdout, penalized.stdout,
        "a frequency penalty of 0.5 left the text of a repeating prompt unchanged"
    );
    for (f, penalty) in [(&plain, false), (&penalized, true)] {
        let rows = logprob_rows(&f.stderr);
        assert_eq!(rows.len(), 24, "{}", f.stderr);
        // The tokens' texts are the answer's text.
        let text: String = rows.iter().map(|r| r.0.as_str()).collect();
        assert_eq!(text, f.stdout.trim_end_matches('\n'), "{}", f.stderr);
        for (token, logprob, alternatives) in &rows {
            assert!(*logprob <= 0.0, "{token:?}: {logprob}");
            assert_eq!(alternatives.len(), 3, "{token:?}");
            assert!(alternatives.windows(2).all(|w| w[0].1 >= w[1].1));
            assert!(alternatives.iter().all(|a| a.1 <= 0.0));
            // Greedy on the raw distribution picks its top token; with a penalty the most
            // likely raw token is at least as likely as the one picked.
            assert!(alternatives[0].1 >= *logprob, "{token:?}");
            if !penalty {
                assert_eq!(&alternatives[0].0, token);
            }
        }
        if penalty {
            // The penalty made the decoder pass over the raw favourite at least once.
            assert!(
                rows.iter().any(|(t, _, alts)| &alts[0].0 != t),
                "{}",
                f.stderr
            );
        }
    }
}

/// Runs a command that must fail cleanly (exit code 2 for a refusal before any rank starts, 1
/// for one found by a rank) with an error containing `want`.
fn refuses(args: &[&str], want: &str) {
    let f = tp(args);
    assert!(
        matches!(f.code, Some(1 | 2)),
        "{args:?} should fail cleanly: {}",
        f.output
    );
    assert!(
        f.stderr.contains(want),
        "{args:?}: expected {want:?} in: {}",
        f.stderr
    );
    assert!(
        !f.output.contains("panicked"),
        "{args:?} panicked: {}",
        f.output
    );
}

#[test]
fn bad_inputs_get_clear_errors() {
    let dir = std::env::temp_dir().join(format!("tp-generate-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing.gguf");
    refuses(
        &["generate", "--model", &missing.to_string_lossy(), "hi"],
        "does not exist",
    );
    let text = dir.join("notes.txt");
    std::fs::write(&text, "not a model at all").unwrap();
    refuses(
        &["generate", "--model", &text.to_string_lossy(), "hi"],
        "GGUF",
    );
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    refuses(
        &["generate", "--model", &empty.to_string_lossy(), "hi"],
        "empty",
    );
    refuses(
        &["generate", "--model", &missing.to_string_lossy(), ""],
        "prompt is empty",
    );
    refuses(&["generate", "--temperature=-1", "hi"], "temperature");
    refuses(&["generate", "--top-p", "0", "hi"], "--top-p");
    refuses(
        &["generate", "--presence-penalty", "2.5", "hi"],
        "--presence-penalty",
    );
    refuses(
        &["generate", "--frequency-penalty=-3", "hi"],
        "--frequency-penalty",
    );
    refuses(&["generate", "--logprobs", "21", "hi"], "--logprobs");
    if let Some(model) = common::smollm2() {
        let m = model.to_string_lossy();
        // A truncated copy of the real file.
        let cut = dir.join("cut.gguf");
        let bytes = std::fs::read(&model).unwrap();
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        refuses(
            &["generate", "--model", &cut.to_string_lossy(), "hi"],
            "truncated",
        );
        refuses(
            &["generate", "--model", &m, "--tp", "12", "hi"],
            "use 1 <= tp <= 9",
        );
        refuses(
            &["generate", "--model", &m, "--tp", "0", "hi"],
            "--tp must be at least 1",
        );
        refuses(
            &[
                "generate",
                "--model",
                &m,
                "--tp",
                "1",
                "--max-rank-memory",
                "250MB",
                "--max-tokens",
                "8000",
                "hi",
            ],
            "the smallest tp that fits is 2",
        );
        // ... and what fits at the tp asked for: fewer positions.
        refuses(
            &[
                "generate",
                "--model",
                &m,
                "--max-rank-memory",
                "250MB",
                "--max-tokens",
                "8000",
                "hi",
            ],
            "or at tp 1, a prompt and --max-tokens of ",
        );
        // A chat is priced at its context (a conversation grows to it): the largest context
        // that fits is named.
        refuses(
            &[
                "chat",
                "--model",
                &m,
                "--ctx-size",
                "8192",
                "--max-rank-memory",
                "120MB",
            ],
            "or at tp 1, --ctx-size ",
        );
        // The preflight prices the blocks this run can hold (the prompt and --max-tokens), not
        // the whole context: 250 MB holds the weights and one block at tp 1 ("hi" is one token),
        // though not the 8192 positions of SmolLM2's context.
        let f = tp(&[
            "generate",
            "--model",
            &m,
            "--tp",
            "1",
            "--max-rank-memory",
            "250MB",
            "--max-tokens",
            "4",
            "--greedy",
            "hi",
        ]);
        assert_eq!(f.code, Some(0), "{}", f.output);
        assert!(
            f.stderr.contains("(5 positions at most"),
            "the start-up report prices the positions held: {}",
            f.stderr
        );
        refuses(
            &[
                "generate",
                "--model",
                &m,
                "--ctx-size",
                "4",
                "one two three four five six",
            ],
            "context",
        );
        // Issue 18: contexts too large to hold are refused with their cost, before any rank
        // allocates (4e9 used to abort allocating a RoPE table, u64::MAX to panic).
        for ctx in ["4000000000", "18446744073709551615"] {
            let start = std::time::Instant::now();
            let f = tp(&["generate", "--model", &m, "--ctx-size", ctx, "hi"]);
            assert!(
                f.code == Some(2) && f.output.contains(ctx) && f.output.contains("bytes"),
                "--ctx-size {ctx}: {}",
                f.output
            );
            assert!(!f.output.contains("panicked"), "{}", f.output);
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{:?}",
                start.elapsed()
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
