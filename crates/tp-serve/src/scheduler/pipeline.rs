//! Micro-batches in flight across pipeline stages (vLLM's virtual engines, without fixed
//! lanes): with `depth` stages the scheduler keeps up to `depth` steps launched, each over
//! requests no other launched step holds, so while the last stage computes one step the
//! earlier stages compute the next ones. A step's rows come back in launch order; a request
//! in flight is not touched (preempted, forked, closed, drafted for) until they do.
//!
//! Which requests a launch takes: those not in flight that have work, shared evenly over the
//! stages still free (`ceil(free requests / free stages)`), in admission order. At the start
//! (nothing in flight) 8 requests on 2 stages go 4 and 4; later every launch takes the
//! requests its predecessor's landing freed, with the new ones. With one request (or one
//! left) nothing else can start and each step lands at once, as without pipelining.

use super::{Scheduler, StepResult};
use std::time::{Duration, Instant};
use tp_engine::StepExecutor;

/// A step launched and not yet sampled: what its rows belong to.
pub(super) struct Flight {
    /// Per chunk: the request's slot, whether its rows are sampled, and the drafts it
    /// verifies.
    pub(super) rows: Vec<(u32, bool, Vec<u32>)>,
    /// Per chunk: the tokens fed.
    pub(super) fed: Vec<Vec<u32>>,
    /// Per chunk: the rows of logits it returns.
    pub(super) chunk_rows: Vec<usize>,
    pub(super) t0: Instant,
    /// The executor's collective time at launch.
    pub(super) comm_before: Duration,
}

impl Scheduler<'_, '_> {
    /// One round with `depth` stages: a launch when a stage is free and some request not in
    /// flight has work, then a landing when every stage is busy or nothing else can start.
    pub(super) fn pump(&mut self, exec: &mut dyn StepExecutor, depth: usize) -> StepResult<()> {
        if self.flights.len() < depth {
            let share = self.next_share(depth);
            if !share.is_empty() {
                if let Some((chunks, flight)) = self.prepare(exec, &share)? {
                    exec.launch(chunks)?;
                    if !self.flights.is_empty() {
                        self.metrics.pipelined_steps.increment(1);
                    }
                    for (slot, ..) in &flight.rows {
                        if let Some(r) = self.running.iter_mut().find(|r| r.slot == *slot) {
                            r.flying = true;
                        }
                    }
                    self.flights.push_back(flight);
                }
            }
        }
        let stages_busy = self.flights.len() >= depth;
        if !self.flights.is_empty() && (stages_busy || self.next_share(depth).is_empty()) {
            self.land(exec)?;
        }
        Ok(())
    }

    /// The requests (slots) the next launch takes: not in flight, with work, in admission
    /// order, an even share over the stages still free.
    fn next_share(&self, depth: usize) -> Vec<u32> {
        let mut free: Vec<u32> = self
            .running
            .iter()
            .filter(|r| !r.flying && r.has_work())
            .map(|r| r.slot)
            .collect();
        let stages = depth.saturating_sub(self.flights.len()).max(1);
        free.truncate(free.len().div_ceil(stages));
        free
    }

    /// Samples the oldest step in flight.
    fn land(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        let Some(flight) = self.flights.pop_front() else {
            return Ok(());
        };
        let logits = exec.land()?;
        self.sample(exec, flight, logits)
    }

    /// Samples every step in flight (before the executor turns to another model, or when
    /// a request in flight must give its blocks back).
    pub(crate) fn land_all(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        while !self.flights.is_empty() {
            self.land(exec)?;
        }
        Ok(())
    }
}
