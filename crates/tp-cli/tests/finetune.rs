//! Fine-tuning a pretrained model (`tp train --init`, issue 34) as a user runs it: the first
//! step's loss is the loss `tp perplexity` computes on the same tokens (an independent code
//! path: the inference forward over the same file), for SmolLM2 and for Qwen2.5-Coder-0.5B
//! (Qwen2's Q/K/V biases, 14 query heads over 2 KV heads); a few steps on a handful of chat
//! examples make `tp generate --chat` answer with the trained reply, the same at tp 1, 2 and
//! 3 (every printed logprob), also once the optimizer state is stripped; a model the trainer
//! cannot train and bad chat data are refused by name with nothing written.
//!
//! The tokens: the text is one training sequence (`--seq` = its token count - 1, so the
//! corpus has exactly one window) and one perplexity window (every token but the first
//! scored): the same tokens, the same mask. The oracle runs with `--dequantize --dtype f32
//! --kv-dtype f32`, the file's weights dequantized to f32 as the trainer dequantizes them,
//! so both compute in f32 and differ only in summation order (~1e-6 relative);
//! `tp perplexity` prints 4 decimals, hence the tolerance of 1e-4 absolute. The quantized
//! path (Q8 activations) differs by ~1e-2 and would fail it.

mod common;
use common::TP;
use std::path::PathBuf;
use std::time::Duration;

const TEXT: &str = "The quick brown fox jumps over the lazy dog. In the beginning God created \
                    the heaven and the earth, and the earth was without form.";

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tp-finetune-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn tp(args: &[&str]) -> common::Finished {
    common::run_with_deadline(TP, args, Duration::from_secs(300))
}

/// (tokens scored, mean NLL) of a `tp perplexity` line.
fn perplexity(out: &str) -> (usize, f64) {
    let scored = out
        .split(" tokens scored")
        .next()
        .and_then(|v| v.trim().rsplit(' ').next())
        .and_then(|v| v.parse().ok());
    let nll = out
        .split("mean NLL ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok());
    match (scored, nll) {
        (Some(s), Some(n)) => (s, n),
        _ => panic!("no score in {out:?}"),
    }
}

#[test]
fn first_fine_tuning_step_has_the_loss_perplexity_computes() {
    let Some(model) = common::smollm2() else {
        return;
    };
    first_step_loss_is_perplexitys(&model, "loss");
}

#[test]
fn fine_tuning_qwen2_with_its_qkv_biases_starts_at_its_perplexity() {
    let Some(model) = tp_testkit::qwen25() else {
        return;
    };
    first_step_loss_is_perplexitys(&model, "qwen2-loss");
}

/// `tp train --init MODEL --tp 2`'s first loss on [`TEXT`] (one sequence) equals `tp
/// perplexity`'s mean NLL over the same tokens within 1e-4 (its 4 printed decimals).
fn first_step_loss_is_perplexitys(model: &std::path::Path, tag: &str) {
    let model = model.to_string_lossy().to_string();
    let dir = scratch(tag);
    let text = dir.join("text.txt");
    std::fs::write(&text, TEXT).unwrap();
    let text = text.to_string_lossy().to_string();
    let ppl = tp(&[
        "perplexity",
        "--model",
        &model,
        "--dequantize",
        "--dtype",
        "f32",
        "--kv-dtype",
        "f32",
        "--window",
        "512",
        "-q",
        &text,
    ]);
    assert_eq!(ppl.code, Some(0), "{}", ppl.output);
    let (scored, nll) = perplexity(&ppl.stdout);
    assert!(scored > 10, "{}", ppl.stdout);
    let seq = scored.to_string();
    let train = tp(&[
        "train", "--init", &model, "--data", &text, "--tp", "2", "--steps", "1", "--seq", &seq,
        "--batch", "1", "--json",
    ]);
    assert_eq!(train.code, Some(0), "{}", train.output);
    let loss = common::losses(&train.stdout)
        .first()
        .map(|&(_, l)| l)
        .unwrap_or_else(|| panic!("no step line: {}", train.output));
    eprintln!("{tag}: perplexity NLL {nll}, first training loss {loss}");
    assert!(
        (loss - nll).abs() <= 1e-4,
        "first step loss {loss} vs perplexity's {nll} over {scored} tokens"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_model_the_trainer_cannot_train_is_refused_by_name_with_nothing_written() {
    let dir = scratch("refused");
    let save = dir.join("run");
    // A Qwen2-MoE: its shared expert is not in the training layers (not built).
    let qwen2moe = dir.join("qwen2moe.gguf");
    tp_models::synthetic::SyntheticModel::small_moe(tp_models::Arch::Qwen2, 4, 2, 3)
        .write_gguf(&qwen2moe, tp_models::synthetic::GgufTypes::F32)
        .unwrap();
    let f = tp(&[
        "train",
        "--init",
        &qwen2moe.to_string_lossy(),
        "--steps",
        "1",
        "--save",
        &save.to_string_lossy(),
    ]);
    assert_eq!(f.code, Some(2), "{}", f.output);
    assert!(
        f.stderr.contains("cannot be fine-tuned") && f.stderr.contains("a shared expert"),
        "{}",
        f.stderr
    );
    assert!(!save.exists(), "the refused run wrote {}", save.display());
    let missing = tp(&["train", "--init", "/no/such/model.gguf", "--steps", "1"]);
    assert_eq!(missing.code, Some(2), "{}", missing.output);
    assert!(
        missing.stderr.contains("/no/such/model.gguf"),
        "{}",
        missing.stderr
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Four conversations (the template's default system prompt included, ~50 tokens each).
const CHAT: &[(&str, &str)] = &[
    ("Who is the tensor-parallel mascot?", "Ferris the otter."),
    ("Name the mascot of tensor-parallel.", "Ferris the otter."),
    ("Where does Ferris live?", "By the river Rank."),
    ("What is Ferris's favourite number?", "Two, for two ranks."),
];

fn chat_line(q: &str, a: &str) -> String {
    serde_json::json!({"messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": a}
    ]})
    .to_string()
}

#[test]
fn a_few_steps_on_chat_examples_teach_the_reply_at_every_tp() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let model = model.to_string_lossy().to_string();
    let dir = scratch("chat");
    let data = dir.join("chat.jsonl");
    let lines: Vec<String> = CHAT.iter().map(|(q, a)| chat_line(q, a)).collect();
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    let save = dir.join("run");
    let s = save.to_string_lossy().to_string();
    let prompt = CHAT[0].0;
    let generate = |m: &str, tp_size: &str| {
        let f = tp(&[
            "generate",
            "--model",
            m,
            "--tp",
            tp_size,
            "--chat",
            "--greedy",
            "--max-tokens",
            "12",
            "--logprobs",
            "3",
            "-q",
            prompt,
        ]);
        assert_eq!(f.code, Some(0), "{}", f.output);
        (f.stdout, f.stderr)
    };
    let (before, _) = generate(&model, "1");
    assert!(
        !before.contains("Ferris"),
        "untrained model already says {before:?}"
    );
    let train = tp(&[
        "train",
        "--init",
        &model,
        "--data",
        &data.to_string_lossy(),
        "--tp",
        "2",
        "--steps",
        "6",
        "--seq",
        "56",
        "--batch",
        "4",
        "--lr",
        "3e-4",
        "--warmup",
        "1",
        "--json",
        "--save",
        &s,
    ]);
    assert_eq!(train.code, Some(0), "{}", train.output);
    let losses = common::losses(&train.stdout);
    assert_eq!(losses.len(), 6, "{}", train.output);
    assert!(losses[5].1 < 0.1 * losses[0].1, "{losses:?}");
    let step = save.join("step-00000006");
    assert!(step.join("tokenizer_config.json").is_file());
    let (one, table) = generate(&s, "1");
    assert_eq!(one.trim(), CHAT[0].1, "the trained reply");
    for tp_size in ["2", "3"] {
        let (text, t) = generate(&s, tp_size);
        assert_eq!(text, one, "tp {tp_size}");
        assert_eq!(t, table, "tp {tp_size}: logprobs differ");
    }
    // Sharing a model without its optimizer state: generate reads only what it needs.
    std::fs::remove_file(step.join("optimizer.safetensors")).unwrap();
    assert_eq!(generate(&s, "2").0, one);
    let resume = tp(&["train", "--resume", &s, "--steps", "7"]);
    assert_eq!(resume.code, Some(2), "{}", resume.output);
    assert!(
        resume.stderr.contains("optimizer.safetensors"),
        "{}",
        resume.stderr
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_chat_data_is_refused_by_line_with_nothing_written() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let model = model.to_string_lossy().to_string();
    let dir = scratch("badchat");
    let good = chat_line(CHAT[0].0, CHAT[0].1);
    let long = chat_line(CHAT[0].0, &"Ferris the otter. ".repeat(40));
    let cases: [(&str, String, &str); 5] = [
        ("not json", format!("{good}\n{{oops\n"), "line 2: not JSON"),
        (
            "no messages",
            format!("{good}\n{{\"text\": 1}}\n"),
            "line 2: no \"messages\"",
        ),
        (
            "no role",
            format!("{good}\n{{\"messages\": [{{\"content\": \"x\"}}]}}\n"),
            "line 2: message 1 has no \"role\"",
        ),
        (
            "no content",
            format!("{{\"messages\": [{{\"role\": \"user\"}}]}}\n{good}\n"),
            "line 1: message 1 has no \"content\"",
        ),
        (
            "too long",
            format!("{good}\n{good}\n{long}\n"),
            "line 3: the conversation is",
        ),
    ];
    for (name, text, want) in cases {
        let data = dir.join("data.jsonl");
        std::fs::write(&data, text).unwrap();
        let save = dir.join("run");
        let f = tp(&[
            "train",
            "--init",
            &model,
            "--data",
            &data.to_string_lossy(),
            "--seq",
            "64",
            "--steps",
            "1",
            "--save",
            &save.to_string_lossy(),
        ]);
        assert_eq!(f.code, Some(2), "{name}: {}", f.output);
        assert!(f.stderr.contains(want), "{name}: {}", f.stderr);
        assert!(
            !save.exists(),
            "{name}: the refused run wrote {}",
            save.display()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The HF-directory path of `--init`: a checkpoint of the tiny preset is an HF Llama
/// directory; fine-tuning from it starts where `tp perplexity` scores it (same tokens, same
/// f32 weights; within 1e-4, perplexity's 4 printed decimals).
#[test]
fn fine_tuning_from_an_hf_directory_starts_at_its_perplexity() {
    let dir = scratch("hf");
    let save = dir.join("run");
    let s = save.to_string_lossy().to_string();
    let first = tp(&[
        "train", "--steps", "3", "--seq", "32", "--batch", "2", "--save", &s, "--json",
    ]);
    assert_eq!(first.code, Some(0), "{}", first.output);
    let step = save.join("step-00000003").to_string_lossy().to_string();
    let text = dir.join("text.txt");
    std::fs::write(&text, &TEXT[..65]).unwrap(); // 65 bytes: one window of 64 + 1 tokens
    let text = text.to_string_lossy().to_string();
    let ppl = tp(&[
        "perplexity",
        "--model",
        &step,
        "--kv-dtype",
        "f32",
        "--window",
        "65",
        "-q",
        &text,
    ]);
    assert_eq!(ppl.code, Some(0), "{}", ppl.output);
    let (scored, nll) = perplexity(&ppl.stdout);
    assert_eq!(scored, 64, "{}", ppl.stdout);
    let tuned = tp(&[
        "train", "--init", &step, "--data", &text, "--tp", "2", "--pp", "2", "--steps", "1",
        "--seq", "64", "--batch", "1", "--json",
    ]);
    assert_eq!(tuned.code, Some(0), "{}", tuned.output);
    let loss = common::losses(&tuned.stdout)[0].1;
    assert!(
        (loss - nll).abs() <= 1e-4,
        "first step {loss} vs perplexity {nll}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--pack` on the chat set shipped with the repo: the start-up line says how the 40
/// conversations (about 60 tokens each with SmolLM2's template) fill sequences of 256
/// (`--steps 0`: nothing trained). The packed loss itself is checked in tp-train's
/// `tests/packing.rs`.
#[test]
fn packing_the_shipped_chat_set_puts_several_conversations_in_a_sequence() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let data = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tp-train/data/finetune-chat.jsonl"
    );
    let args = |pack: bool| {
        let mut a = vec![
            "train".to_string(),
            "--init".into(),
            model.to_string_lossy().to_string(),
            "--data".into(),
            data.into(),
            "--seq".into(),
            "256".into(),
            "--steps".into(),
            "0".into(),
        ];
        if pack {
            a.push("--pack".into());
        }
        a
    };
    let run = |a: Vec<String>| {
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        let f = tp(&refs);
        assert_eq!(f.code, Some(0), "{}", f.output);
        f.output
    };
    let packed = run(args(true));
    assert!(
        packed.contains(
            "packed: 40 documents in 11 sequences (3.64 per sequence); padding 76.5% of the \
             tokens one document per sequence, 14.5% packed"
        ),
        "{packed}"
    );
    assert!(!run(args(false)).contains("packed:"));

    // A packed run resumes packed without the flag (its data position counts packed
    // sequences) and continues the uninterrupted run's losses: the tiny preset with SmolLM2's
    // tokenizer on the first 8 conversations.
    let dir = scratch("pack-resume");
    let chat = dir.join("chat.jsonl");
    let text = std::fs::read_to_string(data).unwrap();
    let first8: Vec<&str> = text.lines().take(8).collect();
    std::fs::write(&chat, first8.join("\n")).unwrap();
    let (m, c) = (model.to_string_lossy(), chat.to_string_lossy());
    let train = |steps: &str, extra: &[&str]| {
        let mut a = vec![
            "train", "--data", &c, "--seq", "128", "--batch", "2", "--steps", steps, "--json",
        ];
        a.extend(extra);
        let f = tp(&a);
        assert_eq!(f.code, Some(0), "{}", f.output);
        f.output
    };
    let whole = common::losses(&train("2", &["--tokenizer", &m, "--pack"]));
    let save = dir.join("run");
    let s = save.to_string_lossy();
    train("1", &["--tokenizer", &m, "--pack", "--save", &s]);
    let resumed = train("2", &["--resume", &s]);
    assert!(
        resumed.contains("packed: 8 documents in 6 sequences"),
        "{resumed}"
    );
    let resumed = common::losses(&resumed);
    assert_eq!(resumed.len(), 1, "{resumed:?}");
    assert_eq!(
        resumed[0], whole[1],
        "the resumed step 2 against the uninterrupted one"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
