//! What the `*-mpi-check` binaries (tp-comm's, tp-nn's and tp-train's, run under mpirun by
//! their crates' tests) share: starting MPI or saying why not, and adding up every rank's
//! passed and failed checks into the one line rank 0 prints (`P passed, F failed`) and the
//! exit code.

use super::{MpiOptions, MpiRuntime};
use crate::communicator::{CommExt, Group};
use crate::dtype::ReduceOp;
use std::process::ExitCode;

/// MPI started with `opts`, or exit code 2 after printing `name: error` to stderr.
pub fn init(name: &str, opts: MpiOptions) -> Result<MpiRuntime, ExitCode> {
    MpiRuntime::init(opts).map_err(|e| {
        eprintln!("{name}: {e}");
        ExitCode::from(2)
    })
}

/// Sums `passed` and `failed` over `world`; rank 0 prints `P passed, F failed`. Success only
/// when no rank failed; exit code 1 otherwise, or when the counts cannot be added up (printed
/// by each rank).
pub fn totals(world: &Group, passed: u64, failed: u64) -> ExitCode {
    let mut counts = [passed, failed];
    if let Err(e) = world.all_reduce(&mut counts, ReduceOp::Sum) {
        eprintln!("rank {}: could not add up the results: {e}", world.rank());
        return ExitCode::FAILURE;
    }
    if world.rank() == 0 {
        println!("{} passed, {} failed", counts[0], counts[1]);
    }
    if counts[1] == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
