//! SentencePiece BPE (`tokenizer.ggml.model = llama`, e.g. TinyLlama) from GGUF metadata.
//!
//! llama.cpp tokenizes these by repeatedly joining the adjacent pair whose joined text is the
//! vocabulary entry with the highest score, falling back to `<0xNN>` byte tokens for text the
//! vocabulary lacks. That is a BPE whose merges are every split of every vocabulary entry into
//! two entries, ranked by the entry's score: this module derives those merges and describes the
//! rest as HF does for Llama: spaces become `▁`, a `▁` is put before each stretch of text that
//! starts the input or follows a special token (when `tokenizer.ggml.add_space_prefix`, the
//! default), and decoding undoes both.

use serde_json::{json, Map, Value as Json};

use crate::gguf::{scores, token_type, Common, Meta};
use crate::json::{self, BpeOptions};
use crate::{Tokenizer, TokenizerError};

/// SentencePiece's word-boundary mark, which stands for a space.
const SPACE_MARK: &str = "\u{2581}";

/// The merges of a SentencePiece vocabulary: every (left, right) split of a mergeable token
/// into two vocabulary entries, highest token score first (ties: lower token id first).
pub(crate) fn derive_merges(
    tokens: &[&str],
    scores: &[f64],
    mergeable: &[bool],
) -> Vec<(String, String)> {
    let index: std::collections::HashMap<&str, usize> =
        tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut found: Vec<(f64, usize, usize, usize)> = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        if !mergeable[id] {
            continue;
        }
        for (split, _) in token.char_indices().skip(1) {
            let (left, right) = token.split_at(split);
            if let (Some(&l), Some(&r)) = (index.get(left), index.get(right)) {
                if mergeable[l] && mergeable[r] {
                    found.push((scores[id], id, l, r));
                }
            }
        }
    }
    found.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    found
        .into_iter()
        .map(|(_, _, l, r)| (tokens[l].to_string(), tokens[r].to_string()))
        .collect()
}

/// Builds the tokenizer for `tokenizer.ggml.model = llama`.
pub(crate) fn from_gguf(
    meta: &Meta<'_>,
    common: &Common<'_>,
    has_types: bool,
) -> Result<Tokenizer, TokenizerError> {
    let n = common.tokens.len();
    let scores = scores(meta, n)?.ok_or_else(|| TokenizerError::MissingKey {
        key: "tokenizer.ggml.scores".into(),
        hint: "a llama (SentencePiece) tokenizer needs its token scores; re-export the model with a current llama.cpp converter".into(),
    })?;
    let add_space_prefix = meta
        .bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    // Only ordinary and user-defined pieces take part in merges (control tokens, bytes and
    // <unk> are reached by other means).
    let mergeable: Vec<bool> = common
        .types
        .iter()
        .map(|&t| {
            t == token_type::NORMAL || t == token_type::USER_DEFINED || t == token_type::UNUSED
        })
        .collect();
    let merges = derive_merges(&common.tokens, &scores, &mergeable);

    let mut vocab = Map::new();
    for (id, token) in common.tokens.iter().enumerate() {
        vocab.insert(token.to_string(), Json::from(id as u32));
    }
    let has_bytes = common.types.contains(&token_type::BYTE);
    let unk_token = common.unk.map(|id| common.tokens[id as usize].to_string());

    let replace = |from: &str, to: &str| json!({ "type": "Replace", "pattern": { "String": from }, "content": to });
    let mut normalizers = Vec::new();
    if add_space_prefix {
        normalizers.push(json!({ "type": "Prepend", "prepend": SPACE_MARK }));
    }
    normalizers.push(replace(" ", SPACE_MARK));
    let normalizer = json!({ "type": "Sequence", "normalizers": normalizers });

    let mut decoders = vec![replace(SPACE_MARK, " ")];
    if has_bytes {
        decoders.push(json!({ "type": "ByteFallback" }));
    }
    decoders.push(json!({ "type": "Fuse" }));
    if add_space_prefix {
        decoders.push(json!({ "type": "Strip", "content": " ", "start": 1, "stop": 0 }));
    }
    let decoder = json!({ "type": "Sequence", "decoders": decoders });

    let doc = json::document(
        common.added_tokens(has_types),
        normalizer,
        Json::Null,
        common.processor(true),
        decoder,
        json::bpe_model(
            vocab,
            merges,
            &BpeOptions {
                ignore_merges: false,
                byte_fallback: has_bytes,
                fuse_unk: true,
                unk_token,
            },
        ),
    );
    let inner = json::load(&doc, "GGUF metadata (tokenizer.ggml.*, SentencePiece)", "re-export the model with a current llama.cpp converter, or load its HF directory (tokenizer.json)")?;
    Tokenizer::assemble(inner, common.settings(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_follow_scores() {
        let tokens = ["a", "b", "c", "ab", "bc", "abc", "<s>"];
        let scores = [-1.0, -1.0, -1.0, -3.0, -2.0, -2.5, 0.0];
        let mergeable = [true, true, true, true, true, true, false];
        let merges = derive_merges(&tokens, &scores, &mergeable);
        let pairs: Vec<(&str, &str)> = merges
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        assert_eq!(
            pairs,
            vec![("b", "c"), ("a", "bc"), ("ab", "c"), ("a", "b")]
        );
    }
}
