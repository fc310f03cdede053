//! SentencePiece (`tokenizer.ggml.model = llama`) tokenization against llama.cpp, on a synthetic vocabulary.
//!
//! tests/fixtures/spm_synthetic.json holds a small SentencePiece-style vocabulary (pieces with
//! scores, <unk>/<s>/</s>, the 256 byte tokens) and llama.cpp's ids for it: make_fixture.py wrote
//! it as a vocabulary-only llama GGUF and ran llama.cpp's llama_tokenize (add_special and
//! parse_special on) over the texts. No model file is needed.

mod common;

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use common::*;
use tp_tokenizer::Tokenizer;

#[derive(serde::Deserialize)]
struct Vocab {
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
    unk: u32,
    bos: u32,
    eos: u32,
    add_bos: bool,
}

#[derive(serde::Deserialize)]
struct SpmFixture {
    vocab: Vocab,
}

fn load() -> (Tokenizer, Fixture, HashMap<String, Value>) {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/spm_synthetic.json");
    let text = std::fs::read_to_string(&path).expect("read the fixture");
    let vocab = serde_json::from_str::<SpmFixture>(&text)
        .expect("parse the vocabulary")
        .vocab;
    let cases: Fixture = serde_json::from_str(&text).expect("parse the cases");
    let mut m = HashMap::new();
    m.insert(
        "tokenizer.ggml.model".to_string(),
        Value::String("llama".into()),
    );
    m.insert(
        "tokenizer.ggml.tokens".into(),
        Value::Array(vocab.tokens.into_iter().map(Value::String).collect()),
    );
    m.insert(
        "tokenizer.ggml.scores".into(),
        Value::Array(vocab.scores.into_iter().map(Value::F32).collect()),
    );
    m.insert(
        "tokenizer.ggml.token_type".into(),
        Value::Array(vocab.types.into_iter().map(Value::I32).collect()),
    );
    m.insert(
        "tokenizer.ggml.unknown_token_id".into(),
        Value::U32(vocab.unk),
    );
    m.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(vocab.bos));
    m.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(vocab.eos));
    m.insert(
        "tokenizer.ggml.add_bos_token".into(),
        Value::Bool(vocab.add_bos),
    );
    let tok = Tokenizer::from_gguf(&m).expect("load the SentencePiece tokenizer");
    (tok, cases, m)
}

#[test]
fn ids_match_llama_cpp() {
    let (tok, mut fixture, _) = load();
    assert!(fixture.cases.len() > 20);
    // One deliberate difference: llama.cpp adds BOS even when the text starts with "<s>" (and
    // warns about the double BOS); `encode` keeps a single one.
    let double_bos = fixture
        .cases
        .iter_mut()
        .find(|c| c.name == "spm_bos_inside")
        .expect("case");
    assert_eq!(&double_bos.ids[..2], &[1, 1]);
    double_bos.ids.remove(0);
    assert_eq!(
        mismatches(&tok, &fixture),
        0,
        "ids differ from llama.cpp's (see MISMATCH lines)"
    );
}

#[test]
fn decode_and_stream() {
    let (tok, fixture, _) = load();
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[2]);
    for case in fixture
        .cases
        .iter()
        .filter(|c| !c.text.contains("<s>") && !c.text.contains("</s>"))
    {
        let ids = tok.encode(&case.text).expect("encode");
        assert_eq!(ids.first(), Some(&1), "BOS first");
        // The space SentencePiece puts in front of the text is dropped again.
        assert_eq!(
            tok.decode(&ids).expect("decode"),
            case.text,
            "case {}",
            case.name
        );
        // Token bytes: the text with the space SentencePiece put in front.
        let bytes: Vec<u8> = ids[1..]
            .iter()
            .flat_map(|&id| tok.token_bytes(id).expect("token bytes"))
            .collect();
        assert_eq!(
            bytes.strip_prefix(b" ").unwrap_or(&bytes),
            case.text.as_bytes(),
            "case {}",
            case.name
        );
        let (streamed, pieces) = stream_all(&mut tok.stream(), &ids);
        assert_eq!(streamed, case.text, "case {}", case.name);
        assert!(
            pieces.iter().all(|p| !p.contains('\u{FFFD}')),
            "case {}",
            case.name
        );
    }
}

#[test]
fn missing_scores_is_an_error() {
    let (_, _, mut m) = load();
    m.remove("tokenizer.ggml.scores");
    let err = Tokenizer::from_gguf(&m).expect_err("an error");
    assert!(err.to_string().contains("tokenizer.ggml.scores"), "{err}");
}
