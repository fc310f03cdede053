//! Generation on the leader: one batched prefill pass over the prompt, then one decode step
//! per token, each step a [`Command::Forward`] that every rank executes.

use crate::error::{EngineError, Result};
use crate::protocol::{ChunkSpec, Command};
use crate::sampling::{Sampler, SamplingParams};
use crate::worker::Worker;
use std::time::{Duration, Instant};

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end-of-sequence token.
    Eos,
    /// `max_tokens` reached, or the sequence's cache is full.
    Length,
    /// The caller asked to stop (a stop sequence matched).
    Stop,
}

impl FinishReason {
    /// OpenAI's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos | FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What the caller's token callback wants next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    /// Tokens that end generation (not passed to the callback).
    pub eos_ids: Vec<u32>,
    pub sampling: SamplingParams,
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

/// Leader: feeds `new_tokens` to `slot` (already open; they follow whatever it holds), then
/// samples up to `opts.max_tokens` tokens, passing each to `on_token`. Returns the generated
/// tokens (EOS excluded) and timings. The last generated token is not in the cache.
pub fn generate(
    worker: &mut Worker,
    slot: u32,
    new_tokens: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32) -> Flow,
) -> Result<(Vec<u32>, GenerationStats)> {
    if new_tokens.is_empty() {
        return Err(EngineError::Param {
            name: "prompt",
            message: "it has no tokens; give some text".into(),
        });
    }
    let capacity = worker.capacity(slot);
    let cached = worker.cached_len(slot);
    if cached + new_tokens.len() > capacity {
        return Err(EngineError::Param {
            name: "prompt",
            message: format!(
                "{} tokens after {cached} cached do not fit the context of {capacity}; shorten it or raise --ctx-size",
                new_tokens.len()
            ),
        });
    }
    let mut sampler = Sampler::new(opts.sampling.clone())?;
    let mut out = Vec::new();
    let t0 = Instant::now();
    let mut logits = step(worker, slot, new_tokens.to_vec())?;
    let prefill = t0.elapsed();
    let t1 = Instant::now();
    let mut finish = FinishReason::Length;
    while out.len() < opts.max_tokens {
        let token = sampler.sample(&logits)?;
        if opts.eos_ids.contains(&token) {
            finish = FinishReason::Eos;
            break;
        }
        out.push(token);
        if on_token(token) == Flow::Stop {
            finish = FinishReason::Stop;
            break;
        }
        if out.len() == opts.max_tokens || worker.cached_len(slot) + 1 > worker.capacity(slot) {
            break;
        }
        logits = step(worker, slot, vec![token])?;
    }
    let stats = GenerationStats {
        prompt_tokens: new_tokens.len(),
        generated_tokens: out.len(),
        prefill,
        decode: t1.elapsed(),
        finish,
    };
    Ok((out, stats))
}

/// One forward of `tokens` on `slot`: the last position's full logits.
fn step(worker: &mut Worker, slot: u32, tokens: Vec<u32>) -> Result<Vec<f32>> {
    worker
        .submit(Command::Forward(vec![ChunkSpec {
            slot,
            tokens,
            all_logits: false,
        }]))?
        .ok_or_else(|| EngineError::Internal("forward returned no logits".into()))
}
