//! Fault injection for drills and tests: a [`Communicator`] wrapper that, on one rank and at
//! one call, panics, exits, desyncs, stalls or kills its process (docs/reliability.md R1-R3).
//!
//! Spec syntax (as `tp bench collectives --fault` takes it): `KIND:RANK@CALL[:SECS]`, e.g.
//! `panic:1@5`, `exit:2@3`, `mismatch:1@4`, `slow:1@3:10`, `kill:1@5`. CALL counts this
//! handle's calls from 0.

use crate::communicator::Group;
use crate::dtype::{DType, ReduceOp};
use crate::error::{CommError, OpKind, Result};
use crate::intercept::Intercept;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What happens when the fault fires.
#[derive(Clone, Debug, PartialEq)]
pub enum FaultKind {
    /// The rank's code panics inside the call.
    Panic,
    /// The rank stops: the call returns `CommError::Injected` and its caller is expected to
    /// return (a thread rank ends; a process rank exits).
    Exit,
    /// The rank issues a barrier instead of the expected call (a one-element all-reduce
    /// instead of a barrier): a desync.
    Mismatch,
    /// The rank sleeps this long before the call (a straggler).
    Slow(Duration),
    /// The rank's process is killed with SIGKILL: no cleanup, no goodbye.
    Kill,
}

/// One injected fault.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultPlan {
    pub kind: FaultKind,
    /// Rank (in the wrapped group) that misbehaves.
    pub rank: usize,
    /// Index of the call (0-based, all ops counted) at which it fires.
    pub at_call: u64,
}

impl std::str::FromStr for FaultPlan {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let usage = "expected KIND:RANK@CALL[:SECS] with KIND one of panic, exit, mismatch, \
                     slow, kill (e.g. panic:1@5 or slow:1@3:10)";
        let mut parts = s.split(':');
        let kind = parts.next().unwrap_or_default();
        let (rank, at_call) = match parts.next() {
            Some(pos) => {
                let (r, c) = pos.split_once('@').ok_or(format!("'{s}': {usage}"))?;
                let r = r
                    .parse()
                    .map_err(|_| format!("'{s}': bad rank '{r}'; {usage}"))?;
                let c = c
                    .parse()
                    .map_err(|_| format!("'{s}': bad call '{c}'; {usage}"))?;
                (r, c)
            }
            None => (1, 3),
        };
        let secs = parts.next();
        if parts.next().is_some() {
            return Err(format!("'{s}': {usage}"));
        }
        let kind = match (kind, secs) {
            ("panic", None) => FaultKind::Panic,
            ("exit", None) => FaultKind::Exit,
            ("mismatch", None) => FaultKind::Mismatch,
            ("kill", None) => FaultKind::Kill,
            ("slow", secs) => {
                let secs: f64 = secs
                    .unwrap_or("30")
                    .parse()
                    .map_err(|_| format!("'{s}': bad seconds; {usage}"))?;
                if !(secs.is_finite() && secs >= 0.0) {
                    return Err(format!("'{s}': seconds must be >= 0"));
                }
                FaultKind::Slow(Duration::from_secs_f64(secs))
            }
            _ => return Err(format!("'{s}': {usage}")),
        };
        Ok(FaultPlan {
            kind,
            rank,
            at_call,
        })
    }
}

/// A group handle that injects `plan` on its rank.
#[derive(Debug)]
pub struct Faulty {
    inner: Group,
    plan: FaultPlan,
    calls: Arc<AtomicU64>,
}

/// How many calls a [`Faulty`] handle has seen, to tell whether its fault was ever reached.
#[derive(Clone, Debug)]
pub struct FaultWatch {
    calls: Arc<AtomicU64>,
    at_call: u64,
}

impl FaultWatch {
    /// Calls made through the handle so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Whether the planned call was reached (on the planned rank the fault fired).
    pub fn reached(&self) -> bool {
        self.calls() > self.at_call
    }
}

impl Faulty {
    pub fn wrap(inner: Group, plan: FaultPlan) -> Group {
        Self::wrap_watched(inner, plan).0
    }

    /// [`Faulty::wrap`], with a watch that tells afterwards whether the fault's call was reached.
    pub fn wrap_watched(inner: Group, plan: FaultPlan) -> (Group, FaultWatch) {
        let calls = Arc::new(AtomicU64::new(0));
        let watch = FaultWatch {
            calls: Arc::clone(&calls),
            at_call: plan.at_call,
        };
        (Arc::new(Faulty { inner, plan, calls }), watch)
    }

    /// Runs the fault if this call is the chosen one; `Some(result)` replaces the call.
    fn fire(&self, op: OpKind) -> Option<Result<()>> {
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        if self.inner.rank() != self.plan.rank || call != self.plan.at_call {
            return None;
        }
        let rank = self.inner.rank();
        match &self.plan.kind {
            FaultKind::Panic => panic!("injected fault: rank {rank} panics at {op} call {call}"),
            FaultKind::Exit => Some(Err(CommError::Injected {
                rank,
                op,
                seq: call,
                what: "the rank exits".into(),
            })),
            // A different call than the peers make: a barrier, or a one-element all-reduce
            // where the peers are in a barrier.
            FaultKind::Mismatch if op == OpKind::Barrier => {
                let mut one = [0u8];
                Some(
                    self.inner
                        .all_reduce_bytes(&mut one, DType::U8, ReduceOp::Sum),
                )
            }
            FaultKind::Mismatch => Some(self.inner.barrier()),
            FaultKind::Slow(d) => {
                std::thread::sleep(*d);
                None
            }
            FaultKind::Kill => {
                // Best effort: SIGKILL through the `kill` utility; abort if that fails.
                let pid = std::process::id().to_string();
                let _ = std::process::Command::new("kill")
                    .args(["-9", &pid])
                    .status();
                std::process::abort()
            }
        }
    }
}

impl Intercept for Faulty {
    fn inner(&self) -> &Group {
        &self.inner
    }
    /// Faults fire on the numbered collective and point-to-point calls; `split` is not
    /// counted (it is not a call a fault plan can name).
    fn before(&self, op: OpKind) -> Option<Result<()>> {
        if op == OpKind::Split {
            return None;
        }
        self.fire(op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_kind_and_rejects_garbage() {
        let p: FaultPlan = "panic:2@7".parse().unwrap();
        assert_eq!((p.kind, p.rank, p.at_call), (FaultKind::Panic, 2, 7));
        let p: FaultPlan = "slow:1@3:2.5".parse().unwrap();
        assert_eq!(p.kind, FaultKind::Slow(Duration::from_millis(2500)));
        assert_eq!("mismatch".parse::<FaultPlan>().unwrap().rank, 1);
        for bad in [
            "",
            "boom:1@2",
            "panic:x@2",
            "panic:1",
            "slow:1@2:-1",
            "panic:1@2:3",
        ] {
            assert!(bad.parse::<FaultPlan>().is_err(), "{bad} must be rejected");
        }
    }
}
