//! Tests that need no model: a tiny byte-level BPE vocabulary in GGUF-metadata form, HF
//! directories written on the fly, the bytes tokenizer, and every bad input as a typed error.

mod common;

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use common::stream_all;
use tp_tokenizer::{ChatMessage, Tokenizer, TokenizerError};

/// GPT-2's byte -> printable char map, written out independently of the crate.
fn byte_char(b: u8) -> char {
    let keeps = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let b = u32::from(b);
    if keeps(b) {
        return char::from_u32(b).expect("char");
    }
    let shifted = (0..b).filter(|&x| !keeps(x)).count() as u32;
    char::from_u32(0x100 + shifted).expect("char")
}

const MERGES: [(&str, &str); 9] = [
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("l", "d"),
    ("Ġwor", "ld"),
];

/// Ids: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|> (control), 3 + b for byte b, then one
/// token per merge (259 "he" ... 262 "hello", 267 "Ġworld"), and 268 "<tool>" (user-defined).
fn synthetic() -> HashMap<String, Value> {
    let mut tokens: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    tokens.extend((0..=255u8).map(|b| byte_char(b).to_string()));
    tokens.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    tokens.push("<tool>".into());
    let mut types = vec![3i32; 3];
    types.extend(std::iter::repeat_n(1, tokens.len() - 4));
    types.push(4);
    let s = |x: &str| Value::String(x.to_string());
    let mut m = HashMap::new();
    m.insert("tokenizer.ggml.model".into(), s("gpt2"));
    m.insert("tokenizer.ggml.pre".into(), s("gpt-2"));
    m.insert(
        "tokenizer.ggml.tokens".into(),
        Value::Array(tokens.iter().map(|t| s(t)).collect()),
    );
    m.insert(
        "tokenizer.ggml.token_type".into(),
        Value::Array(types.into_iter().map(Value::I32).collect()),
    );
    m.insert(
        "tokenizer.ggml.merges".into(),
        Value::Array(MERGES.iter().map(|(a, b)| s(&format!("{a} {b}"))).collect()),
    );
    m.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
    m.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
    m.insert("tokenizer.ggml.padding_token_id".into(), Value::U32(0));
    m.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(false));
    m
}

fn byte_id(b: u8) -> u32 {
    3 + u32::from(b)
}

fn load(meta: &HashMap<String, Value>) -> Tokenizer {
    Tokenizer::from_gguf(meta).expect("load the synthetic tokenizer")
}

#[test]
fn merges_and_specials() {
    let tok = load(&synthetic());
    assert_eq!(tok.vocab_size(), 269);
    assert_eq!(tok.encode("hello world").expect("encode"), vec![262, 267]);
    assert_eq!(tok.encode("hello<|im_end|>").expect("encode"), vec![262, 2]);
    assert_eq!(
        tok.encode("<|im_start|>hi!").expect("encode"),
        vec![1, byte_id(b'h'), byte_id(b'i'), byte_id(b'!')]
    );
    // A user-defined token is parsed out of text but decodes as text.
    assert_eq!(tok.encode("<tool>hello").expect("encode"), vec![268, 262]);
    assert_eq!(tok.decode(&[268, 262, 2]).expect("decode"), "<tool>hello");
    // Special tokens are skipped by decode; ordinary text never turns into one.
    assert_eq!(
        tok.decode(&[1, 262, 267, 2, 0]).expect("decode"),
        "hello world"
    );
    assert_eq!(
        tok.encode("<|im_end").expect("encode").len(),
        "<|im_end".len()
    );
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.pad_id(), Some(0));
    assert_eq!(tok.eos_ids(), &[2, 0]);
    assert_eq!(tok.token_to_id("Ġworld"), Some(267));
    assert_eq!(tok.token_to_id("nope"), None);
}

#[test]
fn round_trip_of_arbitrary_text() {
    let tok = load(&synthetic());
    for text in [
        "",
        " ",
        "hello  world\n\n\tx",
        "naïve 🦀 你好 👨‍👩‍👧",
        "\u{0}\u{7f}\u{ad}",
    ] {
        let ids = tok.encode(text).expect("encode");
        assert_eq!(tok.decode(&ids).expect("decode"), text);
    }
}

#[test]
fn add_bos_and_eos_from_metadata() {
    let mut meta = synthetic();
    meta.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
    meta.insert("tokenizer.ggml.add_eos_token".into(), Value::U8(1));
    let tok = load(&meta);
    assert_eq!(tok.encode("hello").expect("encode"), vec![1, 262, 2]);
    assert_eq!(tok.encode("").expect("encode"), vec![1, 2]);
}

#[test]
fn llama3_pre_adds_bos_by_default_and_skips_merges_for_known_words() {
    let mut meta = synthetic();
    meta.insert(
        "tokenizer.ggml.pre".into(),
        Value::String("llama-bpe".into()),
    );
    meta.remove("tokenizer.ggml.add_bos_token");
    let tok = load(&meta);
    assert_eq!(
        tok.encode("hello world").expect("encode"),
        vec![1, 262, 267]
    );
}

#[test]
fn stream_holds_back_split_characters() {
    let tok = load(&synthetic());
    let crab: Vec<u32> = "🦀".bytes().map(byte_id).collect();
    let mut stream = tok.stream();
    let mut out = Vec::new();
    for &id in &crab {
        out.push(stream.push(id).expect("push"));
    }
    assert_eq!(out, vec![None, None, None, Some("🦀".to_string())]);
    assert_eq!(stream.finish().expect("finish"), None);

    // Pieces concatenate to decode, specials skipped, incomplete tail flushed by finish.
    let mut ids = tok
        .encode("<|im_start|>hello 你好 world<|im_end|>")
        .expect("encode");
    ids.push(crab[0]);
    let (text, pieces) = stream_all(&mut tok.stream(), &ids);
    assert_eq!(text, tok.decode(&ids).expect("decode"));
    assert!(text.ends_with('\u{FFFD}'));
    assert!(pieces.iter().rev().skip(1).all(|p| !p.contains('\u{FFFD}')));

    assert!(matches!(
        tok.stream().push(10_000),
        Err(TokenizerError::IdOutOfRange {
            id: 10_000,
            vocab_size: 269
        })
    ));
}

#[test]
fn decode_rejects_ids_out_of_range() {
    let tok = load(&synthetic());
    match tok.decode(&[262, 269]) {
        Err(TokenizerError::IdOutOfRange { id, vocab_size }) => {
            assert_eq!((id, vocab_size), (269, 269))
        }
        other => panic!("expected IdOutOfRange, got {other:?}"),
    }
    let msg = tok
        .decode(&[u32::MAX])
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(msg.contains("out of range"), "{msg}");
}

fn err_of(meta: &HashMap<String, Value>) -> TokenizerError {
    match Tokenizer::from_gguf(meta) {
        Ok(t) => panic!("expected an error, loaded {t:?}"),
        Err(e) => e,
    }
}

#[test]
fn bad_metadata_is_a_typed_error() {
    let mut m = synthetic();
    m.remove("tokenizer.ggml.tokens");
    assert!(
        matches!(err_of(&m), TokenizerError::MissingKey { ref key, .. } if key == "tokenizer.ggml.tokens")
    );

    let mut m = synthetic();
    m.remove("tokenizer.ggml.merges");
    let e = err_of(&m);
    assert!(
        matches!(e, TokenizerError::MissingKey { ref key, .. } if key == "tokenizer.ggml.merges")
    );
    assert!(e.to_string().contains("tokenizer.ggml.merges"));

    let mut m = synthetic();
    m.remove("tokenizer.ggml.model");
    assert!(
        matches!(err_of(&m), TokenizerError::MissingKey { ref key, .. } if key == "tokenizer.ggml.model")
    );

    let mut m = synthetic();
    m.insert("tokenizer.ggml.model".into(), Value::String("rwkv".into()));
    let e = err_of(&m);
    assert!(matches!(e, TokenizerError::UnsupportedModel { ref model, .. } if model == "rwkv"));
    assert!(e.to_string().contains("gpt2"), "{e}");

    let mut m = synthetic();
    m.insert("tokenizer.ggml.pre".into(), Value::String("martian".into()));
    assert!(
        matches!(err_of(&m), TokenizerError::UnsupportedPreTokenizer { ref pre, .. } if pre == "martian")
    );

    let mut m = synthetic();
    m.insert("tokenizer.ggml.tokens".into(), Value::U32(7));
    assert!(
        matches!(err_of(&m), TokenizerError::InvalidKey { ref key, .. } if key == "tokenizer.ggml.tokens")
    );

    let mut m = synthetic();
    m.insert(
        "tokenizer.ggml.token_type".into(),
        Value::Array(vec![Value::I32(1)]),
    );
    assert!(
        matches!(err_of(&m), TokenizerError::InvalidKey { ref key, .. } if key == "tokenizer.ggml.token_type")
    );

    let mut m = synthetic();
    m.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(5000));
    assert!(
        matches!(err_of(&m), TokenizerError::InvalidKey { ref key, .. } if key == "tokenizer.ggml.eos_token_id")
    );

    let mut m = synthetic();
    m.insert(
        "tokenizer.ggml.merges".into(),
        Value::Array(vec![Value::String("nospace".into())]),
    );
    assert!(
        matches!(err_of(&m), TokenizerError::InvalidKey { ref key, .. } if key == "tokenizer.ggml.merges")
    );

    // A merge of tokens that are not in the vocabulary: the tokenizers library refuses it.
    let mut m = synthetic();
    m.insert(
        "tokenizer.ggml.merges".into(),
        Value::Array(vec![Value::String("zz qq".into())]),
    );
    assert!(matches!(err_of(&m), TokenizerError::Backend { .. }));

    let mut m = synthetic();
    m.insert("tokenizer.ggml.tokens".into(), Value::Array(Vec::new()));
    m.remove("tokenizer.ggml.token_type");
    assert!(matches!(err_of(&m), TokenizerError::InvalidKey { .. }));
}

#[test]
fn chat_template_from_metadata_and_chatml_fallback() {
    let tok = load(&synthetic());
    assert!(!tok.has_chat_template());
    let msgs = [ChatMessage::new("user", "hello")];
    assert_eq!(
        tok.apply_chat_template(&msgs, true).expect("chatml"),
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    );

    let mut meta = synthetic();
    let template = "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}[{{ m.role }}] {{ m.content | trim }}{{ eos_token }}{% endfor %}";
    meta.insert(
        "tokenizer.chat_template".into(),
        Value::String(template.into()),
    );
    let tok = load(&meta);
    assert!(tok.has_chat_template());
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::new("user", " hi ")], false)
            .expect("render"),
        "<|im_start|>[user] hi<|im_end|>"
    );
    match tok.apply_chat_template(&[ChatMessage::new("system", "x")], false) {
        Err(TokenizerError::Template { message }) => {
            assert!(message.contains("no system role"), "{message}")
        }
        other => panic!("expected a template error, got {other:?}"),
    }
}

#[test]
fn gguf_tokenizer_round_trips_through_tokenizer_json() {
    let mut meta = synthetic();
    meta.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
    let tok = load(&meta);
    let dir = tp_testkit::scratch_dir("tokenizer-synthetic-json");
    std::fs::write(
        dir.join("tokenizer.json"),
        tok.to_tokenizer_json().expect("json"),
    )
    .expect("write");
    let back = Tokenizer::from_hf_dir(&dir).expect("load back");
    for text in ["hello world", "<|im_start|>hi<|im_end|>", "🦀 <tool>"] {
        assert_eq!(
            back.encode(text).expect("encode"),
            tok.encode(text).expect("encode"),
            "{text}"
        );
    }
    assert_eq!(back.encode("hello").expect("encode"), vec![1, 262]);
    assert_eq!(back.vocab_size(), tok.vocab_size());
    // Without the configs, end ids come from the token names.
    assert_eq!(back.eos_ids(), &[0, 2]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hf_dir_reads_configs() {
    let tok = load(&synthetic());
    let dir = tp_testkit::scratch_dir("tokenizer-hf-configs");
    std::fs::write(
        dir.join("tokenizer.json"),
        tok.to_tokenizer_json().expect("json"),
    )
    .expect("write");
    let config = serde_json::json!({
        "bos_token": {"content": "<|im_start|>", "lstrip": false},
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": true,
        "chat_template": "{% for m in messages %}{{ bos_token }}{{ m.content }}{{ eos_token }}{% endfor %}",
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write");
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [268, 2]}"#,
    )
    .expect("write");
    let hf = Tokenizer::from_hf_dir(&dir).expect("load");
    assert_eq!(hf.bos_id(), Some(1));
    assert_eq!(hf.pad_id(), Some(0));
    assert_eq!(hf.eos_ids(), &[2, 268, 0]);
    assert_eq!(
        hf.encode("hello").expect("encode"),
        vec![1, 262],
        "add_bos_token adds BOS"
    );
    assert_eq!(
        hf.encode("<|im_start|>hello").expect("encode"),
        vec![1, 262],
        "no second BOS"
    );
    assert_eq!(
        hf.apply_chat_template(&[ChatMessage::new("user", "x")], false)
            .expect("render"),
        "<|im_start|>x<|im_end|>"
    );

    // chat_template.jinja wins over the config's template.
    std::fs::write(dir.join("chat_template.jinja"), "J{{ messages | length }}").expect("write");
    let hf = Tokenizer::from_hf_dir(&dir).expect("load");
    assert_eq!(
        hf.apply_chat_template(&[ChatMessage::new("user", "x")], true)
            .expect("render"),
        "J1"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hf_dir_errors_name_the_file() {
    let dir = tp_testkit::scratch_dir("tokenizer-hf-errors");
    let e = Tokenizer::from_hf_dir(&dir).expect_err("no tokenizer.json");
    assert!(matches!(e, TokenizerError::Io { .. }));
    assert!(e.to_string().contains("tokenizer.json"), "{e}");

    std::fs::write(dir.join("tokenizer.json"), "{ not json").expect("write");
    let e = Tokenizer::from_hf_dir(&dir).expect_err("bad tokenizer.json");
    assert!(matches!(e, TokenizerError::InvalidFile { .. }));
    assert!(e.to_string().contains("tokenizer.json"), "{e}");

    std::fs::write(
        dir.join("tokenizer.json"),
        Tokenizer::bytes(&[]).to_tokenizer_json().expect("json"),
    )
    .expect("write");
    std::fs::write(dir.join("tokenizer_config.json"), "[oops").expect("write");
    let e = Tokenizer::from_hf_dir(&dir).expect_err("bad config");
    assert!(e.to_string().contains("tokenizer_config.json"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bytes_tokenizer_is_self_contained() {
    let tok = Tokenizer::bytes(&["<|endoftext|>", "<|im_start|>", "<|im_end|>"]);
    assert_eq!(tok.vocab_size(), 259);
    let text = "<|im_start|>user\nhé 🦀<|im_end|>";
    let ids = tok.encode(text).expect("encode");
    assert_eq!(ids[0], 257);
    assert_eq!(&ids[1..6], &[117, 115, 101, 114, 10]);
    assert_eq!(*ids.last().expect("ids"), 258);
    assert_eq!(tok.decode(&ids).expect("decode"), "user\nhé 🦀");
    assert_eq!(tok.eos_ids(), &[256, 258]);

    let (streamed, _) = stream_all(&mut tok.stream(), &ids);
    assert_eq!(streamed, "user\nhé 🦀");

    let dir = tp_testkit::scratch_dir("tokenizer-bytes-json");
    std::fs::write(
        dir.join("tokenizer.json"),
        tok.to_tokenizer_json().expect("json"),
    )
    .expect("write");
    let back = Tokenizer::from_hf_dir(&dir).expect("load back");
    assert_eq!(back.encode(text).expect("encode"), ids);
    assert_eq!(back.vocab_size(), 259);
    assert_eq!(back.eos_ids(), tok.eos_ids());
    assert_eq!(back.token_to_id("<|im_end|>"), Some(258));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bytes_tokenizer_bos_and_eos_survive_tokenizer_json() {
    let tok = Tokenizer::bytes(&["<s>", "</s>", "<pad>", "<s>"]);
    assert_eq!(
        tok.vocab_size(),
        259,
        "a repeated special keeps its first id"
    );
    assert_eq!(tok.bos_id(), Some(256));
    assert_eq!(tok.eos_ids(), &[257]);
    assert_eq!(
        tok.encode("a").expect("encode"),
        vec![97],
        "BOS is not added"
    );
    let dir = tp_testkit::scratch_dir("tokenizer-bytes-bos-json");
    std::fs::write(
        dir.join("tokenizer.json"),
        tok.to_tokenizer_json().expect("json"),
    )
    .expect("write");
    let back = Tokenizer::from_hf_dir(&dir).expect("load back");
    assert_eq!(back.bos_id(), Some(256));
    assert_eq!(back.eos_ids(), &[257]);
    assert_eq!(back.encode("<s>a</s>").expect("encode"), vec![256, 97, 257]);
    assert_eq!(back.encode("a").expect("encode"), vec![97]);
    let _ = std::fs::remove_dir_all(&dir);
}
