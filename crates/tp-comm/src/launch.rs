//! Starting ranks on a backend: threads of this process (`local`) or this process as one
//! rank of an `mpirun` job (`mpi`), a watchdog for stragglers, and reporting how each rank
//! ended (each failing rank's error on stderr, with one flight record). Every command that
//! runs ranks (inference sessions, training, the benches, the self-test) starts them here.

use crate::error::chain;
use crate::local::{self, LocalOptions};
use crate::{CommError, Group};
use std::sync::OnceLock;
use std::time::Duration;

/// Where the ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Rank threads in one process, shared memory.
    Local,
    /// One rank per process under mpirun (a build with the `mpi` feature).
    Mpi,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Local => "local",
            Backend::Mpi => "mpi",
        })
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "local" => Ok(Backend::Local),
            "mpi" => Ok(Backend::Mpi),
            other => Err(format!("unknown backend {other:?}; use local or mpi")),
        }
    }
}

/// Some ranks failed; each one's error has been printed on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RanksFailed;

/// A command whose ranks failed exits with 1.
impl From<RanksFailed> for std::process::ExitCode {
    fn from(_: RanksFailed) -> Self {
        std::process::ExitCode::from(1)
    }
}

/// Why ranks could not be started at all.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("the number of ranks must be at least 1")]
    NoRanks,
    #[error(
        "this build has no MPI backend; rebuild with `cargo build --release --features mpi` \
         (needs Debian's libopenmpi-dev and libclang-dev) and start it under mpirun"
    )]
    NoMpi,
    #[error("cannot start the ranks: {0}")]
    Comm(#[from] CommError),
}

/// Whether this process holds rank 0, known before MPI starts: always with local ranks;
/// under mpirun, the process it numbered 0 (`$OMPI_COMM_WORLD_RANK`).
pub fn leads(backend: Backend) -> bool {
    backend == Backend::Local || std::env::var("OMPI_COMM_WORLD_RANK").as_deref() == Ok("0")
}

/// Each world rank's host under mpirun, as the ranks told each other at start.
static HOSTS: OnceLock<Vec<String>> = OnceLock::new();

/// The host of world rank `rank` for messages: under mpirun the name it reported at start
/// (`$TP_HOST`, else its hostname); with local ranks "this host".
pub fn host_of(rank: usize) -> String {
    HOSTS
        .get()
        .and_then(|h| h.get(rank))
        .cloned()
        .unwrap_or_else(|| "this host".into())
}

/// "rank 0 = a, rank 1 = b" for every rank of the MPI job (empty with local ranks).
#[cfg(feature = "mpi")]
fn host_map() -> String {
    HOSTS.get().map_or(String::new(), |h| {
        h.iter()
            .enumerate()
            .map(|(r, h)| format!("rank {r} = {h}"))
            .collect::<Vec<_>>()
            .join(", ")
    })
}

/// Set by commands that handle SIGTERM themselves (`tp serve` drains its requests).
static COMMAND_HANDLES_SIGTERM: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Called before [`run_ranks`] by a command with its own SIGTERM handling: under mpirun the
/// ranks then keep the default (no last word on SIGTERM, see `sigterm`).
pub fn command_handles_sigterm() {
    COMMAND_HANDLES_SIGTERM.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// An error a rank's work can end with: printed per rank, with a flight record when the
/// failure was a collective's.
pub trait RankError: std::fmt::Display + Send {
    /// The error and its causes, each once ([`chain`]).
    fn report(&self) -> String;
    fn flight_record(&self) -> Option<&str>;
    /// The rank only found the group poisoned by another rank's failure (printed last).
    fn is_poisoned(&self) -> bool;
}

impl RankError for CommError {
    fn report(&self) -> String {
        chain(self)
    }
    fn flight_record(&self) -> Option<&str> {
        CommError::flight_record(self)
    }
    fn is_poisoned(&self) -> bool {
        matches!(self, CommError::Poisoned { .. })
    }
}

/// Errors that carry their causes as a chain (`anyhow::Error` is one): the chain's first
/// [`CommError`] gives the flight record.
impl<E> RankError for E
where
    E: AsRef<dyn std::error::Error + Send + Sync + 'static> + std::fmt::Display + Send,
{
    fn report(&self) -> String {
        chain(self.as_ref())
    }
    fn flight_record(&self) -> Option<&str> {
        first_comm(self.as_ref()).and_then(CommError::flight_record)
    }
    fn is_poisoned(&self) -> bool {
        first_comm(self.as_ref()).is_some_and(|e| matches!(e, CommError::Poisoned { .. }))
    }
}

/// The first [`CommError`] among `e` and its causes.
fn first_comm<'a>(e: &'a (dyn std::error::Error + Send + Sync + 'static)) -> Option<&'a CommError> {
    let mut next: Option<&'a (dyn std::error::Error + 'static)> = Some(e);
    while let Some(cur) = next {
        if let Some(c) = cur.downcast_ref::<CommError>() {
            return Some(c);
        }
        next = cur.source();
    }
    None
}

/// Runs `work` on every rank and returns rank 0's value (`None` on the other ranks of an MPI
/// job), or prints each failing rank's error (with one flight record) and returns
/// [`RanksFailed`]. `ranks` is the local rank count (under MPI, mpirun's decides).
pub fn run_ranks<T: Send, E: RankError>(
    backend: Backend,
    ranks: usize,
    timeout: Duration,
    work: impl Fn(Group) -> Result<T, E> + Sync,
) -> Result<Result<Option<T>, RanksFailed>, LaunchError> {
    match backend {
        Backend::Local => {
            if ranks == 0 {
                return Err(LaunchError::NoRanks);
            }
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
            Ok(if failed { Err(RanksFailed) } else { Ok(first) })
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
) -> Result<Result<Option<T>, RanksFailed>, LaunchError> {
    use crate::mpi::{MpiOptions, MpiRuntime};
    let runtime = MpiRuntime::init(MpiOptions {
        timeout,
        verify: true,
        install_panic_hook: true,
    })?;
    let _ = HOSTS.set(runtime.hosts().to_vec());
    let world = runtime.world();
    let rank = world.rank();
    if !COMMAND_HANDLES_SIGTERM.load(std::sync::atomic::Ordering::SeqCst) {
        sigterm::report_and_exit(rank, host_of(rank), host_map());
    }
    match work(world) {
        Ok(v) => Ok(Ok((rank == 0).then_some(v))),
        Err(e) => {
            eprintln!("rank {rank} on {}: error: {}", host_of(rank), e.report());
            eprintln!("rank {rank}: the job's hosts: {}", host_map());
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
) -> Result<Result<Option<T>, RanksFailed>, LaunchError> {
    Err(LaunchError::NoMpi)
}

/// A last word under mpirun. When one process of the job dies (killed, or cut off from
/// mpirun), mpirun ends every other with SIGTERM (then SIGKILL a second later); the rank
/// that was waiting for the dead one would vanish without saying where it was. With this,
/// it prints the call it was in (op, sequence number, how long it waited) and its host,
/// then exits 143 as SIGTERM's default would.
#[cfg(feature = "mpi")]
mod sigterm {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    static RECEIVED: AtomicBool = AtomicBool::new(false);

    pub fn report_and_exit(rank: usize, host: String, hosts: String) {
        // SAFETY: the action only stores to an atomic, which is async-signal-safe.
        let registered = unsafe {
            signal_hook_registry::register(libc::SIGTERM, || RECEIVED.store(true, Ordering::SeqCst))
        };
        if registered.is_err() {
            return; // SIGTERM keeps its default: the process ends without a word.
        }
        let watcher = std::thread::Builder::new()
            .name("sigterm".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(10));
                if RECEIVED.load(Ordering::SeqCst) {
                    let doing = match crate::mpi::call_in_progress() {
                        Some((fp, size, waited)) => format!(
                            "while in {} #{} of a {size}-rank group for {:.1} s",
                            fp.op,
                            fp.seq,
                            waited.as_secs_f64()
                        ),
                        None => "outside any collective".into(),
                    };
                    eprintln!(
                        "rank {rank} on {host}: ended by SIGTERM {doing} (mpirun ends every \
                         process when one fails; its message names the failed one); the job's \
                         hosts: {hosts}"
                    );
                    std::process::exit(143);
                }
            });
        if watcher.is_err() {
            // Without the watcher nobody would act on the flag: restore the default.
            // SAFETY: plain libc call resetting a signal disposition.
            unsafe { libc::signal(libc::SIGTERM, libc::SIG_DFL) };
        }
    }
}
