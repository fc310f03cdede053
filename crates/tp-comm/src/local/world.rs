//! State shared by all rank threads of one local world: liveness, parking, the registry of
//! sub-groups being created, and every rank's flight recorder.

use super::LocalOptions;
use crate::error::Departure;
use crate::flight::FlightRecorder;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Key of a group under construction: (parent group id, split sequence number, color).
pub(crate) type SplitKey = (u64, u64, u32);

pub(crate) struct WorldShared {
    pub opts: LocalOptions,
    /// Why each world rank left, once it has.
    departed: Vec<Mutex<Option<Departure>>>,
    any_departed: AtomicBool,
    park_lock: Mutex<()>,
    park_cv: Condvar,
    sleepers: AtomicUsize,
    /// Sub-groups being created: the shared state and how many members still have to pick it up.
    pub registry: Mutex<HashMap<SplitKey, (Arc<super::group::GroupShared>, usize)>>,
    pub next_group_id: AtomicU64,
    pub flights: Vec<FlightRecorder>,
    pub epoch: Instant,
    /// How long a waiting rank spins before it yields and then parks.
    pub spin: Duration,
}

/// Why a wait ended without its condition.
pub(crate) enum WaitFailure {
    Lost(usize, Departure),
    TimedOut,
}

impl WorldShared {
    pub fn new(size: usize, opts: LocalOptions) -> Arc<Self> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Spinning only pays when every rank has a core; otherwise it steals the core the
        // awaited rank needs, so oversubscribed worlds park almost at once.
        let spin = if size <= cores {
            Duration::from_micros(50)
        } else {
            Duration::from_micros(5)
        };
        Arc::new(WorldShared {
            opts,
            departed: (0..size).map(|_| Mutex::new(None)).collect(),
            any_departed: AtomicBool::new(false),
            park_lock: Mutex::new(()),
            park_cv: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            registry: Mutex::new(HashMap::new()),
            next_group_id: AtomicU64::new(1),
            flights: (0..size).map(|_| FlightRecorder::default()).collect(),
            epoch: Instant::now(),
            spin,
        })
    }

    pub fn mark_departed(&self, world_rank: usize, why: Departure) {
        if let Some(slot) = self.departed.get(world_rank) {
            let mut d = slot.lock().unwrap_or_else(|p| p.into_inner());
            if d.is_none() {
                *d = Some(why);
            }
        }
        self.any_departed.store(true, Ordering::SeqCst);
        self.wake_all();
    }

    /// The first departed rank among `members` (world ranks), if any.
    pub fn lost_member(&self, members: &[usize]) -> Option<(usize, Departure)> {
        if !self.any_departed.load(Ordering::SeqCst) {
            return None;
        }
        members.iter().find_map(|&m| {
            let d = self.departed[m].lock().unwrap_or_else(|p| p.into_inner());
            d.clone().map(|why| (m, why))
        })
    }

    /// Wakes parked waiters; call after any change a waiter may wait for.
    pub fn wake_all(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = self.park_lock.lock().unwrap_or_else(|p| p.into_inner());
            self.park_cv.notify_all();
        }
    }

    /// Waits until `ready()` holds: spins briefly, then yields, then parks. Fails when a rank
    /// of `members` departs or, if `deadline` is set, when it passes.
    pub fn wait(
        &self,
        members: &[usize],
        deadline: Option<Instant>,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), WaitFailure> {
        let start = Instant::now();
        let mut spins: u32 = 0;
        loop {
            if ready() {
                return Ok(());
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                if let Some((m, why)) = self.lost_member(members) {
                    return Err(WaitFailure::Lost(m, why));
                }
                let now = Instant::now();
                if deadline.is_some_and(|d| now >= d) {
                    return Err(WaitFailure::TimedOut);
                }
                let waited = now - start;
                if waited > self.spin * 4 {
                    break;
                }
                if waited > self.spin {
                    std::thread::yield_now();
                    continue;
                }
            }
            std::hint::spin_loop();
        }
        loop {
            let guard = self.park_lock.lock().unwrap_or_else(|p| p.into_inner());
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            let result = if ready() {
                Some(Ok(()))
            } else if let Some((m, why)) = self.lost_member(members) {
                Some(Err(WaitFailure::Lost(m, why)))
            } else {
                let now = Instant::now();
                match deadline {
                    Some(d) if now >= d => Some(Err(WaitFailure::TimedOut)),
                    _ => {
                        let slice = Duration::from_millis(20);
                        let slice = deadline.map_or(slice, |d| slice.min(d - now));
                        let _unused = self
                            .park_cv
                            .wait_timeout(guard, slice)
                            .unwrap_or_else(|p| p.into_inner());
                        None
                    }
                }
            };
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            if let Some(r) = result {
                return r;
            }
        }
    }

    /// Every rank's flight record, for an error message.
    pub fn flight_record(&self) -> String {
        let mut out = String::from("flight record (most recent last):\n");
        for (r, f) in self.flights.iter().enumerate() {
            out.push_str(&f.render(&format!("rank {r}"), self.epoch));
        }
        out
    }
}
