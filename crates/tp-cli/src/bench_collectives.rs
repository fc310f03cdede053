//! `tp bench collectives`: an nccl-tests-style sweep (sizes 8 B to 256 MiB) of all_reduce,
//! all_gather, reduce_scatter and broadcast, with time, algbw, busbw, a count of wrong
//! results per size, and this machine's memcpy bandwidth measured in the same run.
//!
//! The sweep itself is `tp_comm::bench`; this is its flags and its printing. Under `--backend
//! mpi`, all_reduce rows also time a plain blocking `MPI_Allreduce` as the reference column.

use std::process::ExitCode;
use std::time::Duration;
use tp_comm::bench::{shared_memcpy_bandwidth, sweep, Op, Row, SweepConfig};
use tp_comm::fault::{FaultPlan, Faulty};
use tp_comm::{CommError, Group};
use tp_engine::launch::{run_ranks, Backend};

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
        default_value = "all_reduce,all_gather,reduce_scatter,broadcast"
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

fn run_sweep(world: Group, args: &BenchArgs) -> anyhow::Result<Vec<Row>> {
    // Wrapped first, so a fault's CALL index is the group's sequence number in errors.
    let (g, watch) = match &args.fault {
        Some(plan) => {
            let (g, watch) = Faulty::wrap_watched(world, plan.clone());
            (g, Some((plan, watch)))
        }
        None => (world, None),
    };
    let rows = sweep_on(&g, args)?;
    // A drill whose fault never fired tested nothing: that is a failure, not a success.
    if let Some((plan, watch)) = watch {
        if g.rank() == plan.rank && !watch.reached() {
            anyhow::bail!(
                "--fault never fired: the sweep made {} collective calls on rank {} and ended before call {}; \
                 give a CALL below {} (or more sizes with --max-bytes)",
                watch.calls(),
                plan.rank,
                plan.at_call,
                watch.calls()
            );
        }
    }
    Ok(rows)
}

fn sweep_on(g: &Group, args: &BenchArgs) -> Result<Vec<Row>, CommError> {
    let memcpy = shared_memcpy_bandwidth(g)?;
    if g.rank() == 0 {
        announce(memcpy, args.json);
    }
    let cfg = SweepConfig {
        ops: args.ops.clone(),
        min_bytes: args.min_bytes,
        max_bytes: args.max_bytes,
        factor: args.factor,
        samples: args.samples,
        reference: args.fault.is_none(),
    };
    sweep(g, &cfg, memcpy, |row, first| {
        if g.rank() == 0 {
            print_row(row, args.json, first);
        }
    })
}

fn announce(memcpy: f64, json: bool) {
    if json {
        println!("{}", serde_json::json!({"memcpy_gbs": memcpy / 1e9}));
    } else {
        println!("# CPU: {}", tp_kernels::kernel_report());
        println!(
            "# tp bench collectives: memcpy bandwidth of this machine (1 thread, 64 MiB): {:.2} GB/s copied",
            memcpy / 1e9
        );
        println!("# busbw/cp = busbw as a fraction of that copy bandwidth");
    }
}

fn print_row(row: &Row, json: bool, first_of_op: bool) {
    if json {
        let mut j = serde_json::json!({
            "op": row.op.name(), "ranks": row.ranks, "backend": row.backend, "bytes": row.bytes,
            "count": row.count, "time_us": row.time_us, "algbw_gbs": row.algbw_gbs,
            "busbw_gbs": row.busbw_gbs, "busbw_vs_memcpy": row.busbw_vs_memcpy, "wrong": row.wrong,
        });
        if let (Some(t), Some(b), Some(v)) = (row.ref_time_us, row.ref_busbw_gbs, row.vs_ref) {
            j["ref_time_us"] = t.into();
            j["ref_busbw_gbs"] = b.into();
            j["vs_ref"] = v.into();
        }
        println!("{j}");
        return;
    }
    if first_of_op {
        println!(
            "\n# {}  ranks={} backend={} dtype=f32",
            row.op.name(),
            row.ranks,
            row.backend
        );
        print!(
            "# {:>12} {:>10} {:>11} {:>11} {:>11} {:>9} {:>6}",
            "size(B)", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "busbw/cp", "wrong"
        );
        if row.ref_time_us.is_some() {
            print!(
                " | {:>12} {:>11} {:>7}",
                "MPI time(us)", "MPI busbw", "vs MPI"
            );
        }
        println!();
    }
    print!(
        "  {:>12} {:>10} {:>11.2} {:>11.3} {:>11.3} {:>9.3} {:>6}",
        row.bytes,
        row.count,
        row.time_us,
        row.algbw_gbs,
        row.busbw_gbs,
        row.busbw_vs_memcpy,
        row.wrong
    );
    if let (Some(t), Some(b), Some(v)) = (row.ref_time_us, row.ref_busbw_gbs, row.vs_ref) {
        print!(" | {t:>12.2} {b:>11.3} {v:>7.2}");
    }
    println!();
}

pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.min_bytes <= args.max_bytes,
        "--min-bytes ({}) is above --max-bytes ({})",
        args.min_bytes,
        args.max_bytes
    );
    anyhow::ensure!(!args.ops.is_empty(), "--ops names no operation");
    let timeout = Duration::try_from_secs_f64(args.timeout)
        .ok()
        .filter(|t| !t.is_zero())
        .ok_or_else(|| anyhow::anyhow!("--timeout must be a positive number of seconds"))?;
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
    match run_ranks(args.backend, args.ranks, timeout, |world| {
        run_sweep(world, args)
    })? {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(failed) => Ok(failed.into()),
    }
}
