//! A communicator wrapper that counts calls by op, so tests can pin the collectives a layer
//! issues (docs/design.md "Tests": collective counts per layer pinned by a recording communicator).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tp_comm::{Communicator, DType, Group, OpKind, ReduceOp, Result};

#[derive(Debug)]
pub struct RecordingComm {
    inner: Group,
    counts: Mutex<HashMap<OpKind, usize>>,
}

impl RecordingComm {
    /// Wraps `inner`; returns the recorder (to read counts) and a [`Group`] to hand to layers.
    pub fn wrap(inner: Group) -> (Arc<RecordingComm>, Group) {
        let rec = Arc::new(RecordingComm {
            inner,
            counts: Mutex::new(HashMap::new()),
        });
        let group: Group = rec.clone();
        (rec, group)
    }

    /// Calls of `op` so far.
    pub fn count(&self, op: OpKind) -> usize {
        self.counts
            .lock()
            .map(|c| c.get(&op).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    /// All counts so far.
    pub fn snapshot(&self) -> HashMap<OpKind, usize> {
        self.counts.lock().map(|c| c.clone()).unwrap_or_default()
    }

    pub fn reset(&self) {
        if let Ok(mut c) = self.counts.lock() {
            c.clear();
        }
    }

    fn record(&self, op: OpKind) {
        if let Ok(mut c) = self.counts.lock() {
            *c.entry(op).or_insert(0) += 1;
        }
    }
}

impl Communicator for RecordingComm {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        self.record(OpKind::AllReduce);
        self.inner.all_reduce_bytes(buf, dtype, op)
    }
    fn all_gather_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        counts: &[usize],
    ) -> Result<()> {
        self.record(OpKind::AllGather);
        self.inner.all_gather_bytes(send, recv, dtype, counts)
    }
    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.record(OpKind::ReduceScatter);
        self.inner
            .reduce_scatter_bytes(send, recv, dtype, counts, op)
    }
    fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> Result<()> {
        self.record(OpKind::Broadcast);
        self.inner.broadcast_bytes(buf, dtype, root)
    }
    fn send_bytes(&self, buf: &[u8], dtype: DType, dst: usize, tag: u32) -> Result<()> {
        self.record(OpKind::Send);
        self.inner.send_bytes(buf, dtype, dst, tag)
    }
    fn recv_bytes(&self, buf: &mut [u8], dtype: DType, src: usize, tag: u32) -> Result<()> {
        self.record(OpKind::Recv);
        self.inner.recv_bytes(buf, dtype, src, tag)
    }
    fn barrier(&self) -> Result<()> {
        self.record(OpKind::Barrier);
        self.inner.barrier()
    }
    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Group>> {
        self.record(OpKind::Split);
        self.inner.split(color, key)
    }
}
