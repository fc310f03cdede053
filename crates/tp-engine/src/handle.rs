//! A handle on one sequence of a session, for a front end that talks to the model turn by
//! turn (`tp generate`, `tp chat`): it opens the sequence, keeps the tokens its KV cache holds,
//! feeds only what a new prompt adds to them, streams the reply's text, and rewinds, keeps the
//! followers waiting or closes, so the front end sends no step commands itself. And a prompt
//! encoded once ([`PromptIds`]): when the session starts, to price the positions it holds, and
//! kept for the lead.

use crate::decoder::{DecodeParams, LogprobEntry, SequenceDecoder};
use crate::error::{EngineError, Result};
use crate::generate::{generate, Flow, GenerationStats};
use crate::protocol::Command;
use crate::session::Session;
use crate::spec::{SpecStats, Speculator};
use crate::start::HeldPositions;
use std::io::Write;
use std::sync::{Arc, Mutex};
use tp_tokenizer::{Tokenizer, TokenizerError};

/// One generated answer.
pub struct Reply {
    pub stats: GenerationStats,
    pub text: String,
    /// Generated token ids (end-of-sequence excluded).
    pub tokens: Vec<u32>,
    /// Log-probabilities of the shown tokens (when asked for).
    pub logprobs: Vec<LogprobEntry>,
    /// What speculative decoding did (when on).
    pub spec: Option<SpecStats>,
    /// Why drafting stopped during this reply (a drafter error; the reply went on without
    /// drafts), for the caller to tell.
    pub spec_failure: Option<String>,
}

/// Rank 0's handle on one sequence (slot 0) of `session`.
pub struct Engine<'s> {
    session: &'s mut Session,
    slot: u32,
    /// The tokens the sequence's cache holds, in order.
    cached: Vec<u32>,
    /// Speculative decoding of every reply, when set.
    spec: Option<Speculator>,
}

impl<'s> Engine<'s> {
    pub fn new(session: &'s mut Session) -> Self {
        Engine {
            session,
            slot: 0,
            cached: Vec::new(),
            spec: None,
        }
    }

    /// Decodes every reply speculatively with `spec` (or not, with `None`).
    pub fn set_speculation(&mut self, spec: Option<Speculator>) {
        self.spec = spec;
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.session.tokenizer
    }

    /// Positions the sequence can hold.
    pub fn ctx_size(&self) -> usize {
        self.session.ctx_size
    }

    /// Generates after `ids` and writes the text to `out` as it comes. The cache keeps what
    /// `ids` shares with what it holds (at least one token is fed anew); the generated tokens
    /// stay in it (all but the last, which was never fed).
    pub fn reply(
        &mut self,
        ids: &[u32],
        params: &DecodeParams,
        out: &mut dyn Write,
    ) -> Result<Reply> {
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let ctx = self.session.ctx_size;
        if ids.len() >= ctx {
            return Err(EngineError::PromptOverContext {
                tokens: ids.len(),
                ctx,
            });
        }
        let common = self
            .cached
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count();
        self.rewind(common.min(ids.len() - 1))?;
        let (slot, worker) = (self.slot, &mut self.session.worker);
        if worker.slots().capacity(slot) == 0 {
            worker.submit(Command::Open {
                slot,
                capacity: ctx as u32,
            })?;
        }
        let cached = worker.slots().cached_len(slot);
        let mut decoder = SequenceDecoder::new(&self.session.tokenizer, params.clone())?;
        let mut text = String::new();
        let mut logprobs = Vec::new();
        let mut failure: Option<std::io::Error> = None;
        let mut spec = self.spec.as_mut();
        if let Some(s) = spec.as_deref_mut() {
            s.start(&ids[..cached], &ids[cached..]);
        }
        let stats = generate(
            &mut *worker,
            slot,
            &ids[cached..],
            &mut decoder,
            spec,
            |shown| {
                text.push_str(&shown.text);
                logprobs.extend(shown.logprobs.iter().cloned());
                match out
                    .write_all(shown.text.as_bytes())
                    .and_then(|()| out.flush())
                {
                    Ok(()) => Flow::Continue,
                    Err(e) => {
                        failure = Some(e);
                        Flow::Stop
                    }
                }
            },
        )?;
        if let Some(e) = failure {
            return Err(EngineError::Output(e));
        }
        let tokens = decoder.generated().to_vec();
        // The cache holds the prompt and the reply tokens fed back so far.
        self.cached = ids.to_vec();
        self.cached.extend_from_slice(&tokens);
        self.cached.truncate(worker.slots().cached_len(slot));
        Ok(Reply {
            stats,
            text,
            tokens,
            logprobs,
            spec: self.spec.as_ref().map(|s| s.stats),
            spec_failure: self
                .spec
                .as_mut()
                .and_then(|s| s.take_failure().map(str::to_string)),
        })
    }

    /// Forgets everything the sequence holds.
    pub fn reset(&mut self) -> Result<()> {
        self.rewind(0)
    }

    /// Tells the waiting followers the leader is still there (while a person types).
    pub fn keep_alive(&mut self) -> Result<()> {
        self.session.worker.submit(Command::Idle).map(drop)
    }

    /// Frees the sequence's cache.
    pub fn close(self) -> Result<()> {
        let slots = self.session.worker.slots();
        if slots.capacity(self.slot) == 0 {
            return Ok(());
        }
        let slot = self.slot;
        self.session
            .worker
            .submit(Command::Close { slot })
            .map(drop)
    }

    /// Drops cached positions past `len`.
    fn rewind(&mut self, len: usize) -> Result<()> {
        let slots = self.session.worker.slots();
        if slots.capacity(self.slot) > 0 && slots.cached_len(self.slot) > len {
            self.session.worker.submit(Command::Truncate {
                slot: self.slot,
                len: len as u32,
            })?;
        }
        self.cached.truncate(len);
        Ok(())
    }
}

/// A prompt's ids, or why it cannot be encoded.
type Encoded = std::result::Result<Vec<u32>, TokenizerError>;

/// The encoding of a prompt.
type Encode = dyn Fn(&Tokenizer) -> Encoded + Send + Sync;

/// A prompt encoded once by rank 0's tokenizer: as the session starts, to tell the positions
/// its sequence holds ([`PromptIds::held`]), and then handed to the lead ([`PromptIds::ids`]).
#[derive(Clone)]
pub struct PromptIds {
    encode: Arc<Encode>,
    ids: Arc<Mutex<Option<Encoded>>>,
}

impl PromptIds {
    pub fn new(
        encode: impl Fn(&Tokenizer) -> std::result::Result<Vec<u32>, TokenizerError>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        PromptIds {
            encode: Arc::new(encode),
            ids: Arc::new(Mutex::new(None)),
        }
    }

    /// The positions a sequence of this prompt and at most `max_new` generated tokens holds
    /// (a prompt that cannot be encoded is priced as the whole context; the lead then reports
    /// why). The ids are kept for [`PromptIds::ids`].
    pub fn held(&self, max_new: usize) -> HeldPositions {
        let me = self.clone();
        HeldPositions::new(move |t| {
            let ids = (me.encode)(t);
            let held = ids
                .as_ref()
                .map_or(usize::MAX, |ids| ids.len().saturating_add(max_new));
            if let Ok(mut kept) = me.ids.lock() {
                *kept = Some(ids);
            }
            held
        })
    }

    /// The prompt's ids: those encoded as the session started, else encoded now.
    pub fn ids(&self, tokenizer: &Tokenizer) -> std::result::Result<Vec<u32>, TokenizerError> {
        let kept = self.ids.lock().ok().and_then(|mut k| k.take());
        kept.unwrap_or_else(|| (self.encode)(tokenizer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_prompt_is_encoded_once() {
        let tok = Tokenizer::bytes(&["<|endoftext|>"]);
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let prompt = PromptIds::new(move |t| {
            counted.fetch_add(1, Ordering::SeqCst);
            t.encode("abc")
        });
        let want = tok.encode("abc").unwrap();
        assert_eq!(prompt.held(10).positions(&tok), want.len() + 10);
        assert_eq!(prompt.ids(&tok).unwrap(), want);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // Without a start that priced it, the lead encodes it itself.
        assert_eq!(prompt.ids(&tok).unwrap(), want);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}
