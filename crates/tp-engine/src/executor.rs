//! What a leader-side loop (the generation loop, `tp serve`'s scheduler) drives: a
//! [`StepExecutor`] takes step commands and returns logits. The real one is rank 0's
//! [`Worker`] (it broadcasts each command to the followers); [`ScriptedExecutor`] keeps slots
//! and KV blocks as a worker does but takes its logits from a script, so schedulers and loops
//! are tested in milliseconds without a model.

use crate::candidates::{row_needs, split_candidates, RowNeed, StepLogits};
use crate::error::{EngineError, Result};
use crate::protocol::{ChunkSpec, Command};
use crate::slots::Slots;
use crate::swap::ModelCommand;
use crate::worker::{RankProfile, Worker};
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;
use tp_models::KvPool;

/// Executes step commands on behalf of the leader.
pub trait StepExecutor {
    /// Checks and executes `cmd` (on every rank, for a worker). A forward returns its
    /// `[rows, vocab]` logits: one row per chunk, or one per token of an `all_logits` chunk.
    /// A forward takes the KV blocks its chunks need; [`StepExecutor::slots`] tells whether
    /// they are free.
    fn submit(&mut self, cmd: Command) -> Result<Option<Vec<f32>>>;
    /// One forward step over `chunks`: each row whole or as the candidates its chunk asks
    /// for ([`ChunkSpec::need`]).
    fn forward(&mut self, chunks: Vec<ChunkSpec>) -> Result<StepLogits>;
    /// Forward steps worth keeping in flight at once (a pipeline's stages): above 1, a loop
    /// may [`StepExecutor::launch`] that many on disjoint slots before it lands the first.
    fn pipeline_depth(&self) -> usize {
        1
    }
    /// Begins a forward step over `chunks`; its rows come from [`StepExecutor::land`], in
    /// launch order. Only for an executor whose [`StepExecutor::pipeline_depth`] is above 1.
    fn launch(&mut self, chunks: Vec<ChunkSpec>) -> Result<()> {
        let _ = chunks;
        Err(one_at_a_time())
    }
    /// The rows of the oldest launched forward step.
    fn land(&mut self) -> Result<StepLogits> {
        Err(one_at_a_time())
    }
    /// Open sequences and the KV blocks (of rank 0, the same on every rank).
    fn slots(&self) -> &Slots;
    /// Most KV blocks in use at once (rank 0 chooses every block, so its limit holds for all).
    fn set_block_limit(&mut self, blocks: usize);
    /// Time spent in collectives so far (for per-step figures).
    fn comm_time(&self) -> Duration;
    /// Every rank's cumulative time split and bytes sent, gathered now (a small collective
    /// on every rank); `None` from an executor without ranks.
    fn rank_profiles(&mut self) -> Result<Option<Vec<RankProfile>>> {
        Ok(None)
    }
    /// Starts loading the model at `path` on every rank, to be held as `id` beside the
    /// selected one (see [`crate::swap`]); an executor without that ability refuses.
    fn load_model(&mut self, id: u32, path: &str) -> Result<()> {
        let _ = (id, path);
        Err(one_model())
    }
    /// Rank 0's part of the load has ended: [`StepExecutor::adopt_model`] will not wait long.
    fn load_finished(&self) -> bool {
        false
    }
    /// Holds the loaded model `id` on every rank, or (`Ok(Err(why))`) drops it everywhere.
    fn adopt_model(&mut self, id: u32) -> Result<std::result::Result<(), String>> {
        let _ = id;
        Err(one_model())
    }
    /// Later commands apply to model `id` (its own slots and KV pool).
    fn select_model(&mut self, id: u32) -> Result<()> {
        let _ = id;
        Err(one_model())
    }
    /// Frees model `id` (not the selected one).
    fn drop_model(&mut self, id: u32) -> Result<()> {
        let _ = id;
        Err(one_model())
    }
    /// Frees the selected model (the only one held, nothing open) on every rank, then loads
    /// `path` as `id`, selected; `Ok(Err(why))` when some rank could not (no model is held
    /// then: only another replace may follow).
    fn replace_model(&mut self, id: u32, path: &str) -> Result<std::result::Result<(), String>> {
        let _ = (id, path);
        Err(one_model())
    }
}

fn one_at_a_time() -> EngineError {
    EngineError::Internal("this executor runs one forward step at a time".into())
}

fn one_model() -> EngineError {
    EngineError::Internal("this executor holds one model".into())
}

impl StepExecutor for Worker {
    fn submit(&mut self, cmd: Command) -> Result<Option<Vec<f32>>> {
        Worker::submit(self, cmd)
    }
    fn forward(&mut self, chunks: Vec<ChunkSpec>) -> Result<StepLogits> {
        Worker::forward_rows(self, chunks)
    }
    fn pipeline_depth(&self) -> usize {
        Worker::pipeline_depth(self)
    }
    fn launch(&mut self, chunks: Vec<ChunkSpec>) -> Result<()> {
        Worker::launch(self, chunks)
    }
    fn land(&mut self) -> Result<StepLogits> {
        Worker::land(self)
    }
    fn slots(&self) -> &Slots {
        Worker::slots(self)
    }
    fn set_block_limit(&mut self, blocks: usize) {
        Worker::set_block_limit(self, blocks)
    }
    fn comm_time(&self) -> Duration {
        self.profile.comm
    }
    fn rank_profiles(&mut self) -> Result<Option<Vec<RankProfile>>> {
        Worker::submit(self, Command::ProfileReport)?;
        Ok(Some(Worker::rank_profiles(self).to_vec()))
    }
    fn load_model(&mut self, id: u32, path: &str) -> Result<()> {
        let path = path.to_string();
        Worker::submit(self, Command::Model(ModelCommand::Load { id, path })).map(drop)
    }
    fn load_finished(&self) -> bool {
        Worker::load_finished(self)
    }
    fn adopt_model(&mut self, id: u32) -> Result<std::result::Result<(), String>> {
        Worker::adopt_model(self, id)
    }
    fn select_model(&mut self, id: u32) -> Result<()> {
        Worker::submit(self, Command::Model(ModelCommand::Select { id })).map(drop)
    }
    fn drop_model(&mut self, id: u32) -> Result<()> {
        Worker::submit(self, Command::Model(ModelCommand::Drop { id })).map(drop)
    }
    fn replace_model(&mut self, id: u32, path: &str) -> Result<std::result::Result<(), String>> {
        Worker::replace_model(self, id, path)
    }
}

/// The logits of one row: given the slot and every token it holds (the row's own last), the
/// `[vocab]` scores.
pub type Script = Box<dyn FnMut(u32, &[u32]) -> Vec<f32> + Send>;

/// A [`StepExecutor`] without a model (a test double): slots and their KV blocks are kept and
/// checked as [`Worker`] does (the same [`Slots`], with a pool that only counts), the tokens
/// each slot holds are remembered, and each row's logits come from a script.
pub struct ScriptedExecutor {
    slots: Slots,
    /// Tokens held by each open slot.
    tokens: BTreeMap<u32, Vec<u32>>,
    vocab: usize,
    script: Script,
    /// Every command accepted, in order (forwards with the blocks chosen).
    pub log: Vec<Command>,
    /// Forward passes executed so far.
    pub forwards: usize,
    /// Fail the forward pass with this index (0-based), as a lost rank would.
    pub fail_forward: Option<usize>,
    /// Vocabulary shards candidate rows are merged from, as ranks would (default 1).
    pub shards: usize,
    /// Forward steps a loop may keep in flight (default 1: none launched). Stricter than a
    /// worker, which lands its launched steps first: a command touching a slot in flight,
    /// or a plain forward while any is, is an error here, so a loop that relies on that
    /// landing is caught.
    pub depth: usize,
    /// Launched steps: their slots and rows (computed at launch), oldest first.
    flying: VecDeque<(Vec<u32>, StepLogits)>,
    /// Most steps in flight at once so far.
    pub most_in_flight: usize,
    /// Time a forward step takes: `(fixed, per token fed)` (default none), to test what
    /// callers decide from timed steps.
    pub step_time: Option<(std::time::Duration, std::time::Duration)>,
}

impl std::fmt::Debug for ScriptedExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScriptedExecutor")
            .field("vocab", &self.vocab)
            .field("tokens", &self.tokens)
            .field("forwards", &self.forwards)
            .finish_non_exhaustive()
    }
}

impl ScriptedExecutor {
    /// A model with `vocab` ids and a context of `max_positions`.
    pub fn new(vocab: usize, max_positions: usize, script: Script) -> Self {
        ScriptedExecutor {
            slots: Slots::new(KvPool::accounting_only(), max_positions, vocab),
            tokens: BTreeMap::new(),
            vocab,
            script,
            log: Vec::new(),
            forwards: 0,
            fail_forward: None,
            shards: 1,
            depth: 1,
            flying: VecDeque::new(),
            step_time: None,
            most_in_flight: 0,
        }
    }

    /// Tokens held by `slot` (empty when it is not open).
    pub fn tokens(&self, slot: u32) -> &[u32] {
        self.tokens.get(&slot).map_or(&[], Vec::as_slice)
    }

    /// Slots open now.
    pub fn open_slots(&self) -> Vec<u32> {
        self.slots.open().collect()
    }

    fn forward(&mut self, chunks: &[ChunkSpec]) -> Result<Vec<f32>> {
        if self.fail_forward == Some(self.forwards) {
            return Err(EngineError::Internal(format!(
                "forward pass {} failed (scripted)",
                self.forwards
            )));
        }
        self.forwards += 1;
        let mut taken = self.slots.take_grown(chunks)?;
        let mut out = Vec::new();
        let mut result = Ok(());
        for (c, (_, table)) in chunks.iter().zip(taken.iter()) {
            let held = self.tokens.entry(c.slot).or_default();
            held.truncate(table.len());
            for (i, &t) in c.tokens.iter().enumerate() {
                held.push(t);
                if c.all_logits || i + 1 == c.tokens.len() {
                    let row = (self.script)(c.slot, held);
                    if row.len() != self.vocab {
                        result = Err(EngineError::Internal(format!(
                            "the script gave {} logits for a vocabulary of {}",
                            row.len(),
                            self.vocab
                        )));
                    }
                    out.extend(row);
                }
            }
        }
        for ((_, table), c) in taken.iter_mut().zip(chunks) {
            match result {
                Ok(()) => table.advance(c.tokens.len()),
                Err(_) => {
                    let len = table.len();
                    self.slots.pool_mut().truncate(table, len);
                }
            }
        }
        self.slots.put_back(taken);
        result.map(|()| out)
    }
}

impl StepExecutor for ScriptedExecutor {
    fn submit(&mut self, cmd: Command) -> Result<Option<Vec<f32>>> {
        self.submit_rows(cmd)?
            .map(StepLogits::into_full)
            .transpose()
    }
    fn forward(&mut self, chunks: Vec<ChunkSpec>) -> Result<StepLogits> {
        if let Some((fixed, per)) = self.step_time {
            let fed: usize = chunks.iter().map(|c| c.tokens.len()).sum();
            std::thread::sleep(fixed + per * fed as u32);
        }
        self.submit_rows(Command::Forward(chunks))?
            .ok_or_else(|| EngineError::Internal("forward returned no logits".into()))
    }
    fn pipeline_depth(&self) -> usize {
        self.depth
    }
    fn launch(&mut self, chunks: Vec<ChunkSpec>) -> Result<()> {
        if self.depth < 2 || self.flying.len() >= self.depth {
            return Err(EngineError::Internal(format!(
                "a launch with {} of {} forward steps in flight",
                self.flying.len(),
                self.depth
            )));
        }
        let slots = chunks.iter().map(|c| c.slot).collect();
        let rows = self
            .submit_rows(Command::Launch(chunks))?
            .ok_or_else(|| EngineError::Internal("a launch returned no logits".into()))?;
        self.flying.push_back((slots, rows));
        self.most_in_flight = self.most_in_flight.max(self.flying.len());
        Ok(())
    }
    fn land(&mut self) -> Result<StepLogits> {
        self.log.push(Command::Land);
        self.flying
            .pop_front()
            .map(|(_, rows)| rows)
            .ok_or_else(|| EngineError::Internal("no forward is in flight".into()))
    }
    fn slots(&self) -> &Slots {
        &self.slots
    }
    fn set_block_limit(&mut self, blocks: usize) {
        self.slots.pool_mut().set_limit(blocks);
    }
    fn comm_time(&self) -> Duration {
        Duration::ZERO
    }
}

impl ScriptedExecutor {
    /// The step's rows: whole, or candidates merged from [`ScriptedExecutor::shards`] parts.
    fn rows(&self, chunks: &[ChunkSpec], full: Vec<f32>) -> Result<StepLogits> {
        let needs = row_needs(chunks);
        let mut whole = Vec::new();
        let mut cands = Vec::new();
        for (need, row) in needs.iter().zip(full.chunks_exact(self.vocab.max(1))) {
            match *need {
                RowNeed::Full => whole.extend_from_slice(row),
                RowNeed::Candidates { k, lse } => {
                    cands.push(split_candidates(row, k as usize, lse, self.shards))
                }
            }
        }
        StepLogits::assemble(&needs, whole, cands, self.vocab)
    }

    /// A command that a loop keeping steps in flight must not send yet: one touching a slot
    /// in flight, or a plain forward while any step is.
    fn check_flying(&self, cmd: &Command) -> Result<()> {
        let flying = |slot: &u32| self.flying.iter().any(|(s, _)| s.contains(slot));
        let clash = match cmd {
            Command::Close { slot } | Command::Truncate { slot, .. } => flying(slot),
            Command::Fork { src, dst, .. } => flying(src) || flying(dst),
            Command::Launch(chunks) => chunks.iter().any(|c| flying(&c.slot)),
            Command::Forward(_) => !self.flying.is_empty(),
            _ => false,
        };
        if clash {
            return Err(EngineError::Internal(format!(
                "{cmd:?} while forward steps are in flight"
            )));
        }
        Ok(())
    }

    fn submit_rows(&mut self, mut cmd: Command) -> Result<Option<StepLogits>> {
        self.check_flying(&cmd)?;
        self.slots.check(&cmd)?;
        let out = match &mut cmd {
            Command::Forward(chunks) | Command::Launch(chunks) => {
                self.slots.choose_blocks(chunks)?;
                let full = self.forward(chunks)?;
                Some(self.rows(chunks, full)?)
            }
            other => {
                self.slots.apply(other)?;
                match *other {
                    Command::Fork { dst, src, len, .. } => {
                        let mut held = self.tokens(src).to_vec();
                        held.truncate(len as usize);
                        self.tokens.insert(dst, held);
                    }
                    Command::Close { slot } => {
                        self.tokens.remove(&slot);
                    }
                    Command::Truncate { slot, len } => {
                        if let Some(held) = self.tokens.get_mut(&slot) {
                            held.truncate(len as usize);
                        }
                    }
                    _ => {}
                }
                None
            }
        };
        self.log.push(cmd);
        Ok(out)
    }
}
