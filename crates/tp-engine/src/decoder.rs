//! One sequence's decoding, shared by `tp generate`, `tp chat` and `tp serve`: given each
//! step's row of logits, a [`SequenceDecoder`] applies the presence/frequency penalties,
//! samples, computes log-probabilities when asked, recognizes end-of-sequence tokens, the
//! token limit, a full KV cache and stop strings, detokenizes incrementally and says what
//! text (and which tokens' log-probabilities) may be shown now.
//!
//! Text that may be the start of a stop string is held back until it cannot be. A token's
//! log-probabilities are reported with the text that shows it: once some of its text has
//! passed the [`StopMatcher`]. Tokens whose text lies wholly inside a matched stop string (or
//! after it) are never reported; the last reported token may reach into the stop string.
//! Tokens that add no text of their own (the first bytes of a character split over tokens,
//! skipped special tokens) go with the text of the token that completes it. Streamed and
//! whole answers therefore carry the same entries.

use crate::candidates::{force_gather, Row, RowNeed, MAX_CANDIDATES};
use crate::error::{EngineError, Result};
use crate::generate::FinishReason;
use crate::logits::{candidate_logprobs, top_logprobs, Penalties, TokenLogprobs};
use crate::sampling::{Sampler, SamplingParams};
use crate::stop::StopMatcher;
use std::collections::VecDeque;
use tp_tokenizer::{TextStream, Tokenizer};

/// Most alternatives a log-probability report may list per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// How one sequence is decoded.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeParams {
    pub sampling: SamplingParams,
    /// OpenAI's presence penalty, in [-2, 2] (0 = off).
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty, in [-2, 2] (0 = off).
    pub frequency_penalty: f32,
    /// Report log-probabilities with this many alternatives per token (at most
    /// [`MAX_TOP_LOGPROBS`]); `None` = no reports.
    pub logprobs: Option<usize>,
    /// Stop strings (empty ones are ignored); they are never shown.
    pub stop: Vec<String>,
    /// Most tokens to generate, end-of-sequence excluded (at least 1).
    pub max_tokens: usize,
    /// Go on past end-of-sequence tokens (they are then ordinary tokens).
    pub ignore_eos: bool,
}

impl DecodeParams {
    /// Greedy decoding of at most `max_tokens` tokens, nothing else.
    pub fn greedy(max_tokens: usize) -> Self {
        DecodeParams {
            sampling: SamplingParams::greedy(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logprobs: None,
            stop: Vec::new(),
            max_tokens,
            ignore_eos: false,
        }
    }

    /// Rejects values no decoder can honour, naming the parameter
    /// ([`EngineError::Param`]).
    pub fn validate(&self) -> Result<()> {
        self.sampling.validate()?;
        Penalties::new(self.presence_penalty, self.frequency_penalty)?;
        if self.max_tokens == 0 {
            return Err(EngineError::Param {
                name: "max_tokens",
                message: "0 tokens; generate at least 1".into(),
            });
        }
        if let Some(k) = self.logprobs {
            if k > MAX_TOP_LOGPROBS {
                return Err(EngineError::Param {
                    name: "logprobs",
                    message: format!("{k} alternatives; at most {MAX_TOP_LOGPROBS} are reported"),
                });
            }
        }
        Ok(())
    }
}

/// One token as log-probability reports show it.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenInfo {
    /// The token's own text (lossy when `bytes` is part of a UTF-8 character).
    pub token: String,
    /// Its exact bytes.
    pub bytes: Vec<u8>,
    /// Of the model's raw distribution (before penalties, temperature, top-k and top-p); may
    /// be minus infinity.
    pub logprob: f64,
}

impl TokenInfo {
    pub fn new(bytes: Vec<u8>, logprob: f64) -> Self {
        TokenInfo {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
            logprob,
        }
    }
}

/// A generated token's log-probability report.
#[derive(Clone, Debug, PartialEq)]
pub struct LogprobEntry {
    pub chosen: TokenInfo,
    /// The most likely tokens, highest first (ties by id).
    pub top: Vec<TokenInfo>,
    /// Where the token's text starts in the shown text, in characters.
    pub text_offset: usize,
}

/// What may be shown after a step: text (complete UTF-8, stop strings held back) and the
/// log-probability reports of the tokens it shows. Both may be empty.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Emitted {
    pub text: String,
    pub logprobs: Vec<LogprobEntry>,
}

impl Emitted {
    pub fn is_empty(&self) -> bool {
        self.text.is_empty() && self.logprobs.is_empty()
    }
}

/// The end of a sequence: why, and what was held back until then.
#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    pub reason: FinishReason,
    /// Text and reports released by the end (show it after the step's own).
    pub tail: Emitted,
}

/// The result of one [`SequenceDecoder::step`].
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    /// The sampled token (an end-of-sequence token too).
    pub token: u32,
    /// What the token lets the caller show now.
    pub shown: Emitted,
    /// Set when the sequence ended with this step; the decoder takes no more steps.
    pub finished: Option<Finished>,
}

/// Decodes one sequence (see the module documentation).
#[derive(Debug)]
pub struct SequenceDecoder<'t> {
    tokenizer: &'t Tokenizer,
    params: DecodeParams,
    sampler: Sampler,
    penalties: Penalties,
    /// The penalized copy of the row (reused).
    scratch: Vec<f32>,
    stop: StopMatcher,
    text: TextStream<'t>,
    logprobs: Option<LogprobTrack>,
    /// Generated tokens, end-of-sequence excluded.
    generated: Vec<u32>,
    /// Tokens the sequence's cache can still take after the prompt (`None` = no limit).
    context_room: Option<usize>,
    finished: Option<FinishReason>,
    /// Ask for whole rows always ([`SequenceDecoder::set_gather_full`]).
    gather_full: bool,
}

impl<'t> SequenceDecoder<'t> {
    /// Validates `params` ([`DecodeParams::validate`]).
    pub fn new(tokenizer: &'t Tokenizer, params: DecodeParams) -> Result<Self> {
        params.validate()?;
        Ok(SequenceDecoder {
            tokenizer,
            sampler: Sampler::new(params.sampling.clone())?,
            penalties: Penalties::new(params.presence_penalty, params.frequency_penalty)?,
            scratch: Vec::new(),
            stop: StopMatcher::new(&params.stop),
            text: tokenizer.stream(),
            logprobs: params.logprobs.map(|k| LogprobTrack {
                k,
                ..LogprobTrack::default()
            }),
            generated: Vec::new(),
            context_room: None,
            finished: None,
            gather_full: false,
            params,
        })
    }

    /// The sequence's KV cache can take `room` more positions after the prompt: the decoder
    /// ends with [`FinishReason::ContextFull`] once a sampled token could not be fed back.
    pub fn set_context_room(&mut self, room: usize) {
        self.context_room = Some(room);
    }

    pub fn params(&self) -> &DecodeParams {
        &self.params
    }

    /// Generated tokens so far, end-of-sequence excluded.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Why the sequence ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finished
    }

    /// The token to feed next: the last one sampled while the sequence goes on.
    pub fn next_input(&self) -> Option<u32> {
        if self.finished.is_some() {
            None
        } else {
            self.generated.last().copied()
        }
    }

    /// Always ask for whole rows ([`RowNeed::Full`]): the gathered path, the oracle of
    /// distributed sampling.
    pub fn set_gather_full(&mut self, full: bool) {
        self.gather_full = full;
    }

    /// What the next step needs of its row: the whole row for penalties, a nucleus over the
    /// whole vocabulary (temperature without top-k) or more than [`MAX_CANDIDATES`] ids (or
    /// when [`SequenceDecoder::set_gather_full`] or [`force_gather`] says so); otherwise the
    /// most likely ids the sampler and the log-probability report look at.
    pub fn row_need(&self) -> RowNeed {
        let s = &self.params.sampling;
        let sampled = if s.temperature == 0.0 { 0 } else { s.top_k };
        let k = sampled.max(self.params.logprobs.unwrap_or(0)).max(1);
        if self.gather_full
            || force_gather()
            || self.penalties.is_active()
            || k > MAX_CANDIDATES
            || !self.sampler.candidates_suffice(k)
        {
            RowNeed::Full
        } else {
            RowNeed::Candidates {
                k: k as u32,
                lse: self.logprobs.is_some(),
            }
        }
    }

    /// Samples the next token from the sequence's row `logits [vocab]` and says what it shows
    /// and whether the sequence ended. A finished decoder refuses further steps.
    pub fn step(&mut self, logits: &[f32]) -> Result<Step> {
        self.step_row(Row::Full(logits))
    }

    /// [`SequenceDecoder::step`] from a row as the forward step returned it: whole, or as
    /// the candidates [`SequenceDecoder::row_need`] asked for (the same token and reports).
    pub fn step_row(&mut self, row: Row<'_>) -> Result<Step> {
        if self.finished.is_some() {
            return Err(EngineError::Internal(
                "the sequence has finished; it takes no more steps".into(),
            ));
        }
        let token = match row {
            Row::Full(logits) if self.penalties.is_active() => {
                self.scratch.clear();
                self.scratch.extend_from_slice(logits);
                self.penalties.apply(&mut self.scratch);
                self.sampler.sample(&self.scratch)?
            }
            Row::Full(logits) => self.sampler.sample(logits)?,
            Row::Candidates(_) if self.penalties.is_active() => {
                return Err(EngineError::Internal(
                    "penalties need the whole row, not candidates".into(),
                ))
            }
            Row::Candidates(c) if c.nan => return Err(EngineError::NanLogits),
            Row::Candidates(c) => self.sampler.sample_candidates(&c.top, c.vocab)?,
        };
        if !self.params.ignore_eos && self.tokenizer.eos_ids().contains(&token) {
            let finished = self.finish(FinishReason::Eos)?;
            return Ok(Step {
                token,
                shown: Emitted::default(),
                finished: Some(finished),
            });
        }
        self.generated.push(token);
        self.penalties.observe(token);
        if let Some(track) = &mut self.logprobs {
            let lp = match row {
                Row::Full(logits) => top_logprobs(logits, token, track.k)?,
                Row::Candidates(c) => candidate_logprobs(c, token, track.k)?,
            };
            let entry = logprob_entry(lp, self.tokenizer)?;
            track.pending.push_back((entry, None));
        }
        let mut shown = Emitted::default();
        let piece = self
            .text
            .push(token)
            .map_err(|source| EngineError::Decode { token, source })?;
        if let Some(piece) = piece {
            if let Some(track) = &mut self.logprobs {
                track.place(&piece);
            }
            shown.text = self.stop.push(&piece);
            if let Some(track) = &mut self.logprobs {
                shown.logprobs = track.release(&shown.text);
            }
        }
        let reason = if self.stop.is_stopped() {
            Some(FinishReason::Stop)
        } else if self.generated.len() >= self.params.max_tokens {
            Some(FinishReason::Length)
        } else if self
            .context_room
            .is_some_and(|room| self.generated.len() > room)
        {
            Some(FinishReason::ContextFull)
        } else {
            None
        };
        let finished = match reason {
            Some(why) => Some(self.finish(why)?),
            None => None,
        };
        Ok(Step {
            token,
            shown,
            finished,
        })
    }

    /// Ends the sequence now (for `why`, unless the held-back text completes a stop string,
    /// which makes it [`FinishReason::Stop`]) and releases what was held back. Ending an ended
    /// sequence again releases nothing and keeps the first reason.
    pub fn finish(&mut self, why: FinishReason) -> Result<Finished> {
        if let Some(reason) = self.finished {
            return Ok(Finished {
                reason,
                tail: Emitted::default(),
            });
        }
        let mut why = why;
        let mut tail = Emitted::default();
        if !self.stop.is_stopped() {
            let piece = self.text.finish().map_err(|source| EngineError::Decode {
                token: self.generated.last().copied().unwrap_or_default(),
                source,
            })?;
            if let Some(piece) = piece {
                if let Some(track) = &mut self.logprobs {
                    track.place(&piece);
                }
                tail.text.push_str(&self.stop.push(&piece));
            }
            if self.stop.is_stopped() {
                why = FinishReason::Stop;
            } else {
                tail.text.push_str(&self.stop.finish());
            }
        }
        if let Some(track) = &mut self.logprobs {
            tail.logprobs = track.release(&tail.text);
            if !self.stop.is_stopped() {
                tail.logprobs.extend(track.release_all());
            }
        }
        self.finished = Some(why);
        Ok(Finished { reason: why, tail })
    }
}

/// Log-probability entries waiting for their text to pass the stop matcher.
#[derive(Debug, Default)]
struct LogprobTrack {
    /// Alternatives per token.
    k: usize,
    /// In generation order: each with the byte offset where its text starts in the text given
    /// to the stop matcher (`None` while its text has not come out of the detokenizer).
    pending: VecDeque<(LogprobEntry, Option<usize>)>,
    /// Text given to the stop matcher so far: bytes and characters.
    pushed_bytes: usize,
    pushed_chars: usize,
    /// Bytes the stop matcher let through so far.
    shown_bytes: usize,
}

impl LogprobTrack {
    /// Gives every token still without text a place at the start of `piece`.
    fn place(&mut self, piece: &str) {
        for (entry, start) in self.pending.iter_mut().rev() {
            if start.is_some() {
                break;
            }
            *start = Some(self.pushed_bytes);
            entry.text_offset = self.pushed_chars;
        }
        self.pushed_bytes += piece.len();
        self.pushed_chars += piece.chars().count();
    }

    /// Takes the entries of tokens some of whose text is now shown.
    fn release(&mut self, shown: &str) -> Vec<LogprobEntry> {
        self.shown_bytes += shown.len();
        let mut out = Vec::new();
        while let Some((_, Some(start))) = self.pending.front() {
            if *start >= self.shown_bytes {
                break;
            }
            if let Some((entry, _)) = self.pending.pop_front() {
                out.push(entry);
            }
        }
        out
    }

    /// Generation ended without a stop string: everything left is part of the answer.
    fn release_all(&mut self) -> Vec<LogprobEntry> {
        let chars = self.pushed_chars;
        self.pending
            .drain(..)
            .map(|(mut entry, start)| {
                if start.is_none() {
                    entry.text_offset = chars;
                }
                entry
            })
            .collect()
    }
}

/// The log-probability report of a sampled token (of the raw row).
fn logprob_entry(lp: TokenLogprobs, tokenizer: &Tokenizer) -> Result<LogprobEntry> {
    let info = |id: u32, logprob: f64| {
        tokenizer
            .token_bytes(id)
            .map(|b| TokenInfo::new(b, logprob))
            .map_err(|source| EngineError::Decode { token: id, source })
    };
    Ok(LogprobEntry {
        chosen: info(lp.token, lp.logprob)?,
        top: lp
            .top
            .iter()
            .map(|&(id, l)| info(id, l))
            .collect::<Result<_>>()?,
        text_offset: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const EOS: u32 = 256;

    /// Byte ids 0..256 plus `<|endoftext|>` (256, an end-of-sequence token).
    fn tokenizer() -> Tokenizer {
        Tokenizer::bytes(&["<|endoftext|>"])
    }

    /// A row that makes `id` the greedy choice, with `second` the runner-up.
    fn row_for(id: u32, second: u32) -> Vec<f32> {
        let mut row = vec![0.0f32; 257];
        row[second as usize] = 4.0;
        row[id as usize] = 5.0;
        row
    }

    /// Runs the decoder over rows choosing `ids` in turn (then EOS forever): the shown text,
    /// the finish reason and every report, in order.
    fn run(params: DecodeParams, ids: &[u32]) -> (String, FinishReason, Vec<LogprobEntry>) {
        let tok = tokenizer();
        let mut d = SequenceDecoder::new(&tok, params).unwrap();
        let mut text = String::new();
        let mut reports = Vec::new();
        for i in 0.. {
            let id = ids.get(i).copied().unwrap_or(EOS);
            let step = d.step(&row_for(id, b'z' as u32)).unwrap();
            assert_eq!(step.token, id);
            text.push_str(&step.shown.text);
            reports.extend(step.shown.logprobs);
            if let Some(f) = step.finished {
                text.push_str(&f.tail.text);
                reports.extend(f.tail.logprobs);
                assert!(d.next_input().is_none());
                assert!(d.step(&row_for(1, 2)).is_err(), "a finished decoder steps");
                return (text, f.reason, reports);
            }
            assert_eq!(d.next_input(), Some(id));
        }
        unreachable!()
    }

    fn bytes(s: &str) -> Vec<u32> {
        s.bytes().map(u32::from).collect()
    }

    #[test]
    fn eos_length_and_stop_end_the_sequence() {
        let (text, why, _) = run(DecodeParams::greedy(100), &bytes("hi"));
        assert_eq!((text.as_str(), why), ("hi", FinishReason::Eos));
        let (text, why, _) = run(DecodeParams::greedy(3), &bytes("hello"));
        assert_eq!((text.as_str(), why), ("hel", FinishReason::Length));
        let p = DecodeParams {
            stop: vec!["ll".into()],
            ..DecodeParams::greedy(100)
        };
        let (text, why, _) = run(p, &bytes("hello"));
        assert_eq!((text.as_str(), why), ("he", FinishReason::Stop));
        // ignore_eos: the end token is an ordinary token (its text is skipped).
        let p = DecodeParams {
            ignore_eos: true,
            ..DecodeParams::greedy(4)
        };
        let (text, why, _) = run(p, &bytes("ab"));
        assert_eq!((text.as_str(), why), ("ab", FinishReason::Length));
    }

    #[test]
    fn stop_prefixes_are_held_back_until_they_cannot_match() {
        let tok = tokenizer();
        let p = DecodeParams {
            stop: vec!["END".into()],
            ..DecodeParams::greedy(100)
        };
        let mut d = SequenceDecoder::new(&tok, p).unwrap();
        let shown: Vec<String> = bytes("aENx")
            .iter()
            .map(|&id| d.step(&row_for(id, 0)).unwrap().shown.text)
            .collect();
        assert_eq!(shown, vec!["a", "", "", "ENx"]);
        // Held back when the sequence ends without a match: released in the tail.
        let mut d = SequenceDecoder::new(
            &tok,
            DecodeParams {
                stop: vec!["END".into()],
                ..DecodeParams::greedy(2)
            },
        )
        .unwrap();
        assert_eq!(d.step(&row_for(b'a'.into(), 0)).unwrap().shown.text, "a");
        let last = d.step(&row_for(b'E'.into(), 0)).unwrap();
        assert_eq!(last.shown.text, "");
        let f = last.finished.unwrap();
        assert_eq!(
            (f.reason, f.tail.text.as_str()),
            (FinishReason::Length, "E")
        );
    }

    #[test]
    fn characters_split_over_tokens_come_out_whole() {
        // "é" is two byte tokens; nothing shows until the second.
        let p = DecodeParams {
            logprobs: Some(0),
            ..DecodeParams::greedy(100)
        };
        let (text, _, reports) = run(p, &bytes("xé"));
        assert_eq!(text, "xé");
        let offsets: Vec<usize> = reports.iter().map(|e| e.text_offset).collect();
        assert_eq!(offsets, vec![0, 1, 1]);
        assert_eq!(reports[1].chosen.bytes, vec![0xc3]);
    }

    #[test]
    fn logprobs_are_of_the_raw_row_and_skip_stopped_text() {
        let p = DecodeParams {
            logprobs: Some(2),
            stop: vec!["c".into()],
            ..DecodeParams::greedy(100)
        };
        let (text, why, reports) = run(p, &bytes("abcd"));
        assert_eq!((text.as_str(), why), ("ab", FinishReason::Stop));
        // "c" is inside the stop string: not reported.
        assert_eq!(reports.len(), 2);
        let row = row_for(b'a'.into(), b'z'.into());
        let want = crate::logits::log_softmax(&row);
        let e = &reports[0];
        assert_eq!(e.chosen.token, "a");
        assert_eq!(e.chosen.logprob, want[b'a' as usize]);
        let top: Vec<&str> = e.top.iter().map(|t| t.token.as_str()).collect();
        assert_eq!(top, vec!["a", "z"]);
        assert!(e.top[0].logprob >= e.top[1].logprob && e.chosen.logprob < 0.0);
    }

    #[test]
    fn penalties_change_the_choice_but_not_the_logprobs() {
        // 'a' leads 'b' by 1.0: a frequency penalty of 2 makes 'b' win after one 'a'.
        let tok = tokenizer();
        let mut row = vec![-10.0f32; 257];
        row[b'a' as usize] = 3.0;
        row[b'b' as usize] = 2.0;
        let p = DecodeParams {
            frequency_penalty: 2.0,
            logprobs: Some(1),
            ..DecodeParams::greedy(4)
        };
        let mut d = SequenceDecoder::new(&tok, p).unwrap();
        let steps: Vec<Step> = (0..4).map(|_| d.step(&row).unwrap()).collect();
        let ids: Vec<u32> = steps.iter().map(|s| s.token).collect();
        assert_eq!(ids, bytes("abab"));
        // The reports are of the raw row: 'b' keeps its own log-probability and 'a' stays
        // the most likely alternative although the penalty made 'b' the choice.
        let raw = crate::logits::log_softmax(&row);
        let e = &steps[1].shown.logprobs[0];
        assert_eq!(e.chosen.logprob, raw[b'b' as usize]);
        assert_eq!(e.top[0].token, "a");
        assert!(e.top[0].logprob > e.chosen.logprob);
        let mut plain = SequenceDecoder::new(&tok, DecodeParams::greedy(4)).unwrap();
        let ids: Vec<u32> = (0..4).map(|_| plain.step(&row).unwrap().token).collect();
        assert_eq!(ids, bytes("aaaa"));
        // Presence penalty: once per distinct token, however often it occurred
        // (a: 3 - 1.5 = 1.5 beats b: 2 - 1.5 once both have been seen).
        let p = DecodeParams {
            presence_penalty: 1.5,
            ..DecodeParams::greedy(4)
        };
        let mut d = SequenceDecoder::new(&tok, p).unwrap();
        let ids: Vec<u32> = (0..4).map(|_| d.step(&row).unwrap().token).collect();
        assert_eq!(ids, bytes("abaa"));
    }

    #[test]
    fn a_full_cache_ends_with_context_full() {
        let tok = tokenizer();
        let mut d = SequenceDecoder::new(&tok, DecodeParams::greedy(100)).unwrap();
        // Room for 2 positions: 2 tokens are fed back, the third is the last sampled.
        d.set_context_room(2);
        let mut reasons = Vec::new();
        for id in bytes("abc") {
            reasons.push(d.step(&row_for(id, 0)).unwrap().finished.map(|f| f.reason));
        }
        assert_eq!(reasons, vec![None, None, Some(FinishReason::ContextFull)]);
        assert_eq!(d.generated(), &bytes("abc")[..]);
        assert_eq!(FinishReason::ContextFull.as_str(), "length");
    }

    #[test]
    fn bad_parameters_and_rows_are_errors() {
        let tok = tokenizer();
        for (p, name) in [
            (DecodeParams::greedy(0), "max_tokens"),
            (
                DecodeParams {
                    presence_penalty: 2.5,
                    ..DecodeParams::greedy(1)
                },
                "presence_penalty",
            ),
            (
                DecodeParams {
                    logprobs: Some(21),
                    ..DecodeParams::greedy(1)
                },
                "logprobs",
            ),
        ] {
            match SequenceDecoder::new(&tok, p) {
                Err(EngineError::Param { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{name}: {other:?}"),
            }
        }
        let mut d = SequenceDecoder::new(&tok, DecodeParams::greedy(5)).unwrap();
        assert!(matches!(
            d.step(&[f32::NAN; 257]),
            Err(EngineError::NanLogits)
        ));
        // A token the tokenizer does not know (the row is wider than the vocabulary).
        let mut d = SequenceDecoder::new(&tok, DecodeParams::greedy(5)).unwrap();
        let mut wide = vec![0.0f32; 300];
        wide[299] = 1.0;
        assert!(matches!(
            d.step(&wide),
            Err(EngineError::Decode { token: 299, .. })
        ));
    }

    fn entry(tag: u8) -> LogprobEntry {
        LogprobEntry {
            chosen: TokenInfo::new(vec![tag], -1.0),
            top: Vec::new(),
            text_offset: usize::MAX,
        }
    }

    /// Feeds `(tag, piece)` tokens through a track and a stop matcher as the decoder does
    /// (pieces of several characters, which the byte tokenizer cannot make); returns the
    /// shown text and the tags and offsets of the reported tokens.
    fn track(stops: &[&str], tokens: &[(u8, Option<&str>)]) -> (String, Vec<(u8, usize)>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut stop = StopMatcher::new(&stops);
        let mut track = LogprobTrack::default();
        let mut text = String::new();
        let mut reported = Vec::new();
        for &(tag, piece) in tokens {
            if stop.is_stopped() {
                break;
            }
            track.pending.push_back((entry(tag), None));
            if let Some(piece) = piece {
                track.place(piece);
                let shown = stop.push(piece);
                reported.extend(track.release(&shown));
                text.push_str(&shown);
            }
        }
        let tail = stop.finish();
        reported.extend(track.release(&tail));
        if !stop.is_stopped() {
            reported.extend(track.release_all());
        }
        text.push_str(&tail);
        let tags = reported
            .iter()
            .map(|e| (e.chosen.bytes[0], e.text_offset))
            .collect();
        (text, tags)
    }

    #[test]
    fn tokens_are_reported_with_their_text() {
        // No stop: every token, offsets in characters.
        let (text, tags) = track(
            &[],
            &[(1, Some("é")), (2, None), (3, Some("ab")), (4, None)],
        );
        assert_eq!(text, "éab");
        assert_eq!(tags, vec![(1, 0), (2, 1), (3, 1), (4, 3)]);
    }

    #[test]
    fn tokens_inside_a_stop_sequence_are_dropped() {
        // "abc E" reaches into the stop "END": reported; "ND" and later: not.
        let (text, tags) = track(
            &["END"],
            &[(1, Some("abc E")), (2, Some("ND")), (3, Some("x"))],
        );
        assert_eq!(text, "abc ");
        assert_eq!(tags, vec![(1, 0)]);
        // A token that starts the stop sequence is not reported.
        let (text, tags) = track(
            &["END"],
            &[(1, Some("ab")), (2, Some("E")), (3, Some("ND"))],
        );
        assert_eq!(text, "ab");
        assert_eq!(tags, vec![(1, 0)]);
        // A near miss releases the held-back tokens.
        let (text, tags) = track(&["END"], &[(1, Some("a")), (2, Some("E")), (3, Some("x"))]);
        assert_eq!(text, "aEx");
        assert_eq!(tags, vec![(1, 0), (2, 1), (3, 2)]);
        // Held back at the end without a match: reported at finish.
        let (text, tags) = track(&["END"], &[(1, Some("a")), (2, Some("EN"))]);
        assert_eq!(text, "aEN");
        assert_eq!(tags, vec![(1, 0), (2, 1)]);
    }
}
