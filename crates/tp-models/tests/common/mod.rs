//! Shared test helpers: the sharded model's logits and their comparison with an oracle; the
//! real models (CI installs SmolLM2; tests skip without it) come from tp-testkit.

#![allow(dead_code)]

#[allow(unused_imports)] // each test binary uses a subset
pub use tp_testkit::{minilm, qwen25, smollm2};

/// Logits of the sharded model at `tp` (local backend): the last row of the whole prompt in
/// one pass, then the last row after each token fed one by one through a fresh cache
/// (`1 + tokens.len()` rows of `vocab`).
pub fn sharded_logits(
    ckpt: &dyn tp_models::Checkpoint,
    tokens: &[u32],
    tp: usize,
    opts: tp_models::LoadOptions,
) -> Vec<Vec<f32>> {
    use tp_comm::local::{self, LocalOptions};
    use tp_models::{Chunk, Profile, ShardedModel};
    let results = local::run(tp, LocalOptions::default(), |g| {
        let model = ShardedModel::load(ckpt, g.rank(), tp, opts, 64).unwrap();
        let mut prof = Profile::default();
        let mut out = Vec::new();
        let mut pool = model.new_pool();
        let mut cache = model.new_table(64);
        let local = model
            .forward(
                &mut [Chunk {
                    tokens,
                    table: &mut cache,
                    all_logits: false,
                }],
                &mut pool,
                &g,
                &mut prof,
            )
            .unwrap();
        out.push(model.gather_logits(&local, 1, &g, &mut prof).unwrap());
        let mut pool = model.new_pool();
        let mut cache = model.new_table(64);
        for t in tokens {
            let local = model
                .forward(
                    &mut [Chunk {
                        tokens: std::slice::from_ref(t),
                        table: &mut cache,
                        all_logits: false,
                    }],
                    &mut pool,
                    &g,
                    &mut prof,
                )
                .unwrap();
            out.push(model.gather_logits(&local, 1, &g, &mut prof).unwrap());
        }
        out
    })
    .unwrap();
    results.into_iter().next().unwrap().unwrap()
}

pub fn spread(v: &[f32]) -> f32 {
    let max = v.iter().copied().fold(f32::MIN, f32::max);
    let min = v.iter().copied().fold(f32::MAX, f32::min);
    max - min
}

pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i)
        .unwrap()
}

/// Largest `max |got - want| / spread(want)` over the rows; asserts it stays within `rel_tol`
/// and, when `same_argmax`, that every row's greedy token agrees.
pub fn assert_close(
    what: &str,
    got: &[Vec<f32>],
    want: &[Vec<f32>],
    rel_tol: f32,
    same_argmax: bool,
) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: row count");
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: row {i} length");
        assert!(
            g.iter().all(|x| x.is_finite()),
            "{what}: row {i} not finite"
        );
        let err = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let rel = err / spread(w);
        worst = worst.max(rel);
        assert!(
            rel <= rel_tol,
            "{what}: row {i}: max |logit diff| {err} = {rel:.2e} of the spread > {rel_tol:.0e}"
        );
        if same_argmax {
            assert_eq!(
                argmax(g),
                argmax(w),
                "{what}: row {i}: greedy token differs"
            );
        }
    }
    eprintln!("{what}: worst max|diff|/spread = {worst:.2e}");
    worst
}

/// Token ids `0..vocab` picked by a fixed rule (no tokenizer involved).
pub fn prompt(vocab: usize, len: usize) -> Vec<u32> {
    (0..len).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}
