//! The one poll loop every MPI wait goes through: `MPI_Test` on the pending requests until
//! they complete, the deadline passes, or a group member is known to have departed.

use super::notice::{Departed, Global};
use super::raw;
use crate::error::Result;
use mpi::ffi;
use std::os::raw::c_int;
use std::time::{Duration, Instant};

/// How long a wait keeps going after a member's departure notice: the departed rank may have
/// finished its side of this very call before it left, and the call can still complete.
const DEPARTURE_GRACE: Duration = Duration::from_millis(300);
/// How long a wait tests back to back, as MPI's own blocking calls do (each test runs MPI's
/// progress engine, which yields the core when idle under `mpi_yield_when_idle`), before it
/// starts sleeping between tests. Sleeping at once cost every small collective ~70 us of
/// timer slack; an extra yield per test gave the core away more often than MPI itself does.
const YIELD_FOR: Duration = Duration::from_millis(5);
/// Sleep between tests of a long wait (a slow peer): keeps an idle rank off the core.
const LONG_WAIT_SLEEP: Duration = Duration::from_micros(100);
/// Departure notices are probed on the first test of a wait and then every this many tests
/// (each probe is one more pass of MPI's progress engine).
const NOTICE_EVERY: u32 = 16;

/// How a wait ended.
pub(crate) enum Outcome {
    Done,
    /// The deadline passed first.
    TimedOut,
    /// A member of the group departed (its world rank and notice).
    Lost(usize, Departed),
}

/// Tests `reqs` (completed ones become `MPI_REQUEST_NULL`) until all are done.
pub(crate) fn poll(
    g: &Global,
    reqs: &mut [ffi::MPI_Request],
    members: &[usize],
    deadline: Instant,
) -> Result<Outcome> {
    poll_until(g, members, deadline, || test_all(reqs))
}

/// Tests every request of `reqs` with one `MPI_Testall` (one pass of MPI's progress engine);
/// completed ones become `MPI_REQUEST_NULL`. True when all are complete.
pub(crate) fn test_all(reqs: &mut [ffi::MPI_Request]) -> Result<bool> {
    if reqs.is_empty() {
        return Ok(true);
    }
    let mut flag: c_int = 0;
    let n = c_int::try_from(reqs.len()).unwrap_or(c_int::MAX);
    // SAFETY: `reqs` holds live requests started by the caller or MPI_REQUEST_NULL; `n` does
    // not exceed its length.
    let rc =
        unsafe { ffi::MPI_Testall(n, reqs.as_mut_ptr(), &mut flag, ffi::RSMPI_STATUSES_IGNORE) };
    raw::check(rc, "MPI_Testall")?;
    Ok(flag != 0)
}

/// Calls `test` (under the MPI lock) until it returns true, the deadline passes, or one of
/// `members` (world ranks, this rank excluded by the caller) is known to have departed.
pub(crate) fn poll_until(
    g: &Global,
    members: &[usize],
    deadline: Instant,
    mut test: impl FnMut() -> Result<bool>,
) -> Result<Outcome> {
    let start = Instant::now();
    let mut lost: Option<(usize, Departed)> = None;
    let mut round: u32 = 0;
    loop {
        {
            let _l = raw::lock();
            if test()? {
                return Ok(Outcome::Done);
            }
            if round.is_multiple_of(NOTICE_EVERY) {
                g.drain_notices();
            }
        }
        round = round.wrapping_add(1);
        let now = Instant::now();
        if lost.is_none() {
            lost = g.lost_member(members);
        }
        if let Some((rank, d)) = &lost {
            if now >= d.seen + DEPARTURE_GRACE || now >= deadline {
                return Ok(Outcome::Lost(*rank, d.clone()));
            }
        }
        if now >= deadline {
            return Ok(Outcome::TimedOut);
        }
        if now - start > YIELD_FOR {
            std::thread::sleep(LONG_WAIT_SLEEP);
        } else {
            std::hint::spin_loop();
        }
    }
}
