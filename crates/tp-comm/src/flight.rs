//! Flight recorder: each rank's last collective calls, printed after a failure (R3).

use crate::error::Fingerprint;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How many recent calls each rank keeps.
pub const FLIGHT_DEPTH: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallState {
    Started,
    Done,
    Failed,
}

#[derive(Clone, Debug)]
struct Entry {
    group_id: u64,
    group_size: usize,
    fp: Fingerprint,
    state: CallState,
    started: Instant,
    finished: Option<Instant>,
}

/// One rank's ring of recent calls.
#[derive(Debug, Default)]
pub struct FlightRecorder {
    entries: Mutex<VecDeque<Entry>>,
}

impl FlightRecorder {
    pub fn start(&self, group_id: u64, group_size: usize, fp: Fingerprint) {
        let mut e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if e.len() == FLIGHT_DEPTH {
            e.pop_front();
        }
        e.push_back(Entry {
            group_id,
            group_size,
            fp,
            state: CallState::Started,
            started: Instant::now(),
            finished: None,
        });
    }

    /// Marks the newest call of this group as finished.
    pub fn finish(&self, group_id: u64, ok: bool) {
        let mut e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(last) = e.iter_mut().rev().find(|x| x.group_id == group_id) {
            last.state = if ok {
                CallState::Done
            } else {
                CallState::Failed
            };
            last.finished = Some(Instant::now());
        }
    }

    /// The newest call still running: its fingerprint, group size and time so far.
    pub fn in_progress(&self) -> Option<(Fingerprint, usize, Duration)> {
        let e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        e.iter()
            .rev()
            .find(|x| x.state == CallState::Started)
            .map(|x| (x.fp, x.group_size, x.started.elapsed()))
    }

    /// Renders this rank's calls, oldest first, times relative to `epoch`.
    pub fn render(&self, label: &str, epoch: Instant) -> String {
        let e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = format!("  {label}: last {} calls\n", e.len());
        for x in e.iter() {
            let t0 = x.started.saturating_duration_since(epoch).as_secs_f64() * 1e3;
            let took = match x.finished {
                Some(f) => format!("{:.3} ms", (f - x.started).as_secs_f64() * 1e3),
                None => "still running".to_string(),
            };
            out.push_str(&format!(
                "    t={t0:>10.3} ms  group {}({} ranks)  {}  {:?}  {took}\n",
                x.group_id, x.group_size, x.fp, x.state
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::error::OpKind;

    fn fp(seq: u64) -> Fingerprint {
        Fingerprint {
            op: OpKind::AllReduce,
            seq,
            dtype: DType::F32,
            count: 4,
            detail: 0,
        }
    }

    #[test]
    fn the_call_in_progress_is_the_newest_unfinished_one() {
        let f = FlightRecorder::default();
        assert!(f.in_progress().is_none());
        f.start(1, 2, fp(0));
        f.finish(1, true);
        assert!(f.in_progress().is_none());
        f.start(1, 2, fp(1));
        let (got, size, _) = f.in_progress().expect("one running");
        assert_eq!((got.seq, size), (1, 2));
        f.finish(1, false);
        assert!(f.in_progress().is_none());
    }
}
