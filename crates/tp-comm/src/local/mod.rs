//! The `local` backend: every rank is a thread of one process; collectives go through
//! shared memory. The default on one machine.
//!
//! Start a world with [`run`]: it spawns one thread per rank, hands each its world
//! [`Group`](crate::Group), and reports each rank's result. A rank whose closure panics or
//! returns is marked departed at once, so peers waiting on it fail fast (R1).

mod alltoall;
mod barrier;
mod group;
mod ops;
mod world;

pub use ops::LocalComm;

use crate::communicator::Group;
use crate::error::{CommError, Departure};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

/// Options of a local world.
#[derive(Clone, Debug)]
pub struct LocalOptions {
    /// Deadline of every collective call, from the moment it is entered.
    pub timeout: Duration,
}

impl Default for LocalOptions {
    fn default() -> Self {
        LocalOptions {
            timeout: Duration::from_secs(60),
        }
    }
}

/// How one rank's closure ended: its value, or the message of its panic.
pub type RankOutcome<R> = std::result::Result<R, String>;

/// Runs `f` on `size` rank threads of one world and returns each rank's outcome, in rank order.
pub fn run<R, F>(size: usize, opts: LocalOptions, f: F) -> crate::Result<Vec<RankOutcome<R>>>
where
    R: Send,
    F: Fn(Group) -> R + Sync,
{
    if size == 0 {
        return Err(CommError::InvalidArgument {
            rank: 0,
            message: "a world needs at least one rank".into(),
        });
    }
    let world = world::WorldShared::new(size, opts);
    let shared = group::GroupShared::new(Arc::clone(&world), (0..size).collect());
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let comm: Group = Arc::new(LocalComm::new(Arc::clone(&shared), rank));
                let world = Arc::clone(&world);
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(s, move || {
                        let out = catch_unwind(AssertUnwindSafe(|| f(comm)));
                        let why = match &out {
                            Ok(_) => Departure::Exited("its work returned".into()),
                            Err(p) => Departure::Panicked(panic_message(p.as_ref())),
                        };
                        world.mark_departed(rank, why.clone());
                        out.map_err(|_| why.to_string())
                    })
            })
            .collect();
        let mut outcomes = Vec::with_capacity(size);
        for h in handles {
            match h {
                Ok(h) => outcomes.push(h.join().unwrap_or_else(|p| Err(panic_message(p.as_ref())))),
                Err(e) => {
                    let why = format!("could not start the rank thread: {e}");
                    world.mark_departed(outcomes.len(), Departure::Exited(why.clone()));
                    outcomes.push(Err(why));
                }
            }
        }
        Ok(outcomes)
    })
}

/// A group of one rank on the calling thread (no other thread, no waiting): for a model a
/// rank holds whole beside its shard (a draft model for speculative decoding).
pub fn solo() -> Group {
    let world = world::WorldShared::new(1, LocalOptions::default());
    let shared = group::GroupShared::new(world, vec![0]);
    Arc::new(LocalComm::new(shared, 0))
}

/// The text of a panic payload.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CommExt, ReduceOp};

    #[test]
    fn a_solo_group_is_one_rank_on_this_thread() {
        let g = solo();
        assert_eq!((g.rank(), g.size()), (0, 1));
        let mut v = [1.5f32, -2.0];
        g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, [1.5, -2.0]);
        let mut out = [0f32; 2];
        g.all_gather(&v, &mut out).unwrap();
        assert_eq!(out, v);
    }
}
