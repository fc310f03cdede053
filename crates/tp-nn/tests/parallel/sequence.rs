//! Sequence parallelism (Korthikanti et al. 2022, §4.2.2) at the block level: a block whose
//! norms and residual adds hold `s/tp` positions per rank gives, on each rank, its slice of
//! the replicated block's output and input gradient; its tp-sharded weights get the same
//! gradients, and its replicated weights (the norms) partial ones whose sum over the ranks is
//! the replicated gradient (what the trainer all-reduces). Llama's, Qwen3's and Gemma-3's
//! blocks at tp 2 and 4; the collectives pinned (no all-reduce: two all-gathers and two
//! reduce-scatters each way).

use crate::block::gemma3;
use crate::support::{assert_close_tol, dev, world, TOL};
use candle_core::{Tensor, Var};
use tp_comm::OpKind;
use tp_nn::{
    BlockConfig, LayerStyle, ParallelBlock, Placement, RandomTensor, RecordingComm, Rng,
    RopeLayout, SeqLayout, SeqSplit,
};

fn llama() -> BlockConfig {
    BlockConfig {
        hidden: 32,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        ffn: 64,
        rope_theta: 10_000.0,
        rope_layout: RopeLayout::RotateHalf,
        rms_eps: 1e-5,
        max_seq: 16,
        qk_norm: false,
        qkv_bias: false,
        style: LayerStyle::LLAMA,
    }
}

/// One rank's run of one layout: output, input gradient, and each weight's
/// (gradient, placement) in the table's order.
struct Run {
    out: Tensor,
    h_grad: Tensor,
    grads: Vec<(Tensor, Placement)>,
}

/// Forward and backward of `sum(out * r)` on this rank's part (`narrow` of the positions
/// with sequence parallelism).
fn run(
    block: &ParallelBlock,
    h: &Tensor,
    r: &Tensor,
    g: &tp_comm::Group,
    split: Option<&SeqSplit>,
) -> tp_nn::Result<Run> {
    let (h, r, layout) = match split {
        Some(s) => {
            let at = g.rank() * s.local();
            (
                h.narrow(1, at, s.local())?, // [b, s/tp, hidden]
                r.narrow(1, at, s.local())?, // [b, s/tp, hidden]
                SeqLayout::Split(s),
            )
        }
        None => (h.clone(), r.clone(), SeqLayout::Replicated),
    };
    let h_var = Var::from_tensor(&h)?;
    let out = block.forward_layout(h_var.as_tensor(), g, layout)?.hidden;
    let store = (&out * &r)?.sum_all()?.backward()?;
    let h_grad = store.get(h_var.as_tensor()).expect("input grad").clone();
    let grads = block
        .params()?
        .into_iter()
        .map(|(p, v, place)| {
            let gr = store
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{p:?}: no grad"));
            (gr.clone(), place)
        })
        .collect();
    Ok(Run { out, h_grad, grads })
}

fn check(c: &BlockConfig, tp: usize, batch: usize, seq: usize, seed: u64) {
    let d = dev();
    let w = c.random_weights(seed, &d).unwrap();
    let mut rng = Rng::xorshift64_star(seed ^ 0x5e9);
    let h = rng.tensor(&[batch, seq, c.hidden], 0.0, 1.0, &d).unwrap(); // [b, s, hidden]
    let r = rng.tensor(&[batch, seq, c.hidden], 0.0, 1.0, &d).unwrap(); // [b, s, hidden]
    let split = SeqSplit::even(seq, tp).unwrap();
    let outs = world(tp, |g| {
        let block = ParallelBlock::from_global(c, &w, g.rank(), tp)?;
        Ok((
            run(&block, &h, &r, &g, None)?,
            run(&block, &h, &r, &g, Some(&split))?,
        ))
    });
    let what = |s: &str| {
        format!(
            "{s} (tp={tp}, qk_norm={}, post_norms={})",
            c.qk_norm, c.style.post_norms
        )
    };
    let close = |s: &str, got: &Tensor, want: &Tensor| assert_close_tol(&what(s), got, want, TOL);
    let local = split.local();
    for (rank, (rep, sp)) in outs.iter().enumerate() {
        let part = |t: &Tensor| t.narrow(1, rank * local, local).unwrap();
        close(&format!("rank {rank} output"), &sp.out, &part(&rep.out));
        close(
            &format!("rank {rank} input grad"),
            &sp.h_grad,
            &part(&rep.h_grad),
        );
    }
    let params = outs[0].0.grads.len();
    for i in 0..params {
        let sum = |pick: &dyn Fn(&(Run, Run)) -> &Tensor| {
            let mut acc = pick(&outs[0]).zeros_like().unwrap();
            for o in &outs {
                acc = (acc + pick(o)).unwrap();
            }
            acc
        };
        match outs[0].0.grads[i].1 {
            Placement::Replicated => {
                // Every rank's share (its positions, or its heads for the q/k norms) adds up
                // to the same whole with and without sequence parallelism.
                let rep_whole = if c.qk_norm && i_is_qk_norm(c, i) {
                    sum(&|o| &o.0.grads[i].0)
                } else {
                    outs[0].0.grads[i].0.clone()
                };
                close(
                    &format!("param {i} grad (sum over ranks)"),
                    &sum(&|o| &o.1.grads[i].0),
                    &rep_whole,
                );
            }
            Placement::Sharded { .. } => {
                for (rank, (rep, sp)) in outs.iter().enumerate() {
                    close(
                        &format!("rank {rank} param {i} grad"),
                        &sp.grads[i].0,
                        &rep.grads[i].0,
                    );
                }
            }
        }
    }
}

/// Whether parameter `i` of the block's table is a q/k norm (partial per rank already
/// without sequence parallelism).
fn i_is_qk_norm(c: &BlockConfig, i: usize) -> bool {
    c.layer_spec(0).params()[i].partial_grad
}

#[test]
fn sequence_parallel_block_equals_the_replicated_block() {
    for c in [
        llama(),
        BlockConfig {
            qk_norm: true,
            ..llama()
        },
        BlockConfig {
            qkv_bias: true,
            ..llama()
        },
        gemma3(llama(), Some(3)),
    ] {
        for (tp, batch, seq) in [(2, 2, 8), (4, 1, 8), (1, 2, 4)] {
            check(&c, tp, batch, seq, 7);
        }
    }
}

#[test]
fn sequence_parallel_block_uses_gathers_and_reduce_scatters_only() {
    let c = llama();
    let (tp, seq) = (2, 6);
    let w = c.random_weights(3, &dev()).unwrap();
    let h = Rng::xorshift64_star(4)
        .tensor(&[1, seq / tp, c.hidden], 0.0, 1.0, &dev())
        .unwrap(); // [1, s/tp, hidden]
    let split = SeqSplit::even(seq, tp).unwrap();
    let ops = [OpKind::AllReduce, OpKind::AllGather, OpKind::ReduceScatter];
    let counts = world(tp, |g| {
        let (rec, g) = RecordingComm::wrap(g);
        let block = ParallelBlock::from_global(&c, &w, g.rank(), tp)?;
        let h_var = Var::from_tensor(&h)?;
        let out = block.forward_layout(h_var.as_tensor(), &g, SeqLayout::Split(&split))?;
        assert_eq!(out.hidden.dims(), &[1, seq / tp, c.hidden]);
        let fwd = ops.map(|o| rec.count(o));
        rec.reset();
        out.hidden.sqr()?.sum_all()?.backward()?;
        let bwd = ops.map(|o| rec.count(o));
        Ok([fwd, bwd])
    });
    for c in counts {
        assert_eq!(c, [[0, 2, 2], [0, 2, 2]], "[fwd, bwd] x [ar, ag, rs]");
    }
}

#[test]
fn a_split_over_another_tp_is_a_typed_error() {
    let c = llama();
    let w = c.random_weights(3, &dev()).unwrap();
    let h = Tensor::zeros((1, 2, c.hidden), candle_core::DType::F32, &dev()).unwrap();
    let split = SeqSplit::even(8, 4).unwrap();
    let errs = world(2, |g| {
        let block = ParallelBlock::from_global(&c, &w, g.rank(), 2)?;
        Ok(block
            .forward_layout(&h, &g, SeqLayout::Split(&split))
            .unwrap_err()
            .to_string())
    });
    assert!(
        errs[0].contains("split over 4 ranks, the block over tp=2"),
        "{}",
        errs[0]
    );
}

#[test]
fn an_uneven_sequence_is_refused_in_words() {
    let e = SeqSplit::even(17, 2).unwrap_err().to_string();
    assert!(e.contains("17 positions do not divide by tp=2"), "{e}");
    assert!(SeqSplit::even(0, 2).is_err());
    assert!(SeqSplit::even(4, 0).is_err());
    let s = SeqSplit::even(16, 4).unwrap();
    assert_eq!(
        (s.sizes(), s.local(), s.total()),
        (&[4, 4, 4, 4][..], 4, 16)
    );
}
