//! `tp bench decode`: batch-1 prefill and decode speed at each tp, with the time per token
//! split into compute, all-reduce and waiting for the slowest rank, and decode speed set
//! against the memory-bandwidth limit (weight bytes streamed per token / measured read
//! bandwidth with as many threads as ranks). Under `--backend mpi` it also reports the bytes
//! rank 0 hands to MPI per decoded token (all-reduce payloads, fingerprints, commands).

use crate::model_run::{run_model, ModelArgs, Session};
use anyhow::{bail, Context};
use std::process::ExitCode;
use std::time::Instant;
use tp_engine::report::show_bytes;
use tp_engine::{argmax, ChunkSpec, Command};

#[derive(clap::Args, Clone, Debug)]
pub struct BenchDecodeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// tp sizes to measure, e.g. 1,2.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub tps: Vec<usize>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated per run (greedy; end-of-sequence ignored).
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Runs per tp; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Print one JSON object per tp on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One run's figures.
#[derive(Clone, Debug)]
struct Run {
    prefill_tok_s: f64,
    decode_tok_s: f64,
    /// Per decode token, seconds, of the slowest-computing rank.
    compute: f64,
    all_reduce: f64,
    wait: f64,
    /// Bytes rank 0 sent per decode token (mpi backend only).
    sent_per_token: Option<f64>,
}

/// Bytes this process has sent through MPI so far (None without MPI).
fn mpi_bytes_sent(s: &Session) -> Option<u64> {
    #[cfg(feature = "mpi")]
    if s.worker.group().backend() == "mpi" {
        return Some(tp_comm::mpi::bytes_sent());
    }
    let _ = s;
    None
}

const TEXT: &str = "The history of the world is a story of people, places and ideas. \
Rivers carried boats and trade, cities grew around markets, and writing let merchants keep \
accounts and poets keep songs. ";

pub fn run(args: &BenchDecodeArgs) -> anyhow::Result<ExitCode> {
    if args.tps.is_empty() || args.tps.contains(&0) {
        bail!("--tps needs tp sizes of at least 1, e.g. --tps 1,2");
    }
    if args.prompt_tokens == 0 || args.gen_tokens < 2 || args.repeats == 0 {
        bail!("--prompt-tokens >= 1, --gen-tokens >= 2 and --repeats >= 1 are needed");
    }
    let header_done = std::cell::Cell::new(false);
    for &tp in &args.tps {
        let mut margs = args.model.clone();
        margs.tp = Some(tp);
        margs.quiet = true;
        margs.ctx_size = Some(
            args.model
                .ctx_size
                .unwrap_or(args.prompt_tokens + args.gen_tokens + 1),
        );
        let out = run_model(&margs, |s| {
            let bw = read_bandwidth(tp);
            let mut ids = Vec::new();
            while ids.len() < args.prompt_tokens {
                ids.extend(s.tokenizer.encode(TEXT)?);
            }
            ids.truncate(args.prompt_tokens);
            let local_bytes = s.worker.model().streamed_bytes_per_token();
            let mut runs = Vec::new();
            // One warm-up run, then the measured ones.
            for rep in 0..=args.repeats {
                runs.push(
                    one_run(s, &ids, args.gen_tokens)
                        .with_context(|| format!("run {rep} at tp {tp}"))?,
                );
            }
            runs.remove(0);
            Ok((runs, local_bytes, bw, s.worker.model().formats()))
        })?;
        let (runs, rank0_bytes, bw, formats) = match out {
            Ok(Some(v)) => v,
            Ok(None) => return Ok(ExitCode::SUCCESS), // a follower process under MPI
            Err(failed) => return Ok(failed.into()),
        };
        let med = |f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
        let decode = med(|r| r.decode_tok_s);
        let sent = runs
            .iter()
            .all(|r| r.sent_per_token.is_some())
            .then(|| med(|r| r.sent_per_token.unwrap_or(0.0)));
        // Every rank streams about the same bytes (balanced shards); the total per token is
        // what the whole machine must read.
        let total_bytes = rank0_bytes as f64 * tp as f64;
        let limit = bw / total_bytes;
        if args.json {
            println!(
                "{{\"tp\":{tp},\"prefill_tok_s\":{:.1},\"decode_tok_s\":{decode:.1},\"compute_ms\":{:.3},\"all_reduce_ms\":{:.3},\"wait_ms\":{:.3},\"bytes_per_token\":{total_bytes:.0},\"read_gb_s\":{:.2},\"bandwidth_limit_tok_s\":{limit:.1},\"sent_bytes_per_token_per_rank\":{}}}",
                med(|r| r.prefill_tok_s),
                med(|r| r.compute) * 1e3,
                med(|r| r.all_reduce) * 1e3,
                med(|r| r.wait) * 1e3,
                bw / 1e9,
                sent.map_or_else(|| "null".to_string(), |b| format!("{b:.0}"))
            );
            continue;
        }
        if !header_done.replace(true) {
            println!(
                "# tp bench decode: batch 1, {} prompt + {} generated tokens, median of {} runs, one thread per rank ({} weights, {} head)",
                args.prompt_tokens, args.gen_tokens, args.repeats, formats.0, formats.1
            );
            println!("# CPU: {}", tp_kernels::kernel_report());
            println!(
                "# limit = read bandwidth with tp threads / weight bytes streamed per token; per-token times are per decode step"
            );
            println!(
                "{:>3}  {:>12}  {:>11}  {:>10}  {:>13}  {:>10}  {:>13}  {:>10}  {:>11}  {:>8}  {:>15}",
                "tp",
                "prefill t/s",
                "decode t/s",
                "compute ms",
                "all-reduce ms",
                "waiting ms",
                "bytes/token",
                "read GB/s",
                "limit t/s",
                "of limit",
                "sent/token/rank"
            );
        }
        println!(
            "{:>3}  {:>12.1}  {:>11.1}  {:>10.3}  {:>13.3}  {:>10.3}  {:>13}  {:>10.2}  {:>11.1}  {:>7.0}%  {:>15}",
            tp,
            med(|r| r.prefill_tok_s),
            decode,
            med(|r| r.compute) * 1e3,
            med(|r| r.all_reduce) * 1e3,
            med(|r| r.wait) * 1e3,
            show_bytes(total_bytes as u64),
            bw / 1e9,
            limit,
            decode / limit * 100.0,
            sent.map_or_else(|| "-".to_string(), |b| show_bytes(b as u64))
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Prefill `ids` and decode `gen` tokens greedily on slot 0 (EOS ignored), twice: once plain
/// for the speeds, once with a barrier before each all-reduce for the time split of the
/// decode steps (the barriers cost a little, so speeds come from the plain pass).
fn one_run(s: &mut Session, ids: &[u32], gen: usize) -> anyhow::Result<Run> {
    let mut speeds = (0.0, 0.0);
    let mut split = (0.0, 0.0, 0.0);
    let mut sent = None;
    for barriers in [false, true] {
        s.worker.submit(Command::Open {
            slot: 0,
            capacity: (ids.len() + gen) as u32,
        })?;
        let t = Instant::now();
        let mut token = argmax(&forward(s, ids.to_vec())?);
        let prefill = t.elapsed().as_secs_f64();
        s.worker.submit(Command::ProfileStart { barriers })?;
        let sent0 = mpi_bytes_sent(s);
        let t = Instant::now();
        for _ in 1..gen {
            token = argmax(&forward(s, vec![token])?);
        }
        let decode = t.elapsed().as_secs_f64();
        if !barriers {
            sent = match (sent0, mpi_bytes_sent(s)) {
                (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / (gen - 1) as f64),
                _ => None,
            };
        }
        s.worker.submit(Command::ProfileReport)?;
        s.worker.submit(Command::Close { slot: 0 })?;
        let steps = (gen - 1) as f64;
        if barriers {
            // The rank that computed longest: its waiting is near zero, the others wait for it.
            let slowest = s
                .worker
                .rank_profiles()
                .iter()
                .max_by(|a, b| a.compute_s().total_cmp(&b.compute_s()))
                .cloned()
                .unwrap_or_default();
            let most_wait = s
                .worker
                .rank_profiles()
                .iter()
                .map(|p| p.wait_s)
                .fold(0.0, f64::max);
            split = (
                slowest.compute_s() / steps,
                slowest.comm_s / steps,
                most_wait / steps,
            );
        } else {
            speeds = (ids.len() as f64 / prefill, steps / decode);
        }
    }
    Ok(Run {
        prefill_tok_s: speeds.0,
        decode_tok_s: speeds.1,
        compute: split.0,
        all_reduce: split.1,
        wait: split.2,
        sent_per_token: sent,
    })
}

fn forward(s: &mut Session, tokens: Vec<u32>) -> anyhow::Result<Vec<f32>> {
    s.worker
        .submit(Command::Forward(vec![ChunkSpec::new(0, tokens)]))?
        .context("forward returned no logits")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Aggregate read bandwidth (bytes/s) of `threads` threads each summing its own 128 MiB.
fn read_bandwidth(threads: usize) -> f64 {
    const BYTES: usize = 128 << 20;
    let bufs: Vec<Vec<f32>> = (0..threads)
        .map(|t| vec![t as f32 + 1.0; BYTES / 4])
        .collect();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let barrier = std::sync::Barrier::new(threads);
        let t = Instant::now();
        std::thread::scope(|sc| {
            for b in &bufs {
                let barrier = &barrier;
                sc.spawn(move || {
                    barrier.wait();
                    std::hint::black_box(sum(b));
                });
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    (threads * BYTES) as f64 / best
}

fn sum(v: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for c in v.chunks_exact(16) {
        for i in 0..16 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum()
}
