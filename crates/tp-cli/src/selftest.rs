//! `tp selftest`: the collectives conformance suite on the chosen backend.

use std::process::ExitCode;
use std::time::Duration;
use tp_comm::{CommExt, ReduceOp};
use tp_engine::launch::{run_ranks, Backend};

#[derive(clap::Args)]
pub struct SelftestArgs {
    /// Ranks for the local backend (under MPI, mpirun's -n decides).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    #[arg(long, default_value_t = Backend::Local, value_parser = crate::model_run::backend_values())]
    backend: Backend,
    /// Deadline of each collective, in seconds.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
}

pub fn run(args: &SelftestArgs) -> anyhow::Result<ExitCode> {
    let timeout = Duration::try_from_secs_f64(args.timeout)
        .map_err(|_| anyhow::anyhow!("--timeout must be a positive number of seconds"))?;
    let out = run_ranks(args.backend, args.ranks, timeout, |world| {
        let report = tp_comm::conformance::run(&world);
        for f in &report.failed {
            eprintln!("rank {}: FAILED {f}", world.rank());
        }
        let mut counts = [report.passed as u64, report.failed.len() as u64];
        world.all_reduce(&mut counts, ReduceOp::Sum)?;
        Ok::<_, tp_comm::CommError>((world.size(), counts))
    })?;
    match out {
        Ok(Some((size, [passed, failed]))) => {
            println!(
                "conformance on {size} ranks ({:?} backend), checks over all ranks:",
                args.backend
            );
            println!("{passed} passed, {failed} failed");
            Ok(if failed == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Ok(None) => Ok(ExitCode::SUCCESS),
        Err(failed) => Ok(failed.into()),
    }
}
