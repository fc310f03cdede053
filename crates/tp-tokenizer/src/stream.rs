//! Incremental detokenization for streaming: ids in, complete UTF-8 text out.
//!
//! Decoding a token on its own is wrong in two ways: a character may span several tokens (a
//! byte-level or byte-fallback emoji), and decoders look at neighbours (SentencePiece drops the
//! space that starts the text). So the stream decodes a short window of recent ids twice — with
//! and without the new id — and emits what the new id added, once that no longer ends in an
//! incomplete character. The pieces concatenate to `decode` of all ids.

use crate::{Tokenizer, TokenizerError};

/// A streaming detokenizer borrowed from a [`Tokenizer`] (see [`Tokenizer::stream`]).
#[derive(Debug)]
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix: usize,
    /// Ids before this one have been emitted.
    read: usize,
}

impl<'a> TextStream<'a> {
    pub(crate) fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Adds one id; returns the text it completes, if any (`None` while a character is still
    /// incomplete or the id is a skipped special token).
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
        self.tokenizer.check_ids(&[id])?;
        self.ids.push(id);
        let before = self.tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let after = self.tokenizer.decode(&self.ids[self.prefix..])?;
        if after.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(None);
        }
        let piece = new_text(&before, &after);
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(if piece.is_empty() { None } else { Some(piece) })
    }

    /// Ends the stream: returns what is still held back (an incomplete character comes out as
    /// U+FFFD, as `decode` would write it), and starts over.
    pub fn finish(&mut self) -> Result<Option<String>, TokenizerError> {
        let piece = if self.read < self.ids.len() {
            let before = self.tokenizer.decode(&self.ids[self.prefix..self.read])?;
            let after = self.tokenizer.decode(&self.ids[self.prefix..])?;
            new_text(&before, &after)
        } else {
            String::new()
        };
        self.ids.clear();
        self.prefix = 0;
        self.read = 0;
        Ok(if piece.is_empty() { None } else { Some(piece) })
    }
}

/// The text `after` adds to `before` (normally `before` is a prefix of `after`).
fn new_text(before: &str, after: &str) -> String {
    if let Some(rest) = after.strip_prefix(before) {
        return rest.to_string();
    }
    // The context decoded differently once more ids followed it: emit past the common prefix.
    let common = before
        .char_indices()
        .zip(after.chars())
        .find(|((_, a), b)| a != b)
        .map_or(before.len().min(after.len()), |((i, _), _)| i);
    after.get(common..).unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_text_after_prefix() {
        assert_eq!(new_text("Hello", "Hello world"), " world");
        assert_eq!(new_text("", "abc"), "abc");
        assert_eq!(new_text("abc", "abd!"), "d!");
    }
}
