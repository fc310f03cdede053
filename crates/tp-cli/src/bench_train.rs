//! `tp bench train`: step time, tokens/s and MFU of training at several (tp, pp, dp)
//! layouts with a fixed global batch (docs/performance.md "train"), against a matmul peak
//! measured in the same run with the same gemm and one thread per rank. Layouts are visited
//! in rounds and each is preceded by a peak probe on as many threads as it has ranks, so a
//! shared, noisy machine shows up in the figures instead of skewing one layout.

use crate::train::{launch, set_compute_threads};
use anyhow::{bail, Context};
use serde::Serialize;
use std::process::ExitCode;
use std::time::Duration;
use tp_comm::{ParallelDims, ProcessGroups};
use tp_engine::launch::Backend;
use tp_train::setup::default_micro_batches;
use tp_train::{
    flops, AdamWConfig, Corpus, ModelConfig, TrainModel, TrainOptions, TrainSpec, Trainer,
};

#[derive(clap::Args, Clone)]
pub struct BenchTrainArgs {
    /// Model: a preset (tiny, small, bench) or an HF Llama config.json.
    #[arg(long, default_value = "bench")]
    config: String,
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
    /// Print one JSON object per layout instead of the table.
    #[arg(long)]
    json: bool,
    /// Deadline of each collective, in seconds.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
}

#[derive(Serialize)]
struct Row {
    tp: usize,
    pp: usize,
    dp: usize,
    ranks: usize,
    micro_batches: usize,
    params: usize,
    tokens_per_step: usize,
    step_s_median: f64,
    step_s_all: Vec<f64>,
    tokens_per_s: f64,
    /// Against the single-core peak measured alone (the definition).
    mfu: f64,
    matmul_peak_gflops: f64,
    /// Median per-rank peak with all of the layout's ranks probing at once.
    concurrent_peak_gflops: f64,
    /// Against that concurrent peak.
    mfu_vs_concurrent_peak: f64,
    final_loss: f64,
}

/// Step times and probe results of one layout, over all rounds.
#[derive(Default)]
struct Samples {
    times: Vec<f64>,
    peaks: Vec<f64>,
    loss: f64,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(0.0)
}

fn parse_layout(s: &str) -> anyhow::Result<ParallelDims> {
    let parts: Vec<usize> = s
        .split('x')
        .map(|p| p.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("layout '{s}': use TPxPPxDP, e.g. 2x1x1"))?;
    match parts.as_slice() {
        &[tp, pp, dp] => Ok(ParallelDims { tp, pp, dp }),
        _ => bail!("layout '{s}': use TPxPPxDP, e.g. 2x1x1"),
    }
}

pub fn run(a: &BenchTrainArgs) -> anyhow::Result<ExitCode> {
    let timeout = Duration::try_from_secs_f64(a.timeout)
        .map_err(|_| anyhow::anyhow!("--timeout must be a positive number of seconds"))?;
    if a.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let layouts = a
        .layouts
        .iter()
        .map(|s| parse_layout(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let threads = set_compute_threads(Some(a.threads.max(1)), 1);
    let model = ModelConfig::from_arg(&a.config)?;
    let text = tp_train::data::DEFAULT_CORPUS;
    let corpus = Corpus::new(text.iter().map(|&b| u32::from(b)).collect(), a.seq, 0)?;
    let peak = flops::measure_matmul_peak(1024, 10)?;
    let tok = tp_train::TextTokenizer::Bytes.json()?;
    if !a.json {
        println!(
            "# tp bench train: model {}, {:.1}M parameters (hidden {}, {} layers, {} heads / {} \
             KV, FFN {}); batch {} x {} tokens; {threads} compute thread(s) per rank; {} round(s) \
             of {} timed step(s) per layout",
            a.config,
            model.num_params() as f64 / 1e6,
            model.hidden,
            model.layers,
            model.heads,
            model.kv_heads,
            model.ffn,
            a.batch,
            a.seq,
            a.rounds.max(1),
            a.steps
        );
        println!(
            "# matmul peak (candle gemm, [1024,1024]x[1024,1024] f32, best of 10, {threads} \
             thread(s)): {:.1} GFLOP/s; MFU = 6 x params x tokens/s / (ranks x peak)",
            peak / 1e9
        );
        println!(
            "# conc_peak: per-rank peak with all the layout's ranks probing at once, just before \
             its steps (median over rounds); MFU_conc is against it"
        );
    }
    let specs = layouts
        .iter()
        .map(|&d| {
            let micro = a
                .micro_batches
                .unwrap_or_else(|| default_micro_batches(a.batch / d.dp.max(1), d.pp));
            let spec = TrainSpec {
                model: model.clone(),
                dims: d,
                steps: a.warmup + a.steps,
                global_batch: a.batch,
                micro_batches: micro,
                seq: a.seq,
                seed: 0,
                optim: AdamWConfig::default(),
                bucket_elems: 4 << 20,
                save_dir: None,
                save_every: 0,
                keep: 0,
                data_name: "built-in corpus".into(),
            };
            spec.validate().map(|_| spec)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut samples: Vec<Samples> = specs.iter().map(|_| Samples::default()).collect();
    for _round in 0..a.rounds.max(1) {
        for (spec, smp) in specs.iter().zip(&mut samples) {
            let ranks = spec.dims.world_size();
            smp.peaks
                .push(flops::measure_concurrent_peak(1024, 5, ranks)?);
            let out = launch(Backend::Local, ranks, timeout, |world| {
                let groups = ProcessGroups::new(world, spec.dims)?;
                let mut t =
                    Trainer::new(spec, groups, &corpus, &tok, None, TrainOptions::default())?;
                let mut times = Vec::new();
                let mut loss = 0.0;
                for i in 0..spec.steps {
                    let r = t.step()?;
                    if i >= a.warmup {
                        times.push(r.seconds);
                    }
                    loss = r.loss;
                }
                Ok((times, loss))
            })?;
            match out {
                Ok(Some((times, loss))) => {
                    smp.times.extend(times);
                    smp.loss = loss;
                }
                Ok(None) => return Ok(ExitCode::SUCCESS),
                Err(failed) => return Ok(failed.into()),
            }
        }
    }
    if !a.json {
        println!(
            "# {:>3} {:>3} {:>3} {:>5} {:>5} {:>11} {:>9} {:>7} {:>10} {:>8}",
            "tp",
            "pp",
            "dp",
            "ranks",
            "micro",
            "step_s(med)",
            "tokens/s",
            "MFU",
            "conc_peak",
            "MFU_conc"
        );
    }
    for (spec, smp) in specs.iter().zip(&samples) {
        let d = spec.dims;
        let med = median(&smp.times);
        let tokens = a.batch * a.seq;
        let tps = tokens as f64 / med.max(1e-9);
        let conc = median(&smp.peaks);
        let row = Row {
            tp: d.tp,
            pp: d.pp,
            dp: d.dp,
            ranks: d.world_size(),
            micro_batches: spec.micro_batches,
            params: model.num_params(),
            tokens_per_step: tokens,
            step_s_median: med,
            step_s_all: smp.times.clone(),
            tokens_per_s: tps,
            mfu: flops::mfu(&model, tps, d.world_size(), peak),
            matmul_peak_gflops: peak / 1e9,
            concurrent_peak_gflops: conc / 1e9,
            mfu_vs_concurrent_peak: flops::mfu(&model, tps, d.world_size(), conc),
            final_loss: smp.loss,
        };
        if a.json {
            println!("{}", serde_json::to_string(&row)?);
        } else {
            println!(
                "  {:>3} {:>3} {:>3} {:>5} {:>5} {:>11.3} {:>9.0} {:>6.1}% {:>10.1} {:>7.1}%",
                row.tp,
                row.pp,
                row.dp,
                row.ranks,
                row.micro_batches,
                row.step_s_median,
                row.tokens_per_s,
                100.0 * row.mfu,
                row.concurrent_peak_gflops,
                100.0 * row.mfu_vs_concurrent_peak
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
