//! `tp bench train`: step time, tokens/s and MFU of training at several (tp, pp, dp)
//! layouts with a fixed global batch; the measuring and the table are tp-train's `bench`.

use anyhow::bail;
use std::process::ExitCode;
use std::time::Duration;
use tp_train::bench::{parse_layout, table, Bench, BenchConfig};

#[derive(clap::Args, Clone)]
pub struct BenchTrainArgs {
    /// Model: a preset (tiny, small, bench) or an HF Llama config.json.
    #[arg(long, default_value = "bench")]
    config: String,
    /// Architecture of the preset, as `tp train --arch`: llama, qwen2, qwen3, gemma3, or the
    /// mixtures of experts mixtral and qwen3moe (8 experts of the preset's FFN, top-2)
    /// [default: llama; a config.json gives its own].
    #[arg(long)]
    arch: Option<String>,
    /// Expert-parallel sizes, comma separated (as `tp train --ep`): every layout runs with
    /// each that is valid for it (a divisor of its tp, or tp times a divisor of its dp:
    /// whole experts over replicas, tokens dispatched by all-to-all).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    ep: Vec<usize>,
    /// Measure fine-tuning instead: start from this pretrained model (a GGUF file or an HF
    /// directory; the data stays the built-in corpus as bytes, which any vocabulary holds).
    #[arg(long, conflicts_with = "config")]
    init: Option<std::path::PathBuf>,
    /// Layouts to measure, TPxPPxDP, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1x1x1,2x1x1,1x2x1")]
    layouts: Vec<String>,
    /// Sequences per step (the same for every layout).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Micro-batches per replica [default: 1 without a pipeline, else about 2 x pp].
    #[arg(long)]
    micro_batches: Option<usize>,
    /// Model chunks per pipeline rank, comma separated: every layout with pp > 1 runs with
    /// each (the interleaved 1F1B schedule above 1, as `tp train --virtual-stages`);
    /// micro-batches must then be a multiple of pp.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    virtual_stages: Vec<usize>,
    /// Untimed steps first (allocation, page faults).
    #[arg(long, default_value_t = 1)]
    warmup: u64,
    /// Timed steps per layout and round (the median over all rounds is reported).
    #[arg(long, default_value_t = 2)]
    steps: u64,
    /// Rounds over the layouts.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Compute threads per rank (MFU is per rank against a one-thread peak when 1).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Shard the optimizer state over dp (the distributed optimizer, as `tp train
    /// --distributed-optimizer`).
    #[arg(long)]
    distributed_optimizer: bool,
    /// Sequence parallelism at every layout (--seq must divide by each tp); the header also
    /// gives the activation bytes per layer with and without it.
    #[arg(long)]
    sequence_parallel: bool,
    /// Print one JSON object per layout instead of the table.
    #[arg(long)]
    json: bool,
    /// Deadline of each collective, in seconds.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
    /// Activation recomputation, comma separated: every layout runs with each (none,
    /// selective: the attention cores, full: every layer from its input).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "none")]
    recompute: Vec<tp_train::Recompute>,
}

pub fn run(a: &BenchTrainArgs) -> anyhow::Result<ExitCode> {
    let timeout = Duration::try_from_secs_f64(a.timeout)
        .map_err(|_| anyhow::anyhow!("--timeout must be a positive number of seconds"))?;
    if a.steps == 0 {
        bail!("--steps must be at least 1");
    }
    crate::train::set_compute_threads(Some(a.threads.max(1)), 1);
    let bench = Bench::new(BenchConfig {
        model: a.config.clone(),
        arch: a.arch.clone(),
        ep: a.ep.clone(),
        init: a.init.clone(),
        layouts: a
            .layouts
            .iter()
            .map(|s| parse_layout(s))
            .collect::<Result<_, _>>()?,
        batch: a.batch,
        seq: a.seq,
        micro_batches: a.micro_batches,
        virtual_stages: a.virtual_stages.clone(),
        warmup: a.warmup,
        steps: a.steps,
        rounds: a.rounds,
        threads: a.threads,
        distributed_optimizer: a.distributed_optimizer,
        timeout,
        sequence_parallel: a.sequence_parallel,
        recompute: a.recompute.clone(),
    })?;
    if !a.json {
        println!("{}", bench.header());
        print!("{}", bench.activation_report()?);
    }
    let rows = match bench.run()? {
        Ok(Some(rows)) => rows,
        Ok(None) => return Ok(ExitCode::SUCCESS),
        Err(failed) => return Ok(failed.into()),
    };
    if a.json {
        for row in &rows {
            println!("{}", serde_json::to_string(row)?);
        }
    } else {
        print!("{}", table(&rows));
    }
    Ok(ExitCode::SUCCESS)
}
