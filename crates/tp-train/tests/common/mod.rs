//! Shared helpers of the training tests: a small model whose heads, FFN and vocabulary split
//! unevenly at tp 3, a slice of the built-in corpus, and running a layout on rank threads.
#![allow(dead_code)] // each test binary uses a subset

use std::path::PathBuf;
use tp_comm::local::{run, LocalOptions};
use tp_comm::{ParallelDims, ProcessGroups};
use tp_train::{
    AdamWConfig, Checkpoint, Corpus, ModelConfig, StepReport, TrainOptions, TrainSpec, Trainer,
};

/// Relative tolerance of a layout's loss against tp1's at the same step.
pub const LOSS_TOL: f64 = 1e-4;

/// 4 heads (2 KV heads), FFN 64, vocabulary 256: at tp 3 the heads split 2/1/1, the KV head
/// 1 is shared by two ranks, FFN 22/21/21 and vocab 86/85/85.
pub fn model() -> ModelConfig {
    ModelConfig {
        vocab_size: 256,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        max_position_embeddings: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        tie_word_embeddings: false,
    }
}

pub fn corpus() -> Corpus {
    let text = &tp_train::data::DEFAULT_CORPUS[..40_000];
    Corpus::new(text.iter().map(|&b| u32::from(b)).collect(), 16, 7).expect("corpus")
}

pub fn dims(tp: usize, pp: usize, dp: usize) -> ParallelDims {
    ParallelDims { tp, pp, dp }
}

pub fn spec(d: ParallelDims, steps: u64, micro_batches: usize) -> TrainSpec {
    TrainSpec {
        model: model(),
        dims: d,
        steps,
        global_batch: 4,
        micro_batches,
        seq: 16,
        seed: 5,
        optim: AdamWConfig {
            lr: 1e-2,
            min_lr: 1e-3,
            warmup_steps: 3,
            ..AdamWConfig::default()
        },
        bucket_elems: 5000,
        save_dir: None,
        save_every: 0,
        keep: 0,
        data_name: "test corpus".into(),
    }
}

pub fn tokenizer_json() -> String {
    tp_train::tokenizer_json::byte_level_tokenizer_json()
}

/// Runs `f` with a trainer on every rank of `spec.dims`; returns each rank's value.
pub fn with_trainers<R: Send>(
    spec: &TrainSpec,
    resume: Option<&Checkpoint>,
    opts: TrainOptions,
    f: impl Fn(&mut Trainer<'_>) -> tp_train::Result<R> + Sync,
) -> Vec<Result<R, String>> {
    let corpus = corpus();
    let tok = tokenizer_json();
    let outs = run(spec.dims.world_size(), LocalOptions::default(), |world| {
        let groups = ProcessGroups::new(world, spec.dims)?;
        let mut t = Trainer::new(spec, groups, &corpus, &tok, resume, opts.clone())?;
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

/// Trains `spec` (fresh or resumed) to `spec.steps`; rank 0's step reports.
pub fn train(spec: &TrainSpec, resume: Option<&Checkpoint>) -> Vec<StepReport> {
    let mut outs = with_trainers(spec, resume, TrainOptions::default(), |t| {
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
    let d = std::env::temp_dir().join(format!("tp-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}
