//! A mixture-of-experts model end to end: SmolLM2 cut into 8 equal experts (every expert
//! active with weight 1/8, its down projection times 8: the dense function, see
//! `SyntheticModel::dense_as_experts`) written as a GGUF with SmolLM2's tokenizer, then
//! `tp generate` at tp 2 with expert parallelism 2 and 1 must print dense SmolLM2's greedy
//! text and `tp perplexity` its mean NLL, `tp inspect` lists each rank's experts, `tp bench
//! decode` counts the tokens of each expert and each rank's expert rows, and an
//! expert-parallel size that does not divide tp is refused before anything loads; `tp serve`
//! over two pipeline stages reports the tokens routed to each expert on `/metrics`. Under
//! `--moe-capacity-factor` the dropped pairs are counted in `tp bench decode --json` and
//! `/metrics`, and a bad factor or one given for a dense model is refused.

mod common;
mod serve_util;
use std::time::Duration;
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::GgufCheckpoint;

const LIMIT: Duration = Duration::from_secs(300);

/// SmolLM2 as 8 experts in `dir`, with the dense file's tokenizer metadata.
/// The JSON row of `tp bench decode` on `moe` at tp 2 x ep 2 (a 4-token prompt, `gen`
/// tokens, one run) with `extra` flags.
fn bench_decode_row(moe: &str, extra: &[&str], gen: usize) -> serde_json::Value {
    let gen = gen.to_string();
    let mut args = vec![
        "bench",
        "decode",
        "--model",
        moe,
        "--tps",
        "2",
        "--ep",
        "2",
        "--prompt-tokens",
        "4",
        "--gen-tokens",
        &gen,
        "--repeats",
        "1",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = common::tp(&args, LIMIT);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    out.stdout
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON row in {}", out.stdout))
}

fn moe_file(dense: &std::path::Path, dir: &std::path::Path) -> std::path::PathBuf {
    let ckpt = GgufCheckpoint::open(dense).unwrap();
    let moe = SyntheticModel::dense_as_experts(&ckpt, 8).unwrap();
    let tokenizer = ckpt.tokenizer_metadata();
    let path = dir.join("smollm2-8x.gguf");
    moe.write_gguf_with(&path, GgufTypes::F32, tokenizer)
        .unwrap();
    path
}

#[test]
fn smollm2_as_eight_experts_generates_dense_text_at_every_expert_layout() {
    let Some(dense) = common::smollm2() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let moe = moe_file(&dense, dir.path());
    let moe = moe.to_string_lossy();
    let gen = |model: &str, extra: &[&str]| -> String {
        let mut args = vec![
            "generate",
            "--model",
            model,
            "--greedy",
            "--max-tokens",
            "16",
        ];
        args.extend_from_slice(extra);
        args.push("The capital of France is");
        let out = common::tp(&args, LIMIT);
        assert_eq!(out.code, Some(0), "{args:?}: {}", out.stderr);
        out.stdout
    };
    // The dense reference with exact numerics (the MoE file is f32).
    let want = gen(&dense.to_string_lossy(), &["--dequantize", "--tp", "1"]);
    assert!(!want.trim().is_empty());
    for extra in [["--tp", "2", "--ep", "2"], ["--tp", "2", "--ep", "1"]] {
        assert_eq!(gen(&moe, &extra), want, "{extra:?}");
    }
    let out = common::tp(
        &["inspect", "--model", &moe, "--tp", "4", "--ep", "2"],
        LIMIT,
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    for line in [
        "experts    8 of FFN 192, 8 per token",
        "experts per rank (expert-parallel size 2)",
        "   0  experts 0..4 (4 of 8), FFN columns 0..96 of each",
        "   3  experts 4..8 (4 of 8), FFN columns 96..192 of each",
    ] {
        assert!(
            out.stdout.contains(line),
            "{line:?} not in:\n{}",
            out.stdout
        );
    }
    // Perplexity: the same mean NLL line as dense SmolLM2 with exact numerics.
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. ".repeat(12),
    )
    .unwrap();
    let text = text.to_string_lossy();
    let nll = |args: &[&str]| -> String {
        let out = common::tp(args, LIMIT);
        assert_eq!(out.code, Some(0), "{args:?}: {}", out.stderr);
        out.output
            .lines()
            .find(|l| l.contains("mean NLL"))
            .unwrap_or_default()
            .to_string()
    };
    let dense_nll = nll(&[
        "perplexity",
        "--model",
        &dense.to_string_lossy(),
        "--dequantize",
        &text,
    ]);
    assert!(dense_nll.contains("mean NLL"), "{dense_nll}");
    assert_eq!(
        nll(&[
            "perplexity",
            "--model",
            &moe,
            "--tp",
            "2",
            "--ep",
            "2",
            &text
        ]),
        dense_nll
    );
    // Expert load in `tp bench decode`: every token reaches all 8 experts in each of
    // SmolLM2's 30 layers, so 4 decode steps route 120 tokens to each expert, and the two
    // ranks of --ep 2 compute the same number of rows (max over mean 1).
    let row = bench_decode_row(&moe, &[], 5);
    assert_eq!(
        row["expert_tokens"],
        serde_json::json!(vec![120; 8]),
        "{row}"
    );
    assert_eq!(row["expert_rank_load"].as_f64(), Some(1.0), "{row}");
    // `/metrics` of a server at tp 2 x ep 2 over 2 pipeline stages: every
    // token a forward takes reaches all 8 experts in all 30 layers, counted once per layer
    // whichever stage and rank hold it. A request forwards its prompt and each generated
    // token but the last.
    let server = serve_util::ServerProc::start_with(
        serve_util::TP,
        &[],
        std::path::Path::new(&*moe),
        &["--tp", "2", "--ep", "2", "--pp", "2"],
    );
    let body = serde_json::json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let r = server.client.post_json("/v1/completions", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let usage = &r.json()["usage"];
    let forwarded =
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap() - 1;
    let want = (30 * forwarded) as f64;
    let series = |e: usize| format!("tp_expert_tokens_total{{expert=\"{e}\"}}");
    let text = server.wait_metrics(Duration::from_secs(30), |t| {
        serve_util::metric_value(t, &series(7)) == Some(want)
    });
    for e in 0..8 {
        assert_eq!(
            serve_util::metric_value(&text, &series(e)),
            Some(want),
            "expert {e}:\n{text}"
        );
    }
    drop(server);
    let out = common::tp(
        &["generate", "--model", &moe, "--tp", "2", "--ep", "3", "hi"],
        LIMIT,
    );
    assert_ne!(out.code, Some(0));
    assert!(
        out.stderr.contains("must divide tp") && out.stderr.contains("1, 2"),
        "{}",
        out.stderr
    );
}

/// `--moe-capacity-factor 0.5` on SmolLM2 as 8 experts (every token routed to all 8): a step
/// of `n` tokens lets each expert take `ceil(0.5 x n x 8 / 8)` of them, so in each of the 30
/// layers each expert drops `n - ceil(n / 2)` (the later tokens). `tp bench decode` counts
/// them in the prefill (4 tokens: 2 per expert and layer) and none in the one-token decode
/// steps; `tp serve` exports them per expert as `tp_expert_tokens_dropped_total` beside the
/// tokens each expert took. A factor of 0 and a factor for a dense model are refused.
#[test]
fn capacity_drops_are_counted_and_bad_factors_refused() {
    let Some(dense) = common::smollm2() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let moe = moe_file(&dense, dir.path());
    let moe = moe.to_string_lossy();
    let row = bench_decode_row(&moe, &["--moe-capacity-factor", "0.5"], 3);
    assert_eq!(row["prefill_expert_dropped"], 30 * 8 * 2, "{row}");
    assert_eq!(
        row["expert_dropped"],
        serde_json::json!(vec![0; 8]),
        "{row}"
    );
    assert_eq!(
        row["expert_tokens"],
        serde_json::json!(vec![60; 8]),
        "{row}"
    );
    // The same in the table: the prefill's and the decode steps' drops.
    let out = common::tp(
        &[
            "bench",
            "decode",
            "--model",
            &moe,
            "--tps",
            "2",
            "--moe-capacity-factor",
            "0.5",
            "--prompt-tokens",
            "4",
            "--gen-tokens",
            "3",
            "--repeats",
            "1",
        ],
        LIMIT,
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.contains("dropped pf/dec"), "{}", out.stdout);
    assert!(out.stdout.contains(" 480/0"), "{}", out.stdout);

    let server = serve_util::ServerProc::start_with(
        serve_util::TP,
        &[],
        std::path::Path::new(&*moe),
        &["--tp", "2", "--ep", "2", "--moe-capacity-factor", "0.5"],
    );
    let body = serde_json::json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0});
    let r = server.client.post_json("/v1/completions", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let usage = &r.json()["usage"];
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    let forwarded = prompt + usage["completion_tokens"].as_u64().unwrap() - 1;
    let dropped = (30 * (prompt - prompt.div_ceil(2))) as f64;
    let series = |name: &str, e: usize| format!("{name}{{expert=\"{e}\"}}");
    let text = server.wait_metrics(Duration::from_secs(30), |t| {
        serve_util::metric_value(t, &series("tp_expert_tokens_total", 7))
            == Some((30 * forwarded) as f64 - dropped)
    });
    for e in 0..8 {
        let dropped_e =
            serve_util::metric_value(&text, &series("tp_expert_tokens_dropped_total", e));
        assert_eq!(dropped_e, Some(dropped), "expert {e}:\n{text}");
        assert_eq!(
            serve_util::metric_value(&text, &series("tp_expert_tokens_total", e)),
            Some((30 * forwarded) as f64 - dropped),
            "expert {e}:\n{text}"
        );
    }
    drop(server);

    let dense = dense.to_string_lossy();
    for (model, factor, words) in [
        (&*moe, "0", "a number above 0"),
        (&*moe, "nan", "a number above 0"),
        (
            &*dense,
            "1.25",
            "the model has no experts (it is dense); leave it unset (--moe-capacity-factor)",
        ),
    ] {
        let out = common::tp(
            &[
                "generate",
                "--model",
                model,
                "--moe-capacity-factor",
                factor,
                "hi",
            ],
            LIMIT,
        );
        assert_ne!(out.code, Some(0), "{factor}");
        assert!(out.stderr.contains(words), "{factor}: {}", out.stderr);
    }
}
