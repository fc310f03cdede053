//! `tp bench collectives`: an nccl-tests-style sweep (sizes 8 B to 256 MiB) of all_reduce,
//! all_gather, reduce_scatter, broadcast and all_to_all, with time, algbw, busbw, a count of wrong
//! results per size, and this machine's memcpy bandwidth measured in the same run.
//!
//! The sweep and its report are tp-comm's (`bench`, `bench_report`); this is its flags. Under
//! `--backend mpi`, all_reduce rows also time a plain blocking `MPI_Allreduce` as the
//! reference column.

use std::process::ExitCode;
use tp_comm::bench::{Op, SweepConfig};
use tp_comm::bench_report::{run_sweep, SweepError};
use tp_comm::fault::FaultPlan;
use tp_comm::launch::{run_ranks, Backend};

#[derive(clap::Args, Clone)]
pub struct BenchArgs {
    /// Ranks for the local backend (under MPI, mpirun's -n decides).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    #[arg(long, default_value_t = Backend::Local, value_parser = crate::model_run::backend_values())]
    backend: Backend,
    /// Operations to run, comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "all_reduce,all_gather,reduce_scatter,broadcast,all_to_all"
    )]
    ops: Vec<Op>,
    /// Smallest size (bytes; K, M, G suffixes allowed).
    #[arg(long, default_value = "8", value_parser = parse_bytes)]
    min_bytes: usize,
    /// Largest size.
    #[arg(long, default_value = "256M", value_parser = parse_bytes)]
    max_bytes: usize,
    /// Size multiplier between steps.
    #[arg(long, default_value_t = 2)]
    factor: usize,
    /// Print one JSON object per line instead of tables.
    #[arg(long)]
    json: bool,
    /// Deadline of each collective, in seconds.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Inject a fault: KIND:RANK@CALL[:SECS], KIND in panic, exit, mismatch, slow, kill
    /// (e.g. `panic:1@5`, `slow:1@3:10`). The command must then end with that error.
    #[arg(long)]
    fault: Option<FaultPlan>,
    /// Timed repetitions per size (the median is reported).
    #[arg(long, default_value_t = 5)]
    samples: usize,
}

fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|v| v.checked_mul(mult))
        .ok_or_else(|| format!("'{s}' is not a size; use bytes with an optional K, M or G suffix"))
}

/// A sweep error in the CLI's words: the flags that change it.
fn sweep_error(e: SweepError) -> anyhow::Error {
    match e {
        SweepError::Comm(c) => c.into(),
        SweepError::FaultNeverFired {
            calls,
            rank,
            at_call,
        } => anyhow::anyhow!(
            "--fault never fired: the sweep made {calls} collective calls on rank {rank} and \
             ended before call {at_call}; give a CALL below {calls} (or more sizes with --max-bytes)"
        ),
    }
}

pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.min_bytes <= args.max_bytes,
        "--min-bytes ({}) is above --max-bytes ({})",
        args.min_bytes,
        args.max_bytes
    );
    anyhow::ensure!(!args.ops.is_empty(), "--ops names no operation");
    let timeout = crate::model_run::seconds("--timeout", args.timeout)?;
    if let Some(plan) = &args.fault {
        if args.backend == Backend::Local && plan.rank >= args.ranks {
            anyhow::bail!(
                "--fault names rank {} but there are only {} ranks (0..{})",
                plan.rank,
                args.ranks,
                args.ranks
            );
        }
    }
    let cfg = SweepConfig {
        ops: args.ops.clone(),
        min_bytes: args.min_bytes,
        max_bytes: args.max_bytes,
        factor: args.factor,
        samples: args.samples,
        reference: args.fault.is_none(),
    };
    let out = run_ranks(args.backend, args.ranks, timeout, |world| {
        let mut cpu = !args.json;
        let print = |text: &str| {
            if std::mem::take(&mut cpu) {
                println!("# CPU: {}", tp_kernels::kernel_report());
            }
            print!("{text}");
        };
        run_sweep(world, &cfg, args.fault.as_ref(), args.json, print).map_err(sweep_error)
    })?;
    match out {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(failed) => Ok(failed.into()),
    }
}
