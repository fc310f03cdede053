//! Layer-level checks: vocab-parallel cross-entropy and embedding (vocab not divisible by
//! tp), column/row linears through the gather/scatter mappings, the sequence-parallel pair.

use crate::support::{assert_close, dev, world};
use candle_core::{Tensor, Var};
use tp_nn::{
    gather_from_sequence_parallel, reduce_scatter_to_sequence_parallel,
    vocab_parallel_cross_entropy, ColumnParallelLinear, Partition, RandomTensor, Rng,
    RowParallelLinear, TpError, VocabParallelEmbedding,
};

fn targets(n: usize, vocab: usize, seed: u64) -> Tensor {
    let mut rng = Rng::xorshift64_star(seed);
    let t: Vec<u32> = (0..n).map(|_| rng.below(vocab as u64) as u32).collect();
    Tensor::from_vec(t, n, &dev()).unwrap()
}

#[test]
fn vocab_parallel_cross_entropy_matches_dense_loss_and_grad() {
    let (n, vocab) = (7, 11); // 11 is not divisible by 2, 3 or 4
    let logits = Rng::xorshift64_star(21)
        .tensor(&[n, vocab], 0.0, 4.0, &dev())
        .unwrap(); // [n, vocab]
    let tgt = targets(n, vocab, 22);
    let lv = Var::from_tensor(&logits).unwrap();
    let want = candle_nn::loss::cross_entropy(lv.as_tensor(), &tgt).unwrap();
    let want_grad = want
        .backward()
        .unwrap()
        .get(lv.as_tensor())
        .unwrap()
        .clone(); // [n, vocab]
    for tp in 1..=4 {
        let outs = world(tp, |g| {
            let p = Partition::new(vocab, tp, "vocab rows", "vocab row")?;
            let r = p.range(g.rank());
            let local = Var::from_tensor(&logits.narrow(1, r.start, r.len())?)?; // [n, vocab_local]
            let loss = vocab_parallel_cross_entropy(local.as_tensor(), &tgt, &p, &g)?;
            let grad = loss
                .backward()?
                .get(local.as_tensor())
                .expect("logit grad")
                .clone();
            Ok((loss, grad, r))
        });
        for (rank, (loss, grad, r)) in outs.iter().enumerate() {
            assert_close(&format!("tp={tp} rank {rank} loss"), loss, &want);
            let slice = want_grad.narrow(1, r.start, r.len()).unwrap();
            assert_close(&format!("tp={tp} rank {rank} logit grad"), grad, &slice);
        }
    }
}

#[test]
fn vocab_parallel_embedding_matches_dense() {
    let (vocab, hidden) = (13, 6);
    let table = Rng::xorshift64_star(31)
        .tensor(&[vocab, hidden], 0.0, 1.0, &dev())
        .unwrap();
    let ids = targets(10, vocab, 32).reshape((2, 5)).unwrap(); // [2, 5]
    let r = Rng::xorshift64_star(33)
        .tensor(&[2, 5, hidden], 0.0, 1.0, &dev())
        .unwrap();
    let tv = Var::from_tensor(&table).unwrap();
    let want = tv
        .as_tensor()
        .embedding(&ids.flatten_all().unwrap())
        .unwrap()
        .reshape((2, 5, hidden))
        .unwrap();
    let want_grad = (&want * &r)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap()
        .get(tv.as_tensor())
        .unwrap()
        .clone();
    for tp in 1..=4 {
        let outs = world(tp, |g| {
            let emb = VocabParallelEmbedding::from_global(&table, g.rank(), tp)?;
            let out = emb.forward(&ids, &g)?; // [2, 5, hidden]
            let grad = (&out * &r)?
                .sum_all()?
                .backward()?
                .get(emb.weight().as_tensor())
                .expect("grad")
                .clone();
            Ok((out, grad, emb.vocab_range()))
        });
        for (rank, (out, grad, range)) in outs.iter().enumerate() {
            assert_close(&format!("tp={tp} rank {rank} embedding"), out, &want);
            let slice = want_grad.narrow(0, range.start, range.len()).unwrap();
            assert_close(&format!("tp={tp} rank {rank} table grad"), grad, &slice);
        }
    }
    let e = world(2, |g| {
        let emb = VocabParallelEmbedding::from_global(&table, g.rank(), 2)?;
        let bad = Tensor::new(&[3u32, 13], &dev())?;
        Ok(emb.forward(&bad, &g).map_err(|e| e.to_string()))
    });
    assert!(e[0]
        .as_ref()
        .unwrap_err()
        .contains("outside the vocabulary of 13"));
}

/// Column-parallel (gathered output) then row-parallel (scattered input): y = (x A^T) B^T.
#[test]
fn column_then_row_parallel_linear_match_dense() {
    let d = dev();
    let mut rng = Rng::xorshift64_star(41);
    let x = rng.tensor(&[2, 3, 5], 0.0, 1.0, &d).unwrap(); // [2, 3, in]
    let a = rng.tensor(&[7, 5], 0.0, 0.5, &d).unwrap(); // [mid, in], 7 not divisible by 2..4
    let b = rng.tensor(&[4, 7], 0.0, 0.5, &d).unwrap(); // [out, mid]
    let r = rng.tensor(&[2, 3, 4], 0.0, 1.0, &d).unwrap(); // [2, 3, out]
    let (xv, av, bv) = (
        Var::from_tensor(&x).unwrap(),
        Var::from_tensor(&a).unwrap(),
        Var::from_tensor(&b).unwrap(),
    );
    let want = xv
        .as_tensor()
        .broadcast_matmul(&av.t().unwrap())
        .unwrap()
        .broadcast_matmul(&bv.t().unwrap())
        .unwrap();
    let gr = (&want * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let (wx, wa, wb) = (
        gr.get(&xv).unwrap(),
        gr.get(&av).unwrap(),
        gr.get(&bv).unwrap(),
    );
    for tp in 1..=4 {
        let outs = world(tp, |g| {
            let col = ColumnParallelLinear::from_global(&a, g.rank(), tp)?.with_gather_output(true);
            let row = RowParallelLinear::from_global(&b, g.rank(), tp)?;
            let sizes = Partition::new(7, tp, "features", "feature")?.sizes();
            let xv = Var::from_tensor(&x)?;
            let mid = col.forward(xv.as_tensor(), &g)?; // [2, 3, mid] replicated
            let mid_local = tp_nn::scatter_last_dim(&mid, &g, &sizes)?; // [2, 3, mid_local]
            let y = row.forward(&mid_local, &g)?.reduce()?; // [2, 3, out]
            let gr = (&y * &r)?.sum_all()?.backward()?;
            let ga = gr.get(col.weight().as_tensor()).expect("a grad").clone();
            let gb = gr.get(row.weight().as_tensor()).expect("b grad").clone();
            Ok((
                y,
                gr.get(xv.as_tensor()).expect("x grad").clone(),
                ga,
                gb,
                Partition::new(7, tp, "f", "f")?.range(g.rank()),
            ))
        });
        for (rank, (y, gx, ga, gb, rr)) in outs.iter().enumerate() {
            let l = |w: &str| format!("tp={tp} rank {rank} {w}");
            assert_close(&l("output"), y, &want);
            assert_close(&l("x grad"), gx, wx);
            assert_close(&l("a grad"), ga, &wa.narrow(0, rr.start, rr.len()).unwrap());
            assert_close(&l("b grad"), gb, &wb.narrow(1, rr.start, rr.len()).unwrap());
        }
    }
}

#[test]
fn sequence_parallel_pair_is_conjugate() {
    // gather(seq) then reduce_scatter(seq) of a per-rank scaled copy: forward and backward.
    let d = dev();
    let x = Rng::xorshift64_star(51)
        .tensor(&[2, 5, 3], 0.0, 1.0, &d)
        .unwrap(); // [b, seq, h]
    for tp in 1..=4 {
        let sizes = Partition::new(5, tp, "positions", "position")
            .unwrap()
            .sizes();
        let outs = world(tp, |g| {
            let p = Partition::new(5, tp, "positions", "position")?.range(g.rank());
            let xl = Var::from_tensor(&x.narrow(1, p.start, p.len())?)?; // [b, seq_local, h]
            let full = gather_from_sequence_parallel(xl.as_tensor(), &g, 1, &sizes)?; // [b, seq, h]
            let scaled = (&full * (g.rank() + 1) as f64)?; // [b, seq, h]
            let back = reduce_scatter_to_sequence_parallel(&scaled, &g, 1, &sizes)?; // [b, seq_local, h]
            let grad = back
                .sum_all()?
                .backward()?
                .get(xl.as_tensor())
                .expect("grad")
                .clone();
            Ok((full, back, grad, p))
        });
        let k = (tp * (tp + 1) / 2) as f64; // sum of the scales
        for (rank, (full, back, grad, p)) in outs.iter().enumerate() {
            assert_close(&format!("tp={tp} rank {rank} gathered"), full, &x);
            let want = (x.narrow(1, p.start, p.len()).unwrap() * k).unwrap();
            assert_close(
                &format!("tp={tp} rank {rank} reduce-scattered"),
                back,
                &want,
            );
            // d/dx_local of sum over ranks: every rank's scale, so k everywhere.
            assert_close(
                &format!("tp={tp} rank {rank} grad"),
                grad,
                &(grad.ones_like().unwrap() * k).unwrap(),
            );
        }
    }
}

#[test]
fn a_group_of_the_wrong_size_is_rejected() {
    let w = Rng::xorshift64_star(61)
        .tensor(&[6, 4], 0.0, 1.0, &dev())
        .unwrap();
    let errs = world(2, |g| {
        let col = ColumnParallelLinear::from_global(&w, g.rank(), 3)?;
        Ok(matches!(
            col.forward(&w, &g),
            Err(TpError::GroupMismatch { .. })
        ))
    });
    assert!(errs.iter().all(|&b| b));
}

#[test]
fn a_failed_collective_is_a_typed_comm_error() {
    // Ranks disagree on the length of an all-reduce: a desync, reported as TpError::Comm.
    let outs = world(2, |g| {
        let n = 3 + g.rank();
        let x = Tensor::zeros(n, candle_core::DType::F32, &dev())?;
        Ok(match tp_nn::reduce_from_tp(&x, &g) {
            Err(TpError::Comm(_)) => "comm",
            Err(_) => "other error",
            Ok(_) => "ok",
        })
    });
    assert!(outs.iter().all(|o| *o == "comm"), "{outs:?}");
}
