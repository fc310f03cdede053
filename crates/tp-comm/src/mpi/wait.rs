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
/// Busy-polling time before the loop starts sleeping between tests.
const SPIN: Duration = Duration::from_micros(50);

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
    poll_until(g, members, deadline, || {
        let mut all = true;
        for r in reqs.iter_mut() {
            let mut flag: c_int = 0;
            // SAFETY: `r` is a live request started by the caller, or MPI_REQUEST_NULL
            // (for which MPI_Test reports completion at once).
            let rc = unsafe { ffi::MPI_Test(r, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            raw::check(rc, "MPI_Test")?;
            all &= flag != 0;
        }
        Ok(all)
    })
}

/// Indices of the requests of `reqs` still pending.
pub(crate) fn pending(reqs: &[ffi::MPI_Request]) -> Vec<usize> {
    let null = raw::null_request();
    reqs.iter()
        .enumerate()
        .filter(|(_, r)| **r != null)
        .map(|(i, _)| i)
        .collect()
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
    loop {
        {
            let _l = raw::lock();
            if test()? {
                return Ok(Outcome::Done);
            }
            g.drain_notices();
        }
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
        if now - start > SPIN {
            std::thread::sleep(Duration::from_micros(20));
        } else {
            std::hint::spin_loop();
        }
    }
}
