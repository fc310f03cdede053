//! [`Intercept`]: a communicator that wraps another and sees every call first (fault injection,
//! call counting) gets the whole `Communicator` from one hook instead of re-spelling each method.

use crate::communicator::{Communicator, Group};
use crate::dtype::{DType, ReduceOp};
use crate::error::{OpKind, Result};

/// A wrapper around another group handle. Every [`Communicator`] call first goes to
/// [`Intercept::before`] with its op; `None` passes the call on to [`Intercept::inner`] unchanged,
/// `Some(result)` answers it instead (the inner communicator never sees it).
pub trait Intercept: Send + Sync + std::fmt::Debug {
    /// The wrapped handle.
    fn inner(&self) -> &Group;
    /// Called before each call of `op` (`OpKind::Split` included) reaches the inner handle.
    fn before(&self, op: OpKind) -> Option<Result<()>>;
}

impl<T: Intercept> Communicator for T {
    fn rank(&self) -> usize {
        self.inner().rank()
    }
    fn size(&self) -> usize {
        self.inner().size()
    }
    fn backend(&self) -> &'static str {
        self.inner().backend()
    }
    fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        match self.before(OpKind::AllReduce) {
            Some(r) => r,
            None => self.inner().all_reduce_bytes(buf, dtype, op),
        }
    }
    fn all_gather_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        counts: &[usize],
    ) -> Result<()> {
        match self.before(OpKind::AllGather) {
            Some(r) => r,
            None => self.inner().all_gather_bytes(send, recv, dtype, counts),
        }
    }
    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        match self.before(OpKind::ReduceScatter) {
            Some(r) => r,
            None => self
                .inner()
                .reduce_scatter_bytes(send, recv, dtype, counts, op),
        }
    }
    fn all_to_all_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        match self.before(OpKind::AllToAll) {
            Some(r) => r,
            None => self
                .inner()
                .all_to_all_bytes(send, send_counts, recv, recv_counts, dtype),
        }
    }
    fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> Result<()> {
        match self.before(OpKind::Broadcast) {
            Some(r) => r,
            None => self.inner().broadcast_bytes(buf, dtype, root),
        }
    }
    fn send_bytes(&self, buf: &[u8], dtype: DType, dst: usize, tag: u32) -> Result<()> {
        match self.before(OpKind::Send) {
            Some(r) => r,
            None => self.inner().send_bytes(buf, dtype, dst, tag),
        }
    }
    fn recv_bytes(&self, buf: &mut [u8], dtype: DType, src: usize, tag: u32) -> Result<()> {
        match self.before(OpKind::Recv) {
            Some(r) => r,
            None => self.inner().recv_bytes(buf, dtype, src, tag),
        }
    }
    fn barrier(&self) -> Result<()> {
        match self.before(OpKind::Barrier) {
            Some(r) => r,
            None => self.inner().barrier(),
        }
    }
    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Group>> {
        match self.before(OpKind::Split) {
            Some(r) => r.map(|()| None),
            None => self.inner().split(color, key),
        }
    }
}
