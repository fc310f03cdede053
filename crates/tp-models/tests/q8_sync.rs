//! Compressed activation sync (`SyncMode::Q8`): every rank of a group holds the same logits,
//! tp 1 is unchanged (nothing to sync), and at tp 2..4 the logits stay close to the exact ones
//! (the 8-bit rounding of partial sums moves them a little; the greedy token rarely).

mod common;

use common::spread;
use common::Stepper;
use tp_comm::local::{self, LocalOptions};
use tp_models::checkpoint::GgmlDType;
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{open_checkpoint, Arch, Checkpoint, LoadOptions, ShardedModel, SyncMode};

/// Every rank's full logits for the prompt's last position and two decode steps, at `tp`.
fn all_ranks_logits(ckpt: &dyn Checkpoint, tp: usize, mode: SyncMode) -> Vec<Vec<Vec<f32>>> {
    let prompt: Vec<u32> = vec![1, 17, 256, 999, 3, 512, 64, 8];
    local::run(tp, LocalOptions::default(), |g| {
        let mut m = ShardedModel::load(ckpt, g.rank(), tp, LoadOptions::default(), 64).unwrap();
        m.set_sync(mode);
        assert_eq!(m.sync(), mode);
        let mut step = Stepper::new(&m, &g);
        let mut cache = m.new_table(64);
        let mut rows = Vec::new();
        for tokens in [&prompt[..], &[7], &[300]] {
            rows.push(step.logits(&mut cache, tokens, false));
        }
        rows
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

#[test]
fn q8_sync_agrees_across_ranks_and_stays_near_exact() {
    let dir = tempfile::tempdir().unwrap();
    let model = SyntheticModel::small(Arch::Llama, 77);
    let path = dir.path().join("m.gguf");
    model
        .write_gguf(
            &path,
            GgufTypes {
                linear: GgmlDType::Q8_0,
                embed: GgmlDType::Q8_0,
            },
        )
        .unwrap();
    let ckpt = open_checkpoint(&path).unwrap();
    let exact = all_ranks_logits(&*ckpt, 1, SyncMode::Exact).remove(0);
    // At tp 1 there is nothing to sum: the mode changes nothing.
    assert_eq!(all_ranks_logits(&*ckpt, 1, SyncMode::Q8).remove(0), exact);
    for tp in 2..=4 {
        let ranks = all_ranks_logits(&*ckpt, tp, SyncMode::Q8);
        for (r, rows) in ranks.iter().enumerate().skip(1) {
            assert_eq!(rows, &ranks[0], "tp {tp}: rank {r} differs from rank 0");
        }
        let mut differs = false;
        for (step, (got, want)) in ranks[0].iter().zip(&exact).enumerate() {
            let tol = 0.05 * spread(want);
            let worst = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                worst <= tol,
                "tp {tp} step {step}: q8 logits off by {worst} (> 5% of the spread, {tol})"
            );
            differs |= got != want;
        }
        // The compression is real: some logit moves.
        assert!(differs, "tp {tp}: q8 sync gave exactly the exact logits");
    }
}
