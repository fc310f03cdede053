//! Embedding -> block -> vocab-parallel LM head -> vocab-parallel cross-entropy, against the
//! dense pipeline: loss and every gradient, at tp 1..4 with a vocab tp does not divide, and
//! the collective count of one training step pinned.

use crate::support::{assert_close, dev, world};
use candle_core::{Tensor, Var};
use tp_comm::OpKind;
use tp_nn::{
    vocab_parallel_cross_entropy, BlockConfig, ColumnParallelLinear, DenseBlock, LayerStyle,
    ParallelBlock, Partition, RandomTensor, RecordingComm, Rng, RopeLayout, VocabParallelEmbedding,
};

const VOCAB: usize = 11;

fn cfg() -> BlockConfig {
    BlockConfig {
        hidden: 24,
        heads: 9,
        kv_heads: 3,
        head_dim: 4,
        ffn: 30,
        rope_theta: 10_000.0,
        rope_layout: RopeLayout::RotateHalf,
        rms_eps: 1e-5,
        max_seq: 8,
        qk_norm: false,
        qkv_bias: false,
        style: LayerStyle::LLAMA,
    }
}

struct Inputs {
    c: BlockConfig,
    w: tp_nn::BlockWeights,
    table: Tensor, // [vocab, hidden]
    lm: Tensor,    // [vocab, hidden]
    ids: Tensor,   // [b, s]
    tgt: Tensor,   // [b * s]
}

fn inputs() -> Inputs {
    let c = cfg();
    let d = dev();
    let w = c.random_weights(71, &d).unwrap();
    let mut rng = Rng::xorshift64_star(72);
    let table = rng.tensor(&[VOCAB, c.hidden], 0.0, 1.0, &d).unwrap();
    let lm = rng.tensor(&[VOCAB, c.hidden], 0.0, 0.3, &d).unwrap();
    let ids: Vec<u32> = (0..12).map(|_| rng.below(VOCAB as u64) as u32).collect();
    let tgt: Vec<u32> = (0..12).map(|_| rng.below(VOCAB as u64) as u32).collect();
    Inputs {
        c,
        w,
        table,
        lm,
        ids: Tensor::from_vec(ids, (2, 6), &d).unwrap(),
        tgt: Tensor::from_vec(tgt, 12, &d).unwrap(),
    }
}

/// One rank's training step: (loss, table grad, lm grad, forward all-reduces, backward all-reduces).
fn step(
    x: &Inputs,
    g: tp_comm::Group,
) -> tp_nn::Result<(Tensor, Tensor, Tensor, usize, usize, usize)> {
    let (rec, g) = RecordingComm::wrap(g);
    let (rank, tp) = (g.rank(), g.size());
    let emb = VocabParallelEmbedding::from_global(&x.table, rank, tp)?;
    let block = ParallelBlock::from_global(&x.c, &x.w, rank, tp)?;
    let head = ColumnParallelLinear::from_global(&x.lm, rank, tp)?;
    let vocab = Partition::new(VOCAB, tp, "vocab rows", "vocab row")?;
    let h = emb.forward(&x.ids, &g)?; // [b, s, hidden]
    let h = block.forward(&h, &g)?; // [b, s, hidden]
    let logits = head.forward(&h, &g)?; // [b, s, vocab_local]
    let logits = logits.reshape((12, vocab.len(rank)))?; // [b*s, vocab_local]
    let loss = vocab_parallel_cross_entropy(&logits, &x.tgt, &vocab, &g)?;
    let fwd = rec.count(OpKind::AllReduce);
    rec.reset();
    let grads = loss.backward()?;
    let bwd = rec.count(OpKind::AllReduce);
    let other: usize = rec.snapshot().values().sum::<usize>() - bwd;
    let gt = grads.get(emb.weight()).expect("table grad").clone();
    let gl = grads.get(head.weight()).expect("lm grad").clone();
    Ok((loss, gt, gl, fwd, bwd, other))
}

#[test]
fn training_step_matches_dense_and_pins_collectives() {
    let x = inputs();
    let dense = DenseBlock::new(&x.c, &x.w).unwrap();
    let (tv, lv) = (
        Var::from_tensor(&x.table).unwrap(),
        Var::from_tensor(&x.lm).unwrap(),
    );
    let h = tv
        .embedding(&x.ids.flatten_all().unwrap())
        .unwrap()
        .reshape((2, 6, x.c.hidden))
        .unwrap(); // [b, s, hidden]
    let h = dense.forward(&h).unwrap(); // [b, s, hidden]
    let logits = h
        .reshape((12, x.c.hidden))
        .unwrap()
        .matmul(&lv.t().unwrap())
        .unwrap(); // [b*s, vocab]
    let want = candle_nn::loss::cross_entropy(&logits, &x.tgt).unwrap();
    let grads = want.backward().unwrap();
    let (want_t, want_l) = (grads.get(&tv).unwrap(), grads.get(&lv).unwrap());
    for tp in 1..=4 {
        let vocab = Partition::new(VOCAB, tp, "vocab rows", "vocab row").unwrap();
        for (rank, (loss, gt, gl, fwd, bwd, other)) in
            world(tp, |g| step(&x, g)).into_iter().enumerate()
        {
            let l = |w: &str| format!("tp={tp} rank {rank} {w}");
            assert_close(&l("loss"), &loss, &want);
            let r = vocab.range(rank);
            assert_close(
                &l("table grad"),
                &gt,
                &want_t.narrow(0, r.start, r.len()).unwrap(),
            );
            assert_close(
                &l("lm head grad"),
                &gl,
                &want_l.narrow(0, r.start, r.len()).unwrap(),
            );
            // Forward: embedding g, two block g's, CE max and (sum-exp, target) = 5.
            // Backward: two block f's and the LM head's f = 3; nothing else either way.
            assert_eq!((fwd, bwd, other), (5, 3, 0), "{}", l("all-reduce counts"));
        }
    }
}
