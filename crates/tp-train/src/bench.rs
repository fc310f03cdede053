//! Training speed at several (tp, pp, dp) layouts with a fixed global batch (what `tp bench
//! train` reports; docs/performance.md "train"): step time, tokens/s and MFU against a matmul
//! peak measured in the same run with the same gemm. Layouts are visited in rounds and each is
//! preceded by a peak probe on as many threads as it has ranks, so a shared, noisy machine
//! shows up in the figures instead of skewing one layout.

use crate::activations::{paper_bytes, trainer_bytes, ActivationLayout};
use crate::config::TrainArch;
use crate::layout::EpRank;
use crate::run::{launch, median};
use crate::setup::default_micro_batches;
use crate::{
    flops, AdamWConfig, Corpus, ModelConfig, Pretrained, Recompute, TrainError, TrainModel,
    TrainOptions, TrainSpec, Trainer,
};
use serde::Serialize;
use std::time::Duration;
use tp_comm::launch::{Backend, LaunchError, RanksFailed};
use tp_comm::{ParallelDims, ProcessGroups};

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// A preset (tiny, small, bench) or an HF config.json.
    pub model: String,
    /// The architecture a preset takes (`llama`, `qwen2`, `qwen3`, `gemma3`, `mixtral`,
    /// `qwen3moe`: [`crate::config::trainable_arch`]); `None`: the preset's or the file's.
    pub arch: Option<String>,
    /// Expert-parallel sizes to measure ([`TrainSpec::ep`]): every layout runs with each that
    /// is valid for it (a divisor of tp, or tp times a divisor of dp); empty: 1.
    pub ep: Vec<usize>,
    /// A pretrained model to start from instead (fine-tuning speed): a GGUF file or an HF
    /// directory.
    pub init: Option<std::path::PathBuf>,
    pub layouts: Vec<ParallelDims>,
    /// Sequences per step (the same for every layout).
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Micro-batches per replica (default: 1 without a pipeline, else about 2 x pp).
    pub micro_batches: Option<usize>,
    /// Model chunks per pipeline rank (interleaved 1F1B) to measure: every layout with
    /// pp > 1 runs with each (the others with 1).
    pub virtual_stages: Vec<usize>,
    /// Untimed steps first.
    pub warmup: u64,
    /// Timed steps per layout and round.
    pub steps: u64,
    /// Rounds over the layouts.
    pub rounds: usize,
    /// Compute threads per rank.
    pub threads: usize,
    /// Shard the optimizer state over dp (the distributed optimizer).
    pub distributed_optimizer: bool,
    /// Deadline of each collective.
    pub timeout: Duration,
    /// Sequence parallelism at every layout.
    pub sequence_parallel: bool,
    /// Activation recomputations to measure: every layout runs with each.
    pub recompute: Vec<Recompute>,
}

/// Why the bench cannot run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error(transparent)]
    Launch(#[from] LaunchError),
}

/// A layout that is not written TPxPPxDP.
#[derive(Debug, thiserror::Error)]
#[error("layout '{0}': use TPxPPxDP, e.g. 2x1x1")]
pub struct BadLayout(pub String);

/// `TPxPPxDP`, e.g. `2x1x1`.
pub fn parse_layout(s: &str) -> Result<ParallelDims, BadLayout> {
    let parts: Vec<usize> = s
        .split('x')
        .map(|p| p.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|_| BadLayout(s.to_string()))?;
    match parts.as_slice() {
        &[tp, pp, dp] => Ok(ParallelDims { tp, pp, dp }),
        _ => Err(BadLayout(s.to_string())),
    }
}

/// One layout's figures (a JSON object per layout with `--json`).
#[derive(Serialize)]
pub struct Row {
    /// The architecture's name (`tp train --arch`'s: `llama`, `mixtral`, ...).
    pub arch: &'static str,
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
    /// Expert-parallel size (1: every expert sliced over tp, or no experts).
    pub ep: usize,
    pub recompute: Recompute,
    pub ranks: usize,
    pub micro_batches: usize,
    /// Model chunks per pipeline rank (interleaved 1F1B when above 1).
    pub virtual_stages: usize,
    /// Rank 0's pipeline bubble, measured (median over the timed steps): the seconds its
    /// forwards and backwards waited in pipeline receives over the seconds they computed.
    pub bubble_measured: f64,
    /// The schedule's bubble with equal stages, `(p - 1) / (v m)` of the ideal step.
    pub bubble_schedule: f64,
    pub params: usize,
    pub tokens_per_step: usize,
    pub step_s_median: f64,
    pub step_s_all: Vec<f64>,
    pub tokens_per_s: f64,
    /// Against the single-core peak measured alone (the definition).
    pub mfu: f64,
    pub matmul_peak_gflops: f64,
    /// Median per-rank peak with all of the layout's ranks probing at once.
    pub concurrent_peak_gflops: f64,
    /// Against that concurrent peak.
    pub mfu_vs_concurrent_peak: f64,
    pub final_loss: f64,
    /// Whether the optimizer state was sharded over dp (the distributed optimizer).
    pub distributed_optimizer: bool,
    /// Rank 0's optimizer arrays (AdamW m, v and f32 master weights), bytes: 12 x the
    /// elements it holds.
    pub optimizer_bytes_rank0: usize,
    /// Activation bytes rank 0 (first pipeline stage, tp rank 0) keeps from forwards to
    /// backwards at its peak, by the formula of this trainer's layer
    /// ([`crate::activations::trainer_bytes`], f32): one micro-batch's bytes times the
    /// micro-batches (chunks, interleaved) its schedule holds at once. `None` for a mixture
    /// of experts, which the formula does not cover.
    pub activation_bytes_formula: Option<f64>,
    /// The same peak by Korthikanti et al.'s formula of a fused GPT layer
    /// ([`crate::activations::paper_bytes`], f32, the layers only).
    pub activation_bytes_paper: f64,
    /// Counted: the block inputs rank 0's one micro-batch keeps under full recomputation
    /// (its stage's chunks, without the embedding's and the head's graphs); full only.
    pub activation_bytes_counted: Option<u64>,
}

/// Step times and probe results of one layout, over all rounds.
#[derive(Default)]
struct Samples {
    times: Vec<f64>,
    peaks: Vec<f64>,
    loss: f64,
    optimizer_bytes: usize,
    /// Rank 0's kept block-input bytes ([`Trainer::kept_input_bytes`]).
    kept: u64,
    /// Rank 0's measured bubble of each timed step ([`Trainer::measured_bubble`]).
    bubbles: Vec<f64>,
}

/// A bench ready to run: the model, every layout's checked spec, and the peak.
pub struct Bench {
    cfg: BenchConfig,
    model: ModelConfig,
    init: Option<Pretrained>,
    specs: Vec<TrainSpec>,
    threads: usize,
    /// Matmul FLOP/s of one rank measured alone.
    peak: f64,
}

impl Bench {
    /// Checks every layout and measures the peak; the caller has given candle `cfg.threads`
    /// compute threads per rank before.
    pub fn new(cfg: BenchConfig) -> Result<Bench, TrainError> {
        let threads = cfg.threads.max(1);
        let init = cfg.init.as_deref().map(Pretrained::open).transpose()?;
        let arch = cfg
            .arch
            .as_deref()
            .map(crate::config::trainable_arch)
            .transpose()?;
        let model = match (&init, arch) {
            (Some(p), Some(a)) if a.name() != TrainArch::of(&p.config).name() => {
                return Err(TrainError::Config(format!(
                    "the architecture {} was asked for, but {} is a {} model",
                    a.name(),
                    p.path.display(),
                    TrainArch::of(&p.config).name()
                )))
            }
            (Some(p), _) => p.config.clone(),
            (None, arch) => crate::setup::requested_model(&cfg.model, arch)?,
        };
        let eps = if cfg.ep.is_empty() {
            vec![1]
        } else {
            cfg.ep.clone()
        };
        // Each expert-parallel size at the layouts it is valid for; one valid for none is
        // an error (the first layout's).
        let mut layouts = Vec::new();
        for &ep in &eps {
            let valid: Vec<_> = cfg
                .layouts
                .iter()
                .filter(|&&d| EpRank::new(&model, ep, d, 0).is_ok())
                .map(|&d| (d, ep))
                .collect();
            if valid.is_empty() {
                if let Some(&d) = cfg.layouts.first() {
                    EpRank::new(&model, ep, d, 0)?;
                }
            }
            layouts.extend(valid);
        }
        // Layouts in the order given, each with its ep sizes in the order given.
        layouts.sort_by_key(|&(d, _)| cfg.layouts.iter().position(|&l| l == d));
        let modes = if cfg.recompute.is_empty() {
            vec![Recompute::None]
        } else {
            cfg.recompute.clone()
        };
        let chunk_counts = if cfg.virtual_stages.is_empty() {
            vec![1]
        } else {
            cfg.virtual_stages.clone()
        };
        let specs = layouts
            .iter()
            .flat_map(|&(d, ep)| modes.iter().map(move |&r| (d, ep, r)))
            .flat_map(|(d, ep, r)| {
                let mut vs: Vec<usize> = chunk_counts
                    .iter()
                    .map(|&v| if d.pp > 1 { v } else { 1 })
                    .collect();
                vs.dedup();
                vs.into_iter().map(move |v| (d, ep, r, v))
            })
            .map(|(d, ep, recompute, virtual_stages)| {
                let micro = cfg.micro_batches.unwrap_or_else(|| {
                    default_micro_batches(cfg.batch / d.dp.max(1), d.pp, virtual_stages)
                });
                let spec = TrainSpec {
                    model: model.clone(),
                    dims: d,
                    steps: cfg.warmup + cfg.steps,
                    global_batch: cfg.batch,
                    micro_batches: micro,
                    virtual_stages,
                    seq: cfg.seq,
                    seed: 0,
                    optim: AdamWConfig::default(),
                    bucket_elems: 4 << 20,
                    distributed_optimizer: cfg.distributed_optimizer,
                    moe_aux_coef: crate::trainer::DEFAULT_MOE_AUX_COEF,
                    ep,
                    moe_capacity: None,
                    moe_bias_rate: None,
                    sequence_parallel: cfg.sequence_parallel,
                    recompute,
                    pack: false,
                    save_dir: None,
                    save_every: 0,
                    keep: 0,
                    data_name: "built-in corpus".into(),
                    val_every: 0,
                };
                spec.validate().map(|_| spec)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let peak = flops::measure_matmul_peak(1024, 10)?;
        Ok(Bench {
            cfg,
            model,
            init,
            specs,
            threads,
            peak,
        })
    }

    /// What is measured and how, as `#` lines.
    pub fn header(&self) -> String {
        let (a, m, threads) = (&self.cfg, &self.model, self.threads);
        format!(
            "# tp bench train: model {}, {:.1}M parameters (hidden {}, {} layers, {} heads / {} \
             KV, FFN {}{}); batch {} x {} tokens; {threads} compute thread(s) per rank; {} round(s) \
             of {} timed step(s) per layout\n\
             # matmul peak (candle gemm, [1024,1024]x[1024,1024] f32, best of 10, {threads} \
             thread(s)): {:.1} GFLOP/s; MFU = 6 x params x tokens/s / (ranks x peak)\n\
             # conc_peak: per-rank peak with all the layout's ranks probing at once, just before \
             its steps (median over rounds); MFU_conc is against it\n\
             # opt_MiB: rank 0's AdamW m, v and f32 master weights (12 bytes x the elements it \
             holds); * = sharded over dp (distributed optimizer{})\n\
             # sequence parallelism: {}\n\
             # act_MiB: activations rank 0 (first stage, tp rank 0) keeps from forwards to \
             backwards at its peak (one micro-batch's times the micro-batches, or interleaved \
             chunks of L/(p v) layers, its schedule holds at once), f32; (f) the formula of this \
             trainer's layer (activations::RankShapes, within 5% of a counting allocator in \
             tests/activation_memory.rs), embedding and head included, - for experts; (p) Korthikanti et al. \
             2022's for a fused GPT layer (layers only, sequence parallelism as run; twice the \
             paper's 2-byte figure); (c) counted: the block inputs one micro-batch keeps under \
             full recomputation on rank 0 (the embedding's and the head's graphs not counted)\n\
             # v: model chunks per pipeline rank (interleaved 1F1B above 1); bubble: rank 0's \
             seconds waiting in pipeline receives over its seconds computing (median), beside \
             the schedule's (p-1)/(v m)",
            match &a.init {
                Some(p) => p.display().to_string(),
                None => a.model.clone(),
            },
            m.num_params() as f64 / 1e6,
            m.hidden,
            m.layers,
            m.heads,
            m.kv_heads,
            m.ffn,
            match m.experts {
                Some(e) => format!(
                    "; {}: {} experts, top-{}; ep: the expert-parallel size, a divisor of tp \
                     (expert groups inside tp) or tp x a divisor of dp (whole experts over \
                     replicas, tokens dispatched by all-to-all)",
                    TrainArch::of(m).name(),
                    e.count,
                    e.per_token
                ),
                None if TrainArch::of(m).name() != "llama" => {
                    format!("; {}", TrainArch::of(m).name())
                }
                None => String::new(),
            },
            a.batch,
            a.seq,
            a.rounds.max(1),
            a.steps,
            self.peak / 1e9,
            if a.distributed_optimizer {
                ": on"
            } else {
                ": off"
            },
            if a.sequence_parallel { "on" } else { "off" }
        )
    }

    /// `#` lines of the activation bytes per layer of each layout's tp with and without
    /// sequence parallelism ([`crate::activations`]), measured on one micro-batch.
    pub fn activation_report(&self) -> Result<String, TrainError> {
        let mut tps: Vec<(usize, usize)> = self
            .specs
            .iter()
            .filter(|s| s.dims.tp > 1)
            .map(|s| (s.dims.tp, s.micro_batch_size()))
            .collect();
        tps.sort_unstable();
        tps.dedup();
        let mut out = String::new();
        for (tp, micro) in tps {
            let a = crate::activations::measure(&self.model, micro, self.cfg.seq, tp)?;
            out.push_str(&a.report());
        }
        Ok(out)
    }

    /// Trains every layout in rounds (its ranks as threads of this process) and gives one row
    /// per layout, or [`RanksFailed`] once the failing ranks have printed their errors.
    pub fn run(&self) -> Result<Result<Option<Vec<Row>>, RanksFailed>, BenchError> {
        let text = crate::data::DEFAULT_CORPUS;
        let corpus = Corpus::new(
            text.iter().map(|&b| u32::from(b)).collect(),
            self.cfg.seq,
            0,
        )?;
        let tok = crate::TextTokenizer::Bytes.json()?;
        let mut samples: Vec<Samples> = self.specs.iter().map(|_| Samples::default()).collect();
        for _round in 0..self.cfg.rounds.max(1) {
            for (spec, smp) in self.specs.iter().zip(&mut samples) {
                let ranks = spec.dims.world_size();
                smp.peaks
                    .push(flops::measure_concurrent_peak(1024, 5, ranks)?);
                let out = launch(Backend::Local, ranks, self.cfg.timeout, |world| {
                    let groups = ProcessGroups::new(world, spec.dims)?;
                    let mut t = Trainer::new(
                        spec,
                        groups,
                        &corpus,
                        &tok,
                        self.init
                            .as_ref()
                            .map_or(crate::Start::Fresh, crate::Start::Init),
                        TrainOptions::default(),
                    )?;
                    let optimizer_bytes = t.optimizer_memory().bytes();
                    let (mut times, mut bubbles) = (Vec::new(), Vec::new());
                    let mut loss = 0.0;
                    for i in 0..spec.steps {
                        let r = t.step()?;
                        if i >= self.cfg.warmup {
                            times.push(r.seconds);
                            bubbles.push(t.measured_bubble());
                        }
                        loss = r.loss;
                    }
                    Ok((times, bubbles, loss, optimizer_bytes, t.kept_input_bytes()))
                })?;
                match out {
                    Ok(Some((times, bubbles, loss, bytes, kept))) => {
                        smp.times.extend(times);
                        smp.bubbles.extend(bubbles);
                        smp.loss = loss;
                        smp.optimizer_bytes = bytes;
                        smp.kept = kept;
                    }
                    Ok(None) => return Ok(Ok(None)),
                    Err(failed) => return Ok(Err(failed)),
                }
            }
        }
        Ok(Ok(Some(
            self.specs
                .iter()
                .zip(samples)
                .map(|(spec, smp)| self.row(spec, smp))
                .collect::<Result<_, _>>()?,
        )))
    }

    fn row(&self, spec: &TrainSpec, smp: Samples) -> Result<Row, TrainError> {
        let d = spec.dims;
        let med = median(smp.times.clone());
        let tokens = self.cfg.batch * self.cfg.seq;
        let tps = tokens as f64 / med.max(1e-9);
        let conc = median(smp.peaks);
        let r = spec.recompute;
        let acts = ActivationLayout {
            dims: d,
            micro_batch: spec.micro_batch_size(),
            seq: spec.seq,
            micro_batches: spec.micro_batches,
            virtual_stages: spec.virtual_stages,
            sequence_parallel: spec.sequence_parallel,
            recompute: r,
        };
        Ok(Row {
            arch: TrainArch::of(&self.model).name(),
            tp: d.tp,
            pp: d.pp,
            dp: d.dp,
            ep: spec.ep,
            recompute: r,
            ranks: d.world_size(),
            micro_batches: spec.micro_batches,
            virtual_stages: spec.virtual_stages,
            bubble_measured: median(smp.bubbles),
            bubble_schedule: (d.pp - 1) as f64 / (spec.virtual_stages * spec.micro_batches) as f64,
            params: self.model.num_params(),
            tokens_per_step: tokens,
            step_s_median: med,
            step_s_all: smp.times,
            tokens_per_s: tps,
            mfu: flops::mfu(&self.model, tps, d.world_size(), self.peak),
            matmul_peak_gflops: self.peak / 1e9,
            concurrent_peak_gflops: conc / 1e9,
            mfu_vs_concurrent_peak: flops::mfu(&self.model, tps, d.world_size(), conc),
            final_loss: smp.loss,
            distributed_optimizer: spec.distributed_optimizer && d.dp > 1,
            optimizer_bytes_rank0: smp.optimizer_bytes,
            activation_bytes_formula: match self.model.experts {
                Some(_) => None,
                None => Some(trainer_bytes(&self.model, &acts)?),
            },
            activation_bytes_paper: paper_bytes(&self.model, &acts)?,
            activation_bytes_counted: (r == Recompute::Full).then_some(smp.kept),
        })
    }
}

const MIB: f64 = (1u64 << 20) as f64;

/// The table of `rows`: a `#` header line, then a line per layout.
pub fn table(rows: &[Row]) -> String {
    // The arch and ep columns where a row is not the dense default (a Llama at ep 1).
    let named = rows.iter().any(|r| r.arch != "llama" || r.ep > 1);
    let arch_ep = |arch: &str, ep: &dyn std::fmt::Display| {
        if named {
            format!("{arch:>8} {ep:>2} ")
        } else {
            String::new()
        }
    };
    let mut s = format!(
        "# {}{:>3} {:>3} {:>3} {:>9} {:>5} {:>5} {:>2} {:>6} {:>8} {:>11} {:>9} {:>7} {:>10} {:>8} {:>9} \
         {:>10} {:>10} {:>10}\n",
        arch_ep("arch", &"ep"),
        "tp",
        "pp",
        "dp",
        "recompute",
        "ranks",
        "micro",
        "v",
        "bubble",
        "(p-1)/vm",
        "step_s(med)",
        "tokens/s",
        "MFU",
        "conc_peak",
        "MFU_conc",
        "opt_MiB",
        "act_MiB(f)",
        "act_MiB(p)",
        "act_MiB(c)"
    );
    for row in rows {
        s.push_str(&format!(
            "  {}{:>3} {:>3} {:>3} {:>9} {:>5} {:>5} {:>2} {:>5.1}% {:>7.1}% {:>11.3} {:>9.0} {:>6.1}% {:>10.1} {:>7.1}% {:>8.2}{} \
             {:>10} {:>10.2} {:>10}\n",
            arch_ep(row.arch, &row.ep),
            row.tp,
            row.pp,
            row.dp,
            format!("{:?}", row.recompute).to_lowercase(),
            row.ranks,
            row.micro_batches,
            row.virtual_stages,
            100.0 * row.bubble_measured,
            100.0 * row.bubble_schedule,
            row.step_s_median,
            row.tokens_per_s,
            100.0 * row.mfu,
            row.concurrent_peak_gflops,
            100.0 * row.mfu_vs_concurrent_peak,
            row.optimizer_bytes_rank0 as f64 / MIB,
            if row.distributed_optimizer { "*" } else { " " },
            row.activation_bytes_formula
                .map_or("-".to_string(), |b| format!("{:.2}", b / MIB)),
            row.activation_bytes_paper / MIB,
            row.activation_bytes_counted
                .map_or("-".to_string(), |b| format!("{:.2}", b as f64 / MIB))
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_tp_x_pp_x_dp() {
        let d = parse_layout("2x1x3").unwrap();
        assert_eq!((d.tp, d.pp, d.dp), (2, 1, 3));
        for bad in ["2x1", "2x1x1x1", "axbxc", ""] {
            let e = parse_layout(bad).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("layout '{bad}': use TPxPPxDP, e.g. 2x1x1")
            );
        }
    }
}
