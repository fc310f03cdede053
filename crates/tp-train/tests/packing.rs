//! Packed sequences (issue 34): the oracle is the same documents one per sequence, each
//! padded alone. A packed batch's loss (and the validation loss of the whole corpus, the
//! forward-only path) and every gradient shard of every rank equal the
//! unpacked batch's (the same targets in the loss, the same normalisation) within 1e-5, at
//! tp 1, tp 2, tp 2 with sequence parallelism, pp 2, tp 2 x pp 2, and with selective and full
//! recomputation, for the Llama of the test kit (RoPE: positions must restart at each
//! document) and the Gemma-3 (windows of 6 within documents). Training 10 steps packed at
//! tp 2 and at pp 2 gives tp 1's losses within 1e-4.

mod common;
use common::*;
use tp_comm::ParallelDims;
use tp_train::fixtures::{documents, gemma3_spec};
use tp_train::{Corpus, Recompute, TrainOptions, TrainSpec};

const DOCS: usize = 11;
const PAD: u32 = 0;

fn unpacked() -> Corpus {
    Corpus::documents(&documents(DOCS), 16, PAD, 3).unwrap()
}

fn packed() -> Corpus {
    Corpus::packed(&documents(DOCS), 16, PAD, 3).unwrap()
}

/// The validation loss of all of `corpus` and one step's loss and each rank's gradient
/// shards over all of its windows (one global batch of them, `micro` micro-batches).
fn step(mut spec: TrainSpec, corpus: &Corpus, micro: usize) -> Vec<([f64; 2], Vec<Vec<f32>>)> {
    spec.global_batch = corpus.windows() as usize;
    spec.micro_batches = micro;
    spec.pack = corpus.is_packed();
    spec.steps = 1;
    with_trainers_on(&spec, corpus, None, TrainOptions::default(), |t| {
        let val = t.validation_loss(corpus)?;
        let (loss, _) = t.compute_gradients()?;
        let per_param = (0..t.specs().len())
            .map(|i| t.grads_flat()[t.flat_layout().range(i)].to_vec())
            .collect();
        Ok(([val, loss], per_param))
    })
    .into_iter()
    .map(|r| r.expect("rank"))
    .collect()
}

fn with(mut s: TrainSpec, sp: bool, recompute: Recompute) -> TrainSpec {
    s.sequence_parallel = sp;
    s.recompute = recompute;
    s
}

#[test]
fn packing_puts_several_documents_in_a_window_and_pads_less() {
    let (p, u) = (packed(), unpacked());
    let st = p.pack_stats().unwrap();
    assert_eq!((st.documents, st.windows), (DOCS, p.windows() as usize));
    assert_eq!(u.windows(), DOCS as u64);
    assert!(p.windows() < u.windows(), "{st:?}");
    assert!(st.padding_packed < st.padding_unpacked / 2.0, "{st:?}");
    assert!(u.pack_stats().is_none() && !u.is_packed());
    // A document longer than a window is an error, as unpacked.
    let e = Corpus::packed(&[(vec![1; 18], vec![true; 18])], 16, PAD, 0).unwrap_err();
    assert!(e.to_string().contains("document 1 has 18 tokens"), "{e}");
    // The same targets are in the loss.
    let count = |c: &Corpus| c.all_batches(64)[0].2.iter().sum::<f32>();
    assert_eq!(count(&p), count(&u));
    // Positions restart at each document; the inputs are the documents back to back.
    let (ids, _, _) = p.batch(0, p.windows() as usize);
    let (doc, pos) = p.segments(0, p.windows() as usize).unwrap();
    for i in 1..ids.len() {
        if i % 16 != 0 && doc[i] == doc[i - 1] {
            assert_eq!(pos[i], pos[i - 1] + 1);
        } else {
            assert_eq!(pos[i], 0);
        }
    }
}

fn packed_gradients_equal_unpacked(name: &str, spec: fn(ParallelDims, u64, usize) -> TrainSpec) {
    let (p, u) = (packed(), unpacked());
    let mut worst = 0f64;
    for (d, sp, r) in [
        (dims(1, 1, 1), false, Recompute::None),
        (dims(2, 1, 1), false, Recompute::None),
        (dims(2, 1, 1), true, Recompute::None),
        (dims(2, 1, 1), false, Recompute::Selective),
        (dims(2, 1, 1), true, Recompute::Full),
        (dims(1, 2, 1), false, Recompute::None),
        (dims(2, 2, 1), false, Recompute::Full),
    ] {
        let want = step(with(spec(d, 1, 1), sp, r), &u, 1);
        let got = step(with(spec(d, 1, 1), sp, r), &p, 1);
        let what = format!("{name} {d:?} sp={sp} {r:?}");
        for (rank, ((gl, g), (wl, w))) in got.iter().zip(&want).enumerate() {
            for (kind, (gl, wl)) in ["validation", "training"].iter().zip(gl.iter().zip(wl)) {
                let rel = (gl - wl).abs() / wl.abs();
                worst = worst.max(rel);
                assert!(
                    rel <= 1e-5,
                    "{what} rank {rank}: {kind} loss {gl} packed, {wl} unpacked"
                );
            }
            for (i, (g, w)) in g.iter().zip(w).enumerate() {
                let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
                let err = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                worst = worst.max(f64::from(err / scale));
                assert!(
                    err <= 1e-5 * scale,
                    "{what} rank {rank} parameter {i}: gradient differs by {err:e} (scale \
                     {scale:e})"
                );
            }
        }
    }
    eprintln!("{name}: worst relative loss or gradient difference packed/unpacked {worst:.2e}");
}

#[test]
fn llama_packed_loss_and_gradients_equal_unpacked() {
    packed_gradients_equal_unpacked("Llama", spec);
}

#[test]
fn gemma3_packed_loss_and_gradients_equal_unpacked() {
    packed_gradients_equal_unpacked("Gemma-3", gemma3_spec);
}

#[test]
fn packed_training_at_tp2_and_pp2_follows_tp1() {
    // More documents than one batch, so the steps see different windows.
    let corpus = tp_train::fixtures::packed_corpus().unwrap();
    let run = |d: ParallelDims, micro: usize| {
        let mut s = spec(d, 10, micro);
        s.pack = true;
        train_on(&s, &corpus, None)
    };
    let reference = run(dims(1, 1, 1), 2);
    assert_eq!(reference.len(), 10);
    assert!(
        reference[9].loss < reference[0].loss,
        "training lowers the loss"
    );
    for (d, micro) in [(dims(2, 1, 1), 2), (dims(1, 2, 1), 4)] {
        let got = run(d, micro);
        let diff = max_rel_loss_diff(&got, &reference);
        eprintln!(
            "packed tp={} pp={}: max relative loss difference {diff:.2e}",
            d.tp, d.pp
        );
        assert!(
            diff <= LOSS_TOL,
            "packed {d:?}: loss differs from tp 1 by {diff:e}"
        );
        assert_grad_norms_close(&format!("packed {d:?}"), &got, &reference, LOSS_TOL);
    }
}

#[test]
fn a_run_and_its_data_must_agree_on_packing() {
    let s = spec(dims(1, 1, 1), 1, 1);
    let e = with_trainers_on(&s, &packed(), None, TrainOptions::default(), |_| Ok(()));
    let e = e[0].as_ref().unwrap_err();
    assert!(e.contains("does not ask for packed sequences"), "{e}");
}
