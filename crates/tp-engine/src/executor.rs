//! What a leader-side loop (the generation loop, `tp serve`'s scheduler) drives: a
//! [`StepExecutor`] takes step commands and returns logits. The real one is rank 0's
//! [`Worker`] (it broadcasts each command to the followers); [`ScriptedExecutor`] keeps slots
//! and cache lengths as a worker does but takes its logits from a script, so schedulers and
//! loops are tested in milliseconds without a model.

use crate::error::{EngineError, Result};
use crate::protocol::{ChunkSpec, Command};
use crate::worker::Worker;
use std::collections::BTreeMap;
use std::time::Duration;

/// Executes step commands on behalf of the leader.
pub trait StepExecutor {
    /// Checks and executes `cmd` (on every rank, for a worker). A forward returns its
    /// `[rows, vocab]` logits: one row per chunk, or one per token of an `all_logits` chunk.
    fn submit(&mut self, cmd: Command) -> Result<Option<Vec<f32>>>;
    /// Positions cached for `slot` (0 when it is not open).
    fn cached_len(&self, slot: u32) -> usize;
    /// Capacity of `slot`'s cache (0 when it is not open).
    fn capacity(&self, slot: u32) -> usize;
    /// Bytes held by every open cache (on this rank).
    fn cache_bytes(&self) -> usize;
    /// Time spent in collectives so far (for per-step figures).
    fn comm_time(&self) -> Duration;
}

impl StepExecutor for Worker {
    fn submit(&mut self, cmd: Command) -> Result<Option<Vec<f32>>> {
        Worker::submit(self, cmd)
    }
    fn cached_len(&self, slot: u32) -> usize {
        Worker::cached_len(self, slot)
    }
    fn capacity(&self, slot: u32) -> usize {
        Worker::capacity(self, slot)
    }
    fn cache_bytes(&self) -> usize {
        Worker::cache_bytes(self)
    }
    fn comm_time(&self) -> Duration {
        self.profile.comm
    }
}

/// The logits of one row: given the slot and every token it holds (the row's own last), the
/// `[vocab]` scores.
pub type Script = Box<dyn FnMut(u32, &[u32]) -> Vec<f32> + Send>;

/// A [`StepExecutor`] without a model (a test double): slots, capacities and cached tokens are
/// kept and checked as [`Worker`] does, and each row's logits come from a script.
pub struct ScriptedExecutor {
    vocab: usize,
    max_positions: usize,
    /// Tokens held by each open slot, and its capacity.
    slots: BTreeMap<u32, (Vec<u32>, usize)>,
    script: Script,
    /// Every command accepted, in order.
    pub log: Vec<Command>,
    /// Forward passes executed so far.
    pub forwards: usize,
    /// Fail the forward pass with this index (0-based), as a lost rank would.
    pub fail_forward: Option<usize>,
    /// Bytes a cached position costs (for `cache_bytes`).
    pub bytes_per_position: usize,
}

impl std::fmt::Debug for ScriptedExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScriptedExecutor")
            .field("vocab", &self.vocab)
            .field("slots", &self.slots)
            .field("forwards", &self.forwards)
            .finish_non_exhaustive()
    }
}

impl ScriptedExecutor {
    /// A model with `vocab` ids and a context of `max_positions`.
    pub fn new(vocab: usize, max_positions: usize, script: Script) -> Self {
        ScriptedExecutor {
            vocab,
            max_positions,
            slots: BTreeMap::new(),
            script,
            log: Vec::new(),
            forwards: 0,
            fail_forward: None,
            bytes_per_position: 1,
        }
    }

    /// Tokens held by `slot` (empty when it is not open).
    pub fn tokens(&self, slot: u32) -> &[u32] {
        self.slots.get(&slot).map_or(&[], |(t, _)| t.as_slice())
    }

    /// Slots open now.
    pub fn open_slots(&self) -> Vec<u32> {
        self.slots.keys().copied().collect()
    }

    fn check(&self, cmd: &Command) -> Result<()> {
        match cmd {
            Command::Open { slot, capacity } => {
                if self.slots.contains_key(slot) {
                    return Err(EngineError::Internal(format!(
                        "slot {slot} is already open"
                    )));
                }
                if *capacity == 0 || *capacity as usize > self.max_positions {
                    return Err(EngineError::Param {
                        name: "capacity",
                        message: format!(
                            "{capacity} positions; this model allows 1..={}",
                            self.max_positions
                        ),
                    });
                }
            }
            Command::Close { slot } | Command::Truncate { slot, .. } => {
                if !self.slots.contains_key(slot) {
                    return Err(EngineError::Internal(format!("slot {slot} is not open")));
                }
            }
            Command::Forward(chunks) => {
                for (i, c) in chunks.iter().enumerate() {
                    let (held, capacity) = self.slots.get(&c.slot).ok_or_else(|| {
                        EngineError::Internal(format!("slot {} is not open", c.slot))
                    })?;
                    if c.tokens.is_empty() || held.len() + c.tokens.len() > *capacity {
                        return Err(EngineError::Internal(format!(
                            "{} tokens do not fit slot {} ({} of {capacity} held)",
                            c.tokens.len(),
                            c.slot,
                            held.len()
                        )));
                    }
                    if chunks[..i].iter().any(|o| o.slot == c.slot) {
                        return Err(EngineError::Internal(format!(
                            "slot {} appears twice in one step",
                            c.slot
                        )));
                    }
                    if let Some(&id) = c.tokens.iter().find(|&&t| t as usize >= self.vocab) {
                        return Err(EngineError::Internal(format!(
                            "token {id} is outside the vocabulary of {}",
                            self.vocab
                        )));
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

    fn forward(&mut self, chunks: &[ChunkSpec]) -> Result<Vec<f32>> {
        if self.fail_forward == Some(self.forwards) {
            return Err(EngineError::Internal(format!(
                "forward pass {} failed (scripted)",
                self.forwards
            )));
        }
        self.forwards += 1;
        let mut out = Vec::new();
        for c in chunks {
            let Some((held, _)) = self.slots.get_mut(&c.slot) else {
                return Err(EngineError::Internal(format!(
                    "slot {} is not open",
                    c.slot
                )));
            };
            for (i, &t) in c.tokens.iter().enumerate() {
                held.push(t);
                if c.all_logits || i + 1 == c.tokens.len() {
                    let row = (self.script)(c.slot, held);
                    if row.len() != self.vocab {
                        return Err(EngineError::Internal(format!(
                            "the script gave {} logits for a vocabulary of {}",
                            row.len(),
                            self.vocab
                        )));
                    }
                    out.extend(row);
                }
            }
        }
        Ok(out)
    }
}

impl StepExecutor for ScriptedExecutor {
    fn submit(&mut self, cmd: Command) -> Result<Option<Vec<f32>>> {
        self.check(&cmd)?;
        let out = match &cmd {
            Command::Open { slot, capacity } => {
                self.slots.insert(*slot, (Vec::new(), *capacity as usize));
                None
            }
            Command::Close { slot } => {
                self.slots.remove(slot);
                None
            }
            Command::Truncate { slot, len } => {
                if let Some((held, _)) = self.slots.get_mut(slot) {
                    held.truncate(*len as usize);
                }
                None
            }
            Command::Forward(chunks) => Some(self.forward(chunks)?),
            _ => None,
        };
        self.log.push(cmd);
        Ok(out)
    }
    fn cached_len(&self, slot: u32) -> usize {
        self.tokens(slot).len()
    }
    fn capacity(&self, slot: u32) -> usize {
        self.slots.get(&slot).map_or(0, |(_, c)| *c)
    }
    fn cache_bytes(&self) -> usize {
        self.slots.values().map(|(t, _)| t.len()).sum::<usize>() * self.bytes_per_position
    }
    fn comm_time(&self) -> Duration {
        Duration::ZERO
    }
}
