//! The `tp plan` command line: clap arguments and the `run` entry point that
//! resolves presets/files, plans, and returns the text or JSON to print.

use crate::cluster_file::load_cluster_file;
use crate::gguf::load_gguf;
use crate::hardware::{accelerator_preset, accelerator_preset_names, ClusterSpec};
use crate::hf_config::load_hf_config;
use crate::megatron_table::{compare_with_table1, render_markdown};
use crate::model::ModelSpec;
use crate::model_presets::{model_preset, model_preset_names};
use crate::report::{serving_json, serving_text, training_json, training_text, ReportLimits};
use crate::search::{plan_serving, plan_training};
use crate::workload::{Optimizer, Precision, ServingWorkload, TrainingWorkload};
use crate::PlanError;
use std::path::{Path, PathBuf};

/// Arguments of `tp plan`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// Model preset name, or a path to a Hugging Face config.json or a .gguf file.
    #[arg(long)]
    pub model: Option<String>,
    /// Total devices (GPUs, or machines for a CPU preset).
    #[arg(long)]
    pub gpus: Option<u64>,
    /// Devices per node [default: 8, or 1 for a CPU preset].
    #[arg(long)]
    pub gpus_per_node: Option<u64>,
    /// Accelerator preset.
    #[arg(long, default_value = "h100")]
    pub gpu: String,
    /// TOML cluster file (replaces --gpu/--gpus/--gpus-per-node).
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// Override intra-node bandwidth per device, GB/s.
    #[arg(long)]
    pub intra_node_gbs: Option<f64>,
    /// Override inter-node bandwidth per device, GB/s.
    #[arg(long)]
    pub inter_node_gbs: Option<f64>,
    /// Latency of one message between nodes (CPU machines), e.g. `200us`, `0.2ms`
    /// [default: the accelerator's: 30 us for CPU machines, 10 us for GPU nodes].
    #[arg(long, value_name = "TIME")]
    pub link_latency: Option<String>,
    /// Bandwidth between nodes per device, e.g. `1gbit`, `125MB/s`, or GB/s as a number
    /// (replaces --inter-node-gbs).
    #[arg(long, value_name = "RATE")]
    pub link_bandwidth: Option<String>,
    /// CPU machines: cores (rank threads) per machine [default: the preset's].
    #[arg(long)]
    pub cores: Option<u64>,
    /// Training sequence length.
    #[arg(long, default_value_t = 2048)]
    pub seq: u64,
    /// Training global batch (sequences per step).
    #[arg(long, default_value_t = 512)]
    pub global_batch: u64,
    /// Weight/activation precision [default: bf16; fp32 for CPU serving].
    #[arg(long, value_enum)]
    pub precision: Option<Precision>,
    #[arg(long, value_enum, default_value_t = Optimizer::Adam)]
    pub optimizer: Optimizer,
    /// Shard optimizer state over data-parallel ranks (ZeRO-1).
    #[arg(long)]
    pub distributed_optimizer: bool,
    /// Fused attention: no s×s score activations.
    #[arg(long)]
    pub flash_attention: bool,
    /// Largest micro-batch to consider.
    #[arg(long, default_value_t = 8)]
    pub max_micro_batch: u64,
    /// Plan serving instead of training.
    #[arg(long)]
    pub serve: bool,
    /// Serving: tokens per sequence in the KV cache [default: --seq].
    #[arg(long)]
    pub context: Option<u64>,
    /// Serving: sequences decoded concurrently.
    #[arg(long, default_value_t = 1)]
    pub concurrency: u64,
    /// Serving: target time per output token, milliseconds.
    #[arg(long)]
    pub target_tpot_ms: Option<f64>,
    /// Serving: KV-cache precision [default: --precision].
    #[arg(long, value_enum)]
    pub kv_precision: Option<Precision>,
    /// Layouts to show.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Rejected layouts to show.
    #[arg(long, default_value_t = 20)]
    pub show_rejected: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Print the comparison with Narayanan et al. 2021 Table 1 and exit.
    #[arg(long)]
    pub megatron_table: bool,
    /// Print the comparisons with published runs beyond Megatron 2021 (Korthikanti et al.
    /// 2022 Table 5: sequence parallelism and selective recomputation; Llama 3.1 405B) and
    /// exit.
    #[arg(long)]
    pub published_runs: bool,
    /// List model and accelerator presets and exit.
    #[arg(long)]
    pub list_presets: bool,
    /// Uneven hosts: each host's measured speed in rank order (e.g. decode tokens/s of
    /// `tp bench decode` at tp 1 on each, 25,12); prints the `--rank-weights` to use and exits.
    #[arg(long, value_name = "S0,S1,..", allow_hyphen_values = true)]
    pub host_speeds: Option<String>,
}

impl Default for PlanArgs {
    fn default() -> Self {
        PlanArgs {
            model: None,
            gpus: None,
            gpus_per_node: None,
            gpu: "h100".to_string(),
            cluster: None,
            intra_node_gbs: None,
            inter_node_gbs: None,
            link_latency: None,
            link_bandwidth: None,
            cores: None,
            seq: 2048,
            global_batch: 512,
            precision: None,
            optimizer: Optimizer::Adam,
            distributed_optimizer: false,
            flash_attention: false,
            max_micro_batch: 8,
            serve: false,
            context: None,
            concurrency: 1,
            target_tpot_ms: None,
            kv_precision: None,
            top: 10,
            show_rejected: 20,
            json: false,
            megatron_table: false,
            published_runs: false,
            list_presets: false,
            host_speeds: None,
        }
    }
}

/// A preset name, a `.gguf` file (header only), or a config.json path
/// (anything else ending in `.json` or naming an existing file).
pub fn resolve_model(spec: &str) -> Result<ModelSpec, PlanError> {
    let path = Path::new(spec);
    let lower = spec.to_ascii_lowercase();
    if lower.ends_with(".gguf") {
        return load_gguf(path);
    }
    if lower.ends_with(".json") || path.is_file() {
        return load_hf_config(path);
    }
    model_preset(spec)
}

fn resolve_cluster(args: &PlanArgs) -> Result<ClusterSpec, PlanError> {
    let mut cluster = match &args.cluster {
        Some(_) if args.cores.is_some() => {
            return Err(PlanError::InvalidCluster(
                "--cores with --cluster: set cpu_cores in the cluster file instead".to_string(),
            ))
        }
        Some(path) => load_cluster_file(path)?,
        None => {
            let mut accelerator = accelerator_preset(&args.gpu)?;
            if let Some(n) = args.cores {
                accelerator = accelerator.with_cores(n)?;
            }
            let cpu = matches!(
                accelerator.kind,
                crate::hardware::AcceleratorKind::CpuMachine { .. }
            );
            let gpus = match args.gpus {
                Some(n) => n,
                None if cpu => 1,
                None => {
                    return Err(PlanError::InvalidCluster(
                        "--gpus is required (or give --cluster FILE)".to_string(),
                    ))
                }
            };
            let per_node = args.gpus_per_node.unwrap_or(if cpu { 1 } else { 8 });
            ClusterSpec::new(accelerator, gpus, per_node)?
        }
    };
    if let Some(bw) = args.intra_node_gbs {
        cluster.intra_node_bandwidth = bw * 1e9;
    }
    if let Some(bw) = args.inter_node_gbs {
        cluster.inter_node_bandwidth = bw * 1e9;
    }
    if let Some(text) = &args.link_bandwidth {
        cluster.inter_node_bandwidth = parse_rate(text)?;
    }
    if let Some(text) = &args.link_latency {
        cluster.inter_node_latency_s = parse_duration(text)?;
    }
    cluster.validate()?;
    Ok(cluster)
}

/// `200us`, `0.2ms`, `1s` (a bare number is microseconds) -> seconds.
pub fn parse_duration(text: &str) -> Result<f64, PlanError> {
    let t = text.trim().to_ascii_lowercase();
    let (num, scale) = [("us", 1e-6), ("µs", 1e-6), ("ms", 1e-3), ("s", 1.0)]
        .iter()
        .find_map(|(unit, scale)| t.strip_suffix(unit).map(|n| (n.trim(), *scale)))
        .unwrap_or((t.as_str(), 1e-6));
    match num.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 && v * scale <= 60.0 => Ok(v * scale),
        _ => Err(PlanError::InvalidCluster(format!(
            "link latency {text:?} is not a time: give e.g. 200us, 0.2ms or 1s (0 to 60 s)"
        ))),
    }
}

/// `1gbit`, `100mbit`, `125MB/s`, `1.25GB/s` (a bare number is GB/s) -> bytes/s.
pub fn parse_rate(text: &str) -> Result<f64, PlanError> {
    let t = text.trim().to_ascii_lowercase();
    let units = [
        ("gbit/s", 1e9 / 8.0),
        ("gbit", 1e9 / 8.0),
        ("mbit/s", 1e6 / 8.0),
        ("mbit", 1e6 / 8.0),
        ("gb/s", 1e9),
        ("mb/s", 1e6),
    ];
    let (num, scale) = units
        .iter()
        .find_map(|(unit, scale)| t.strip_suffix(unit).map(|n| (n.trim(), *scale)))
        .unwrap_or((t.as_str(), 1e9));
    match num.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v * scale),
        _ => Err(PlanError::InvalidCluster(format!(
            "link bandwidth {text:?} is not a rate: give e.g. 1gbit, 125MB/s or 1.25 (GB/s)"
        ))),
    }
}

fn list_presets() -> String {
    format!(
        "models: {}\naccelerators: {}\n",
        model_preset_names(),
        accelerator_preset_names()
    )
}

/// Runs `tp plan` and returns what to print.
pub fn run(args: &PlanArgs) -> Result<String, PlanError> {
    if args.list_presets {
        return Ok(list_presets());
    }
    if let Some(text) = &args.host_speeds {
        return crate::rank_weights::report(&crate::rank_weights::parse_speeds(text)?);
    }
    if args.megatron_table {
        let rows = compare_with_table1()?;
        return if args.json {
            Ok(serde_json::to_string_pretty(&rows)?)
        } else {
            Ok(render_markdown(&rows))
        };
    }
    if args.published_runs {
        let rows = crate::korthikanti_table::compare_with_table5()?;
        let llama3 = crate::llama3_run::compare_with_table4()?;
        return if args.json {
            Ok(serde_json::to_string_pretty(&serde_json::json!({
                "korthikanti_2022": rows,
                "llama3_405b": llama3,
            }))?)
        } else {
            Ok(format!(
                "{}\n{}",
                crate::korthikanti_table::render_markdown(&rows),
                crate::llama3_run::render_markdown(&llama3)
            ))
        };
    }
    let model_name = args
        .model
        .as_deref()
        .ok_or_else(|| PlanError::UnknownModelPreset {
            name: String::new(),
            valid: model_preset_names(),
        })?;
    let model = resolve_model(model_name)?;
    let cluster = resolve_cluster(args)?;
    let limits = ReportLimits {
        top: args.top,
        rejected: args.show_rejected,
    };
    if args.serve {
        let default_precision = if cluster.is_cpu() {
            Precision::Fp32
        } else {
            Precision::Bf16
        };
        let weight_precision = args.precision.unwrap_or(default_precision);
        let workload = ServingWorkload {
            context_len: args.context.unwrap_or(args.seq),
            concurrency: args.concurrency,
            target_time_per_token_s: args.target_tpot_ms.map(|ms| ms / 1e3),
            weight_precision,
            kv_precision: args.kv_precision.unwrap_or(weight_precision),
        };
        let plan = plan_serving(&model, &cluster, &workload)?;
        if args.json {
            serving_json(&plan, limits)
        } else {
            Ok(serving_text(&plan, limits))
        }
    } else {
        let workload = TrainingWorkload {
            global_batch: args.global_batch,
            seq_len: args.seq,
            precision: args.precision.unwrap_or(Precision::Bf16),
            optimizer: args.optimizer,
            distributed_optimizer: args.distributed_optimizer,
            flash_attention: args.flash_attention,
            max_micro_batch: args.max_micro_batch,
        };
        let plan = plan_training(&model, &cluster, &workload)?;
        if args.json {
            training_json(&plan, limits)
        } else {
            Ok(training_text(&plan, limits))
        }
    }
}
