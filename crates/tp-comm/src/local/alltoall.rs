//! The local backend's all-to-all: every rank publishes its send buffer and both counts
//! vectors, all ranks check the whole counts table after the first barrier (so every rank
//! fails alike when a pair disagrees), then each copies its blocks straight out of the peers'
//! send buffers and meets them at the second barrier.

use super::ops::{prefix, Call, LocalComm, Path};
use crate::communicator::{check, Communicator};
use crate::dtype::DType;
use crate::error::{CommError, OpKind, Result};

/// What a rank publishes for one all-to-all: pointers to its send buffer and its two counts
/// vectors (one entry per rank each), alive until the call's second barrier.
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
        // The counts differ by rank, so the fingerprint carries none; the table check does.
        self.collective(OpKind::AllToAll, dtype, 0, 0, |c| {
            c.publish(Path::Direct, (&view as *const View).cast(), 0);
            c.meet()?;
            // SAFETY: after the barrier every rank's slot holds the address of its `View`,
            // whose slices hold `n` counts each (checked against the same group's size before
            // the call) and stay alive and unwritten until `leave`.
            let views: Vec<&View> = (0..n)
                .map(|j| unsafe { &*c.source(Path::Direct, j).cast::<View>() })
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
            c.leave();
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
fn copy_blocks(rank: usize, views: &[&View], recv: &mut [u8], recv_counts: &[usize], dtype: DType) {
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
