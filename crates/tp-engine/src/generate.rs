//! Generation on the leader: batched prefill of the prompt (in chunks of [`PREFILL_CHUNK`]), then one decode step
//! per token, each step a [`Command::Forward`] that every rank executes. What each row's
//! logits mean (sampling, penalties, stop strings, text) is the [`SequenceDecoder`]'s work;
//! each step asks for what the decoder needs of its rows ([`SequenceDecoder::row_need`]):
//! the whole rows, or only each rank's candidates merged.

use crate::candidates::{RowNeed, StepLogits};
use crate::decoder::{Emitted, SequenceDecoder};
use crate::error::{EngineError, Result};
use crate::executor::StepExecutor;
use crate::protocol::{ChunkSpec, Command};
use crate::spec::Speculator;
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
    /// Target forward steps after the prompt's (one per token without speculation).
    pub decode_steps: usize,
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
///
/// With a [`Speculator`] (its `start` already called with the tokens the slot holds and
/// `new_tokens`), each decode step feeds the last token and the drafts together and takes
/// every row's logits: the decoder samples the rows in order, as it would one step at a
/// time, until its token differs from the row's draft; the positions of the rejected drafts
/// are dropped from the cache. Each row's logits are those a one-token step would give (the
/// forward pass's rows do not depend on their batch), and the decoder draws one random
/// number per token as without drafts, so the output is the output without speculation,
/// token for token, greedy or sampled with the same seed.
///
/// This is the speculative-sampling rule for a drafter whose distribution is a point mass
/// on its draft `d` (ours are deterministic): accept with probability `min(1, p(d)/q(d)) =
/// p(d)`, else draw from the residual `max(0, p - q)`, which is `p` without `d`. Drawing
/// `t ~ p` and accepting when `t == d` does exactly that: the draft is kept with probability
/// `p(d)`, and a rejection leaves `t` distributed as `p` restricted to the other tokens.
pub fn generate(
    exec: &mut dyn StepExecutor,
    slot: u32,
    new_tokens: &[u32],
    decoder: &mut SequenceDecoder<'_>,
    mut spec: Option<&mut Speculator>,
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
    let mut logits = StepLogits::default();
    for chunk in new_tokens.chunks(PREFILL_CHUNK) {
        logits = step(exec, slot, chunk.to_vec(), false, decoder.row_need())?;
    }
    let prefill = t0.elapsed();
    let t1 = Instant::now();
    // The drafts fed after the last token in the step whose rows `logits` holds.
    let mut drafts: Vec<u32> = Vec::new();
    let mut steps = 0;
    let mut step_time = 0.0;
    let finish = 'gen: loop {
        // Rows in order: row i follows draft i-1; the last row follows every draft.
        let (mut used, mut accepted) = (0, 0);
        let mut finished = None;
        for (i, row) in logits.rows().enumerate() {
            used = i + 1;
            let draft = drafts.get(i).copied();
            let out = decoder.step_row(row)?;
            if draft == Some(out.token) {
                accepted += 1;
            }
            let flow = if out.shown.is_empty() {
                Flow::Continue
            } else {
                on_text(&out.shown)
            };
            if let Some(done) = out.finished {
                if !done.tail.is_empty() {
                    on_text(&done.tail);
                }
                finished = Some(done.reason);
                break;
            }
            if flow == Flow::Stop {
                // The caller has what it wants; nothing held back is shown.
                finished = Some(decoder.finish(crate::FinishReason::Stop)?.reason);
                break;
            }
            if draft != Some(out.token) {
                break;
            }
        }
        if let Some(s) = spec.as_deref_mut() {
            if steps > 0 {
                s.record(drafts.len(), accepted, step_time);
            }
        }
        // The step fed the last token and every draft; keep the last token and the drafts
        // whose rows were used (an accepted draft's row produced the next token).
        if used <= drafts.len() {
            let keep = exec.slots().cached_len(slot) - (drafts.len() + 1 - used);
            exec.submit(Command::Truncate {
                slot,
                len: keep as u32,
            })?;
        }
        if let Some(reason) = finished {
            break 'gen reason;
        }
        let Some(token) = decoder.next_input() else {
            return Err(EngineError::Internal(
                "the decoder goes on without a token to feed".into(),
            ));
        };
        drafts = match spec.as_deref_mut() {
            Some(s) => {
                // Room: the cache takes the token and the drafts; more rows than tokens still
                // wanted are wasted.
                let room = capacity.saturating_sub(exec.slots().cached_len(slot) + 1);
                let wanted =
                    (decoder.params().max_tokens).saturating_sub(decoder.generated().len());
                s.draft(decoder.generated(), room.min(wanted.saturating_sub(1)))
            }
            None => Vec::new(),
        };
        let mut fed = Vec::with_capacity(1 + drafts.len());
        fed.push(token);
        fed.extend_from_slice(&drafts);
        steps += 1;
        let t = Instant::now();
        let need = decoder.row_need();
        logits = match spec.as_deref_mut().filter(|s| s.drafts_ahead()) {
            Some(s) if !drafts.is_empty() => {
                // The step after this one may feed the target's next token and drafts.
                let limit = capacity.saturating_sub(exec.slots().cached_len(slot) + fed.len());
                let generated = decoder.generated();
                let (result, panicked) = std::thread::scope(|scope| {
                    let ahead = scope.spawn(|| s.draft_ahead(generated, &drafts, limit));
                    let result = step(exec, slot, fed, true, need);
                    (result, ahead.join().is_err())
                });
                if panicked {
                    s.stop("the drafter panicked while drafting ahead");
                }
                result?
            }
            _ => step(exec, slot, fed, !drafts.is_empty(), need)?,
        };
        step_time = t.elapsed().as_secs_f64();
    };
    Ok(GenerationStats {
        prompt_tokens: new_tokens.len(),
        generated_tokens: decoder.generated().len(),
        decode_steps: steps,
        prefill,
        decode: t1.elapsed(),
        finish,
    })
}

/// One forward of `tokens` on `slot`: the last position's row, or every position's with
/// `all_logits`, each as `need` says (the decoder's need does not change within a step).
fn step(
    exec: &mut dyn StepExecutor,
    slot: u32,
    tokens: Vec<u32>,
    all_logits: bool,
    need: RowNeed,
) -> Result<StepLogits> {
    let mut chunk = ChunkSpec::new(slot, tokens).with_need(need);
    chunk.all_logits = all_logits;
    exec.forward(vec![chunk])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidates::RowNeed;
    use crate::decoder::DecodeParams;
    use crate::executor::ScriptedExecutor;
    use crate::spec::{DraftTokens, SpecStats};
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
        let stats = generate(
            &mut ex,
            7,
            b"abc".map(u32::from).as_slice(),
            &mut d,
            None,
            |e| {
                shown.push_str(&e.text);
                Flow::Continue
            },
        )
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
        let stats = generate(&mut ex, 1, &prompt, &mut d, None, |_| Flow::Continue).unwrap();
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
        let e = generate(&mut ex, 0, &[1, 2, 3], &mut d, None, |_| Flow::Continue).unwrap_err();
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
        let e = generate(&mut ex, 0, &[], &mut d, None, |_| Flow::Continue).unwrap_err();
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
        let stats = generate(&mut ex, 0, &[1, 2, 3], &mut d, None, |_| {
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

    /// Drafts from a known continuation: `right` proposes exactly what the script will
    /// produce (every draft accepted), otherwise each drafted token is off by one (every
    /// draft rejected).
    struct Known {
        text: &'static [u8],
        prompt: usize,
        right: bool,
    }

    impl crate::spec::Drafter for Known {
        fn draft(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>> {
            let at = history.len() - self.prompt;
            Ok((at..at + k)
                .map(|i| {
                    let t = self.text.get(i).map_or(256, |&b| u32::from(b));
                    if self.right {
                        t
                    } else {
                        (t + 1) % 257
                    }
                })
                .collect())
        }
    }

    type Outcome = (String, FinishReason, Vec<u32>, Vec<u32>);

    /// Generation of the byte script `text` after "abc" with `params`: shown text, finish,
    /// generated tokens, cache contents, and the decode steps and speculation counts.
    fn outcome(
        text: &'static [u8],
        capacity: u32,
        params: &DecodeParams,
        spec: Option<&mut Speculator>,
    ) -> (Outcome, usize) {
        let tok = Tokenizer::bytes(&["<|endoftext|>"]);
        let prompt = b"abc".map(u32::from);
        let mut ex = exec(text, 3);
        ex.submit(Command::Open { slot: 2, capacity }).unwrap();
        let mut d = SequenceDecoder::new(&tok, params.clone()).unwrap();
        let mut shown = String::new();
        let mut spec = spec;
        if let Some(s) = spec.as_deref_mut() {
            s.start(&[], &prompt);
        }
        let g = generate(&mut ex, 2, &prompt, &mut d, spec, |e| {
            shown.push_str(&e.text);
            Flow::Continue
        })
        .unwrap();
        assert_eq!(g.generated_tokens, d.generated().len());
        let out = (
            shown,
            g.finish,
            d.generated().to_vec(),
            ex.tokens(2).to_vec(),
        );
        (out, g.decode_steps)
    }

    /// Speculation with `right` or wrong drafts of `k` tokens gives the output and cache
    /// contents of plain decoding; returns the speculated run's decode steps and counts.
    fn same_with_speculation(
        text: &'static [u8],
        capacity: u32,
        params: DecodeParams,
        right: bool,
        k: DraftTokens,
    ) -> (usize, SpecStats) {
        let (plain, plain_steps) = outcome(text, capacity, &params, None);
        let mut spec = Speculator::new(
            Box::new(Known {
                text,
                prompt: 3,
                right,
            }),
            k,
        );
        let (fast, steps) = outcome(text, capacity, &params, Some(&mut spec));
        assert_eq!(plain, fast, "speculation changed the output ({params:?})");
        assert_eq!(
            spec.stats.steps, steps,
            "{k:?} right {right} cap {capacity} {params:?}"
        );
        if !right {
            // Rejected drafts cost nothing but rows: one token per step, as without.
            assert_eq!((steps, spec.stats.accepted), (plain_steps, 0));
        }
        // Drafting ahead during the verification steps: the same output; right drafts are
        // used ahead whenever a step follows a fully accepted one, wrong ones never.
        spec.set_draft_ahead(true);
        let (ahead, ahead_steps) = outcome(text, capacity, &params, Some(&mut spec));
        assert_eq!(
            plain, ahead,
            "drafting ahead changed the output ({params:?})"
        );
        let st = spec.stats;
        assert!(st.ahead_used <= st.ahead, "{st:?}");
        if right && st.verify_steps > 2 && params.sampling.temperature == 0.0 {
            assert!(st.ahead_used > 0, "{k:?} cap {capacity} {params:?}: {st:?}");
            assert!(
                ahead_steps <= steps,
                "{ahead_steps} steps ahead, {steps} without"
            );
        }
        if !right {
            assert_eq!(st.ahead_used, 0, "{st:?}");
        }
        (steps, spec.stats)
    }

    /// A drafter that panics on its second call, which drafting ahead makes on another
    /// thread during the first verification: drafting stops, the output stays.
    struct Panicky {
        known: Known,
        calls: usize,
    }

    impl crate::spec::Drafter for Panicky {
        fn draft(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>> {
            self.calls += 1;
            assert!(self.calls != 2, "the drafter broke on cue");
            self.known.draft(history, k)
        }
        fn costly(&self) -> bool {
            true
        }
    }

    #[test]
    fn a_drafter_panicking_ahead_stops_drafting_and_keeps_the_output() {
        let text = b"hello world";
        let params = DecodeParams::greedy(100);
        let (plain, _) = outcome(text, 64, &params, None);
        let known = Known {
            text,
            prompt: 3,
            right: true,
        };
        let mut spec =
            Speculator::new(Box::new(Panicky { known, calls: 0 }), DraftTokens::Fixed(2));
        assert!(spec.drafter_is_costly());
        spec.set_draft_ahead(true);
        let (got, _) = outcome(text, 64, &params, Some(&mut spec));
        assert_eq!(plain, got);
        assert_eq!((spec.stats.errors, spec.stats.ahead_used), (1, 0));
        assert!(spec
            .take_failure()
            .is_some_and(|w| w.contains("panicked while drafting ahead")));
    }

    #[test]
    fn speculation_changes_no_greedy_token() {
        for k in [
            DraftTokens::Fixed(1),
            DraftTokens::Fixed(3),
            DraftTokens::Adaptive,
        ] {
            for right in [true, false] {
                // EOS inside an accepted run.
                let (steps, st) =
                    same_with_speculation(b"hello world", 64, DecodeParams::greedy(100), right, k);
                if right {
                    // Drafts past the end token are never verified; all others are kept.
                    assert!(st.accepted > 0 && st.drafted - st.accepted <= 16, "{st:?}");
                    assert!(steps < 11, "{steps} steps for 11 tokens");
                }
                // max_tokens inside an accepted run, and a stop string in one.
                same_with_speculation(b"hello world", 64, DecodeParams::greedy(7), right, k);
                let p = DecodeParams {
                    stop: vec!["o w".into()],
                    ..DecodeParams::greedy(100)
                };
                same_with_speculation(b"hello world", 64, p, right, k);
                // Sampling with a seed: the tokens of plain sampling with that seed.
                for seed in 0..8 {
                    let p = DecodeParams {
                        sampling: crate::SamplingParams {
                            temperature: 1.5,
                            top_k: 0,
                            top_p: 1.0,
                            seed,
                        },
                        ..DecodeParams::greedy(12)
                    };
                    same_with_speculation(b"hello world", 64, p, right, k);
                }
                // The end of the context: capacity 9 holds "abc" and 6 fed tokens.
                for cap in [4, 5, 9, 13, 14, 15] {
                    same_with_speculation(b"hello world", cap, DecodeParams::greedy(100), right, k);
                }
            }
        }
    }

    /// Right drafts (the [`Known`] script's) that fail on cue: every `full`-th call the draft
    /// KV pool is full, and from call `fail_at` on the drafter errs.
    struct Faulty {
        known: Known,
        calls: usize,
        full: usize,
        fail_at: usize,
    }

    impl crate::spec::Drafter for Faulty {
        fn draft(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>> {
            self.calls += 1;
            if self.calls >= self.fail_at {
                return Err(EngineError::Internal("the draft forward broke".into()));
            }
            if self.calls.is_multiple_of(self.full) {
                return Err(EngineError::DraftKvFull {
                    needed: 1,
                    free: 0,
                    limit: 4,
                });
            }
            self.known.draft(history, k)
        }
    }

    /// A drafter's errors never fail the sequence: a full draft pool skips that step's
    /// drafts, any other error stops drafting (told once); the output is plain decoding's.
    #[test]
    fn drafter_errors_leave_the_output_unchanged() {
        let text: &'static [u8] = b"hello world, hello there";
        let params = DecodeParams::greedy(100);
        let (plain, plain_steps) = outcome(text, 64, &params, None);
        for (full, fail_at) in [(2, usize::MAX), (3, 4), (usize::MAX, 1)] {
            let known = Known {
                text,
                prompt: 3,
                right: true,
            };
            let faulty = Faulty {
                known,
                calls: 0,
                full,
                fail_at,
            };
            let mut spec = Speculator::new(Box::new(faulty), DraftTokens::Fixed(2));
            let (fast, steps) = outcome(text, 64, &params, Some(&mut spec));
            assert_eq!(plain, fast, "full every {full}, failing at {fail_at}");
            let st = spec.stats;
            let failed = fail_at != usize::MAX;
            assert_eq!(st.errors, usize::from(failed), "{st:?}");
            if failed {
                // Told once; the steps after the error decode one token each.
                let why = spec.take_failure().map(str::to_string);
                assert_eq!(why.as_deref(), Some("the draft forward broke"));
                assert_eq!(spec.take_failure(), None);
                assert!(steps > plain_steps / 2, "{steps}");
            } else {
                assert_eq!(spec.take_failure(), None);
                // Every other call found the pool full; the others drafted and were kept.
                assert!(st.kv_full > 2 && st.accepted > 0, "{st:?}");
                assert!(steps < plain_steps, "{steps} vs {plain_steps}");
            }
            if full == 3 {
                assert_eq!((st.kv_full, st.errors), (1, 1), "{st:?}");
            }
        }
    }

    #[test]
    fn ngram_drafts_give_the_same_tokens() {
        // The script repeats its prompt-like text: n-gram drafts are accepted in part.
        let text: &'static [u8] = b"abcabd abcabd abcabx abcabd";
        let params = DecodeParams::greedy(100);
        let (plain, plain_steps) = outcome(text, 64, &params, None);
        for k in [
            DraftTokens::Fixed(2),
            DraftTokens::Fixed(8),
            DraftTokens::Adaptive,
        ] {
            let mut spec = Speculator::for_method(crate::spec::SpecMethod::Ngram, k);
            let (fast, steps) = outcome(text, 64, &params, Some(&mut spec));
            assert_eq!(plain, fast);
            let st = spec.stats;
            assert!(st.accepted > 0 && st.accepted < st.drafted, "{st:?}");
            assert!(steps < plain_steps, "{steps} vs {plain_steps}");
        }
    }

    /// A three-token "model" whose distribution depends on the last token: the joint law of
    /// the first three sampled tokens under speculative sampling (n-gram drafts, accepted and
    /// rejected) is the target's (chi-square, 26 degrees of freedom, significance 0.001:
    /// critical value 54.05), and each seed gives the tokens plain sampling gives.
    #[test]
    fn speculative_sampling_keeps_the_joint_distribution() {
        let tok = Tokenizer::bytes(&["<|endoftext|>"]);
        let logits_after = |last: u32| -> [f32; 3] {
            match last % 3 {
                0 => [1.0, 0.2, -0.5],
                1 => [-0.3, 0.9, 0.4],
                _ => [0.0, -1.0, 1.2],
            }
        };
        let probs = |last: u32| -> [f64; 3] {
            let l = logits_after(last);
            let w: Vec<f64> = l.iter().map(|&x| (x as f64).exp()).collect();
            let t: f64 = w.iter().sum();
            [w[0] / t, w[1] / t, w[2] / t]
        };
        // Tokens are 'a' + 0..3; the prompt ends with 'c' (2).
        let base = u32::from(b'a');
        let mut want = vec![0.0; 27];
        for (cell, w) in want.iter_mut().enumerate() {
            let (a, b, c) = (cell / 9, (cell / 3) % 3, cell % 3);
            *w = probs(2)[a] * probs(a as u32)[b] * probs(b as u32)[c];
        }
        let run = |seed: u64, drafts: bool| -> [u32; 3] {
            let mut ex = ScriptedExecutor::new(
                257,
                64,
                Box::new(move |_, held| {
                    let mut row = vec![f32::NEG_INFINITY; 257];
                    let last = held.last().map_or(0, |&t| t.wrapping_sub(base));
                    for (j, l) in logits_after(last).iter().enumerate() {
                        row[base as usize + j] = *l;
                    }
                    row
                }),
            );
            ex.submit(Command::Open {
                slot: 0,
                capacity: 64,
            })
            .unwrap();
            let params = DecodeParams {
                sampling: crate::SamplingParams {
                    temperature: 1.0,
                    top_k: 0,
                    top_p: 1.0,
                    seed,
                },
                ..DecodeParams::greedy(3)
            };
            let mut d = SequenceDecoder::new(&tok, params).unwrap();
            let prompt = b"abc".map(u32::from);
            let mut spec =
                Speculator::for_method(crate::spec::SpecMethod::Ngram, DraftTokens::Fixed(2));
            spec.start(&[], &prompt);
            generate(
                &mut ex,
                0,
                &prompt,
                &mut d,
                drafts.then_some(&mut spec),
                |_| Flow::Continue,
            )
            .unwrap();
            let g = d.generated();
            [g[0] - base, g[1] - base, g[2] - base]
        };
        let n = 20_000;
        let mut counts = vec![0usize; 27];
        for seed in 0..n {
            let [a, b, c] = run(seed, true);
            counts[(a * 9 + b * 3 + c) as usize] += 1;
        }
        let x2 = crate::sampling::tests::chi_square(&counts, &want);
        assert!(x2 < 54.05, "chi-square {x2}: {counts:?}");
        // Seeded runs repeat, and give the tokens plain sampling gives with the seed.
        for seed in 0..200 {
            assert_eq!(run(seed, true), run(seed, false), "seed {seed}");
        }
    }

    /// Candidates merged from 1..3 vocabulary shards (a scripted model: rows of random
    /// logits with repeated values, so ties cross shard boundaries) give the gathered rows'
    /// tokens and log-probability reports, bit for bit, greedy and seeded top-k/top-p, with
    /// and without n-gram drafts; penalties and a nucleus over the whole vocabulary ask for
    /// whole rows.
    #[test]
    fn candidates_from_shards_give_the_gathered_tokens_and_reports() {
        let tok = Tokenizer::bytes(&["<|endoftext|>"]);
        let run = |params: &DecodeParams, shards: usize, gather: bool, spec: bool| {
            let mut ex = ScriptedExecutor::new(
                257,
                128,
                Box::new(|_, held| {
                    let mut rng = tp_spec::Rng::new(held.iter().map(|&t| u64::from(t)).sum());
                    // Letters only, values on a coarse grid (ties), the end token unlikely.
                    let mut row = vec![f32::NEG_INFINITY; 257];
                    for l in &mut row[b'a' as usize..=b'z' as usize] {
                        *l = rng.below(8) as f32 * 0.5;
                    }
                    row[256] = -3.0;
                    row
                }),
            );
            ex.shards = shards;
            ex.submit(Command::Open {
                slot: 0,
                capacity: 128,
            })
            .unwrap();
            let mut d = SequenceDecoder::new(&tok, params.clone()).unwrap();
            d.set_gather_full(gather);
            let need = d.row_need();
            let prompt = b"abcabc".map(u32::from);
            let mut s =
                Speculator::for_method(crate::spec::SpecMethod::Ngram, DraftTokens::Fixed(3));
            s.start(&[], &prompt);
            let mut reports = Vec::new();
            generate(&mut ex, 0, &prompt, &mut d, spec.then_some(&mut s), |e| {
                reports.extend(e.logprobs.iter().cloned());
                Flow::Continue
            })
            .unwrap();
            let fed = ex.log.iter().filter_map(|c| match c {
                Command::Forward(chunks) => Some(chunks[0].need),
                _ => None,
            });
            assert!(fed.into_iter().all(|n| n == need), "{need:?}");
            (need, format!("{:?} {reports:?}", d.generated()))
        };
        let sampled = |top_k, top_p| DecodeParams {
            sampling: crate::SamplingParams {
                temperature: 0.9,
                top_k,
                top_p,
                seed: 11,
            },
            logprobs: Some(4),
            ..DecodeParams::greedy(24)
        };
        let cases = [
            (
                DecodeParams {
                    logprobs: Some(5),
                    ..DecodeParams::greedy(24)
                },
                RowNeed::Candidates { k: 5, lse: true },
            ),
            (
                DecodeParams::greedy(24),
                RowNeed::Candidates { k: 1, lse: false },
            ),
            (sampled(6, 0.8), RowNeed::Candidates { k: 6, lse: true }),
            (sampled(3, 1.0), RowNeed::Candidates { k: 4, lse: true }),
            (
                DecodeParams {
                    logprobs: None,
                    ..sampled(7, 0.9)
                },
                RowNeed::Candidates { k: 7, lse: false },
            ),
            (sampled(0, 0.8), RowNeed::Full),
            (
                DecodeParams {
                    presence_penalty: 0.5,
                    ..sampled(6, 0.8)
                },
                RowNeed::Full,
            ),
            (
                DecodeParams {
                    logprobs: Some(2),
                    ..sampled(65, 0.9)
                },
                RowNeed::Full,
            ),
        ];
        for (params, need) in &cases {
            for spec in [false, true] {
                let (full, want) = run(params, 1, true, spec);
                assert_eq!(full, RowNeed::Full);
                assert!(want.len() > 100, "{want}");
                for shards in 1..=3 {
                    let (got_need, got) = run(params, shards, false, spec);
                    assert_eq!(got_need, *need, "{params:?}");
                    assert_eq!(got, want, "{params:?}, {shards} shards, drafts {spec}");
                }
            }
        }
    }
}
