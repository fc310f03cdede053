//! The `tokenizer.json` of a byte-level model (token id = byte value), in the Hugging Face
//! `tokenizers` format: a BPE model with the 256 byte symbols and no merges, behind GPT-2's
//! ByteLevel pre-tokenizer and decoder (no regex split), so any loader of HF model
//! directories maps text to exactly the ids training used. To be replaced by
//! `tp_tokenizer::Tokenizer::bytes(..).to_tokenizer_json()` once that crate lands.

/// GPT-2's reversible byte -> printable character map (`bytes_to_unicode`).
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap_or('?')
}

/// The JSON text of the byte-level tokenizer.
pub fn byte_level_tokenizer_json() -> String {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), serde_json::Value::from(b)))
        .collect();
    let byte_level = serde_json::json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": false,
        "use_regex": false
    });
    let v = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": []
        }
    });
    serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_tokenizers_loads_it_and_ids_are_bytes() {
        let json = byte_level_tokenizer_json();
        let tok: tokenizers::Tokenizer = json.parse().expect("tokenizers loads the JSON");
        assert_eq!(tok.get_vocab_size(true), 256);
        let text = "In the beginning,\n\tthe  earth: caf\u{e9} \u{1F600}!";
        let enc = tok.encode(text, false).unwrap();
        let want: Vec<u32> = text.bytes().map(u32::from).collect();
        assert_eq!(enc.get_ids(), want.as_slice());
        assert_eq!(tok.decode(&want, false).unwrap(), text);
        let all: std::collections::HashSet<char> = (0..=255).map(byte_char).collect();
        assert_eq!(all.len(), 256);
    }
}
