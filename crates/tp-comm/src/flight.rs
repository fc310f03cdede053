//! Flight recorder: each rank's last collective calls, printed after a failure (R3).

use crate::error::Fingerprint;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Instant;

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
