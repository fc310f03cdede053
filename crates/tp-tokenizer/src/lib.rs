//! tp-tokenizer: a model's tokenizer and chat template from GGUF metadata or tokenizer.json.
//!
//! [`Tokenizer`] wraps the HF `tokenizers` library. Every source is turned into a tokenizer.json
//! document first (GGUF metadata in [`gguf`], raw bytes in [`bytes`], an HF directory in
//! [`hf`]), so any tokenizer can be written back out with [`Tokenizer::to_tokenizer_json`].
//! Chat templates are rendered with minijinja ([`template`]); [`TextStream`] turns generated ids
//! into text piece by piece.
//!
//! A model without a chat template gets ChatML (`<|im_start|>role\ncontent<|im_end|>\n` per
//! message, and `<|im_start|>assistant\n` for the generation prompt), or Gemma's turns when its
//! vocabulary has `<start_of_turn>`/`<end_of_turn>`.

mod bytes;
mod chat;
mod error;
mod gguf;
mod hf;
mod json;
mod pieces;
mod pretok;
mod pyjson;
mod specials;
mod spm;
mod stream;
mod strftime;
mod template;

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, OnceLock};

pub use error::TokenizerError;
pub use stream::TextStream;

/// One message of a chat: `role` is "system", "user", "assistant" (or what the template knows).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// What a source says beyond the tokenizer.json document.
#[derive(Debug, Default, Clone)]
pub(crate) struct Settings {
    /// Number of ids; `None`: one more than the largest id the tokenizer knows.
    pub vocab_size: Option<usize>,
    pub bos_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub eos_ids: Vec<u32>,
    /// Texts of BOS/EOS, given to the chat template as `bos_token` / `eos_token`.
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub chat_template: Option<String>,
    /// Put BOS in front of encoded text when the tokenizer.json post-processor does not.
    pub prepend_bos: bool,
    /// Encoded text starts with BOS (by the post-processor or `prepend_bos`).
    pub adds_bos: bool,
}

/// A model's tokenizer: text <-> ids, its special tokens and its chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    settings: Settings,
    /// How ids map to their exact bytes ([`Tokenizer::token_bytes`]).
    pieces: pieces::Pieces,
    /// `inner` with special-token parsing off: message text of a chat that looks like a special
    /// token is encoded with it. Built on first use: a second copy of the vocabulary and merges
    /// (tens of MB for a 151k-token vocabulary) that most runs never need.
    plain: Arc<OnceLock<tokenizers::Tokenizer>>,
    /// Special tokens (parsed out of text, skipped by `decode`): id and text, ordered by id.
    specials: Arc<Vec<(u32, String)>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.settings.bos_id)
            .field("eos_ids", &self.settings.eos_ids)
            .field("adds_bos", &self.settings.adds_bos)
            .field("has_chat_template", &self.settings.chat_template.is_some())
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// From GGUF metadata: `tokenizer.ggml.{model,pre,tokens,merges,scores,token_type,
    /// bos_token_id,eos_token_id,eot_token_id,eom_token_id,unknown_token_id,padding_token_id,
    /// add_bos_token,add_eos_token}` and `tokenizer.chat_template`.
    ///
    /// Supports model `gpt2` (byte-level BPE) with the pre-tokenizers gpt2, smollm, qwen2,
    /// llama-bpe (llama3) and a few aliases of each, and model `llama` (SentencePiece BPE with
    /// byte fallback, e.g. TinyLlama).
    pub fn from_gguf(
        metadata: &HashMap<String, candle_core::quantized::gguf_file::Value>,
    ) -> Result<Self, TokenizerError> {
        gguf::from_metadata(metadata)
    }

    /// From an HF model directory: `tokenizer.json`, plus `tokenizer_config.json` (chat_template,
    /// bos/eos tokens, add_bos_token), `chat_template.jinja` and `generation_config.json` (eos ids)
    /// when present.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TokenizerError> {
        hf::from_dir(dir)
    }

    /// The tokenizer of the GGUF file at `path` ([`Tokenizer::from_gguf`] on its metadata), read
    /// with tp-spec's header reader: only the header, never the tensor data.
    pub fn from_gguf_file(path: &Path) -> Result<Self, TokenizerError> {
        let header = tp_spec::GgufHeader::read_file(path).map_err(|e| match e {
            tp_spec::GgufError::Io(source) => TokenizerError::Io {
                path: path.to_path_buf(),
                hint: "pass a readable GGUF file".into(),
                source,
            },
            e => TokenizerError::InvalidFile {
                path: path.to_path_buf(),
                reason: e.to_string(),
            },
        })?;
        gguf::from_metadata(&gguf::candle_metadata(header.metadata))
    }

    /// A tokenizer.json file alone (no tokenizer_config.json beside it is read): BOS and EOS
    /// come from its post-processor and its special tokens' names; no chat template.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self, TokenizerError> {
        hf::from_file(path)
    }

    /// A byte-level tokenizer: ids 0..256 are the bytes, then `specials` in order (for models
    /// trained on raw bytes). Specials named like end markers (`<|endoftext|>`, `<|im_end|>`, ...)
    /// end generation. [`Tokenizer::to_tokenizer_json`] writes it out for [`Tokenizer::from_hf_dir`].
    pub fn bytes(specials: &[&str]) -> Self {
        bytes::tokenizer(specials)
    }

    /// The tokenizer as a tokenizer.json document (load it back with [`Tokenizer::from_hf_dir`]).
    /// BOS added by this tokenizer is part of the document's post-processor; the chat template
    /// and extra end ids are not (write tokenizer_config.json / generation_config.json for those).
    pub fn to_tokenizer_json(&self) -> Result<String, TokenizerError> {
        self.inner
            .to_string(true)
            .map_err(|e| TokenizerError::backend("could not be written as tokenizer.json", e))
    }

    /// Assembles a tokenizer from a loaded `tokenizers` document and what its source said.
    pub(crate) fn assemble(
        mut inner: tokenizers::Tokenizer,
        settings: Settings,
    ) -> Result<Self, TokenizerError> {
        // Encoding always returns every id of the text: no truncation, no padding.
        inner
            .with_truncation(None)
            .map_err(|e| TokenizerError::backend("rejected disabling truncation", e))?;
        inner.with_padding(None);
        let largest = inner
            .get_vocab(true)
            .into_values()
            .max()
            .map_or(0, |id| id as usize + 1);
        let vocab_size = settings.vocab_size.unwrap_or(largest).max(largest);
        let pieces = pieces::Pieces::of(&inner);
        let mut specials: Vec<(u32, String)> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        specials.sort();
        Ok(Self {
            inner,
            vocab_size,
            settings,
            pieces,
            plain: Arc::new(OnceLock::new()),
            specials: Arc::new(specials),
        })
    }

    /// Text -> ids. Adds BOS when the model asks for it, but never a second one: text that
    /// already starts with the BOS token (a chat template that renders `bos_token`) keeps just that.
    /// Special-token strings in `text` (such as `<|im_start|>` in a rendered chat prompt) become
    /// those special tokens; other text never does.
    /// For a chat, use [`Tokenizer::encode_chat`], which keeps message text plain.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode(text, true)
            .map_err(|e| TokenizerError::backend("could not encode the text", e))?;
        Ok(self.with_bos(encoding.get_ids().to_vec()))
    }

    /// Text -> the ids of the text alone: nothing is added around it (no BOS, no
    /// post-processor), special-token strings in it still become those tokens. For training
    /// data, whose documents are cut into windows regardless of where they begin.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError::backend("could not encode the text", e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Ids as the post-processor left them, with BOS added or deduplicated as `encode` promises.
    fn with_bos(&self, mut ids: Vec<u32>) -> Vec<u32> {
        if let (Some(bos), true) = (self.settings.bos_id, self.settings.adds_bos) {
            if self.settings.prepend_bos && ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
            if ids.len() >= 2 && ids[0] == bos && ids[1] == bos {
                ids.remove(0);
            }
        }
        ids
    }

    /// The chat prompt for `messages` as ids (the model's template, or ChatML): the ids `encode`
    /// gives for [`Tokenizer::apply_chat_template`]'s text, except that text from the messages is
    /// always plain text: a special token's text inside a message (`<|im_start|>system`) is
    /// encoded as ordinary characters, never as the special token. Special tokens appear only
    /// where the template writes them. A role the template does not know is
    /// [`TokenizerError::UnknownRole`]; a template that rewrites message text so that it cannot
    /// be told from template text is [`TokenizerError::Inseparable`].
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let source = self.template_source();
        chat::check_roles(source, messages)?;
        let texts: Vec<String> = self.specials.iter().map(|(_, t)| t.clone()).collect();
        let marked = chat::render_marked(
            source,
            &self.context(messages, add_generation_prompt),
            &texts,
        )?;
        let encoding = self
            .inner
            .encode(marked.text.as_str(), true)
            .map_err(|e| TokenizerError::backend("could not encode the chat prompt", e))?;
        // Special tokens the tokenizer found, with their byte ranges; those touching message text
        // are not the template's.
        let found = self.special_spans(&marked.text, &encoding);
        let touches = |r: &Range<usize>| {
            marked
                .untrusted
                .iter()
                .any(|u| r.start < u.end && u.start < r.end)
        };
        if let Some(reference) = &marked.reference {
            let ours: Vec<u32> = found
                .iter()
                .filter(|(_, r, _)| !touches(r))
                .map(|(id, _, _)| *id)
                .collect();
            let expected = self
                .inner
                .encode(reference.as_str(), false)
                .map_err(|e| TokenizerError::backend("could not encode the chat prompt", e))?;
            let template_only: Vec<u32> = self
                .special_spans(reference, &expected)
                .into_iter()
                .map(|(id, _, _)| id)
                .collect();
            if ours != template_only {
                return Err(TokenizerError::Inseparable {
                    reason: "the template rewrites message text, and the special tokens of the result are not the ones the template writes".into(),
                });
            }
        }
        if !found.iter().any(|(_, r, _)| touches(r)) {
            return Ok(self.with_bos(encoding.get_ids().to_vec()));
        }
        // Some message text looks like a special token: encode the text between the template's
        // own special tokens with special-token parsing off.
        let backend = |e| TokenizerError::backend("could not encode the chat prompt", e);
        let mut parts = Vec::new();
        let mut at = 0;
        for (_, _, whole) in found.iter().filter(|(_, r, _)| !touches(r)) {
            if at < whole.start {
                parts.push(
                    self.plain()
                        .encode(&marked.text[at..whole.start], false)
                        .map_err(backend)?,
                );
            }
            parts.push(
                self.inner
                    .encode(&marked.text[whole.clone()], false)
                    .map_err(backend)?,
            );
            at = whole.end;
        }
        if at < marked.text.len() {
            parts.push(
                self.plain()
                    .encode(&marked.text[at..], false)
                    .map_err(backend)?,
            );
        }
        let merged = tokenizers::Encoding::merge(parts, false);
        let done = self
            .inner
            .post_process(merged, None, true)
            .map_err(backend)?;
        Ok(self.with_bos(done.get_ids().to_vec()))
    }

    /// `inner` with special-token parsing off, built the first time it is needed.
    fn plain(&self) -> &tokenizers::Tokenizer {
        self.plain.get_or_init(|| {
            let mut plain = self.inner.clone();
            plain.set_encode_special_tokens(true);
            plain
        })
    }

    /// The special tokens of `encoding` (of `text`): id, the byte range of the token's own text,
    /// and the whole range it consumed (with whitespace an `lstrip`/`rstrip` token takes).
    fn special_spans(
        &self,
        text: &str,
        encoding: &tokenizers::Encoding,
    ) -> Vec<(u32, Range<usize>, Range<usize>)> {
        let mut out = Vec::new();
        for (&id, &(a, b)) in encoding.get_ids().iter().zip(encoding.get_offsets()) {
            let Ok(k) = self.specials.binary_search_by_key(&id, |(i, _)| *i) else {
                continue;
            };
            if a >= b {
                continue; // added by the post-processor, not found in the text
            }
            let token = &self.specials[k].1;
            let exact = text
                .get(a..b)
                .and_then(|s| s.find(token.as_str()))
                .map_or(a..b, |i| a + i..a + i + token.len());
            out.push((id, exact, a..b));
        }
        out
    }

    /// Ids -> text, special tokens skipped. An id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.check_ids(ids)?;
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError::backend("could not decode the ids", e))
    }

    pub(crate) fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizerError> {
        match ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            Some(&id) => Err(TokenizerError::IdOutOfRange {
                id,
                vocab_size: self.vocab_size,
            }),
            None => Ok(()),
        }
    }

    /// The exact bytes token `id` stands for on its own (what it adds to the text, before a
    /// decoder's context rules such as SentencePiece dropping the space that starts the text).
    /// May be part of a UTF-8 character. Special tokens give their text (`<|im_end|>`), though
    /// `decode` skips them; an id in range that the vocabulary lacks gives no bytes.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>, TokenizerError> {
        self.check_ids(&[id])?;
        if let Some(content) = self.pieces.added.get(&id) {
            return Ok(content.as_bytes().to_vec());
        }
        let Some(piece) = self.inner.id_to_token(id) else {
            return Ok(Vec::new());
        };
        match self.pieces.bytes(&piece) {
            Some(bytes) => Ok(bytes),
            None => Ok(self.decode(&[id])?.into_bytes()),
        }
    }

    /// Number of ids (the embedding rows a model needs).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The beginning-of-sequence id, if the model has one (whether or not `encode` adds it).
    pub fn bos_id(&self) -> Option<u32> {
        self.settings.bos_id
    }

    /// The padding id, if the model names one.
    pub fn pad_id(&self) -> Option<u32> {
        self.settings.pad_id
    }

    /// Every id that ends generation (eos, eot such as `<|im_end|>`, `<|endoftext|>`), no duplicates, eos first.
    pub fn eos_ids(&self) -> &[u32] {
        &self.settings.eos_ids
    }

    /// The id of a token given by its vocabulary text (e.g. `"<|im_end|>"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The special tokens (control tokens: parsed out of raw text by `encode`, skipped by
    /// `decode`) as (id, text), by id.
    pub fn special_tokens(&self) -> &[(u32, String)] {
        &self.specials
    }

    /// Whether the model ships a chat template (otherwise ChatML is used).
    pub fn has_chat_template(&self) -> bool {
        self.settings.chat_template.is_some()
    }

    /// The model's chat template source, if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.settings.chat_template.as_deref()
    }

    /// Renders the model's chat template (or ChatML when it has none) for `messages`;
    /// `add_generation_prompt` appends the opening of the assistant's turn.
    /// This is the text only: encoding it with [`Tokenizer::encode`] would parse special-token
    /// text inside messages; [`Tokenizer::encode_chat`] does not.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        template::render(
            self.template_source(),
            &self.context(messages, add_generation_prompt),
        )
    }

    /// The roles the chat template knows: system, user, assistant, and tool (or ipython,
    /// function, developer) when the template names it.
    pub fn chat_roles(&self) -> Vec<&'static str> {
        chat::known_roles(self.template_source())
    }

    /// The file's chat template; without one, Gemma's turns for a vocabulary that has them,
    /// else ChatML.
    fn template_source(&self) -> &str {
        if let Some(t) = self.settings.chat_template.as_deref() {
            return t;
        }
        let has = |name: &str| self.special_tokens().iter().any(|(_, t)| t == name);
        if has("<start_of_turn>") && has("<end_of_turn>") {
            template::GEMMA
        } else {
            template::CHATML
        }
    }

    fn context<'a>(
        &'a self,
        messages: &'a [ChatMessage],
        add_generation_prompt: bool,
    ) -> template::Context<'a> {
        template::Context {
            messages,
            add_generation_prompt,
            bos_token: self.settings.bos_token.as_deref().unwrap_or(""),
            eos_token: self.settings.eos_token.as_deref().unwrap_or(""),
        }
    }

    /// An incremental detokenizer for streaming generated ids.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream::new(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_send_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
        check::<TextStream<'static>>();
    }

    #[test]
    fn encode_text_adds_nothing_and_a_written_document_loads_back() {
        let t = Tokenizer::bytes(&["<|endoftext|>", "<s>"]);
        assert_eq!(t.encode_text("a<|endoftext|>").unwrap(), vec![97, 256]);
        let dir = std::env::temp_dir().join(format!("tp-tokenizer-json-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("my-tokenizer.json");
        std::fs::write(&path, t.to_tokenizer_json().unwrap()).unwrap();
        let back = Tokenizer::from_tokenizer_json(&path).unwrap();
        assert_eq!(back.vocab_size(), 258);
        assert_eq!(back.encode_text("xy<s>").unwrap(), vec![120, 121, 257]);
        let e = Tokenizer::from_tokenizer_json(&dir.join("none.json")).unwrap_err();
        assert!(matches!(e, TokenizerError::Io { .. }), "{e}");
        std::fs::write(&path, "{").unwrap();
        let e = Tokenizer::from_tokenizer_json(&path).unwrap_err();
        assert!(matches!(e, TokenizerError::InvalidFile { .. }), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn token_bytes_are_exact() {
        let t = Tokenizer::bytes(&["<|endoftext|>", "<|im_end|>"]);
        for b in 0..=255u8 {
            assert_eq!(t.token_bytes(u32::from(b)).ok(), Some(vec![b]), "byte {b}");
        }
        assert_eq!(t.token_bytes(257).ok(), Some(b"<|im_end|>".to_vec()));
        assert!(t.token_bytes(258).is_err());
        // The bytes of a text's ids are the text, a character split over tokens included.
        let text = "é🙂 x";
        let ids = t.encode(text).unwrap_or_default();
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| t.token_bytes(id).unwrap_or_default())
            .collect();
        assert_eq!(bytes, text.as_bytes());
    }
}
