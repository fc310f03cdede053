//! The pre-tokenizer of a byte-level BPE model, chosen by GGUF `tokenizer.ggml.pre`.
//!
//! Each name maps to the regexes llama.cpp applies for it (in order, each one splitting the
//! pieces the previous one left; text between matches stays a piece of its own), plus the two
//! settings llama.cpp ties to the name: whether whole words found in the vocabulary skip the
//! merges (`ignore_merges`), and whether BOS is added when the file does not say.

use crate::TokenizerError;

/// GPT-2's split: contractions, letters, numbers, other symbols, whitespace not before a word.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's split (case-insensitive contractions, digits in groups of up to three, newlines kept apart).
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split: Llama 3's with every digit on its own.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// One digit (SmolLM/StarCoder isolate digits before GPT-2's split).
const DIGIT: &str = r"\p{N}";

/// llama.cpp's fallback for a byte-level model without a known pre-tokenizer name.
const DEFAULT: [&str; 4] = [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"];

/// How a byte-level BPE model splits text before the merges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PreTokenizerSpec {
    /// Regexes applied in order.
    pub regexes: Vec<&'static str>,
    /// A piece that is itself a vocabulary entry becomes that token without merging.
    pub ignore_merges: bool,
    /// BOS is added when `tokenizer.ggml.add_bos_token` is absent.
    pub add_bos_default: bool,
}

/// Names accepted for `tokenizer.ggml.pre`, grouped by the split they select.
const GROUPS: &[(&[&str], &str)] = &[
    (
        &[
            "gpt-2",
            "gpt2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "roberta-bpe",
        ],
        "gpt2",
    ),
    (
        &["smollm", "starcoder", "refact", "codeshell", "command-r"],
        "smollm",
    ),
    (&["qwen2", "deepseek-r1-qwen", "stablelm2"], "qwen2"),
    (
        &["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"],
        "llama3",
    ),
    (&["dbrx", "smaug-bpe"], "llama3-merging"),
    (&["default"], "default"),
];

/// Every accepted name, for error messages.
pub(crate) fn supported_names() -> String {
    GROUPS
        .iter()
        .flat_map(|(names, _)| names.iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The pre-tokenizer for `pre` (`None`: the key is absent, which llama.cpp treats as "default").
pub(crate) fn lookup(pre: Option<&str>) -> Result<PreTokenizerSpec, TokenizerError> {
    let name = pre.unwrap_or("default");
    let group = GROUPS
        .iter()
        .find(|(names, _)| names.contains(&name))
        .map(|(_, group)| *group)
        .ok_or_else(|| TokenizerError::UnsupportedPreTokenizer {
            pre: name.to_string(),
            supported: supported_names(),
        })?;
    let spec = |regexes: Vec<&'static str>, ignore_merges, add_bos_default| PreTokenizerSpec {
        regexes,
        ignore_merges,
        add_bos_default,
    };
    Ok(match group {
        "gpt2" => spec(vec![GPT2], false, false),
        "smollm" => spec(vec![DIGIT, GPT2], false, false),
        "qwen2" => spec(vec![QWEN2], false, false),
        "llama3" => spec(vec![LLAMA3], true, true),
        "llama3-merging" => spec(vec![LLAMA3], false, false),
        _ => spec(DEFAULT.to_vec(), false, false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_names_resolve() {
        assert_eq!(
            lookup(Some("smollm")).map(|s| s.regexes.len()).ok(),
            Some(2)
        );
        assert_eq!(
            lookup(Some("qwen2")).map(|s| s.regexes).ok(),
            Some(vec![QWEN2])
        );
        let llama3 = lookup(Some("llama-bpe")).ok();
        assert_eq!(llama3.as_ref().map(|s| s.ignore_merges), Some(true));
        assert_eq!(llama3.map(|s| s.add_bos_default), Some(true));
        assert_eq!(lookup(None).map(|s| s.regexes.len()).ok(), Some(4));
    }

    #[test]
    fn unknown_name_is_an_error_listing_the_supported_ones() {
        let err = lookup(Some("no-such-pre"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("no-such-pre") && err.contains("smollm"),
            "{err}"
        );
    }
}
