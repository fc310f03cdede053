//! An nccl-tests-style sweep of the collectives over a group: time, algbw and busbw per size,
//! a count of wrong results (each size is checked once with rank-valued inputs), and this
//! machine's single-thread copy bandwidth as the yardstick. `tp bench collectives` prints it.
//!
//! Definitions follow nccl-tests (its doc/PERFORMANCE.md, github.com/NVIDIA/nccl-tests): size
//! is the full buffer (all_gather: the gathered output; reduce_scatter: the input; all_to_all:
//! one rank's send buffer, a block per rank), algbw = size / time, busbw = algbw x 2(n-1)/n
//! for all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for broadcast.
//! On the MPI world, all_reduce rows also time a plain blocking `MPI_Allreduce` (sum of f32,
//! same sizes and input buffer) as a reference column, and all_to_all rows a plain blocking
//! `MPI_Alltoall`.

use crate::{CommError, CommExt, Group, ReduceOp};
use std::time::Instant;

/// A collective the sweep times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    AllToAll,
}

impl Op {
    pub const ALL: [Op; 5] = [
        Op::AllReduce,
        Op::AllGather,
        Op::ReduceScatter,
        Op::Broadcast,
        Op::AllToAll,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
            Op::AllToAll => "all_to_all",
        }
    }

    /// busbw / algbw for `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }
}

impl std::str::FromStr for Op {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Op::ALL
            .into_iter()
            .find(|op| op.name() == s)
            .ok_or_else(|| {
                format!("unknown operation {s:?}; use all_reduce, all_gather, reduce_scatter, broadcast or all_to_all")
            })
    }
}

/// What to sweep.
#[derive(Clone, Debug)]
pub struct SweepConfig {
    pub ops: Vec<Op>,
    /// Smallest and largest buffer, bytes.
    pub min_bytes: usize,
    pub max_bytes: usize,
    /// Size multiplier between steps (at least 2).
    pub factor: usize,
    /// Timed repetitions per size (the median is reported).
    pub samples: usize,
    /// Also time plain `MPI_Allreduce` / `MPI_Alltoall` on all_reduce / all_to_all rows (MPI
    /// world only; they have no deadline, so leave it off under injected faults).
    pub reference: bool,
}

/// One row of the sweep.
#[derive(Clone, Debug)]
pub struct Row {
    pub op: Op,
    pub ranks: usize,
    pub backend: &'static str,
    pub bytes: usize,
    /// f32 elements of the full buffer.
    pub count: usize,
    pub time_us: f64,
    pub algbw_gbs: f64,
    pub busbw_gbs: f64,
    /// busbw as a fraction of the copy bandwidth.
    pub busbw_vs_memcpy: f64,
    /// Wrong elements over all ranks in the checked call.
    pub wrong: u64,
    /// The plain `MPI_Allreduce` / `MPI_Alltoall` reference (mpi backend, all_reduce and
    /// all_to_all only).
    pub ref_time_us: Option<f64>,
    pub ref_busbw_gbs: Option<f64>,
    /// Our busbw / the reference's (1.0 = as fast as plain MPI).
    pub vs_ref: Option<f64>,
}

/// f32 elements per rank buffer for a size, rounded so every rank gets an equal part.
fn count_for(op: Op, bytes: usize, n: usize) -> usize {
    let c = (bytes / 4).max(1);
    match op {
        Op::AllGather | Op::ReduceScatter | Op::AllToAll => (c / n).max(1) * n,
        _ => c,
    }
}

/// Copy bandwidth of this machine (bytes copied per second, single thread, 64 MiB), median
/// of 7 copies.
pub fn memcpy_bandwidth() -> f64 {
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
        Op::AllToAll => Buffers {
            a: vec![0.0; count],
            b: vec![0.0; count],
        },
    }
}

fn call(g: &Group, op: Op, buf: &mut Buffers) -> Result<(), CommError> {
    match op {
        Op::AllReduce => g.all_reduce(&mut buf.a, ReduceOp::Sum),
        Op::AllGather => g.all_gather(&buf.a, &mut buf.b),
        Op::ReduceScatter => g.reduce_scatter(&buf.a, &mut buf.b, ReduceOp::Sum),
        Op::Broadcast => g.broadcast(&mut buf.a, 0),
        Op::AllToAll => g.all_to_all(&buf.a, &mut buf.b),
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
        // Block j of the output is rank j's block r: its elements r * part.. of its input.
        Op::AllToAll => {
            let part = (buf.b.len() / n).max(1);
            buf.b
                .iter()
                .enumerate()
                .filter(|(i, x)| **x != val(i / part, r * part + i % part))
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

/// The plain `MPI_Allreduce` / `MPI_Alltoall` time of an all_reduce / all_to_all row (mpi
/// backend on the world only).
#[cfg(feature = "mpi")]
fn reference(
    g: &Group,
    op: Op,
    buf: &mut Buffers,
    samples: usize,
) -> Result<Option<f64>, CommError> {
    if !matches!(op, Op::AllReduce | Op::AllToAll) || g.backend() != "mpi" {
        return Ok(None);
    }
    let mut ref_buf = Buffers {
        b: vec![0.0; buf.a.len()],
        a: std::mem::take(&mut buf.a),
    };
    let t = time_calls(g, &mut ref_buf, samples, |b| match op {
        Op::AllToAll => crate::mpi::plain_all_to_all_f32(&b.a, &mut b.b),
        _ => crate::mpi::plain_all_reduce_f32(&b.a, &mut b.b),
    });
    buf.a = ref_buf.a;
    t.map(Some)
}

#[cfg(not(feature = "mpi"))]
fn reference(_: &Group, _: Op, _: &mut Buffers, _: usize) -> Result<Option<f64>, CommError> {
    Ok(None)
}

/// Rank 0 measures the copy bandwidth (bytes per second) while the others wait, then every
/// rank gets it.
pub fn shared_memcpy_bandwidth(world: &Group) -> Result<f64, CommError> {
    let mut memcpy = [0.0f64];
    if world.rank() == 0 {
        memcpy[0] = memcpy_bandwidth();
    }
    world.broadcast(&mut memcpy, 0)?;
    Ok(memcpy[0])
}

/// Runs the sweep on every rank of `g`; `memcpy` is [`shared_memcpy_bandwidth`]'s figure.
/// `on_row` sees each row as it is measured (with whether it is the first of its op).
pub fn sweep(
    g: &Group,
    cfg: &SweepConfig,
    memcpy: f64,
    mut on_row: impl FnMut(&Row, bool),
) -> Result<Vec<Row>, CommError> {
    let n = g.size();
    let mut rows: Vec<Row> = Vec::new();
    for &op in &cfg.ops {
        let mut bytes = cfg.min_bytes.max(4);
        while bytes <= cfg.max_bytes {
            let count = count_for(op, bytes, n);
            let mut buf = buffers(op, count, n);
            let mut wrong = [check(g, op, &mut buf)?];
            g.all_reduce(&mut wrong, ReduceOp::Sum)?;
            let time = time_size(g, op, &mut buf, cfg.samples)?;
            let ref_time = match cfg.reference {
                true => reference(g, op, &mut buf, cfg.samples)?,
                false => None,
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
            on_row(&row, rows.iter().all(|r| r.op != op));
            rows.push(row);
            bytes = match bytes.checked_mul(cfg.factor.max(2)) {
                Some(b) => b,
                None => break,
            };
        }
    }
    Ok(rows)
}
