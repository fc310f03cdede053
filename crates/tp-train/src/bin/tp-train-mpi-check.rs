//! Under mpirun: 20 training steps of the fixture model at every layout whose size is the
//! number of processes (tp2 x pp2, tp2 x dp2, pp2 x dp2, tp4, pp4, dp4 at 4 processes; tp3
//! and pp3 at 3), one rank per process, each against the tp1 loss curve computed inside this
//! process on the local backend; the layouts with tp > 1 dividing the sequence (16) again with
//! sequence parallelism. Every rank checks every step; rank 0 prints `N passed, N
//! failed`. With `--distributed-optimizer`, the layouts with dp > 1 train with the optimizer
//! state sharded over dp (issue 34) against the same tp1 curve.

use std::process::ExitCode;
use tp_comm::local::{self, LocalOptions};
use tp_comm::mpi::{check, MpiOptions};
use tp_comm::{Group, ParallelDims, ProcessGroups};
use tp_train::{fixtures, TextTokenizer, TrainError, TrainOptions, Trainer};

/// Relative tolerance of the issue (see tests/parity.rs for why it holds).
const TOLERANCE: f64 = 1e-4;
const STEPS: u64 = 20;

fn losses(
    world: Group,
    dims: ParallelDims,
    micro: usize,
    sequence_parallel: bool,
    distributed_optimizer: bool,
) -> Result<Vec<f64>, TrainError> {
    let spec = tp_train::TrainSpec {
        sequence_parallel,
        distributed_optimizer,
        ..fixtures::spec(dims, STEPS, micro)
    };
    let corpus = fixtures::corpus()?;
    let tok = TextTokenizer::Bytes.json()?;
    let groups = ProcessGroups::new(world, dims)?;
    let mut t = Trainer::new(
        &spec,
        groups,
        &corpus,
        &tok,
        tp_train::Start::Fresh,
        TrainOptions::default(),
    )?;
    let mut out = Vec::new();
    t.run(&mut |r| out.push(r.loss))?;
    Ok(out)
}

/// Layouts of `n` ranks, with micro-batches that divide the 4-sequence batch, and whether
/// the run is sequence parallel.
fn layouts(n: usize) -> Vec<(ParallelDims, usize, bool)> {
    let mut out = Vec::new();
    for tp in 1..=n {
        for pp in 1..=n {
            for dp in [1, 2, 4] {
                if tp * pp * dp == n && tp <= 4 && pp <= 4 && (tp, pp, dp) != (1, 1, 1) {
                    let per_replica = 4 / dp;
                    let micro = if pp > 1 { per_replica } else { 1 };
                    let dims = ParallelDims { tp, pp, dp };
                    out.push((dims, micro, false));
                    if tp > 1 && fixtures::spec(dims, STEPS, micro).seq.is_multiple_of(tp) {
                        out.push((dims, micro, true));
                    }
                }
            }
        }
    }
    out
}

fn main() -> ExitCode {
    // Each collective's deadline: 60 s.
    let runtime = match check::init("tp-train-mpi-check", MpiOptions::default()) {
        Ok(r) => r,
        Err(code) => return code,
    };
    let world = runtime.world();
    let rank = world.rank();
    let sharded = std::env::args().any(|a| a == "--distributed-optimizer");
    // The oracle: tp1 in this process, on a one-rank local world.
    let reference = match local::run(1, LocalOptions::default(), |w| {
        losses(
            w,
            ParallelDims {
                tp: 1,
                pp: 1,
                dp: 1,
            },
            1,
            false,
            false,
        )
    }) {
        Ok(mut v) => match v.pop() {
            Some(Ok(Ok(l))) => l,
            other => {
                eprintln!("rank {rank}: the tp1 reference failed: {other:?}");
                return ExitCode::from(1);
            }
        },
        Err(e) => {
            eprintln!("rank {rank}: error: {e}");
            return ExitCode::from(1);
        }
    };
    let (mut passed, mut failed) = (0u64, 0u64);
    let layouts = layouts(world.size())
        .into_iter()
        .filter(|(d, _, _)| !sharded || d.dp > 1);
    for (dims, micro, sp) in layouts {
        let sp_name = match (sp, sharded) {
            (false, false) => "",
            (true, false) => " sequence-parallel",
            (false, true) => " distributed optimizer",
            (true, true) => " sequence-parallel distributed optimizer",
        };
        match losses(world.clone(), dims, micro, sp, sharded) {
            Ok(got) => {
                let worst = got
                    .iter()
                    .zip(&reference)
                    .map(|(g, w)| (g - w).abs() / w.abs())
                    .fold(0.0, f64::max);
                if got.len() == reference.len() && worst <= TOLERANCE {
                    passed += 1;
                    if rank == 0 {
                        println!(
                            "tp={} pp={} dp={}{sp_name}: {STEPS} steps, max relative loss difference {worst:.2e}",
                            dims.tp, dims.pp, dims.dp
                        );
                    }
                } else {
                    failed += 1;
                    eprintln!(
                        "rank {rank}: FAILED tp={} pp={} dp={}{sp_name}: {} steps, max relative \
                         difference {worst:e} > {TOLERANCE:e}",
                        dims.tp,
                        dims.pp,
                        dims.dp,
                        got.len()
                    );
                }
            }
            Err(e) => {
                eprintln!("rank {rank}: error at {dims:?}{sp_name}: {e}");
                if let Some(f) = e.as_comm().and_then(|c| c.flight_record()) {
                    eprint!("{f}");
                }
                failed += 1;
                break; // the world may be unusable now
            }
        }
    }
    check::totals(&world, passed, failed)
}
