//! `tp train`: trains a Llama, Qwen2, Qwen3 or Gemma-3 model with tensor, pipeline and data parallelism
//! (tp-train's `run::Job`). Validates everything on the main thread first (data, config,
//! layout, checkpoint checksums), then starts the ranks; rank 0 shows progress with loss,
//! tokens/s and MFU, and the run ends with a checkpoint and a loss curve beside it.

use anyhow::Context;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tp_comm::launch::{leads, Backend};
use tp_comm::ParallelDims;
use tp_train::checkpoint::{SaveHook, SavePoint};
use tp_train::run::Job;
use tp_train::setup::{compute_threads, prepare, RunRequest};
use tp_train::{StepReport, TrainError, TrainOptions};

#[derive(clap::Args, Clone)]
pub struct TrainArgs {
    /// Tensor-parallel ranks: every layer is split over them.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Pipeline stages: the layers are split into this many consecutive groups.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Data-parallel replicas: each takes a share of every batch.
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Model: a preset (tiny, small, bench) or an HF Llama, Qwen2, Qwen3 or Gemma-3 config.json
    /// [default: tiny, or the checkpoint's model with --resume].
    #[arg(long)]
    pub config: Option<String>,
    /// Fine-tune a pretrained model: a GGUF file (dequantized to f32) or an HF directory.
    /// Its config, weights and tokenizer are used (a Llama, Qwen2, Qwen3 or Gemma-3, or a
    /// Mixtral or Qwen3-MoE).
    #[arg(long, conflicts_with_all = ["config", "resume"])]
    pub init: Option<PathBuf>,
    /// Architecture of a preset: llama; qwen2 (adds biases to Q, K and V); qwen3 (adds an RMSNorm over each query and key head);
    /// gemma3 (adds those and Gemma-3's block: GeGLU, post norms, scaled embeddings, a
    /// sliding window on every other layer); mixtral, qwen3moe (llama's, qwen3's with every
    /// MLP a mixture of 8 experts of the preset's FFN width, top-2) [default: llama; a
    /// config.json or checkpoint gives its own].
    #[arg(long)]
    pub arch: Option<String>,
    /// Training data: a text file, or a `.jsonl` file of chat conversations (one
    /// `{"messages": [{"role": .., "content": ..}, ..]}` a line), rendered with the model's
    /// chat template, one a sequence, the loss on the assistant's replies only [default: the
    /// built-in public-domain corpus].
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Hold out one sequence (or conversation) in N as a validation split (0 = none).
    #[arg(long, default_value_t = 0)]
    pub held_out: u64,
    /// Validation loss on the held-out split every N steps (and after the last).
    #[arg(long, default_value_t = 10)]
    pub val_every: u64,
    /// A tokenizer.json (or a model directory holding one) [default: bytes, vocab 256].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Train until this many optimizer steps are done (a resumed run counts its earlier steps).
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    /// Sequences per step over all replicas [default: 8, or the checkpoint's].
    #[arg(long)]
    pub batch: Option<usize>,
    /// Micro-batches per step on each replica (pipeline depth) [default: 1 without a
    /// pipeline, else about 2 x pp].
    #[arg(long)]
    pub micro_batches: Option<usize>,
    /// Model chunks per pipeline rank: the interleaved 1F1B schedule (Narayanan et al. 2021
    /// §2.2.2), a V times smaller pipeline bubble for V times the sends. Needs pp > 1, a layer
    /// for each of the pp x V chunks and micro-batches a multiple of pp.
    #[arg(long, default_value_t = 1)]
    pub virtual_stages: usize,
    /// Tokens per sequence [default: 128, or the checkpoint's].
    #[arg(long)]
    pub seq: Option<usize>,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Final learning rate of the cosine decay [default: lr / 10].
    #[arg(long)]
    pub min_lr: Option<f64>,
    /// Linear warm-up steps.
    #[arg(long, default_value_t = 20)]
    pub warmup: u64,
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// Clip gradients to this global L2 norm (0 = off).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f64,
    /// Seed of the initialization and the data order [default: 0, or the checkpoint's].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Directory for checkpoints and the loss curve.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Save every N steps (0 = only at the end).
    #[arg(long, default_value_t = 0)]
    pub save_every: u64,
    /// Step directories to keep (0 = all).
    #[arg(long, default_value_t = 2)]
    pub keep: usize,
    /// Continue from a checkpoint (a --save directory or one of its step directories), at
    /// any tp, pp or dp.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    #[arg(long, default_value_t = Backend::Local, value_parser = crate::model_run::backend_values())]
    pub backend: Backend,
    /// Deadline of each collective, in seconds.
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
    /// Compute threads per rank [default: the cores shared out among the ranks].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Data-parallel all-reduce bucket size, MiB.
    #[arg(long, default_value_t = 16.0)]
    pub bucket_mib: f64,
    /// Weight of the load-balancing loss of a mixture of experts (the Switch Transformer's
    /// alpha; 0 turns it off).
    #[arg(long, default_value_t = tp_train::DEFAULT_MOE_AUX_COEF)]
    pub moe_aux_loss_coeff: f64,
    /// Expert-parallel size of a mixture of experts: a divisor of --tp gives expert groups
    /// inside the tp group (1: every expert sliced over tp); --tp times a divisor of --dp
    /// gives whole experts over that many data-parallel replicas, tokens sent to them by
    /// all-to-all (docs/moe.md).
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
    /// Mixture of experts: each expert takes at most ceil(F x tokens x top-k / experts) of a
    /// micro-batch's (token, expert) pairs, the later ones dropped and counted in the step
    /// report (GShard's capacity factor, a number above 0) [default: no token is dropped].
    #[arg(long, value_name = "F", value_parser = crate::model_run::parse_capacity_factor)]
    pub moe_capacity_factor: Option<tp_models::CapacityFactor>,
    /// Mixture of experts: the aux-loss-free load-balancing bias (DeepSeek-V3): a per-expert
    /// bias on the router's top-k choice (not its weights), moved by this rate after each
    /// step towards balance, saved in checkpoints; 0 reports the imbalance without moving
    /// it (DeepSeek-V3 used 0.001) [default: off].
    #[arg(long, value_name = "U")]
    pub moe_bias_update_rate: Option<f64>,
    /// Megatron's distributed optimizer (ZeRO-1): AdamW's moments and master weights sharded
    /// over the dp replicas (gradients reduce-scattered, weights all-gathered); the same
    /// training with dp times less optimizer memory per rank (with --ep over replicas, a
    /// rank's experts sharded over the replicas holding them). Checkpoints resume either way.
    #[arg(long)]
    pub distributed_optimizer: bool,
    /// Sequence parallelism (Megatron, Korthikanti et al. 2022): the norms and residual adds
    /// hold seq/tp positions per tp rank (--seq must divide by --tp).
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Activation recomputation (Korthikanti et al. 2022): none; selective: the backward
    /// recomputes each attention core (scores, softmax, weighted sum of V) instead of keeping
    /// it; full: each layer keeps only its input and is recomputed. Same losses, less memory.
    #[arg(long, value_enum, default_value = "none")]
    pub recompute: tp_train::Recompute,
    /// Pack several conversations into each sequence (chat --data): each token keeps its
    /// position in its conversation and attends within it only; padding only at the end.
    #[arg(long)]
    pub pack: bool,
    /// Print one JSON object per step on stdout instead of the progress bar.
    #[arg(long)]
    pub json: bool,
    /// Drill: abort the process at a point of the save of a step (STEP:part:FILE,
    /// STEP:file:FILE, STEP:renamed), to check that the previous checkpoint survives.
    #[arg(long, hide = true)]
    pub crash_during_save: Option<String>,
}

impl TrainArgs {
    /// The run these flags ask for.
    fn request(&self) -> RunRequest {
        RunRequest {
            dims: ParallelDims {
                tp: self.tp,
                pp: self.pp,
                dp: self.dp,
            },
            config: self.config.clone(),
            init: self.init.clone(),
            arch: self.arch.clone(),
            data: self.data.clone(),
            tokenizer: self.tokenizer.clone(),
            steps: self.steps,
            batch: self.batch,
            micro_batches: self.micro_batches,
            virtual_stages: self.virtual_stages,
            seq: self.seq,
            lr: self.lr,
            min_lr: self.min_lr,
            warmup: self.warmup,
            weight_decay: self.weight_decay,
            clip: self.clip,
            seed: self.seed,
            save: self.save.clone(),
            save_every: self.save_every,
            keep: self.keep,
            resume: self.resume.clone(),
            bucket_mib: self.bucket_mib,
            moe_aux_coef: self.moe_aux_loss_coeff,
            ep: self.ep,
            moe_capacity: self.moe_capacity_factor,
            moe_bias_rate: self.moe_bias_update_rate,
            distributed_optimizer: self.distributed_optimizer,
            sequence_parallel: self.sequence_parallel,
            recompute: self.recompute,
            pack: self.pack,
            held_out: self.held_out,
            val_every: self.val_every,
        }
    }
}

fn crash_hook(spec: &str) -> anyhow::Result<SaveHook> {
    let (step, point) = spec
        .split_once(':')
        .context("--crash-during-save takes STEP:POINT, e.g. 10:part:model.safetensors")?;
    let step: u64 = step.parse().context("--crash-during-save: bad step")?;
    let point = point.to_string();
    Ok(Arc::new(move |s: u64, p: SavePoint<'_>| {
        let here = match p {
            SavePoint::PartWritten { file } => format!("part:{file}"),
            SavePoint::FileWritten { file } => format!("file:{file}"),
            SavePoint::Renamed => "renamed".into(),
            SavePoint::LatestWritten => "latest".into(),
        };
        if s == step && here == point {
            eprintln!("drill: aborting the process during the save of step {s} at {here}");
            std::process::abort();
        }
        Ok::<(), TrainError>(())
    }))
}

pub fn run(a: &TrainArgs) -> anyhow::Result<ExitCode> {
    let timeout = Duration::try_from_secs_f64(a.timeout)
        .map_err(|_| anyhow::anyhow!("--timeout must be a positive number of seconds"))?;
    let p = prepare(&a.request())?;
    let threads = set_compute_threads(a.threads, Job::local_ranks(&p, a.backend));
    let job = Job::new(&p, a.backend, threads)?;
    if leads(a.backend) {
        eprintln!("{}", job.header());
    }
    let opts = TrainOptions {
        save_hook: a.crash_during_save.as_deref().map(crash_hook).transpose()?,
    };
    let start = p.resume.as_ref().map_or(0, |c| c.state.step);
    let tty = std::io::stderr().is_terminal() && !a.json;
    let bar = tty.then(|| {
        let b = indicatif::ProgressBar::new(p.spec.steps);
        b.set_position(start);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "step {pos}/{len} [{bar:30.cyan/blue}] {msg} (eta {eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b
    });
    let every = (p.spec.steps / 20).max(1);
    let progress = |r: &StepReport| {
        let f = job.step(r);
        if a.json {
            println!(
                "{}",
                serde_json::json!({
                    "step": r.step, "loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr,
                    "tokens": r.tokens, "seconds": r.seconds, "tokens_per_s": f.tokens_per_s,
                    "mfu": f.mfu, "aux_loss": r.aux_loss, "val_loss": r.val_loss,
                    "expert_rows": r.expert_rows,
                    "moe_dropped": r.moe_dropped, "moe_imbalance": r.moe_imbalance,
                })
            );
        } else if let Some(b) = &bar {
            b.set_position(r.step);
            b.set_message(f.line);
        } else if r.step.is_multiple_of(every) || r.step == p.spec.steps || r.val_loss.is_some() {
            println!("step {}/{} {}", r.step, p.spec.steps, f.line);
        }
        if let (Some(v), false) = (r.val_loss, a.json) {
            let line = format!("step {}/{} validation loss {v:.4}", r.step, p.spec.steps);
            match &bar {
                Some(b) => b.println(line),
                None => println!("{line}"),
            }
        }
    };
    let out = job.run(timeout, &opts, &progress)?;
    if let Some(b) = &bar {
        b.finish();
    }
    match out {
        Ok(Some(summary)) => job.summary(&summary).iter().for_each(|l| println!("{l}")),
        Ok(None) => {}
        Err(failed) => return Ok(failed.into()),
    }
    Ok(ExitCode::SUCCESS)
}

/// Gives each rank `threads` compute threads, or shares the cores out among the ranks of this
/// process (and, under mpirun, the processes on this node); returns the per-rank count. Set
/// here, before any rank starts: candle's matmul reads `RAYON_NUM_THREADS` at every call.
pub(crate) fn set_compute_threads(threads: Option<usize>, local_ranks: usize) -> usize {
    let count = |var: &str| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
    };
    let n = compute_threads(
        threads,
        count("RAYON_NUM_THREADS"),
        local_ranks,
        count("OMPI_COMM_WORLD_LOCAL_SIZE").unwrap_or(1),
    );
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    n
}
