//! `tp generate` end to end on the real SmolLM2: greedy text identical at every tp (R10), the
//! known continuation, and a clear error for every bad input (never a panic, never a hang).

mod common;
use std::time::Duration;

const TP: &str = env!("CARGO_BIN_EXE_tp");
const DEADLINE: Duration = Duration::from_secs(300);

fn tp(args: &[&str]) -> common::Finished {
    common::run_with_deadline(TP, args, DEADLINE)
}

fn greedy(model: &str, tp_size: usize, prompt: &str, tokens: usize) -> String {
    let n = tp_size.to_string();
    let t = tokens.to_string();
    let f = tp(&[
        "generate",
        "--model",
        model,
        "--tp",
        &n,
        "--greedy",
        "--max-tokens",
        &t,
        "-q",
        prompt,
    ]);
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

#[test]
fn known_continuation_of_the_smoke_prompt() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let text = greedy(&model.to_string_lossy(), 1, PROMPTS[0], 8);
    assert!(
        text.starts_with(" girl named Emma who loved to play"),
        "{text:?}"
    );
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
                "350MB",
                "hi",
            ],
            "the smallest tp that fits is 2",
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
        // allocates (4e9 used to abort allocating the RoPE table, u64::MAX to panic).
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
