//! A rank's executor: its model shard, the KV caches of open sequences, and the loop that
//! followers run. Rank 0 drives the same executor through [`Worker::submit`].

use crate::error::{EngineError, Result};
use crate::protocol::{self, ChunkSpec, Command};
use std::collections::HashMap;
use tp_comm::{CommExt, Group};
use tp_models::{Chunk, Profile, SeqCache, ShardedModel};

/// One rank's model shard and caches.
#[derive(Debug)]
pub struct Worker {
    model: ShardedModel,
    group: Group,
    caches: HashMap<u32, SeqCache>,
    /// Time split of every forward pass so far (reset freely).
    pub profile: Profile,
    rank_profiles: Vec<RankProfile>,
}

/// One rank's time split, in seconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankProfile {
    /// Inside forward passes and logit gathers.
    pub total_s: f64,
    /// In all-reduces and gathers (after the barrier when profiling with barriers).
    pub comm_s: f64,
    /// In the barriers: waiting for the slowest rank.
    pub wait_s: f64,
    pub all_reduces: u64,
}

impl RankProfile {
    pub fn compute_s(&self) -> f64 {
        (self.total_s - self.comm_s - self.wait_s).max(0.0)
    }
}

impl Worker {
    pub fn new(model: ShardedModel, group: Group) -> Self {
        Worker {
            model,
            group,
            caches: HashMap::new(),
            profile: Profile::default(),
            rank_profiles: Vec::new(),
        }
    }

    pub fn model(&self) -> &ShardedModel {
        &self.model
    }

    pub fn group(&self) -> &Group {
        &self.group
    }

    pub fn is_leader(&self) -> bool {
        self.group.rank() == 0
    }

    /// Positions cached for `slot` (0 when it is not open).
    pub fn cached_len(&self, slot: u32) -> usize {
        self.caches.get(&slot).map_or(0, SeqCache::len)
    }

    /// Capacity of `slot`'s cache (0 when it is not open).
    pub fn capacity(&self, slot: u32) -> usize {
        self.caches.get(&slot).map_or(0, SeqCache::capacity)
    }

    /// Bytes held by every open cache on this rank.
    pub fn cache_bytes(&self) -> usize {
        self.caches.values().map(SeqCache::bytes).sum()
    }

    /// Leader only: checks `cmd` against the local state (identical on every rank), sends it to
    /// the followers and executes it. Returns the full `[rows, vocab]` logits of a forward.
    pub fn submit(&mut self, cmd: Command) -> Result<Option<Vec<f32>>> {
        if !self.is_leader() {
            return Err(EngineError::Internal("only rank 0 submits commands".into()));
        }
        self.check(&cmd)?;
        protocol::send(&self.group, &cmd)?;
        self.execute(cmd)
    }

    /// Follower loop: executes the leader's commands until `Exit`.
    pub fn follow(&mut self) -> Result<()> {
        loop {
            let cmd = protocol::receive(&self.group)?;
            if cmd == Command::Exit {
                return Ok(());
            }
            self.check(&cmd).map_err(|e| EngineError::Protocol {
                rank: self.group.rank(),
                message: format!("rejected {cmd:?}: {e}"),
            })?;
            self.execute(cmd)?;
        }
    }

    /// Input checks that must pass before any rank starts a collective.
    fn check(&self, cmd: &Command) -> Result<()> {
        let max = self.model.max_positions();
        match cmd {
            Command::Open { slot, capacity } => {
                if self.caches.contains_key(slot) {
                    return Err(EngineError::Internal(format!(
                        "slot {slot} is already open"
                    )));
                }
                if *capacity as usize > max || *capacity == 0 {
                    return Err(EngineError::Param {
                        name: "capacity",
                        message: format!("{capacity} positions; this model allows 1..={max}"),
                    });
                }
            }
            Command::Close { slot } | Command::Truncate { slot, .. } => {
                if !self.caches.contains_key(slot) {
                    return Err(EngineError::Internal(format!("slot {slot} is not open")));
                }
            }
            Command::Forward(chunks) => {
                let vocab = self.model.config().vocab;
                for (i, c) in chunks.iter().enumerate() {
                    let cache = self.caches.get(&c.slot).ok_or_else(|| {
                        EngineError::Internal(format!("slot {} is not open", c.slot))
                    })?;
                    cache.check_room(c.tokens.len())?;
                    if chunks[..i].iter().any(|o| o.slot == c.slot) {
                        return Err(EngineError::Internal(format!(
                            "slot {} appears twice in one step",
                            c.slot
                        )));
                    }
                    if let Some(&id) = c.tokens.iter().find(|&&t| t as usize >= vocab) {
                        return Err(tp_models::ModelError::TokenOutOfRange { id, vocab }.into());
                    }
                }
            }
            Command::Idle
            | Command::Exit
            | Command::ProfileStart { .. }
            | Command::ProfileReport => {}
        }
        Ok(())
    }

    fn execute(&mut self, cmd: Command) -> Result<Option<Vec<f32>>> {
        match cmd {
            Command::Open { slot, capacity } => {
                let cache = self.model.new_cache(capacity as usize);
                self.caches.insert(slot, cache);
            }
            Command::Close { slot } => {
                self.caches.remove(&slot);
            }
            Command::Truncate { slot, len } => {
                if let Some(c) = self.caches.get_mut(&slot) {
                    c.truncate(len as usize);
                }
            }
            Command::Forward(chunks) => return self.forward(chunks).map(Some),
            Command::ProfileStart { barriers } => {
                self.profile = if barriers {
                    Profile::with_barriers()
                } else {
                    Profile::default()
                };
            }
            Command::ProfileReport => self.rank_profiles = self.report()?,
            Command::Idle | Command::Exit => {}
        }
        Ok(None)
    }

    /// Every rank's profile as of the last [`Command::ProfileReport`].
    pub fn rank_profiles(&self) -> &[RankProfile] {
        &self.rank_profiles
    }

    /// Every rank's profile, gathered.
    fn report(&mut self) -> Result<Vec<RankProfile>> {
        let p = &self.profile;
        let mine = [
            p.total.as_secs_f64(),
            p.comm.as_secs_f64(),
            p.wait.as_secs_f64(),
            p.all_reduces as f64,
        ];
        let mut all = vec![0f64; 4 * self.group.size()];
        if self.group.size() == 1 {
            all.copy_from_slice(&mine);
        } else {
            self.group.all_gather(&mine, &mut all)?;
        }
        Ok(all
            .chunks_exact(4)
            .map(|c| RankProfile {
                total_s: c[0],
                comm_s: c[1],
                wait_s: c[2],
                all_reduces: c[3] as u64,
            })
            .collect())
    }

    fn forward(&mut self, specs: Vec<ChunkSpec>) -> Result<Vec<f32>> {
        // Take the caches out so each chunk can borrow its own mutably.
        let mut taken: Vec<(u32, SeqCache)> = specs
            .iter()
            .filter_map(|s| self.caches.remove(&s.slot).map(|c| (s.slot, c)))
            .collect();
        let rows: usize = specs
            .iter()
            .map(|s| if s.all_logits { s.tokens.len() } else { 1 })
            .sum();
        let result = {
            let mut chunks: Vec<Chunk<'_>> = specs
                .iter()
                .zip(taken.iter_mut())
                .map(|(s, (_, cache))| Chunk {
                    tokens: &s.tokens,
                    cache,
                    all_logits: s.all_logits,
                })
                .collect();
            self.model
                .forward(&mut chunks, &self.group, &mut self.profile)
        };
        for (slot, cache) in taken {
            self.caches.insert(slot, cache);
        }
        let local = result?;
        Ok(self
            .model
            .gather_logits(&local, rows, &self.group, &mut self.profile)?)
    }
}
