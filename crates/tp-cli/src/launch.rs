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

/// An error a rank's work can end with: printed per rank, with a flight record when the
/// failure was a collective's.
pub trait RankError: std::fmt::Display + Send {
    /// The error and its causes, each once ([`crate::errors::chain`]).
    fn report(&self) -> String;
    fn flight_record(&self) -> Option<&str>;
    /// The rank only found the group poisoned by another rank's failure (printed last).
    fn is_poisoned(&self) -> bool;
}

impl RankError for CommError {
    fn report(&self) -> String {
        crate::errors::chain(self)
    }
    fn flight_record(&self) -> Option<&str> {
        CommError::flight_record(self)
    }
    fn is_poisoned(&self) -> bool {
        matches!(self, CommError::Poisoned { .. })
    }
}

impl RankError for anyhow::Error {
    fn report(&self) -> String {
        crate::errors::chain(self.as_ref())
    }
    fn flight_record(&self) -> Option<&str> {
        self.chain()
            .find_map(|e| e.downcast_ref::<CommError>())
            .and_then(CommError::flight_record)
    }
    fn is_poisoned(&self) -> bool {
        self.chain()
            .find_map(|e| e.downcast_ref::<CommError>())
            .is_some_and(|e| matches!(e, CommError::Poisoned { .. }))
    }
}

/// Runs `work` on every rank and returns rank 0's value, or prints each failing rank's error
/// (with one flight record) and returns the exit code 1.
pub fn run_ranks<T: Send, E: RankError>(
    backend: Backend,
    ranks: usize,
    timeout: Duration,
    work: impl Fn(Group) -> Result<T, E> + Sync,
) -> anyhow::Result<Result<Option<T>, ExitCode>> {
    match backend {
        Backend::Local => {
            anyhow::ensure!(ranks >= 1, "--ranks must be at least 1");
            let watchdog = Watchdog::start();
            let outcomes = local::run(ranks, LocalOptions { timeout }, |g| {
                let rank = g.rank();
                let out = work(g);
                if let Err(e) = &out {
                    watchdog.failed(rank, e);
                }
                out
            })?;
            watchdog.finished();
            let mut first = None;
            let mut errors: Vec<(usize, E)> = Vec::new();
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
            errors.sort_by_key(|(_, e)| e.is_poisoned());
            for (rank, e) in &errors {
                eprintln!("rank {rank}: error: {}", e.report());
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

/// Ends the process shortly after a rank fails if other rank threads are still stuck in code
/// that cannot be interrupted (a straggler asleep in its own work): the error is printed
/// within a grace period instead of whenever the straggler wakes.
struct Watchdog {
    state: std::sync::Arc<(std::sync::Mutex<WatchState>, std::sync::Condvar)>,
}

#[derive(Default)]
struct WatchState {
    errors: Vec<String>,
    flight_record: Option<String>,
    finished: bool,
}

/// How long the other ranks get to finish after the first failure.
const GRACE: Duration = Duration::from_secs(2);

impl Watchdog {
    fn start() -> Self {
        let state = std::sync::Arc::new((
            std::sync::Mutex::new(WatchState::default()),
            std::sync::Condvar::new(),
        ));
        let s = std::sync::Arc::clone(&state);
        std::thread::spawn(move || {
            let (lock, cv) = &*s;
            let mut st = lock.lock().unwrap_or_else(|p| p.into_inner());
            while st.errors.is_empty() && !st.finished {
                st = cv.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            if st.finished {
                return;
            }
            let (st2, _) = cv
                .wait_timeout_while(st, GRACE, |st| !st.finished)
                .unwrap_or_else(|p| p.into_inner());
            if !st2.finished {
                for e in &st2.errors {
                    eprintln!("{e}");
                }
                if let Some(f) = &st2.flight_record {
                    eprint!("{f}");
                }
                eprintln!(
                    "some ranks are still busy {GRACE:?} after the first failure; exiting without them"
                );
                std::process::exit(1);
            }
        });
        Watchdog { state }
    }

    fn failed(&self, rank: usize, e: &dyn RankError) {
        let (lock, cv) = &*self.state;
        let mut st = lock.lock().unwrap_or_else(|p| p.into_inner());
        st.errors
            .push(format!("rank {rank}: error: {}", e.report()));
        if st.flight_record.is_none() {
            st.flight_record = e.flight_record().map(str::to_string);
        }
        cv.notify_all();
    }

    fn finished(&self) {
        let (lock, cv) = &*self.state;
        lock.lock().unwrap_or_else(|p| p.into_inner()).finished = true;
        cv.notify_all();
    }
}

#[cfg(feature = "mpi")]
fn run_mpi<T, E: RankError>(
    timeout: Duration,
    work: impl Fn(Group) -> Result<T, E>,
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
            eprintln!("rank {rank}: error: {}", e.report());
            if let Some(f) = e.flight_record() {
                eprint!("{f}");
            }
            // Give peers a moment to report their side, then end this process without
            // finalizing: mpirun then ends the job. (MPI_Abort while a peer is exiting can
            // hang Open MPI 4.1's mpirun; a plain exit never did in our drills.)
            std::thread::sleep(Duration::from_millis(500));
            std::mem::forget(runtime);
            std::process::exit(1)
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi<T, E: RankError>(
    _timeout: Duration,
    _work: impl Fn(Group) -> Result<T, E>,
) -> anyhow::Result<Result<Option<T>, ExitCode>> {
    anyhow::bail!(
        "this tp was built without MPI; rebuild with `cargo build --release --features mpi` \
         (needs Debian's libopenmpi-dev and libclang-dev) and start it under mpirun"
    )
}
