//! A communicator wrapper that counts calls by op, so tests can pin the collectives a layer
//! issues (docs/design.md "Tests": collective counts per layer pinned by a recording communicator).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tp_comm::{Group, Intercept, OpKind, Result};

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

impl Intercept for RecordingComm {
    fn inner(&self) -> &Group {
        &self.inner
    }
    fn before(&self, op: OpKind) -> Option<Result<()>> {
        self.record(op);
        None
    }
}
