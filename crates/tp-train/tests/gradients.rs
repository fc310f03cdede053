//! Gradients, step 0: every trainable parameter receives a non-zero gradient (candle's fused
//! ops have no backward: a silent zero would never train), and at every layout each rank's
//! completed, dp-summed gradient shard equals its slice of the tp1 gradient — for the Llama
//! and for the Qwen2 of the same sizes (Q/K/V biases: at tp 3 and 4 a KV head's bias entries
//! sit on two ranks, whose shares are summed like the K/V rows'), the Qwen3 (whose per-head q/k norm gradients are summed over tp)
//! and the Gemma-3 (one KV head held by every rank; post norms, windows, scaled embeddings),
//! and the Mixtral (4 experts a layer, top-2: every expert's shard, and the router, whose
//! gradient is partial per tp rank through both the experts' outputs and the load-balancing
//! loss each rank backpropagates a 1/tp share of).

mod common;
use common::*;
use tp_train::checkpoint::shards::slice_global;
use tp_train::fixtures::{gemma3_spec, moe_spec, qwen2_spec, qwen3_spec};
use tp_train::layout::ParamSpec;
use tp_train::{TrainOptions, TrainSpec};

type RankGrads = (Vec<ParamSpec>, Vec<Vec<f32>>);
type SpecFn = fn(tp_comm::ParallelDims, u64, usize) -> TrainSpec;

fn grads_at(spec: SpecFn, d: tp_comm::ParallelDims, micro: usize, ep: usize) -> Vec<RankGrads> {
    let spec = TrainSpec {
        ep,
        ..spec(d, 1, micro)
    };
    with_trainers(&spec, None, TrainOptions::default(), |t| {
        t.compute_gradients()?;
        let per_param = (0..t.specs().len())
            .map(|i| t.grads_flat()[t.flat_layout().range(i)].to_vec())
            .collect();
        Ok((t.specs().to_vec(), per_param))
    })
    .into_iter()
    .map(|r| r.expect("rank"))
    .collect()
}

#[test]
fn every_parameter_gets_a_gradient_and_every_shard_matches_tp1() {
    check_every_shard(spec, 9);
}

#[test]
fn qwen2_every_parameter_gets_a_gradient_and_every_shard_matches_tp1() {
    check_every_shard(qwen2_spec, 12);
}

#[test]
fn qwen3_every_parameter_gets_a_gradient_and_every_shard_matches_tp1() {
    check_every_shard(qwen3_spec, 11);
}

#[test]
fn gemma3_every_parameter_gets_a_gradient_and_every_shard_matches_tp1() {
    check_every_shard(gemma3_spec, 13);
}

#[test]
fn mixtral_every_parameter_gets_a_gradient_and_every_shard_matches_tp1() {
    // Norms, Q, K, V, O, the router and 4 experts' gate, up and down. The balance loss
    // depends on the micro-batch's tokens, so every layout keeps micro-batches of 2.
    check_shards_at(
        moe_spec,
        7 + 4 * 3,
        &[
            (dims(2, 1, 1), 2),
            (dims(3, 1, 1), 2),
            (dims(4, 1, 1), 2),
            (dims(1, 2, 1), 2),
            (dims(2, 2, 1), 2),
            (dims(2, 1, 2), 1),
        ],
    );
}

#[test]
fn mixtral_experts_over_replicas_give_the_expert_tp_gradients() {
    // Expert parallelism (docs/moe.md): ep 2 inside tp 2; whole experts over the replicas at
    // tp 1 x dp 2 x ep 2 (one ep block) and tp 2 x dp 2 x ep 4 (one expert a rank), against
    // tp 1 with micro-batches of 2 sequences; and tp 1 x dp 4 x ep 2 (two ep blocks, so each
    // expert's gradient is summed over its expert-data-parallel group too) against tp 1
    // with micro-batches of 1, as the balance loss is per micro-batch.
    let per_layer = 7 + 4 * 3;
    check_shards_against(
        moe_spec,
        per_layer,
        2,
        &[
            (dims(2, 1, 1), 2, 2),
            (dims(1, 1, 2), 1, 2),
            (dims(2, 1, 2), 1, 4),
        ],
    );
    check_shards_against(moe_spec, per_layer, 4, &[(dims(1, 1, 4), 1, 2)]);
    // The dispatch inside sequence parallelism (the MoE's input gathered over tp first) and
    // full recomputation (the forward's all-to-alls repeated inside the backward).
    check_shards_against(moe_sp_full, per_layer, 2, &[(dims(2, 1, 2), 1, 4)]);
}

/// [`moe_spec`] with sequence parallelism and full activation recomputation.
fn moe_sp_full(d: tp_comm::ParallelDims, steps: u64, micro: usize) -> TrainSpec {
    TrainSpec {
        sequence_parallel: d.tp > 1,
        recompute: tp_train::Recompute::Full,
        ..moe_spec(d, steps, micro)
    }
}

/// The checks above for the model of `spec`, whose layers have `per_layer` tensors.
fn check_every_shard(spec: SpecFn, per_layer: usize) {
    check_shards_at(
        spec,
        per_layer,
        &[
            (dims(2, 1, 1), 2),
            (dims(3, 1, 1), 2),
            (dims(4, 1, 1), 1),
            (dims(1, 2, 1), 2),
            (dims(2, 2, 1), 4),
            (dims(2, 1, 2), 1),
        ],
    );
}

/// The checks above at each `(layout, micro-batches)` against tp 1 with 2 micro-batches.
fn check_shards_at(spec: SpecFn, per_layer: usize, layouts: &[(tp_comm::ParallelDims, usize)]) {
    let with_ep: Vec<_> = layouts.iter().map(|&(d, m)| (d, m, 1)).collect();
    check_shards_against(spec, per_layer, 2, &with_ep);
}

/// The checks above at each `(layout, micro-batches, ep)` against tp 1 with `ref_micro`
/// micro-batches.
fn check_shards_against(
    spec: SpecFn,
    per_layer: usize,
    ref_micro: usize,
    layouts: &[(tp_comm::ParallelDims, usize, usize)],
) {
    let (specs, dense) = grads_at(spec, dims(1, 1, 1), ref_micro, 1).swap_remove(0);
    assert_eq!(specs.len(), 1 + per_layer * 4 + 2);
    for (s, g) in specs.iter().zip(&dense) {
        let nonzero = g.iter().filter(|x| **x != 0.0).count();
        // The embedding's rows of bytes absent from the batch are legitimately zero.
        assert!(nonzero > 0, "{} received no gradient", s.name);
        if !s.name.contains("embed_tokens") {
            assert!(
                nonzero * 2 > g.len(),
                "{}: only {nonzero}/{} non-zero",
                s.name,
                g.len()
            );
        }
    }
    let by_name = |n: &str| {
        let i = specs.iter().position(|s| s.name == n).expect("name");
        (&specs[i], &dense[i])
    };
    let mut worst = 0f32;
    for &(d, micro, ep) in layouts {
        for (rank, (rspecs, grads)) in grads_at(spec, d, micro, ep).iter().enumerate() {
            for (s, g) in rspecs.iter().zip(grads) {
                let (full, want_full) = by_name(&s.name);
                let want = slice_global(want_full, &full.shape, &s.placement);
                let scale = want_full.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
                let err = g
                    .iter()
                    .zip(&want)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                worst = worst.max(err / scale);
                assert!(
                    err <= 1e-5 * scale,
                    "{d:?} ep {ep} rank {rank} {}: gradient differs from tp1 by {err:e} (scale {scale:e})",
                    s.name
                );
            }
        }
    }
    eprintln!("worst relative gradient difference: {worst:.2e}");
}
