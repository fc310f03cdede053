//! Pieces of a `tokenizer.json` document (the HF `tokenizers` format), built as JSON values.
//!
//! The GGUF and byte-level tokenizers are described as a tokenizer.json document and loaded
//! through the same path as an HF directory, so every tokenizer this crate builds can be written
//! out with `to_tokenizer_json` and loaded back.

use serde_json::{json, Map, Value};

use crate::TokenizerError;

/// One entry of `added_tokens`: a token matched in raw text before the model runs.
pub(crate) fn added_token(id: u32, content: &str, special: bool) -> Value {
    json!({
        "id": id,
        "content": content,
        "single_word": false,
        "lstrip": false,
        "rstrip": false,
        "normalized": false,
        "special": special,
    })
}

/// A pre-tokenizer that splits on a regex and keeps both the matches and the text between them.
pub(crate) fn split_isolated(regex: &str) -> Value {
    json!({
        "type": "Split",
        "pattern": { "Regex": regex },
        "behavior": "Isolated",
        "invert": false,
    })
}

/// The GPT-2 byte-to-unicode step as a pre-tokenizer: no prefix space; `use_regex` adds GPT-2's split.
pub(crate) fn byte_level_pre(use_regex: bool) -> Value {
    json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": false,
        "use_regex": use_regex,
    })
}

/// The inverse of the byte-level mapping, as a decoder.
pub(crate) fn byte_level_decoder() -> Value {
    json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": false,
        "use_regex": false,
    })
}

/// A sequence of pre-tokenizers (or the single one when there is only one).
pub(crate) fn pre_sequence(mut parts: Vec<Value>) -> Value {
    if parts.len() == 1 {
        return parts.remove(0);
    }
    json!({ "type": "Sequence", "pretokenizers": parts })
}

/// Options of a BPE model beyond its vocabulary and merges.
#[derive(Default)]
pub(crate) struct BpeOptions {
    pub ignore_merges: bool,
    pub byte_fallback: bool,
    pub fuse_unk: bool,
    pub unk_token: Option<String>,
}

/// A BPE model. `merges` are in priority order (first = merged first).
pub(crate) fn bpe_model(
    vocab: Map<String, Value>,
    merges: Vec<(String, String)>,
    options: &BpeOptions,
) -> Value {
    let merges: Vec<Value> = merges.into_iter().map(|(a, b)| json!([a, b])).collect();
    json!({
        "type": "BPE",
        "dropout": null,
        "unk_token": options.unk_token,
        "continuing_subword_prefix": null,
        "end_of_word_suffix": null,
        "fuse_unk": options.fuse_unk,
        "byte_fallback": options.byte_fallback,
        "ignore_merges": options.ignore_merges,
        "vocab": Value::Object(vocab),
        "merges": merges,
    })
}

/// A post-processor that puts `bos` before and `eos` after every encoded text (either may be absent).
/// Returns `Value::Null` when both are absent.
pub(crate) fn bos_eos_processor(bos: Option<(&str, u32)>, eos: Option<(&str, u32)>) -> Value {
    if bos.is_none() && eos.is_none() {
        return Value::Null;
    }
    let special =
        |token: &str, type_id: u32| json!({ "SpecialToken": { "id": token, "type_id": type_id } });
    let sequence =
        |name: &str, type_id: u32| json!({ "Sequence": { "id": name, "type_id": type_id } });
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut special_tokens = Map::new();
    for (token, id) in bos.iter().chain(eos.iter()) {
        special_tokens.insert(
            token.to_string(),
            json!({ "id": token, "ids": [id], "tokens": [token] }),
        );
    }
    for (name, type_id, out) in [("A", 0, &mut single), ("B", 1, &mut pair)] {
        if let Some((token, _)) = bos {
            out.push(special(token, type_id));
        }
        out.push(sequence(name, type_id));
        if let Some((token, _)) = eos {
            out.push(special(token, type_id));
        }
    }
    // A pair is the single template for A followed by the one for B.
    let mut full_pair = single.clone();
    full_pair.extend(pair);
    json!({
        "type": "TemplateProcessing",
        "single": single,
        "pair": full_pair,
        "special_tokens": special_tokens,
    })
}

/// A whole tokenizer.json document.
pub(crate) fn document(
    added_tokens: Vec<Value>,
    normalizer: Value,
    pre_tokenizer: Value,
    post_processor: Value,
    decoder: Value,
    model: Value,
) -> Value {
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": decoder,
        "model": model,
    })
}

/// Loads a document into the `tokenizers` library; `what` names the source and `hint` says
/// what to do when the library refuses it.
pub(crate) fn load(
    doc: &Value,
    what: &str,
    hint: &str,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let refused = |e: &dyn std::fmt::Display| TokenizerError::Backend {
        context: format!("built from {what} was rejected"),
        reason: format!("{e}; {hint}"),
    };
    let text = serde_json::to_string(doc).map_err(|e| refused(&e))?;
    text.parse::<tokenizers::Tokenizer>()
        .map_err(|e| refused(&e))
}

/// GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes map to
/// themselves, the others to U+0100 onwards in byte order.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let keeps_itself = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut table = ['\0'; 256];
    let mut next = 0x100u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let b = b as u32;
        let code = if keeps_itself(b) {
            b
        } else {
            let c = next;
            next += 1;
            c
        };
        // Every code here is below 0x144, so it is a valid char.
        *slot = char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_gpt2s() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0], 'Ā');
        let mut all: Vec<char> = t.to_vec();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 256, "the map is one to one");
    }

    #[test]
    fn processor_without_tokens_is_null() {
        assert!(bos_eos_processor(None, None).is_null());
    }
}
