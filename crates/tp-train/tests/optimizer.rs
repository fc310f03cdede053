//! The sharded AdamW step equals the dense one: at tp 3 (uneven, a KV head held by two
//! ranks) each rank's update of its shards, with the clipping factor from the global norm
//! assembled from the ranks' owned elements, is exactly the slice of the dense update.

use tp_nn::Rng;
use tp_train::checkpoint::shards::slice_global;
use tp_train::fixtures::model;
use tp_train::grads::{clip_coefficient, FlatLayout, NormOwnership};
use tp_train::layout::{all_params, stage_params, ParamSpec};
use tp_train::optim::{AdamW, AdamWConfig};

fn random(n: usize, rng: &mut Rng, scale: f32) -> Vec<f32> {
    (0..n).map(|_| scale * rng.signed_unit()).collect()
}

/// Concatenated shards of `global` (per-tensor buffers) for `specs`.
fn shard(global: &[Vec<f32>], full: &[ParamSpec], specs: &[ParamSpec]) -> Vec<f32> {
    specs
        .iter()
        .zip(full)
        .flat_map(|(s, f)| {
            let i = full.iter().position(|x| x.name == s.name).unwrap_or(0);
            slice_global(&global[i], &f.shape, &s.placement)
        })
        .collect()
}

#[test]
fn sharded_adamw_with_global_clipping_equals_dense_adamw() {
    let cfg = model();
    let full = all_params(&cfg).unwrap();
    let mut rng = Rng::xorshift64_star(99);
    let mut w: Vec<Vec<f32>> = full
        .iter()
        .map(|s| random(s.global_len(), &mut rng, 0.5))
        .collect();
    let hp = AdamWConfig {
        clip_norm: 0.5,
        ..AdamWConfig::default()
    };
    let tp = 3;
    let per_rank: Vec<Vec<ParamSpec>> = (0..tp)
        .map(|t| stage_params(&cfg, 0, 1, t, tp).unwrap())
        .collect();
    let mut shards: Vec<(Vec<f32>, AdamW)> = per_rank
        .iter()
        .map(|s| {
            let p = shard(&w, &full, s);
            let n = p.len();
            (p, AdamW::new(n))
        })
        .collect();
    let dense_layout = FlatLayout::new(&full);
    let mut dense_p: Vec<f32> = w.concat();
    let mut dense_opt = AdamW::new(dense_p.len());
    for step in 0..3 {
        let g: Vec<Vec<f32>> = full
            .iter()
            .map(|s| random(s.global_len(), &mut rng, 1.0))
            .collect();
        let dense_g = g.concat();
        // Dense norm and update.
        let dense_sq: f64 = dense_g.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let coef = clip_coefficient(dense_sq.sqrt(), hp.clip_norm);
        assert!(coef < 1.0, "the test should clip");
        dense_opt.update(
            &mut dense_p,
            &dense_g,
            &dense_layout,
            &full,
            &hp,
            1e-2,
            coef,
        );
        // Sharded: owned sums of squares add up to the dense one.
        let mut sq = 0f64;
        for (t, specs) in per_rank.iter().enumerate() {
            let layout = FlatLayout::new(specs);
            let own = NormOwnership::plan(&per_rank, t);
            sq += own.sum_sq(&shard(&g, &full, specs), &layout, specs);
        }
        assert!(
            (sq - dense_sq).abs() <= 1e-9 * dense_sq,
            "step {step}: {sq} vs {dense_sq}"
        );
        for (t, specs) in per_rank.iter().enumerate() {
            let layout = FlatLayout::new(specs);
            let gs = shard(&g, &full, specs);
            let (p, opt) = &mut shards[t];
            opt.update(p, &gs, &layout, specs, &hp, 1e-2, coef);
        }
        // Split the dense result back per tensor and compare exactly.
        let mut at = 0;
        for (i, s) in full.iter().enumerate() {
            w[i] = dense_p[at..at + s.global_len()].to_vec();
            at += s.global_len();
        }
        for (t, specs) in per_rank.iter().enumerate() {
            assert_eq!(
                shards[t].0,
                shard(&w, &full, specs),
                "step {step} tp rank {t}"
            );
            let m: Vec<Vec<f32>> = {
                let mut at = 0;
                full.iter()
                    .map(|s| {
                        let v = dense_opt.exp_avg[at..at + s.global_len()].to_vec();
                        at += s.global_len();
                        v
                    })
                    .collect()
            };
            assert_eq!(
                shards[t].1.exp_avg,
                shard(&m, &full, specs),
                "moments, rank {t}"
            );
        }
    }
}
