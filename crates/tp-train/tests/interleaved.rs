//! Virtual pipeline stages (issue 34; the interleaved 1F1B schedule of Narayanan et al. 2021
//! §2.2.2) against the oracle of tests/parity.rs: the same run without them. The fixture's 4
//! layers at pp 2 x 2 virtual stages are 4 chunks of one layer, rank 0 holding layers 0 and 2
//! (the embedding on the first), rank 1 layers 1 and 3 (the head on the last), messages
//! wrapping from rank 1 back to rank 0 between them. 12 steps give the same loss at every
//! step as 1F1B at the same layout and as tp 1 within 1e-4 relative, at pp 2, tp 2 x pp 2,
//! pp 3 and pp 4 (6 and 8 layers), with tied embeddings, sequence parallelism, full and
//! selective recomputation, packed documents, the distributed optimizer at pp 2 x dp 2, and
//! for the Gemma-3 and the Mixtral; a checkpoint of a run at 2 virtual stages resumes at 1
//! and at other layouts; bad counts are refused naming the valid ones. The schedule's order,
//! memory, deadlock freedom and bubble are tested in `tp_train::schedule`.

mod common;
use common::*;
use tp_train::{Recompute, TrainOptions, TrainSpec};

const STEPS: u64 = 12;

/// `spec` with `v` virtual stages.
fn virt(spec: TrainSpec, v: usize) -> TrainSpec {
    TrainSpec {
        virtual_stages: v,
        ..spec
    }
}

/// Trains `s` with 1 and with 2 virtual stages and against tp 1; asserts every step's loss
/// within the tolerance, and the gradient norms against 1F1B within 1e-3.
fn same_curve(what: &str, s: &TrainSpec, oracle: &[tp_train::StepReport]) {
    let one = train(&virt(s.clone(), 1), None);
    let two = train(&virt(s.clone(), 2), None);
    assert_eq!(two.len(), STEPS as usize);
    let d = s.dims;
    for (against, want) in [("1F1B", &one[..]), ("tp 1", oracle)] {
        let diff = max_rel_loss_diff(&two, want);
        eprintln!(
            "{what} tp={} pp={} dp={} m={}: 2 virtual stages vs {against}: max relative loss \
             difference {diff:.2e}",
            d.tp, d.pp, d.dp, s.micro_batches
        );
        assert!(diff <= LOSS_TOL, "{what} {d:?} vs {against}: {diff:e}");
    }
    assert_grad_norms_close(what, &two, &one, 1e-3);
}

#[test]
fn two_virtual_stages_follow_1f1b_and_tp1_at_pp2_and_tp2_x_pp2() {
    let oracle = train(&spec(dims(1, 1, 1), STEPS, 1), None);
    for (d, micro) in [(dims(1, 2, 1), 4), (dims(1, 2, 1), 2), (dims(2, 2, 1), 4)] {
        same_curve("Llama", &spec(d, STEPS, micro), &oracle);
    }
}

#[test]
fn two_virtual_stages_with_tied_embeddings_sp_recompute_and_the_distributed_optimizer() {
    let mut tied = spec(dims(1, 1, 1), STEPS, 1);
    tied.model.tied_embeddings = true;
    let tied_oracle = train(&tied, None);
    let mut s = spec(dims(2, 2, 1), STEPS, 4);
    s.model.tied_embeddings = true;
    same_curve("tied", &s, &tied_oracle);

    let oracle = train(&spec(dims(1, 1, 1), STEPS, 1), None);
    let s = TrainSpec {
        sequence_parallel: true,
        recompute: Recompute::Full,
        ..spec(dims(2, 2, 1), STEPS, 4)
    };
    same_curve("sequence parallel, full recompute", &s, &oracle);
    let s = TrainSpec {
        recompute: Recompute::Selective,
        ..spec(dims(2, 2, 1), STEPS, 4)
    };
    same_curve("selective recompute", &s, &oracle);
    let s = TrainSpec {
        distributed_optimizer: true,
        ..spec(dims(1, 2, 2), STEPS, 2)
    };
    same_curve("distributed optimizer", &s, &oracle);
}

/// Deeper pipelines, where a rank's two neighbours differ: 8 layers at pp 4 x 2 virtual
/// stages (4 micro-batches) and 6 layers at pp 3 x 2 (3 micro-batches of 2 sequences).
#[test]
fn two_virtual_stages_at_pp3_and_pp4() {
    for (layers, pp, micro, batch) in [(8, 4, 4, 4), (6, 3, 3, 6)] {
        let deeper = |d| {
            let mut s = spec(d, STEPS, 1);
            s.model.layers = layers;
            s.global_batch = batch;
            s
        };
        let oracle = train(&deeper(dims(1, 1, 1)), None);
        let s = TrainSpec {
            micro_batches: micro,
            ..deeper(dims(1, pp, 1))
        };
        same_curve(&format!("{layers} layers"), &s, &oracle);
    }
}

/// The other families: Gemma-3's layers differ by index (windows and RoPE bases on layers 0
/// and 2, both on rank 0 at V = 2), the Mixtral adds each chunk's load-balancing loss.
#[test]
fn two_virtual_stages_for_gemma3_and_mixtral() {
    use tp_train::fixtures::{gemma3_spec, moe_spec};
    let gemma = train(&gemma3_spec(dims(1, 1, 1), STEPS, 1), None);
    same_curve("Gemma-3", &gemma3_spec(dims(2, 2, 1), STEPS, 4), &gemma);
    // One sequence per micro-batch, as tests/parity.rs runs the Mixtral.
    let moe = train(&moe_spec(dims(1, 1, 1), STEPS, 4), None);
    same_curve("Mixtral", &moe_spec(dims(1, 2, 1), STEPS, 4), &moe);
}

/// Packed documents: each step's loss and, after the last, the validation loss of the whole
/// corpus (forwards only, through the chunks in model order).
#[test]
fn two_virtual_stages_on_packed_documents_and_the_validation_loss() {
    let corpus = tp_train::fixtures::packed_corpus().expect("packed");
    let run = |d, micro, v| -> Vec<f64> {
        let s = TrainSpec {
            pack: true,
            ..virt(spec(d, STEPS, micro), v)
        };
        let mut outs = with_trainers_on(&s, &corpus, None, TrainOptions::default(), |t| {
            let mut out = Vec::new();
            for _ in 0..STEPS {
                out.push(t.step()?.loss);
            }
            out.push(t.validation_loss(&corpus)?);
            Ok(out)
        });
        outs.swap_remove(0).expect("trains")
    };
    let oracle = run(dims(1, 1, 1), 1, 1);
    for (d, micro) in [(dims(1, 2, 1), 2), (dims(2, 2, 1), 4)] {
        let got = run(d, micro, 2);
        let worst = got
            .iter()
            .zip(&oracle)
            .map(|(g, w)| (g - w).abs() / w.abs())
            .fold(0.0, f64::max);
        eprintln!("packed {d:?}, 2 virtual stages vs tp 1: max relative difference {worst:.2e}");
        assert!(worst <= LOSS_TOL, "packed {d:?}: {worst:e}");
    }
}

/// Checkpoints hold every tensor whole by name: a run at pp 2 x 2 virtual stages saved after
/// 6 steps resumes at 1 virtual stage, at tp 2 x pp 1 and at tp 2 x pp 2 x 2 virtual stages,
/// and continues the uninterrupted run's curve.
#[test]
fn a_checkpoint_at_two_virtual_stages_resumes_at_one_and_at_other_layouts() {
    let dir = scratch("interleaved-resume");
    let s = virt(spec(dims(1, 2, 1), STEPS, 4), 2);
    let full = train(&s, None);
    let (first, ck) = train_and_save(&s, 6, &dir);
    let first: Vec<f64> = first.iter().map(|r| r.loss).collect();
    let want: Vec<f64> = full[..6].iter().map(|r| r.loss).collect();
    assert_eq!(first, want, "same layout and seed must reproduce exactly");
    let saved = &ck.state.saved_layout;
    assert_eq!((saved.pp, saved.virtual_stages), (2, 2));
    // Layer 2 is rank 0's second chunk.
    let layer2 = saved
        .tensors
        .iter()
        .find(|t| t.name == "model.layers.2.mlp.down_proj.weight")
        .expect("layer 2 saved");
    assert_eq!(layer2.pp_stage, 0);
    for (d, micro, v) in [
        (dims(1, 2, 1), 4, 1),
        (dims(2, 1, 1), 1, 1),
        (dims(2, 2, 1), 2, 2),
    ] {
        let got = train(&virt(spec(d, STEPS, micro), v), Some(&ck));
        let diff = max_rel_loss_diff(&got, &full[6..]);
        eprintln!("resumed at {d:?} v={v}: max relative loss difference {diff:.2e}");
        assert!(diff <= LOSS_TOL, "resumed at {d:?} v={v}: {diff:e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn virtual_stages_need_a_pipeline_a_layer_per_chunk_and_micro_batches_in_groups_of_pp() {
    let check = |d, micro, v| {
        virt(spec(d, 1, micro), v)
            .validate()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let e = check(dims(1, 1, 1), 1, 2);
    assert!(e.contains("this run has one stage"), "{e}");
    let e = check(dims(1, 2, 1), 4, 3);
    assert!(
        e.contains("4 layers cannot give each of 2 pipeline stages x 3 virtual stages a layer")
            && e.contains("use 1 to 2 virtual stages at pp=2"),
        "{e}"
    );
    let e = check(dims(1, 4, 1), 2, 2);
    assert!(e.contains("use 1 to 1 virtual stages at pp=4"), "{e}");
    let e = check(dims(1, 2, 1), 1, 2);
    assert!(
        e.contains("1 micro-batches per replica is not a multiple of 2; use 2"),
        "{e}"
    );
    let e = check(dims(1, 2, 1), 2, 0);
    assert!(e.contains("at least 1"), "{e}");
    assert_eq!(check(dims(1, 2, 1), 2, 2), "");
}
