//! `tp bench collectives`: an nccl-tests-style sweep (sizes 8 B to 256 MiB) of all_reduce,
//! all_gather, reduce_scatter and broadcast, with time, algbw, busbw, a count of wrong
//! results per size, and this machine's memcpy bandwidth measured in the same run.
//!
//! Under `--backend mpi`, all_reduce rows also time a plain blocking `MPI_Allreduce` (sum of
//! f32, straight through MPI's FFI, same process, same sizes and input buffer) as the
//! reference column, with our busbw as a fraction of its busbw.
//!
//! Definitions follow nccl-tests (its doc/PERFORMANCE.md, github.com/NVIDIA/nccl-tests): size is the full buffer (all_gather:
//! the gathered output; reduce_scatter: the input), algbw = size / time, busbw = algbw x
//! 2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter, 1 for broadcast.

use serde::Serialize;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use tp_comm::fault::{FaultPlan, Faulty};
use tp_comm::{CommError, CommExt, Group, ReduceOp};
use tp_engine::launch::{run_ranks, Backend};

#[derive(clap::Args, Clone)]
pub struct BenchArgs {
    /// Ranks for the local backend (under MPI, mpirun's -n decides).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    #[arg(long, default_value_t = Backend::Local)]
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
#[clap(rename_all = "snake_case")]
enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
        }
    }
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter => (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }
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

/// One row of the sweep.
#[derive(Serialize, Clone)]
struct Row {
    op: Op,
    ranks: usize,
    backend: &'static str,
    bytes: usize,
    count: usize,
    time_us: f64,
    algbw_gbs: f64,
    busbw_gbs: f64,
    busbw_vs_memcpy: f64,
    wrong: u64,
    /// The plain `MPI_Allreduce` reference (mpi backend, all_reduce only).
    #[serde(skip_serializing_if = "Option::is_none")]
    ref_time_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ref_busbw_gbs: Option<f64>,
    /// Our busbw / the reference's (1.0 = as fast as plain MPI).
    #[serde(skip_serializing_if = "Option::is_none")]
    vs_ref: Option<f64>,
}

/// f32 elements per rank buffer for a size, rounded so every rank gets an equal part.
fn count_for(op: Op, bytes: usize, n: usize) -> usize {
    let c = (bytes / 4).max(1);
    match op {
        Op::AllGather | Op::ReduceScatter => (c / n).max(1) * n,
        _ => c,
    }
}

/// Copy bandwidth of this machine (bytes copied per second, single thread, 64 MiB), median
/// of 7 copies.
fn memcpy_bandwidth() -> f64 {
    let n = 64 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src);
    let mut times: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    median(&mut times).map_or(0.0, |t| n as f64 / t)
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Buffers for one op at one size, reused across iterations.
struct Buffers {
    a: Vec<f32>,
    b: Vec<f32>,
}

fn buffers(op: Op, count: usize, n: usize) -> Buffers {
    match op {
        Op::AllReduce | Op::Broadcast => Buffers {
            a: vec![0.0; count],
            b: Vec::new(),
        },
        Op::AllGather => Buffers {
            a: vec![0.0; count / n],
            b: vec![0.0; count],
        },
        Op::ReduceScatter => Buffers {
            a: vec![0.0; count],
            b: vec![0.0; count / n],
        },
    }
}

fn call(g: &Group, op: Op, buf: &mut Buffers) -> Result<(), CommError> {
    match op {
        Op::AllReduce => g.all_reduce(&mut buf.a, ReduceOp::Sum),
        Op::AllGather => g.all_gather(&buf.a, &mut buf.b),
        Op::ReduceScatter => g.reduce_scatter(&buf.a, &mut buf.b, ReduceOp::Sum),
        Op::Broadcast => g.broadcast(&mut buf.a, 0),
    }
}

/// One checked call with rank-valued inputs; returns the number of wrong elements here.
fn check(g: &Group, op: Op, buf: &mut Buffers) -> Result<u64, CommError> {
    let (r, n) = (g.rank(), g.size());
    let val = |rank: usize, i: usize| ((rank + 1) * (i % 7 + 1)) as f32;
    for (i, x) in buf.a.iter_mut().enumerate() {
        *x = val(r, i);
    }
    call(g, op, buf)?;
    let total = (n * (n + 1) / 2) as f32;
    let wrong = match op {
        Op::AllReduce => buf
            .a
            .iter()
            .enumerate()
            .filter(|(i, x)| **x != (i % 7 + 1) as f32 * total)
            .count(),
        Op::Broadcast => buf
            .a
            .iter()
            .enumerate()
            .filter(|(i, x)| **x != val(0, *i))
            .count(),
        Op::AllGather => {
            let part = buf.a.len();
            buf.b
                .iter()
                .enumerate()
                .filter(|(i, x)| **x != val(i / part.max(1), i % part.max(1)))
                .count()
        }
        Op::ReduceScatter => {
            let part = buf.b.len();
            buf.b
                .iter()
                .enumerate()
                .filter(|(i, x)| **x != ((r * part + i) % 7 + 1) as f32 * total)
                .count()
        }
    };
    // Leave zeros behind so timed repetitions do not grow towards infinity.
    buf.a.iter_mut().for_each(|x| *x = 0.0);
    Ok(wrong as u64)
}

/// Times one size: fixed warm-up calls, an iteration count agreed by all ranks (rank 0 picks
/// it from 5 trial calls so a sample takes ~20 ms), then `samples` timed runs; each sample is
/// the slowest rank's time. Every rank makes the same number of calls.
fn time_size(g: &Group, op: Op, buf: &mut Buffers, samples: usize) -> Result<f64, CommError> {
    time_calls(g, buf, samples, |b| call(g, op, b))
}

/// [`time_size`] for any call made by every rank (the reference column uses it too).
fn time_calls(
    g: &Group,
    buf: &mut Buffers,
    samples: usize,
    mut call: impl FnMut(&mut Buffers) -> Result<(), CommError>,
) -> Result<f64, CommError> {
    for _ in 0..3 {
        call(buf)?;
    }
    let t = Instant::now();
    for _ in 0..5 {
        call(buf)?;
    }
    let one = (t.elapsed().as_secs_f64() / 5.0).max(1e-7);
    let mut iters = [((0.02 / one) as u64).clamp(1, 20_000)];
    g.broadcast(&mut iters, 0)?;
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples.max(1) {
        g.barrier()?;
        let t = Instant::now();
        for _ in 0..iters[0] {
            call(buf)?;
        }
        let mut el = [t.elapsed().as_secs_f64()];
        g.all_reduce(&mut el, ReduceOp::Max)?;
        times.push(el[0] / iters[0] as f64);
    }
    Ok(median(&mut times).unwrap_or(f64::NAN))
}

/// The plain `MPI_Allreduce` time of an all_reduce row (mpi backend on the world only).
#[cfg(feature = "mpi")]
fn reference(
    g: &Group,
    op: Op,
    buf: &mut Buffers,
    samples: usize,
) -> Result<Option<f64>, CommError> {
    if op != Op::AllReduce || g.backend() != "mpi" {
        return Ok(None);
    }
    let mut ref_buf = Buffers {
        b: vec![0.0; buf.a.len()],
        a: std::mem::take(&mut buf.a),
    };
    let t = time_calls(g, &mut ref_buf, samples, |b| {
        tp_comm::mpi::plain_all_reduce_f32(&b.a, &mut b.b)
    });
    buf.a = ref_buf.a;
    t.map(Some)
}

#[cfg(not(feature = "mpi"))]
fn reference(_: &Group, _: Op, _: &mut Buffers, _: usize) -> Result<Option<f64>, CommError> {
    Ok(None)
}

/// Rank 0 measures the copy bandwidth while the others wait, then shares it and prints the
/// header.
fn measure_and_announce(world: &Group, json: bool) -> Result<f64, CommError> {
    let mut memcpy = [0.0f64];
    if world.rank() == 0 {
        memcpy[0] = memcpy_bandwidth();
    }
    world.broadcast(&mut memcpy, 0)?;
    if world.rank() == 0 {
        if json {
            println!("{}", serde_json::json!({"memcpy_gbs": memcpy[0] / 1e9}));
        } else {
            println!("# CPU: {}", tp_kernels::kernel_report());
            println!(
                "# tp bench collectives: memcpy bandwidth of this machine (1 thread, 64 MiB): {:.2} GB/s copied",
                memcpy[0] / 1e9
            );
            println!("# busbw/cp = busbw as a fraction of that copy bandwidth");
        }
    }
    Ok(memcpy[0])
}

fn sweep(world: Group, args: &BenchArgs) -> anyhow::Result<Vec<Row>> {
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
    let g = g.clone();
    let memcpy = measure_and_announce(&g, args.json)?;
    let n = g.size();
    let mut rows = Vec::new();
    for &op in &args.ops {
        let mut bytes = args.min_bytes.max(4);
        while bytes <= args.max_bytes {
            let count = count_for(op, bytes, n);
            let mut buf = buffers(op, count, n);
            let mut wrong = [check(&g, op, &mut buf)?];
            g.all_reduce(&mut wrong, ReduceOp::Sum)?;
            let time = time_size(&g, op, &mut buf, args.samples)?;
            // Not under an injected fault: the plain call has no deadline.
            let ref_time = match args.fault {
                None => reference(&g, op, &mut buf, args.samples)?,
                Some(_) => None,
            };
            let size = count * 4;
            let algbw = size as f64 / time / 1e9;
            let busbw = algbw * op.bus_factor(n);
            let ref_busbw = ref_time.map(|t| size as f64 / t / 1e9 * op.bus_factor(n));
            let row = Row {
                op,
                ranks: n,
                backend: g.backend(),
                bytes: size,
                count,
                time_us: time * 1e6,
                algbw_gbs: algbw,
                busbw_gbs: busbw,
                busbw_vs_memcpy: busbw * 1e9 / memcpy,
                wrong: wrong[0],
                ref_time_us: ref_time.map(|t| t * 1e6),
                ref_busbw_gbs: ref_busbw,
                vs_ref: ref_busbw.map(|r| busbw / r),
            };
            if g.rank() == 0 {
                print_row(&row, args.json, rows.iter().all(|r: &Row| r.op != op));
            }
            rows.push(row);
            bytes = match bytes.checked_mul(args.factor.max(2)) {
                Some(b) => b,
                None => break,
            };
        }
    }
    Ok(rows)
}

fn print_row(row: &Row, json: bool, first_of_op: bool) {
    if json {
        println!("{}", serde_json::to_string(row).unwrap_or_default());
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
        sweep(world, args)
    })? {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(failed) => Ok(failed.into()),
    }
}
