//! Tests on the real SmolLM2-135M-Instruct GGUF: ids against llama.cpp, chat template, streaming.
//!
//! The expected ids in tests/fixtures/smollm2*.json were made once by tests/oracle/make_fixture.py,
//! which runs llama.cpp's tokenizer (llama_tokenize, add_special and parse_special on) on the same
//! GGUF file through tests/oracle/llama_ids.cpp; see the script for the exact commands. The
//! `smollm2_vocab_pre_*` fixtures are the same vocabulary with tokenizer.ggml.pre overridden, so
//! the gpt2, qwen2, llama-bpe and default pre-tokenizers are also checked against llama.cpp.
//! Every test here skips with a message when the model is not installed.

mod common;

use candle_core::quantized::gguf_file::Value;
use common::*;
use tp_tokenizer::{ChatMessage, Tokenizer};

fn smollm2() -> Option<(Tokenizer, std::collections::HashMap<String, Value>)> {
    let path = tp_testkit::smollm2()?;
    let meta = metadata(&path);
    let tok = Tokenizer::from_gguf(&meta).expect("load the SmolLM2 tokenizer");
    Some((tok, meta))
}

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

fn without_specials(text: &str) -> String {
    SPECIALS
        .iter()
        .fold(text.to_string(), |t, s| t.replace(s, ""))
}

#[test]
fn ids_match_llama_cpp() {
    let Some((tok, _)) = smollm2() else { return };
    let fixture = fixture("smollm2.json");
    assert!(fixture.cases.len() >= 20);
    assert_eq!(
        mismatches(&tok, &fixture),
        0,
        "ids differ from llama.cpp's (see MISMATCH lines)"
    );
}

#[test]
fn other_pre_tokenizers_match_llama_cpp_on_this_vocab() {
    let Some((_, meta)) = smollm2() else { return };
    let mut bad = 0;
    for pre in ["gpt-2", "qwen2", "llama-bpe", "default"] {
        let fixture = fixture(&format!("smollm2_vocab_pre_{pre}.json"));
        assert_eq!(fixture.pre_override.as_deref(), Some(pre));
        let mut meta = meta.clone();
        meta.insert("tokenizer.ggml.pre".into(), Value::String(pre.into()));
        let tok = Tokenizer::from_gguf(&meta).expect("load with another pre-tokenizer");
        bad += mismatches(&tok, &fixture);
    }
    assert_eq!(bad, 0, "ids differ from llama.cpp's (see MISMATCH lines)");
}

#[test]
fn decode_round_trips() {
    let Some((tok, _)) = smollm2() else { return };
    for case in fixture("smollm2.json").cases {
        let ids = tok.encode(&case.text).expect("encode");
        assert_eq!(
            tok.decode(&ids).expect("decode"),
            without_specials(&case.text),
            "case {}",
            case.name
        );
    }
}

#[test]
fn special_tokens_and_sizes() {
    let Some((tok, _)) = smollm2() else { return };
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(
        tok.eos_ids(),
        &[2, 0],
        "eos <|im_end|> first, then <|endoftext|>"
    );
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(0));
    assert!(tok.has_chat_template());
    assert_eq!(
        tok.encode("<|im_start|>").expect("encode"),
        vec![1],
        "add_bos is false"
    );
    assert!(matches!(
        tok.decode(&[49152]),
        Err(tp_tokenizer::TokenizerError::IdOutOfRange { id: 49152, .. })
    ));
}

fn chat() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new("user", "What is the capital of France?"),
        ChatMessage::new("assistant", "The capital of France is Paris."),
        ChatMessage::new("user", "And of Germany? Answer in one word."),
    ]
}

#[test]
fn chat_template_renders_chatml() {
    let Some((tok, _)) = smollm2() else { return };
    let expected = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
                    <|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
                    <|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n\
                    <|im_start|>user\nAnd of Germany? Answer in one word.<|im_end|>\n\
                    <|im_start|>assistant\n";
    let prompt = tok.apply_chat_template(&chat(), true).expect("render");
    assert_eq!(prompt, expected);
    let without_prompt = tok.apply_chat_template(&chat(), false).expect("render");
    assert_eq!(
        without_prompt,
        expected.trim_end_matches("<|im_start|>assistant\n")
    );

    // The rendered prompt tokenizes as llama.cpp tokenizes the same string.
    let case = fixture("smollm2.json")
        .cases
        .into_iter()
        .find(|c| c.name == "chat_prompt")
        .expect("chat_prompt case");
    assert_eq!(case.text, expected);
    assert_eq!(tok.encode(&prompt).expect("encode"), case.ids);
    // Encoding the chat with message text kept plain gives llama.cpp's ids too.
    assert_eq!(
        tok.encode_chat(&chat(), true).expect("encode_chat"),
        case.ids
    );

    // Without a system message SmolLM2's template adds its own.
    let user_only = tok
        .apply_chat_template(&[ChatMessage::new("user", "Hi")], true)
        .expect("render");
    assert_eq!(
        user_only,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn streaming_equals_decode() {
    let Some((tok, _)) = smollm2() else { return };
    let mut held_back = 0;
    for case in fixture("smollm2.json").cases {
        let mut stream = tok.stream();
        let (text, pieces) = stream_all(&mut stream, &case.ids);
        assert_eq!(
            text,
            tok.decode(&case.ids).expect("decode"),
            "case {}",
            case.name
        );
        assert!(
            pieces.iter().all(|p| !p.contains('\u{FFFD}')),
            "case {}: a piece holds a broken character",
            case.name
        );
        held_back += case.ids.len().saturating_sub(pieces.len());
    }
    assert!(held_back > 0);

    // An emoji that byte-level BPE splits over several tokens comes out whole, once.
    let ids = tok.encode("ok 🦀!").expect("encode");
    let mut stream = tok.stream();
    let pieces: Vec<Option<String>> = ids
        .iter()
        .map(|&id| stream.push(id).expect("push"))
        .collect();
    assert!(
        pieces.iter().any(Option::is_none),
        "the crab spans tokens: {ids:?}"
    );
    let joined: String = pieces.into_iter().flatten().collect();
    assert_eq!(joined, "ok 🦀!");
    assert_eq!(stream.finish().expect("finish"), None);
}

#[test]
fn tokenizer_json_round_trip() {
    let Some((tok, _)) = smollm2() else { return };
    let dir = tp_testkit::scratch_dir("tokenizer-smollm2-json");
    std::fs::write(
        dir.join("tokenizer.json"),
        tok.to_tokenizer_json().expect("to json"),
    )
    .expect("write");
    let back = Tokenizer::from_hf_dir(&dir).expect("load back");
    assert_eq!(back.vocab_size(), tok.vocab_size());
    for case in fixture("smollm2.json").cases {
        assert_eq!(
            back.encode(&case.text).expect("encode"),
            case.ids,
            "case {}",
            case.name
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn token_bytes_concatenate_to_the_text() {
    let Some((tok, _)) = smollm2() else { return };
    for text in [
        "Hello world",
        " leading space",
        "caf\u{e9} \u{1F642}!\n\tend",
        "<|im_start|>user",
    ] {
        let ids = tok.encode(text).expect("encode");
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| tok.token_bytes(id).expect("token bytes"))
            .collect();
        assert_eq!(String::from_utf8_lossy(&bytes), text, "{ids:?}");
    }
    // A byte token standing for part of a character has that byte alone.
    let ids = tok.encode("\u{1F642}").expect("encode");
    if ids.len() > 1 {
        let first = tok.token_bytes(ids[0]).expect("token bytes");
        assert!(std::str::from_utf8(&first).is_err(), "{first:?}");
    }
}

/// The GGUF file read through tp-spec's header reader gives the tokenizer candle's reading of
/// the same metadata gives; `encode_text` is `encode` without what is added around the text.
#[test]
fn from_gguf_file_is_from_gguf_on_candles_reading() {
    let Some((tok, _)) = smollm2() else { return };
    let path = tp_testkit::smollm2().unwrap();
    let file = Tokenizer::from_gguf_file(&path).expect("load from the file");
    assert_eq!(file.vocab_size(), tok.vocab_size());
    assert_eq!(file.eos_ids(), tok.eos_ids());
    for case in fixture("smollm2.json").cases {
        let want = tok.encode(&case.text).unwrap();
        assert_eq!(file.encode(&case.text).unwrap(), want, "{}", case.name);
        // SmolLM2 adds nothing around text, so the text alone has the same ids.
        assert_eq!(file.encode_text(&case.text).unwrap(), want, "{}", case.name);
    }
    let e = Tokenizer::from_gguf_file(&path.with_extension("missing")).unwrap_err();
    assert!(matches!(e, tp_tokenizer::TokenizerError::Io { .. }), "{e}");
}
