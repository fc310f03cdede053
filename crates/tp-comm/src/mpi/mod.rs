//! The `mpi` backend: one rank per process, started by `mpirun`; collectives over MPI.
//!
//! Start with [`MpiRuntime::init`] (once per process) and take [`MpiRuntime::world`]. Every
//! wait polls non-blocking MPI calls with the deadline of [`MpiOptions::timeout`] (R3), each
//! collective's first message to every peer carries its fingerprint, checked on receipt (R2,
//! [`MpiOptions::verify`]), and departure notices from panicking or exiting ranks turn waits
//! into `PeerLost` (R1). `TP_NET_DELAY_US` (a test aid) delays each message step.
//! A rank killed by a signal (SIGKILL, OOM killer) sends no notice: then `mpirun` notices the
//! dead process and tears the whole job down, and peers see no `CommError` at all.
//! A binary started without `mpirun` is a world of one (MPI singleton init).

pub mod check;
mod comm;
mod convert;
mod delay;
mod notice;
mod raw;
mod startup;
mod wait;

pub use comm::MpiComm;
pub use delay::VAR as NET_DELAY_VAR;

use crate::communicator::Group;
use crate::error::{CommError, Departure, Fingerprint, Result};
use mpi::ffi;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The call this process is in right now, if any: fingerprint, group size and time so far
/// (for a last word when the process is being ended from outside).
pub fn call_in_progress() -> Option<(Fingerprint, usize, Duration)> {
    notice::global()?.flight.in_progress()
}

/// Options of the MPI runtime.
#[derive(Clone, Debug)]
pub struct MpiOptions {
    /// Deadline of every call, from the moment it is entered.
    pub timeout: Duration,
    /// Check every peer's fingerprint on each collective (R2): small all_reduces carry it in
    /// their one message, other collectives exchange it first.
    pub verify: bool,
    /// Chain a panic hook that tells every other rank this one is gone (R1).
    pub install_panic_hook: bool,
}

impl Default for MpiOptions {
    fn default() -> Self {
        MpiOptions {
            timeout: Duration::from_secs(60),
            verify: true,
            install_panic_hook: true,
        }
    }
}

static INIT_CALLED: AtomicBool = AtomicBool::new(false);

/// This process's MPI session: `MPI_Init` on creation, an "exited" notice and
/// `MPI_Finalize` on drop.
pub struct MpiRuntime {
    g: &'static notice::Global,
    world: Arc<MpiComm>,
    /// Each world rank's host name, from the start-up exchange.
    hosts: Vec<String>,
}

impl std::fmt::Debug for MpiRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MpiRuntime(rank {} of {})",
            self.g.world_rank, self.g.world_size
        )
    }
}

impl MpiRuntime {
    /// Initializes MPI and checks that every rank runs this build (crate version and the
    /// executable's build id, exchanged with every rank together with its host name);
    /// a mismatch is [`CommError::BuildMismatch`] naming the hosts. A second call in the
    /// same process is an error.
    pub fn init(opts: MpiOptions) -> Result<MpiRuntime> {
        let net_delay = delay::from_env()?;
        if INIT_CALLED.swap(true, Ordering::SeqCst) {
            return Err(CommError::Backend(
                "MpiRuntime::init was already called in this process; MPI can be initialized \
                 once per process: keep the first runtime and clone its world()"
                    .into(),
            ));
        }
        let _l = raw::lock();
        let mut flag: c_int = 0;
        raw::check(
            // SAFETY: MPI_Initialized may be called at any time.
            unsafe { ffi::MPI_Initialized(&mut flag) },
            "MPI_Initialized",
        )?;
        if flag != 0 {
            return Err(CommError::Backend(
                "MPI was already initialized by other code".into(),
            ));
        }
        let mut provided: c_int = 0;
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: reading an immutable handle constant.
        let mut control = raw::Comm(unsafe { ffi::RSMPI_COMM_NULL });
        let mut data = control;
        // SAFETY: first and only MPI_Init_thread of the process (guarded above); null
        // argc/argv are allowed; the out-params are valid.
        unsafe {
            raw::check(
                ffi::MPI_Init_thread(
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    ffi::RSMPI_THREAD_SERIALIZED,
                    &mut provided,
                ),
                "MPI_Init_thread",
            )?;
            let world = ffi::RSMPI_COMM_WORLD;
            raw::check(
                ffi::MPI_Comm_set_errhandler(world, ffi::RSMPI_ERRORS_RETURN),
                "MPI_Comm_set_errhandler",
            )?;
            raw::check(ffi::MPI_Comm_rank(world, &mut rank), "MPI_Comm_rank")?;
            raw::check(ffi::MPI_Comm_size(world, &mut size), "MPI_Comm_size")?;
            raw::check(ffi::MPI_Comm_dup(world, &mut control.0), "MPI_Comm_dup")?;
            raw::check(ffi::MPI_Comm_dup(world, &mut data.0), "MPI_Comm_dup")?;
        }
        let bad = |_| CommError::Backend("MPI reported a negative rank or size".into());
        let g = notice::install(notice::Global::new(
            usize::try_from(rank).map_err(bad)?,
            usize::try_from(size).map_err(bad)?,
            control,
            &opts,
            net_delay,
        ));
        drop(_l);
        let world = Arc::new(MpiComm::new(g, data)?);
        if opts.install_panic_hook {
            notice::install_panic_hook();
        }
        let peers = startup::exchange(g)?;
        let hosts = peers.iter().map(|p| p.host.clone()).collect();
        let rt = MpiRuntime { g, world, hosts };
        startup::check_same_build(&peers)?;
        Ok(rt)
    }

    /// The world group (every process of the job).
    pub fn world(&self) -> Group {
        Arc::clone(&self.world) as Group
    }

    /// Each world rank's host name (`$TP_HOST` where set, else its hostname), by rank.
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// This process's rank in the world.
    pub fn world_rank(&self) -> usize {
        self.g.world_rank
    }

    /// Kills the whole job (`MPI_Abort` on the world) after a fatal error. Open MPI 4.1's
    /// `mpirun` can hang in its teardown when an abort races another rank's exit; when a peer
    /// is already gone, exiting non-zero without finalizing is the more reliable way out.
    pub fn abort(&self, code: i32) -> ! {
        {
            let _l = raw::try_lock_for(Duration::from_millis(200));
            // SAFETY: MPI is initialized and not finalized (we hold the runtime).
            unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code) };
        }
        std::process::exit(code)
    }
}

impl Drop for MpiRuntime {
    fn drop(&mut self) {
        // Buffered sends of groups still alive must reach their receivers before MPI goes.
        self.world.drain_sends();
        self.g.notify(&Departure::Exited(
            "its work returned and it shut MPI down".into(),
        ));
        let _l = raw::lock();
        self.g.finalized.store(true, Ordering::SeqCst);
        // SAFETY: MPI is initialized; after this no call of this crate touches MPI
        // (every path checks `finalized`).
        unsafe { ffi::MPI_Finalize() };
    }
}

/// Bytes this process has handed to MPI sends since `MpiRuntime::init`: payloads and
/// fingerprints of its collectives and point-to-point sends. For the collectives MPI runs
/// itself (all_gather, reduce_scatter, broadcast) it counts the bytes a bandwidth-optimal
/// algorithm sends from one rank ((n-1)/n of the gathered or scattered buffer; the whole
/// buffer from a broadcast root). Zero before init.
pub fn bytes_sent() -> u64 {
    notice::global().map_or(0, |g| g.sent.load(Ordering::Relaxed))
}

/// A plain blocking `MPI_Allreduce` (sum of f32) on the world, straight through the FFI:
/// the reference column of `tp bench collectives`. Benchmark aid only: no deadline, no
/// fingerprint, no departure notices (a lost peer makes mpirun end the job). Call it on
/// every rank with equal lengths, outside any other collective.
pub fn plain_all_reduce_f32(send: &[f32], recv: &mut [f32]) -> Result<()> {
    if send.len() != recv.len() {
        return Err(CommError::InvalidArgument {
            rank: notice::global().map_or(0, |g| g.world_rank),
            message: format!(
                "the send buffer has {} elements and the receive buffer {}; give both the same length",
                send.len(),
                recv.len()
            ),
        });
    }
    let Some(g) = notice::global() else {
        return Err(CommError::Backend(
            "plain_all_reduce_f32 needs MpiRuntime::init first".into(),
        ));
    };
    if g.finalized.load(Ordering::SeqCst) {
        return Err(CommError::Backend("MPI was already finalized".into()));
    }
    let n = raw::int_count(g.world_rank, send.len(), "the buffer")?;
    let _l = raw::lock();
    raw::check(
        // SAFETY: both buffers hold `n` f32s and outlive this blocking call; MPI is
        // initialized and not finalized (checked above, under the runtime's lifetime).
        unsafe {
            ffi::MPI_Allreduce(
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                n,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_SUM,
                ffi::RSMPI_COMM_WORLD,
            )
        },
        "MPI_Allreduce",
    )
}

/// A plain blocking `MPI_Alltoall` of f32 on the world, straight through the FFI: the
/// reference column of all_to_all rows. Benchmark aid only, with the caveats of
/// [`plain_all_reduce_f32`]; `send` and `recv` hold the same whole number of blocks, one per
/// rank, on every rank.
pub fn plain_all_to_all_f32(send: &[f32], recv: &mut [f32]) -> Result<()> {
    let Some(g) = notice::global() else {
        return Err(CommError::Backend(
            "plain_all_to_all_f32 needs MpiRuntime::init first".into(),
        ));
    };
    let n = g.world_size.max(1);
    if send.len() != recv.len() || !send.len().is_multiple_of(n) {
        return Err(CommError::InvalidArgument {
            rank: g.world_rank,
            message: format!(
                "the send buffer has {} elements and the receive buffer {}; give both the \
                 same multiple of the {n} ranks",
                send.len(),
                recv.len()
            ),
        });
    }
    if g.finalized.load(Ordering::SeqCst) {
        return Err(CommError::Backend("MPI was already finalized".into()));
    }
    let block = raw::int_count(g.world_rank, send.len() / n, "a block")?;
    let _l = raw::lock();
    raw::check(
        // SAFETY: both buffers hold `n` blocks of `block` f32s and outlive this blocking
        // call; MPI is initialized and not finalized (checked above).
        unsafe {
            ffi::MPI_Alltoall(
                send.as_ptr().cast(),
                block,
                ffi::RSMPI_FLOAT,
                recv.as_mut_ptr().cast(),
                block,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_COMM_WORLD,
            )
        },
        "MPI_Alltoall",
    )
}
