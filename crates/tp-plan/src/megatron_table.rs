//! Comparison with Narayanan et al. 2021 (arXiv:2104.04473), Table 1: the
//! planner's predicted TFLOP/s per GPU for the paper's own (t, p, d, B) on
//! A100-80GB, 8 GPUs per node, s = 2048, full recompute, against the reported
//! figure; plus the planner's own top choice for the same cluster.

use crate::flops::narayanan_flops_per_iteration;
use crate::hardware::{accelerator_preset, ClusterSpec};
use crate::model_presets::model_preset;
use crate::search::plan_training;
use crate::sharding::ParallelConfig;
use crate::training_model::estimate_training;
use crate::workload::{Optimizer, Precision, Recompute, TrainingWorkload};
use crate::PlanError;
use serde::Serialize;

/// One row of Table 1 as published.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MegatronRow {
    pub preset: &'static str,
    pub params_billion: f64,
    pub tp: u64,
    pub pp: u64,
    pub gpus: u64,
    pub global_batch: u64,
    pub reported_tflops_per_gpu: f64,
}

const fn row(
    preset: &'static str,
    params_billion: f64,
    tp: u64,
    pp: u64,
    gpus: u64,
    global_batch: u64,
    reported: f64,
) -> MegatronRow {
    MegatronRow {
        preset,
        params_billion,
        tp,
        pp,
        gpus,
        global_batch,
        reported_tflops_per_gpu: reported,
    }
}

/// Table 1 of Narayanan et al. 2021 (weak scaling, Selene, A100-80GB).
pub const TABLE1: [MegatronRow; 10] = [
    row("megatron-1.7b", 1.7, 1, 1, 32, 512, 137.0),
    row("megatron-3.6b", 3.6, 2, 1, 64, 512, 138.0),
    row("megatron-7.5b", 7.5, 4, 1, 128, 512, 142.0),
    row("megatron-18b", 18.4, 8, 1, 256, 1024, 135.0),
    row("megatron-39b", 39.1, 8, 2, 512, 1536, 138.0),
    row("megatron-76b", 76.1, 8, 4, 1024, 1792, 140.0),
    row("megatron-145b", 145.6, 8, 8, 1536, 2304, 148.0),
    row("megatron-310b", 310.1, 8, 16, 1920, 2160, 155.0),
    row("megatron-530b", 529.6, 8, 35, 2520, 2520, 163.0),
    row("megatron-1t", 1008.0, 8, 64, 3072, 3072, 163.0),
];

/// Relative tolerance of the comparison: |predicted/reported - 1| ≤ 15%.
pub const TOLERANCE: f64 = 0.15;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MegatronComparison {
    pub row: MegatronRow,
    /// Best micro-batch (≤ 8) for the paper's (t, p, d) under our model.
    pub micro_batch: u64,
    /// Predicted step time of the paper's layout, seconds.
    pub predicted_step_s: f64,
    pub predicted_tflops_per_gpu: f64,
    pub relative_error: f64,
    /// The planner's own best layout on the same cluster and batch.
    pub planner_top: ParallelConfig,
    pub planner_top_mfu: f64,
    pub planner_top_step_s: f64,
}

impl MegatronComparison {
    pub fn within_tolerance(&self) -> bool {
        self.relative_error.abs() <= TOLERANCE
    }
}

fn paper_workload(batch: u64) -> TrainingWorkload {
    TrainingWorkload {
        global_batch: batch,
        seq_len: 2048,
        precision: Precision::Fp16,
        optimizer: Optimizer::Adam,
        distributed_optimizer: false,
        flash_attention: false,
        max_micro_batch: 8,
    }
}

/// Runs the comparison for all ten rows.
pub fn compare_with_table1() -> Result<Vec<MegatronComparison>, PlanError> {
    let a100 = accelerator_preset("a100-80")?;
    TABLE1
        .iter()
        .map(|row| {
            let model = model_preset(row.preset)?;
            let cluster = ClusterSpec::new(a100.clone(), row.gpus, 8)?;
            let workload = paper_workload(row.global_batch);
            let dp = row.gpus / (row.tp * row.pp);
            let paper_flops = narayanan_flops_per_iteration(
                row.global_batch,
                2048,
                model.num_layers,
                model.hidden_size,
                model.vocab_size,
            );
            let tflops = |step_s: f64| paper_flops / (step_s * row.gpus as f64) / 1e12;
            let usable = cluster.usable_memory_bytes();
            let per_replica = row.global_batch / dp;
            let best = (1..=8u64)
                .filter(|b| per_replica % b == 0)
                .map(|micro_batch| {
                    let config = ParallelConfig {
                        tp: row.tp,
                        pp: row.pp,
                        dp,
                        ep: 1,
                        micro_batch,
                        sequence_parallel: false,
                        recompute: Recompute::Full,
                        virtual_stages: 1,
                    };
                    estimate_training(&model, &cluster, &workload, &config)
                })
                .filter(|e| e.memory.total() <= usable)
                .min_by(|a, b| a.step_s.total_cmp(&b.step_s))
                .ok_or_else(|| {
                    PlanError::InvalidWorkload(format!(
                        "paper layout for {} does not fit",
                        row.preset
                    ))
                })?;
            let plan = plan_training(&model, &cluster, &workload)?;
            let top = plan.ranked.first().ok_or_else(|| {
                PlanError::InvalidWorkload(format!("no valid layout for {}", row.preset))
            })?;
            let predicted = tflops(best.step_s);
            Ok(MegatronComparison {
                row: *row,
                micro_batch: best.config.micro_batch,
                predicted_step_s: best.step_s,
                predicted_tflops_per_gpu: predicted,
                relative_error: predicted / row.reported_tflops_per_gpu - 1.0,
                planner_top: top.config,
                planner_top_mfu: top.mfu,
                planner_top_step_s: top.step_s,
            })
        })
        .collect()
}

/// The comparison as a Markdown table (pasted into docs/planner.md; a test
/// checks the document still matches).
pub fn render_markdown(rows: &[MegatronComparison]) -> String {
    let mut out = String::from(
        "| model | t | p | GPUs | batch | reported TFLOP/s/GPU | predicted (b) | error | planner top (t, p, v, b, recompute, SP) | its speed-up | its MFU |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for c in rows {
        out.push_str(&format!(
            "| {} ({:.1}B) | {} | {} | {} | {} | {:.0} | {:.1} (b={}) | {:+.1}%{} | ({}, {}, {}, {}, {:?}, {}) | {:.2}x | {:.1}% |\n",
            c.row.preset,
            c.row.params_billion,
            c.row.tp,
            c.row.pp,
            c.row.gpus,
            c.row.global_batch,
            c.row.reported_tflops_per_gpu,
            c.predicted_tflops_per_gpu,
            c.micro_batch,
            c.relative_error * 100.0,
            if c.within_tolerance() { "" } else { " (outside 15%)" },
            c.planner_top.tp,
            c.planner_top.pp,
            c.planner_top.virtual_stages,
            c.planner_top.micro_batch,
            c.planner_top.recompute,
            if c.planner_top.sequence_parallel { "SP" } else { "no SP" },
            c.predicted_step_s / c.planner_top_step_s,
            c.planner_top_mfu * 100.0,
        ));
    }
    let within = rows.iter().filter(|c| c.within_tolerance()).count();
    out.push_str(&format!(
        "\n{within} of {} rows within ±15% of the reported TFLOP/s per GPU.\n",
        rows.len()
    ));
    out
}
