//! `LocalComm`: the collectives of the local backend over a shared [`GroupShared`].
//!
//! Every call: publish the fingerprint (and either copy a small buffer into the slot's
//! scratch or publish the buffer's address), meet at the barrier with a deadline, compare
//! all fingerprints (R2), then move data. Large calls meet at a second barrier before
//! returning, since peers read and write this rank's buffer until then; that second wait has
//! no deadline because every rank past the first barrier only does bounded copying.
//! Reductions run in rank order, so every rank gets bitwise identical results (R10).

use super::group::{GroupShared, Message, SMALL_BYTES};
use super::world::WaitFailure;
use crate::communicator::{check, Communicator, Group};
use crate::dtype::{DType, ReduceOp};
use crate::error::{CommError, Fingerprint, OpKind, Result};
use crate::reduce::reduce_into;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// One rank's handle on a local group.
pub struct LocalComm {
    g: Arc<GroupShared>,
    rank: usize,
    seq: AtomicU64,
    sent: Vec<AtomicU64>,
    received: Vec<AtomicU64>,
    busy: AtomicBool,
}

impl std::fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "LocalComm(group {}, rank {}/{})",
            self.g.id,
            self.rank,
            self.g.size()
        )
    }
}

/// Where a rank's contribution to a call lives.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Path {
    Scratch,
    Direct,
}

/// Bytes reduced per step of the direct all-reduce (fits L1 with its sources).
const BLOCK_WORDS: usize = 2048;

impl LocalComm {
    pub(crate) fn new(g: Arc<GroupShared>, rank: usize) -> Self {
        let n = g.size();
        LocalComm {
            g,
            rank,
            seq: AtomicU64::new(0),
            sent: (0..n).map(|_| AtomicU64::new(0)).collect(),
            received: (0..n).map(|_| AtomicU64::new(0)).collect(),
            busy: AtomicBool::new(false),
        }
    }

    pub(super) fn world_rank(&self) -> usize {
        self.g.members[self.rank]
    }

    fn invalid(&self, message: String) -> CommError {
        CommError::InvalidArgument {
            rank: self.world_rank(),
            message,
        }
    }

    /// Runs one collective: entry bookkeeping, the op, and the flight record.
    pub(super) fn collective<R>(
        &self,
        op: OpKind,
        dtype: DType,
        count: usize,
        detail: u64,
        body: impl FnOnce(&Call) -> Result<R>,
    ) -> Result<R> {
        if self.busy.swap(true, Ordering::Acquire) {
            return Err(self.invalid(
                "two threads called collectives on the same handle at once; give each thread \
                 its own group (split) or serialize the calls"
                    .into(),
            ));
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let fp = Fingerprint {
            op,
            seq,
            dtype,
            count: count as u64,
            detail,
        };
        let me = self.world_rank();
        let world = &self.g.world;
        world.flights[me].start(self.g.id, self.g.size(), fp);
        let call = Call {
            comm: self,
            fp,
            parity: (seq & 1) as usize,
            deadline: Instant::now() + world.opts.timeout,
        };
        self.g.slots[self.rank]
            .entered
            .store(seq + 1, Ordering::Relaxed);
        self.g.slots[self.rank].write_fp(call.parity, &fp);
        let out = body(&call);
        world.flights[me].finish(self.g.id, out.is_ok());
        self.busy.store(false, Ordering::Release);
        out
    }
}

/// The state of one collective call in progress.
pub(super) struct Call<'a> {
    comm: &'a LocalComm,
    pub(super) fp: Fingerprint,
    parity: usize,
    deadline: Instant,
}

impl Call<'_> {
    pub(super) fn g(&self) -> &GroupShared {
        &self.comm.g
    }

    pub(super) fn me(&self) -> usize {
        self.comm.world_rank()
    }

    /// Publishes this rank's contribution: a copy into scratch, or the buffer's address.
    pub(super) fn publish(&self, path: Path, data: *const u8, len: usize) {
        let slot = &self.g().slots[self.comm.rank];
        match path {
            // SAFETY: our own slot, before the barrier of this parity (see group.rs).
            Path::Scratch => unsafe {
                slot.fill_scratch(self.parity, std::slice::from_raw_parts(data, len))
            },
            Path::Direct => slot.ptr[self.parity].store(data as usize, Ordering::Relaxed),
        }
    }

    /// Start of rank `j`'s contribution.
    pub(super) fn source(&self, path: Path, j: usize) -> *const u8 {
        let slot = &self.g().slots[j];
        match path {
            Path::Scratch => slot.scratch_ptr(self.parity),
            Path::Direct => slot.ptr[self.parity].load(Ordering::Relaxed) as *const u8,
        }
    }

    /// The first barrier, with the deadline, then the fingerprint comparison.
    pub(super) fn meet(&self) -> Result<()> {
        let g = self.g();
        let world = &g.world;
        let gen = match g.barrier.arrive() {
            Ok(super::barrier::Arrival::Completed) => {
                world.wake_all();
                None
            }
            Ok(super::barrier::Arrival::Waiting(gen)) => Some(gen),
            Err(cause) => return Err(self.poisoned(cause)),
        };
        if let Some(gen) = gen {
            let waited = world.wait(&g.members, Some(self.deadline), || {
                g.barrier.poll(gen).is_some()
            });
            match waited {
                Ok(()) => {
                    if g.barrier.poll(gen) == Some(false) {
                        return Err(self.poisoned(g.barrier.cause()));
                    }
                }
                Err(failure) => {
                    let (cause, err) = self.failure_error(failure);
                    if !g.barrier.withdraw(gen, cause) {
                        world.wake_all();
                        return Err(err);
                    }
                }
            }
        }
        self.verify()
    }

    /// The second barrier of a direct call: peers may still touch our buffer until it.
    pub(super) fn leave(&self) {
        let g = self.g();
        let arrival = g.barrier.arrive();
        if let Ok(super::barrier::Arrival::Completed) = arrival {
            g.world.wake_all();
        }
        if let Ok(super::barrier::Arrival::Waiting(gen)) = arrival {
            // No deadline and no liveness check: every rank past `meet` finishes its bounded
            // copying and arrives, and returning earlier would free memory peers still use.
            let _always_ok = g.world.wait(&[], None, || g.barrier.poll(gen).is_some());
        }
    }

    fn verify(&self) -> Result<()> {
        let g = self.g();
        for (j, slot) in g.slots.iter().enumerate() {
            let theirs = slot.read_fp(self.parity);
            if theirs != Some(self.fp) {
                let other_rank = g.members[j];
                let theirs = theirs.unwrap_or(Fingerprint {
                    op: OpKind::Barrier,
                    seq: u64::MAX,
                    dtype: DType::U8,
                    count: 0,
                    detail: 0,
                });
                g.barrier.poison(format!(
                    "desync: rank {} called [{}], rank {other_rank} called [{theirs}]",
                    self.me(),
                    self.fp
                ));
                g.world.wake_all();
                return Err(CommError::Mismatch {
                    rank: self.me(),
                    other_rank,
                    mine: self.fp,
                    theirs,
                    group_size: g.size(),
                    flight_record: g.world.flight_record(),
                });
            }
        }
        Ok(())
    }

    fn poisoned(&self, cause: String) -> CommError {
        CommError::Poisoned {
            rank: self.me(),
            op: self.fp.op,
            seq: self.fp.seq,
            cause,
            flight_record: self.g().world.flight_record(),
        }
    }

    /// The error for a failed wait, and the poison cause peers will see.
    fn failure_error(&self, failure: WaitFailure) -> (String, CommError) {
        let g = self.g();
        let flight_record = g.world.flight_record();
        match failure {
            WaitFailure::Lost(lost_rank, why) => (
                format!("rank {lost_rank} is gone ({why})"),
                CommError::PeerLost {
                    rank: self.me(),
                    lost_rank,
                    why,
                    op: self.fp.op,
                    seq: self.fp.seq,
                    group_size: g.size(),
                    flight_record,
                },
            ),
            WaitFailure::TimedOut => {
                let missing: Vec<usize> = g
                    .slots
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.entered.load(Ordering::Relaxed) <= self.fp.seq)
                    .map(|(j, _)| g.members[j])
                    .collect();
                (
                    format!(
                        "rank {} timed out in {} #{} waiting for ranks {missing:?}",
                        self.me(),
                        self.fp.op,
                        self.fp.seq
                    ),
                    CommError::Timeout {
                        rank: self.me(),
                        op: self.fp.op,
                        seq: self.fp.seq,
                        waited: g.world.opts.timeout,
                        missing,
                        group_size: g.size(),
                        flight_record,
                    },
                )
            }
        }
    }
}

/// Element range `[lo, hi)` of part `j` when `count` elements are cut into `n` balanced parts.
fn part(count: usize, n: usize, j: usize) -> (usize, usize) {
    let lo = (count as u128 * j as u128 / n as u128) as usize;
    let hi = (count as u128 * (j + 1) as u128 / n as u128) as usize;
    (lo, hi)
}

pub(super) fn prefix(counts: &[usize]) -> Vec<usize> {
    let mut offs = Vec::with_capacity(counts.len() + 1);
    let mut acc = 0;
    offs.push(0);
    for c in counts {
        acc += c;
        offs.push(acc);
    }
    offs
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.g.size()
    }

    fn backend(&self) -> &'static str {
        "local"
    }

    fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let count = check::elements(self.world_rank(), buf.len(), dtype, "the buffer")?;
        let n = self.size();
        let path = if buf.len() <= SMALL_BYTES {
            Path::Scratch
        } else {
            Path::Direct
        };
        let len = buf.len();
        let base = buf.as_mut_ptr();
        self.collective(OpKind::AllReduce, dtype, count, u64::from(op.code()), |c| {
            c.publish(path, base, len);
            c.meet()?;
            match path {
                Path::Scratch => {
                    // SAFETY: every rank's scratch holds `len` bytes written before the barrier.
                    let srcs: Vec<&[u8]> = (0..n)
                        .map(|j| unsafe { std::slice::from_raw_parts(c.source(path, j), len) })
                        .collect();
                    // SAFETY: `base` is our own buffer of `len` bytes; nobody else writes it
                    // on this path.
                    let dst = unsafe { std::slice::from_raw_parts_mut(base, len) };
                    reduce_into(dst, &srcs, dtype, op);
                }
                Path::Direct => {
                    // This rank owns part `rank` of every buffer: it reads that part from all
                    // ranks and writes the result back to all of them. Parts are disjoint.
                    let es = dtype.size();
                    let (lo, hi) = part(count, n, self.rank);
                    let mut tmp = vec![0u64; BLOCK_WORDS];
                    let block = BLOCK_WORDS * 8;
                    let bases: Vec<*mut u8> =
                        (0..n).map(|j| c.source(path, j) as *mut u8).collect();
                    let mut off = lo * es;
                    let end = hi * es;
                    while off < end {
                        let blen = block.min(end - off);
                        let t = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut tmp)[..blen];
                        // SAFETY: part `rank` of each buffer is read and written only by this
                        // rank between the two barriers.
                        let srcs: Vec<&[u8]> = bases
                            .iter()
                            .map(|&b| unsafe { std::slice::from_raw_parts(b.add(off), blen) })
                            .collect();
                        reduce_into(t, &srcs, dtype, op);
                        for &b in &bases {
                            unsafe { std::ptr::copy_nonoverlapping(t.as_ptr(), b.add(off), blen) };
                        }
                        off += blen;
                    }
                    c.leave();
                }
            }
            Ok(())
        })
    }

    fn all_gather_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        counts: &[usize],
    ) -> Result<()> {
        let me = self.world_rank();
        let (_, total) = check::gather_args(
            me,
            self.rank,
            self.size(),
            (send.len(), recv.len()),
            dtype,
            counts,
        )?;
        let es = dtype.size();
        let largest = counts.iter().copied().max().unwrap_or(0) * es;
        let path = if largest <= SMALL_BYTES {
            Path::Scratch
        } else {
            Path::Direct
        };
        let offs = prefix(counts);
        self.collective(
            OpKind::AllGather,
            dtype,
            total,
            check::counts_hash(counts),
            |c| {
                c.publish(path, send.as_ptr(), send.len());
                c.meet()?;
                for (j, w) in offs.windows(2).enumerate() {
                    let (lo, hi) = (w[0] * es, w[1] * es);
                    // SAFETY: rank j's contribution holds counts[j] elements and stays put
                    // until the second barrier (direct) or the next call of this parity.
                    let src = unsafe { std::slice::from_raw_parts(c.source(path, j), hi - lo) };
                    recv[lo..hi].copy_from_slice(src);
                }
                if path == Path::Direct {
                    c.leave();
                }
                Ok(())
            },
        )
    }

    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let me = self.world_rank();
        let (total, _) = check::scatter_args(
            me,
            self.rank,
            self.size(),
            (send.len(), recv.len()),
            dtype,
            counts,
        )?;
        let es = dtype.size();
        let path = if send.len() <= SMALL_BYTES {
            Path::Scratch
        } else {
            Path::Direct
        };
        let offs = prefix(counts);
        let detail = check::counts_hash(counts) ^ u64::from(op.code()) << 56;
        self.collective(OpKind::ReduceScatter, dtype, total, detail, |c| {
            c.publish(path, send.as_ptr(), send.len());
            c.meet()?;
            let (lo, hi) = (offs[self.rank] * es, offs[self.rank + 1] * es);
            // SAFETY: every rank's send buffer holds `total` elements, alive until `leave`.
            let srcs: Vec<&[u8]> = (0..self.size())
                .map(|j| unsafe { std::slice::from_raw_parts(c.source(path, j).add(lo), hi - lo) })
                .collect();
            reduce_into(recv, &srcs, dtype, op);
            if path == Path::Direct {
                c.leave();
            }
            Ok(())
        })
    }

    fn all_to_all_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        self.all_to_all_local(send, send_counts, recv, recv_counts, dtype)
    }

    fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> Result<()> {
        let me = self.world_rank();
        let count = check::elements(me, buf.len(), dtype, "the buffer")?;
        check::peer(me, self.size(), root, "root")?;
        let path = if buf.len() <= SMALL_BYTES {
            Path::Scratch
        } else {
            Path::Direct
        };
        self.collective(OpKind::Broadcast, dtype, count, root as u64, |c| {
            if self.rank == root {
                c.publish(path, buf.as_ptr(), buf.len());
            }
            c.meet()?;
            if self.rank != root {
                // SAFETY: the root's buffer (or scratch) holds the same length, verified.
                let src = unsafe { std::slice::from_raw_parts(c.source(path, root), buf.len()) };
                buf.copy_from_slice(src);
            }
            if path == Path::Direct {
                c.leave();
            }
            Ok(())
        })
    }

    fn send_bytes(&self, buf: &[u8], dtype: DType, dst: usize, tag: u32) -> Result<()> {
        let me = self.world_rank();
        let count = check::elements(me, buf.len(), dtype, "the send buffer")?;
        check::peer(me, self.size(), dst, "destination")?;
        check::tag(me, tag)?;
        let seq = self.sent[dst].fetch_add(1, Ordering::Relaxed);
        let world = &self.g.world;
        let fp = Fingerprint {
            op: OpKind::Send,
            seq,
            dtype,
            count: count as u64,
            detail: u64::from(tag),
        };
        world.flights[me].start(self.g.id, self.size(), fp);
        let dst_world = self.g.members[dst];
        if let Some((lost_rank, why)) = world.lost_member(&[dst_world]) {
            world.flights[me].finish(self.g.id, false);
            return Err(CommError::PeerLost {
                rank: me,
                lost_rank,
                why,
                op: OpKind::Send,
                seq,
                group_size: self.size(),
                flight_record: world.flight_record(),
            });
        }
        let msg = Message {
            tag,
            dtype,
            seq,
            data: buf.to_vec(),
        };
        self.g.mailboxes[self.rank * self.size() + dst]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(msg);
        world.wake_all();
        world.flights[me].finish(self.g.id, true);
        Ok(())
    }

    fn recv_bytes(&self, buf: &mut [u8], dtype: DType, src: usize, tag: u32) -> Result<()> {
        let me = self.world_rank();
        let count = check::elements(me, buf.len(), dtype, "the receive buffer")?;
        check::peer(me, self.size(), src, "source")?;
        check::tag(me, tag)?;
        let seq = self.received[src].load(Ordering::Relaxed);
        let world = &self.g.world;
        let fp = Fingerprint {
            op: OpKind::Recv,
            seq,
            dtype,
            count: count as u64,
            detail: u64::from(tag),
        };
        world.flights[me].start(self.g.id, self.size(), fp);
        let mailbox = &self.g.mailboxes[src * self.size() + self.rank];
        let src_world = self.g.members[src];
        let deadline = Instant::now() + world.opts.timeout;
        let waited = world.wait(&[src_world], Some(deadline), || {
            !mailbox.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
        });
        let result = match waited {
            Err(WaitFailure::Lost(lost_rank, why)) => Err(CommError::PeerLost {
                rank: me,
                lost_rank,
                why,
                op: OpKind::Recv,
                seq,
                group_size: self.size(),
                flight_record: world.flight_record(),
            }),
            Err(WaitFailure::TimedOut) => Err(CommError::Timeout {
                rank: me,
                op: OpKind::Recv,
                seq,
                waited: world.opts.timeout,
                missing: vec![src_world],
                group_size: self.size(),
                flight_record: world.flight_record(),
            }),
            Ok(()) => {
                let mut q = mailbox.lock().unwrap_or_else(|p| p.into_inner());
                match q.front() {
                    Some(m) if m.tag == tag && m.dtype == dtype && m.data.len() == buf.len() => {
                        buf.copy_from_slice(&m.data);
                        q.pop_front();
                        self.received[src].fetch_add(1, Ordering::Relaxed);
                        Ok(())
                    }
                    Some(m) => Err(CommError::Mismatch {
                        rank: me,
                        other_rank: src_world,
                        mine: fp,
                        theirs: Fingerprint {
                            op: OpKind::Send,
                            seq: m.seq,
                            dtype: m.dtype,
                            count: (m.data.len() / m.dtype.size()) as u64,
                            detail: u64::from(m.tag),
                        },
                        group_size: self.size(),
                        flight_record: world.flight_record(),
                    }),
                    None => Err(self.invalid("message vanished from the mailbox".into())),
                }
            }
        };
        world.flights[me].finish(self.g.id, result.is_ok());
        result
    }

    fn barrier(&self) -> Result<()> {
        self.collective(OpKind::Barrier, DType::U8, 0, 0, |c| c.meet())
    }

    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Group>> {
        let n = self.size();
        let split_seq = self.seq.load(Ordering::Relaxed);
        let mine = [color.map_or(0, |c| u64::from(c) + 1), key as u64];
        let mut all = vec![0u64; 2 * n];
        crate::CommExt::all_gather(self, &mine, &mut all)?;
        let Some(color) = color else {
            return Ok(None);
        };
        let mut members: Vec<(u64, usize)> = (0..n)
            .filter(|&j| all[2 * j] == mine[0])
            .map(|j| (all[2 * j + 1], j))
            .collect();
        members.sort_unstable();
        let new_rank = members
            .iter()
            .position(|&(_, j)| j == self.rank)
            .ok_or_else(|| self.invalid("split lost this rank".into()))?;
        let world_members: Vec<usize> = members.iter().map(|&(_, j)| self.g.members[j]).collect();
        let world = &self.g.world;
        let shared = {
            let mut reg = world.registry.lock().unwrap_or_else(|p| p.into_inner());
            let k = (self.g.id, split_seq, color);
            let entry = reg.entry(k).or_insert_with(|| {
                let len = world_members.len();
                (GroupShared::new(Arc::clone(world), world_members), len)
            });
            let shared = Arc::clone(&entry.0);
            entry.1 -= 1;
            if entry.1 == 0 {
                reg.remove(&k);
            }
            shared
        };
        Ok(Some(Arc::new(LocalComm::new(shared, new_rank))))
    }
}
