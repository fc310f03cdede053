//! Predicted training step time and memory of one layout: 1F1B pipeline with
//! bubble (p-1)/(v·m) (Narayanan et al. 2021 §2.2.1, §2.2.2 for v virtual stages), tensor-parallel all-reduces
//! (Shoeybi et al. 2019 §3: 2 forward + 2 backward per layer, +2 with full
//! recompute), expert all-to-all, data-parallel gradient all-reduce, GEMMs at a
//! calibrated fraction of peak and element-wise work bound by memory bandwidth.

use crate::activation_memory::{layer_activation_bytes, ActivationShape};
use crate::collectives::{all_to_all_s, ring_all_reduce_s, send_s, Link};
use crate::flops::{attention_score_forward_flops, training_flops_per_iteration};
use crate::hardware::ClusterSpec;
use crate::model::ModelSpec;
use crate::sharding::{stage_layer_counts, ParallelConfig, TensorShard};
use crate::state_memory::{stage_rank_params, MemoryBreakdown, RankParams};
use crate::workload::{Recompute, TrainingWorkload};
use serde::Serialize;

/// Each stored activation byte is written once and read once by memory-bound
/// element-wise kernels (layer norm, GeLU, softmax, dropout, residual adds).
pub const ELEMENTWISE_TRAFFIC_PER_STORED_BYTE: f64 = 2.0;

/// Where a step's time goes, seconds (slowest pipeline stage).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct TimeBreakdown {
    pub compute_s: f64,
    pub tensor_parallel_comm_s: f64,
    pub expert_parallel_comm_s: f64,
    pub pipeline_bubble_s: f64,
    pub pipeline_p2p_s: f64,
    pub data_parallel_comm_s: f64,
    pub optimizer_step_s: f64,
}

impl TimeBreakdown {
    pub fn total_s(&self) -> f64 {
        self.compute_s
            + self.tensor_parallel_comm_s
            + self.expert_parallel_comm_s
            + self.pipeline_bubble_s
            + self.pipeline_p2p_s
            + self.data_parallel_comm_s
            + self.optimizer_step_s
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainingEstimate {
    pub config: ParallelConfig,
    pub micro_batches: u64,
    /// Memory of the most loaded device.
    pub memory: MemoryBreakdown,
    pub time: TimeBreakdown,
    pub step_s: f64,
    pub tokens_per_s: f64,
    /// Model FLOPs (no recompute) / (step · devices · peak).
    pub mfu: f64,
    /// Executed FLOPs (with recompute) per device per second, in TFLOP/s.
    pub hardware_tflops_per_device: f64,
    /// ceil(heads/tp)·tp/heads.
    pub head_imbalance: f64,
    /// KV heads held over all tensor ranks / kv heads.
    pub kv_replication: f64,
}

/// Per-rank compute resources: GPUs own a device each; CPU tensor ranks are
/// threads with a core each and min(per-core, machine / tp) of the bandwidth.
struct RankResources {
    flops: f64,
    memory_bandwidth: f64,
}

fn rank_resources(cluster: &ClusterSpec, tp: u64) -> RankResources {
    let a = &cluster.accelerator;
    RankResources {
        flops: a.rank_flops(cluster.ranks_per_device(tp)),
        memory_bandwidth: a.rank_memory_bandwidth(cluster.ranks_per_device(tp)),
    }
}

/// Time of one layer for one micro-batch, split into compute and communication.
struct LayerTime {
    compute_s: f64,
    tensor_comm_s: f64,
    expert_comm_s: f64,
}

fn layer_time(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    workload: &TrainingWorkload,
    config: &ParallelConfig,
    shard: &TensorShard,
) -> LayerTime {
    let res = rank_resources(cluster, config.tp);
    let b = config.micro_batch;
    let s = workload.seq_len;
    let h = model.hidden_size as f64;
    let d = model.head_dim as f64;
    let act_bytes = workload.precision.bytes();
    let tokens = (b * s) as f64;
    // Forward GEMM FLOPs of the most loaded rank.
    let rank_matmul_params = 2.0 * h * d * (shard.max_query_heads + shard.max_kv_heads) as f64
        + (model.experts_per_token
            * model.mlp_matrices()
            * model.hidden_size
            * shard.max_ffn_columns) as f64;
    let score_flops = attention_score_forward_flops(model, b, s) * shard.query_fraction(model);
    let forward_flops = 2.0 * tokens * rank_matmul_params + score_flops;
    let shape = ActivationShape {
        micro_batch: b,
        seq: s,
        sequence_parallel: config.sequence_parallel,
        flash_attention: workload.flash_attention,
        element_bytes: act_bytes,
    };
    let acts = layer_activation_bytes(model, shard, &shape);
    let forward_traffic = ELEMENTWISE_TRAFFIC_PER_STORED_BYTE * acts.all();
    let forward_s = forward_flops / res.flops + forward_traffic / res.memory_bandwidth;
    let recompute_s = match config.recompute {
        Recompute::None => 0.0,
        Recompute::Full => forward_s,
        Recompute::Selective => {
            score_flops / res.flops
                + ELEMENTWISE_TRAFFIC_PER_STORED_BYTE * acts.attention_scores / res.memory_bandwidth
        }
    };
    // Forward + backward (2x forward) + recompute.
    let compute_s = 3.0 * forward_s + recompute_s;
    let (bw, lat) = cluster.link_for_span(config.tp);
    let tp_link = Link {
        bandwidth: bw,
        latency_s: lat,
    };
    let all_reduces = if config.recompute == Recompute::Full {
        6.0
    } else {
        4.0
    };
    let tensor_comm_s = all_reduces * ring_all_reduce_s(tokens * h * act_bytes, config.tp, tp_link);
    let expert_comm_s = if model.is_moe() && config.ep > 1 {
        let (bw, lat) = cluster.link_for_span(cluster.tensor_group_slots(config.tp) * config.ep);
        let link = Link {
            bandwidth: bw,
            latency_s: lat,
        };
        // The trainer's layout (`tp train --ep t x e`): every rank holds whole experts, so a
        // replica's t ranks each dispatch the rows of their own experts, 1/t of the
        // replica's (token, expert) rows.
        let dispatched =
            tokens * model.experts_per_token as f64 * h * act_bytes / config.tp.max(1) as f64;
        all_reduces * all_to_all_s(dispatched, config.ep, link)
    } else {
        0.0
    };
    LayerTime {
        compute_s,
        tensor_comm_s,
        expert_comm_s,
    }
}

/// Predicts memory and step time of `config`. The caller checks divisibility.
pub fn estimate_training(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    workload: &TrainingWorkload,
    config: &ParallelConfig,
) -> TrainingEstimate {
    let shard = TensorShard::new(model, config.tp);
    let res = rank_resources(cluster, config.tp);
    let b = config.micro_batch;
    let s = workload.seq_len;
    let micro_batches = workload.global_batch / (config.dp * b);
    let m = micro_batches.max(1);
    let element = workload.precision.bytes();
    let h = model.hidden_size as f64;
    let layer = layer_time(model, cluster, workload, config, &shard);

    // Last stage also runs the vocab-parallel LM head: forward + backward = 3 forwards.
    let vocab_rank = model.vocab_size.div_ceil(config.tp) as f64;
    let logits_flops = 3.0 * 2.0 * (b * s) as f64 * h * vocab_rank;
    let logits_s = logits_flops / res.flops;

    // Scatter/gather p2p (Narayanan §4.1): b·s·h/t bytes each way per micro-batch.
    let p2p_per_micro_s = if config.pp > 1 {
        let (bw, lat) =
            cluster.link_for_span(2 * cluster.tensor_group_slots(config.tp) * config.dp);
        let bytes = (b * s) as f64 * h * element / config.tp as f64;
        2.0 * send_s(
            bytes,
            Link {
                bandwidth: bw,
                latency_s: lat,
            },
        )
    } else {
        0.0
    };

    let counts = stage_layer_counts(model.num_layers, config.pp);
    let last = counts.len() - 1;
    let stage_times: Vec<(f64, f64, f64)> = counts
        .iter()
        .enumerate()
        .map(|(i, &layers)| {
            let l = layers as f64;
            let extra = if i == last { logits_s } else { 0.0 };
            (
                l * layer.compute_s + extra,
                l * layer.tensor_comm_s,
                l * layer.expert_comm_s,
            )
        })
        .collect();
    let slowest = stage_times
        .iter()
        .copied()
        .fold((0.0, 0.0, 0.0), |best, t| {
            if t.0 + t.1 + t.2 > best.0 + best.1 + best.2 {
                t
            } else {
                best
            }
        });
    let per_micro_s = slowest.0 + slowest.1 + slowest.2 + p2p_per_micro_s;

    // Memory: each stage's rank holds its params, and under 1F1B stage i keeps
    // activations of min(pp - i, m) in-flight micro-batches.
    let params = stage_rank_params(model, &shard, config.ep, config.pp);
    let shape = ActivationShape {
        micro_batch: b,
        seq: s,
        sequence_parallel: config.sequence_parallel,
        flash_attention: workload.flash_attention,
        element_bytes: element,
    };
    let acts = layer_activation_bytes(model, &shard, &shape);
    let opt_bytes = workload.optimizer.state_bytes_per_param(workload.precision);
    let expert_dp = (config.dp / config.ep.max(1)).max(1) as f64;
    let (dense_opt_div, expert_opt_div) = if workload.distributed_optimizer {
        (config.dp as f64, expert_dp)
    } else {
        (1.0, 1.0)
    };
    let v = config.virtual_stages.max(1);
    let memory_of_stage = |i: usize, p: &RankParams| -> MemoryBreakdown {
        // Layers whose activations are held at the peak: under 1F1B stage i runs p - i
        // micro-batches forward before its first backward; interleaved (Megatron's warm-up),
        // 2(p - i - 1) + (v - 1)p + 1 chunks of counts[i] / v layers, at most every chunk of
        // every micro-batch. Stage 0 then holds (1 + (p - 1)/(p v)) times 1F1B's
        // (Korthikanti et al. 2022 §4.2.3).
        let layers_in_flight = if v == 1 {
            counts[i] as f64 * (config.pp - i as u64).min(m) as f64
        } else {
            let chunks = 2 * (config.pp - i as u64 - 1) + (v - 1) * config.pp + 1;
            counts[i] as f64 / v as f64 * chunks.min(m * v) as f64
        };
        let mut activations = layers_in_flight * acts.stored(config.recompute);
        if config.recompute == Recompute::Full {
            // Backward of one layer materialises its full activations again.
            activations += acts.all();
        }
        if i == last {
            // fp32 logits for the cross entropy: 4·b·s·V/t.
            activations += 4.0 * (b * s) as f64 * vocab_rank;
        }
        MemoryBreakdown {
            weights: p.total() * element,
            gradients: p.total() * element,
            optimizer_state: p.dense * opt_bytes / dense_opt_div
                + p.expert * opt_bytes / expert_opt_div,
            activations,
            kv_cache: 0.0,
        }
    };
    let memory = params
        .iter()
        .enumerate()
        .map(|(i, p)| memory_of_stage(i, p))
        .fold(MemoryBreakdown::default(), |best, mem| {
            if mem.total() > best.total() {
                mem
            } else {
                best
            }
        });

    // Data-parallel gradient all-reduce (reduce-scatter + all-gather with a
    // distributed optimizer: same volume), not overlapped with backward.
    let heaviest = params.iter().copied().fold(RankParams::default(), |a, p| {
        if p.total() > a.total() {
            p
        } else {
            a
        }
    });
    let (bw, lat) = cluster.link_for_span(cluster.tensor_group_slots(config.tp) * config.dp);
    let dp_link = Link {
        bandwidth: bw,
        latency_s: lat,
    };
    let expert_comm_s = if heaviest.expert > 0.0 {
        ring_all_reduce_s(heaviest.expert * element, expert_dp as u64, dp_link)
    } else {
        0.0
    };
    let data_parallel_comm_s =
        ring_all_reduce_s(heaviest.dense * element, config.dp, dp_link) + expert_comm_s;
    // Optimizer update streams weights, grads and state through memory (read + write).
    let optimizer_step_s =
        2.0 * (memory.weights + memory.gradients + memory.optimizer_state) / res.memory_bandwidth;

    let time = TimeBreakdown {
        compute_s: m as f64 * slowest.0,
        tensor_parallel_comm_s: m as f64 * slowest.1,
        expert_parallel_comm_s: m as f64 * slowest.2,
        // Interleaving: the bubble is (p - 1) chunks of 1/v of a stage's work (each with its
        // send), and every micro-batch crosses v times as many stage boundaries (Narayanan
        // et al. 2021 §2.2.2).
        pipeline_bubble_s: (config.pp - 1) as f64
            * ((per_micro_s - p2p_per_micro_s) / v as f64 + p2p_per_micro_s),
        pipeline_p2p_s: (m * v) as f64 * p2p_per_micro_s,
        data_parallel_comm_s,
        optimizer_step_s,
    };
    let step_s = time.total_s();
    let devices = cluster.num_devices as f64;
    let model_flops = training_flops_per_iteration(model, workload.global_batch, s, false);
    let executed_flops = match config.recompute {
        Recompute::Full => training_flops_per_iteration(model, workload.global_batch, s, true),
        Recompute::Selective => {
            model_flops
                + model.num_layers as f64
                    * attention_score_forward_flops(model, workload.global_batch, s)
        }
        Recompute::None => model_flops,
    };
    TrainingEstimate {
        config: *config,
        micro_batches,
        memory,
        time,
        step_s,
        tokens_per_s: (workload.global_batch * s) as f64 / step_s,
        mfu: model_flops / (step_s * devices * cluster.accelerator.peak_flops),
        hardware_tflops_per_device: executed_flops / (step_s * devices) / 1e12,
        head_imbalance: shard.head_imbalance,
        kv_replication: shard.total_kv_heads_held as f64 / model.num_kv_heads as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hardware::accelerator_preset;
    use crate::model_presets::model_preset;
    use crate::workload::{Optimizer, Precision};

    fn workload(batch: u64) -> TrainingWorkload {
        TrainingWorkload {
            global_batch: batch,
            seq_len: 2048,
            precision: Precision::Bf16,
            optimizer: Optimizer::Adam,
            distributed_optimizer: false,
            flash_attention: false,
            max_micro_batch: 8,
        }
    }

    fn config(tp: u64, pp: u64, dp: u64, mb: u64) -> ParallelConfig {
        ParallelConfig {
            tp,
            pp,
            dp,
            ep: 1,
            micro_batch: mb,
            sequence_parallel: false,
            recompute: Recompute::Full,
            virtual_stages: 1,
        }
    }

    #[test]
    fn bubble_is_p_minus_one_over_m_of_the_ideal_time() {
        // 145B, (t,p,d) = (8,8,24), B=2304, b=1 → m = 96; bubble/ideal = 7/96 (p2p excluded).
        let m = model_preset("megatron-145b").unwrap();
        let c = ClusterSpec::new(accelerator_preset("a100-80").unwrap(), 1536, 8).unwrap();
        let e = estimate_training(&m, &c, &workload(2304), &config(8, 8, 24, 1));
        assert_eq!(e.micro_batches, 96);
        let per_micro =
            (e.time.compute_s + e.time.tensor_parallel_comm_s + e.time.pipeline_p2p_s) / 96.0;
        assert!((e.time.pipeline_bubble_s / (96.0 * per_micro) - 7.0 / 96.0).abs() < 1e-9);
    }

    /// Interleaving with v chunks per stage (Narayanan et al. 2021 §2.2.2): the bubble is 1/v
    /// of 1F1B's, every micro-batch makes v times the stage-boundary sends, and the first
    /// stage holds (1 + (p-1)/(p v)) times 1F1B's activations (Korthikanti et al. 2022
    /// §4.2.3); compute is unchanged.
    #[test]
    fn virtual_stages_shrink_the_bubble_and_grow_sends_and_first_stage_activations() {
        let m = model_preset("megatron-145b").unwrap(); // 80 layers: 10 per stage at p = 8
        let c = ClusterSpec::new(accelerator_preset("a100-80").unwrap(), 1536, 8).unwrap();
        let at = |v: u64, recompute: Recompute| {
            let mut cfg = config(8, 8, 24, 1);
            cfg.virtual_stages = v;
            cfg.recompute = recompute;
            estimate_training(&m, &c, &workload(2304), &cfg)
        };
        let rel = |a: f64, b: f64| (a / b - 1.0).abs();
        let plain = at(1, Recompute::Full);
        let p2p = plain.time.pipeline_p2p_s / 96.0;
        let work = (plain.time.compute_s + plain.time.tensor_parallel_comm_s) / 96.0;
        let acts = at(1, Recompute::None).memory.activations;
        for v in [2u64, 5, 10] {
            let e = at(v, Recompute::Full);
            assert!(rel(e.time.compute_s, plain.time.compute_s) < 1e-12);
            assert!(rel(e.time.pipeline_p2p_s, v as f64 * plain.time.pipeline_p2p_s) < 1e-12);
            assert!(rel(e.time.pipeline_bubble_s, 7.0 * (work / v as f64 + p2p)) < 1e-9);
            // Without recompute the first stage (8 micro-batches in flight under 1F1B) holds
            // the most: its activations grow by 1 + (p - 1)/(p v).
            let factor = 1.0 + 7.0 / (8.0 * v as f64);
            let got = at(v, Recompute::None).memory.activations;
            assert!(
                rel(got, acts * factor) < 1e-12,
                "v {v}: {got} vs {}",
                acts * factor
            );
        }
    }

    #[test]
    fn tensor_parallel_all_reduces_hand_computed() {
        // 145B, t=8, p=8 (10 layers per stage), b=1, m=96, full recompute → 6 all-reduces
        // per layer of b·s·h·2 = 50_331_648 B over 8 ranks at 300 GB/s, α = 5 µs:
        // 2·7/8·50_331_648/300e9 + 14·5e-6 = 2.936013e-4 + 7e-5 = 3.636013e-4 s.
        // Step total: 6 · 10 layers · 96 micro-batches · 3.636013e-4 = 2.0943435 s.
        let m = model_preset("megatron-145b").unwrap();
        let c = ClusterSpec::new(accelerator_preset("a100-80").unwrap(), 1536, 8).unwrap();
        let e = estimate_training(&m, &c, &workload(2304), &config(8, 8, 24, 1));
        let per = 2.0 * 7.0 / 8.0 * 50_331_648.0 / 300e9 + 14.0 * 5e-6;
        assert!((e.time.tensor_parallel_comm_s / (6.0 * 10.0 * 96.0 * per) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn expert_all_to_alls_carry_a_ranks_own_experts_rows() {
        // Mixtral 8x7B (32 layers, h 4096, top-2) on 64 A100s, t = 2, p = 1, d = 32, e = 2,
        // b = 1, full recompute: 6 all-to-alls per layer over 2 ranks, each rank sending the
        // rows of its own experts, b·s·k·h·2 B / t = 2048·2·4096·2 / 2 = 16_777_216 B, within
        // a node (300 GB/s, α = 5 µs): 1/2 · 16_777_216 / 300e9 + 5e-6 s each.
        let m = model_preset("mixtral-8x7b").unwrap();
        let c = ClusterSpec::new(accelerator_preset("a100-80").unwrap(), 64, 8).unwrap();
        let cfg = ParallelConfig {
            ep: 2,
            ..config(2, 1, 32, 1)
        };
        let e = estimate_training(&m, &c, &workload(64), &cfg);
        let per = 0.5 * 16_777_216.0 / 300e9 + 5e-6;
        let want = 6.0 * 32.0 * 2.0 * per; // x 2 micro-batches per replica
        let got = e.time.expert_parallel_comm_s;
        assert!((got / want - 1.0).abs() < 1e-12, "{got} vs {want}");
    }

    #[test]
    fn data_parallel_all_reduce_hand_computed() {
        // 1.7B on 32 GPUs, t=p=1: dp=32 spans 4 nodes → 25 GB/s NIC, α = 10 µs.
        // Params: 24·(12·2304² + 2·2304) + 51200·2304 + 2304
        //   = 24·63_705_600 + 117_964_800 + 2304 = 1_646_901_504; bf16 grads ×2 B.
        // Ring: 2·31/32·3_293_803_008/25e9 + 62·10e-6 = 0.255270 + 0.00062 s.
        let m = model_preset("megatron-1.7b").unwrap();
        assert_eq!(m.total_params(), 1_646_901_504);
        let c = ClusterSpec::new(accelerator_preset("a100-80").unwrap(), 32, 8).unwrap();
        let e = estimate_training(&m, &c, &workload(512), &config(1, 1, 32, 1));
        let expected = 2.0 * 31.0 / 32.0 * 3_293_803_008.0 / 25e9 + 62.0 * 10e-6;
        assert!((e.time.data_parallel_comm_s / expected - 1.0).abs() < 1e-12);
    }

    #[test]
    fn weights_grads_optimizer_are_sixteen_bytes_per_param() {
        // Llama-2-7B on one stage, tp=1: 16 bytes x 6.74e9 params.
        let m = model_preset("llama-2-7b").unwrap();
        let c = ClusterSpec::new(accelerator_preset("h100").unwrap(), 8, 8).unwrap();
        let e = estimate_training(&m, &c, &workload(64), &config(1, 1, 8, 1));
        let states = e.memory.weights + e.memory.gradients + e.memory.optimizer_state;
        assert_eq!(states, 16.0 * m.total_params() as f64);
    }

    #[test]
    fn uneven_tp_reports_imbalance_and_replication() {
        let m = model_preset("smollm2-135m").unwrap();
        let c = ClusterSpec::new(accelerator_preset("h100").unwrap(), 8, 8).unwrap();
        let mut cfg = config(4, 1, 2, 1);
        cfg.recompute = Recompute::None;
        let e = estimate_training(&m, &c, &workload(16), &cfg);
        // 9 heads / 4 ranks → 3 on the largest: 3·4/9.
        assert!((e.head_imbalance - 4.0 / 3.0).abs() < 1e-12);
        // Ranks [0,3) [3,5) [5,7) [7,9) with groups of 3 hold 1+1+2+1 = 5 of 3 kv heads.
        assert!((e.kv_replication - 5.0 / 3.0).abs() < 1e-12);
    }
}
