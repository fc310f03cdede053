//! Transformer block at tp 1..9, even and uneven, Llama's, Qwen2's (Q/K/V biases), Qwen3's
//! (per-head q/k norms) and Gemma-3's (GeGLU, post norms, `1 + w` norms, query scale, sliding window, scaled RoPE):
//! outputs and gradients equal the dense reference; collective counts pinned.

use crate::support::{assert_close_tol, dev, embed, world, TOL};
use candle_core::{Tensor, Var};
use proptest::prelude::*;
use tp_comm::OpKind;
use tp_nn::{
    Activation, BlockConfig, DenseBlock, LayerStyle, ParallelBlock, Placement, RandomTensor,
    RecordingComm, Rng, RopeLayout,
};
use tp_spec::WeightName;

/// The reference block's name of a table weight (the reference names its own weights).
fn reference_name(w: WeightName) -> &'static str {
    match w {
        WeightName::AttnNorm(_) => "attn_norm",
        WeightName::Q(_) => "wq",
        WeightName::K(_) => "wk",
        WeightName::V(_) => "wv",
        WeightName::O(_) => "wo",
        WeightName::FfnNorm(_) => "mlp_norm",
        WeightName::Gate(_) => "w_gate",
        WeightName::Up(_) => "w_up",
        WeightName::Down(_) => "w_down",
        WeightName::QNorm(_) => "q_norm",
        WeightName::KNorm(_) => "k_norm",
        WeightName::PostAttnNorm(_) => "post_attn_norm",
        WeightName::PostFfnNorm(_) => "post_mlp_norm",
        WeightName::QBias(_) => "bq",
        WeightName::KBias(_) => "bk",
        WeightName::VBias(_) => "bv",
        other => panic!("{other:?} is not a block weight"),
    }
}

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
        qk_norm: false,
        qkv_bias: false,
        style: LayerStyle::LLAMA,
    }
}

/// Issue 32: a model's layers cut the FFN in the inference plan's units (32 columns of 96 at
/// tp 2 is 64 | 32, at tp 3 32 | 32 | 32; 4 units of 32 at tp 3 is 64 | 32 | 32): outputs and
/// gradients still equal the dense block's.
#[test]
fn ffn_cut_in_units_of_32_columns_matches_the_reference() {
    for (ffn, tp) in [(96, 2), (96, 3), (128, 3)] {
        check_block_split(
            &cfg(16, 6, 3, 4, ffn, RopeLayout::RotateHalf),
            tp,
            1,
            5,
            3,
            TOL,
            32,
        );
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
/// The same block with Qwen2's Q/K/V biases.
fn qwen2(c: BlockConfig) -> BlockConfig {
    BlockConfig {
        qkv_bias: true,
        ..c
    }
}
/// The same block with Qwen3's per-head q/k norms.
fn qwen3(c: BlockConfig) -> BlockConfig {
    BlockConfig { qk_norm: true, ..c }
}

/// The same block as a Gemma-3 layer: q/k norms and every Gemma departure; a local layer
/// (`window`) or a global one with linearly scaled RoPE.
pub(crate) fn gemma3(c: BlockConfig, window: Option<usize>) -> BlockConfig {
    BlockConfig {
        qk_norm: true,
        style: LayerStyle {
            activation: Activation::GeluTanh,
            post_norms: true,
            unit_offset_norms: true,
            query_scale: Some(0.3),
            window,
            rope_scale: if window.is_some() { 1.0 } else { 4.0 },
            experts: None,
        },
        ..c
    }
}

/// Relative tolerance of the random Gemma-3 shapes against the reference. The shapes above
/// hold 1e-5; the proptest's tiny ones (hidden 4..19, head_dim 2..6, sequences of 1..6) put
/// three more normalisations in a layer (post-attention, post-MLP, q/k norms) over a few
/// values each, and a norm of a small or nearly one-dimensional output divides by its RMS,
/// scaling up f32 rounding (even at tp 1): 6000 drawn cases stayed within 5e-4, 1e-4 failed
/// on some. A missing or wrong departure moves outputs by far more
/// (`each_gemma3_departure_changes_the_output`).
const GEMMA_TOL: f32 = 5e-4;

struct RankOut {
    out: Tensor,
    h_grad: Tensor,
    /// Raw gradients, as backward leaves them: (reference name, grad, placement, whether the
    /// table says each rank's gradient is partial).
    grads: Vec<(&'static str, Tensor, Placement, bool)>,
}

/// Runs the dense reference and the parallel block at `tp`, and compares everything.
fn check_block(c: &BlockConfig, tp: usize, batch: usize, seq: usize, seed: u64) {
    check_block_tol(c, tp, batch, seq, seed, TOL)
}

/// [`check_block`] within relative tolerance `tol`.
fn check_block_tol(c: &BlockConfig, tp: usize, batch: usize, seq: usize, seed: u64, tol: f32) {
    check_block_split(c, tp, batch, seq, seed, tol, 1)
}

/// [`check_block_tol`] with the FFN cut in units of `ffn_unit` columns where they divide it
/// (the shard plan's rule, as a model's layers are built: [`ParallelBlock::from_plan`]).
fn check_block_split(
    c: &BlockConfig,
    tp: usize,
    batch: usize,
    seq: usize,
    seed: u64,
    tol: f32,
    ffn_unit: usize,
) {
    let d = dev();
    let w = c.random_weights(seed, &d).unwrap();
    let mut rng = Rng::xorshift64_star(seed ^ 0xabcdef);
    let h = rng.tensor(&[batch, seq, c.hidden], 0.0, 1.0, &d).unwrap(); // [b, s, hidden]
    let r = rng.tensor(&[batch, seq, c.hidden], 0.0, 1.0, &d).unwrap(); // [b, s, hidden]

    let dense = DenseBlock::new(c, &w).unwrap();
    let h_var = Var::from_tensor(&h).unwrap();
    let want = dense.forward(h_var.as_tensor()).unwrap(); // [b, s, hidden]
    let dgrads = (&want * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let want_h_grad = dgrads.get(h_var.as_tensor()).unwrap().clone();

    let outs = world(tp, |g| {
        let plan = tp_spec::ShardPlan::for_block(
            c.heads,
            c.kv_heads,
            c.head_dim,
            c.ffn,
            ffn_unit,
            g.rank(),
            tp,
        )?;
        let block = ParallelBlock::from_plan(c, &w, 0, &plan)?;
        let h_var = Var::from_tensor(&h)?;
        let out = block.forward(h_var.as_tensor(), &g)?;
        let grads = (&out * &r)?.sum_all()?.backward()?;
        let h_grad = grads
            .get(h_var.as_tensor())
            .expect("input gradient")
            .clone();
        let params = block
            .params()?
            .into_iter()
            .map(|(param, v, p)| {
                let n = reference_name(param.name);
                let gr = grads
                    .get(v.as_tensor())
                    .unwrap_or_else(|| panic!("{n} has no gradient"));
                (n, gr.clone(), p, param.partial_grad)
            })
            .collect();
        Ok(RankOut {
            out,
            h_grad,
            grads: params,
        })
    });

    let label = |what: &str| format!("{what} (tp={tp}, heads={}/{})", c.heads, c.kv_heads);
    let assert_close =
        |what: &str, got: &Tensor, want: &Tensor| assert_close_tol(what, got, want, tol);
    for (rank, o) in outs.iter().enumerate() {
        assert_close(&label(&format!("rank {rank} output")), &o.out, &want);
        assert_close(
            &label(&format!("rank {rank} input grad")),
            &o.h_grad,
            &want_h_grad,
        );
    }
    assert_eq!(
        outs[0].grads.len(),
        dense.vars().len(),
        "{}",
        label("weights")
    );
    for (name, dvar) in dense.vars() {
        let want_g = dgrads.get(dvar.as_tensor()).unwrap();
        let i = outs[0]
            .grads
            .iter()
            .position(|g| g.0 == *name)
            .unwrap_or_else(|| panic!("the parallel block lacks {name}"));
        let replicated = matches!(outs[0].grads[i].2, Placement::Replicated);
        if replicated && outs[0].grads[i].3 {
            // The q/k norms: each rank's gradient covers its own heads; the sum over ranks
            // (the trainer's tp all-reduce) is the dense gradient.
            let mut sum = want_g.zeros_like().unwrap();
            for o in &outs {
                sum = (sum + &o.grads[i].1).unwrap();
            }
            assert_close(
                &label(&format!("{name} grad (sum over ranks)")),
                &sum,
                want_g,
            );
        } else if replicated {
            for (rank, o) in outs.iter().enumerate() {
                assert_close(
                    &label(&format!("rank {rank} {name} grad")),
                    &o.grads[i].1,
                    want_g,
                );
            }
        } else {
            // Shards add up to the dense gradient (KV heads held by several ranks each get
            // their query heads' share); for disjoint shards this is exactly "each shard
            // equals its slice". The trainer sums the shared rows (tp-train's `SharedRows`).
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
    }
}

#[test]
fn even_config_tp_1_to_4() {
    for tp in 1..=4 {
        check_block(&even(), tp, 2, 5, 1);
    }
}

#[test]
fn smollm2_heads_tp_1_to_4() {
    for tp in 1..=4 {
        check_block(&smol(), tp, 2, 5, 2);
    }
}

#[test]
fn smollm2_heads_every_tp_up_to_nine() {
    // Every tp from 1 to the number of query heads works; tp 1..4 are covered above.
    for tp in 5..=9 {
        check_block(&smol(), tp, 1, 4, 13);
    }
}

#[test]
fn eight_heads_two_kv_tp_4_and_8() {
    for tp in [4, 8] {
        check_block(&eight_two(), tp, 1, 9, 3);
    }
}

#[test]
fn qwen2_qkv_bias_even_and_uneven_tp_1_to_3() {
    // Outputs, the input gradient and every weight gradient, the biases' included (their
    // shards summed into the dense gradient, the column sum of the projection's gradient).
    for tp in 1..=3 {
        check_block(&qwen2(even()), tp, 2, 5, 41);
        check_block(&qwen2(smol()), tp, 2, 5, 42);
    }
}

#[test]
fn qwen2_qkv_bias_with_kv_heads_shared_by_ranks_tp_3_4_and_8() {
    // 8 query heads over 2 KV heads: at tp 3 a rank's heads span both KV groups, at tp 4
    // and 8 each KV head (its K/V rows and bias entries) sits on several ranks, whose
    // gradient shards add up to the dense one (the trainer's SharedRows).
    for tp in [3, 4, 8] {
        check_block(&qwen2(eight_two()), tp, 1, 6, 43);
    }
}

#[test]
fn qwen2_biases_matter_and_must_match_the_config() {
    // Other biases (or none) give another output, so the comparisons above can fail on them.
    let c = qwen2(smol());
    let d = dev();
    let w = c.random_weights(44, &d).unwrap();
    let dense = DenseBlock::new(&c, &w).unwrap();
    let names: Vec<&str> = dense.vars().iter().map(|(n, _)| *n).collect();
    assert_eq!(&names[9..], ["bq", "bk", "bv"]);
    let h = Rng::xorshift64_star(45)
        .tensor(&[1, 4, c.hidden], 0.0, 1.0, &d)
        .unwrap();
    let want = dense.forward(&h).unwrap();
    let without = BlockConfig {
        qkv_bias: false,
        ..c.clone()
    };
    let mut plain = w.clone();
    plain.qkv_bias = None;
    // A block without biases has the same other weights (the biases are drawn last).
    let plain_drawn = without.random_weights(44, &d).unwrap();
    assert_eq!(
        plain_drawn.wq.to_vec2::<f32>().unwrap(),
        w.wq.to_vec2::<f32>().unwrap()
    );
    for k in 0..3 {
        let mut other = w.clone();
        if let Some(b) = other.qkv_bias.as_mut() {
            let t = [&mut b.0, &mut b.1, &mut b.2][k].clone();
            *[&mut b.0, &mut b.1, &mut b.2][k] = (t + 0.5).unwrap();
        }
        let outs = world(3, |g| {
            ParallelBlock::from_global(&c, &other, g.rank(), 3)?.forward(&h, &g)
        });
        let err = crate::support::max_abs(&(&outs[0] - &want).unwrap());
        assert!(err > 1e-3, "bias {k} should change the output, got {err}");
    }
    let outs = world(3, |g| {
        ParallelBlock::from_global(&without, &plain, g.rank(), 3)?.forward(&h, &g)
    });
    let err = crate::support::max_abs(&(&outs[0] - &want).unwrap());
    assert!(err > 1e-3, "the biases should change the output, got {err}");
    // The config and the weights must agree on the biases, and a bias of the wrong width is
    // a typed error.
    let e = ParallelBlock::from_global(&c, &plain, 0, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("qkv_bias = true") && e.contains("lack"), "{e}");
    assert!(ParallelBlock::from_global(&without, &w, 0, 1).is_err());
    let mut short = w.clone();
    if let Some(b) = short.qkv_bias.as_mut() {
        b.1 = b.1.narrow(0, 0, 3).unwrap();
    }
    let e = ParallelBlock::from_global(&c, &short, 0, 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("bias bk must be [24]"), "{e}");
}

#[test]
fn qwen3_qk_norm_even_and_uneven_tp_1_to_4() {
    for tp in 1..=4 {
        check_block(&qwen3(even()), tp, 2, 5, 21);
        check_block(&qwen3(smol()), tp, 2, 5, 22);
    }
}

#[test]
fn qwen3_qk_norm_with_kv_heads_shared_by_ranks_tp_4_and_8() {
    for tp in [4, 8] {
        check_block(&qwen3(eight_two()), tp, 1, 6, 23);
    }
}

#[test]
fn gemma3_local_and_global_layers_tp_1_to_4() {
    // A window of 3 over 6 positions masks; MQA-like 8/2 heads put tp 4 above the KV heads.
    for tp in 1..=4 {
        check_block(&gemma3(even(), Some(3)), tp, 2, 6, 31);
        check_block(&gemma3(smol(), None), tp, 2, 6, 32);
        check_block(&gemma3(eight_two(), Some(2)), tp, 1, 6, 33);
    }
}

#[test]
fn gemma3_one_kv_head_shared_by_every_rank() {
    // Gemma-3-270M's layout in small: 4 query heads, 1 KV head, tp up to 4.
    let c = gemma3(cfg(32, 4, 1, 8, 48, RopeLayout::RotateHalf), Some(4));
    for tp in [2, 3, 4] {
        check_block(&c, tp, 1, 7, 34);
    }
}

#[test]
fn each_gemma3_departure_changes_the_output() {
    // Turning one departure off (same weights where they still apply) gives another output,
    // so the reference comparisons above can fail on each of them.
    let c = gemma3(smol(), Some(2));
    let d = dev();
    let w = c.random_weights(35, &d).unwrap();
    let h = Rng::xorshift64_star(36)
        .tensor(&[1, 6, c.hidden], 0.0, 1.0, &d)
        .unwrap();
    let want = DenseBlock::new(&c, &w).unwrap().forward(&h).unwrap();
    let st = c.style;
    let mut plain_w = w.clone();
    (plain_w.post_attn_norm, plain_w.post_mlp_norm) = (None, None);
    let variants = [
        (
            "silu",
            LayerStyle {
                activation: Activation::Silu,
                ..st
            },
            &w,
        ),
        (
            "no post norms",
            LayerStyle {
                post_norms: false,
                ..st
            },
            &plain_w,
        ),
        (
            "plain norms",
            LayerStyle {
                unit_offset_norms: false,
                ..st
            },
            &w,
        ),
        (
            "default query scale",
            LayerStyle {
                query_scale: None,
                ..st
            },
            &w,
        ),
        ("no window", LayerStyle { window: None, ..st }, &w),
        (
            "rope scale 2",
            LayerStyle {
                rope_scale: 2.0,
                ..st
            },
            &w,
        ),
    ];
    for (what, style, ww) in variants {
        let cc = BlockConfig { style, ..c.clone() };
        let outs = world(2, |g| {
            ParallelBlock::from_global(&cc, ww, g.rank(), 2)?.forward(&h, &g)
        });
        let err = crate::support::max_abs(&(&outs[0] - &want).unwrap());
        assert!(err > 1e-4, "{what}: the output should change, got {err}");
    }
    // The config and the weights must agree on the post norms; a window of 0 is refused.
    let e = ParallelBlock::from_global(&c, &plain_w, 0, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("post_norms = true") && e.contains("lack"), "{e}");
    let zero = BlockConfig {
        style: LayerStyle {
            window: Some(0),
            ..st
        },
        ..c.clone()
    };
    let e = ParallelBlock::from_global(&zero, &w, 0, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("at least one position"), "{e}");
}

#[test]
fn qwen3_reference_has_all_eleven_tensors_and_the_norms_matter() {
    let c = qwen3(smol());
    let d = dev();
    let w = c.random_weights(24, &d).unwrap();
    let dense = DenseBlock::new(&c, &w).unwrap();
    let names: Vec<&str> = dense.vars().iter().map(|(n, _)| *n).collect();
    assert_eq!(&names[9..], ["q_norm", "k_norm"]);
    let h = Rng::xorshift64_star(25)
        .tensor(&[1, 4, c.hidden], 0.0, 1.0, &d)
        .unwrap();
    let want = dense.forward(&h).unwrap();
    // Other q/k norm weights (or none) give another output: the comparison can fail.
    let mut other = w.clone();
    other.k_norm = Some(
        Rng::xorshift64_star(26)
            .tensor(&[c.head_dim], 1.0, 0.5, &d)
            .unwrap(),
    );
    let without = BlockConfig {
        qk_norm: false,
        ..c.clone()
    };
    let mut plain = w.clone();
    (plain.q_norm, plain.k_norm) = (None, None);
    for (cc, ww) in [(&c, &other), (&without, &plain)] {
        let outs = world(3, |g| {
            ParallelBlock::from_global(cc, ww, g.rank(), 3)?.forward(&h, &g)
        });
        let err = crate::support::max_abs(&(&outs[0] - &want).unwrap());
        assert!(err > 1e-3, "q/k norms should change the output, got {err}");
    }
    // The config and the weights must agree on the norms.
    let e = ParallelBlock::from_global(&c, &plain, 0, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("qk_norm = true") && e.contains("lack"), "{e}");
    assert!(ParallelBlock::from_global(&without, &w, 0, 1).is_err());
}

#[test]
fn a_wrong_reference_is_caught() {
    // The comparison must be able to fail: a block built with other weights differs.
    let c = smol();
    let d = dev();
    let w = c.random_weights(7, &d).unwrap();
    let other = c.random_weights(8, &d).unwrap();
    let h = Rng::xorshift64_star(9)
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
fn counts(c: &BlockConfig, tp: usize, seq: usize) -> Vec<[usize; 6]> {
    let d = dev();
    let w = c.random_weights(11, &d).unwrap();
    let h = Rng::xorshift64_star(12)
        .tensor(&[1, seq, c.hidden], 0.0, 1.0, &d)
        .unwrap();
    let ops = [OpKind::AllReduce, OpKind::AllGather, OpKind::ReduceScatter];
    world(tp, |g| {
        let (rec, g) = RecordingComm::wrap(g);
        let block = ParallelBlock::from_global(c, &w, g.rank(), tp)?;
        let h_var = Var::from_tensor(&h)?;
        let out = block.forward(h_var.as_tensor(), &g)?;
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
    // The q/k norms add none: their gradient is summed over tp by the trainer, once a step.
    for tp in [2, 3] {
        for block in [
            smol(),
            qwen2(smol()),
            qwen3(smol()),
            gemma3(smol(), Some(2)),
        ] {
            for c in counts(&block, tp, 4) {
                assert_eq!(
                    c,
                    [2, 0, 0, 2, 0, 0],
                    "tp={tp} qk_norm={}: [fwd ar, ag, rs, bwd ar, ag, rs]",
                    block.qk_norm
                );
            }
        }
    }
}

#[test]
fn recomputed_attention_core_gives_the_same_bits() {
    // Selective recomputation (the attention core recomputed in the backward): the output,
    // the input gradient and every weight gradient are bitwise those without, at tp 1 and 2,
    // causal and through a window of 2.
    for block in [smol(), gemma3(smol(), Some(2))] {
        let w = block.random_weights(5, &dev()).unwrap();
        let x = Rng::xorshift64_star(9)
            .tensor(&[2, 6, block.hidden], 0.0, 1.0, &dev())
            .unwrap(); // [b, s, hidden]
        for tp in [1, 2] {
            let run = |recompute: bool| {
                world(tp, |g| {
                    let mut b = ParallelBlock::from_global(&block, &w, g.rank(), tp)?;
                    b.set_recompute_core(recompute);
                    let xv = Var::from_tensor(&x)?;
                    let y = b.forward(xv.as_tensor(), &g)?; // [b, s, hidden]
                    let grads = y.sqr()?.sum_all()?.backward()?;
                    let mut out = vec![y.flatten_all()?.to_vec1::<f32>()?];
                    let mut tensors = vec![xv.as_tensor().clone()];
                    tensors.extend(
                        b.params()?
                            .into_iter()
                            .map(|(_, v, _)| v.as_tensor().clone()),
                    );
                    for t in tensors {
                        let gt = grads.get(&t).expect("a gradient");
                        out.push(gt.flatten_all()?.to_vec1::<f32>()?);
                    }
                    Ok(out)
                })
            };
            assert_eq!(
                run(true),
                run(false),
                "tp={tp} window={:?}",
                block.style.window
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
        interleaved: bool, qk_norm: bool, gemma in 1usize..3, window in 1usize..5, seed in 0u64..1000,
    ) {
        let heads = kv * group;
        let tp = 1 + tp_pick % heads.min(4);
        let layout = if interleaved { RopeLayout::Interleaved } else { RopeLayout::RotateHalf };
        // Gemma's post norm makes a one-column FFN degenerate: the norm of a multiple of one
        // vector does not depend on the multiple, so the gate and up gradients are f32 noise
        // around zero; Gemma layers get at least two columns in all.
        let ffn = tp + ffn_extra + usize::from(gemma > 0);
        let c = BlockConfig { qk_norm, ..cfg(hidden, heads, kv, 2 * half_hd, ffn, layout) };
        // Gemma-3's layer styles: none, a local layer, a global one.
        let c = match gemma {
            0 => c,
            1 => gemma3(c, Some(window)),
            _ => gemma3(c, None),
        };
        let tol = if gemma > 0 { GEMMA_TOL } else { TOL };
        check_block_tol(&c, tp, batch, tp + seq_extra, seed, tol);
    }
}
