//! Generation on the leader: batched prefill of the prompt (in chunks of [`PREFILL_CHUNK`]), then one decode step
//! per token, each step a [`Command::Forward`] that every rank executes. What each row's
//! logits mean (sampling, penalties, stop strings, text) is the [`SequenceDecoder`]'s work.

use crate::decoder::{Emitted, SequenceDecoder};
use crate::error::{EngineError, Result};
use crate::executor::StepExecutor;
use crate::protocol::{ChunkSpec, Command};
use std::time::{Duration, Instant};

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end-of-sequence token.
    Eos,
    /// `max_tokens` reached.
    Length,
    /// The sequence's KV cache is full: the last token could not be fed back.
    ContextFull,
    /// The caller asked to stop (a stop string matched, or the text callback said so).
    Stop,
}

impl FinishReason {
    /// OpenAI's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos | FinishReason::Stop => "stop",
            FinishReason::Length | FinishReason::ContextFull => "length",
        }
    }
}

/// What the caller's text callback wants next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

#[derive(Clone, Debug)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill: Duration,
    pub decode: Duration,
    pub finish: FinishReason,
}

impl GenerationStats {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill.as_secs_f64().max(1e-9)
    }
    /// Decode steps per second (the first token comes from the prefill pass).
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

/// Most prompt tokens in one prefill step. Every rank holds a step's activations whole
/// (`[tokens, hidden]` residual, norm and f64 partial sums), so at tp 4 a 512-token step held
/// more than a 2048-token prompt's KV cache; 128 tokens still fill the many-token kernels
/// (measured: a 2150-token prompt prefills as fast in chunks of 128 as of 512, tp 1 and 2).
pub const PREFILL_CHUNK: usize = 128;

/// Leader: feeds `new_tokens` to `slot` (already open; they follow whatever it holds), then
/// decodes with `decoder` until it finishes, passing everything it shows to `on_text` (which
/// may end generation early with [`Flow::Stop`], reported as [`FinishReason::Stop`]). The
/// generated tokens are `decoder.generated()`; the last one is not in the cache.
pub fn generate(
    exec: &mut dyn StepExecutor,
    slot: u32,
    new_tokens: &[u32],
    decoder: &mut SequenceDecoder<'_>,
    mut on_text: impl FnMut(&Emitted) -> Flow,
) -> Result<GenerationStats> {
    if new_tokens.is_empty() {
        return Err(EngineError::Param {
            name: "prompt",
            message: "it has no tokens; give some text".into(),
        });
    }
    let capacity = exec.slots().capacity(slot);
    let cached = exec.slots().cached_len(slot);
    if cached + new_tokens.len() > capacity {
        return Err(EngineError::PromptTooLong {
            tokens: new_tokens.len(),
            cached,
            capacity,
        });
    }
    decoder.set_context_room(capacity - cached - new_tokens.len());
    let t0 = Instant::now();
    // The prompt goes in chunks: activation buffers stay bounded by the chunk, not the prompt
    // (the logits of all but the last chunk are not needed).
    let mut logits = Vec::new();
    for chunk in new_tokens.chunks(PREFILL_CHUNK) {
        logits = step(exec, slot, chunk.to_vec())?;
    }
    let prefill = t0.elapsed();
    let t1 = Instant::now();
    let finish = loop {
        let out = decoder.step(&logits)?;
        let flow = if out.shown.is_empty() {
            Flow::Continue
        } else {
            on_text(&out.shown)
        };
        if let Some(done) = out.finished {
            if !done.tail.is_empty() {
                on_text(&done.tail);
            }
            break done.reason;
        }
        if flow == Flow::Stop {
            // The caller has what it wants; nothing held back is shown.
            break decoder.finish(crate::FinishReason::Stop)?.reason;
        }
        let Some(token) = decoder.next_input() else {
            return Err(EngineError::Internal(
                "the decoder goes on without a token to feed".into(),
            ));
        };
        logits = step(exec, slot, vec![token])?;
    };
    Ok(GenerationStats {
        prompt_tokens: new_tokens.len(),
        generated_tokens: decoder.generated().len(),
        prefill,
        decode: t1.elapsed(),
        finish,
    })
}

/// One forward of `tokens` on `slot`: the last position's full logits.
fn step(exec: &mut dyn StepExecutor, slot: u32, tokens: Vec<u32>) -> Result<Vec<f32>> {
    exec.submit(Command::Forward(vec![ChunkSpec::new(slot, tokens)]))?
        .ok_or_else(|| EngineError::Internal("forward returned no logits".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoder::DecodeParams;
    use crate::executor::ScriptedExecutor;
    use tp_tokenizer::Tokenizer;

    /// A byte "model" that continues with the next byte of `text` after the prompt's length
    /// `prompt`, then the end token (256).
    fn exec(text: &'static [u8], prompt: usize) -> ScriptedExecutor {
        ScriptedExecutor::new(
            257,
            64,
            Box::new(move |_, held| {
                let mut row = vec![0.0f32; 257];
                let next = text.get(held.len() - prompt).map_or(256, |&b| b as usize);
                row[next] = 10.0;
                row
            }),
        )
    }

    fn run(
        text: &'static [u8],
        capacity: u32,
        params: DecodeParams,
    ) -> (String, GenerationStats, ScriptedExecutor) {
        let tok = Tokenizer::bytes(&["<|endoftext|>"]);
        let mut ex = exec(text, 3);
        ex.submit(Command::Open { slot: 7, capacity }).unwrap();
        let mut d = SequenceDecoder::new(&tok, params).unwrap();
        let mut shown = String::new();
        let stats = generate(&mut ex, 7, b"abc".map(u32::from).as_slice(), &mut d, |e| {
            shown.push_str(&e.text);
            Flow::Continue
        })
        .unwrap();
        assert_eq!(stats.generated_tokens, d.generated().len());
        (shown, stats, ex)
    }

    #[test]
    fn the_loop_feeds_back_every_token_but_the_last() {
        let (text, stats, ex) = run(b"hello", 64, DecodeParams::greedy(100));
        assert_eq!((text.as_str(), stats.finish), ("hello", FinishReason::Eos));
        // Prompt, then "hello" fed back; the end token never is.
        assert_eq!(ex.tokens(7), b"abchello".map(u32::from).as_slice());
        let (text, stats, ex) = run(b"hello", 64, DecodeParams::greedy(2));
        assert_eq!((text.as_str(), stats.finish), ("he", FinishReason::Length));
        assert_eq!(ex.tokens(7).len(), 4);
    }

    #[test]
    fn a_long_prompt_goes_in_chunks() {
        let tok = Tokenizer::bytes(&["<|endoftext|>"]);
        let prompt: Vec<u32> = (0..1100).map(|i| (i % 200) as u32).collect();
        let mut ex = ScriptedExecutor::new(
            257,
            2048,
            Box::new(|_, _| {
                let mut row = vec![0.0f32; 257];
                row[256] = 10.0;
                row
            }),
        );
        ex.submit(Command::Open {
            slot: 1,
            capacity: 2048,
        })
        .unwrap();
        let mut d = SequenceDecoder::new(&tok, DecodeParams::greedy(4)).unwrap();
        let stats = generate(&mut ex, 1, &prompt, &mut d, |_| Flow::Continue).unwrap();
        assert_eq!(stats.finish, FinishReason::Eos);
        let sizes: Vec<usize> = ex
            .log
            .iter()
            .filter_map(|c| match c {
                Command::Forward(chunks) => Some(chunks[0].tokens.len()),
                _ => None,
            })
            .collect();
        let mut want = vec![PREFILL_CHUNK; 1100 / PREFILL_CHUNK];
        want.push(1100 % PREFILL_CHUNK);
        assert_eq!(sizes, want);
        assert_eq!(ex.tokens(1), prompt.as_slice());
    }

    #[test]
    fn a_full_cache_ends_generation() {
        // Capacity 5: the prompt takes 3, two tokens are fed back, a third is sampled.
        let (text, stats, ex) = run(b"hello", 5, DecodeParams::greedy(100));
        assert_eq!(
            (text.as_str(), stats.finish),
            ("hel", FinishReason::ContextFull)
        );
        assert_eq!(ex.tokens(7).len(), 5);
    }

    #[test]
    fn a_prompt_that_does_not_fit_is_a_typed_error() {
        let tok = Tokenizer::bytes(&["<|endoftext|>"]);
        let mut ex = exec(b"x", 3);
        ex.submit(Command::Open {
            slot: 0,
            capacity: 2,
        })
        .unwrap();
        let mut d = SequenceDecoder::new(&tok, DecodeParams::greedy(1)).unwrap();
        let e = generate(&mut ex, 0, &[1, 2, 3], &mut d, |_| Flow::Continue).unwrap_err();
        assert!(
            matches!(
                e,
                EngineError::PromptTooLong {
                    tokens: 3,
                    cached: 0,
                    capacity: 2
                }
            ),
            "{e:?}"
        );
        let e = generate(&mut ex, 0, &[], &mut d, |_| Flow::Continue).unwrap_err();
        assert!(
            matches!(e, EngineError::Param { name: "prompt", .. }),
            "{e:?}"
        );
    }

    #[test]
    fn the_callback_can_stop_early() {
        let tok = Tokenizer::bytes(&["<|endoftext|>"]);
        let mut ex = exec(b"hello", 3);
        ex.submit(Command::Open {
            slot: 0,
            capacity: 64,
        })
        .unwrap();
        let mut d = SequenceDecoder::new(&tok, DecodeParams::greedy(100)).unwrap();
        let mut calls = 0;
        let stats = generate(&mut ex, 0, &[1, 2, 3], &mut d, |_| {
            calls += 1;
            if calls == 2 {
                Flow::Stop
            } else {
                Flow::Continue
            }
        })
        .unwrap();
        assert_eq!((stats.finish, d.generated().len()), (FinishReason::Stop, 2));
    }
}
