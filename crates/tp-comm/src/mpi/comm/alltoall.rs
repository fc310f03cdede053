//! The MPI backend's all-to-all: one message per peer on the control communicator (one
//! round trip, over [`MpiComm::post_exchange`]) carrying the fingerprint, this rank's whole
//! send and receive counts, and this rank's block for that peer. Every rank so sees the whole
//! counts table and checks it the same way: where a pair disagrees, every rank fails alike with
//! `CountsMismatch` before any block is used (R2), as on the local backend. The fingerprint
//! rides in each message anyway, so it is checked whatever `verify` says.

use super::{pack, read_header, write_header, MpiComm, HDR};
use crate::communicator::{check, Communicator};
use crate::dtype::DType;
use crate::error::{CommError, OpKind, Result};

/// Start of each block, in elements (one more entry than `counts`: the total).
fn prefix(counts: &[usize]) -> Vec<usize> {
    let mut offs = vec![0];
    offs.extend(counts.iter().scan(0, |acc, &c| {
        *acc += c;
        Some(*acc)
    }));
    offs
}

/// `counts` as little-endian u64 words.
fn encode(counts: &[usize], out: &mut Vec<u8>) {
    for &c in counts {
        out.extend_from_slice(&(c as u64).to_le_bytes());
    }
}

fn decode(bytes: &[u8]) -> Vec<usize> {
    bytes
        .chunks_exact(8)
        .map(|c| {
            let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            usize::try_from(w).unwrap_or(usize::MAX)
        })
        .collect()
}

impl MpiComm {
    /// `Communicator::all_to_all_bytes` of the MPI backend.
    pub(super) fn all_to_all_mpi(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        let n = self.size();
        check::all_to_all_args(
            self.me(),
            n,
            (send.len(), recv.len()),
            dtype,
            (send_counts, recv_counts),
        )?;
        let es = dtype.size();
        // Fingerprint, then n send counts and n receive counts, then the block.
        let head = HDR + 16 * n;
        let (soffs, roffs) = (prefix(send_counts), prefix(recv_counts));
        let peers = self.peers();
        let layout = |counts: &[usize]| {
            let mut at = 0;
            peers
                .iter()
                .map(|&j| {
                    let len = head + counts[j] * es;
                    at += len;
                    (at - len, len)
                })
                .collect::<Vec<_>>()
        };
        let (sends, recvs) = (layout(send_counts), layout(recv_counts));
        // The counts differ by rank, so the fingerprint carries none; the table check does.
        self.collective_with(OpKind::AllToAll, dtype, 0, 0, false, |st, fp, dl| {
            let mine = pack(fp);
            let mut counts = Vec::with_capacity(16 * n);
            encode(send_counts, &mut counts);
            encode(recv_counts, &mut counts);
            let total = sends.last().map_or(0, |&(o, l)| o + l);
            let out = st.send.bytes(total);
            for (&(o, l), &j) in sends.iter().zip(&peers) {
                let m = &mut out[o..o + l];
                write_header(&mine, m);
                m[HDR..head].copy_from_slice(&counts);
                m[head..].copy_from_slice(&send[soffs[j] * es..soffs[j + 1] * es]);
            }
            let got = if peers.is_empty() {
                Vec::new()
            } else {
                self.post_exchange(st, fp, &sends, &recvs, dl)?
            };
            let total = recvs.last().map_or(0, |&(o, l)| o + l);
            let msgs = st.recv.bytes(total);
            let mut table_send = vec![send_counts.to_vec(); n];
            let mut table_recv = vec![recv_counts.to_vec(); n];
            for (k, &j) in peers.iter().enumerate() {
                let (o, l) = recvs[k];
                let m = &msgs[o..o + l];
                let words = read_header(m);
                // A message too short for the counts (or of another call) is not readable.
                if words != mine || got[k] < head {
                    return Err(self.peer_error(fp, j, got[k], l, &words));
                }
                table_send[j] = decode(&m[HDR..HDR + 8 * n]);
                table_recv[j] = decode(&m[HDR + 8 * n..head]);
            }
            let disagreement =
                check::counts_disagreement(n, |i| &table_send[i], |j| &table_recv[j]);
            if let Some((i, j, sent, expected)) = disagreement {
                return Err(CommError::CountsMismatch {
                    rank: self.me(),
                    op: OpKind::AllToAll,
                    seq: fp.seq,
                    sender: self.members[i],
                    receiver: self.members[j],
                    sent,
                    expected,
                    group_size: n,
                    flight_record: self.g.flight_record(),
                });
            }
            let r = self.rank;
            recv[roffs[r] * es..roffs[r + 1] * es]
                .copy_from_slice(&send[soffs[r] * es..soffs[r + 1] * es]);
            for (k, &j) in peers.iter().enumerate() {
                let (o, l) = recvs[k];
                if got[k] != l {
                    // The table agreed, so the peer's block has our count: another build.
                    return Err(self.peer_error(fp, j, got[k], l, &read_header(&msgs[o..])));
                }
                recv[roffs[j] * es..roffs[j + 1] * es].copy_from_slice(&msgs[o + head..o + l]);
            }
            Ok(())
        })
    }
}
