//! The exact bytes of one token, for log-probability reports: a token may hold part of a
//! UTF-8 character, which `decode` (it returns a `String`) cannot show.
//!
//! The bytes are read from the token's vocabulary piece according to the decoder: byte-level
//! BPE maps each char back to its byte, SentencePiece turns `▁` into a space and `<0xNN>`
//! byte-fallback pieces into that byte. Added tokens (`<|im_end|>`, ...) are their content.
//! Any other decoder falls back to decoding the id alone.

use std::collections::HashMap;

use serde_json::Value;

use crate::json;

/// SentencePiece's word-boundary mark.
const SPACE_MARK: char = '\u{2581}';

/// How a vocabulary piece turns into bytes.
#[derive(Clone, Debug, Default)]
pub(crate) enum PieceKind {
    /// GPT-2 byte-to-unicode chars.
    ByteLevel(HashMap<char, u8>),
    /// `▁` for a space; `<0xNN>` pieces are bytes when the decoder has byte fallback.
    SentencePiece { byte_fallback: bool },
    /// Unknown decoder: decode the id on its own.
    #[default]
    Decode,
}

/// What [`crate::Tokenizer::token_bytes`] needs, worked out once when a tokenizer is built.
#[derive(Clone, Debug, Default)]
pub(crate) struct Pieces {
    pub kind: PieceKind,
    /// Content of every added token by id.
    pub added: HashMap<u32, String>,
}

impl Pieces {
    /// From the loaded document: its decoder and added tokens.
    pub fn of(inner: &tokenizers::Tokenizer) -> Self {
        let decoder = inner
            .get_decoder()
            .and_then(|d| serde_json::to_value(d).ok())
            .unwrap_or(Value::Null);
        let mut types = Vec::new();
        decoder_types(&decoder, &mut types);
        let kind = if types.iter().any(|t| t == "ByteLevel") {
            byte_level()
        } else if types.iter().any(|t| t == "Metaspace" || t == "Replace") {
            PieceKind::SentencePiece {
                byte_fallback: types.iter().any(|t| t == "ByteFallback"),
            }
        } else {
            PieceKind::Decode
        };
        let added = inner
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, t)| (id, t.content))
            .collect();
        Pieces { kind, added }
    }

    /// The bytes of vocabulary piece `piece`, or `None` when only decoding can tell.
    pub fn bytes(&self, piece: &str) -> Option<Vec<u8>> {
        match &self.kind {
            PieceKind::ByteLevel(map) => {
                let mut out = Vec::with_capacity(piece.len());
                for c in piece.chars() {
                    match map.get(&c) {
                        Some(&b) => out.push(b),
                        // Not a byte-level char (a piece added as plain text): its own UTF-8.
                        None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                    }
                }
                Some(out)
            }
            PieceKind::SentencePiece { byte_fallback } => {
                if *byte_fallback {
                    if let Some(b) = byte_piece(piece) {
                        return Some(vec![b]);
                    }
                }
                Some(piece.replace(SPACE_MARK, " ").into_bytes())
            }
            PieceKind::Decode => None,
        }
    }
}

pub(crate) fn byte_level() -> PieceKind {
    let table = json::byte_to_char_table();
    PieceKind::ByteLevel(
        table
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect(),
    )
}

/// The `type` of every decoder in a (possibly nested) decoder description.
fn decoder_types(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(o) => {
            if let Some(Value::String(t)) = o.get("type") {
                out.push(t.clone());
            }
            if let Some(Value::Array(items)) = o.get("decoders") {
                for d in items {
                    decoder_types(d, out);
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|d| decoder_types(d, out)),
        _ => {}
    }
}

/// `<0xNN>` -> NN.
fn byte_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_pieces_parse() {
        assert_eq!(byte_piece("<0x0A>"), Some(10));
        assert_eq!(byte_piece("<0xff>"), Some(255));
        assert_eq!(byte_piece("<0x0>"), None);
        assert_eq!(byte_piece("0x0A"), None);
        let spm = Pieces {
            kind: PieceKind::SentencePiece {
                byte_fallback: true,
            },
            added: HashMap::new(),
        };
        assert_eq!(spm.bytes("▁Hello").as_deref(), Some(&b" Hello"[..]));
        assert_eq!(spm.bytes("<0xE2>").as_deref(), Some(&[0xE2u8][..]));
    }
}
