//! Packed sequences (several documents per sequence): a block over a packed batch, with each
//! token's document position for RoPE and the block-diagonal causal mask, gives for every
//! document the output and gradients of running that document alone, at tp 1 and 2, with and
//! without the recomputed attention core, for Llama's block in both RoPE layouts and a
//! Gemma-3 layer with a window of 2 (the window within documents).
//!
//! RoPE is relative (`R(a)^T R(b) = R(b - a)`), so within documents that only see each other
//! a shift of positions (0..seq instead of each document's own) moves the outputs by
//! rounding alone: the blocks here have RoPE tables of 5 positions, the longest document, so
//! sequences of 8 rotated at 0..8 are refused and only each document's positions work.

use crate::block::gemma3;
use crate::support::{assert_close, dev, world};
use candle_core::{Tensor, Var};
use tp_nn::{BlockConfig, LayerStyle, ParallelBlock, RandomTensor, Rng, RopeLayout, Segments};

fn llama(layout: RopeLayout) -> BlockConfig {
    BlockConfig {
        hidden: 48,
        heads: 6,
        kv_heads: 2,
        head_dim: 8,
        ffn: 64,
        rope_theta: 10_000.0,
        rope_layout: layout,
        rms_eps: 1e-5,
        max_seq: 5, // the longest document (see the module's note)
        qk_norm: false,
        qkv_bias: false,
        style: LayerStyle::LLAMA,
    }
}

/// A Gemma-3 local layer with a window of 2.
fn gemma3_local() -> BlockConfig {
    gemma3(llama(RopeLayout::RotateHalf), Some(2))
}

/// Two sequences of 8: documents of 3 and 5 tokens; of 2 and 4 tokens then 2 of padding
/// (a document of its own). (row, start, length) of each.
const DOCS: [(usize, usize, usize); 5] = [(0, 0, 3), (0, 3, 5), (1, 0, 2), (1, 2, 4), (1, 6, 2)];
const SEQ: usize = 8;

fn segments() -> Segments {
    let (mut doc, mut pos) = (vec![0u32; 2 * SEQ], vec![0u32; 2 * SEQ]);
    for (d, &(row, start, len)) in DOCS.iter().enumerate() {
        for i in 0..len {
            doc[row * SEQ + start + i] = d as u32;
            pos[row * SEQ + start + i] = i as u32;
        }
    }
    Segments::new(doc, pos, 2, SEQ).unwrap()
}

/// The block's output `[2, SEQ, hidden]`, the input's gradient and every weight's, of
/// `sum(y * r)`: packed (`true`), or each document alone with the results put in place.
fn run(c: &BlockConfig, tp: usize, recompute: bool, packed: bool) -> Vec<Vec<Tensor>> {
    let d = dev();
    let w = c.random_weights(3, &d).unwrap();
    let mut rng = Rng::xorshift64_star(11);
    let x = rng.tensor(&[2, SEQ, c.hidden], 0.0, 1.0, &d).unwrap(); // [2, SEQ, hidden]
    let r = rng.tensor(&[2, SEQ, c.hidden], 0.0, 1.0, &d).unwrap(); // [2, SEQ, hidden]
    let seg = segments();
    world(tp, |g| {
        let mut b = ParallelBlock::from_global(c, &w, g.rank(), tp)?;
        b.set_recompute_core(recompute);
        let xv = Var::from_tensor(&x)?;
        let (y, objective) = if packed {
            let y = b
                .forward_packed(xv.as_tensor(), &g, Default::default(), Some(&seg))?
                .hidden; // [2, SEQ, hidden]
            let objective = (&y * &r)?.sum_all()?;
            (y, objective)
        } else {
            let mut rows = [Vec::new(), Vec::new()];
            let mut objective = Tensor::zeros((), candle_core::DType::F32, &d)?;
            for &(row, start, len) in &DOCS {
                let xd = xv.as_tensor().narrow(0, row, 1)?.narrow(1, start, len)?; // [1, len, hidden]
                let yd = b.forward(&xd, &g)?; // [1, len, hidden]
                let rd = r.narrow(0, row, 1)?.narrow(1, start, len)?; // [1, len, hidden]
                objective = (objective + (&yd * &rd)?.sum_all()?)?;
                rows[row].push(yd);
            }
            let rows = rows
                .iter()
                .map(|p| Tensor::cat(p, 1))
                .collect::<candle_core::Result<Vec<_>>>()?;
            (Tensor::cat(&rows, 0)?, objective) // [2, SEQ, hidden]
        };
        let grads = objective.backward()?;
        let mut out = vec![y, grads.get(xv.as_tensor()).expect("x grad").clone()];
        for (_, v, _) in b.params()? {
            out.push(
                grads
                    .get(v.as_tensor())
                    .expect("a weight's gradient")
                    .clone(),
            );
        }
        Ok(out)
    })
}

#[test]
fn a_packed_batch_equals_each_document_alone() {
    for (name, c) in [
        ("Llama interleaved", llama(RopeLayout::Interleaved)),
        ("Llama rotate-half", llama(RopeLayout::RotateHalf)),
        ("Gemma-3 window 2", gemma3_local()),
    ] {
        for tp in [1, 2] {
            for recompute in [false, true] {
                let got = run(&c, tp, recompute, true);
                let want = run(&c, tp, recompute, false);
                for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
                    for (i, (g, w)) in g.iter().zip(w).enumerate() {
                        let what = format!(
                            "{name} tp={tp} recompute={recompute} rank {rank} tensor {i} \
                             (0: output, 1: input grad, then the weights' grads)"
                        );
                        assert_close(&what, g, w);
                    }
                }
            }
        }
    }
}

#[test]
fn the_packed_mask_is_block_diagonal_causal_within_the_window() {
    let m = segments().mask(Some(2), &dev()).unwrap(); // [2, 1, SEQ, SEQ]
    let m = m.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let sees = |row: usize, i: usize, j: usize| m[(row * SEQ + i) * SEQ + j] == 0.0;
    assert!(sees(0, 4, 3) && sees(0, 4, 4) && !sees(0, 4, 2) && !sees(0, 4, 5));
    assert!(sees(0, 2, 1) && !sees(0, 2, 0)); // the window of 2
    assert!(!sees(0, 3, 2)); // the first token of a document sees only itself
    assert!(sees(1, 7, 6) && !sees(1, 6, 5)); // padding is a document of its own
    let bad = Segments::new(vec![0, 0, 1], vec![0, 2, 0], 1, 3).unwrap_err();
    assert!(bad.to_string().contains("expected 1"), "{bad}");
    let bad = Segments::new(vec![0, 0], vec![0, 1], 1, 3).unwrap_err();
    assert!(bad.to_string().contains("2 document ids"), "{bad}");
}
