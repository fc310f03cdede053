//! Renders plans as aligned text tables or as JSON (top layouts, rejection
//! counts by reason and a sample of rejections).

use crate::hardware::{AcceleratorKind, ClusterSpec};
use crate::model::ModelSpec;
use crate::search::{Rejection, ServingPlan, TrainingPlan};
use crate::serving_model::{DecodeBound, ServingEstimate};
use crate::training_model::TrainingEstimate;
use crate::workload::Recompute;
use crate::PlanError;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// How much of a plan to show.
#[derive(Debug, Clone, Copy)]
pub struct ReportLimits {
    pub top: usize,
    pub rejected: usize,
}

#[derive(Serialize)]
struct JsonPlan<'a, W: Serialize, E: Serialize> {
    model: &'a ModelSpec,
    total_params: u64,
    cluster: &'a ClusterSpec,
    workload: &'a W,
    valid_layouts: usize,
    top: &'a [E],
    rejected_total: u64,
    rejected_by_kind: &'a BTreeMap<String, u64>,
    rejected_sample: &'a [Rejection],
}

fn head<T>(items: &[T], n: usize) -> &[T] {
    &items[..items.len().min(n)]
}

pub fn training_json(plan: &TrainingPlan, limits: ReportLimits) -> Result<String, PlanError> {
    let view = JsonPlan {
        model: &plan.model,
        total_params: plan.model.total_params(),
        cluster: &plan.cluster,
        workload: &plan.workload,
        valid_layouts: plan.ranked.len(),
        top: head(&plan.ranked, limits.top),
        rejected_total: plan.rejected.total,
        rejected_by_kind: &plan.rejected.by_kind,
        rejected_sample: head(&plan.rejected.list, limits.rejected),
    };
    Ok(serde_json::to_string_pretty(&view)?)
}

pub fn serving_json(plan: &ServingPlan, limits: ReportLimits) -> Result<String, PlanError> {
    let view = JsonPlan {
        model: &plan.model,
        total_params: plan.model.total_params(),
        cluster: &plan.cluster,
        workload: &plan.workload,
        valid_layouts: plan.ranked.len(),
        top: head(&plan.ranked, limits.top),
        rejected_total: plan.rejected.total,
        rejected_by_kind: &plan.rejected.by_kind,
        rejected_sample: head(&plan.rejected.list, limits.rejected),
    };
    Ok(serde_json::to_string_pretty(&view)?)
}

fn header(out: &mut String, model: &ModelSpec, cluster: &ClusterSpec) {
    let _ = writeln!(
        out,
        "model   {}: {:.2}B params, {} layers, hidden {}, ffn {}, {} heads ({} kv), vocab {}{}",
        model.name,
        model.total_params() as f64 / 1e9,
        model.num_layers,
        model.hidden_size,
        model.ffn_hidden_size,
        model.num_query_heads,
        model.num_kv_heads,
        model.vocab_size,
        if model.is_moe() {
            format!(
                ", {} experts top-{}",
                model.num_experts, model.experts_per_token
            )
        } else {
            String::new()
        }
    );
    let a = &cluster.accelerator;
    let memory = match (a.kind, a.per_core_memory_bandwidth()) {
        (AcceleratorKind::CpuMachine { cores }, Some(per_core)) => format!(
            "{cores} cores, memory {:.0} GB/s per core, {:.0} GB/s machine",
            per_core / 1e9,
            a.memory_bandwidth / 1e9
        ),
        _ => format!("{:.0} GB/s memory", a.memory_bandwidth / 1e9),
    };
    let _ = writeln!(
        out,
        "cluster {} x {} ({} per node): {:.1} TFLOP/s, {:.1} GiB, {memory}; links {:.0} GB/s + {:.0} us intra, {:.3} GB/s + {:.0} us inter",
        cluster.num_devices,
        a.name,
        cluster.devices_per_node,
        a.peak_flops / 1e12,
        a.memory_bytes / GIB,
        cluster.intra_node_bandwidth / 1e9,
        cluster.intra_node_latency_s * 1e6,
        cluster.inter_node_bandwidth / 1e9,
        cluster.inter_node_latency_s * 1e6,
    );
}

fn recompute_name(r: Recompute) -> &'static str {
    match r {
        Recompute::None => "none",
        Recompute::Selective => "selective",
        Recompute::Full => "full",
    }
}

fn rejections(
    out: &mut String,
    total: u64,
    by_kind: &BTreeMap<String, u64>,
    list: &[Rejection],
    n: usize,
) {
    let kinds: Vec<String> = by_kind.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    let _ = writeln!(out, "\nrejected {total} layouts ({})", kinds.join(", "));
    for r in head(list, n) {
        let mut shape = format!("tp={}", r.tp);
        if let Some(pp) = r.pp {
            let _ = write!(shape, " pp={pp}");
        }
        if let Some(dp) = r.dp {
            let _ = write!(shape, " dp={dp}");
        }
        if let Some(ep) = r.ep.filter(|ep| *ep > 1) {
            let _ = write!(shape, " ep={ep}");
        }
        if let Some(mb) = r.micro_batch {
            let _ = write!(shape, " mb={mb}");
        }
        if r.sequence_parallel == Some(true) {
            shape.push_str(" sp");
        }
        if let Some(rc) = r.recompute {
            let _ = write!(shape, " recompute={}", recompute_name(rc));
        }
        if let Some(v) = r.virtual_stages.filter(|v| *v > 1) {
            let _ = write!(shape, " v={v}");
        }
        let _ = writeln!(out, "  {shape:<44} {}", r.reason);
    }
    if list.len() > n {
        let _ = writeln!(
            out,
            "  ... {} more (raise --show-rejected or use --json)",
            list.len() - n
        );
    }
}

fn training_row(out: &mut String, rank: usize, e: &TrainingEstimate) {
    let c = &e.config;
    let m = &e.memory;
    let t = &e.time;
    let _ = writeln!(
        out,
        "{rank:>3} {:>3} {:>3} {:>2} {:>5} {:>3} {:>3} {:>3} {:>9} | {:>9.3} {:>5.1}% {:>6.1} | {:>6.1} {:>6.1} {:>6.1} {:>6.1} {:>6.1} | {:>7.3} {:>7.3} {:>7.3} {:>7.3} {:>7.3} | {:>5.2} {:>4.2}",
        c.tp,
        c.pp,
        c.virtual_stages,
        c.dp,
        c.ep,
        c.micro_batch,
        if c.sequence_parallel { "sp" } else { "-" },
        recompute_name(c.recompute),
        e.step_s,
        e.mfu * 100.0,
        e.hardware_tflops_per_device,
        m.weights / GIB,
        m.gradients / GIB,
        m.optimizer_state / GIB,
        m.activations / GIB,
        m.total() / GIB,
        t.compute_s,
        t.tensor_parallel_comm_s + t.expert_parallel_comm_s,
        t.pipeline_bubble_s + t.pipeline_p2p_s,
        t.data_parallel_comm_s,
        t.optimizer_step_s,
        e.head_imbalance,
        e.kv_replication,
    );
}

pub fn training_text(plan: &TrainingPlan, limits: ReportLimits) -> String {
    let mut out = String::new();
    header(&mut out, &plan.model, &plan.cluster);
    let w = &plan.workload;
    let _ = writeln!(
        out,
        "train   global batch {}, seq {}, {:?}, {:?}{}{}",
        w.global_batch,
        w.seq_len,
        w.precision,
        w.optimizer,
        if w.distributed_optimizer {
            ", distributed optimizer"
        } else {
            ""
        },
        if w.flash_attention {
            ", flash attention"
        } else {
            ""
        },
    );
    let _ = writeln!(
        out,
        "\n{} valid layouts, fastest first (memory in GiB per device; time in s per step; comm = tp + ep; pipe = bubble + p2p{})",
        plan.ranked.len(),
        if plan.model.is_moe() {
            "; ep = data-parallel replicas sharing the experts, `tp train --ep tp x ep`"
        } else {
            ""
        }
    );
    let _ = writeln!(
        out,
        "  # {:>3} {:>3} {:>2} {:>5} {:>3} {:>3} {:>3} {:>9} | {:>9} {:>6} {:>6} | {:>6} {:>6} {:>6} {:>6} {:>6} | {:>7} {:>7} {:>7} {:>7} {:>7} | {:>5} {:>4}",
        "tp", "pp", "v", "dp", "ep", "mb", "sp", "recompute", "step_s", "MFU", "TF/s", "weight", "grad", "optim", "activ", "total",
        "compute", "comm", "pipe", "dp_comm", "optim", "imbal", "kvx"
    );
    for (i, e) in head(&plan.ranked, limits.top).iter().enumerate() {
        training_row(&mut out, i + 1, e);
    }
    if plan.ranked.is_empty() {
        out.push_str("  no layout fits; see the rejections below\n");
    }
    rejections(
        &mut out,
        plan.rejected.total,
        &plan.rejected.by_kind,
        &plan.rejected.list,
        limits.rejected,
    );
    out
}

/// One serving layout's row; `moe` adds the expert groups after tp.
fn serving_row(out: &mut String, rank: usize, e: &ServingEstimate, moe: bool) {
    let c = &e.config;
    let ep = if moe {
        format!(" {:>3}", c.ep)
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "{rank:>3} {:>3}{ep} {:>3} {:>4} {:>6} | {:>9.2} {:>10.1} {:>10.5} {:>9} {:>8.3} | {:>7.2} {:>7.2} {:>7.2} {:>8.2} | {:>5.2} {:>4.2}",
        c.tp,
        c.pp,
        c.dp,
        e.sequences_per_replica,
        e.time_per_output_token_s * 1e3,
        e.tokens_per_s,
        e.device_seconds_per_token,
        match e.bound {
            DecodeBound::MemoryBandwidth => "memory",
            DecodeBound::Compute => "compute",
        },
        e.time_to_first_token_s,
        e.memory.weights / GIB,
        e.memory.kv_cache / GIB,
        e.memory.activations / GIB,
        e.memory_budget_bytes / GIB,
        e.head_imbalance,
        e.kv_replication,
    );
}

pub fn serving_text(plan: &ServingPlan, limits: ReportLimits) -> String {
    let mut out = String::new();
    header(&mut out, &plan.model, &plan.cluster);
    let w = &plan.workload;
    let _ = writeln!(
        out,
        "serve   context {}, concurrency {}, target {}, weights {}, kv {:?}",
        w.context_len,
        w.concurrency,
        w.target_time_per_token_s
            .map(|t| format!("{:.2} ms/token", t * 1e3))
            .unwrap_or_else(|| "none".to_string()),
        if plan.model.stored.is_some() && !plan.model.is_moe() {
            format!(
                "as stored in the file (quantized blocks kept, floats as {:?}; each rank's bytes and the stages' layers as the runtime splits them)",
                w.weight_precision
            )
        } else {
            format!("{:?}", w.weight_precision)
        },
        w.kv_precision,
    );
    let _ = writeln!(
        out,
        "\n{} layouts meet the target, cheapest first (dev-s/tok = device-seconds per output token; memory GiB per rank; budget = per device{})",
        plan.ranked.len(),
        if plan.cluster.is_cpu() { ", all threads of the machine" } else { "" }
    );
    let moe = plan.model.is_moe();
    let _ = writeln!(
        out,
        "  # {:>3}{} {:>3} {:>4} {:>6} | {:>9} {:>10} {:>10} {:>9} {:>8} | {:>7} {:>7} {:>7} {:>8} | {:>5} {:>4}",
        "tp", if moe { "  ep" } else { "" }, "pp", "dp", "seqs", "TPOT_ms", "tokens/s", "dev-s/tok", "bound", "TTFT_s", "weights", "kv", "activ", "budget", "imbal", "kvx"
    );
    for (i, e) in head(&plan.ranked, limits.top).iter().enumerate() {
        serving_row(&mut out, i + 1, e, moe);
    }
    if let Some(fast) = fastest(&plan.ranked).filter(|_| plan.cluster.num_devices > 1) {
        let c = fast.config;
        let machines = if plan.cluster.is_cpu() {
            format!(
                " ({} machine(s) per replica)",
                c.pp * plan.cluster.devices_per_tensor_group(c.tp)
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "\nfastest per token: tp={}{} pp={} dp={}{machines}: TPOT {:.2} ms = {:.2} ms reading/computing + {:.2} ms tensor-parallel all-reduces + {:.2} ms stage sends + {:.2} ms step command",
            c.tp,
            if plan.model.is_moe() {
                format!(" ep={}", c.ep)
            } else {
                String::new()
            },
            c.pp,
            c.dp,
            fast.time_per_output_token_s * 1e3,
            (fast.time_per_output_token_s
                - fast.tensor_parallel_comm_s
                - fast.pipeline_p2p_s
                - fast.command_s)
                * 1e3,
            fast.tensor_parallel_comm_s * 1e3,
            fast.pipeline_p2p_s * 1e3,
            fast.command_s * 1e3,
        );
    }
    match plan.ranked.first() {
        None => out.push_str("  no layout fits and meets the target; see the rejections below\n"),
        Some(best) if plan.cluster.is_cpu() && plan.cluster.num_devices == 1 => {
            // The busiest thread's reads bound the step; each thread reads at its rank bandwidth.
            let tp = best.config.tp;
            let rank_bandwidth = plan
                .cluster
                .accelerator
                .rank_memory_bandwidth(plan.cluster.ranks_per_device(tp));
            let busiest_rank_bytes = best.memory_read_s * rank_bandwidth;
            let _ = writeln!(
                out,
                "\nrecommendation for this machine: tp={} (threads), memory budget {:.2} GiB of {:.1} GiB; decode is {}-bound: {:.1} tokens/s (bandwidth bound {:.1} tokens/s: the busiest of {} thread(s) reads {:.1} MB per step of {} sequence(s) at {:.0} GB/s)",
                best.config.tp,
                best.memory_budget_bytes / GIB,
                plan.cluster.accelerator.memory_bytes / GIB,
                match best.bound {
                    DecodeBound::MemoryBandwidth => "memory",
                    DecodeBound::Compute => "compute",
                },
                best.tokens_per_s,
                best.sequences_per_replica as f64 * rank_bandwidth / busiest_rank_bytes,
                tp,
                busiest_rank_bytes / 1e6,
                best.sequences_per_replica,
                rank_bandwidth / 1e9,
            );
        }
        Some(_) => {}
    }
    rejections(
        &mut out,
        plan.rejected.total,
        &plan.rejected.by_kind,
        &plan.rejected.list,
        limits.rejected,
    );
    out
}

/// The layout with the least time per output token (the cheaper one among equals).
pub fn fastest(ranked: &[ServingEstimate]) -> Option<&ServingEstimate> {
    ranked.iter().min_by(|a, b| {
        a.time_per_output_token_s
            .total_cmp(&b.time_per_output_token_s)
    })
}
