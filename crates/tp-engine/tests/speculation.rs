//! Speculative decoding on the real SmolLM2 at tp 1..3 (rank threads): a verification step's
//! rows are the one-token steps' logits bit for bit (also after rejected positions were
//! dropped from the cache), and greedy generation gives the plain output token for token with
//! n-gram drafts, drafts that are always accepted (an oracle that knows the plain output),
//! always rejected (the oracle's tokens off by one), with stop strings and end-of-sequence
//! inside accepted runs and at the end of the context.

use tp_engine::draft_model::{DraftModelError, DraftModelSource, ModelDrafter};
use tp_engine::{
    generate, ChunkSpec, Command, DecodeParams, DraftTokens, Drafter, FinishReason, Flow,
    SequenceDecoder, SpecMethod, Speculator, Worker,
};
use tp_models::{GgufCheckpoint, KvDtype, LoadOptions};
use tp_tokenizer::Tokenizer;

const CTX: usize = 512;

mod common;

/// Runs `lead` on rank 0's worker of SmolLM2 at `tp` (the followers follow); its result.
fn on_workers<T: Send>(
    tp: usize,
    kv: KvDtype,
    lead: impl Fn(&mut Worker, &Tokenizer) -> T + Sync,
) -> Option<T> {
    let path = tp_testkit::smollm2()?;
    let ckpt = GgufCheckpoint::open(&path).unwrap();
    let tok = Tokenizer::from_gguf_file(&path).unwrap();
    let opts = LoadOptions {
        kv_dtype: kv,
        ..LoadOptions::default()
    };
    Some(common::on_workers(&ckpt, tp, opts, CTX, |w| lead(w, &tok)))
}

fn forward(w: &mut Worker, slot: u32, tokens: &[u32], all: bool) -> Vec<f32> {
    let mut c = ChunkSpec::new(slot, tokens.to_vec());
    c.all_logits = all;
    w.submit(Command::Forward(vec![c])).unwrap().unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn verification_rows_are_the_one_token_steps_logits() {
    let prompt: Vec<u32> = vec![1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173];
    let next: Vec<u32> = vec![28, 665, 436, 253, 1165, 30_000, 7, 49_000];
    for kv in [KvDtype::F16, KvDtype::F32] {
        for tp in 1..=3 {
            let Some(()) = on_workers(tp, kv, |w, _| {
                let vocab = w.model().config().vocab;
                // One token at a time.
                w.submit(Command::Open {
                    slot: 0,
                    capacity: 64,
                })
                .unwrap();
                forward(w, 0, &prompt, false);
                let one: Vec<Vec<f32>> = next.iter().map(|&t| forward(w, 0, &[t], false)).collect();
                // All eight in one step, every row.
                w.submit(Command::Open {
                    slot: 1,
                    capacity: 64,
                })
                .unwrap();
                forward(w, 1, &prompt, false);
                let many = forward(w, 1, &next, true);
                for (i, row) in many.chunks_exact(vocab).enumerate() {
                    assert_eq!(bits(row), bits(&one[i]), "{kv} tp {tp}: row {i}");
                }
                // Drop the last five positions (rejected drafts), verify again from there.
                let len = (prompt.len() + 3) as u32;
                w.submit(Command::Truncate { slot: 1, len }).unwrap();
                let again = forward(w, 1, &next[3..], true);
                for (i, row) in again.chunks_exact(vocab).enumerate() {
                    assert_eq!(
                        bits(row),
                        bits(&one[3 + i]),
                        "{kv} tp {tp}: after rollback, row {i}"
                    );
                }
                for slot in [0, 1] {
                    w.submit(Command::Close { slot }).unwrap();
                }
            }) else {
                eprintln!("SmolLM2 is not installed: skipped");
                return;
            };
        }
    }
}

/// Drafts the known plain output (right), or each of its tokens plus one (always rejected).
struct Oracle {
    want: Vec<u32>,
    prompt: usize,
    right: bool,
    vocab: u32,
}

impl Drafter for Oracle {
    fn draft(&mut self, history: &[u32], k: usize) -> tp_engine::Result<Vec<u32>> {
        let at = history.len() - self.prompt;
        Ok(self
            .want
            .iter()
            .skip(at)
            .take(k)
            .map(|&t| if self.right { t } else { (t + 1) % self.vocab })
            .collect())
    }
}

/// What a generation gave: text, finish, tokens, cached positions.
type Outcome = (String, FinishReason, Vec<u32>, usize);

fn run(
    w: &mut Worker,
    tok: &Tokenizer,
    ids: &[u32],
    params: &DecodeParams,
    capacity: usize,
    spec: Option<&mut Speculator>,
) -> Outcome {
    w.submit(Command::Open {
        slot: 0,
        capacity: capacity as u32,
    })
    .unwrap();
    let mut d = SequenceDecoder::new(tok, params.clone()).unwrap();
    let mut text = String::new();
    let mut spec = spec;
    if let Some(s) = spec.as_deref_mut() {
        s.start(&[], ids);
    }
    let g = generate(w, 0, ids, &mut d, spec, |e| {
        text.push_str(&e.text);
        Flow::Continue
    })
    .unwrap();
    let cached = w.slots().cached_len(0);
    w.submit(Command::Close { slot: 0 }).unwrap();
    (text, g.finish, d.generated().to_vec(), cached)
}

#[test]
fn greedy_output_is_unchanged_by_speculation_at_tp_1_to_3() {
    const PROMPTS: [&str; 2] = [
        "Repeat this list exactly: apples, bananas, cherries, dates, figs, grapes, kiwis. \
         Now repeat it again: apples, bananas,",
        "Once upon a time, there was a little",
    ];
    for tp in 1..=3 {
        let Some(()) = on_workers(tp, KvDtype::F16, |w, tok| {
            let vocab = w.model().config().vocab as u32;
            // Both prompts at tp 1; the quoting one (long accepted runs) at tp 2 and 3.
            for prompt in &PROMPTS[..if tp == 1 { 2 } else { 1 }] {
                let ids = tok.encode(prompt).unwrap();
                // Plain runs: to the end of sequence or 40 tokens; with a stop string; with
                // the context ending 12 tokens after the prompt.
                let stop = DecodeParams {
                    stop: vec![" kiwi".into(), " play".into()],
                    ..DecodeParams::greedy(40)
                };
                let cases = [
                    (DecodeParams::greedy(40), CTX),
                    (stop, CTX),
                    (DecodeParams::greedy(40), ids.len() + 12),
                ];
                for (params, cap) in &cases {
                    let plain = run(w, tok, &ids, params, *cap, None);
                    assert!(plain.2.len() > 3, "tp {tp}: {plain:?}");
                    let mut spec: Vec<(String, Speculator)> = vec![
                        (
                            "ngram adaptive".into(),
                            Speculator::for_method(SpecMethod::Ngram, DraftTokens::Adaptive),
                        ),
                        (
                            "ngram k=1".into(),
                            Speculator::for_method(SpecMethod::Ngram, DraftTokens::Fixed(1)),
                        ),
                        (
                            "ngram k=8".into(),
                            Speculator::for_method(SpecMethod::Ngram, DraftTokens::Fixed(8)),
                        ),
                    ];
                    for right in [true, false] {
                        let oracle = Oracle {
                            want: plain.2.clone(),
                            prompt: ids.len(),
                            right,
                            vocab,
                        };
                        spec.push((
                            format!("oracle right={right}"),
                            Speculator::new(Box::new(oracle), DraftTokens::Fixed(5)),
                        ));
                    }
                    for (name, s) in spec.iter_mut() {
                        let got = run(w, tok, &ids, params, *cap, Some(s));
                        assert_eq!(got, plain, "tp {tp}, {name}, {prompt:?}, {params:?}");
                        let st = s.stats;
                        if name == "oracle right=true" {
                            assert!(st.accepted >= st.drafted.saturating_sub(5), "{st:?}");
                            assert!(st.steps * 2 <= plain.2.len() + 1, "{st:?}");
                        }
                        if name == "oracle right=false" {
                            assert_eq!(st.accepted, 0, "{st:?}");
                            assert!(st.drafted > 0);
                        }
                    }
                }
            }
        }) else {
            eprintln!("SmolLM2 is not installed: skipped");
            return;
        };
    }
}

/// A draft model on rank 0: SmolLM2 drafting for itself (always accepted) and its f32
/// dequantized copy (other numerics: now and then rejected, so the draft's cache is rolled
/// back) give the plain greedy output at tp 1..3.
#[test]
fn a_draft_model_changes_no_greedy_token() {
    let Some(path) = tp_testkit::smollm2() else {
        eprintln!("SmolLM2 is not installed: skipped");
        return;
    };
    for tp in 1..=3 {
        on_workers(tp, KvDtype::F16, |w, tok| {
            let vocab = w.model().config().vocab;
            let ids = tok
                .encode("Repeat this list exactly: apples, bananas, cherries, dates, figs. Again: apples,")
                .unwrap();
            let params = DecodeParams::greedy(32);
            let plain = run(w, tok, &ids, &params, CTX, None);
            for keep_quantized in [true, false] {
                let opts = LoadOptions {
                    keep_quantized,
                    ..LoadOptions::default()
                };
                for k in [DraftTokens::Fixed(4), DraftTokens::Adaptive] {
                    let mut s = Speculator::new(
                        Box::new(ModelDrafter::open(&path, tok, vocab, CTX, opts).unwrap()),
                        k,
                    );
                    let got = run(w, tok, &ids, &params, CTX, Some(&mut s));
                    assert_eq!(
                        got, plain,
                        "tp {tp}, quantized draft {keep_quantized}, {k:?}"
                    );
                    assert!(s.stats.accepted > 0, "{:?}", s.stats);
                    if keep_quantized {
                        // The draft is the target itself: every verified draft is kept
                        // (drafts past the last token wanted are not verified).
                        let unverified = s.stats.drafted - s.stats.accepted;
                        assert!(unverified <= 16, "{:?}", s.stats);
                    }
                }
            }
        });
    }
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    let (Some(small), Some(qwen)) = (tp_testkit::smollm2(), tp_testkit::qwen25()) else {
        eprintln!("SmolLM2 or Qwen2.5-Coder-0.5B is not installed: skipped");
        return;
    };
    let target = Tokenizer::from_gguf_file(&qwen).unwrap();
    let e = ModelDrafter::open(&small, &target, 151_936, 64, LoadOptions::default()).unwrap_err();
    assert!(matches!(e, DraftModelError::Vocabulary { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("151936 tokens") && msg.contains("49152"),
        "{msg}"
    );
}

/// One draft model shared by several sequences (as `tp serve` shares it between requests):
/// each sequence's drafter, used in turns with the others and rolled back by rejections,
/// drafts what a drafter of its own model drafts.
#[test]
fn sequences_sharing_a_draft_model_draft_as_alone() {
    let Some(path) = tp_testkit::smollm2() else {
        eprintln!("SmolLM2 is not installed: skipped");
        return;
    };
    let tok = Tokenizer::from_gguf_file(&path).unwrap();
    let vocab = tok.vocab_size();
    let opts = LoadOptions::default();
    let shared = DraftModelSource::open(&path, &tok, vocab, CTX, opts).unwrap();
    let texts = [
        "Repeat this list exactly: apples, bananas, cherries, dates, figs. Again: apples,",
        "The quick brown fox jumps over the lazy dog. The quick brown",
        "fn main() { let x = 1; let y = 2; println!(\"{}\", x + y); } fn main() {",
    ];
    let mut turns: Vec<(Vec<u32>, ModelDrafter, ModelDrafter)> = texts
        .iter()
        .map(|t| {
            let alone = ModelDrafter::open(&path, &tok, vocab, CTX, opts).unwrap();
            (tok.encode(t).unwrap(), shared.sequence(), alone)
        })
        .collect();
    for round in 0..4 {
        for (i, (history, mine, alone)) in turns.iter_mut().enumerate() {
            let a = mine.draft(history, 4).unwrap();
            let b = alone.draft(history, 4).unwrap();
            assert_eq!(a, b, "round {round}, sequence {i}");
            assert!(!a.is_empty());
            // Keep the first draft and a token of our own (a rejection after one).
            history.push(a[0]);
            history.push(a[0]);
        }
    }
}

/// A bounded draft pool (SmolLM2 drafting for itself) changes no greedy token: room for the
/// whole sequence drafts every step it can; one block fills mid-run, after which steps
/// draft nothing (counted) and the target decodes on unspeculated; no block at all never
/// drafts. Two sequences sharing one small pool take turns at it.
#[test]
fn a_bounded_draft_pool_changes_no_greedy_token() {
    let Some(path) = tp_testkit::smollm2() else {
        eprintln!("SmolLM2 is not installed: skipped");
        return;
    };
    for tp in 1..=2 {
        on_workers(tp, KvDtype::F16, |w, tok| {
            let vocab = w.model().config().vocab;
            let ids = tok
                .encode("Repeat this list exactly: apples, bananas, cherries. Again: apples,")
                .unwrap();
            // Two rounds of 4 drafts (3 of them fed back) stay inside the first block.
            assert!(ids.len() + 2 * 4 + 3 <= 32, "{}", ids.len());
            let params = DecodeParams::greedy(40);
            let plain = run(w, tok, &ids, &params, CTX, None);
            let opts = LoadOptions::default();
            let source = DraftModelSource::open(&path, tok, vocab, CTX, opts).unwrap();
            let held = (ids.len() + 40).div_ceil(32);
            for blocks in [held, 1, 0] {
                source.set_block_limit(blocks);
                let mut s = Speculator::new(Box::new(source.sequence()), DraftTokens::Fixed(4));
                let got = run(w, tok, &ids, &params, CTX, Some(&mut s));
                assert_eq!(got, plain, "tp {tp}, {blocks} draft blocks");
                let st = s.stats;
                assert_eq!(st.errors, 0, "{st:?}");
                match blocks {
                    // Every step but the last (one token left: nothing to draft) found it full.
                    0 => assert_eq!((st.drafted, st.kv_full), (0, st.steps - 1), "{st:?}"),
                    1 => assert!(st.accepted > 0 && st.kv_full > 0, "{st:?}"),
                    _ => assert!(st.accepted > 0 && st.kv_full == 0, "{st:?}"),
                }
            }
            // Two sequences over a pool of two blocks: each drafts as a drafter alone would
            // while the pool has room for it.
            source.set_block_limit(2);
            let mut a = source.sequence();
            let mut b = source.sequence();
            let mut alone = ModelDrafter::open(&path, tok, vocab, CTX, opts).unwrap();
            let mut history = ids.clone();
            for _ in 0..2 {
                let want = alone.draft(&history, 4).unwrap();
                assert_eq!(a.draft(&history, 4).unwrap(), want);
                assert_eq!(b.draft(&history, 4).unwrap(), want);
                history.extend_from_slice(&want);
            }
            // Both tables now hold a block each and need a second: the pool is full.
            history.extend(std::iter::repeat_n(ids[1], 40));
            let full = a.draft(&history, 4).unwrap_err();
            assert!(
                matches!(full, tp_engine::EngineError::DraftKvFull { limit: 2, .. }),
                "{full}"
            );
            // Once `b` is gone its block is free again for `a`.
            drop(b);
            let history = &history[..history.len() - 40 + 10];
            assert!(!a.draft(history, 4).unwrap().is_empty());
        });
    }
}
