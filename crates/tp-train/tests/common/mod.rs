//! Shared helpers of the training tests: the small model and corpus of
//! `tp_train::fixtures` (uneven at tp 3), and running a layout on rank threads.
#![allow(dead_code)] // each test binary uses a subset

pub mod logits;

use std::path::PathBuf;
use tp_comm::local::{run, LocalOptions};
use tp_comm::{ParallelDims, ProcessGroups};
use tp_train::{Checkpoint, Corpus, StepReport, TrainOptions, TrainSpec, Trainer};

/// Relative tolerance of a layout's loss against tp1's at the same step.
pub const LOSS_TOL: f64 = 1e-4;

#[allow(unused_imports)] // each test binary uses a subset
pub use tp_train::fixtures::spec;

pub fn corpus() -> Corpus {
    tp_train::fixtures::corpus().expect("corpus")
}

pub fn dims(tp: usize, pp: usize, dp: usize) -> ParallelDims {
    ParallelDims { tp, pp, dp }
}

pub fn tokenizer_json() -> String {
    tp_train::TextTokenizer::Bytes.json().unwrap()
}

/// Runs `f` with a trainer on every rank of `spec.dims`; returns each rank's value.
pub fn with_trainers<R: Send>(
    spec: &TrainSpec,
    resume: Option<&Checkpoint>,
    opts: TrainOptions,
    f: impl Fn(&mut Trainer<'_>) -> tp_train::Result<R> + Sync,
) -> Vec<Result<R, String>> {
    with_trainers_on(spec, &corpus(), resume, opts, f)
}

/// [`with_trainers`] on the data `corpus`.
pub fn with_trainers_on<R: Send>(
    spec: &TrainSpec,
    corpus: &Corpus,
    resume: Option<&Checkpoint>,
    opts: TrainOptions,
    f: impl Fn(&mut Trainer<'_>) -> tp_train::Result<R> + Sync,
) -> Vec<Result<R, String>> {
    let tok = tokenizer_json();
    let outs = run(spec.dims.world_size(), LocalOptions::default(), |world| {
        let groups = ProcessGroups::new(world, spec.dims)?;
        let start = resume.map_or(tp_train::Start::Fresh, tp_train::Start::Resume);
        let mut t = Trainer::new(spec, groups, corpus, &tok, start, opts.clone())?;
        f(&mut t)
    })
    .expect("world starts");
    outs.into_iter()
        .map(|o| match o {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(e.to_string()),
            Err(panic) => Err(format!("panicked: {panic}")),
        })
        .collect()
}

/// Trains `spec` from scratch for its first `steps` steps, saves a checkpoint into `dir` and
/// opens it: rank 0's step reports and the checkpoint.
pub fn train_and_save(
    spec: &TrainSpec,
    steps: usize,
    dir: &std::path::Path,
) -> (Vec<StepReport>, Checkpoint) {
    let reports = with_trainers(spec, None, TrainOptions::default(), |t| {
        let mut reports = Vec::new();
        for _ in 0..steps {
            reports.push(t.step()?);
        }
        t.save_to(dir)?;
        Ok(reports)
    })
    .swap_remove(0)
    .expect("first part");
    (reports, Checkpoint::open(dir).expect("checkpoint opens"))
}

/// Trains `spec` (fresh or resumed) to `spec.steps`; rank 0's step reports.
pub fn train(spec: &TrainSpec, resume: Option<&Checkpoint>) -> Vec<StepReport> {
    train_on(spec, &corpus(), resume)
}

/// [`train`] on the data `corpus`.
pub fn train_on(spec: &TrainSpec, corpus: &Corpus, resume: Option<&Checkpoint>) -> Vec<StepReport> {
    let mut outs = with_trainers_on(spec, corpus, resume, TrainOptions::default(), |t| {
        let mut reports = Vec::new();
        t.run(&mut |r| reports.push(r.clone()))?;
        Ok(reports)
    });
    for (rank, o) in outs.iter().enumerate() {
        if let Err(e) = o {
            panic!("{:?} rank {rank}: {e}", spec.dims);
        }
    }
    outs.swap_remove(0).unwrap_or_default()
}

/// Largest relative difference of the losses, step by step (steps must line up).
pub fn max_rel_loss_diff(got: &[StepReport], want: &[StepReport]) -> f64 {
    assert_eq!(got.len(), want.len(), "step counts differ");
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            assert_eq!(g.step, w.step);
            (g.loss - w.loss).abs() / w.loss.abs()
        })
        .fold(0.0, f64::max)
}

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    tp_testkit::scratch_dir(&format!("train-{name}"))
}

/// Every step's gradient norm in `got` within `tol` (relative) of `want`'s at the same step.
pub fn assert_grad_norms_close(what: &str, got: &[StepReport], want: &[StepReport], tol: f64) {
    for (g, w) in got.iter().zip(want) {
        let rel = (g.grad_norm - w.grad_norm).abs() / w.grad_norm;
        assert!(
            rel <= tol,
            "{what}: step {} grad norm {} vs {}",
            g.step,
            g.grad_norm,
            w.grad_norm
        );
    }
}

/// A checkpoint's whole state as three flat buffers in the tp 1 order of its parameters:
/// the weights and AdamW's two moments (to compare two runs' saved state element by element).
pub fn saved_state(ck: &Checkpoint) -> [Vec<f32>; 3] {
    use tp_train::init::WeightSource;
    let specs = tp_train::layout::rank_params(&ck.config, 0, 1, 1, 0, 1).expect("tp 1 specs");
    let mut weights = Vec::new();
    for s in &specs {
        let t = ck
            .global(s.weight, &s.name, &s.shape)
            .expect("saved weight");
        weights.extend(t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    let (m, v) = ck.optimizer_shards(&specs).expect("saved moments");
    [weights, m, v]
}

/// The largest difference of two buffers relative to `b`'s largest magnitude.
pub fn max_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let scale = b.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs()));
    let diff = a.iter().zip(b).fold(0f64, |m, (&x, &y)| {
        m.max((f64::from(x) - f64::from(y)).abs())
    });
    diff / scale.max(f64::MIN_POSITIVE)
}
