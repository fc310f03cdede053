//! `tp-comm-mpi-check`: runs the conformance suite on the MPI world (under `mpirun`), or a
//! failure drill (`--drill panic|mismatch|barrier|slow|exit`) that shows R1-R3 errors on the
//! survivors (`--op all_to_all` drills an uneven all_to_all_v instead of all_reduce; its
//! `mismatch` is disagreeing counts); `--bench` times all_reduce, `--no-verify` turns the
//! fingerprint exchange off.

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use tp_comm::mpi::{check, MpiOptions, MpiRuntime};
use tp_comm::{CommError, CommExt, Group, ReduceOp};

const USAGE: &str =
    "usage: tp-comm-mpi-check [--drill panic|mismatch|barrier|slow|exit [--op all_reduce|all_to_all]] \
     [--bench] [--no-verify]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut drill = None;
    let mut bench = false;
    let mut verify = true;
    let mut a2a = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--drill" => drill = it.next().cloned(),
            "--bench" => bench = true,
            "--no-verify" => verify = false,
            "--op" => match it.next().map(String::as_str) {
                Some("all_reduce") => a2a = false,
                Some("all_to_all") => a2a = true,
                other => {
                    eprintln!("unknown --op {other:?}; {USAGE}");
                    return ExitCode::from(2);
                }
            },
            _ => {
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    if let Some(d) = &drill {
        if !["panic", "mismatch", "barrier", "slow", "exit"].contains(&d.as_str()) {
            eprintln!("unknown drill {d:?}; {USAGE}");
            return ExitCode::from(2);
        }
    }
    let opts = MpiOptions {
        timeout: if drill.is_some() {
            Duration::from_secs(2)
        } else {
            Duration::from_secs(60)
        },
        verify,
        ..MpiOptions::default()
    };
    let rt = match check::init("tp-comm-mpi-check", opts) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match (drill, bench) {
        (Some(d), _) => run_drill(&rt, &d, a2a),
        (None, true) => run_bench(&rt),
        (None, false) => run_conformance(&rt),
    }
}

fn run_conformance(rt: &MpiRuntime) -> ExitCode {
    let world = rt.world();
    let t0 = Instant::now();
    let rep = tp_comm::conformance::run(&world);
    println!(
        "rank {}/{}: {} passed, {} failed in {:.2} s",
        world.rank(),
        world.size(),
        rep.passed,
        rep.failed.len(),
        t0.elapsed().as_secs_f64()
    );
    for f in rep.failed.iter().take(20) {
        println!("rank {}: FAILED {f}", world.rank());
    }
    check::totals(&world, rep.passed as u64, rep.failed.len() as u64)
}

/// Medians of all_reduce times at 4 B, 4 KiB and 64 MiB of f32, ours and a plain blocking
/// MPI_Allreduce on the same buffers, interleaved in rounds so both see the same load; then
/// the same for all_to_all (send buffers of 4 KiB, 1 MiB and 64 MiB) against MPI_Alltoall.
fn run_bench(rt: &MpiRuntime) -> ExitCode {
    let world = rt.world();
    if bench_all_reduce(&world) != ExitCode::SUCCESS {
        return ExitCode::FAILURE;
    }
    bench_all_to_all(&world)
}

fn bench_all_to_all(world: &Group) -> ExitCode {
    let n = world.size();
    for (bytes, rounds, per) in [
        (4096usize, 20usize, 100usize),
        (1 << 20, 10, 10),
        (64 << 20, 3, 1),
    ] {
        let count = bytes / 4 / n * n;
        let send = vec![world.rank() as f32; count];
        let mut out = vec![0.0f32; count];
        let medians = interleaved_medians(rounds, per, |ours| {
            if ours {
                world.all_to_all(&send, &mut out)
            } else {
                tp_comm::mpi::plain_all_to_all_f32(&send, &mut out)
            }
        });
        let (ours, plain) = match medians {
            Ok(m) => m,
            Err(e) => {
                eprintln!("rank {}: {e}", world.rank());
                return ExitCode::FAILURE;
            }
        };
        if world.rank() == 0 {
            println!(
                "all_to_all {bytes} B send buffer x{n} ranks: median {ours:.1} us, plain MPI_Alltoall {plain:.1} us ({rounds} rounds of {per})"
            );
        }
    }
    ExitCode::SUCCESS
}

fn bench_all_reduce(world: &Group) -> ExitCode {
    for (bytes, rounds, per) in [
        (4usize, 20usize, 100usize),
        (4096, 20, 100),
        (64 << 20, 3, 1),
    ] {
        let mut buf = vec![1.0f32; bytes / 4];
        let mut out = vec![0.0f32; bytes / 4];
        let medians = interleaved_medians(rounds, per, |ours| {
            if ours {
                world.all_reduce(&mut buf, ReduceOp::Max)
            } else {
                tp_comm::mpi::plain_all_reduce_f32(&buf, &mut out)
            }
        });
        let (ours, plain) = match medians {
            Ok(m) => m,
            Err(e) => {
                eprintln!("rank {}: {e}", world.rank());
                return ExitCode::FAILURE;
            }
        };
        if world.rank() == 0 {
            println!(
                "all_reduce {bytes} B x{} ranks: median {ours:.1} us, plain MPI_Allreduce {plain:.1} us ({rounds} rounds of {per})",
                world.size()
            );
        }
    }
    ExitCode::SUCCESS
}

/// Median microseconds per call of `op(true)` (ours) and `op(false)` (plain MPI), measured in
/// `rounds` alternating rounds of `per` calls each, so both see the same machine.
fn interleaved_medians(
    rounds: usize,
    per: usize,
    mut op: impl FnMut(bool) -> Result<(), CommError>,
) -> Result<(f64, f64), CommError> {
    let (mut ours, mut plain) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        for which in [true, false] {
            let t = Instant::now();
            for _ in 0..per {
                op(which)?;
            }
            let us = t.elapsed().as_secs_f64() / per as f64 * 1e6;
            if which { &mut ours } else { &mut plain }.push(us);
        }
    }
    ours.sort_by(f64::total_cmp);
    plain.sort_by(f64::total_cmp);
    Ok((ours[rounds / 2], plain[rounds / 2]))
}

/// One call of a drill: an all_reduce of `len` f32, or (`a2a`) an all_to_all_v where rank i
/// sends i + j + 1 elements to rank j, plus `len - 4` more on every block (so `len` 5 on one
/// rank makes its counts disagree with every receiver's).
fn drill_call(world: &Group, a2a: bool, len: usize) -> Result<(), CommError> {
    let (me, n) = (world.rank(), world.size());
    if !a2a {
        let mut x = vec![me as f32; len];
        return world.all_reduce(&mut x, ReduceOp::Sum);
    }
    let send_counts: Vec<usize> = (0..n).map(|j| me + j + 1 + len - 4).collect();
    let recv_counts: Vec<usize> = (0..n).map(|i| i + me + 1).collect();
    let send = vec![me as f32; send_counts.iter().sum()];
    let mut recv = vec![0f32; recv_counts.iter().sum()];
    world.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)?;
    let mut at = 0;
    for (i, &c) in recv_counts.iter().enumerate() {
        if recv[at..at + c].iter().any(|&x| x != i as f32) {
            return Err(CommError::Backend(format!(
                "drill: rank {me} got a wrong block from rank {i}"
            )));
        }
        at += c;
    }
    Ok(())
}

/// Rank 1 misbehaves at its 3rd call (panics, calls it with 5 elements instead of 4, calls a
/// barrier instead, sleeps past the 2 s deadline, or returns from main); every other rank prints its error
/// and the result of one more call (refused: the group is poisoned), then the job aborts.
fn run_drill(rt: &MpiRuntime, drill: &str, a2a: bool) -> ExitCode {
    let world = rt.world();
    let me = world.rank();
    for call in 0..5 {
        let mut len = 4;
        let mut barrier = false;
        if me == 1 && call == 2 {
            match drill {
                "panic" => panic!("drill: rank 1 panics before its 3rd call"),
                "mismatch" => len = 5,
                "barrier" => barrier = true,
                "exit" => return ExitCode::SUCCESS,
                _ => std::thread::sleep(Duration::from_secs(4)),
            }
        }
        let out = if barrier {
            world.barrier()
        } else {
            drill_call(&world, a2a, len)
        };
        if let Err(e) = out {
            // One write per rank, staggered by rank: mpirun interleaves concurrent output.
            let mut text = format!("rank {me}: drill {drill}: {e}\n");
            if let Some(fr) = e.flight_record() {
                text.push_str(&format!("rank {me}: flight record:\n{fr}"));
            }
            let mut y = [0f32; 4];
            if let Err(next) = world.all_reduce(&mut y, ReduceOp::Sum) {
                text.push_str(&format!("rank {me}: the next call: {next}\n"));
            }
            std::thread::sleep(Duration::from_millis(60 * me as u64));
            let mut err = std::io::stderr().lock();
            let _ = err.write_all(text.as_bytes());
            let _ = err.flush();
            drop(err);
            // Exit without MPI_Finalize (a peer is gone or desynced, so finalize could
            // hang); mpirun reports the non-zero exit. No MPI_Abort: when an abort races a
            // peer's exit, Open MPI 4.1's mpirun teardown hangs now and then.
            std::thread::sleep(Duration::from_millis(300));
            std::process::exit(3);
        }
    }
    println!("rank {me}: drill {drill} finished without an error");
    ExitCode::FAILURE
}
