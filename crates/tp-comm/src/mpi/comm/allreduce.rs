//! The MPI backend's all-reduce, over point-to-point messages in the buffer's own dtype (f16
//! and bf16 travel as 2 bytes) and reduced here in rank order 0..n with `reduce_into`, the
//! local backend's kernel: every rank gets the same bits, and the same bits as the local
//! backend (R10).
//!
//! - Small buffers: one message per peer carrying the fingerprint and the whole buffer (one
//!   round trip, like a plain `MPI_Allreduce`), checked on receipt (R2).
//! - Large buffers: after a fingerprint exchange, a chunked, pipelined reduce-scatter to the
//!   owner of each contiguous shard and all-gather of the reduced chunks: each rank sends
//!   2(n-1)/n of the buffer (as a ring does), the reduction of chunk c overlaps the transfer
//!   of the next chunks, and all progress is one `MPI_Testsome` loop under the deadline.

use super::{wait_net_delay, MpiComm, State};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Fingerprint, Result};
use crate::mpi::raw;
use crate::mpi::wait::{self, Outcome};
use crate::reduce::reduce_into;
use mpi::ffi;
use std::ops::Range;
use std::os::raw::c_int;
use std::time::Instant;

/// Buffers whose bytes sent per rank, (n-1) x size, stay within this go in one message.
pub(super) const DIRECT_MAX: usize = 256 << 10;
/// Bytes per pipelined message.
const CHUNK: usize = 512 << 10;
/// Reduce-scatter messages a rank keeps in flight per peer.
const WINDOW: usize = 4;
/// Tags of the pipelined messages on the data communicator, above every user send tag
/// (`MAX_TAG * 16 + 15 < 2^24`).
const RS_TAG: c_int = 1 << 25;
const AG_TAG: c_int = (1 << 25) + 1;

impl MpiComm {
    /// The all-reduce body run inside `collective_with` (no separate exchange before it).
    pub(super) fn all_reduce_body(
        &self,
        st: &mut State,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        fp: &Fingerprint,
        deadline: Instant,
    ) -> Result<()> {
        let n = self.members.len();
        if n == 1 {
            return Ok(());
        }
        if buf.len().saturating_mul(n - 1) <= DIRECT_MAX {
            self.swap(st, fp, buf, deadline, self.g.verify)?;
            let len = super::HDR + buf.len();
            // Our own contribution is the copy in the send scratch (the sends are complete).
            let own = &st.send.bytes(len)[super::HDR..];
            let recv = st.recv.bytes(len * (n - 1));
            let srcs: Vec<&[u8]> = (0..n)
                .map(|j| {
                    if j == self.rank {
                        own
                    } else {
                        let k = if j < self.rank { j } else { j - 1 };
                        &recv[k * len + super::HDR..(k + 1) * len]
                    }
                })
                .collect();
            reduce_into(buf, &srcs, dtype, op);
            return Ok(());
        }
        if self.g.verify {
            self.exchange(st, fp, deadline)?;
        }
        self.pipelined(st, buf, dtype, op, fp, deadline)
    }

    fn pipelined(
        &self,
        st: &mut State,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        fp: &Fingerprint,
        deadline: Instant,
    ) -> Result<()> {
        let n = self.members.len();
        let me = self.rank;
        let plan = Plan::new(buf.len(), dtype.size(), n);
        let peers = self.peers();
        let mine = plan.chunks(me);
        let mc = mine.len();
        let my_shard = plan.shard(me);
        let total = buf.len();
        // Receive scratch: [all-gather area: total | rs pieces: (n-1) x shard | result: shard]
        let piece = my_shard.len();
        let rs_base = total;
        let res_base = total + (n - 1) * piece;
        let sp = st.send.bytes(total).as_mut_ptr();
        let rp = st.recv.bytes(res_base + piece).as_mut_ptr();
        let bp = buf.as_mut_ptr();
        let comm = self.comm.0;
        let null = raw::null_request();

        // Reduce-scatter sends: chunk-major, peers in ring order from the next rank.
        let order: Vec<(usize, Range<usize>)> = {
            let per: Vec<Vec<Range<usize>>> = peers.iter().map(|&j| plan.chunks(j)).collect();
            let most = per.iter().map(Vec::len).max().unwrap_or(0);
            let mut o = Vec::new();
            for c in 0..most {
                for step in 1..n {
                    let j = (me + step) % n;
                    let k = if j < me { j } else { j - 1 };
                    if let Some(r) = per[k].get(c) {
                        o.push((j, r.clone()));
                    }
                }
            }
            o
        };
        let ag_chunks: Vec<(usize, Range<usize>)> = peers
            .iter()
            .flat_map(|&j| plan.chunks(j).into_iter().map(move |r| (j, r)))
            .collect();
        let mut rs_send = vec![null; order.len()];
        let mut rs_recv = vec![null; (n - 1) * mc];
        let mut ag_send = vec![null; (n - 1) * mc];
        let mut ag_recv = vec![null; ag_chunks.len()];
        let mut idx = vec![0 as c_int; order.len().max(rs_recv.len()).max(ag_recv.len())];
        let mut arrived = vec![0usize; mc];
        let (mut next, mut inflight, mut reduced) = (0usize, 0usize, 0usize);
        let to_int = |b: usize| raw::int_count(self.me(), b, "a message (bytes)");
        {
            let _l = raw::lock();
            for (k, &j) in peers.iter().enumerate() {
                for (c, r) in mine.iter().enumerate() {
                    let at = rs_base + k * piece + (r.start - my_shard.start);
                    // SAFETY: `at + r.len()` is within the receive scratch (sized above); it
                    // is leaked if the request does not complete.
                    unsafe {
                        raw::irecv_bytes(
                            rp.add(at),
                            to_int(r.len())?,
                            j,
                            RS_TAG,
                            comm,
                            &mut rs_recv[k * mc + c],
                        )?
                    };
                }
            }
            for (i, (j, r)) in ag_chunks.iter().enumerate() {
                // SAFETY: `r` lies within the all-gather area (the first `total` bytes).
                unsafe {
                    raw::irecv_bytes(
                        rp.add(r.start),
                        to_int(r.len())?,
                        *j,
                        AG_TAG,
                        comm,
                        &mut ag_recv[i],
                    )?
                };
            }
        }
        wait_net_delay(self.g);
        let mut ag_started = false;
        let out = wait::poll_until(self.g, &self.others(), deadline, || {
            // 1. Keep WINDOW reduce-scatter chunks in flight per peer, copying each into the
            //    send scratch just before it goes (the user's buffer is never handed to MPI).
            while next < order.len() && inflight < WINDOW * (n - 1) {
                let (j, r) = &order[next];
                // SAFETY: `r` is within both `buf` and the send scratch (`total` bytes each),
                // and no request reads or writes this range of the send scratch yet.
                unsafe { std::ptr::copy_nonoverlapping(bp.add(r.start), sp.add(r.start), r.len()) };
                // SAFETY: the send scratch range stays untouched until the request
                // completes; it is leaked on failure.
                unsafe {
                    raw::isend_bytes(
                        sp.add(r.start).cast_const(),
                        to_int(r.len())?,
                        *j,
                        RS_TAG,
                        comm,
                        &mut rs_send[next],
                    )?
                };
                self.g.count_sent(r.len());
                next += 1;
                inflight += 1;
            }
            inflight -= test_some(&mut rs_send, &mut idx)?.len();
            // 2. Reduce each of this rank's chunks once every peer's piece is in, and send
            //    the result to every peer.
            for i in test_some(&mut rs_recv, &mut idx)? {
                let c = i % mc;
                arrived[c] += 1;
                if arrived[c] < n - 1 {
                    continue;
                }
                let r = &mine[c];
                let off = r.start - my_shard.start;
                // SAFETY: every peer's piece of chunk `c` has arrived (its receive completed)
                // and no request touches the result range or `buf[r]` now; the ranges are
                // disjoint parts of the scratch and of `buf`.
                let (dst, srcs) = unsafe {
                    let dst = std::slice::from_raw_parts_mut(rp.add(res_base + off), r.len());
                    let srcs: Vec<&[u8]> = (0..n)
                        .map(|j| {
                            if j == me {
                                std::slice::from_raw_parts(bp.add(r.start).cast_const(), r.len())
                            } else {
                                let k = if j < me { j } else { j - 1 };
                                std::slice::from_raw_parts(
                                    rp.add(rs_base + k * piece + off).cast_const(),
                                    r.len(),
                                )
                            }
                        })
                        .collect();
                    (dst, srcs)
                };
                reduce_into(dst, &srcs, dtype, op);
                drop(srcs);
                // SAFETY: `buf[r]` is no longer read by anyone; `dst` is its result.
                unsafe { std::ptr::copy_nonoverlapping(dst.as_ptr(), bp.add(r.start), r.len()) };
                if !ag_started {
                    ag_started = true;
                    wait_net_delay(self.g);
                }
                for (k, &j) in peers.iter().enumerate() {
                    // SAFETY: the result range is never written again in this call; it
                    // is leaked with the scratch on failure.
                    unsafe {
                        raw::isend_bytes(
                            rp.add(res_base + off).cast_const(),
                            to_int(r.len())?,
                            j,
                            AG_TAG,
                            comm,
                            &mut ag_send[k * mc + c],
                        )?
                    };
                    self.g.count_sent(r.len());
                }
                reduced += 1;
            }
            // 3. Reduced chunks of the other shards go to `buf` as they arrive.
            for i in test_some(&mut ag_recv, &mut idx)? {
                let r = &ag_chunks[i].1;
                // SAFETY: the receive of this range completed; `buf[r]` was already copied
                // into the send scratch (its reduce-scatter message went out before the
                // owner could reduce it).
                unsafe { std::ptr::copy_nonoverlapping(rp.add(r.start), bp.add(r.start), r.len()) };
            }
            test_some(&mut ag_send, &mut idx)?;
            Ok(next == order.len()
                && reduced == mc
                && [&rs_send, &rs_recv, &ag_send, &ag_recv]
                    .iter()
                    .all(|v| v.iter().all(|q| *q == null)))
        })?;
        match out {
            Outcome::Done => Ok(()),
            other => {
                st.send.leak();
                st.recv.leak();
                let missing: Vec<usize> = peers
                    .iter()
                    .enumerate()
                    .filter(|(k, j)| {
                        rs_recv[k * mc..(k + 1) * mc].iter().any(|q| *q != null)
                            || ag_chunks
                                .iter()
                                .zip(&ag_recv)
                                .any(|((o, _), q)| o == *j && *q != null)
                    })
                    .map(|(_, &j)| self.members[j])
                    .collect();
                Err(match other {
                    Outcome::Lost(r, d) => self.lost(fp, r, d),
                    _ => self.timeout(fp, missing),
                })
            }
        }
    }
}

/// `MPI_Testsome` over `reqs`: the indices that completed in this pass (they become
/// `MPI_REQUEST_NULL`).
fn test_some(reqs: &mut [ffi::MPI_Request], idx: &mut [c_int]) -> Result<Vec<usize>> {
    if reqs.is_empty() {
        return Ok(Vec::new());
    }
    let mut outcount: c_int = 0;
    let n = c_int::try_from(reqs.len()).unwrap_or(c_int::MAX);
    raw::check(
        // SAFETY: `reqs` holds live requests or MPI_REQUEST_NULL; `idx` has room for
        // `reqs.len()` indices (the caller sizes it to the longest request array).
        unsafe {
            ffi::MPI_Testsome(
                n,
                reqs.as_mut_ptr(),
                &mut outcount,
                idx.as_mut_ptr(),
                ffi::RSMPI_STATUSES_IGNORE,
            )
        },
        "MPI_Testsome",
    )?;
    // MPI_UNDEFINED (negative) when no request was active.
    let got = usize::try_from(outcount).unwrap_or(0).min(idx.len());
    Ok(idx[..got]
        .iter()
        .filter_map(|&i| usize::try_from(i).ok())
        .filter(|&i| i < reqs.len())
        .collect())
}

/// How a buffer of `bytes` (elements of `elem` bytes) splits into one contiguous shard per
/// rank and each shard into chunks of about `CHUNK` bytes; every rank computes the same plan.
struct Plan {
    count: usize,
    elem: usize,
    n: usize,
}

impl Plan {
    fn new(bytes: usize, elem: usize, n: usize) -> Plan {
        Plan {
            count: bytes / elem.max(1),
            elem: elem.max(1),
            n,
        }
    }

    /// Byte range of rank `k`'s shard.
    fn shard(&self, k: usize) -> Range<usize> {
        let lo = k * self.count / self.n;
        let hi = (k + 1) * self.count / self.n;
        lo * self.elem..hi * self.elem
    }

    /// Byte ranges of the chunks of rank `k`'s shard.
    fn chunks(&self, k: usize) -> Vec<Range<usize>> {
        let s = self.shard(k);
        let step = (CHUNK / self.elem).max(1) * self.elem;
        (s.start..s.end)
            .step_by(step)
            .map(|a| a..(a + step).min(s.end))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_the_buffer_once_in_whole_elements() {
        for (bytes, elem, n) in [(4 << 20, 4, 2), (3 * CHUNK + 6, 2, 3), (1000 * 8, 8, 4)] {
            let p = Plan::new(bytes, elem, n);
            let mut at = 0;
            for k in 0..n {
                for r in p.chunks(k) {
                    assert_eq!(r.start, at);
                    assert!(r.len() <= CHUNK && r.len() % elem == 0 && !r.is_empty());
                    at = r.end;
                }
                assert_eq!(p.shard(k).end, at);
            }
            assert_eq!(at, bytes);
        }
    }
}
