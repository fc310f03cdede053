//! Predicted decode latency, throughput, cost and memory of one serving layout.
//! Decode is a roofline: each step streams the rank's weights and the KV cache
//! (time ≥ bytes / bandwidth, so tokens/s ≤ bandwidth / bytes per token) or is
//! bound by FLOPs; tensor ranks add 2 all-reduces per layer (Shoeybi et al. 2019
//! §3); pipeline stages run one after another for a given token. With `c` sequences and
//! `pp` stages `tp serve` keeps `m = min(pp, c)` micro-batches in flight, so each stage step
//! computes `c/m` sequences (and reads its weights once per micro-batch) while the other
//! stages compute the other micro-batches: a token takes the sum of the stages' times at
//! `c/m` sequences, and all `c` sequences advance in that time (compute-bound stages gain
//! up to `m` times; memory-bound ones read their weights `m` times as often and gain nothing).

use crate::collectives::{all_reduce_s, send_s, Link};
use crate::hardware::ClusterSpec;
use crate::model::ModelSpec;
use crate::sharding::{stage_layer_counts, TensorShard};
use crate::state_memory::{kv_cache_bytes, stage_rank_params, MemoryBreakdown};
use crate::workload::{Precision, ServingWorkload};
use serde::Serialize;

/// A serving layout: tp ranks per stage, pp stages, dp independent replicas; for a mixture
/// of experts, `ep` expert groups of `tp / ep` consecutive ranks, each holding whole experts
/// sliced over its ranks (the runtime's `--ep`; 1 slices every expert over all tp ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ServingConfig {
    pub tp: u64,
    pub pp: u64,
    pub dp: u64,
    pub ep: u64,
}

impl ServingConfig {
    /// A dense layout (one expert group).
    pub fn dense(tp: u64, pp: u64, dp: u64) -> Self {
        ServingConfig { tp, pp, dp, ep: 1 }
    }
}

/// What bounds a decode step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DecodeBound {
    MemoryBandwidth,
    Compute,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServingEstimate {
    pub config: ServingConfig,
    pub sequences_per_replica: u64,
    /// Most loaded device (GPU) or one tensor rank (CPU thread).
    pub memory: MemoryBreakdown,
    /// Memory one device must provide: per GPU, or the whole CPU machine
    /// (all its tensor-rank threads together, replicated KV heads included).
    pub memory_budget_bytes: f64,
    pub time_per_output_token_s: f64,
    /// Part of the token time spent streaming weights + KV cache.
    pub memory_read_s: f64,
    pub compute_s: f64,
    pub tensor_parallel_comm_s: f64,
    pub pipeline_p2p_s: f64,
    /// The leader's step command reaching the replica's other ranks (0 on one rank).
    pub command_s: f64,
    pub bound: DecodeBound,
    pub tokens_per_s: f64,
    /// Device-seconds (GPU-seconds, or machine-seconds for CPU) per output token.
    pub device_seconds_per_token: f64,
    /// Prefill of one full context on an idle replica.
    pub time_to_first_token_s: f64,
    pub head_imbalance: f64,
    pub kv_replication: f64,
}

/// Each pipeline stage of a model file as the runtime splits it: its layer count and every
/// tensor rank's weight bytes, from the file's stored layouts
/// ([`crate::model::StoredWeights`]); unquantized weights at the precision's size (f32 4
/// bytes, 2 otherwise). `None` for presets and MoE files: the parameter-count estimate
/// applies.
struct StoredStage {
    layers: u64,
    /// Each rank's weight bytes held, and read per decode step (the embedding is looked up).
    rank_bytes: Vec<u64>,
    read_bytes: Vec<u64>,
}

fn stored_stages(
    model: &ModelSpec,
    config: &ServingConfig,
    precision: Precision,
) -> Option<Vec<StoredStage>> {
    let stored = model.stored.as_ref()?;
    if model.is_moe() {
        return None;
    }
    let dense_bytes = if precision == Precision::Fp32 { 4 } else { 2 };
    let tp = usize::try_from(config.tp).ok()?;
    let pp = usize::try_from(config.pp).ok()?;
    stored
        .stages(pp)?
        .iter()
        .map(|stage| {
            let ranks = (0..tp)
                .map(|r| stored.stage_rank_bytes(stage, tp, r, dense_bytes))
                .collect::<Option<Vec<_>>>()?;
            let rank_bytes = ranks.iter().map(|b| b.held).collect();
            let read_bytes = ranks.iter().map(|b| b.read).collect();
            Some(StoredStage {
                layers: stage.layers.len() as u64,
                rank_bytes,
                read_bytes,
            })
        })
        .collect()
}

/// Expected number of distinct experts that `tokens` top-k tokens touch:
/// E·(1 - (1 - k/E)^tokens) (uniform routing).
pub fn expected_experts_touched(experts: u64, top_k: u64, tokens: u64) -> f64 {
    let e = experts as f64;
    e * (1.0 - (1.0 - top_k as f64 / e).powf(tokens as f64))
}

/// Expected largest number of touched experts in one expert group, over `groups` groups that
/// split `experts` as evenly as they go (the first `experts % groups` one larger), when each
/// expert is touched with probability `touched_fraction` independently (uniform routing; the
/// experts a step touches are in fact drawn without replacement per token, a small
/// correlation this ignores). A decode step waits for the busiest group.
pub fn expected_busiest_group(experts: u64, groups: u64, touched_fraction: f64) -> f64 {
    let groups = groups.clamp(1, experts.max(1));
    let q = touched_fraction.clamp(0.0, 1.0);
    let sizes: Vec<u64> = (0..groups)
        .map(|g| experts / groups + u64::from(g < experts % groups))
        .collect();
    // P(Binomial(n, q) <= m).
    let cdf = |n: u64, m: u64| -> f64 {
        if m >= n || q <= 0.0 {
            return 1.0;
        }
        if q >= 1.0 {
            return 0.0;
        }
        let ratio = q / (1.0 - q);
        let mut p = (1.0 - q).powi(i32::try_from(n).unwrap_or(i32::MAX));
        let mut sum = p;
        for i in 0..m {
            p *= (n - i) as f64 / (i + 1) as f64 * ratio;
            sum += p;
        }
        sum.min(1.0)
    };
    let largest = sizes.iter().copied().max().unwrap_or(0);
    (1..=largest)
        .map(|m| 1.0 - sizes.iter().map(|&n| cdf(n, m - 1)).product::<f64>())
        .sum()
}

pub fn estimate_serving(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    workload: &ServingWorkload,
    config: &ServingConfig,
) -> ServingEstimate {
    let shard = TensorShard::new(model, config.tp);
    let acc = &cluster.accelerator;
    let tp = config.tp as f64;
    // GPU ranks own a device; CPU rank threads get a core each and
    // min(per-core, machine / threads) of the memory bandwidth, the threads of one machine
    // being min(tp, cores) (a larger tp spans machines).
    let rank_flops = acc.rank_flops(cluster.ranks_per_device(config.tp));
    let rank_bw = acc.rank_memory_bandwidth(cluster.ranks_per_device(config.tp));
    let seqs = workload.concurrency.div_ceil(config.dp).max(1);
    // Sequences one stage step computes: one micro-batch of those in flight.
    let micro = seqs.div_ceil(config.pp.clamp(1, seqs));
    let w_bytes = workload.weight_precision.bytes();
    let kv_bytes = workload.kv_precision.bytes();
    let act_bytes = if workload.weight_precision == Precision::Fp32 {
        4.0
    } else {
        2.0
    };
    let h = model.hidden_size as f64;
    let d = model.head_dim as f64;
    let ctx = workload.context_len;

    let mut params = stage_rank_params(model, &shard, 1, config.pp);
    // A model file's stages as the runtime splits and reads them.
    let stored = stored_stages(model, config, workload.weight_precision);
    let counts = match &stored {
        Some(stages) => stages.iter().map(|s| s.layers).collect(),
        None => stage_layer_counts(model.num_layers, config.pp),
    };
    let touched = if model.is_moe() {
        expected_experts_touched(model.num_experts, model.experts_per_token, seqs)
            / model.num_experts as f64
    } else {
        1.0
    };
    // Expert parallelism: a rank holds its group's experts, each sliced over the group's
    // tp / ep ranks, and a step waits for the group whose experts the tokens touched most.
    let ep = config.ep.clamp(1, config.tp.max(1));
    let expert_fraction_read = if model.is_moe() && ep > 1 {
        let group = TensorShard::new(model, config.tp / ep);
        let slice = (model.mlp_matrices() * model.hidden_size * group.max_ffn_columns) as f64;
        let held = model.num_experts.div_ceil(ep) as f64 * slice;
        for (p, &layers) in params
            .iter_mut()
            .zip(&stage_layer_counts(model.num_layers, config.pp))
        {
            p.expert = held * layers as f64;
        }
        let busiest = expected_busiest_group(model.num_experts, ep, touched);
        // Of the rank's experts, the share the busiest group reads.
        busiest / model.num_experts.div_ceil(ep) as f64
    } else {
        touched
    };
    let (tp_bw, tp_lat) = cluster.link_for_span(config.tp);
    let tp_link = Link {
        bandwidth: tp_bw,
        latency_s: tp_lat,
    };
    let vocab_rank = model.vocab_size.div_ceil(config.tp) as f64;
    let rank_matmul_per_layer = 2.0 * h * d * (shard.max_query_heads + shard.max_kv_heads) as f64
        + (model.experts_per_token
            * model.mlp_matrices()
            * model.hidden_size
            * shard.max_ffn_columns) as f64;
    let last = counts.len() - 1;

    let mut memory_read_s = 0.0;
    let mut compute_s = 0.0;
    let mut tensor_parallel_comm_s = 0.0;
    let mut token_s = 0.0;
    let mut memory = MemoryBreakdown::default();
    for (i, &layers) in counts.iter().enumerate() {
        let p = &params[i];
        let (weights, weights_read) = match &stored {
            Some(stages) => {
                let most = |v: &[u64]| v.iter().copied().max().unwrap_or(0) as f64;
                (most(&stages[i].rank_bytes), most(&stages[i].read_bytes))
            }
            None => (
                (p.dense + p.expert) * w_bytes,
                (p.dense + p.expert * expert_fraction_read) * w_bytes,
            ),
        };
        let kv = kv_cache_bytes(model, &shard, layers, ctx, seqs, kv_bytes);
        let kv_read = kv_cache_bytes(model, &shard, layers, ctx, micro, kv_bytes);
        let l = layers as f64;
        let b = micro as f64;
        let logits = if i == last {
            2.0 * b * h * vocab_rank
        } else {
            0.0
        };
        let flops = 2.0 * b * rank_matmul_per_layer * l
            + 4.0 * b * ctx as f64 * (shard.max_query_heads as f64 * d) * l
            + logits;
        let read_s = (weights_read + kv_read) / rank_bw;
        let flop_s = flops / rank_flops;
        let comm = 2.0 * l * all_reduce_s(b * h * act_bytes, config.tp, tp_link);
        memory_read_s += read_s;
        compute_s += flop_s;
        tensor_parallel_comm_s += comm;
        token_s += read_s.max(flop_s) + comm;
        let stage_memory = MemoryBreakdown {
            weights,
            kv_cache: kv,
            activations: 4.0 * b * vocab_rank + 2.0 * b * h * act_bytes,
            ..MemoryBreakdown::default()
        };
        if stage_memory.total() > memory.total() {
            memory = stage_memory;
        }
    }
    let pipeline_p2p_s = if config.pp > 1 {
        let (bw, lat) = cluster.link_for_span(2 * cluster.tensor_group_slots(config.tp));
        (config.pp - 1) as f64
            * send_s(
                micro as f64 * h * act_bytes,
                Link {
                    bandwidth: bw,
                    latency_s: lat,
                },
            )
    } else {
        0.0
    };
    // The leader's step command (the tokens to feed) reaches every rank of the replica
    // before it computes: one message over the widest link the replica spans.
    let replica_slots = config.pp * cluster.tensor_group_slots(config.tp);
    let command_s = if config.pp * config.tp > 1 {
        let (bw, lat) = cluster.link_for_span(replica_slots);
        send_s(
            64.0 * micro as f64,
            Link {
                bandwidth: bw,
                latency_s: lat,
            },
        )
    } else {
        0.0
    };
    token_s += command_s;
    token_s += pipeline_p2p_s;

    let memory_budget_bytes = if cluster.is_cpu() {
        // The tensor threads of a stage share a machine: count every rank's weights
        // (replicated kv projections included) and KV cache; a tp spanning machines
        // splits them evenly over its machines.
        let machines = cluster.devices_per_tensor_group(config.tp) as f64;
        let largest_stage = counts.iter().copied().max().unwrap_or(0);
        let held_kv = shard.total_kv_heads_held as f64;
        let attention = 2.0 * h * d * (model.num_query_heads as f64 + held_kv);
        let per_layer = attention
            + model.mlp_params_per_layer() as f64
            + tp * model.norm_params_per_layer() as f64;
        let embeddings = if model.tied_embeddings && config.pp == 1 {
            1.0
        } else {
            2.0
        };
        let weights = match &stored {
            Some(stages) => stages
                .iter()
                .map(|s| s.rank_bytes.iter().sum::<u64>())
                .max()
                .unwrap_or(0) as f64,
            None => {
                (largest_stage as f64 * per_layer + embeddings * model.embedding_params() as f64)
                    * w_bytes
            }
        };
        let kv = 2.0 * largest_stage as f64 * held_kv * d * ctx as f64 * seqs as f64 * kv_bytes;
        (weights + kv) / machines + cluster.ranks_per_device(config.tp) as f64 * memory.activations
    } else {
        memory.total()
    };

    let devices_per_replica = if cluster.is_cpu() {
        config.pp * cluster.devices_per_tensor_group(config.tp)
    } else {
        config.tp * config.pp
    };
    let tokens_per_s_replica = seqs as f64 / token_s;
    let prefill_flops =
        2.0 * ctx as f64 * model.active_matmul_params_per_layer() as f64 * model.num_layers as f64
            + 2.0 * ctx as f64 * ctx as f64 * model.query_dim() as f64 * model.num_layers as f64;
    // The most loaded rank (ceil(a/t) heads) finishes last.
    let replica_flops = rank_flops * tp / shard.head_imbalance;
    ServingEstimate {
        config: *config,
        sequences_per_replica: seqs,
        memory,
        memory_budget_bytes,
        time_per_output_token_s: token_s,
        memory_read_s,
        compute_s,
        tensor_parallel_comm_s,
        pipeline_p2p_s,
        command_s,
        bound: if memory_read_s >= compute_s {
            DecodeBound::MemoryBandwidth
        } else {
            DecodeBound::Compute
        },
        tokens_per_s: tokens_per_s_replica * config.dp as f64,
        device_seconds_per_token: devices_per_replica as f64 / tokens_per_s_replica,
        time_to_first_token_s: prefill_flops / replica_flops,
        head_imbalance: shard.head_imbalance,
        kv_replication: shard.total_kv_heads_held as f64 / model.num_kv_heads as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hardware::accelerator_preset;
    use crate::model_presets::model_preset;

    fn serve(concurrency: u64, precision: Precision) -> ServingWorkload {
        ServingWorkload {
            context_len: 1024,
            concurrency,
            target_time_per_token_s: None,
            weight_precision: precision,
            kv_precision: precision,
        }
    }

    #[test]
    fn micro_batches_in_flight_let_compute_bound_stages_work_at_once() {
        // Two one-core machines (cpu-2core cut to 1 core each), SmolLM2-135M f32: at 16
        // sequences a step is bound by FLOPs, and pp 2 keeps two micro-batches of 8 in
        // flight, so each stage computes half the sequences and the two stages run at once
        // (one micro-batch at a time the two would take turns: about 1x).
        let m = model_preset("smollm2-135m").unwrap();
        let core = accelerator_preset("cpu-2core")
            .unwrap()
            .with_cores(1)
            .unwrap();
        let two = ClusterSpec::new(core.clone(), 2, 1).unwrap();
        let one = ClusterSpec::new(core, 1, 1).unwrap();
        let at = |c: &ClusterSpec, concurrency, pp| {
            let w = serve(concurrency, Precision::Fp32);
            estimate_serving(&m, c, &w, &ServingConfig::dense(1, pp, 1))
        };
        let (host, piped) = (at(&one, 16, 1), at(&two, 16, 2));
        assert_eq!(host.bound, DecodeBound::Compute);
        let gain = piped.tokens_per_s / host.tokens_per_s;
        // Short of 2x: a micro-batch of 8 still reads the stage's weights, and the sends.
        assert!(gain > 1.5 && gain < 2.0, "{gain}");
        // One sequence: nothing to overlap, the stages take turns (and pay the send).
        let gain = at(&two, 1, 2).tokens_per_s / at(&one, 1, 1).tokens_per_s;
        assert!(gain <= 1.0, "{gain}");
        // Memory bound (one sequence's weights dominate): micro-batches read the weights
        // once each, so at 2 sequences pp 2 gains little over one machine.
        let gain = at(&two, 2, 2).tokens_per_s / at(&one, 2, 1).tokens_per_s;
        assert!(gain < 1.3, "{gain}");
    }

    #[test]
    fn single_stream_decode_is_bandwidth_bound() {
        // Llama-2-7B bf16 on one H100: ~13.5 GB of weights at 3.35 TB/s ≈ 4.0 ms/token
        // (+ 0.5 GB of KV cache at 1024 tokens ≈ 0.16 ms). Tolerance 5%.
        let m = model_preset("llama-2-7b").unwrap();
        let c = ClusterSpec::new(accelerator_preset("h100").unwrap(), 1, 8).unwrap();
        let e = estimate_serving(
            &m,
            &c,
            &serve(1, Precision::Bf16),
            &ServingConfig::dense(1, 1, 1),
        );
        assert_eq!(e.bound, DecodeBound::MemoryBandwidth);
        let bytes = 2.0 * m.total_params() as f64 + 2.0 * 32.0 * 4096.0 * 1024.0 * 2.0;
        let expected = bytes / 3350e9;
        assert!((e.time_per_output_token_s / expected - 1.0).abs() < 0.05);
    }

    fn tp1_and_tp2(c: &ClusterSpec, w: &ServingWorkload) -> (ServingEstimate, ServingEstimate) {
        let m = model_preset("smollm2-135m").unwrap();
        let at = |tp| estimate_serving(&m, c, w, &ServingConfig::dense(tp, 1, 1));
        (at(1), at(2))
    }

    #[test]
    fn cpu_rank_threads_each_stream_at_per_core_bandwidth_so_tp2_nearly_halves_decode() {
        // cpu-2core: 25 GB/s per core, 50 GB/s for the machine, so each rank thread
        // streams its shard at 25 GB/s at tp 1 and at tp 2. SmolLM2-135M f32 at tp 1:
        // 538 MB of weights + 47 MB of KV (1024 tokens) / 25 GB/s ≈ 23.4 ms per token.
        let m = model_preset("smollm2-135m").unwrap();
        let c = ClusterSpec::new(accelerator_preset("cpu-2core").unwrap(), 1, 1).unwrap();
        let (t1, t2) = tp1_and_tp2(&c, &serve(1, Precision::Fp32));
        for e in [&t1, &t2] {
            assert_eq!(e.bound, DecodeBound::MemoryBandwidth);
            let rank_bytes = e.memory.weights + e.memory.kv_cache;
            assert!((e.memory_read_s * 25e9 / rank_bytes - 1.0).abs() < 1e-12);
        }
        let floor = 4.0 * m.total_params() as f64 / 25e9;
        assert!(t1.time_per_output_token_s >= floor);
        // The largest tp-2 shard is a bit over half of the model: 5 of 9 query heads,
        // 2 of 3 kv heads (one replicated: 4 held of 3), half the MLP and vocabulary.
        let share =
            (t2.memory.weights + t2.memory.kv_cache) / (t1.memory.weights + t1.memory.kv_cache);
        assert!(share > 0.5 && share < 0.55, "{share}");
        assert!((t2.memory_read_s / t1.memory_read_s - share).abs() < 1e-12);
        // So tp 2 is nearly 2x faster: short of it by the larger shard and the
        // 2 all-reduces per layer.
        assert!(t2.tensor_parallel_comm_s > 0.0);
        let speedup = t1.time_per_output_token_s / t2.time_per_output_token_s;
        assert!(speedup > 1.75 && speedup < 1.0 / share, "{speedup}");
        assert!(t2.tokens_per_s > t1.tokens_per_s);
        // tp=2 replicates one kv head: the machine's memory budget grows.
        assert!(t2.memory_budget_bytes > t1.memory_budget_bytes);
    }

    #[test]
    fn cpu_whose_one_core_saturates_memory_gains_nothing_from_tp() {
        // Hypothetical: one core already draws the machine's 25 GB/s, so 2 threads
        // get 12.5 GB/s each and tp 2 streams the same bytes (plus the replicated
        // kv head) no faster, then pays for its all-reduces.
        let mut a = accelerator_preset("cpu-2core").unwrap();
        a.memory_bandwidth = 25e9;
        a.memory_bandwidth_per_core = Some(25e9);
        let c = ClusterSpec::new(a, 1, 1).unwrap();
        let (t1, t2) = tp1_and_tp2(&c, &serve(1, Precision::Fp32));
        assert_eq!(t2.bound, DecodeBound::MemoryBandwidth);
        assert!(t2.memory_read_s >= t1.memory_read_s);
        assert!(t2.time_per_output_token_s > t1.time_per_output_token_s);
    }

    #[test]
    fn expert_touch_expectation() {
        // One token touches exactly k experts; many tokens touch nearly all.
        assert!((expected_experts_touched(8, 2, 1) - 2.0).abs() < 1e-12);
        assert!(expected_experts_touched(8, 2, 64) > 7.99);
    }

    /// The busiest group's expected touched experts, against every outcome of independent
    /// touches enumerated (exact), and against routing simulated the way tokens pick
    /// experts (top-k distinct experts per token, uniform): within 6%.
    #[test]
    fn the_busiest_expert_group_is_the_expected_maximum() {
        for (experts, groups, q) in [(6, 3, 0.3), (7, 2, 0.5), (8, 4, 0.25), (5, 1, 0.6)] {
            let mut exact = 0.0;
            for outcome in 0u32..1 << experts {
                let p: f64 = (0..experts)
                    .map(|e| if outcome >> e & 1 == 1 { q } else { 1.0 - q })
                    .product();
                let busiest = (0..groups)
                    .map(|g| {
                        // The runtime's balanced split: the first experts % groups one larger.
                        let start: u64 = (0..g)
                            .map(|h| experts / groups + u64::from(h < experts % groups))
                            .sum();
                        let size = experts / groups + u64::from(g < experts % groups);
                        (start..start + size)
                            .filter(|&e| outcome >> e & 1 == 1)
                            .count()
                    })
                    .max()
                    .unwrap_or(0);
                exact += p * busiest as f64;
            }
            let got = expected_busiest_group(experts, groups, q);
            assert!(
                (got - exact).abs() < 1e-12,
                "{experts} {groups} {q}: {got} vs {exact}"
            );
        }
        assert_eq!(expected_busiest_group(8, 2, 1.0), 4.0);
        assert_eq!(expected_busiest_group(8, 2, 0.0), 0.0);
        assert!((expected_busiest_group(8, 1, 0.25) - 2.0).abs() < 1e-12);
        // Mixtral's routing, one token (top-2 of 8) over 2 and 4 groups.
        let mut rng = tp_spec::Rng::new(3);
        for (groups, tokens) in [(2u64, 1u64), (4, 1), (2, 4)] {
            let trials = 20_000;
            let mut total = 0usize;
            for _ in 0..trials {
                let mut touched = [false; 8];
                for _ in 0..tokens {
                    let a = rng.below(8) as usize;
                    let mut b = rng.below(7) as usize;
                    if b >= a {
                        b += 1;
                    }
                    touched[a] = true;
                    touched[b] = true;
                }
                let per = 8 / groups as usize;
                total += touched
                    .chunks(per)
                    .map(|g| g.iter().filter(|&&t| t).count())
                    .max()
                    .unwrap_or(0);
            }
            let simulated = total as f64 / trials as f64;
            let q = expected_experts_touched(8, 2, tokens) / 8.0;
            let predicted = expected_busiest_group(8, groups, q);
            assert!(
                (predicted / simulated - 1.0).abs() < 0.06,
                "{groups} groups, {tokens} tokens: {predicted} vs {simulated}"
            );
        }
    }

    /// Expert parallelism holds the same expert bytes per rank as slicing every expert, but a
    /// step waits for the group its tokens touched most: slower at one sequence, the same
    /// once every expert is touched.
    #[test]
    fn expert_groups_cost_routing_imbalance_until_every_expert_is_busy() {
        let m = model_preset("mixtral-8x7b").unwrap();
        let c = ClusterSpec::new(accelerator_preset("h100").unwrap(), 8, 8).unwrap();
        let at = |concurrency, ep| {
            let config = ServingConfig {
                tp: 8,
                pp: 1,
                dp: 1,
                ep,
            };
            estimate_serving(&m, &c, &serve(concurrency, Precision::Bf16), &config)
        };
        for ep in [2, 4, 8] {
            let (one, sliced) = (at(1, ep), at(1, 1));
            assert_eq!(one.memory.weights, sliced.memory.weights, "ep {ep}");
            assert!(one.time_per_output_token_s > 1.2 * sliced.time_per_output_token_s);
            let (busy, sliced) = (at(256, ep), at(256, 1));
            let ratio = busy.time_per_output_token_s / sliced.time_per_output_token_s;
            assert!((ratio - 1.0).abs() < 1e-6, "ep {ep}: {ratio}");
        }
    }
}
