//! The byte-level tokenizer for models trained on raw bytes: id b is byte b, then the specials.
//!
//! It is a tokenizer.json document like any other (a BPE model with the 256 byte-level symbols
//! and no merges), so a byte-trained checkpoint can ship it and be loaded with `from_hf_dir`.

use serde_json::{Map, Value};

use crate::json::{self, BpeOptions};
use crate::{specials, Settings, Tokenizer};

/// The byte tokenizer with `specials` at ids 256.. in order (a repeated name keeps its first id).
pub(crate) fn tokenizer(specials: &[&str]) -> Tokenizer {
    let mut unique: Vec<&str> = Vec::new();
    for s in specials {
        if !s.is_empty() && !unique.contains(s) {
            unique.push(s);
        }
    }
    let table = json::byte_to_char_table();
    let mut vocab = Map::new();
    for (b, c) in table.iter().enumerate() {
        vocab.insert(c.to_string(), Value::from(b as u32));
    }
    let added = unique
        .iter()
        .enumerate()
        .map(|(i, s)| json::added_token(256 + i as u32, s, true))
        .collect();
    let doc = json::document(
        added,
        Value::Null,
        json::byte_level_pre(false),
        Value::Null,
        json::byte_level_decoder(),
        json::bpe_model(vocab, Vec::new(), &BpeOptions::default()),
    );
    let id_of = |name: &str| {
        unique
            .iter()
            .position(|s| *s == name)
            .map(|i| 256 + i as u32)
    };
    let eos_ids: Vec<u32> = unique
        .iter()
        .filter(|s| specials::is_end_of_generation_name(s))
        .filter_map(|s| id_of(s))
        .collect();
    // A special named like a BOS token is the BOS id (never added by `encode`).
    let bos_id = unique
        .iter()
        .find(|s| specials::is_begin_of_sequence_name(s))
        .and_then(|s| id_of(s));
    let settings = Settings {
        vocab_size: Some(256 + unique.len()),
        bos_id,
        pad_id: None,
        eos_token: eos_ids
            .first()
            .map(|&id| unique[id as usize - 256].to_string()),
        bos_token: bos_id.map(|id| unique[id as usize - 256].to_string()),
        eos_ids,
        chat_template: None,
        prepend_bos: false,
        adds_bos: false,
    };
    // The document is fixed apart from the special names, which the library takes as they are,
    // so loading it cannot fail; should it ever, fall back to the same vocabulary without specials.
    match json::load(
        &doc,
        "the byte-level description",
        "this is a bug in tp-tokenizer",
    )
    .and_then(|inner| Tokenizer::assemble(inner, settings.clone()))
    {
        Ok(tokenizer) => tokenizer,
        Err(_) => fallback(settings),
    }
}

/// A minimal byte tokenizer built through the typed API (used only if the document is refused).
fn fallback(settings: Settings) -> Tokenizer {
    use tokenizers::models::bpe::{Vocab, BPE};
    let table = json::byte_to_char_table();
    let vocab: Vocab = table
        .iter()
        .enumerate()
        .map(|(b, c)| (c.to_string(), b as u32))
        .collect();
    let model = BPE::new(vocab, Vec::new());
    let mut inner = tokenizers::Tokenizer::new(model);
    inner.with_pre_tokenizer(Some(
        tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, false, false),
    ));
    inner.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::new(
        false, false, false,
    )));
    Tokenizer {
        plain: Default::default(),
        specials: Default::default(),
        pieces: crate::pieces::Pieces {
            kind: crate::pieces::byte_level(),
            added: Default::default(),
        },
        inner,
        vocab_size: 256,
        settings: Settings {
            vocab_size: Some(256),
            eos_ids: Vec::new(),
            bos_id: None,
            bos_token: None,
            eos_token: None,
            ..settings
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_bytes_then_specials() {
        let t = tokenizer(&["<|endoftext|>", "<|im_start|>", "<|im_end|>"]);
        assert_eq!(t.vocab_size(), 259);
        let text = "a é🙂\n\t<|im_start|>x<|im_end|>";
        let ids = t.encode(text).unwrap_or_default();
        let mut expected: Vec<u32> = "a é🙂\n\t".bytes().map(u32::from).collect();
        expected.push(257);
        expected.push(u32::from(b'x'));
        expected.push(258);
        assert_eq!(ids, expected);
        assert_eq!(t.decode(&ids).ok().as_deref(), Some("a é🙂\n\tx"));
        assert_eq!(t.eos_ids(), &[256, 258]);
        assert_eq!(t.bos_id(), None);
        assert_eq!(t.token_to_id("<|im_end|>"), Some(258));
    }

    #[test]
    fn every_byte_round_trips() {
        let t = tokenizer(&[]);
        let all: Vec<u32> = (0..256).collect();
        let text = "\u{0}\u{1}\u{7f} ~\u{a0}\u{ad}ÿ";
        let ids = t.encode(text).unwrap_or_default();
        assert_eq!(ids, text.bytes().map(u32::from).collect::<Vec<_>>());
        assert!(t.decode(&all).is_ok());
        assert!(matches!(
            t.decode(&[256]),
            Err(crate::TokenizerError::IdOutOfRange {
                id: 256,
                vocab_size: 256
            })
        ));
    }

    #[test]
    fn fallback_encodes_bytes() {
        let t = fallback(Settings::default());
        assert_eq!(t.encode("hi ").unwrap_or_default(), vec![104, 105, 32]);
    }
}
