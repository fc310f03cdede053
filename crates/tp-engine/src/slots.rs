//! The open sequences of one rank and their KV blocks: the checks every step command passes
//! before any rank starts a collective, the leader's choice of blocks, and the slot commands
//! themselves. [`crate::Worker`] (with a model's pool) and [`crate::ScriptedExecutor`] (with a
//! pool that only counts) keep their sequences here, so both accept and refuse the same
//! commands.

use crate::error::{EngineError, Result};
use crate::protocol::{ChunkSpec, Command};
use std::collections::BTreeMap;
use tp_models::{BlockTable, KvPool, ModelError};

/// Open sequences (by slot) over one pool of KV blocks.
#[derive(Debug)]
pub struct Slots {
    pool: KvPool,
    tables: BTreeMap<u32, BlockTable>,
    /// Longest sequence the model allows.
    max_positions: usize,
    vocab: usize,
}

impl Slots {
    pub fn new(pool: KvPool, max_positions: usize, vocab: usize) -> Self {
        Slots {
            pool,
            tables: BTreeMap::new(),
            max_positions,
            vocab,
        }
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    pub fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }

    pub fn table(&self, slot: u32) -> Option<&BlockTable> {
        self.tables.get(&slot)
    }

    /// Slots open now, ascending.
    pub fn open(&self) -> impl Iterator<Item = u32> + '_ {
        self.tables.keys().copied()
    }

    /// Positions cached for `slot` (0 when it is not open).
    pub fn cached_len(&self, slot: u32) -> usize {
        self.tables.get(&slot).map_or(0, BlockTable::len)
    }

    /// Capacity of `slot` (0 when it is not open).
    pub fn capacity(&self, slot: u32) -> usize {
        self.tables.get(&slot).map_or(0, BlockTable::capacity)
    }

    /// Checks `cmd` against this rank's state (identical on every rank).
    pub fn check(&self, cmd: &Command) -> Result<()> {
        match cmd {
            Command::Open { slot, capacity } => self.check_new(*slot, *capacity)?,
            Command::Fork {
                dst,
                src,
                len,
                capacity,
            } => {
                self.check_new(*dst, *capacity)?;
                let held = self.cached_len(*src);
                if !self.tables.contains_key(src) || *len as usize > held || len > capacity {
                    return Err(EngineError::Internal(format!(
                        "cannot share {len} positions of slot {src} ({held} held) into a slot of {capacity}"
                    )));
                }
            }
            Command::Close { slot } | Command::Truncate { slot, .. } => {
                self.get(*slot)?;
            }
            Command::Forward(chunks) | Command::Launch(chunks) => {
                for (i, c) in chunks.iter().enumerate() {
                    if c.tokens.is_empty() {
                        return Err(EngineError::Internal(format!(
                            "an empty chunk for slot {}",
                            c.slot
                        )));
                    }
                    self.get(c.slot)?.check_room(c.tokens.len())?;
                    if chunks[..i].iter().any(|o| o.slot == c.slot) {
                        return Err(EngineError::Internal(format!(
                            "slot {} appears twice in one step",
                            c.slot
                        )));
                    }
                    let vocab = self.vocab;
                    if let Some(&id) = c.tokens.iter().find(|&&t| t as usize >= vocab) {
                        return Err(ModelError::TokenOutOfRange { id, vocab }.into());
                    }
                }
            }
            Command::Idle
            | Command::Land
            | Command::Exit
            | Command::ProfileStart { .. }
            | Command::ProfileReport
            | Command::Model(_) => {}
        }
        Ok(())
    }

    fn get(&self, slot: u32) -> Result<&BlockTable> {
        self.tables
            .get(&slot)
            .ok_or_else(|| EngineError::Internal(format!("slot {slot} is not open")))
    }

    fn check_new(&self, slot: u32, capacity: u32) -> Result<()> {
        if self.tables.contains_key(&slot) {
            return Err(EngineError::Internal(format!(
                "slot {slot} is already open"
            )));
        }
        let max = self.max_positions;
        if capacity as usize > max || capacity == 0 {
            return Err(EngineError::Param {
                name: "capacity",
                message: format!("{capacity} positions; this model allows 1..={max}"),
            });
        }
        Ok(())
    }

    /// Blocks each chunk takes when a forward step runs them in this order (0 for a slot that
    /// is not open).
    pub fn blocks_needed_for(&self, chunks: &[ChunkSpec]) -> Vec<usize> {
        let empty = BlockTable::default();
        let growth: Vec<(&BlockTable, usize)> = chunks
            .iter()
            .map(|c| match self.tables.get(&c.slot) {
                Some(t) => (t, c.tokens.len()),
                None => (&empty, 0),
            })
            .collect();
        self.pool.blocks_needed_all(&growth)
    }

    /// Leader: names the lowest free blocks each chunk takes, in chunk order (an error when
    /// the pool's limit does not allow them all).
    pub fn choose_blocks(&self, chunks: &mut [ChunkSpec]) -> Result<()> {
        let needs = self.blocks_needed_for(chunks);
        let mut ids = self.pool.lowest_free(needs.iter().sum())?.into_iter();
        for (c, k) in chunks.iter_mut().zip(needs) {
            c.blocks = ids.by_ref().take(k).collect();
        }
        Ok(())
    }

    /// Executes a slot command (open, fork, close, truncate; others are not slot commands
    /// and do nothing here). `cmd` has passed [`Slots::check`].
    pub fn apply(&mut self, cmd: &Command) -> Result<()> {
        match *cmd {
            Command::Open { slot, capacity } => {
                self.tables.insert(slot, BlockTable::new(capacity as usize));
            }
            Command::Fork {
                dst,
                src,
                len,
                capacity,
            } => {
                let src = self
                    .tables
                    .get(&src)
                    .ok_or_else(|| EngineError::Internal(format!("slot {src} is not open")))?;
                let table = self.pool.fork(src, len as usize, capacity as usize)?;
                self.tables.insert(dst, table);
            }
            Command::Close { slot } => {
                if let Some(mut t) = self.tables.remove(&slot) {
                    self.pool.release(&mut t);
                }
            }
            Command::Truncate { slot, len } => {
                if let Some(t) = self.tables.get_mut(&slot) {
                    self.pool.truncate(t, len as usize);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Takes the tables of a forward step's chunks out (in chunk order) after giving each the
    /// blocks the leader chose; on an error nothing has changed. Put them back with
    /// [`Slots::put_back`].
    pub fn take_grown(&mut self, specs: &[ChunkSpec]) -> Result<Vec<(u32, BlockTable)>> {
        let mut taken: Vec<(u32, BlockTable)> = Vec::with_capacity(specs.len());
        let mut grown = Ok(());
        for s in specs {
            let Some(mut table) = self.tables.remove(&s.slot) else {
                grown = Err(EngineError::Internal(format!(
                    "slot {} is not open",
                    s.slot
                )));
                break;
            };
            grown = self
                .pool
                .grow(&mut table, s.tokens.len(), &s.blocks)
                .map_err(EngineError::from);
            taken.push((s.slot, table));
            if grown.is_err() {
                break;
            }
        }
        if let Err(e) = grown {
            // Blocks taken past each table's positions go back; positions are unchanged.
            for (_, table) in taken.iter_mut() {
                let len = table.len();
                self.pool.truncate(table, len);
            }
            self.put_back(taken);
            return Err(e);
        }
        Ok(taken)
    }

    pub fn put_back(&mut self, taken: Vec<(u32, BlockTable)>) {
        self.tables.extend(taken);
    }
}
