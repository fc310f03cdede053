//! Special tokens recognised by name: those that end generation (as llama.cpp does) and those that begin a sequence.

/// Token texts that end a turn or a document in the models we know (llama.cpp's list of
/// end-of-generation markers, trimmed to the common ones).
const END_OF_GENERATION: &[&str] = &[
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<EOT>",
    "<|return|>",
    "</s>",
    "<eos>",
];

/// Token texts that begin a sequence, used when nothing else names BOS.
const BEGIN_OF_SEQUENCE: &[&str] = &["<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>"];

/// Whether a token with this text begins a sequence.
pub(crate) fn is_begin_of_sequence_name(token: &str) -> bool {
    BEGIN_OF_SEQUENCE.contains(&token)
}

/// Whether a token with this text ends generation.
pub(crate) fn is_end_of_generation_name(token: &str) -> bool {
    END_OF_GENERATION.contains(&token)
}

/// Keeps the first occurrence of each id, in order.
pub(crate) fn dedup(ids: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    for id in ids {
        if !out.contains(&id) {
            out.push(id);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dedup_keeps_order() {
        assert_eq!(dedup([2, 0, 2, 5, 0]), vec![2, 0, 5]);
    }

    #[test]
    fn names() {
        assert!(is_end_of_generation_name("<|im_end|>"));
        assert!(!is_end_of_generation_name("<|im_start|>"));
        assert!(is_begin_of_sequence_name("<s>"));
        assert!(!is_begin_of_sequence_name("</s>"));
    }
}
