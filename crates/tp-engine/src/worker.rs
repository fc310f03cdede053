//! A rank's executor: its model shard, its pool of KV blocks with the block table of every
//! open sequence, and the loop that followers run. Rank 0 drives the same executor through
//! [`Worker::submit`], choosing the blocks each forward step takes. Under pipelining
//! ([`Worker::staged`]) the commands still go to every rank of the world, a forward runs on
//! the rank's stage (tp collectives inside the stage, activations to the next stage), and the
//! last stage's gathered logits go to rank 0. With several stages rank 0 may keep forwards
//! in flight ([`Worker::launch`], [`Worker::land`]): the commands then go point to point, so
//! an earlier stage runs the next micro-batch while the last stage still runs this one.

use crate::candidates::{row_needs, StepLogits};
use crate::error::{EngineError, Result};
use crate::protocol::{self, ChunkSpec, Command, Transport};
use crate::slots::Slots;
use std::collections::VecDeque;
use tp_comm::{CommExt, Group};
use tp_models::{BlockTable, Chunk, Profile, ShardedModel};

mod models;
mod rows;
pub use models::ReloadSpec;

/// One rank's model shard and caches.
#[derive(Debug)]
pub struct Worker {
    model: ShardedModel,
    /// Every rank: the commands go over it.
    group: Group,
    /// This rank's stage's tp group (`group` itself without pipelining).
    tp: Group,
    /// This tp rank's counterparts in every stage (rank = stage), when pipelined.
    pipe: Option<Group>,
    slots: Slots,
    /// Time split of every forward pass so far (reset freely).
    pub profile: Profile,
    rank_profiles: Vec<RankProfile>,
    /// Models held beside this one (a server's reload; see [`crate::swap`]).
    held: models::Held,
    /// Broadcast, or point to point when pipelined (see [`Transport`]).
    transport: Transport,
    /// Forwards launched and not yet landed, oldest first: their chunks (KV blocks already
    /// taken). Kept on the last stage's ranks only: the others ran theirs at launch.
    in_flight: VecDeque<Vec<ChunkSpec>>,
    /// Rank 0: rows of launched forwards landed before [`Worker::land`] asked (a command
    /// that must not overtake them came first), oldest first.
    landed: VecDeque<StepLogits>,
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
    /// Bytes sent in collectives (as a bandwidth-optimal algorithm sends them).
    pub sent_bytes: u64,
    /// Mixture of experts: (token, expert) rows this rank's experts computed.
    pub expert_rows: u64,
    /// Mixture of experts: the tokens the routers of this rank's layers sent to each expert,
    /// reported by each stage's tp rank 0 only (its tp peers route the same tokens; empty
    /// on them and for a dense model), so the sum over ranks counts every layer once.
    pub routed_tokens: Vec<u64>,
    /// Mixture of experts: the (token, expert) pairs the capacity factor dropped per expert,
    /// reported as `routed_tokens` is (empty without drops).
    pub dropped_tokens: Vec<u64>,
}

impl RankProfile {
    pub fn compute_s(&self) -> f64 {
        (self.total_s - self.comm_s - self.wait_s).max(0.0)
    }
}

impl Worker {
    pub fn new(model: ShardedModel, group: Group) -> Self {
        Self::staged(model, group.clone(), group, None)
    }

    /// A rank of a pipeline: `world` carries the commands, `tp` is its stage's group and
    /// `pipe` its counterparts in every stage (rank = stage index; `None` without
    /// pipelining). World rank 0 must be the last stage's tp rank 0 (it samples from the
    /// logits that stage gathers).
    pub fn staged(model: ShardedModel, world: Group, tp: Group, pipe: Option<Group>) -> Self {
        let group = world;
        let slots = Slots::new(
            model.new_pool(),
            model.max_positions(),
            model.config().vocab,
        );
        Worker {
            model,
            group,
            tp,
            slots,
            profile: Profile::default(),
            rank_profiles: Vec::new(),
            held: models::Held::default(),
            transport: if pipe.is_some() {
                Transport::PointToPoint
            } else {
                Transport::Broadcast
            },
            pipe,
            in_flight: VecDeque::new(),
            landed: VecDeque::new(),
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

    /// Open sequences and this rank's KV blocks.
    pub fn slots(&self) -> &Slots {
        &self.slots
    }

    /// Most KV blocks in use at once. Rank 0's limit is the one that counts: it chooses
    /// every block.
    pub fn set_block_limit(&mut self, blocks: usize) {
        self.slots.pool_mut().set_limit(blocks);
    }

    /// Leader only: checks `cmd` against the local state (identical on every rank), names the
    /// KV blocks a forward step takes, sends it to the followers and executes it. Returns the
    /// full `[rows, vocab]` logits of a forward whose chunks all ask for whole rows (see
    /// [`Worker::forward_rows`] for the others).
    pub fn submit(&mut self, cmd: Command) -> Result<Option<Vec<f32>>> {
        self.submit_rows(cmd)?
            .map(StepLogits::into_full)
            .transpose()
    }

    /// Leader only: one forward step over `chunks`, its rows whole or as candidates as each
    /// chunk asks.
    pub fn forward_rows(&mut self, chunks: Vec<ChunkSpec>) -> Result<StepLogits> {
        self.submit_rows(Command::Forward(chunks))?
            .ok_or_else(|| EngineError::Internal("forward returned no logits".into()))
    }

    /// Forwards worth keeping in flight at once: one per pipeline stage.
    pub fn pipeline_depth(&self) -> usize {
        self.model.stage().count
    }

    /// Leader only: begins a forward step over `chunks` (every stage but the last runs its
    /// part now; see [`Command::Launch`]). Its rows come from a later [`Worker::land`], in
    /// launch order. A command that touches a slot in flight, or must not overtake a launched
    /// forward (another forward, a model or profile command), lands them first.
    pub fn launch(&mut self, chunks: Vec<ChunkSpec>) -> Result<()> {
        self.submit_rows(Command::Launch(chunks)).map(drop)
    }

    /// Leader only: the rows of the oldest launched forward.
    pub fn land(&mut self) -> Result<StepLogits> {
        if let Some(rows) = self.landed.pop_front() {
            return Ok(rows);
        }
        if self.in_flight.is_empty() {
            return Err(EngineError::Internal("no forward is in flight".into()));
        }
        self.submit_rows(Command::Land)?
            .ok_or_else(|| EngineError::Internal("a landed forward returned no rows".into()))
    }

    /// Whether `cmd` must wait until every launched forward has landed.
    fn waits_for_flights(&self, cmd: &Command) -> bool {
        let flying = |slot: &u32| self.in_flight.iter().flatten().any(|c| c.slot == *slot);
        match cmd {
            Command::Open { .. } | Command::Idle | Command::Land => false,
            Command::Close { slot } | Command::Truncate { slot, .. } => flying(slot),
            Command::Fork { src, dst, .. } => flying(src) || flying(dst),
            Command::Launch(chunks) => chunks.iter().any(|c| flying(&c.slot)),
            Command::Forward(_)
            | Command::ProfileStart { .. }
            | Command::ProfileReport
            | Command::Model(_)
            | Command::Exit => true,
        }
    }

    fn submit_rows(&mut self, mut cmd: Command) -> Result<Option<StepLogits>> {
        if !self.is_leader() {
            return Err(EngineError::Internal("only rank 0 submits commands".into()));
        }
        if !self.in_flight.is_empty() && self.waits_for_flights(&cmd) {
            while !self.in_flight.is_empty() {
                let rows = self.submit_rows(Command::Land)?.ok_or_else(|| {
                    EngineError::Internal("a landed forward returned no rows".into())
                })?;
                self.landed.push_back(rows);
            }
        }
        self.check_held(&cmd)?;
        self.slots.check(&cmd)?;
        if let Command::Model(m) = &cmd {
            self.check_model(m)?;
        }
        if let Command::Forward(chunks) | Command::Launch(chunks) = &mut cmd {
            self.slots.choose_blocks(chunks)?;
        }
        protocol::send(&self.group, &cmd, self.transport)
            .and_then(|()| self.execute(cmd))
            .map_err(|e| self.name_stage(e))
    }

    /// Under pipelining, a collective's failure that names a rank (gone, or not answering)
    /// says which stage that rank holds, and its host.
    fn name_stage(&self, e: EngineError) -> EngineError {
        let stages = self.model.stage().count;
        match e.culprit() {
            Some(rank) if self.pipe.is_some() && rank < self.group.size() => {
                let (stage, _) = tp_spec::stage_of_rank(rank, self.tp.size(), stages);
                EngineError::Stage {
                    stage,
                    stages,
                    rank,
                    host: tp_comm::launch::host_of(rank),
                    source: Box::new(e),
                }
            }
            _ => e,
        }
    }

    /// Follower loop: executes the leader's commands until `Exit`.
    pub fn follow(&mut self) -> Result<()> {
        self.follow_commands().map_err(|e| self.name_stage(e))
    }

    fn follow_commands(&mut self) -> Result<()> {
        loop {
            let cmd = protocol::receive(&self.group, self.transport)?;
            if cmd == Command::Exit {
                return Ok(());
            }
            let checked = match &cmd {
                Command::Model(m) => self.check_model(m),
                other => self
                    .check_held(other)
                    .and_then(|()| self.slots.check(other)),
            };
            checked.map_err(|e| EngineError::Protocol {
                rank: self.group.rank(),
                message: format!("rejected {cmd:?}: {e}"),
            })?;
            self.execute(cmd)?;
        }
    }

    fn execute(&mut self, cmd: Command) -> Result<Option<StepLogits>> {
        match cmd {
            Command::Forward(chunks) => return self.forward(chunks).map(Some),
            Command::Launch(chunks) => self.launch_here(chunks)?,
            Command::Land => {
                if !self.model.stage().is_last() {
                    return Ok(None);
                }
                let chunks = self
                    .in_flight
                    .pop_front()
                    .ok_or_else(|| EngineError::Protocol {
                        rank: self.group.rank(),
                        message: "told to land a forward with none in flight".into(),
                    })?;
                return self.forward(chunks).map(Some);
            }
            Command::ProfileStart { barriers } => {
                self.profile = if barriers {
                    Profile::with_barriers()
                } else {
                    Profile::default()
                };
            }
            Command::ProfileReport => self.rank_profiles = self.report()?,
            Command::Idle | Command::Exit => {}
            Command::Model(m) => self.execute_model(m)?,
            Command::Open { .. }
            | Command::Fork { .. }
            | Command::Close { .. }
            | Command::Truncate { .. } => self.slots.apply(&cmd)?,
        }
        Ok(None)
    }

    /// Every rank's profile as of the last [`Command::ProfileReport`].
    pub fn rank_profiles(&self) -> &[RankProfile] {
        &self.rank_profiles
    }

    /// Every rank's profile, gathered (one collective on every rank): a follower takes part
    /// when rank 0 submits [`Command::ProfileReport`].
    fn report(&mut self) -> Result<Vec<RankProfile>> {
        /// The fixed figures of one rank in the gather; the tokens each expert took, then
        /// the pairs dropped per expert, follow.
        const FIXED: usize = 6;
        let experts = self.model.config().experts.as_ref().map_or(0, |e| e.count);
        let fields = FIXED + 2 * experts;
        let p = &self.profile;
        let mut mine = vec![
            p.total.as_secs_f64(),
            p.comm.as_secs_f64(),
            p.wait.as_secs_f64(),
            p.all_reduces as f64,
            p.sent_bytes as f64,
            p.expert_rows as f64,
        ];
        let reports_routes = self.tp.rank() == 0;
        for counts in [&p.expert_tokens, &p.expert_dropped] {
            mine.extend((0..experts).map(|e| match counts.get(e) {
                Some(&n) if reports_routes => n as f64,
                _ => 0.0,
            }));
        }
        let mut all = vec![0f64; fields * self.group.size()];
        if self.group.size() == 1 {
            all.copy_from_slice(&mine);
        } else {
            self.group.all_gather(&mine, &mut all)?;
        }
        // Per-expert counts, empty when all zero (a dense model, a peer of tp rank 0).
        let counts = |c: &[f64]| -> Vec<u64> {
            if c.iter().any(|&n| n > 0.0) {
                c.iter().map(|&n| n as u64).collect()
            } else {
                Vec::new()
            }
        };
        Ok(all
            .chunks_exact(fields)
            .map(|c| RankProfile {
                total_s: c[0],
                comm_s: c[1],
                wait_s: c[2],
                all_reduces: c[3] as u64,
                sent_bytes: c[4] as u64,
                expert_rows: c[5] as u64,
                routed_tokens: counts(&c[FIXED..FIXED + experts]),
                dropped_tokens: counts(&c[FIXED + experts..]),
            })
            .collect())
    }

    /// This rank's part of a launch: the whole stage's part on an earlier stage; on the
    /// last, the KV blocks rank 0 chose (taken now, so later commands see them taken) and a
    /// place in the queue [`Command::Land`] takes from.
    fn launch_here(&mut self, mut specs: Vec<ChunkSpec>) -> Result<()> {
        if !self.model.stage().is_last() {
            return self.forward(specs).map(drop);
        }
        let taken = self.take_chosen(&specs)?;
        self.slots.put_back(taken);
        // Taken: the landing forward finds them in place and takes no more.
        specs.iter_mut().for_each(|c| c.blocks.clear());
        self.in_flight.push_back(specs);
        Ok(())
    }

    /// The tables of `specs`' slots, grown by the blocks rank 0 chose: the same on every
    /// rank, or this rank has diverged.
    fn take_chosen(&mut self, specs: &[ChunkSpec]) -> Result<Vec<(u32, BlockTable)>> {
        let rank = self.group.rank();
        self.slots
            .take_grown(specs)
            .map_err(|e| EngineError::Protocol {
                rank,
                message: format!("the KV blocks rank 0 chose do not fit this rank's cache: {e}"),
            })
    }

    fn forward(&mut self, specs: Vec<ChunkSpec>) -> Result<StepLogits> {
        let mut taken = self.take_chosen(&specs)?;
        let needs = row_needs(&specs);
        let result = {
            let mut chunks: Vec<Chunk<'_>> = specs
                .iter()
                .zip(taken.iter_mut())
                .map(|(s, (_, table))| Chunk {
                    tokens: &s.tokens,
                    table,
                    all_logits: s.all_logits,
                })
                .collect();
            self.model.forward_stage(
                &mut chunks,
                self.slots.pool_mut(),
                &self.tp,
                self.pipe.as_ref(),
                &mut self.profile,
            )
        };
        self.slots.put_back(taken);
        let local = result?;
        // Only the last stage (world rank 0's, see `tp_spec::stage_of_rank`) has logits.
        if !self.model.stage().is_last() {
            return Ok(StepLogits::default());
        }
        rows::step_logits(&self.model, local, &needs, &self.tp, &mut self.profile)
    }
}
