//! `MpiComm`: one rank's handle on an MPI group. Every call posts a non-blocking MPI
//! operation on communicator-owned scratch buffers and polls it with the deadline (R3), after
//! a fingerprint exchange on the group's control communicator (R2) when `verify` is on.

use super::notice::{Departed, Global};
use super::raw::{self, Comm, Scratch};
use super::wait::{self, Outcome};
use crate::dtype::DType;
use crate::error::{CommError, Departure, Fingerprint, OpKind, Result};
use mpi::ffi;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, TryLockError};
use std::time::Instant;

mod allreduce;
mod alltoall;
mod ops;

/// Waits the `TP_NET_DELAY_US` delay (if any) before a message step's sends.
pub(super) fn wait_net_delay(g: &Global) {
    super::delay::wait(g.net_delay);
}

/// Tag of fingerprint messages on a group's control communicator.
const FP_TAG: c_int = 3;
/// Words of a packed fingerprint.
const FP_WORDS: usize = 5;
/// Bytes of a packed fingerprint at the head of a fingerprint message.
pub(super) const HDR: usize = FP_WORDS * 8;

static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(0);

/// A buffered send still in flight: MPI reads `data` until the request completes.
struct PendingSend {
    req: ffi::MPI_Request,
    /// Never read here: owned so it outlives the request.
    _data: Vec<u8>,
}

/// Mutable per-handle state; its lock also rejects concurrent calls on one handle.
#[derive(Default)]
struct State {
    seq: u64,
    poisoned: Option<String>,
    send: Scratch,
    recv: Scratch,
    sends: Vec<PendingSend>,
    sent: Vec<u64>,
    received: Vec<u64>,
}

/// One rank's handle on an MPI group (the world or a split of it).
pub struct MpiComm {
    g: &'static Global,
    comm: Comm,
    ctl: Comm,
    rank: usize,
    members: Vec<usize>,
    id: u64,
    state: Mutex<State>,
}

// SAFETY: the raw pointers inside `State` (requests) are only used under the state lock and
// the MPI lock, as MPI_THREAD_SERIALIZED requires.
unsafe impl Send for State {}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MpiComm(group {}, rank {}/{})",
            self.id,
            self.rank,
            self.members.len()
        )
    }
}

impl MpiComm {
    /// Wraps `comm` (this handle's own; a control dup is made here). Collective over `comm`.
    pub(crate) fn new(g: &'static Global, comm: Comm) -> Result<MpiComm> {
        let _l = raw::lock();
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        let mut ctl = Comm(comm.0);
        // SAFETY: `comm` is a live communicator; the out-params are valid.
        unsafe {
            raw::check(ffi::MPI_Comm_rank(comm.0, &mut rank), "MPI_Comm_rank")?;
            raw::check(ffi::MPI_Comm_size(comm.0, &mut size), "MPI_Comm_size")?;
            raw::check(ffi::MPI_Comm_dup(comm.0, &mut ctl.0), "MPI_Comm_dup")?;
        }
        let size = usize::try_from(size).map_err(|_| CommError::Backend("negative size".into()))?;
        let members = world_ranks(comm, size)?;
        Ok(MpiComm {
            g,
            comm,
            ctl,
            rank: usize::try_from(rank).map_err(|_| CommError::Backend("negative rank".into()))?,
            members,
            id: NEXT_GROUP_ID.fetch_add(1, Ordering::Relaxed),
            state: Mutex::new(State {
                sent: vec![0; size],
                received: vec![0; size],
                ..State::default()
            }),
        })
    }

    fn me(&self) -> usize {
        self.g.world_rank
    }

    fn peers(&self) -> Vec<usize> {
        (0..self.members.len())
            .filter(|&j| j != self.rank)
            .collect()
    }

    fn others(&self) -> Vec<usize> {
        self.peers().into_iter().map(|j| self.members[j]).collect()
    }

    fn invalid(&self, message: String) -> CommError {
        CommError::InvalidArgument {
            rank: self.me(),
            message,
        }
    }

    fn state(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        match self.state.try_lock() {
            Ok(s) => Ok(s),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(self.invalid(
                "two threads called the same MPI group handle at once; give each thread its \
                 own group (split) or serialize the calls"
                    .into(),
            )),
        }
    }

    fn lost(&self, fp: &Fingerprint, lost_rank: usize, d: Departed) -> CommError {
        let suffix = match d.last {
            Some((op, seq)) => format!(" (its last call: {op} #{seq})"),
            None => String::new(),
        };
        let why = match d.why {
            Departure::Panicked(m) => Departure::Panicked(format!("{m}{suffix}")),
            Departure::Exited(m) => Departure::Exited(format!("{m}{suffix}")),
        };
        CommError::PeerLost {
            rank: self.me(),
            lost_rank,
            why,
            op: fp.op,
            seq: fp.seq,
            group_size: self.members.len(),
            flight_record: self.g.flight_record(),
        }
    }

    fn timeout(&self, fp: &Fingerprint, missing: Vec<usize>) -> CommError {
        CommError::Timeout {
            rank: self.me(),
            op: fp.op,
            seq: fp.seq,
            waited: self.g.timeout,
            missing,
            group_size: self.members.len(),
            flight_record: self.g.flight_record(),
        }
    }

    /// Runs one collective: bookkeeping, fingerprint exchange, the op, poisoning on failure.
    fn collective<R>(
        &self,
        op: OpKind,
        dtype: DType,
        count: usize,
        detail: u64,
        body: impl FnOnce(&mut State, &Fingerprint, Instant) -> Result<R>,
    ) -> Result<R> {
        self.collective_with(op, dtype, count, detail, self.g.verify, body)
    }

    /// [`Self::collective`], with the separate fingerprint exchange before the op only when
    /// `exchange_first` (all_reduce carries the fingerprint in its own first message).
    fn collective_with<R>(
        &self,
        op: OpKind,
        dtype: DType,
        count: usize,
        detail: u64,
        exchange_first: bool,
        body: impl FnOnce(&mut State, &Fingerprint, Instant) -> Result<R>,
    ) -> Result<R> {
        let mut st = self.state()?;
        let seq = st.seq;
        st.seq += 1;
        let fp = Fingerprint {
            op,
            seq,
            dtype,
            count: count as u64,
            detail,
        };
        self.g.flight.start(self.id, self.members.len(), fp);
        self.g.set_last(op, seq);
        if let Some(cause) = &st.poisoned {
            self.g.flight.finish(self.id, false);
            return Err(CommError::Poisoned {
                rank: self.me(),
                op,
                seq,
                cause: cause.clone(),
                flight_record: self.g.flight_record(),
            });
        }
        let deadline = Instant::now() + self.g.timeout;
        let out = reap(&mut st)
            .and_then(|()| {
                if exchange_first {
                    self.exchange(&mut st, &fp, deadline)
                } else {
                    Ok(())
                }
            })
            .and_then(|()| body(&mut st, &fp, deadline));
        if let Err(e) = &out {
            if matches!(
                e,
                CommError::PeerLost { .. }
                    | CommError::Timeout { .. }
                    | CommError::Mismatch { .. }
                    | CommError::CountsMismatch { .. }
            ) {
                st.poisoned = Some(e.to_string());
            }
        }
        self.g.flight.finish(self.id, out.is_ok());
        out
    }

    /// R2 without a payload: [`Self::swap`] of the bare fingerprint, always checked.
    fn exchange(&self, st: &mut State, fp: &Fingerprint, deadline: Instant) -> Result<()> {
        self.swap(st, fp, &[], deadline, true)
    }

    /// Sends `fingerprint ++ payload` (one message on the control communicator) to every
    /// peer and receives theirs, each of the same length, into `st.recv` (peer `k` of
    /// [`Self::peers`] at `k * (HDR + payload.len())`). A peer whose message is shorter or
    /// longer (a different call) or whose fingerprint differs (`check`) is a `Mismatch`
    /// naming both fingerprints. Desynced calls of any kind meet here: every collective's
    /// first message is one of these.
    fn swap(
        &self,
        st: &mut State,
        fp: &Fingerprint,
        payload: &[u8],
        deadline: Instant,
        check: bool,
    ) -> Result<()> {
        self.swap_v(st, fp, payload, |_| payload.len(), deadline, check)
            .map(|_| ())
    }

    /// [`Self::swap`] where peer `j` (group rank) sends `theirs(j)` payload bytes: every
    /// peer's message lands in a slot of `HDR + max` bytes (`max` the largest payload, ours
    /// included), peer `k` of [`Self::peers`] at `k * slot` of `st.recv`. Returns `slot`.
    fn swap_v(
        &self,
        st: &mut State,
        fp: &Fingerprint,
        payload: &[u8],
        theirs: impl Fn(usize) -> usize,
        deadline: Instant,
        check: bool,
    ) -> Result<usize> {
        let peers = self.peers();
        if peers.is_empty() {
            return Ok(HDR + payload.len());
        }
        let np = peers.len();
        let mine_len = HDR + payload.len();
        let expect: Vec<usize> = peers.iter().map(|&j| HDR + theirs(j)).collect();
        let slot = expect.iter().copied().fold(mine_len, usize::max);
        let mine = pack(fp);
        {
            let s = st.send.bytes(mine_len);
            write_header(&mine, s);
            s[HDR..].copy_from_slice(payload);
        }
        let sends = vec![(0, mine_len); np];
        let recvs: Vec<(usize, usize)> = (0..np).map(|k| (k * slot, slot)).collect();
        let got = self.post_exchange(st, fp, &sends, &recvs, deadline)?;
        let recv = st.recv.bytes(slot * np);
        for (k, &j) in peers.iter().enumerate() {
            let at = &recv[k * slot..(k + 1) * slot];
            let words = read_header(at);
            if got[k] == expect[k] && (!check || words == mine) {
                continue;
            }
            return Err(self.peer_error(fp, j, got[k], expect[k], &words));
        }
        Ok(slot)
    }

    /// The message exchange under [`Self::swap_v`] and all_to_all: posts, for each peer `k` of
    /// [`Self::peers`], a receive into `recvs[k]` (offset, bytes) of the receive scratch and a
    /// send of `sends[k]` of the send scratch (filled by the caller) on the control
    /// communicator, and polls them all with the deadline. Returns the bytes each peer's
    /// message carried (`usize::MAX`: longer than its receive, truncated by MPI; its first
    /// bytes, the fingerprint among them, are there). A lost peer or the deadline leaks both
    /// scratch buffers (MPI may still use them) and is the error.
    fn post_exchange(
        &self,
        st: &mut State,
        fp: &Fingerprint,
        sends: &[(usize, usize)],
        recvs: &[(usize, usize)],
        deadline: Instant,
    ) -> Result<Vec<usize>> {
        let peers = self.peers();
        let np = peers.len();
        let end = |v: &[(usize, usize)]| v.iter().map(|&(o, l)| o + l).max().unwrap_or(0);
        let isends = sends
            .iter()
            .map(|&(_, l)| raw::int_count(self.me(), l, "the message (bytes)"))
            .collect::<Result<Vec<_>>>()?;
        let irecvs = recvs
            .iter()
            .map(|&(_, l)| raw::int_count(self.me(), l, "the message (bytes)"))
            .collect::<Result<Vec<_>>>()?;
        let sp = st.send.bytes(end(sends)).as_ptr();
        let rp = st.recv.bytes(end(recvs)).as_mut_ptr();
        let mut reqs = vec![raw::null_request(); 2 * np];
        wait_net_delay(self.g);
        {
            let _l = raw::lock();
            for (k, &j) in peers.iter().enumerate() {
                // SAFETY: receive `k` lies inside the receive scratch and send `k` inside the
                // send scratch (both sized to the furthest end above); both are leaked below if
                // a request does not complete.
                unsafe {
                    raw::check(
                        ffi::MPI_Irecv(
                            rp.add(recvs[k].0).cast(),
                            irecvs[k],
                            raw::byte_type(),
                            j as c_int,
                            FP_TAG,
                            self.ctl.0,
                            &mut reqs[k],
                        ),
                        "MPI_Irecv",
                    )?;
                    raw::check(
                        ffi::MPI_Isend(
                            sp.add(sends[k].0).cast(),
                            isends[k],
                            raw::byte_type(),
                            j as c_int,
                            FP_TAG,
                            self.ctl.0,
                            &mut reqs[np + k],
                        ),
                        "MPI_Isend",
                    )?;
                }
            }
        }
        self.g.count_sent(sends.iter().map(|&(_, l)| l).sum());
        // Per peer: the bytes its message carried, or None while it has not arrived.
        let mut got: Vec<Option<usize>> = vec![None; np];
        let mut idx = vec![0 as c_int; 2 * np];
        let mut statuses = vec![raw::empty_status(); 2 * np];
        let null = raw::null_request();
        let out = wait::poll_until(self.g, &self.others(), deadline, || {
            // One MPI_Testsome per pass: one run of MPI's progress engine, as in MPI_Wait.
            let mut outcount: c_int = 0;
            // SAFETY: `reqs` holds live requests or MPI_REQUEST_NULL; `idx` and `statuses`
            // have room for every request.
            let rc = unsafe {
                ffi::MPI_Testsome(
                    (2 * np) as c_int,
                    reqs.as_mut_ptr(),
                    &mut outcount,
                    idx.as_mut_ptr(),
                    statuses.as_mut_ptr(),
                )
            };
            let in_status = rc == ffi::MPI_ERR_IN_STATUS as c_int;
            if !in_status {
                raw::check(rc, "MPI_Testsome")?;
            }
            let done = usize::try_from(outcount).unwrap_or(0).min(idx.len());
            for (&i, status) in idx[..done].iter().zip(&statuses) {
                let Ok(i) = usize::try_from(i) else { continue };
                let failed = in_status && status.MPI_ERROR != ffi::MPI_SUCCESS as c_int;
                if i >= np {
                    if failed {
                        raw::check(status.MPI_ERROR, "MPI_Isend")?;
                    }
                } else if failed {
                    // A longer message than ours (MPI_ERR_TRUNCATE): its first `len` bytes,
                    // the fingerprint among them, are in the slot.
                    reqs[i] = null;
                    got[i] = Some(usize::MAX);
                } else {
                    let mut n: c_int = 0;
                    // SAFETY: `status` was filled by the completed receive.
                    unsafe { ffi::MPI_Get_count(status, raw::byte_type(), &mut n) };
                    got[i] = Some(usize::try_from(n).unwrap_or(0));
                }
            }
            Ok(reqs.iter().all(|r| *r == null))
        })?;
        if !matches!(out, Outcome::Done) {
            st.send.leak();
            st.recv.leak();
            let missing: Vec<usize> = (0..np)
                .filter(|&k| got[k].is_none())
                .map(|k| self.members[peers[k]])
                .collect();
            return Err(match out {
                Outcome::Lost(r, d) => self.lost(fp, r, d),
                _ => self.timeout(fp, missing),
            });
        }
        Ok(got.into_iter().map(|b| b.unwrap_or(0)).collect())
    }

    /// The error for peer `j` (group rank) whose message of `bytes` bytes (`usize::MAX`:
    /// more than `len`) does not match ours: its fingerprint differs (`Mismatch`, naming
    /// both), or it is unreadable or of another length with the same fingerprint.
    fn peer_error(
        &self,
        fp: &Fingerprint,
        j: usize,
        bytes: usize,
        len: usize,
        words: &[u64],
    ) -> CommError {
        let other_rank = self.members[j];
        let readable = bytes >= HDR;
        let theirs = readable.then(|| unpack(words)).flatten();
        match theirs {
            Some(theirs) if theirs != *fp => CommError::Mismatch {
                rank: self.me(),
                other_rank,
                mine: *fp,
                theirs,
                group_size: self.members.len(),
                flight_record: self.g.flight_record(),
            },
            _ => CommError::Backend(format!(
                "rank {other_rank} sent a message of {} for {} #{} where {len} bytes were \
                 expected, with {}; are both ranks running the same build of tp?",
                if bytes == usize::MAX {
                    "more bytes".to_string()
                } else {
                    format!("{bytes} bytes")
                },
                fp.op,
                fp.seq,
                if readable {
                    format!("fingerprint words {words:?}")
                } else {
                    "no readable fingerprint".to_string()
                }
            )),
        }
    }

    /// Starts a non-blocking op on the scratch buffers and waits for it; on failure the
    /// request and both scratch buffers are leaked, since MPI may still use them.
    fn run(
        &self,
        st: &mut State,
        fp: &Fingerprint,
        deadline: Instant,
        start: impl FnOnce(&mut ffi::MPI_Request) -> c_int,
        what: &str,
    ) -> Result<()> {
        let mut req = [raw::null_request()];
        wait_net_delay(self.g);
        {
            let _l = raw::lock();
            raw::check(start(&mut req[0]), what)?;
        }
        match wait::poll(self.g, &mut req, &self.others(), deadline)? {
            Outcome::Done => Ok(()),
            other => {
                st.send.leak();
                st.recv.leak();
                Err(match other {
                    Outcome::Lost(r, d) => self.lost(fp, r, d),
                    _ => self.timeout(fp, self.others()),
                })
            }
        }
    }
}

/// Tests the pending buffered sends and drops the completed ones.
fn reap(st: &mut State) -> Result<()> {
    if st.sends.is_empty() {
        return Ok(());
    }
    let _l = raw::lock();
    let mut err = Ok(());
    st.sends.retain_mut(|p| {
        let mut flag: c_int = 0;
        // SAFETY: `p.req` is a send request (or null once complete); `p.data` is alive.
        let rc = unsafe { ffi::MPI_Test(&mut p.req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        if rc != ffi::MPI_SUCCESS as c_int {
            err = raw::check(rc, "MPI_Test");
        }
        flag == 0
    });
    err
}

/// World ranks of every rank of `comm`.
fn world_ranks(comm: Comm, size: usize) -> Result<Vec<usize>> {
    let ranks: Vec<c_int> = (0..size as c_int).collect();
    let mut out = vec![0 as c_int; size];
    // SAFETY: reading an immutable handle constant.
    let mut grp = unsafe { ffi::RSMPI_GROUP_NULL };
    let mut wgrp = grp;
    // SAFETY: live communicators, out-params sized `size`; the groups are freed again.
    unsafe {
        raw::check(ffi::MPI_Comm_group(comm.0, &mut grp), "MPI_Comm_group")?;
        raw::check(
            ffi::MPI_Comm_group(ffi::RSMPI_COMM_WORLD, &mut wgrp),
            "MPI_Comm_group",
        )?;
        raw::check(
            ffi::MPI_Group_translate_ranks(
                grp,
                size as c_int,
                ranks.as_ptr(),
                wgrp,
                out.as_mut_ptr(),
            ),
            "MPI_Group_translate_ranks",
        )?;
        ffi::MPI_Group_free(&mut grp);
        ffi::MPI_Group_free(&mut wgrp);
    }
    out.into_iter()
        .map(|r| {
            usize::try_from(r).map_err(|_| CommError::Backend("rank outside the world".into()))
        })
        .collect()
}

/// Writes packed fingerprint words at the head of a message.
fn write_header(words: &[u64; FP_WORDS], out: &mut [u8]) {
    for (w, o) in words.iter().zip(out.chunks_exact_mut(8)) {
        o.copy_from_slice(&w.to_le_bytes());
    }
}

/// The fingerprint words at the head of a received message (`HDR` bytes or more).
fn read_header(at: &[u8]) -> Vec<u64> {
    at[..HDR]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect()
}

fn pack(fp: &Fingerprint) -> [u64; FP_WORDS] {
    [
        u64::from(fp.op.code()),
        fp.seq,
        u64::from(fp.dtype.code()),
        fp.count,
        fp.detail,
    ]
}

fn unpack(w: &[u64]) -> Option<Fingerprint> {
    Some(Fingerprint {
        op: OpKind::from_code(u8::try_from(*w.first()?).ok()?)?,
        seq: *w.get(1)?,
        dtype: DType::from_code(u8::try_from(*w.get(2)?).ok()?)?,
        count: *w.get(3)?,
        detail: *w.get(4)?,
    })
}

impl MpiComm {
    /// Waits (with the deadline) for this handle's buffered sends to complete; returns
    /// whether they all did. Sends that did not are leaked, since MPI may still read them.
    pub(crate) fn drain_sends(&self) -> bool {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut reqs: Vec<ffi::MPI_Request> = st.sends.iter().map(|p| p.req).collect();
        let drained = reqs.is_empty()
            || matches!(
                wait::poll(
                    self.g,
                    &mut reqs,
                    &self.others(),
                    Instant::now() + self.g.timeout
                ),
                Ok(Outcome::Done)
            );
        let sends = std::mem::take(&mut st.sends);
        if drained {
            drop(sends);
        } else {
            std::mem::forget(sends);
        }
        drained && st.poisoned.is_none()
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if self.g.finalized.load(Ordering::SeqCst) || !self.drain_sends() {
            // After MPI_Finalize nothing may be freed; after a failure MPI may still use
            // these communicators and buffers.
            return;
        }
        let _l = raw::lock();
        // SAFETY: no request of this handle is pending any more; the handles are ours.
        unsafe {
            ffi::MPI_Comm_free(&mut self.comm.0);
            ffi::MPI_Comm_free(&mut self.ctl.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_pack_and_unpack() {
        let fp = Fingerprint {
            op: OpKind::ReduceScatter,
            seq: 41,
            dtype: DType::BF16,
            count: 1 << 40,
            detail: u64::MAX,
        };
        assert_eq!(unpack(&pack(&fp)), Some(fp));
        assert_eq!(unpack(&[99, 0, 1, 0, 0]), None);
        assert_eq!(unpack(&[1, 0, 1]), None);
    }

    #[test]
    fn counts_above_i32_max_are_invalid_arguments() {
        assert!(raw::int_count(0, c_int::MAX as usize, "x").is_ok());
        let e = raw::int_count(3, c_int::MAX as usize + 1, "the buffer").unwrap_err();
        assert!(
            matches!(e, CommError::InvalidArgument { rank: 3, .. }),
            "{e}"
        );
    }
}
