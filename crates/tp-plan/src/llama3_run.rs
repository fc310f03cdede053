//! Comparison with a recent large public run: Llama 3.1 405B pre-training (Llama Team, "The
//! Llama 3 Herd of Models", arXiv:2407.21783, 2024, Table 4; the same figures on Meta's SC'24
//! slide): H100-80GB, 8 GPUs per node, t = 8, p = 16, 16M tokens a batch of sequences of
//! 8,192 (2,048 sequences), BF16, on 8,192 and 16,384 GPUs, against the reported TFLOP/s per
//! GPU. What the paper does not give (micro-batch, interleaving depth `v`, recomputation) is
//! the planner's fastest choice that fits: micro-batch 1, sequence parallelism, `v` and
//! recomputation searched.

use crate::flops::training_flops_per_iteration;
use crate::hardware::{accelerator_preset, ClusterSpec};
use crate::model_presets::model_preset;
use crate::sharding::ParallelConfig;
use crate::training_model::estimate_training;
use crate::workload::{Optimizer, Precision, Recompute, TrainingWorkload};
use crate::PlanError;
use serde::Serialize;

/// One run of Table 4 (the 8K-context ones; context parallelism 1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Llama3Run {
    pub gpus: u64,
    pub tp: u64,
    pub pp: u64,
    pub global_batch: u64,
    pub seq: u64,
    pub reported_tflops_per_gpu: f64,
}

/// The two 8K-context runs of Table 4.
pub const TABLE4: [Llama3Run; 2] = [
    Llama3Run {
        gpus: 8192,
        tp: 8,
        pp: 16,
        global_batch: 2048,
        seq: 8192,
        reported_tflops_per_gpu: 430.0,
    },
    Llama3Run {
        gpus: 16384,
        tp: 8,
        pp: 16,
        global_batch: 2048,
        seq: 8192,
        reported_tflops_per_gpu: 400.0,
    },
];

/// Relative tolerance: |predicted / reported - 1| ≤ 15%.
pub const TOLERANCE: f64 = 0.15;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Llama3Comparison {
    pub run: Llama3Run,
    /// The planner's choice of what the paper does not give.
    pub config: ParallelConfig,
    pub predicted_step_s: f64,
    /// Model FLOPs (forward and backward, no recomputation) per step and GPU.
    pub predicted_tflops_per_gpu: f64,
    pub relative_error: f64,
}

impl Llama3Comparison {
    pub fn within_tolerance(&self) -> bool {
        self.relative_error.abs() <= TOLERANCE
    }
}

/// Runs the comparison for both runs.
pub fn compare_with_table4() -> Result<Vec<Llama3Comparison>, PlanError> {
    let h100 = accelerator_preset("h100")?;
    let model = model_preset("llama-3-405b")?;
    TABLE4
        .iter()
        .map(|run| {
            let cluster = ClusterSpec::new(h100.clone(), run.gpus, 8)?;
            let workload = TrainingWorkload {
                global_batch: run.global_batch,
                seq_len: run.seq,
                precision: Precision::Bf16,
                optimizer: Optimizer::Adam,
                distributed_optimizer: true,
                flash_attention: true,
                max_micro_batch: 1,
            };
            let dp = run.gpus / (run.tp * run.pp);
            let flops = training_flops_per_iteration(&model, run.global_batch, run.seq, false);
            let mut options = Vec::new();
            for virtual_stages in [1, 2, 4, 8] {
                for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
                    options.push(ParallelConfig {
                        tp: run.tp,
                        pp: run.pp,
                        dp,
                        ep: 1,
                        micro_batch: 1,
                        sequence_parallel: true,
                        recompute,
                        virtual_stages,
                    });
                }
            }
            let best = options
                .iter()
                .map(|c| estimate_training(&model, &cluster, &workload, c))
                .filter(|e| e.memory.total() <= cluster.usable_memory_bytes())
                .min_by(|a, b| a.step_s.total_cmp(&b.step_s))
                .ok_or_else(|| {
                    PlanError::InvalidWorkload(format!(
                        "Llama 3's layout on {} GPUs does not fit",
                        run.gpus
                    ))
                })?;
            let predicted = flops / (best.step_s * run.gpus as f64) / 1e12;
            Ok(Llama3Comparison {
                run: *run,
                config: best.config,
                predicted_step_s: best.step_s,
                predicted_tflops_per_gpu: predicted,
                relative_error: predicted / run.reported_tflops_per_gpu - 1.0,
            })
        })
        .collect()
}

/// The comparison as a Markdown table (in docs/planner.md; a test checks it matches).
pub fn render_markdown(rows: &[Llama3Comparison]) -> String {
    let mut out = String::from(
        "| GPUs | t | p | d | batch x seq | reported TFLOP/s/GPU | predicted | error | planner's v, recompute | predicted step s |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for c in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} x {} | {:.0} | {:.1} | {:+.1}%{} | {}, {:?} | {:.2} |\n",
            c.run.gpus,
            c.run.tp,
            c.run.pp,
            c.config.dp,
            c.run.global_batch,
            c.run.seq,
            c.run.reported_tflops_per_gpu,
            c.predicted_tflops_per_gpu,
            c.relative_error * 100.0,
            if c.within_tolerance() {
                ""
            } else {
                " (outside 15%)"
            },
            c.config.virtual_stages,
            c.config.recompute,
            c.predicted_step_s,
        ));
    }
    out
}
