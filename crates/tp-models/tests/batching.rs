//! Continuous batching must not change results: sequences run together in one forward pass
//! (prefill chunks and decode tokens mixed) give bitwise the logits they get alone, at tp 1
//! and 2, on the real quantized SmolLM2.

mod common;

use common::Stepper;
use tp_comm::local::{self, LocalOptions};
use tp_models::{Chunk, GgufCheckpoint, LoadOptions, Profile, ShardedModel};

const PROMPTS: [&[u32]; 3] = [
    &[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173],
    &[
        4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198, 30, 31,
    ],
    &[11_339, 2_402, 253],
];

#[test]
fn batched_logits_equal_lone_logits_bitwise() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let ckpt = GgufCheckpoint::open(&path).unwrap();
    for tp in [1, 2] {
        let out = local::run(tp, LocalOptions::default(), |g| {
            let m = ShardedModel::load(&ckpt, g.rank(), tp, LoadOptions::default(), 64).unwrap();
            let mut prof = Profile::default();
            // Alone: prefill each prompt, then one decode token (id 42).
            let mut alone = Vec::new();
            for p in PROMPTS {
                let mut step = Stepper::new(&m, &g);
                let mut cache = m.new_table(64);
                let a = step.local(&mut cache, p, true);
                let b = step.local(&mut cache, &[42], false);
                alone.push((a, b));
            }
            // Together: sequence 0 prefilled first; then one step mixing its decode token with
            // the prefill of sequences 1 and 2; then a step decoding 1 and 2 together.
            let mut pool = m.new_pool();
            let mut caches: Vec<_> = (0..3).map(|_| m.new_table(64)).collect();
            let (c0, rest) = caches.split_at_mut(1);
            let (c1, c2) = rest.split_at_mut(1);
            let a0 = m
                .forward(
                    &mut [Chunk {
                        tokens: PROMPTS[0],
                        table: &mut c0[0],
                        all_logits: true,
                    }],
                    &mut pool,
                    &g,
                    &mut prof,
                )
                .unwrap();
            let mixed = m
                .forward(
                    &mut [
                        Chunk {
                            tokens: &[42],
                            table: &mut c0[0],
                            all_logits: false,
                        },
                        Chunk {
                            tokens: PROMPTS[1],
                            table: &mut c1[0],
                            all_logits: true,
                        },
                        Chunk {
                            tokens: PROMPTS[2],
                            table: &mut c2[0],
                            all_logits: true,
                        },
                    ],
                    &mut pool,
                    &g,
                    &mut prof,
                )
                .unwrap();
            let decode12 = m
                .forward(
                    &mut [
                        Chunk {
                            tokens: &[42],
                            table: &mut c1[0],
                            all_logits: false,
                        },
                        Chunk {
                            tokens: &[42],
                            table: &mut c2[0],
                            all_logits: false,
                        },
                    ],
                    &mut pool,
                    &g,
                    &mut prof,
                )
                .unwrap();
            (alone, a0, mixed, decode12, m.plan().vocab_rows().len())
        })
        .unwrap();
        for rank_out in out {
            let (alone, a0, mixed, decode12, v) = rank_out.unwrap();
            let rows = |x: &[f32], from: usize, n: usize| x[from * v..(from + n) * v].to_vec();
            assert!(a0 == alone[0].0, "tp {tp}: prefill of sequence 0 differs");
            let (l1, l2) = (PROMPTS[1].len(), PROMPTS[2].len());
            assert!(
                rows(&mixed, 0, 1) == alone[0].1,
                "tp {tp}: decode of 0 batched with prefills differs"
            );
            assert!(
                rows(&mixed, 1, l1) == alone[1].0,
                "tp {tp}: prefill of 1 batched differs"
            );
            assert!(
                rows(&mixed, 1 + l1, l2) == alone[2].0,
                "tp {tp}: prefill of 2 batched differs"
            );
            assert!(
                rows(&decode12, 0, 1) == alone[1].1,
                "tp {tp}: decode of 1 batched differs"
            );
            assert!(
                rows(&decode12, 1, 1) == alone[2].1,
                "tp {tp}: decode of 2 batched differs"
            );
        }
    }
}

/// A prefill longer than the MLP's pass (128 tokens: the gate/up output is held for that many
/// at a time) gives bitwise the logits of the same tokens in chunks shorter than one pass, at
/// tp 1 and 2: the split of the MLP into passes cannot change a token's result.
#[test]
fn a_long_prefill_equals_short_chunks_bitwise() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let ckpt = GgufCheckpoint::open(&path).unwrap();
    let tokens: Vec<u32> = (0..300u32).map(|i| 1 + (i * 7919) % 49_000).collect();
    for tp in [1, 2] {
        let out = local::run(tp, LocalOptions::default(), |g| {
            let m = ShardedModel::load(&ckpt, g.rank(), tp, LoadOptions::default(), 512).unwrap();
            let mut step = Stepper::new(&m, &g);
            let mut whole = m.new_table(512);
            let long = step.local(&mut whole, &tokens, true); // 3 passes: 128, 128, 44
            let mut parts = m.new_table(512);
            let short: Vec<f32> = tokens
                .chunks(100)
                .flat_map(|c| step.local(&mut parts, c, true))
                .collect();
            (long, short)
        })
        .unwrap();
        for rank_out in out {
            let (long, short) = rank_out.unwrap();
            assert_eq!(long.len(), short.len());
            assert!(
                long == short,
                "tp {tp}: a 300-token prefill differs from 3 x 100"
            );
        }
    }
}
