//! The local backend's all-to-all: every rank publishes its send buffer and both counts
//! vectors, all ranks check the whole counts table after the first barrier (so every rank
//! fails alike when a pair disagrees), then each copies its blocks out of the peers' parts.
//!
//! A rank whose counts and send buffer fit its scratch slot copies them there (its slot's
//! pointer then reads 0); a larger one publishes the address of a [`View`] of its own slices.
//! The ranks choose alone (their send sizes differ), and every rank sees every choice after
//! the barrier: the call meets at a second barrier only when some rank published its own
//! buffers, which peers read until then.

use super::group::SMALL_BYTES;
use super::ops::{prefix, Call, LocalComm, Path};
use crate::communicator::{check, Communicator};
use crate::dtype::DType;
use crate::error::{CommError, OpKind, Result};

/// What a rank publishes for one all-to-all: pointers to its send buffer and its two counts
/// vectors (one entry per rank each), alive until the call's second barrier.
/// Bytes of one count.
const W: usize = std::mem::size_of::<usize>();

#[derive(Clone, Copy)]
struct View {
    send: *const u8,
    send_counts: *const usize,
    recv_counts: *const usize,
}

impl LocalComm {
    /// `Communicator::all_to_all_bytes` of the local backend.
    pub(super) fn all_to_all_local(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        let n = self.size();
        check::all_to_all_args(
            self.world_rank(),
            n,
            (send.len(), recv.len()),
            dtype,
            (send_counts, recv_counts),
        )?;
        let view = View {
            send: send.as_ptr(),
            send_counts: send_counts.as_ptr(),
            recv_counts: recv_counts.as_ptr(),
        };
        // Scratch layout: send counts, receive counts (n words each), then the send buffer.
        let small = (2 * W * n).saturating_add(send.len()) <= SMALL_BYTES;
        let staged: Vec<u8> = if small {
            let mut v = Vec::with_capacity(2 * W * n + send.len());
            for &x in send_counts.iter().chain(recv_counts) {
                v.extend_from_slice(&x.to_ne_bytes());
            }
            v.extend_from_slice(send);
            v
        } else {
            Vec::new()
        };
        // The counts differ by rank, so the fingerprint carries none; the table check does.
        self.collective(OpKind::AllToAll, dtype, 0, 0, |c| {
            if small {
                c.publish(Path::Scratch, staged.as_ptr(), staged.len());
                c.publish(Path::Direct, std::ptr::null(), 0);
            } else {
                c.publish(Path::Direct, (&view as *const View).cast(), 0);
            }
            c.meet()?;
            let direct = (0..n).any(|j| !c.source(Path::Direct, j).is_null());
            // SAFETY: after the barrier every rank's slot holds the address of its `View`, or
            // 0 with its counts and send buffer in its scratch (8-byte aligned, counts first);
            // either way `n` counts each (checked against the same group's size before the
            // call), alive and unwritten until `leave` (or this parity's next call).
            let views: Vec<View> = (0..n)
                .map(|j| {
                    let p = c.source(Path::Direct, j);
                    if p.is_null() {
                        let s = c.source(Path::Scratch, j);
                        View {
                            send_counts: s.cast(),
                            recv_counts: unsafe { s.add(W * n) }.cast(),
                            send: unsafe { s.add(2 * W * n) },
                        }
                    } else {
                        unsafe { *p.cast::<View>() }
                    }
                })
                .collect();
            let sends = |i: usize| unsafe { std::slice::from_raw_parts(views[i].send_counts, n) };
            let recvs = |j: usize| unsafe { std::slice::from_raw_parts(views[j].recv_counts, n) };
            let out = match check::counts_disagreement(n, sends, recvs) {
                Some(pair) => Err(counts_mismatch(c, pair)),
                None => {
                    copy_blocks(self.rank(), &views, recv, recv_counts, dtype);
                    Ok(())
                }
            };
            if direct {
                c.leave();
            }
            if let Err(e) = &out {
                // Every rank found the same pair; the group is desynced like after a
                // fingerprint mismatch. Poisoned only now: peers read our counts until `leave`.
                c.g().barrier.poison(e.to_string());
                c.g().world.wake_all();
            }
            out
        })
    }
}

/// Copies block `rank` of every rank j's send buffer into block j of `recv`.
fn copy_blocks(rank: usize, views: &[View], recv: &mut [u8], recv_counts: &[usize], dtype: DType) {
    let es = dtype.size();
    let n = views.len();
    let offs = prefix(recv_counts);
    for (j, v) in views.iter().enumerate() {
        // SAFETY: as in `all_to_all_local`: rank j's counts hold `n` entries until `leave`.
        let theirs = unsafe { std::slice::from_raw_parts(v.send_counts, n) };
        let at: usize = theirs[..rank].iter().sum();
        let len = recv_counts[j] * es;
        // SAFETY: rank j's send buffer holds the sum of its send counts (checked by rank j),
        // so block `rank` (`theirs[rank]` = `recv_counts[j]` elements, the table agreed) lies
        // inside it; it stays put until `leave`.
        let src = unsafe { std::slice::from_raw_parts(v.send.add(at * es), len) };
        recv[offs[j] * es..offs[j] * es + len].copy_from_slice(src);
    }
}

fn counts_mismatch(
    c: &Call<'_>,
    (i, j, sent, expected): (usize, usize, usize, usize),
) -> CommError {
    let g = c.g();
    CommError::CountsMismatch {
        rank: c.me(),
        op: OpKind::AllToAll,
        seq: c.fp.seq,
        sender: g.members[i],
        receiver: g.members[j],
        sent,
        expected,
        group_size: g.size(),
        flight_record: g.world.flight_record(),
    }
}
