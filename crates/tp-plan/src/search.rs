//! Enumerates every training (tp, pp, virtual stages, dp, ep, micro-batch, sequence
//! parallel, recompute) and serving (tp, ep, pp, dp) layout, rejects the invalid ones with a
//! reason, and ranks the rest: training by predicted step time, serving by device-seconds
//! per token under the latency target.

use crate::hardware::{AcceleratorKind, ClusterSpec};
use crate::model::ModelSpec;
use crate::serving_model::{estimate_serving, ServingConfig, ServingEstimate};
use crate::sharding::ParallelConfig;
use crate::training_model::{estimate_training, TrainingEstimate};
use crate::workload::{Recompute, ServingWorkload, TrainingWorkload};
use crate::PlanError;
use serde::Serialize;
use std::collections::BTreeMap;

/// Why a layout cannot be used.
#[derive(Debug, Clone, PartialEq, Serialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RejectReason {
    #[error("tp={tp} crosses the node boundary ({per_node} devices per node)")]
    TpCrossesNode { tp: u64, per_node: u64 },
    #[error("tp={tp} exceeds the {cores} cores of the machine(s)")]
    TpExceedsCores { tp: u64, cores: u64 },
    #[error("tp={tp} spans machines of {cores} cores: give it whole machines (a multiple of {cores}, at most {machines} machines)")]
    TpSpansPartMachines { tp: u64, cores: u64, machines: u64 },
    #[error("{devices} devices are not a multiple of {per_replica} per model replica")]
    DevicesNotDivisible { devices: u64, per_replica: u64 },
    #[error("pp={pp} exceeds the {layers} layers")]
    PpExceedsLayers { pp: u64, layers: u64 },
    #[error("{v} virtual stages need the {layers} layers in pp·v = {chunks} equal chunks")]
    VirtualStagesUneven { v: u64, layers: u64, chunks: u64 },
    #[error("an interleaved schedule needs the {micro_batches} micro-batches to be a multiple of pp={pp}")]
    VirtualStagesMicroBatches { micro_batches: u64, pp: u64 },
    #[error("global batch {batch} is not divisible by dp={dp}")]
    BatchNotDivisible { batch: u64, dp: u64 },
    #[error("out of memory: needs {need_gib:.1} GiB of {usable_gib:.1} GiB usable")]
    OutOfMemory { need_gib: f64, usable_gib: f64 },
    #[error("time per output token {tpot_ms:.2} ms exceeds the {target_ms:.2} ms target")]
    LatencyTargetMissed { tpot_ms: f64, target_ms: f64 },
}

impl RejectReason {
    pub fn kind(&self) -> &'static str {
        match self {
            RejectReason::TpCrossesNode { .. } => "tp_crosses_node",
            RejectReason::TpExceedsCores { .. } => "tp_exceeds_cores",
            RejectReason::TpSpansPartMachines { .. } => "tp_spans_part_machines",
            RejectReason::DevicesNotDivisible { .. } => "devices_not_divisible",
            RejectReason::PpExceedsLayers { .. } => "pp_exceeds_layers",
            RejectReason::BatchNotDivisible { .. } => "batch_not_divisible",
            RejectReason::VirtualStagesUneven { .. } => "virtual_stages_uneven",
            RejectReason::VirtualStagesMicroBatches { .. } => "virtual_stages_micro_batches",
            RejectReason::OutOfMemory { .. } => "out_of_memory",
            RejectReason::LatencyTargetMissed { .. } => "latency_target_missed",
        }
    }
}

/// A rejected layout; fields a rejection did not get to are `None`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rejection {
    pub tp: u64,
    pub pp: Option<u64>,
    pub dp: Option<u64>,
    pub ep: Option<u64>,
    pub micro_batch: Option<u64>,
    pub sequence_parallel: Option<bool>,
    pub recompute: Option<Recompute>,
    pub virtual_stages: Option<u64>,
    pub reason: RejectReason,
}

impl Rejection {
    fn shape(tp: u64, pp: Option<u64>, dp: Option<u64>, reason: RejectReason) -> Self {
        Rejection {
            tp,
            pp,
            dp,
            ep: None,
            micro_batch: None,
            sequence_parallel: None,
            recompute: None,
            virtual_stages: None,
            reason,
        }
    }
}

/// All rejections, with counts per reason kind.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Rejections {
    pub total: u64,
    pub by_kind: BTreeMap<String, u64>,
    pub list: Vec<Rejection>,
}

impl Rejections {
    fn push(&mut self, rejection: Rejection) {
        self.total += 1;
        *self
            .by_kind
            .entry(rejection.reason.kind().to_string())
            .or_default() += 1;
        self.list.push(rejection);
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainingPlan {
    pub model: ModelSpec,
    pub cluster: ClusterSpec,
    pub workload: TrainingWorkload,
    /// Fastest first.
    pub ranked: Vec<TrainingEstimate>,
    pub rejected: Rejections,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServingPlan {
    pub model: ModelSpec,
    pub cluster: ClusterSpec,
    pub workload: ServingWorkload,
    /// Cheapest (device-seconds per token) first, all within the latency target.
    pub ranked: Vec<ServingEstimate>,
    pub rejected: Rejections,
}

/// Divisors of `n` in increasing order (O(√n)).
fn divisors(n: u64) -> Vec<u64> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1;
    while d * d <= n {
        if n.is_multiple_of(d) {
            small.push(d);
            if d * d != n {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// Virtual pipeline stages (model chunks per stage) tried besides plain 1F1B.
const VIRTUAL_STAGES: [u64; 3] = [2, 4, 8];

/// Upper bounds on workload sizes (keep every product far from u64 overflow).
const MAX_TOKENS_PER_SEQUENCE: u64 = 1 << 24;
const MAX_BATCH: u64 = 1 << 32;
const MAX_MICRO_BATCH: u64 = 1 << 16;

/// Tensor sizes worth enumerating, with the shape rejections of the others.
/// Returns (tp, devices one tensor group occupies).
fn tensor_candidates(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    rejected: &mut Rejections,
) -> Vec<u64> {
    let mut out = Vec::new();
    let cap = match cluster.accelerator.kind {
        AcceleratorKind::Gpu => cluster.num_devices,
        // A tensor group may span whole machines (one rank per core, over their link).
        AcceleratorKind::CpuMachine { cores } => cores * cluster.num_devices + 1,
    };
    for tp in 1..=model.num_query_heads.min(cap) {
        let reason = match cluster.accelerator.kind {
            AcceleratorKind::Gpu if tp > cluster.devices_per_node => {
                Some(RejectReason::TpCrossesNode {
                    tp,
                    per_node: cluster.devices_per_node,
                })
            }
            AcceleratorKind::Gpu if !cluster.num_devices.is_multiple_of(tp) => {
                Some(RejectReason::DevicesNotDivisible {
                    devices: cluster.num_devices,
                    per_replica: tp,
                })
            }
            AcceleratorKind::CpuMachine { cores } if tp > cores * cluster.num_devices => {
                Some(RejectReason::TpExceedsCores {
                    tp,
                    cores: cores * cluster.num_devices,
                })
            }
            AcceleratorKind::CpuMachine { cores }
                if tp > cores
                    && (!tp.is_multiple_of(cores)
                        || !cluster.num_devices.is_multiple_of(tp / cores)) =>
            {
                Some(RejectReason::TpSpansPartMachines {
                    tp,
                    cores,
                    machines: cluster.num_devices,
                })
            }
            _ => None,
        };
        match reason {
            Some(r) => rejected.push(Rejection::shape(tp, None, None, r)),
            None => out.push(tp),
        }
    }
    out
}

/// Memory a device must hold for a per-rank footprint: a CPU machine hosts the tensor
/// threads its cores run.
fn device_memory_need(cluster: &ClusterSpec, tp: u64, per_rank: f64) -> f64 {
    per_rank * cluster.ranks_per_device(tp) as f64
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Ranks every training layout by predicted step time.
pub fn plan_training(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    workload: &TrainingWorkload,
) -> Result<TrainingPlan, PlanError> {
    model.validate()?;
    cluster.validate()?;
    if workload.global_batch == 0 || workload.seq_len == 0 || workload.max_micro_batch == 0 {
        return Err(PlanError::InvalidWorkload(
            "global batch, sequence length and max micro-batch must be positive".to_string(),
        ));
    }
    if workload.seq_len > MAX_TOKENS_PER_SEQUENCE
        || workload.global_batch > MAX_BATCH
        || workload.max_micro_batch > MAX_MICRO_BATCH
    {
        return Err(PlanError::InvalidWorkload(format!(
            "limits: sequence ≤ {MAX_TOKENS_PER_SEQUENCE}, global batch ≤ {MAX_BATCH}, micro-batch ≤ {MAX_MICRO_BATCH}"
        )));
    }
    let mut rejected = Rejections::default();
    let mut ranked = Vec::new();
    let usable = cluster.usable_memory_bytes();
    for tp in tensor_candidates(model, cluster, &mut rejected) {
        let groups = cluster.num_devices / cluster.devices_per_tensor_group(tp);
        for pp in divisors(groups) {
            let dp = groups / pp;
            if pp > model.num_layers {
                rejected.push(Rejection::shape(
                    tp,
                    Some(pp),
                    Some(dp),
                    RejectReason::PpExceedsLayers {
                        pp,
                        layers: model.num_layers,
                    },
                ));
                continue;
            }
            if !workload.global_batch.is_multiple_of(dp) {
                rejected.push(Rejection::shape(
                    tp,
                    Some(pp),
                    Some(dp),
                    RejectReason::BatchNotDivisible {
                        batch: workload.global_batch,
                        dp,
                    },
                ));
                continue;
            }
            let per_replica_batch = workload.global_batch / dp;
            let expert_options: Vec<u64> = if model.is_moe() {
                divisors(dp)
                    .into_iter()
                    .filter(|ep| model.num_experts.is_multiple_of(*ep))
                    .collect()
            } else {
                vec![1]
            };
            for &ep in &expert_options {
                for micro_batch in divisors(per_replica_batch)
                    .into_iter()
                    .filter(|b| *b <= workload.max_micro_batch)
                {
                    let sp_options: &[bool] = if tp > 1 { &[false, true] } else { &[false] };
                    let micro_batches = per_replica_batch / micro_batch;
                    let mut virtual_options = vec![1];
                    for v in VIRTUAL_STAGES.into_iter().filter(|_| pp > 1) {
                        let chunks = pp * v;
                        let reason = if !model.num_layers.is_multiple_of(chunks) {
                            RejectReason::VirtualStagesUneven {
                                v,
                                layers: model.num_layers,
                                chunks,
                            }
                        } else if !micro_batches.is_multiple_of(pp) {
                            RejectReason::VirtualStagesMicroBatches { micro_batches, pp }
                        } else {
                            virtual_options.push(v);
                            continue;
                        };
                        let mut r = Rejection::shape(tp, Some(pp), Some(dp), reason);
                        r.micro_batch = Some(micro_batch);
                        r.virtual_stages = Some(v);
                        rejected.push(r);
                    }
                    for &sequence_parallel in sp_options {
                        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
                            for &virtual_stages in &virtual_options {
                                let config = ParallelConfig {
                                    tp,
                                    pp,
                                    dp,
                                    ep,
                                    micro_batch,
                                    sequence_parallel,
                                    recompute,
                                    virtual_stages,
                                };
                                let estimate = estimate_training(model, cluster, workload, &config);
                                let need = device_memory_need(cluster, tp, estimate.memory.total());
                                if need > usable {
                                    rejected.push(Rejection {
                                        tp,
                                        pp: Some(pp),
                                        dp: Some(dp),
                                        ep: Some(ep),
                                        micro_batch: Some(micro_batch),
                                        sequence_parallel: Some(sequence_parallel),
                                        recompute: Some(recompute),
                                        virtual_stages: Some(virtual_stages),
                                        reason: RejectReason::OutOfMemory {
                                            need_gib: need / GIB,
                                            usable_gib: usable / GIB,
                                        },
                                    });
                                } else {
                                    ranked.push(estimate);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    ranked.sort_by(|a, b| {
        a.step_s
            .total_cmp(&b.step_s)
            .then(a.memory.total().total_cmp(&b.memory.total()))
    });
    Ok(TrainingPlan {
        model: model.clone(),
        cluster: cluster.clone(),
        workload: workload.clone(),
        ranked,
        rejected,
    })
}

/// Ranks every serving layout by device-seconds per output token among those
/// meeting the latency target (ties: lower latency first).
pub fn plan_serving(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    workload: &ServingWorkload,
) -> Result<ServingPlan, PlanError> {
    model.validate()?;
    cluster.validate()?;
    if workload.context_len == 0 || workload.concurrency == 0 {
        return Err(PlanError::InvalidWorkload(
            "context length and concurrency must be positive".to_string(),
        ));
    }
    if workload.context_len > MAX_TOKENS_PER_SEQUENCE || workload.concurrency > MAX_BATCH {
        return Err(PlanError::InvalidWorkload(format!(
            "limits: context ≤ {MAX_TOKENS_PER_SEQUENCE}, concurrency ≤ {MAX_BATCH}"
        )));
    }
    if let Some(t) = workload.target_time_per_token_s {
        if !(t.is_finite() && t > 0.0) {
            return Err(PlanError::InvalidWorkload(
                "the time-per-token target must be positive".to_string(),
            ));
        }
    }
    let mut rejected = Rejections::default();
    let mut ranked = Vec::new();
    let usable = cluster.usable_memory_bytes();
    for tp in tensor_candidates(model, cluster, &mut rejected) {
        let groups = cluster.num_devices / cluster.devices_per_tensor_group(tp);
        for pp in divisors(groups) {
            let dp = groups / pp;
            if pp > model.num_layers {
                let reason = RejectReason::PpExceedsLayers {
                    pp,
                    layers: model.num_layers,
                };
                rejected.push(Rejection::shape(tp, Some(pp), Some(dp), reason));
                continue;
            }
            // Expert groups (the runtime's --ep): any divisor of tp up to the expert count.
            let eps: Vec<u64> = if model.is_moe() {
                divisors(tp)
                    .into_iter()
                    .filter(|&ep| ep <= model.num_experts)
                    .collect()
            } else {
                vec![1]
            };
            for ep in eps {
                let config = ServingConfig { tp, pp, dp, ep };
                let estimate = estimate_serving(model, cluster, workload, &config);
                let reason = if estimate.memory_budget_bytes > usable {
                    Some(RejectReason::OutOfMemory {
                        need_gib: estimate.memory_budget_bytes / GIB,
                        usable_gib: usable / GIB,
                    })
                } else {
                    workload
                        .target_time_per_token_s
                        .filter(|target| estimate.time_per_output_token_s > *target)
                        .map(|target| RejectReason::LatencyTargetMissed {
                            tpot_ms: estimate.time_per_output_token_s * 1e3,
                            target_ms: target * 1e3,
                        })
                };
                match reason {
                    Some(r) => {
                        let mut rej = Rejection::shape(tp, Some(pp), Some(dp), r);
                        rej.ep = (ep > 1).then_some(ep);
                        rejected.push(rej)
                    }
                    None => ranked.push(estimate),
                }
            }
        }
    }
    ranked.sort_by(|a, b| {
        a.device_seconds_per_token
            .total_cmp(&b.device_seconds_per_token)
            .then(
                a.time_per_output_token_s
                    .total_cmp(&b.time_per_output_token_s),
            )
    });
    Ok(ServingPlan {
        model: model.clone(),
        cluster: cluster.clone(),
        workload: workload.clone(),
        ranked,
        rejected,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hardware::accelerator_preset;
    use crate::model_presets::model_preset;
    use crate::workload::{Optimizer, Precision};

    fn training(batch: u64) -> TrainingWorkload {
        TrainingWorkload {
            global_batch: batch,
            seq_len: 4096,
            precision: Precision::Bf16,
            optimizer: Optimizer::Adam,
            distributed_optimizer: false,
            flash_attention: true,
            max_micro_batch: 4,
        }
    }

    #[test]
    fn divisors_in_order() {
        assert_eq!(divisors(36), vec![1, 2, 3, 4, 6, 9, 12, 18, 36]);
        assert_eq!(divisors(1), vec![1]);
        assert_eq!(divisors(3072).len(), 22);
    }

    #[test]
    fn llama3_70b_on_64_h100_keeps_tp_in_node_and_lists_rejections() {
        let m = model_preset("llama-3-70b").unwrap();
        let c = ClusterSpec::new(accelerator_preset("h100").unwrap(), 64, 8).unwrap();
        let plan = plan_training(&m, &c, &training(512)).unwrap();
        let best = &plan.ranked[0];
        assert!(best.config.tp <= 8 && best.config.tp * best.config.pp * best.config.dp == 64);
        assert!(plan.rejected.by_kind.contains_key("tp_crosses_node"));
        assert!(plan.rejected.by_kind.contains_key("out_of_memory"));
        // 70B with Adam (16 B/param = 1.1 TB) cannot fit unsharded on one 80 GB GPU.
        assert!(plan.ranked.iter().all(|e| e.config.tp * e.config.pp > 1));
        // Sorted by step time.
        assert!(plan.ranked.windows(2).all(|w| w[0].step_s <= w[1].step_s));
    }

    #[test]
    fn uneven_tp_is_allowed_for_smollm2() {
        // 9 heads: tp=2 (5/4 heads) is a valid, reported layout on 2 GPUs.
        let m = model_preset("smollm2-135m").unwrap();
        let c = ClusterSpec::new(accelerator_preset("a100-80").unwrap(), 2, 2).unwrap();
        let plan = plan_training(&m, &c, &training(8)).unwrap();
        let uneven = plan.ranked.iter().find(|e| e.config.tp == 2).unwrap();
        assert!(uneven.head_imbalance > 1.1);
    }

    #[test]
    fn mixtral_enumerates_expert_parallelism() {
        let m = model_preset("mixtral-8x7b").unwrap();
        let c = ClusterSpec::new(accelerator_preset("h100").unwrap(), 32, 8).unwrap();
        let plan = plan_training(&m, &c, &training(256)).unwrap();
        assert!(plan.ranked.iter().any(|e| e.config.ep > 1));
    }

    #[test]
    fn serving_respects_the_latency_target() {
        let m = model_preset("llama-2-70b").unwrap();
        let c = ClusterSpec::new(accelerator_preset("h100").unwrap(), 8, 8).unwrap();
        let w = ServingWorkload {
            context_len: 4096,
            concurrency: 32,
            target_time_per_token_s: Some(0.030),
            weight_precision: Precision::Bf16,
            kv_precision: Precision::Bf16,
        };
        let plan = plan_serving(&m, &c, &w).unwrap();
        assert!(!plan.ranked.is_empty());
        assert!(plan
            .ranked
            .iter()
            .all(|e| e.time_per_output_token_s <= 0.030));
        assert!(plan.rejected.by_kind.contains_key("out_of_memory"));
    }

    #[test]
    fn cpu_box_recommends_a_tp_within_its_cores() {
        let m = model_preset("smollm2-135m").unwrap();
        let c = ClusterSpec::new(accelerator_preset("cpu-2core").unwrap(), 1, 1).unwrap();
        let w = ServingWorkload {
            context_len: 2048,
            concurrency: 1,
            target_time_per_token_s: None,
            weight_precision: Precision::Fp32,
            kv_precision: Precision::Fp32,
        };
        let plan = plan_serving(&m, &c, &w).unwrap();
        let best = &plan.ranked[0];
        // Each core streams 25 GB/s of the machine's 50: two threads decode faster.
        assert_eq!(best.config.tp, 2);
        assert!(best.memory_budget_bytes < 24.0 * GIB);
        assert_eq!(plan.rejected.by_kind.get("tp_exceeds_cores"), Some(&1));
    }

    /// Virtual stages are tried where every stage's layers split into v equal chunks and the
    /// micro-batches are a multiple of pp (Megatron's conditions), and refused otherwise with
    /// the reason; with enough micro-batches the search prefers interleaving when the bubble
    /// it saves outweighs the sends.
    #[test]
    fn virtual_stages_are_offered_where_megatron_allows_them() {
        let m = model_preset("megatron-145b").unwrap(); // 80 layers
        let c = ClusterSpec::new(accelerator_preset("a100-80").unwrap(), 64, 8).unwrap();
        let mut w = training(64);
        w.max_micro_batch = 1;
        let plan = plan_training(&m, &c, &w).unwrap();
        let offered = |tp: u64, pp: u64, v: u64| {
            plan.ranked
                .iter()
                .any(|e| (e.config.tp, e.config.pp, e.config.virtual_stages) == (tp, pp, v))
        };
        // pp 8: 10 layers a stage, so v = 2 (5-layer chunks) but not 4 or 8.
        assert!(offered(8, 8, 2));
        assert!(!offered(8, 8, 4) && !offered(8, 8, 8));
        assert!(plan.rejected.list.iter().any(|r| r.pp == Some(8)
            && r.virtual_stages == Some(4)
            && r.reason.kind() == "virtual_stages_uneven"));
        // pp 1 has no virtual stages.
        assert!(plan
            .ranked
            .iter()
            .all(|e| e.config.pp > 1 || e.config.virtual_stages == 1));
        // 64 sequences over dp 1 at b = 1: 64 micro-batches, a multiple of pp 8 (allowed);
        // over dp 2 at pp 4 with tp 8: 32, a multiple of 4; a global batch of 36 over dp 1
        // at pp 8 gives 36 micro-batches, not a multiple of 8: refused.
        let plan36 = plan_training(&m, &c, &{
            let mut w = training(36);
            w.max_micro_batch = 1;
            w
        })
        .unwrap();
        assert!(plan36
            .rejected
            .list
            .iter()
            .any(|r| r.pp == Some(8) && r.reason.kind() == "virtual_stages_micro_batches"));
        // Where it is allowed, interleaving shrinks the bubble of the same layout.
        let same = |v: u64| {
            plan.ranked
                .iter()
                .find(|e| {
                    (e.config.tp, e.config.pp, e.config.virtual_stages) == (8, 8, v)
                        && e.config.recompute == Recompute::Full
                        && !e.config.sequence_parallel
                })
                .unwrap()
                .time
                .pipeline_bubble_s
        };
        assert!(same(2) < 0.6 * same(1));
    }

    /// Two one-core hosts: tp 2 spans them (its all-reduces over their link), pp 2 puts a
    /// stage on each. Fast links favour tp 2; at 0.2 ms per message the 60 all-reduces of a
    /// token cost more than tp saves and pp 2 (two messages a token) beats it, while one host
    /// alone is fastest of all (a token passes both stages in turn).
    #[test]
    fn the_link_latency_decides_between_tp_across_hosts_and_pipeline_stages() {
        let m = model_preset("smollm2-135m").unwrap();
        let one_core = accelerator_preset("cpu-2core")
            .unwrap()
            .with_cores(1)
            .unwrap();
        let w = ServingWorkload {
            context_len: 512,
            concurrency: 1,
            target_time_per_token_s: None,
            weight_precision: Precision::Bf16,
            kv_precision: Precision::Bf16,
        };
        let tpot = |latency_s: f64, tp: u64, pp: u64| {
            let mut c = ClusterSpec::new(one_core.clone(), 2, 1).unwrap();
            c.inter_node_latency_s = latency_s;
            c.inter_node_bandwidth = 125e6;
            let plan = plan_serving(&m, &c, &w).unwrap();
            assert_eq!(plan.rejected.by_kind.get("tp_exceeds_cores"), Some(&1));
            let e = plan
                .ranked
                .iter()
                .find(|e| (e.config.tp, e.config.pp) == (tp, pp))
                .unwrap_or_else(|| panic!("tp {tp} pp {pp} is offered"));
            assert_eq!(e.command_s > 0.0, tp * pp > 1);
            e.time_per_output_token_s
        };
        let fast = 5e-6;
        assert!(tpot(fast, 2, 1) < tpot(fast, 1, 2));
        assert!(tpot(fast, 2, 1) < tpot(fast, 1, 1));
        let slow = 200e-6;
        assert!(tpot(slow, 1, 2) < tpot(slow, 2, 1));
        assert!(tpot(slow, 1, 1) < tpot(slow, 1, 2));
        // A stage boundary costs one message per token, tp two all-reduces per layer.
        let extra = tpot(slow, 1, 2) - tpot(fast, 1, 2);
        assert!((extra - 2.0 * (slow - fast)).abs() < 1e-9, "{extra}");
        let extra = tpot(slow, 2, 1) - tpot(fast, 2, 1);
        let messages = (2 * m.num_layers + 1) as f64;
        assert!((extra - messages * (slow - fast)).abs() < 1e-9, "{extra}");
    }
}
