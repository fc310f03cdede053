//! The `Communicator` operations of [`MpiComm`](super::MpiComm): argument checks, scratch
//! staging and the non-blocking MPI call of each collective; buffered send and probed recv.

use super::allreduce::DIRECT_MAX;
use super::{reap, MpiComm, PendingSend, State, HDR};
use crate::communicator::{check, Communicator, Group};
use crate::dtype::{DType, ReduceOp};
use crate::error::{CommError, Fingerprint, OpKind, Result};
use crate::mpi::convert::{is_half, narrow, widen};
use crate::mpi::raw::{self, Comm};
use crate::mpi::wait::{self, Outcome};
use mpi::ffi;
use std::os::raw::c_int;
use std::sync::Arc;
use std::time::Instant;

/// Groups up to this size run a barrier as one all-to-all fingerprint exchange.
const SWAP_BARRIER_MAX: usize = 8;

fn prefix(counts: &[c_int]) -> Vec<c_int> {
    let mut acc = 0;
    counts
        .iter()
        .map(|c| {
            let o = acc;
            acc += c;
            o
        })
        .collect()
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let count = check::elements(self.me(), buf.len(), dtype, "the buffer")?;
        raw::int_count(self.me(), count, "the buffer")?;
        self.collective_with(
            OpKind::AllReduce,
            dtype,
            count,
            u64::from(op.code()),
            false,
            |st, fp, dl| self.all_reduce_body(st, buf, dtype, op, fp, dl),
        )
    }

    fn all_gather_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        counts: &[usize],
    ) -> Result<()> {
        let me = self.me();
        let (_, total) = check::gather_args(
            me,
            self.rank,
            self.size(),
            (send.len(), recv.len()),
            dtype,
            counts,
        )?;
        raw::int_count(me, total, "the receive buffer")?;
        let n = self.size();
        let elem = dtype.size();
        let widest = counts
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .saturating_mul(elem);
        if widest.saturating_mul(n - 1) <= DIRECT_MAX {
            // One message per peer with the fingerprint in front (one round trip).
            let bytes: Vec<usize> = counts.iter().map(|&c| c * elem).collect();
            return self.collective_with(
                OpKind::AllGather,
                dtype,
                total,
                check::counts_hash(counts),
                false,
                |st, fp, dl| {
                    let slot = self.swap_v(st, fp, send, |j| bytes[j], dl, self.g.verify)?;
                    let got = st.recv.bytes(slot * (n - 1));
                    let mut at = 0;
                    for (j, &b) in bytes.iter().enumerate() {
                        let piece = if j == self.rank {
                            send
                        } else {
                            let k = if j < self.rank { j } else { j - 1 };
                            &got[k * slot + HDR..k * slot + HDR + b]
                        };
                        recv[at..at + b].copy_from_slice(piece);
                        at += b;
                    }
                    Ok(())
                },
            );
        }
        let icounts: Vec<c_int> = counts
            .iter()
            .map(|&c| raw::int_count(me, c, "a count"))
            .collect::<Result<_>>()?;
        let displs = prefix(&icounts);
        self.collective(
            OpKind::AllGather,
            dtype,
            total,
            check::counts_hash(counts),
            |st, fp, dl| {
                let s = st.send.bytes(send.len());
                s.copy_from_slice(send);
                let sp = s.as_ptr();
                let rp = st.recv.bytes(recv.len()).as_mut_ptr();
                let (comm, dt) = (self.comm.0, raw::datatype(dtype));
                let my = icounts[self.rank];
                self.run(
                    st,
                    fp,
                    dl,
                    // SAFETY: send scratch holds counts[rank] elements, recv scratch the total; the
                    // count and displacement arrays outlive the call (MPI copies them at post time
                    // in OpenMPI, and they live until this closure's caller returns anyway).
                    |req| unsafe {
                        ffi::MPI_Iallgatherv(
                            sp.cast(),
                            my,
                            dt,
                            rp.cast(),
                            icounts.as_ptr(),
                            displs.as_ptr(),
                            dt,
                            comm,
                            req,
                        )
                    },
                    "MPI_Iallgatherv",
                )?;
                recv.copy_from_slice(st.recv.bytes(recv.len()));
                let n = self.size();
                self.g.count_sent(recv.len() / n * (n - 1));
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
        let me = self.me();
        let (total, mine) = check::scatter_args(
            me,
            self.rank,
            self.size(),
            (send.len(), recv.len()),
            dtype,
            counts,
        )?;
        raw::int_count(me, total, "the send buffer")?;
        let icounts: Vec<c_int> = counts
            .iter()
            .map(|&c| raw::int_count(me, c, "a count"))
            .collect::<Result<_>>()?;
        let detail = check::counts_hash(counts) ^ (u64::from(op.code()) << 56);
        self.collective(OpKind::ReduceScatter, dtype, total, detail, |st, fp, dl| {
            let half = is_half(dtype);
            let (swire, rwire, dt) = if half {
                (total * 4, mine * 4, raw::datatype(DType::F32))
            } else {
                (send.len(), recv.len(), raw::datatype(dtype))
            };
            let s = st.send.bytes(swire);
            if half {
                widen(send, dtype, s);
            } else {
                s.copy_from_slice(send);
            }
            let sp = s.as_ptr();
            let rp = st.recv.bytes(rwire).as_mut_ptr();
            let comm = self.comm.0;
            self.run(
                st,
                fp,
                dl,
                // SAFETY: the scratch buffers hold the total and this rank's part in `dt`
                // elements and are leaked by `run` on failure; `icounts` outlives the wait.
                |req| unsafe {
                    ffi::MPI_Ireduce_scatter(
                        sp.cast(),
                        rp.cast(),
                        icounts.as_ptr(),
                        dt,
                        raw::op(op),
                        comm,
                        req,
                    )
                },
                "MPI_Ireduce_scatter",
            )?;
            let n = self.size();
            self.g.count_sent(send.len() / n * (n - 1));
            let r = st.recv.bytes(rwire);
            if half {
                narrow(r, dtype, recv);
            } else {
                recv.copy_from_slice(r);
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
        self.all_to_all_mpi(send, send_counts, recv, recv_counts, dtype)
    }

    fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> Result<()> {
        let me = self.me();
        let count = check::elements(me, buf.len(), dtype, "the buffer")?;
        check::peer(me, self.size(), root, "root")?;
        let n = raw::int_count(me, count, "the buffer")?;
        let peers = self.size() - 1;
        if buf.len().saturating_mul(peers) <= DIRECT_MAX {
            // The root's message carries the fingerprint and the buffer, the others' the
            // fingerprint alone (one round trip, desyncs still caught).
            return self.collective_with(
                OpKind::Broadcast,
                dtype,
                count,
                root as u64,
                false,
                |st, fp, dl| {
                    let len = buf.len();
                    let payload: &[u8] = if self.rank == root { buf } else { &[] };
                    let slot = self.swap_v(
                        st,
                        fp,
                        payload,
                        |j| if j == root { len } else { 0 },
                        dl,
                        self.g.verify,
                    )?;
                    if self.rank != root {
                        let k = if root < self.rank { root } else { root - 1 };
                        let got = st.recv.bytes(slot * peers);
                        buf.copy_from_slice(&got[k * slot + HDR..k * slot + HDR + len]);
                    }
                    Ok(())
                },
            );
        }
        self.collective(
            OpKind::Broadcast,
            dtype,
            count,
            root as u64,
            |st, fp, dl| {
                let s = st.send.bytes(buf.len());
                if self.rank == root {
                    s.copy_from_slice(buf);
                }
                let sp = s.as_mut_ptr();
                let (comm, dt) = (self.comm.0, raw::datatype(dtype));
                self.run(
                    st,
                    fp,
                    dl,
                    // SAFETY: the scratch holds `n` elements of `dt`; leaked by `run` on failure.
                    |req| unsafe { ffi::MPI_Ibcast(sp.cast(), n, dt, root as c_int, comm, req) },
                    "MPI_Ibcast",
                )?;
                if self.rank != root {
                    buf.copy_from_slice(st.send.bytes(buf.len()));
                } else {
                    self.g.count_sent(buf.len());
                }
                Ok(())
            },
        )
    }

    fn send_bytes(&self, buf: &[u8], dtype: DType, dst: usize, tag: u32) -> Result<()> {
        let me = self.me();
        let count = check::elements(me, buf.len(), dtype, "the send buffer")?;
        check::peer(me, self.size(), dst, "destination")?;
        check::tag(me, tag)?;
        let len = raw::int_count(me, buf.len(), "the send buffer (bytes)")?;
        let mut st = self.state()?;
        let seq = st.sent[dst];
        let fp = Fingerprint {
            op: OpKind::Send,
            seq,
            dtype,
            count: count as u64,
            detail: u64::from(tag),
        };
        self.g.flight.start(self.id, self.size(), fp);
        self.g.set_last(OpKind::Send, seq);
        let out = (|| {
            reap(&mut st)?;
            {
                let _l = raw::lock();
                self.g.drain_notices();
            }
            if let Some((r, d)) = self.g.lost_member(&[self.members[dst]]) {
                return Err(self.lost(&fp, r, d));
            }
            let data = buf.to_vec();
            let mut req = raw::null_request();
            let mpi_tag = (tag * 16 + u32::from(dtype.code())) as c_int;
            super::wait_net_delay(self.g);
            self.g.count_sent(buf.len());
            {
                let _l = raw::lock();
                raw::check(
                    // SAFETY: `data` moves into `st.sends` with the request and lives until the
                    // request completes (or is leaked at drop).
                    unsafe {
                        ffi::MPI_Isend(
                            data.as_ptr().cast(),
                            len,
                            raw::byte_type(),
                            dst as c_int,
                            mpi_tag,
                            self.comm.0,
                            &mut req,
                        )
                    },
                    "MPI_Isend",
                )?;
            }
            st.sends.push(PendingSend { req, _data: data });
            st.sent[dst] += 1;
            Ok(())
        })();
        self.g.flight.finish(self.id, out.is_ok());
        out
    }

    fn recv_bytes(&self, buf: &mut [u8], dtype: DType, src: usize, tag: u32) -> Result<()> {
        let me = self.me();
        let count = check::elements(me, buf.len(), dtype, "the receive buffer")?;
        check::peer(me, self.size(), src, "source")?;
        check::tag(me, tag)?;
        let mut st = self.state()?;
        let seq = st.received[src];
        let fp = Fingerprint {
            op: OpKind::Recv,
            seq,
            dtype,
            count: count as u64,
            detail: u64::from(tag),
        };
        self.g.flight.start(self.id, self.size(), fp);
        self.g.set_last(OpKind::Recv, seq);
        let out = self.recv_inner(&mut st, buf, &fp, src, tag);
        if out.is_ok() {
            st.received[src] += 1;
        }
        self.g.flight.finish(self.id, out.is_ok());
        out
    }

    fn barrier(&self) -> Result<()> {
        if self.size() <= SWAP_BARRIER_MAX {
            // Every rank's fingerprint to every peer: no rank leaves before all have arrived
            // (one round trip; MPI_Ibarrier takes two on two ranks over TCP).
            return self.collective_with(OpKind::Barrier, DType::U8, 0, 0, false, |st, fp, dl| {
                reap(st)?;
                self.swap(st, fp, &[], dl, true)
            });
        }
        self.collective(OpKind::Barrier, DType::U8, 0, 0, |st, fp, dl| {
            reap(st)?;
            let comm = self.comm.0;
            // SAFETY: a barrier request on a live communicator; no buffers.
            self.run(
                st,
                fp,
                dl,
                |req| unsafe { ffi::MPI_Ibarrier(comm, req) },
                "MPI_Ibarrier",
            )
        })
    }

    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Group>> {
        let me = self.me();
        let icolor = match color {
            None => {
                // SAFETY: reading an immutable constant.
                unsafe { ffi::RSMPI_UNDEFINED }
            }
            Some(c) => c_int::try_from(c)
                .map_err(|_| self.invalid(format!("color {c} is above {}", c_int::MAX)))?,
        };
        let ikey = c_int::try_from(key)
            .map_err(|_| self.invalid(format!("key {key} is above {}", c_int::MAX)))?;
        let newcomm = self.collective(OpKind::Split, DType::U8, 0, 0, |st, fp, dl| {
            // Everyone is present once this barrier completes, so the blocking
            // MPI_Comm_split below cannot wait on an absent rank.
            let comm = self.comm.0;
            self.run(
                st,
                fp,
                dl,
                // SAFETY: a barrier request on a live communicator; no buffers.
                |req| unsafe { ffi::MPI_Ibarrier(comm, req) },
                "MPI_Ibarrier",
            )?;
            let _l = raw::lock();
            let mut out = Comm(comm);
            raw::check(
                // SAFETY: collective over `comm`, which every member has entered.
                unsafe { ffi::MPI_Comm_split(comm, icolor, ikey, &mut out.0) },
                "MPI_Comm_split",
            )?;
            Ok(out)
        })?;
        if color.is_none() {
            return Ok(None);
        }
        let _ = me;
        Ok(Some(Arc::new(MpiComm::new(self.g, newcomm)?)))
    }
}

impl MpiComm {
    fn recv_inner(
        &self,
        st: &mut State,
        buf: &mut [u8],
        fp: &Fingerprint,
        src: usize,
        tag: u32,
    ) -> Result<()> {
        let want_tag = (tag * 16 + u32::from(fp.dtype.code())) as c_int;
        let deadline = Instant::now() + self.g.timeout;
        let mut status = raw::empty_status();
        let src_world = self.members[src];
        let comm = self.comm.0;
        let probed = wait::poll_until(self.g, &[src_world], deadline, || {
            let mut flag: c_int = 0;
            // SAFETY: live communicator; valid out-params.
            let rc = unsafe {
                ffi::MPI_Iprobe(
                    src as c_int,
                    ffi::RSMPI_ANY_TAG,
                    comm,
                    &mut flag,
                    &mut status,
                )
            };
            raw::check(rc, "MPI_Iprobe")?;
            Ok(flag != 0)
        })?;
        match probed {
            Outcome::Done => {}
            Outcome::Lost(r, d) => return Err(self.lost(fp, r, d)),
            Outcome::TimedOut => return Err(self.timeout(fp, vec![src_world])),
        }
        let mut bytes: c_int = 0;
        // SAFETY: `status` was filled by the successful probe.
        unsafe { ffi::MPI_Get_count(&status, raw::byte_type(), &mut bytes) };
        let got_tag = status.MPI_TAG;
        if got_tag != want_tag || usize::try_from(bytes).ok() != Some(buf.len()) {
            let tdt = DType::from_code((got_tag & 15) as u8).unwrap_or(DType::U8);
            return Err(CommError::Mismatch {
                rank: self.me(),
                other_rank: src_world,
                mine: *fp,
                theirs: Fingerprint {
                    op: OpKind::Send,
                    seq: fp.seq,
                    dtype: tdt,
                    count: (bytes.max(0) as usize / tdt.size()) as u64,
                    detail: (got_tag / 16) as u64,
                },
                group_size: self.size(),
                flight_record: self.g.flight_record(),
            });
        }
        let r = st.recv.bytes(buf.len());
        let rp = r.as_mut_ptr();
        let mut req = [raw::null_request()];
        {
            let _l = raw::lock();
            raw::check(
                // SAFETY: the probed message (first from `src` with this tag) has exactly
                // `bytes` bytes and the scratch holds as many; leaked below on failure.
                unsafe {
                    ffi::MPI_Irecv(
                        rp.cast(),
                        bytes,
                        raw::byte_type(),
                        src as c_int,
                        want_tag,
                        comm,
                        &mut req[0],
                    )
                },
                "MPI_Irecv",
            )?;
        }
        match wait::poll(self.g, &mut req, &[src_world], deadline)? {
            Outcome::Done => {
                buf.copy_from_slice(st.recv.bytes(buf.len()));
                Ok(())
            }
            other => {
                st.recv.leak();
                st.poisoned = Some(format!("rank {} failed recv #{}", self.me(), fp.seq));
                Err(match other {
                    Outcome::Lost(r, d) => self.lost(fp, r, d),
                    _ => self.timeout(fp, vec![src_world]),
                })
            }
        }
    }
}
