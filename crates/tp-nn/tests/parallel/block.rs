//! Transformer block at tp 1..8, even and uneven, plain and sequence parallel: outputs and
//! gradients equal the dense reference; collective counts pinned.

use crate::support::{assert_close, dev, embed, world};
use candle_core::{Tensor, Var};
use proptest::prelude::*;
use tp_comm::OpKind;
use tp_nn::{
    BlockConfig, DenseBlock, ParallelBlock, Placement, RecordingComm, RopeLayout, SeededRng,
};

fn cfg(
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    layout: RopeLayout,
) -> BlockConfig {
    BlockConfig {
        hidden,
        heads,
        kv_heads,
        head_dim,
        ffn,
        rope_theta: 10_000.0,
        rope_layout: layout,
        rms_eps: 1e-5,
        max_seq: 16,
    }
}

fn even() -> BlockConfig {
    cfg(32, 4, 2, 8, 64, RopeLayout::Interleaved)
}
/// SmolLM2's head layout (9 query heads, 3 KV heads), scaled down.
fn smol() -> BlockConfig {
    cfg(48, 9, 3, 8, 80, RopeLayout::RotateHalf)
}
fn eight_two() -> BlockConfig {
    cfg(32, 8, 2, 4, 40, RopeLayout::RotateHalf)
}

struct RankOut {
    out: Tensor,
    h_grad: Tensor,
    /// Raw gradients, as backward leaves them: (name, grad, placement).
    grads: Vec<(&'static str, Tensor, Placement)>,
    /// After `reduce_shared_grads`: every rank's grad should equal its dense slice.
    reduced: Vec<Tensor>,
}

/// Runs the dense reference and the parallel block at `tp`, and compares everything.
fn check_block(
    c: &BlockConfig,
    tp: usize,
    batch: usize,
    seq: usize,
    seed: u64,
    seq_parallel: bool,
) {
    let d = dev();
    let w = c.random_weights(seed, &d).unwrap();
    let mut rng = SeededRng::new(seed ^ 0xabcdef);
    let h = rng.tensor(&[batch, seq, c.hidden], 0.0, 1.0, &d).unwrap(); // [b, s, hidden]
    let r = rng.tensor(&[batch, seq, c.hidden], 0.0, 1.0, &d).unwrap(); // [b, s, hidden]

    let dense = DenseBlock::new(c, &w).unwrap();
    let h_var = Var::from_tensor(&h).unwrap();
    let want = dense.forward(h_var.as_tensor()).unwrap(); // [b, s, hidden]
    let dgrads = (&want * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let want_h_grad = dgrads.get(h_var.as_tensor()).unwrap().clone();

    let seq_sizes = ParallelBlock::seq_partition(seq, tp).map(|p| p.sizes());
    let outs = world(tp, |g| {
        let rank = g.rank();
        let block = ParallelBlock::from_global(c, &w, rank, tp)?;
        let (h_in, r_in) = if seq_parallel {
            let p = ParallelBlock::seq_partition(seq, tp)?.range(rank);
            (
                h.narrow(1, p.start, p.len())?,
                r.narrow(1, p.start, p.len())?,
            )
        } else {
            (h.clone(), r.clone())
        };
        let h_var = Var::from_tensor(&h_in)?;
        let out = if seq_parallel {
            block.forward_sequence_parallel(h_var.as_tensor(), seq, &g)?
        } else {
            block.forward(h_var.as_tensor(), &g)?
        };
        let mut grads = (&out * &r_in)?.sum_all()?.backward()?;
        let h_grad = grads
            .get(h_var.as_tensor())
            .expect("input gradient")
            .clone();
        let params = block
            .params()
            .into_iter()
            .map(|(n, v, p)| {
                let gr = grads
                    .get(v.as_tensor())
                    .unwrap_or_else(|| panic!("{n} has no gradient"));
                (n, gr.clone(), p)
            })
            .collect();
        block.reduce_shared_grads(&mut grads, &g, seq_parallel)?;
        let reduced = block
            .params()
            .iter()
            .map(|(_, v, _)| grads.get(v.as_tensor()).expect("reduced grad").clone())
            .collect();
        Ok(RankOut {
            out,
            h_grad,
            grads: params,
            reduced,
        })
    });

    let label = |what: &str| {
        format!(
            "{what} (tp={tp}, heads={}/{}, sp={seq_parallel})",
            c.heads, c.kv_heads
        )
    };
    let sizes = seq_sizes.unwrap_or_default();
    let mut start = 0;
    for (rank, o) in outs.iter().enumerate() {
        let (want_out, want_hg) = if seq_parallel {
            let s = (start, sizes[rank]);
            start += sizes[rank];
            (
                want.narrow(1, s.0, s.1).unwrap(),
                want_h_grad.narrow(1, s.0, s.1).unwrap(),
            )
        } else {
            (want.clone(), want_h_grad.clone())
        };
        assert_close(&label(&format!("rank {rank} output")), &o.out, &want_out);
        assert_close(
            &label(&format!("rank {rank} input grad")),
            &o.h_grad,
            &want_hg,
        );
    }
    for (i, (name, dvar)) in dense.vars().iter().enumerate() {
        let want_g = dgrads.get(dvar.as_tensor()).unwrap();
        let replicated = matches!(outs[0].grads[i].2, Placement::Replicated);
        assert_eq!(outs[0].grads[i].0, *name);
        if replicated && !seq_parallel {
            for (rank, o) in outs.iter().enumerate() {
                assert_close(
                    &label(&format!("rank {rank} {name} grad")),
                    &o.grads[i].1,
                    want_g,
                );
            }
        } else {
            // Shards (and sequence-parallel partial norm grads) add up to the dense gradient;
            // for disjoint shards this is exactly "each shard equals its slice".
            let mut sum = want_g.zeros_like().unwrap();
            for o in &outs {
                sum = (sum + embed(&o.grads[i].1, want_g.dims(), &o.grads[i].2)).unwrap();
            }
            assert_close(
                &label(&format!("{name} grad (sum of shards)")),
                &sum,
                want_g,
            );
        }
        // After completing shared gradients, every rank's shard equals its dense slice and
        // every replicated parameter's grad equals the dense grad.
        for (rank, o) in outs.iter().enumerate() {
            let want_slice = match &o.grads[i].2 {
                Placement::Sharded { dim, range } => {
                    want_g.narrow(*dim, range.start, range.len()).unwrap()
                }
                Placement::Replicated => want_g.clone(),
            };
            assert_close(
                &label(&format!("rank {rank} {name} completed grad")),
                &o.reduced[i],
                &want_slice,
            );
        }
    }
}

#[test]
fn even_config_tp_1_to_4() {
    for tp in 1..=4 {
        check_block(&even(), tp, 2, 5, 1, false);
    }
}

#[test]
fn smollm2_heads_tp_1_to_4() {
    for tp in 1..=4 {
        check_block(&smol(), tp, 2, 5, 2, false);
    }
}

#[test]
fn smollm2_heads_every_tp_up_to_nine() {
    // Every tp from 1 to the number of query heads works; tp 1..4 are covered above.
    for tp in 5..=9 {
        check_block(&smol(), tp, 1, 4, 13, false);
    }
    check_block(&smol(), 9, 1, 10, 14, true);
}

#[test]
fn eight_heads_two_kv_tp_4_and_8() {
    for tp in [4, 8] {
        check_block(&eight_two(), tp, 1, 9, 3, false);
    }
}

#[test]
fn sequence_parallel_matches_reference() {
    for tp in 1..=4 {
        check_block(&even(), tp, 2, 5, 4, true);
        check_block(&smol(), tp, 2, 7, 5, true);
    }
    for tp in [4, 8] {
        check_block(&eight_two(), tp, 1, 9, 6, true);
    }
}

#[test]
fn a_wrong_reference_is_caught() {
    // The comparison must be able to fail: a block built with other weights differs.
    let c = smol();
    let d = dev();
    let w = c.random_weights(7, &d).unwrap();
    let other = c.random_weights(8, &d).unwrap();
    let h = SeededRng::new(9)
        .tensor(&[1, 4, c.hidden], 0.0, 1.0, &d)
        .unwrap();
    let want = DenseBlock::new(&c, &other).unwrap().forward(&h).unwrap();
    let outs = world(3, |g| {
        ParallelBlock::from_global(&c, &w, g.rank(), 3)?.forward(&h, &g)
    });
    let err = crate::support::max_abs(&(&outs[0] - &want).unwrap());
    assert!(err > 1e-2, "different weights should differ, got {err}");
}

/// (forward counts, backward counts) of one block on a recording communicator.
fn counts(c: &BlockConfig, tp: usize, seq: usize, seq_parallel: bool) -> Vec<[usize; 6]> {
    let d = dev();
    let w = c.random_weights(11, &d).unwrap();
    let h = SeededRng::new(12)
        .tensor(&[1, seq, c.hidden], 0.0, 1.0, &d)
        .unwrap();
    let ops = [OpKind::AllReduce, OpKind::AllGather, OpKind::ReduceScatter];
    world(tp, |g| {
        let (rec, g) = RecordingComm::wrap(g);
        let rank = g.rank();
        let block = ParallelBlock::from_global(c, &w, rank, tp)?;
        let h_in = if seq_parallel {
            let p = ParallelBlock::seq_partition(seq, tp)?.range(rank);
            h.narrow(1, p.start, p.len())?
        } else {
            h.clone()
        };
        let h_var = Var::from_tensor(&h_in)?;
        let out = if seq_parallel {
            block.forward_sequence_parallel(h_var.as_tensor(), seq, &g)?
        } else {
            block.forward(h_var.as_tensor(), &g)?
        };
        let fwd = ops.map(|o| rec.count(o));
        rec.reset();
        out.sqr()?.sum_all()?.backward()?;
        let bwd = ops.map(|o| rec.count(o));
        let total: usize = rec.snapshot().values().sum();
        assert_eq!(total, bwd.iter().sum::<usize>(), "no other ops in backward");
        Ok([fwd[0], fwd[1], fwd[2], bwd[0], bwd[1], bwd[2]])
    })
}

#[test]
fn two_all_reduces_each_way() {
    for tp in [2, 3] {
        for c in counts(&smol(), tp, 4, false) {
            assert_eq!(
                c,
                [2, 0, 0, 2, 0, 0],
                "tp={tp}: [fwd ar, ag, rs, bwd ar, ag, rs]"
            );
        }
    }
}

#[test]
fn sequence_parallel_two_gathers_two_reduce_scatters_each_way() {
    for tp in [2, 3] {
        for c in counts(&smol(), tp, 5, true) {
            assert_eq!(
                c,
                [0, 2, 2, 0, 2, 2],
                "tp={tp}: [fwd ar, ag, rs, bwd ar, ag, rs]"
            );
        }
    }
}

#[test]
fn tp_above_heads_is_a_typed_error() {
    let c = smol();
    let w = c.random_weights(1, &dev()).unwrap();
    let e = ParallelBlock::from_global(&c, &w, 0, 12)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("9 heads cannot give every rank a head at tp=12; use 1 <= tp <= 9"),
        "{e}"
    );
    assert!(ParallelBlock::from_global(&c, &w, 0, 0).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn random_shapes_match_reference(
        kv in 1usize..4, group in 1usize..4, half_hd in 1usize..4, hidden in 4usize..20,
        ffn_extra in 0usize..9, tp_pick in 0usize..100, seq_extra in 0usize..3, batch in 1usize..3,
        interleaved: bool, sp: bool, seed in 0u64..1000,
    ) {
        let heads = kv * group;
        let tp = 1 + tp_pick % heads.min(4);
        let layout = if interleaved { RopeLayout::Interleaved } else { RopeLayout::RotateHalf };
        let c = cfg(hidden, heads, kv, 2 * half_hd, tp + ffn_extra, layout);
        check_block(&c, tp, batch, tp + seq_extra, seed, sp);
    }
}
