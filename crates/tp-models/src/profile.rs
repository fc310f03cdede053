//! Where a rank's forward time goes: compute, all-reduce, and waiting for the slowest rank.
//!
//! With `barriers` on, each all-reduce is preceded by a barrier: time in the barrier is time
//! spent waiting for the slowest rank to arrive, time in the all-reduce after it is the
//! reduction itself. Off (the default) costs nothing but the clock reads.

use std::time::{Duration, Instant};
use tp_comm::{CommError, Group};

#[derive(Clone, Debug, Default)]
pub struct Profile {
    /// Insert a barrier before every all-reduce to separate waiting from reducing.
    pub barriers: bool,
    /// Wall time inside forward passes, communication included.
    pub total: Duration,
    /// Time inside all-reduces and gathers (after the barrier when `barriers`).
    pub comm: Duration,
    /// Time in the barriers (waiting for the slowest rank).
    pub wait: Duration,
    pub all_reduces: usize,
    /// Bytes this rank sent in collectives, as a bandwidth-optimal algorithm sends them
    /// (see [`Profile::sent_all_reduce`] and [`Profile::sent_all_gather`]).
    pub sent_bytes: u64,
    /// Mixture of experts: tokens each expert took, summed over layers (the routing is
    /// replicated, so every rank counts the same); without a capacity factor, the tokens
    /// routed to it.
    pub expert_tokens: Vec<u64>,
    /// Mixture of experts: (token, expert) rows this rank's experts computed, over layers.
    pub expert_rows: u64,
    /// Mixture of experts: (token, expert) pairs routed to each expert that the capacity
    /// factor dropped, summed over layers (every rank counts the same).
    pub expert_dropped: Vec<u64>,
    started: Option<Instant>,
}

impl Profile {
    pub fn with_barriers() -> Self {
        Profile {
            barriers: true,
            ..Profile::default()
        }
    }

    /// Compute time: total minus communication and waiting.
    pub fn compute(&self) -> Duration {
        self.total.saturating_sub(self.comm + self.wait)
    }

    pub(crate) fn start_compute(&mut self) {
        self.started = Some(Instant::now());
    }

    pub(crate) fn stop_compute(&mut self) {
        if let Some(s) = self.started.take() {
            self.total += s.elapsed();
        }
    }

    /// Times receiving a pipeline stage's input: waiting for the stage before.
    pub(crate) fn stage_recv(
        &mut self,
        op: impl FnOnce() -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let t = Instant::now();
        let out = op();
        self.wait += t.elapsed();
        out
    }

    /// Times sending `bytes` to the next pipeline stage (buffered: no wait for the receiver).
    pub(crate) fn stage_send(
        &mut self,
        bytes: usize,
        op: impl FnOnce() -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let t = Instant::now();
        let out = op();
        self.comm += t.elapsed();
        self.sent_bytes += bytes as u64;
        out
    }

    /// Runs an all-reduce (with its barrier when profiling).
    pub(crate) fn all_reduce(
        &mut self,
        group: &Group,
        op: impl FnOnce(&Group) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        if self.barriers {
            let t = Instant::now();
            group.barrier()?;
            self.wait += t.elapsed();
        }
        let t = Instant::now();
        let out = op(group);
        self.comm += t.elapsed();
        self.all_reduces += 1;
        out
    }

    /// Times a communication call made outside the forward pass (logit gathers).
    pub fn time_comm<T>(
        &mut self,
        op: impl FnOnce() -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        let t = Instant::now();
        let out = op();
        let e = t.elapsed();
        self.comm += e;
        self.total += e;
        out
    }

    /// Counts an all-reduce of `bytes` over `ranks`: a ring sends `2 (ranks - 1) / ranks` of
    /// the buffer from each rank.
    pub fn sent_all_reduce(&mut self, bytes: usize, ranks: usize) {
        let r = ranks.max(1) as u64;
        self.sent_bytes += 2 * (r - 1) * bytes as u64 / r;
    }

    /// Counts an all-gather where this rank contributes `own_bytes`: they go to every other
    /// rank once.
    pub fn sent_all_gather(&mut self, own_bytes: usize, ranks: usize) {
        self.sent_bytes += (ranks.max(1) as u64 - 1) * own_bytes as u64;
    }

    /// Counts a layer's routing: `routes[t]` are token t's experts of `count`.
    pub(crate) fn count_routes(&mut self, routes: &[Vec<(usize, f32)>], count: usize) {
        if self.expert_tokens.len() < count {
            self.expert_tokens.resize(count, 0);
        }
        for &(e, _) in routes.iter().flatten() {
            self.expert_tokens[e] += 1;
        }
    }

    /// Counts a layer's dropped pairs: `dropped[e]` of expert e.
    pub(crate) fn count_dropped(&mut self, dropped: &[u64]) {
        add_counts(&mut self.expert_dropped, dropped);
    }

    /// (token, expert) pairs the capacity factor dropped, over experts and layers.
    pub fn expert_dropped_total(&self) -> u64 {
        self.expert_dropped.iter().sum()
    }

    /// Adds another profile's figures (e.g. per-step into per-run).
    pub fn add(&mut self, other: &Profile) {
        add_counts(&mut self.expert_tokens, &other.expert_tokens);
        add_counts(&mut self.expert_dropped, &other.expert_dropped);
        self.expert_rows += other.expert_rows;
        self.sent_bytes += other.sent_bytes;
        self.total += other.total;
        self.comm += other.comm;
        self.wait += other.wait;
        self.all_reduces += other.all_reduces;
    }
}

/// `sum += add` per expert, `sum` grown to `add`'s length.
fn add_counts(sum: &mut Vec<u64>, add: &[u64]) {
    if sum.len() < add.len() {
        sum.resize(add.len(), 0);
    }
    for (a, b) in sum.iter_mut().zip(add) {
        *a += b;
    }
}
