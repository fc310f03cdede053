//! Starting ranks on a backend: threads of this process (`local`) or this process as one
//! rank of an `mpirun` job (`mpi`), and reporting how each rank ended.

use std::process::ExitCode;
use std::time::Duration;
use tp_comm::local::{self, LocalOptions};
use tp_comm::{CommError, Group};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// Rank threads in one process, shared memory.
    Local,
    /// One rank per process under mpirun (build with `--features mpi`).
    Mpi,
}

/// How a rank's work ended.
pub type RankResult<T> = Result<T, CommError>;

/// Runs `work` on every rank and returns rank 0's value, or prints each failing rank's error
/// (with one flight record) and returns the exit code 1.
pub fn run_ranks<T: Send>(
    backend: Backend,
    ranks: usize,
    timeout: Duration,
    work: impl Fn(Group) -> RankResult<T> + Sync,
) -> anyhow::Result<Result<Option<T>, ExitCode>> {
    match backend {
        Backend::Local => {
            anyhow::ensure!(ranks >= 1, "--ranks must be at least 1");
            let outcomes = local::run(ranks, LocalOptions { timeout }, work)?;
            let mut first = None;
            let mut errors: Vec<(usize, CommError)> = Vec::new();
            let mut panics: Vec<(usize, String)> = Vec::new();
            for (rank, outcome) in outcomes.into_iter().enumerate() {
                match outcome {
                    Ok(Ok(v)) if rank == 0 => first = Some(v),
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => errors.push((rank, e)),
                    Err(panic) => panics.push((rank, panic)),
                }
            }
            let failed = !errors.is_empty() || !panics.is_empty();
            for (rank, panic) in &panics {
                eprintln!("rank {rank}: {panic}");
            }
            // The cause first: ranks that only found the group poisoned come last.
            errors.sort_by_key(|(_, e)| matches!(e, CommError::Poisoned { .. }));
            for (rank, e) in &errors {
                eprintln!("rank {rank}: error: {e}");
            }
            if let Some(f) = errors.iter().find_map(|(_, e)| e.flight_record()) {
                eprint!("{f}");
            }
            Ok(if failed {
                Err(ExitCode::from(1))
            } else {
                Ok(first)
            })
        }
        Backend::Mpi => run_mpi(timeout, work),
    }
}

#[cfg(feature = "mpi")]
fn run_mpi<T>(
    timeout: Duration,
    work: impl Fn(Group) -> RankResult<T>,
) -> anyhow::Result<Result<Option<T>, ExitCode>> {
    use tp_comm::mpi::{MpiOptions, MpiRuntime};
    let runtime = MpiRuntime::init(MpiOptions {
        timeout,
        verify: true,
        install_panic_hook: true,
    })?;
    let world = runtime.world();
    let rank = world.rank();
    match work(world) {
        Ok(v) => Ok(Ok((rank == 0).then_some(v))),
        Err(e) => {
            eprintln!("rank {rank}: error: {e}");
            if let Some(f) = e.flight_record() {
                eprint!("{f}");
            }
            // Give peers a moment to report their side, then end the whole job.
            std::thread::sleep(Duration::from_millis(500));
            runtime.abort(1)
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi<T>(
    _timeout: Duration,
    _work: impl Fn(Group) -> RankResult<T>,
) -> anyhow::Result<Result<Option<T>, ExitCode>> {
    anyhow::bail!(
        "this tp was built without MPI; rebuild with `cargo build --release --features mpi` \
         (needs Debian's libopenmpi-dev and libclang-dev) and start it under mpirun"
    )
}
