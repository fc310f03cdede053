//! A poisonable generation barrier on one atomic word.
//!
//! State word: bit 0 = poisoned, bits 1..32 = ranks arrived, bits 32..64 = generation.
//! Completing the barrier and poisoning it are both single compare-and-swaps, so a rank that
//! gives up (timeout, lost peer) either withdraws before the barrier completes, and nobody
//! touches its buffers, or learns that it completed and carries on: never both.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

const POISON: u64 = 1;

fn arrived(s: u64) -> u64 {
    (s >> 1) & 0x7fff_ffff
}
fn generation(s: u64) -> u64 {
    s >> 32
}
fn pack(generation: u64, arrived: u64) -> u64 {
    (generation << 32) | (arrived << 1)
}

pub(crate) struct PoisonBarrier {
    size: u64,
    state: AtomicU64,
    cause: Mutex<Option<String>>,
}

/// What `arrive` saw.
pub(crate) enum Arrival {
    /// This rank was the last: the barrier is complete.
    Completed,
    /// Others are still missing: wait until the generation moves past this one.
    Waiting(u64),
}

impl PoisonBarrier {
    pub fn new(size: usize) -> Self {
        PoisonBarrier {
            size: size as u64,
            state: AtomicU64::new(0),
            cause: Mutex::new(None),
        }
    }

    /// Registers this rank's arrival. `Err(cause)` if the barrier is poisoned.
    pub fn arrive(&self) -> Result<Arrival, String> {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            if s & POISON != 0 {
                return Err(self.cause());
            }
            let a = arrived(s) + 1;
            let (next, done) = if a == self.size {
                (pack(generation(s).wrapping_add(1) & 0xffff_ffff, 0), true)
            } else {
                (pack(generation(s), a), false)
            };
            match self
                .state
                .compare_exchange_weak(s, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    return Ok(if done {
                        Arrival::Completed
                    } else {
                        Arrival::Waiting(generation(s))
                    })
                }
                Err(cur) => s = cur,
            }
        }
    }

    /// Whether the barrier of generation `gen` has completed (`Some(true)`), is poisoned
    /// (`Some(false)`), or is still open (`None`).
    pub fn poll(&self, gen: u64) -> Option<bool> {
        let s = self.state.load(Ordering::Acquire);
        if generation(s) != gen {
            Some(true)
        } else if s & POISON != 0 {
            Some(false)
        } else {
            None
        }
    }

    /// Gives up on generation `gen`: poisons the barrier unless it completed meanwhile.
    /// Returns true if it completed after all (the caller must then carry on normally).
    pub fn withdraw(&self, gen: u64, cause: String) -> bool {
        let mut c = self.cause.lock().unwrap_or_else(|p| p.into_inner());
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            if generation(s) != gen {
                return true;
            }
            if s & POISON != 0 {
                return false;
            }
            match self.state.compare_exchange_weak(
                s,
                s | POISON,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    *c = Some(cause);
                    return false;
                }
                Err(cur) => s = cur,
            }
        }
    }

    /// Poisons the barrier whatever its state (after a detected desync).
    pub fn poison(&self, cause: String) {
        let mut c = self.cause.lock().unwrap_or_else(|p| p.into_inner());
        if self.state.fetch_or(POISON, Ordering::AcqRel) & POISON == 0 {
            *c = Some(cause);
        }
    }

    #[cfg(test)]
    pub fn is_poisoned(&self) -> bool {
        self.state.load(Ordering::Acquire) & POISON != 0
    }

    pub fn cause(&self) -> String {
        let c = self.cause.lock().unwrap_or_else(|p| p.into_inner());
        c.clone()
            .unwrap_or_else(|| "an earlier failure".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completes_on_last_arrival_and_withdraw_loses_to_completion() {
        let b = PoisonBarrier::new(2);
        let Ok(Arrival::Waiting(g)) = b.arrive() else {
            panic!("first arrival must wait")
        };
        assert_eq!(b.poll(g), None);
        assert!(matches!(b.arrive(), Ok(Arrival::Completed)));
        assert_eq!(b.poll(g), Some(true));
        // Completed already: withdrawing reports completion and does not poison.
        assert!(b.withdraw(g, "late".into()));
        assert!(!b.is_poisoned());
    }

    #[test]
    fn withdraw_poisons_an_open_barrier() {
        let b = PoisonBarrier::new(3);
        let Ok(Arrival::Waiting(g)) = b.arrive() else {
            panic!("must wait")
        };
        assert!(!b.withdraw(g, "rank 0 timed out".into()));
        assert_eq!(b.poll(g), Some(false));
        assert_eq!(b.arrive().err().as_deref(), Some("rank 0 timed out"));
    }
}
