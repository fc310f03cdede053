//! Tests on the opt-in Qwen2.5-Coder-0.5B-Instruct GGUF (`tokenizer.ggml.pre = qwen2`), against llama.cpp.
//!
//! tests/fixtures/qwen2.5-coder-0.5b.json was made by tests/oracle/make_fixture.py with llama.cpp's
//! tokenizer on the same file (see the script). The model is optional (docs/models.md tells how
//! to install it): without it every test here prints why it skips.

mod common;

use common::*;
use tp_tokenizer::{ChatMessage, Tokenizer};

fn qwen() -> Option<Tokenizer> {
    let path = tp_testkit::qwen25()?;
    Some(Tokenizer::from_gguf(&metadata(&path)).expect("load the Qwen tokenizer"))
}

#[test]
fn ids_match_llama_cpp() {
    let Some(tok) = qwen() else { return };
    let fixture = fixture("qwen2.5-coder-0.5b.json");
    assert_eq!(
        mismatches(&tok, &fixture),
        0,
        "ids differ from llama.cpp's (see MISMATCH lines)"
    );
    for case in &fixture.cases {
        let (streamed, _) = stream_all(&mut tok.stream(), &case.ids);
        assert_eq!(
            streamed,
            tok.decode(&case.ids).expect("decode"),
            "case {}",
            case.name
        );
    }
}

#[test]
fn specials_and_template() {
    let Some(tok) = qwen() else { return };
    let im_end = tok.token_to_id("<|im_end|>").expect("<|im_end|>");
    let endoftext = tok.token_to_id("<|endoftext|>").expect("<|endoftext|>");
    assert!(
        tok.eos_ids().contains(&im_end) && tok.eos_ids().contains(&endoftext),
        "{:?}",
        tok.eos_ids()
    );
    assert!(tok.has_chat_template());
    let messages = [
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new("user", "Write hello world in Rust."),
        ChatMessage::new("assistant", "fn main() { println!(\"hello world\"); }"),
        ChatMessage::new("user", "Thanks!"),
    ];
    let expected = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
                    <|im_start|>user\nWrite hello world in Rust.<|im_end|>\n\
                    <|im_start|>assistant\nfn main() { println!(\"hello world\"); }<|im_end|>\n\
                    <|im_start|>user\nThanks!<|im_end|>\n\
                    <|im_start|>assistant\n";
    assert_eq!(
        tok.apply_chat_template(&messages, true).expect("render"),
        expected
    );
    // Benign messages: the same ids as encoding the rendered text (llama.cpp's way).
    assert_eq!(
        tok.encode_chat(&messages, true).expect("encode_chat"),
        tok.encode(expected).expect("encode")
    );
    let user_only = tok
        .apply_chat_template(&messages[1..2], true)
        .expect("render");
    assert!(
        user_only.starts_with("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud."),
        "{user_only}"
    );
}
