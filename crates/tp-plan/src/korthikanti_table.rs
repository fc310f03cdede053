//! Comparison with Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
//! Transformer Models", arXiv:2205.05198, MLSys 2023), Tables 3 and 5: the planner's
//! predicted iteration time for the paper's own GPT models and layouts (A100-80GB, 8 GPUs
//! per node, s = 2048, V = 51,200, micro-batch 1, t = 8, no data parallelism), once with
//! sequence parallelism and selective recomputation (the paper's "present work") and once
//! with full recomputation and no sequence parallelism (its baseline), against the reported
//! iteration times; and the model FLOPs utilization both imply.

use crate::flops::training_flops_per_iteration;
use crate::hardware::{accelerator_preset, ClusterSpec};
use crate::model::ModelSpec;
use crate::model_presets::MEGATRON_2021_VOCAB;
use crate::sharding::ParallelConfig;
use crate::training_model::estimate_training;
use crate::workload::{Optimizer, Precision, Recompute, TrainingWorkload};
use crate::PlanError;
use serde::Serialize;

/// One model of the paper: its shape (Table 3), layout and reported iteration times
/// (Table 5).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct KorthikantiRow {
    pub name: &'static str,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub tp: u64,
    pub pp: u64,
    pub gpus: u64,
    pub global_batch: u64,
    /// Seconds per iteration with sequence parallelism and selective recomputation.
    pub reported_selective_s: f64,
    /// Seconds per iteration with full recomputation (no sequence parallelism).
    pub reported_full_s: f64,
    /// The reported model FLOPs utilization of the selective run.
    pub reported_mfu: f64,
}

const fn row(
    name: &'static str,
    (layers, hidden, heads): (u64, u64, u64),
    (tp, pp, gpus, global_batch): (u64, u64, u64, u64),
    reported_selective_s: f64,
    reported_full_s: f64,
    reported_mfu: f64,
) -> KorthikantiRow {
    KorthikantiRow {
        name,
        layers,
        hidden,
        heads,
        tp,
        pp,
        gpus,
        global_batch,
        reported_selective_s,
        reported_full_s,
        reported_mfu,
    }
}

/// Tables 3 and 5 of Korthikanti et al. 2022 (Selene, A100-80GB).
pub const TABLE5: [KorthikantiRow; 4] = [
    row("gpt-22b", (48, 6144, 64), (8, 1, 8, 4), 1.10, 1.42, 0.415),
    row(
        "gpt-175b",
        (96, 12288, 96),
        (8, 8, 64, 64),
        13.75,
        18.13,
        0.514,
    ),
    row(
        "gpt-530b",
        (105, 20480, 128),
        (8, 35, 280, 280),
        37.83,
        49.05,
        0.560,
    ),
    row(
        "gpt-1t",
        (128, 25600, 160),
        (8, 64, 512, 512),
        71.49,
        94.42,
        0.563,
    ),
];

/// Relative tolerance on throughput: |reported step / predicted step - 1| ≤ 15%.
pub const TOLERANCE: f64 = 0.15;

/// One run (a row under one recomputation policy) predicted and reported.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunComparison {
    pub predicted_step_s: f64,
    pub reported_step_s: f64,
    /// Predicted throughput over reported, minus one.
    pub relative_error: f64,
    /// Whether the predicted memory of the busiest rank fits 80 GB (less the planner's
    /// reserve).
    pub fits: bool,
}

impl RunComparison {
    fn new(predicted_step_s: f64, reported_step_s: f64, fits: bool) -> Self {
        RunComparison {
            predicted_step_s,
            reported_step_s,
            relative_error: reported_step_s / predicted_step_s - 1.0,
            fits,
        }
    }

    pub fn within_tolerance(&self) -> bool {
        self.relative_error.abs() <= TOLERANCE
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KorthikantiComparison {
    pub row: KorthikantiRow,
    /// Sequence parallelism with selective recomputation.
    pub selective: RunComparison,
    /// Full recomputation, no sequence parallelism.
    pub full: RunComparison,
    /// Model FLOPs utilization the reported selective time implies by the paper's FLOP
    /// count (72·B·s·l·h²·(1 + s/6h + V/12lh)) and 312 TFLOP/s per GPU.
    pub implied_mfu: f64,
    /// The same from the predicted selective time.
    pub predicted_mfu: f64,
}

impl KorthikantiComparison {
    pub fn runs(&self) -> [&RunComparison; 2] {
        [&self.selective, &self.full]
    }
}

/// Runs the comparison for the four models.
pub fn compare_with_table5() -> Result<Vec<KorthikantiComparison>, PlanError> {
    let a100 = accelerator_preset("a100-80")?;
    TABLE5
        .iter()
        .map(|row| {
            let model = ModelSpec::gpt(
                row.name,
                row.layers,
                row.hidden,
                row.heads,
                MEGATRON_2021_VOCAB,
            );
            let cluster = ClusterSpec::new(a100.clone(), row.gpus, 8)?;
            let workload = TrainingWorkload {
                global_batch: row.global_batch,
                seq_len: 2048,
                precision: Precision::Fp16,
                optimizer: Optimizer::Adam,
                distributed_optimizer: false,
                flash_attention: false,
                max_micro_batch: 1,
            };
            let dp = row.gpus / (row.tp * row.pp);
            let run = |sequence_parallel: bool, recompute: Recompute, reported: f64| {
                let config = ParallelConfig {
                    tp: row.tp,
                    pp: row.pp,
                    dp,
                    ep: 1,
                    micro_batch: 1,
                    sequence_parallel,
                    recompute,
                    virtual_stages: 1,
                };
                let e = estimate_training(&model, &cluster, &workload, &config);
                let fits = e.memory.total() <= cluster.usable_memory_bytes();
                RunComparison::new(e.step_s, reported, fits)
            };
            let selective = run(true, Recompute::Selective, row.reported_selective_s);
            let full = run(false, Recompute::Full, row.reported_full_s);
            let flops = training_flops_per_iteration(&model, row.global_batch, 2048, false);
            let peak = a100.peak_flops * row.gpus as f64;
            Ok(KorthikantiComparison {
                row: *row,
                implied_mfu: flops / (row.reported_selective_s * peak),
                predicted_mfu: flops / (selective.predicted_step_s * peak),
                selective,
                full,
            })
        })
        .collect()
}

/// The comparison as a Markdown table (pasted into docs/planner.md; a test checks the
/// document still matches).
pub fn render_markdown(rows: &[KorthikantiComparison]) -> String {
    let mut out = String::from(
        "| model | l, h, a | t | p | GPUs | batch | SP + selective: reported s | predicted s | error | full recompute: reported s | predicted s | error | reported MFU (implied) | predicted MFU |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let err = |r: &RunComparison| {
        format!(
            "{:+.1}%{}{}",
            r.relative_error * 100.0,
            if r.within_tolerance() {
                ""
            } else {
                " (outside 15%)"
            },
            if r.fits { "" } else { " (does not fit)" }
        )
    };
    for c in rows {
        let r = &c.row;
        out.push_str(&format!(
            "| {} | {}, {}, {} | {} | {} | {} | {} | {:.2} | {:.2} | {} | {:.2} | {:.2} | {} | {:.1}% ({:.1}%) | {:.1}% |\n",
            r.name,
            r.layers,
            r.hidden,
            r.heads,
            r.tp,
            r.pp,
            r.gpus,
            r.global_batch,
            r.reported_selective_s,
            c.selective.predicted_step_s,
            err(&c.selective),
            r.reported_full_s,
            c.full.predicted_step_s,
            err(&c.full),
            r.reported_mfu * 100.0,
            c.implied_mfu * 100.0,
            c.predicted_mfu * 100.0,
        ));
    }
    let runs = rows.iter().flat_map(|c| c.runs()).collect::<Vec<_>>();
    let within = runs.iter().filter(|r| r.within_tolerance()).count();
    out.push_str(&format!(
        "\n{within} of {} runs within ±15% of the reported throughput.\n",
        runs.len()
    ));
    out
}
