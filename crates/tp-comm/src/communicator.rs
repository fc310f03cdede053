//! The `Communicator` trait (one rank's handle on a group) and its typed helpers.
//!
//! The trait is object safe and speaks bytes plus a [`DType`]; [`CommExt`] adds the typed
//! calls layers use (`comm.all_reduce(&mut x, ReduceOp::Sum)`). Semantics follow MPI:
//! every rank of a group calls the same collectives in the same order.

use crate::dtype::{DType, Elem, ReduceOp};
use crate::error::{CommError, Result};
use std::sync::Arc;

/// A cheap, clonable handle on a group.
pub type Group = Arc<dyn Communicator>;

/// One rank's view of a group of ranks.
///
/// Buffers are byte slices whose length is a multiple of `dtype.size()`; `counts` are in
/// elements. Every call has a deadline set by the backend's options.
pub trait Communicator: Send + Sync + std::fmt::Debug {
    /// This rank's index in the group, `0..size`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// Backend name: "local" or "mpi".
    fn backend(&self) -> &'static str;

    /// In place: every rank ends with the element-wise reduction over ranks, in rank order.
    fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()>;
    /// Rank r contributes `send` (`counts[r]` elements); `recv` holds every rank's part in rank
    /// order (`sum(counts)` elements). Uneven counts are allowed.
    fn all_gather_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        counts: &[usize],
    ) -> Result<()>;
    /// `send` holds `sum(counts)` elements on every rank; rank r receives the reduction of part
    /// r (`counts[r]` elements) into `recv`.
    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()>;
    /// Every rank sends a block to every rank (MPI_Alltoallv): block j of `send`
    /// (`send_counts[j]` elements, blocks in rank order) goes to rank j, and rank j's block for
    /// this rank lands in block j of `recv` (`recv_counts[j]` elements). Rank i's
    /// `send_counts[j]` must equal rank j's `recv_counts[i]`; where they disagree every rank
    /// returns [`CommError::CountsMismatch`]. Zero counts (empty peers, empty calls) are allowed.
    fn all_to_all_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()>;
    /// `buf` of `root` is copied to every rank.
    fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> Result<()>;
    /// Buffered send: returns once the data is copied out; messages between a pair of ranks
    /// arrive in order. `tag` < 2^20 must match the receiver's.
    fn send_bytes(&self, buf: &[u8], dtype: DType, dst: usize, tag: u32) -> Result<()>;
    /// Receives the next message from `src`; its tag, dtype and length must match.
    fn recv_bytes(&self, buf: &mut [u8], dtype: DType, src: usize, tag: u32) -> Result<()>;
    /// Returns when every rank of the group has entered it.
    fn barrier(&self) -> Result<()>;
    /// Collective: ranks with the same `color` form a new group, ordered by (`key`, rank).
    /// `None` takes part in the call without joining any group.
    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Group>>;
}

/// Typed helpers over any [`Communicator`].
pub trait CommExt: Communicator {
    fn all_reduce<T: Elem>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_bytes(bytemuck::cast_slice_mut(buf), T::DTYPE, op)
    }
    /// Even all-gather: every rank sends `send.len()` elements.
    fn all_gather<T: Elem>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let counts = vec![send.len(); self.size()];
        self.all_gather_v(send, recv, &counts)
    }
    fn all_gather_v<T: Elem>(&self, send: &[T], recv: &mut [T], counts: &[usize]) -> Result<()> {
        self.all_gather_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            counts,
        )
    }
    /// Even reduce-scatter: every rank receives `recv.len()` elements.
    fn reduce_scatter<T: Elem>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        let counts = vec![recv.len(); self.size()];
        self.reduce_scatter_v(send, recv, &counts, op)
    }
    fn reduce_scatter_v<T: Elem>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            counts,
            op,
        )
    }
    /// Even all-to-all (MPI_Alltoall): `send` holds one block of `send.len() / size`
    /// elements per rank, in rank order; block j goes to rank j, and rank j's block for this
    /// rank lands in block j of `recv` (same length as `send` on every rank).
    fn all_to_all<T: Elem>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let n = self.size();
        for (what, len) in [("send", send.len()), ("receive", recv.len())] {
            if !len.is_multiple_of(n) {
                return Err(CommError::InvalidArgument {
                    rank: self.rank(),
                    message: format!(
                        "all_to_all: the {what} buffer holds {len} elements, not a whole block \
                         for each of the group's {n} ranks; give it a multiple of {n} elements \
                         or use all_to_all_v for uneven blocks"
                    ),
                });
            }
        }
        let send_counts = vec![send.len() / n; n];
        let recv_counts = vec![recv.len() / n; n];
        self.all_to_all_v(send, &send_counts, recv, &recv_counts)
    }
    /// All-to-all with per-peer counts (MPI_Alltoallv): block j of `send` (`send_counts[j]`
    /// elements) goes to rank j; rank j's block (`recv_counts[j]` elements) lands in block j
    /// of `recv`. See [`Communicator::all_to_all_bytes`].
    fn all_to_all_v<T: Elem>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.all_to_all_bytes(
            bytemuck::cast_slice(send),
            send_counts,
            bytemuck::cast_slice_mut(recv),
            recv_counts,
            T::DTYPE,
        )
    }
    fn broadcast<T: Elem>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_bytes(bytemuck::cast_slice_mut(buf), T::DTYPE, root)
    }
    fn send<T: Elem>(&self, buf: &[T], dst: usize, tag: u32) -> Result<()> {
        self.send_bytes(bytemuck::cast_slice(buf), T::DTYPE, dst, tag)
    }
    fn recv<T: Elem>(&self, buf: &mut [T], src: usize, tag: u32) -> Result<()> {
        self.recv_bytes(bytemuck::cast_slice_mut(buf), T::DTYPE, src, tag)
    }
}

impl<C: Communicator + ?Sized> CommExt for C {}

/// Largest tag a caller may use.
pub const MAX_TAG: u32 = (1 << 20) - 1;

/// Argument checks shared by the backends; the messages say what to fix.
pub(crate) mod check {
    use super::*;

    pub fn elements(rank: usize, bytes: usize, dtype: DType, what: &str) -> Result<usize> {
        if !bytes.is_multiple_of(dtype.size()) {
            return Err(CommError::InvalidArgument {
                rank,
                message: format!(
                    "{what} has {bytes} bytes, not a multiple of {} ({dtype})",
                    dtype.size()
                ),
            });
        }
        Ok(bytes / dtype.size())
    }

    pub fn peer(rank: usize, size: usize, peer: usize, what: &str) -> Result<()> {
        if peer >= size {
            return Err(CommError::InvalidArgument {
                rank,
                message: format!(
                    "{what} {peer} is out of range for a {size}-rank group (0..{size})"
                ),
            });
        }
        Ok(())
    }

    pub fn tag(rank: usize, tag: u32) -> Result<()> {
        if tag > MAX_TAG {
            return Err(CommError::InvalidArgument {
                rank,
                message: format!("tag {tag} is above the largest tag {MAX_TAG}"),
            });
        }
        Ok(())
    }

    /// Checks a counts vector against the group size and this rank's buffers.
    #[allow(clippy::too_many_arguments)] // each is a distinct fact the message names
    pub fn counts(
        world_rank: usize,
        rank: usize,
        size: usize,
        counts: &[usize],
        mine: usize,
        total: usize,
        mine_what: &str,
        total_what: &str,
    ) -> Result<()> {
        let bad = |message: String| {
            Err(CommError::InvalidArgument {
                rank: world_rank,
                message,
            })
        };
        if counts.len() != size {
            return bad(format!(
                "counts has {} entries but the group has {size} ranks",
                counts.len()
            ));
        }
        let sum: usize = counts.iter().sum();
        if counts[rank] != mine {
            return bad(format!(
                "{mine_what} holds {mine} elements but counts[{rank}] = {}",
                counts[rank]
            ));
        }
        if sum != total {
            return bad(format!(
                "{total_what} holds {total} elements but the counts add up to {sum}"
            ));
        }
        Ok(())
    }

    /// All-gather arguments: `send` holds this rank's `counts[rank]` elements, `recv` their
    /// sum. Returns (elements sent, elements received).
    pub fn gather_args(
        world_rank: usize,
        rank: usize,
        size: usize,
        (send, recv): (usize, usize),
        dtype: DType,
        counts: &[usize],
    ) -> Result<(usize, usize)> {
        let mine = elements(world_rank, send, dtype, "the send buffer")?;
        let total = elements(world_rank, recv, dtype, "the receive buffer")?;
        self::counts(
            world_rank,
            rank,
            size,
            counts,
            mine,
            total,
            "the send buffer",
            "the receive buffer",
        )?;
        Ok((mine, total))
    }

    /// Reduce-scatter arguments: `send` holds the sum of `counts`, `recv` this rank's part.
    /// Returns (elements sent, elements received).
    pub fn scatter_args(
        world_rank: usize,
        rank: usize,
        size: usize,
        (send, recv): (usize, usize),
        dtype: DType,
        counts: &[usize],
    ) -> Result<(usize, usize)> {
        let total = elements(world_rank, send, dtype, "the send buffer")?;
        let mine = elements(world_rank, recv, dtype, "the receive buffer")?;
        self::counts(
            world_rank,
            rank,
            size,
            counts,
            mine,
            total,
            "the receive buffer",
            "the send buffer",
        )?;
        Ok((total, mine))
    }

    /// All-to-all arguments: `send_counts` and `recv_counts` have an entry per rank and add
    /// up to the send and receive buffers. Returns (elements sent, elements received).
    pub fn all_to_all_args(
        world_rank: usize,
        size: usize,
        (send, recv): (usize, usize),
        dtype: DType,
        (send_counts, recv_counts): (&[usize], &[usize]),
    ) -> Result<(usize, usize)> {
        let sent = elements(world_rank, send, dtype, "the send buffer")?;
        let received = elements(world_rank, recv, dtype, "the receive buffer")?;
        for (what, counts, held) in [
            ("send", send_counts, sent),
            ("receive", recv_counts, received),
        ] {
            let bad = |message: String| {
                Err(CommError::InvalidArgument {
                    rank: world_rank,
                    message,
                })
            };
            if counts.len() != size {
                return bad(format!(
                    "the {what} counts have {} entries but the group has {size} ranks; give \
                     one count per rank",
                    counts.len()
                ));
            }
            let sum = counts
                .iter()
                .try_fold(0usize, |a, &c| a.checked_add(c))
                .unwrap_or(usize::MAX);
            if sum != held {
                return bad(format!(
                    "the {what} buffer holds {held} elements but the {what} counts add up to \
                     {sum}"
                ));
            }
        }
        Ok((sent, received))
    }

    /// The first pair, in (sender, receiver) rank order, whose all-to-all counts disagree:
    /// `(i, j, send_counts of i for j, recv_counts of j for i)`. `send(i)` and `recv(j)` are
    /// rank i's send counts and rank j's receive counts, `n` entries each. Every rank that
    /// sees the whole table finds the same pair.
    pub fn counts_disagreement<'a>(
        n: usize,
        send: impl Fn(usize) -> &'a [usize],
        recv: impl Fn(usize) -> &'a [usize],
    ) -> Option<(usize, usize, usize, usize)> {
        (0..n).find_map(|i| {
            let row = send(i);
            (0..n).find_map(|j| {
                let (sent, expected) = (row[j], recv(j)[i]);
                (sent != expected).then_some((i, j, sent, expected))
            })
        })
    }

    /// An order-sensitive hash of the counts, so ranks that disagree on them are caught.
    pub fn counts_hash(counts: &[usize]) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &c in counts {
            h ^= c as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h
    }
}
