//! The continuous-batching scheduler: a plain loop on rank 0's thread that owns the
//! [`tp_engine::Worker`]. Each step it admits queued requests whose prompt's KV blocks are free
//! now, builds ONE [`Command::Forward`] holding a decode token for every running request plus
//! prefill chunks (capped per step so decode latency stays bounded), samples each row with its
//! request's own [`SequenceDecoder`], streams text back and ends finished or abandoned
//! sequences at once (Orca-style iteration-level scheduling).
//!
//! Memory is paged (vLLM's design, on CPU): a sequence takes KV blocks as its tokens arrive,
//! not a reservation for its whole length. When a step needs more blocks than are free, the
//! prefix cache gives back its least recently used entries, then the newest running request
//! is preempted (its blocks freed, itself queued first to be recomputed from everything it
//! held, as vLLM's recompute preemption does): the oldest request always progresses, and a
//! lone request that fills the whole budget finishes with `length`. No running request fails
//! for lack of memory and nothing waits forever.
//!
//! Prefix sharing: a request whose tokens begin like those of a running sequence or of a
//! finished one kept in the prefix cache starts as a fork of it ([`Command::Fork`]: the
//! common blocks shared, copied on the first write into a shared block) and prefills only the
//! rest. Requests that would share a prefix another sequence is still prefilling wait for it
//! rather than compute it again (a shared system prompt is computed once).
//!
//! Every row of a batched forward is computed independently of the others (per-row
//! activation quantization, per-sequence attention), so a greedy request gets the same
//! tokens alone, batched, forked from a shared prefix or recomputed after a preemption; the
//! tests check it.
//!
//! Rank 0 holds every request's row of logits (whole, or only the candidates its decoder
//! needs, merged from every rank's vocabulary shard: [`SequenceDecoder::row_need`]), so each
//! request's [`SequenceDecoder`] (penalties, sampling, log-probabilities, stop strings, text;
//! the same one `tp generate` and `tp chat` use) is rank-0-only work.
//!
//! The scheduler drives a [`StepExecutor`]: rank 0's [`tp_engine::Worker`] in the server, a
//! [`tp_engine::ScriptedExecutor`] in the unit tests below. With pipeline stages it keeps one
//! step in flight per stage, each over other requests ([`pipeline`]), so every stage computes
//! at once.

use crate::metrics::Metrics;
use crate::spec::{rejected_positions, SeqSpec, SpecBatch};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;
use tp_engine::{
    ChunkSpec, Command, DecodeParams, Emitted, EngineError, FinishReason, Finished, LogprobEntry,
    RowNeed, SequenceDecoder, StepExecutor, StepLogits,
};
use tp_models::BLOCK_POSITIONS;
use tp_tokenizer::Tokenizer;

mod pipeline;
use pipeline::Flight;

/// Limits of the scheduler.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Most sequences generated at once.
    pub max_seqs: usize,
    /// KV blocks of [`BLOCK_POSITIONS`] positions all sequences may hold together (per rank).
    pub kv_blocks: usize,
    /// Most tokens in one forward step (decode tokens plus prefill chunks).
    pub max_batch_tokens: usize,
    /// How often an idle leader tells followers it is alive (well under `--timeout`).
    pub heartbeat: Duration,
    /// Requests start as forks of running or cached sequences they share a prefix with
    /// (off: every request computes its whole prompt).
    pub prefix_sharing: bool,
    /// Most finished sequences kept for later requests that begin alike (0: no prefix
    /// cache). Their blocks count in `kv_blocks` and are given back when needed.
    pub prefix_cache_entries: usize,
    /// Speculative decoding: each request drafts with its own drafter from this source
    /// (see [`crate::spec`]); `None`: one token per request per step.
    pub spec: Option<crate::spec::ServeSpec>,
}

impl SchedulerConfig {
    /// Positions one sequence may hold: the whole KV budget.
    pub fn max_positions(&self) -> usize {
        self.kv_blocks.saturating_mul(BLOCK_POSITIONS)
    }
}

/// One request handed to the scheduler.
#[derive(Debug)]
pub struct Job {
    pub prompt: Vec<u32>,
    /// How to decode; `prompt.len() + params.max_tokens` fits the context and the KV budget.
    pub params: DecodeParams,
    /// Where text goes; the request is cancelled at the next step once it is closed.
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
    /// The held model to run on (a candidate's canary); `None`: the live one.
    pub model: Option<u32>,
}

/// Token counts of a finished job: its prompt and what it generated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

impl Usage {
    /// The counts of jobs sharing one prompt (a request's choices) with one more finished:
    /// the prompt counted once, generated tokens summed.
    pub fn with_choice(self, choice: Usage) -> Usage {
        Usage {
            prompt_tokens: choice.prompt_tokens,
            completion_tokens: self.completion_tokens + choice.completion_tokens,
        }
    }
}

/// What a job's submitter receives: plain engine-side values (the HTTP side turns them into
/// OpenAI JSON and statuses).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Text to show next (complete UTF-8, stop sequences held back) and, when asked for, the
    /// log-probabilities of the tokens it shows (the text may be empty when only they remain).
    Text {
        text: String,
        logprobs: Vec<LogprobEntry>,
    },
    Done {
        finish: FinishReason,
        usage: Usage,
        /// From arrival to the first generated token.
        time_to_first_token: Duration,
    },
    /// The request could not be finished.
    Failed {
        message: String,
        /// The scheduler was shut down (the request may be retried), rather than failing.
        shutting_down: bool,
    },
}

impl Event {
    fn failed(message: impl Into<String>) -> Event {
        Event::Failed {
            message: message.into(),
            shutting_down: false,
        }
    }
}

/// Messages to the scheduler.
#[derive(Debug)]
pub enum Control {
    Submit(Job),
    /// Load, switch, roll back or discard a model (see [`crate::rollout`]).
    Admin(crate::rollout::Admin),
    /// Cancel whatever is left and return (the HTTP side has drained or given up).
    Shutdown,
}

/// Requests handed over but not yet admitted (shared with the HTTP side to bound the queue).
#[derive(Debug, Default)]
pub struct Load {
    pub pending: AtomicUsize,
}

/// One admitted request.
struct Running<'t> {
    job: Job,
    slot: u32,
    /// Tokens to hold before decoding (re)starts: the prompt, or after a preemption everything
    /// the sequence held.
    context: Vec<u32>,
    /// Tokens whose keys and values the slot holds: a prefix of `context` while prefilling,
    /// then `context` and the decode tokens fed since.
    held: Vec<u32>,
    /// Recomputing after a preemption: the context's last row is not sampled (its token was).
    resumed: bool,
    decoder: SequenceDecoder<'t>,
    first_token: Option<Instant>,
    /// Its drafter and this step's drafts, when the server speculates.
    spec: Option<SeqSpec>,
    /// In a launched step whose rows have not come back (pipelining): nothing may touch its
    /// sequence until they do.
    flying: bool,
}

impl Running<'_> {
    /// Context tokens still to prefill.
    fn prefill_left(&self) -> usize {
        self.context.len().saturating_sub(self.held.len())
    }

    /// Whether a step has something to feed it: prompt tokens or its next token.
    fn has_work(&self) -> bool {
        self.prefill_left() > 0 || self.decoder.next_input().is_some()
    }
}

/// A request waiting for admission: new, or preempted and waiting to be recomputed.
enum Queued<'t> {
    New(Job),
    Preempted(Box<Running<'t>>),
}

impl Queued<'_> {
    fn job(&self) -> &Job {
        match self {
            Queued::New(job) => job,
            Queued::Preempted(r) => &r.job,
        }
    }

    /// The tokens it must hold before it samples (again).
    fn context(&self) -> &[u32] {
        match self {
            Queued::New(job) => &job.prompt,
            Queued::Preempted(r) => &r.context,
        }
    }
}

/// A finished sequence kept open in the prefix cache.
struct CachedPrefix {
    slot: u32,
    tokens: Vec<u32>,
    /// Step of its last use (least recently used goes first).
    used: u64,
}

/// What happened to a running request after its row was sampled.
enum Outcome {
    Continue,
    Finished(Finished),
    Failed(String),
}

/// A step's chunks and, for each, (index into the running requests, sample its rows).
type Plan = (Vec<ChunkSpec>, Vec<(usize, bool)>);

/// Engine errors are boxed: they carry flight records and are large.
type StepResult<T> = std::result::Result<T, Box<EngineError>>;

/// Runs until [`Control::Shutdown`] or until every sender is gone. An engine error (a lost
/// rank, a timeout) ends it: every request gets [`Event::Failed`] and the error is returned.
pub fn run(
    exec: &mut dyn StepExecutor,
    tokenizer: &Tokenizer,
    cfg: &SchedulerConfig,
    rx: &Receiver<Control>,
    load: &Load,
    metrics: &Metrics,
) -> crate::error::Result<()> {
    run_models(exec, tokenizer, cfg, rx, load, metrics, String::new(), None)
}

/// [`run`] with the first model's name (for the rollout's figures and log lines) and the
/// path it was loaded from (to load it back after a drain swap; `None`: unknown, no drain).
#[allow(clippy::too_many_arguments)]
pub fn run_models(
    exec: &mut dyn StepExecutor,
    tokenizer: &Tokenizer,
    cfg: &SchedulerConfig,
    rx: &Receiver<Control>,
    load: &Load,
    metrics: &Metrics,
    name: String,
    path: Option<String>,
) -> crate::error::Result<()> {
    exec.set_block_limit(cfg.kv_blocks);
    metrics.kv_blocks_total.set(cfg.kv_blocks as f64);
    // The executor's first model is model 0.
    let first = Scheduler::new(cfg, tokenizer, load, metrics, 0);
    let mut fleet = crate::rollout::Fleet::new(first, name, path);
    let out = fleet.run(exec, rx);
    let end = match &out {
        Ok(()) => Event::Failed {
            message: "the server is shutting down".into(),
            shutting_down: true,
        },
        Err(e) => Event::failed(format!("the inference engine failed: {}", chain(&**e))),
    };
    fleet.abandon_all(exec, &end);
    Ok(out?)
}

/// The scheduler of one held model: its queue, running sequences and prefix cache (a
/// sequence and a cached prefix belong to the model they were computed on).
pub(crate) struct Scheduler<'a, 't> {
    /// The held model (the executor's id) this one schedules on.
    pub(crate) model: u32,
    /// Requests that finished, and that failed, on this model (the rollout's error rate).
    pub(crate) finished: u64,
    pub(crate) failed: u64,
    cfg: &'a SchedulerConfig,
    tokenizer: &'t Tokenizer,
    load: &'a Load,
    metrics: &'a Metrics,
    waiting: VecDeque<Queued<'t>>,
    /// In admission order.
    running: Vec<Running<'t>>,
    /// The prefix cache, least recently used first.
    cached: Vec<CachedPrefix>,
    next_slot: u32,
    /// Forward steps so far (the prefix cache's clock).
    steps: u64,
    /// Time in forward steps so far.
    step_time: Duration,
    /// Steps launched and not yet landed, oldest first (pipelining; see [`pipeline`]).
    flights: VecDeque<Flight>,
    /// What a step costs per token fed (adaptive speculation, [`crate::spec::SpecBatch`]).
    step_cost: crate::spec::StepCost,
}

/// Length of the common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<'a, 't> Scheduler<'a, 't> {
    pub(crate) fn new(
        cfg: &'a SchedulerConfig,
        tokenizer: &'t Tokenizer,
        load: &'a Load,
        metrics: &'a Metrics,
        model: u32,
    ) -> Self {
        Scheduler {
            model,
            finished: 0,
            failed: 0,
            cfg,
            tokenizer,
            load,
            metrics,
            waiting: VecDeque::new(),
            running: Vec::new(),
            cached: Vec::new(),
            next_slot: 0,
            steps: 0,
            step_time: Duration::ZERO,
            flights: VecDeque::new(),
            step_cost: crate::spec::StepCost::default(),
        }
    }

    pub(crate) fn cfg(&self) -> &'a SchedulerConfig {
        self.cfg
    }

    pub(crate) fn metrics(&self) -> &'a Metrics {
        self.metrics
    }

    pub(crate) fn tokenizer(&self) -> &'t Tokenizer {
        self.tokenizer
    }

    pub(crate) fn load(&self) -> &'a Load {
        self.load
    }

    /// Queues a new request.
    pub(crate) fn push(&mut self, job: Job) {
        self.waiting.push_back(Queued::New(job));
    }

    pub(crate) fn running(&self) -> usize {
        self.running.len()
    }

    pub(crate) fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub(crate) fn cached(&self) -> usize {
        self.cached.len()
    }

    /// Forward steps, and their time, so far.
    pub(crate) fn steps(&self) -> (u64, Duration) {
        (self.steps, self.step_time)
    }

    /// One round on this model (selected in the executor): requests whose client left are
    /// dropped, queued ones admitted, then one batched step.
    pub(crate) fn turn(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        self.drop_abandoned(exec)?;
        self.admit(exec)?;
        if self.running.is_empty() {
            // With nothing running and the prefix cache given back, a request that fits
            // the budget is always admitted: one left over never will be.
            self.refuse(0);
        }
        self.publish(exec);
        if !self.running.is_empty() {
            self.step(exec)?;
        }
        Ok(())
    }

    /// Gives every prefix-cache entry back (the model is no longer live: its blocks are
    /// better free).
    pub(crate) fn clear_cache(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        while self.evict_cached(exec, None)? {}
        Ok(())
    }

    /// Frees the slots of requests whose client went away (the event receiver was dropped).
    fn drop_abandoned(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        let mut i = 0;
        while i < self.waiting.len() {
            if !self.waiting[i].job().events.is_closed() {
                i += 1;
                continue;
            }
            if let Some(q) = self.waiting.remove(i) {
                self.metrics.cancelled.increment(1);
                if let Queued::New(_) = q {
                    self.load.pending.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            // One in flight is dropped once its step has landed.
            if self.running[i].job.events.is_closed() && !self.running[i].flying {
                let r = self.running.remove(i);
                self.metrics.cancelled.increment(1);
                exec.submit(Command::Close { slot: r.slot })?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Fails queued request `i`: its tokens do not fit the whole KV cache.
    pub(crate) fn refuse(&mut self, i: usize) {
        let Some(q) = self.waiting.remove(i) else {
            return;
        };
        if let Queued::New(_) = q {
            self.load.pending.fetch_sub(1, Ordering::Relaxed);
        }
        let _ = q.job().events.send(Event::failed(format!(
            "the request has {} tokens but the server's KV cache holds {} positions",
            q.context().len(),
            self.cfg.max_positions()
        )));
    }

    /// The open sequence (running or cached) sharing the longest prefix with `context`, and
    /// that length (at most `cap`).
    fn best_prefix(&self, context: &[u32], cap: usize) -> Option<(u32, usize)> {
        if !self.cfg.prefix_sharing {
            return None;
        }
        // A sequence in flight is written now: fork it once its step has landed.
        let running = self
            .running
            .iter()
            .filter(|r| !r.flying)
            .map(|r| (r.slot, r.held.as_slice()));
        let cached = self.cached.iter().map(|c| (c.slot, c.tokens.as_slice()));
        running
            .chain(cached)
            .map(|(slot, tokens)| (slot, common_prefix(context, tokens).min(cap)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(slot, n)| (n, std::cmp::Reverse(slot)))
    }

    /// Longest prefix of `context` that a running sequence will hold once its prefill is done.
    fn coming_prefix(&self, context: &[u32], cap: usize) -> usize {
        if !self.cfg.prefix_sharing {
            return 0;
        }
        self.running
            .iter()
            .filter(|r| r.prefill_left() > 0)
            .map(|r| common_prefix(context, &r.context).min(cap))
            .max()
            .unwrap_or(0)
    }

    /// Gives the least recently used prefix-cache entry back (not `keep`); false when there
    /// is none.
    fn evict_cached(&mut self, exec: &mut dyn StepExecutor, keep: Option<u32>) -> StepResult<bool> {
        let Some(i) = self
            .cached
            .iter()
            .enumerate()
            .filter(|(_, c)| Some(c.slot) != keep)
            .min_by_key(|(_, c)| c.used)
            .map(|(i, _)| i)
        else {
            return Ok(false);
        };
        let c = self.cached.remove(i);
        exec.submit(Command::Close { slot: c.slot })?;
        Ok(true)
    }

    fn new_slot(&mut self, exec: &dyn StepExecutor) -> u32 {
        loop {
            let slot = self.next_slot;
            self.next_slot = self.next_slot.wrapping_add(1);
            if exec.slots().table(slot).is_none() {
                return slot;
            }
        }
    }

    /// Admits queued requests in order while their prompt's blocks are free now (after the
    /// prefix cache gives back what it must), keeping one block of growth per running
    /// request. A request that would share a prefix another is still prefilling waits for it.
    fn admit(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        let mut i = 0;
        while i < self.waiting.len() && self.running.len() < self.cfg.max_seqs {
            let q = &self.waiting[i];
            let context = q.context().to_vec();
            let context = context.as_slice();
            let resumed = matches!(q, Queued::Preempted(_));
            let whole = context.len().div_ceil(BLOCK_POSITIONS);
            if whole > self.cfg.kv_blocks && !resumed {
                // The HTTP side checks this; never let one request block the queue forever.
                self.refuse(i);
                continue;
            }
            // A new request feeds at least one token (its last row gives the first logits).
            let cap = if resumed {
                context.len()
            } else {
                context.len().saturating_sub(1)
            };
            let mut source = self.best_prefix(context, cap);
            let shared = source.map_or(0, |(_, n)| n);
            if self.coming_prefix(context, cap) > shared {
                i += 1;
                continue;
            }
            let growth = self.running.len();
            let want = |shared: usize| whole - shared / BLOCK_POSITIONS + growth;
            let keep = source.map(|(slot, _)| slot);
            let free = |exec: &dyn StepExecutor| exec.slots().pool().free_blocks();
            while free(exec) < want(shared) && self.evict_cached(exec, keep)? {}
            if free(exec) < want(shared) {
                // The cached source holds the blocks it needs more than the shared prefix
                // saves: give it back too and start from nothing.
                let cached_source = keep.filter(|k| self.cached.iter().any(|c| c.slot == *k));
                if cached_source.is_none() || !self.evict_cached(exec, None)? {
                    break;
                }
                while free(exec) < want(0) && self.evict_cached(exec, None)? {}
                source = self.best_prefix(context, cap);
                if free(exec) < want(source.map_or(0, |(_, n)| n)) {
                    break;
                }
            }
            let Some(q) = self.waiting.remove(i) else {
                break;
            };
            self.start(exec, q, source)?;
        }
        Ok(())
    }

    /// Opens a queued request's sequence (a fork of `source` when it shares a prefix).
    fn start(
        &mut self,
        exec: &mut dyn StepExecutor,
        q: Queued<'t>,
        source: Option<(u32, usize)>,
    ) -> StepResult<()> {
        let mut r = match q {
            Queued::Preempted(r) => *r,
            Queued::New(job) => {
                self.load.pending.fetch_sub(1, Ordering::Relaxed);
                self.metrics
                    .queue_time
                    .record(job.arrived.elapsed().as_secs_f64());
                if job.prompt.is_empty() {
                    // The HTTP side refuses these; without a token there is nothing to run.
                    let _ = job.events.send(Event::failed("the prompt has no tokens"));
                    return Ok(());
                }
                let decoder = match SequenceDecoder::new(self.tokenizer, job.params.clone()) {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = job.events.send(Event::failed(e.to_string()));
                        return Ok(());
                    }
                };
                let metrics = &self.metrics;
                let spec = self
                    .cfg
                    .spec
                    .as_ref()
                    .and_then(|s| SeqSpec::new(s, &job.prompt, metrics));
                Running {
                    spec,
                    context: job.prompt.clone(),
                    job,
                    slot: 0,
                    held: Vec::new(),
                    resumed: false,
                    decoder,
                    first_token: None,
                    flying: false,
                }
            }
        };
        let slot = self.new_slot(exec);
        let capacity = (r.job.prompt.len() + r.job.params.max_tokens) as u32;
        let cmd = match source {
            Some((src, len)) => Command::Fork {
                dst: slot,
                src,
                len: len as u32,
                capacity,
            },
            None => Command::Open { slot, capacity },
        };
        if let Err(e) = exec.submit(cmd) {
            let _ = r.job.events.send(Event::failed(e.to_string()));
            return Err(Box::new(e));
        }
        if let Some((src, len)) = source {
            self.metrics.prefix_cache_hits.increment(1);
            self.metrics.board.prefix_hit();
            self.metrics.prefix_cache_hit_tokens.increment(len as u64);
            let steps = self.steps;
            if let Some(c) = self.cached.iter_mut().find(|c| c.slot == src) {
                c.used = steps;
            }
        }
        r.slot = slot;
        r.held = r.context[..source.map_or(0, |(_, n)| n)].to_vec();
        self.running.push(r);
        Ok(())
    }

    fn publish(&self, exec: &dyn StepExecutor) {
        let m = self.metrics;
        let pool = exec.slots().pool();
        m.waiting.set(self.waiting.len() as f64);
        m.running.set(self.running.len() as f64);
        m.kv_blocks_used.set(pool.in_use() as f64);
        m.prefix_cache_entries.set(self.cached.len() as f64);
        m.kv_cache_bytes.set(pool.bytes() as f64);
    }

    /// This step's chunks for the running requests in `chosen` (slots): a decode token for
    /// every one that has one, then prefill chunks in admission order within the per-step
    /// token cap.
    fn plan(&self, chosen: &[u32]) -> Plan {
        let mut chunks: Vec<ChunkSpec> = Vec::with_capacity(self.running.len());
        let mut rows = Vec::with_capacity(self.running.len());
        let mine = |r: &Running<'_>| chosen.contains(&r.slot);
        for (i, r) in self.running.iter().enumerate() {
            if r.prefill_left() > 0 || !mine(r) {
                continue;
            }
            if let Some(t) = r.decoder.next_input() {
                let drafts = r.spec.as_ref().map_or(&[][..], |s| &s.drafts);
                let mut chunk = ChunkSpec::new(r.slot, [&[t][..], drafts].concat())
                    .with_need(r.decoder.row_need());
                chunk.all_logits = !drafts.is_empty();
                chunks.push(chunk);
                rows.push((i, true));
            }
        }
        let decode_tokens: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        let mut budget = self
            .cfg
            .max_batch_tokens
            .saturating_sub(decode_tokens)
            .max(1);
        for (i, r) in self.running.iter().enumerate() {
            let left = r.prefill_left();
            if left == 0 || budget == 0 || !mine(r) {
                continue;
            }
            let n = left.min(budget);
            budget -= n;
            let from = r.held.len();
            let sample = n == left && !r.resumed;
            // A row nobody samples: the cheapest there is.
            let need = if sample {
                r.decoder.row_need()
            } else {
                RowNeed::Candidates { k: 1, lse: false }
            };
            let chunk = ChunkSpec::new(r.slot, r.context[from..from + n].to_vec());
            chunks.push(chunk.with_need(need));
            rows.push((i, sample));
        }
        (chunks, rows)
    }

    /// Frees blocks until this step's chunks (for the requests in `chosen`) fit: the prefix
    /// cache first, then drafts, then the steps in flight land, then the newest running
    /// request is preempted. Returns the chunks that fit (empty when the only running request
    /// filled the whole budget and was finished).
    fn plan_within_budget(
        &mut self,
        exec: &mut dyn StepExecutor,
        chosen: &[u32],
    ) -> StepResult<Plan> {
        loop {
            let (chunks, rows) = self.plan(chosen);
            let need: usize = exec.slots().blocks_needed_for(&chunks).iter().sum();
            if need <= exec.slots().pool().free_blocks() {
                return Ok((chunks, rows));
            }
            if self.evict_cached(exec, None)? {
                continue;
            }
            if self.drop_drafts() {
                continue;
            }
            if !self.flights.is_empty() {
                // Requests in flight cannot be preempted: let them land first.
                self.land_all(exec)?;
                continue;
            }
            if self.running.len() > 1 {
                self.preempt_newest(exec)?;
                continue;
            }
            // One request holds the whole budget and needs more: it ends as if its context
            // were full.
            if let Some(mut r) = self.running.pop() {
                match r.decoder.finish(FinishReason::Length) {
                    Ok(done) => r.finish(done, self.metrics),
                    Err(e) => {
                        let _ = r.job.events.send(Event::failed(chain(&e)));
                    }
                }
                self.close(exec, r)?;
            }
            return Ok((Vec::new(), Vec::new()));
        }
    }

    /// Frees the blocks of the latest-arrived running request and queues it first, to be
    /// recomputed from everything it held.
    fn preempt_newest(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        let Some(i) = self
            .running
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.flying)
            .max_by_key(|(_, r)| (r.job.arrived, r.slot))
            .map(|(i, _)| i)
        else {
            return Ok(());
        };
        let mut r = self.running.remove(i);
        exec.submit(Command::Close { slot: r.slot })?;
        self.metrics.preemptions.increment(1);
        self.metrics.board.preempted();
        if r.first_token.is_some() {
            // Everything it held, recomputed; its pending token is fed after. Preempted again
            // before that recompute finished, it held a prefix of the context: keep the context.
            if r.held.len() > r.context.len() {
                r.context = std::mem::take(&mut r.held);
            }
            r.resumed = true;
        }
        r.held.clear();
        self.waiting.push_front(Queued::Preempted(Box::new(r)));
        Ok(())
    }

    /// Asks every decoding request that speculates for this step's drafts, within its
    /// sequence's room, the tokens it still wants and the step's token cap left over after
    /// the decode tokens and the prefill chunks (prompts go first: drafts are optional). A
    /// request whose drafter fails goes on without drafts. Which steps draft is the
    /// speculation's [`SpecBatch`]: every one, those where at most N requests decode, or
    /// (adaptive) the drafts the measured step cost says pay. Only the requests in `chosen`
    /// (slots) draft: the others are not in this step.
    fn draft_all(&mut self, exec: &mut dyn StepExecutor, chosen: &[u32]) -> StepResult<()> {
        let Some(batch) = self.cfg.spec.as_ref().map(|s| s.batch) else {
            return Ok(());
        };
        let mine = |r: &Running<'_>| chosen.contains(&r.slot);
        let decoding = self
            .running
            .iter()
            .filter(|r| mine(r) && r.prefill_left() == 0 && r.decoder.next_input().is_some())
            .count();
        let cost = self.step_cost.line();
        let limit = match batch {
            SpecBatch::Always => None,
            SpecBatch::UpTo(m) => Some(m),
            SpecBatch::Adaptive if cost.is_none() => Some(1),
            SpecBatch::Adaptive => None,
        };
        if limit.is_some_and(|m| decoding > m) {
            self.drop_drafts();
            return Ok(());
        }
        let prefill: usize = self
            .running
            .iter()
            .filter(|r| mine(r))
            .map(Running::prefill_left)
            .sum();
        let mut budget = self.cfg.max_batch_tokens.saturating_sub(decoding + prefill);
        for r in self.running.iter_mut() {
            if !chosen.contains(&r.slot) {
                continue;
            }
            let decodes = r.prefill_left() == 0 && r.decoder.next_input().is_some();
            let Some(spec) = r.spec.as_mut() else {
                continue;
            };
            spec.drafts.clear();
            if !decodes {
                continue;
            }
            // The cache takes the next token and the drafts; rows past the tokens still
            // wanted are wasted.
            let room = exec
                .slots()
                .capacity(r.slot)
                .saturating_sub(r.held.len() + 1);
            let wanted = r
                .decoder
                .params()
                .max_tokens
                .saturating_sub(r.decoder.generated().len());
            let limit = room.min(wanted.saturating_sub(1)).min(budget);
            spec.draft(r.decoder.generated(), limit, self.metrics);
            budget -= spec.drafts.len().min(budget);
        }
        if let (SpecBatch::Adaptive, Some(cost)) = (batch, cost) {
            if decoding > 1 {
                let room = self.cfg.max_batch_tokens.saturating_sub(decoding);
                self.keep_paying_drafts(chosen, cost, decoding + prefill.min(room), decoding);
            }
        }
        Ok(())
    }

    /// Keeps the drafts that raise the step's expected tokens per second
    /// ([`crate::spec::choose_drafts`]) among the requests in `chosen` and drops the others
    /// (the step feeds `fed` tokens and gives `given` without drafts).
    fn keep_paying_drafts(&mut self, chosen: &[u32], cost: (f64, f64), fed: usize, given: usize) {
        let drafting: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let r = &self.running[i];
                chosen.contains(&r.slot) && r.spec.as_ref().is_some_and(|s| !s.drafts.is_empty())
            })
            .collect();
        let candidates: Vec<crate::spec::Candidate> = drafting
            .iter()
            .filter_map(|&i| self.running[i].spec.as_ref())
            .map(SeqSpec::candidate)
            .collect();
        let kept = crate::spec::choose_drafts(cost, fed, given, &candidates);
        for (j, &i) in drafting.iter().enumerate() {
            if !kept.contains(&j) {
                if let Some(s) = self.running[i].spec.as_mut() {
                    self.metrics.spec_drafts_dropped(s.drafts.len());
                    s.drafts.clear();
                }
            }
        }
    }

    /// Drops every request's drafts for this step (their blocks do not fit; those of requests
    /// in flight are sent already); false when there were none.
    fn drop_drafts(&mut self) -> bool {
        let mut any = false;
        let idle = self.running.iter_mut().filter(|r| !r.flying);
        for s in idle.filter_map(|r| r.spec.as_mut()) {
            any |= !s.drafts.is_empty();
            s.drafts.clear();
        }
        any
    }

    /// One batched forward and what its rows give; with pipeline stages, one launch and (when
    /// every stage is busy or nothing else can start) one landing ([`pipeline`]).
    fn step(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        let depth = exec.pipeline_depth().max(1);
        if depth > 1 {
            return self.pump(exec, depth);
        }
        let all: Vec<u32> = self.running.iter().map(|r| r.slot).collect();
        let Some((chunks, flight)) = self.prepare(exec, &all)? else {
            return Ok(());
        };
        let logits = exec.forward(chunks)?;
        self.sample(exec, flight, logits)
    }

    /// Drafts for the requests in `chosen` (slots), plans their step within the KV budget and
    /// returns its chunks with what its rows belong to; `None` when nothing is left to run.
    fn prepare(
        &mut self,
        exec: &mut dyn StepExecutor,
        chosen: &[u32],
    ) -> StepResult<Option<(Vec<ChunkSpec>, Flight)>> {
        self.draft_all(exec, chosen)?;
        if self.running.is_empty() {
            return Ok(None);
        }
        let (chunks, rows) = self.plan_within_budget(exec, chosen)?;
        if chunks.is_empty() {
            return Ok(None);
        }
        self.steps += 1;
        let flight = Flight {
            rows: rows
                .iter()
                .map(|&(i, sample)| {
                    let r = &self.running[i];
                    let drafts = r.spec.as_ref().map_or(Vec::new(), |s| s.drafts.clone());
                    (r.slot, sample, drafts)
                })
                .collect(),
            fed: chunks.iter().map(|c| c.tokens.clone()).collect(),
            // Rows of logits each chunk returns: every token's for a verification, else one.
            chunk_rows: chunks
                .iter()
                .map(tp_engine::candidates::chunk_rows)
                .collect(),
            t0: Instant::now(),
            comm_before: exec.comm_time(),
        };
        Ok(Some((chunks, flight)))
    }

    /// What a step's rows give: each request's tokens sampled and streamed, rejected drafts
    /// dropped from the caches, finished requests ended.
    fn sample(
        &mut self,
        exec: &mut dyn StepExecutor,
        f: Flight,
        logits: StepLogits,
    ) -> StepResult<()> {
        let took = f.t0.elapsed();
        self.step_time += took;
        self.metrics.step_seconds.record(took.as_secs_f64());
        self.metrics
            .step_collective_seconds
            .record(exec.comm_time().saturating_sub(f.comm_before).as_secs_f64());
        self.metrics.step_rows.record(f.chunk_rows.len() as f64);
        let fed: usize = f.fed.iter().map(Vec::len).sum();
        self.step_cost.observe(fed, took.as_secs_f64());
        let n_rows: usize = f.chunk_rows.iter().sum();
        if logits.len() != n_rows {
            return Err(Box::new(EngineError::Internal(format!(
                "{} rows of logits for {n_rows} rows",
                logits.len()
            ))));
        }
        let mut generated = 0;
        let mut ended: Vec<(u32, Outcome)> = Vec::new();
        let mut truncate = Vec::new();
        let mut row = 0;
        for (((slot, sample, drafts), tokens), n) in f.rows.into_iter().zip(f.fed).zip(f.chunk_rows)
        {
            let first = row;
            row += n;
            let Some(r) = self.running.iter_mut().find(|r| r.slot == slot) else {
                continue;
            };
            r.flying = false;
            if r.prefill_left() > 0 && !r.resumed {
                self.metrics.prompt_tokens.increment(tokens.len() as u64);
            }
            r.held.extend_from_slice(&tokens);
            if r.prefill_left() == 0 {
                r.resumed = false;
            }
            if !sample {
                continue;
            }
            let (outcome, used, accepted) = r.advance(&logits, first..row, &drafts);
            generated += used;
            if let Some(dropped) = rejected_positions(drafts.len(), used) {
                if dropped > 0 {
                    let keep = r.held.len() - dropped;
                    r.held.truncate(keep);
                    truncate.push((r.slot, keep));
                }
            }
            if let Some(s) = r.spec.as_mut() {
                s.record(used, accepted, took.as_secs_f64(), self.metrics);
            }
            if let Outcome::Continue = outcome {
                continue;
            }
            ended.push((slot, outcome));
        }
        self.metrics.board.generated(generated as u64);
        // The rejected drafts' positions leave the caches before anything else runs.
        for (slot, len) in truncate {
            exec.submit(Command::Truncate {
                slot,
                len: len as u32,
            })?;
        }
        // Latest admitted first, as the prefix cache takes them.
        let at = |slot: u32| self.running.iter().position(|r| r.slot == slot);
        ended.sort_by_key(|(slot, _)| std::cmp::Reverse(at(*slot)));
        for (slot, outcome) in ended {
            let Some(i) = self.running.iter().position(|r| r.slot == slot) else {
                continue;
            };
            let mut r = self.running.remove(i);
            match outcome {
                Outcome::Finished(done) => {
                    self.finished += 1;
                    r.finish(done, self.metrics);
                    self.keep_or_close(exec, r)?;
                }
                Outcome::Failed(msg) => {
                    self.failed += 1;
                    let _ = r.job.events.send(Event::failed(msg));
                    self.close(exec, r)?;
                }
                Outcome::Continue => {}
            }
        }
        self.publish(exec);
        Ok(())
    }

    /// A finished sequence goes to the prefix cache (the least recently used entry leaves
    /// when it is full), or is closed.
    fn keep_or_close(&mut self, exec: &mut dyn StepExecutor, r: Running<'t>) -> StepResult<()> {
        if self.cfg.prefix_cache_entries == 0 {
            return self.close(exec, r);
        }
        while self.cached.len() >= self.cfg.prefix_cache_entries {
            if !self.evict_cached(exec, None)? {
                break;
            }
        }
        self.cached.push(CachedPrefix {
            slot: r.slot,
            tokens: r.held,
            used: self.steps,
        });
        Ok(())
    }

    /// Closes a request's sequence on every rank.
    fn close(&mut self, exec: &mut dyn StepExecutor, r: Running<'t>) -> StepResult<()> {
        exec.submit(Command::Close { slot: r.slot })?;
        Ok(())
    }

    /// Tells every request still held that it ends now, and closes what can be closed.
    pub(crate) fn abandon_all(&mut self, exec: &mut dyn StepExecutor, end: &Event) {
        // Steps in flight land first (their rows unused), so the ranks agree on every slot.
        while self.flights.pop_front().is_some() {
            if exec.land().is_err() {
                self.flights.clear();
            }
        }
        for q in self.waiting.drain(..) {
            if let Queued::New(_) = q {
                self.load.pending.fetch_sub(1, Ordering::Relaxed);
            }
            let _ = q.job().events.send(end.clone());
        }
        for r in std::mem::take(&mut self.running) {
            let _ = r.job.events.send(end.clone());
            // After an engine failure this fails too; nothing more can be done then.
            let _ = exec.submit(Command::Close { slot: r.slot });
        }
        for c in std::mem::take(&mut self.cached) {
            let _ = exec.submit(Command::Close { slot: c.slot });
        }
        self.publish(exec);
    }
}

impl Running<'_> {
    /// Samples this request's next tokens from its rows `mine` of the step's logits and
    /// streams what they show: one row, or a verification's (row `j` follows draft `j - 1`),
    /// taken in order until the sequence ends or a token differs from the row's draft.
    /// Returns the outcome, the rows used (tokens generated) and the drafts accepted.
    fn advance(
        &mut self,
        logits: &StepLogits,
        mine: std::ops::Range<usize>,
        drafts: &[u32],
    ) -> (Outcome, usize, usize) {
        if self.first_token.is_none() {
            self.first_token = Some(Instant::now());
        }
        let mut accepted = 0;
        let n = mine.len();
        for (j, row) in mine.filter_map(|i| logits.row(i)).enumerate() {
            let step = match self.decoder.step_row(row) {
                Ok(s) => s,
                Err(e) => return (Outcome::Failed(chain(&e)), j + 1, accepted),
            };
            let kept = drafts.get(j) == Some(&step.token);
            accepted += usize::from(kept);
            self.send(step.shown);
            if let Some(done) = step.finished {
                return (Outcome::Finished(done), j + 1, accepted);
            }
            if !kept {
                return (Outcome::Continue, j + 1, accepted);
            }
        }
        // The last row has no draft: the loop returns at it.
        (Outcome::Continue, n, accepted)
    }

    fn send(&self, shown: Emitted) {
        if !shown.is_empty() {
            let _ = self.job.events.send(Event::Text {
                text: shown.text,
                logprobs: shown.logprobs,
            });
        }
    }

    /// Sends what the end released, reports the end and records the request's figures.
    fn finish(&mut self, done: Finished, m: &Metrics) {
        self.send(done.tail);
        let generated = self.decoder.generated().len();
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let ttft = first.duration_since(self.job.arrived);
        m.generation_tokens.increment(generated as u64);
        m.time_to_first_token.record(ttft.as_secs_f64());
        m.request_latency
            .record(now.duration_since(self.job.arrived).as_secs_f64());
        let per = (generated >= 2)
            .then(|| now.duration_since(first).as_secs_f64() / (generated - 1) as f64);
        if let Some(per) = per {
            m.time_per_output_token.record(per);
        }
        m.board.request_done(ttft.as_secs_f64(), per);
        let _ = self.job.events.send(Event::Done {
            finish: done.reason,
            usage: Usage {
                prompt_tokens: self.job.prompt.len(),
                completion_tokens: generated,
            },
            time_to_first_token: ttft,
        });
    }
}

/// An error's message followed by its causes (`a: b: c`).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

/// A cheap handle the HTTP side keeps: the control channel and the shared queue counter.
#[derive(Clone, Debug)]
pub struct SchedulerHandle {
    pub control: std::sync::mpsc::Sender<Control>,
    pub load: Arc<Load>,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::mpsc;
    use tp_engine::ScriptedExecutor;

    const VOCAB: usize = 257;
    pub(crate) const EOS: usize = 256;

    /// A byte "model": after a lowercase letter the next one, after `z` the end token; after
    /// anything else `a`. With `endless`, `z` is followed by `a` instead.
    pub(crate) fn alphabet(endless: bool) -> ScriptedExecutor {
        slow_alphabet(endless, Duration::ZERO)
    }

    /// [`alphabet`], taking `delay` per row.
    fn slow_alphabet(endless: bool, delay: Duration) -> ScriptedExecutor {
        ScriptedExecutor::new(
            VOCAB,
            100_000,
            Box::new(move |_, held| {
                std::thread::sleep(delay);
                let mut row = vec![0.0f32; VOCAB];
                let next = match held.last().map(|&t| t as u8) {
                    Some(b'z') if !endless => EOS,
                    Some(c @ b'a'..=b'y') => (c + 1) as usize,
                    _ => b'a' as usize,
                };
                row[next] = 10.0;
                row
            }),
        )
    }

    /// `blocks` KV blocks of 32 positions, `batch` tokens a step, prefix sharing but no prefix
    /// cache.
    pub(crate) fn cfg(blocks: usize, batch: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_seqs: 4,
            kv_blocks: blocks,
            max_batch_tokens: batch,
            heartbeat: Duration::from_millis(5),
            prefix_sharing: true,
            prefix_cache_entries: 0,
            spec: None,
        }
    }

    pub(crate) fn job(
        prompt: &str,
        params: DecodeParams,
    ) -> (Job, tokio::sync::mpsc::UnboundedReceiver<Event>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            prompt: prompt.bytes().map(u32::from).collect(),
            params,
            events: tx,
            arrived: Instant::now(),
            model: None,
        };
        (job, rx)
    }

    /// A request's events up to its end: the text, and the end event.
    pub(crate) fn collect(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Event>) -> (String, Event) {
        let mut text = String::new();
        loop {
            match rx.blocking_recv() {
                Some(Event::Text { text: t, .. }) => text.push_str(&t),
                Some(end) => return (text, end),
                None => panic!("the scheduler dropped a request without an end event"),
            }
        }
    }

    /// Runs the scheduler on its own thread, with `initial` queued before it starts, while
    /// `drive` talks to it; then shuts it down.
    fn with_scheduler<T>(
        exec: &mut ScriptedExecutor,
        cfg: &SchedulerConfig,
        initial: Vec<Job>,
        drive: impl FnOnce(&mpsc::Sender<Control>) -> T,
    ) -> (T, crate::error::Result<()>) {
        with_metrics(exec, cfg, initial, &Metrics::new(), drive)
    }

    /// [`with_scheduler`] recording into `metrics`.
    pub(crate) fn with_metrics<T>(
        exec: &mut ScriptedExecutor,
        cfg: &SchedulerConfig,
        initial: Vec<Job>,
        metrics: &Metrics,
        drive: impl FnOnce(&mpsc::Sender<Control>) -> T,
    ) -> (T, crate::error::Result<()>) {
        let tok = Tokenizer::bytes(&["<|endoftext|>"]);
        let load = Load::default();
        let (tx, rx) = mpsc::channel();
        for job in initial {
            load.pending.fetch_add(1, Ordering::Relaxed);
            submit(&tx, job);
        }
        std::thread::scope(|s| {
            let sched = s.spawn(move || run(exec, &tok, cfg, &rx, &load, metrics));
            let out = drive(&tx);
            let _ = tx.send(Control::Shutdown);
            let result = sched.join().expect("the scheduler thread panicked");
            (out, result)
        })
    }

    fn submit(tx: &mpsc::Sender<Control>, job: Job) {
        tx.send(Control::Submit(job))
            .expect("the scheduler is running");
    }

    /// Forward steps that carry `slot`, with the number of tokens each fed it.
    fn fed(exec: &ScriptedExecutor, slot: u32) -> Vec<usize> {
        exec.log
            .iter()
            .filter_map(|c| match c {
                Command::Forward(chunks) => chunks
                    .iter()
                    .find(|c| c.slot == slot)
                    .map(|c| c.tokens.len()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn requests_finish_by_eos_length_and_stop() {
        let mut exec = alphabet(false);
        let (a, mut ra) = job("w", DecodeParams::greedy(100));
        let (b, mut rb) = job("a", DecodeParams::greedy(3));
        let stop = DecodeParams {
            stop: vec!["ef".into()],
            ..DecodeParams::greedy(100)
        };
        let (c, mut rc) = job("a", stop);
        let (ends, result) = with_scheduler(&mut exec, &cfg(1000, 64), vec![a, b, c], |_| {
            [collect(&mut ra), collect(&mut rb), collect(&mut rc)]
        });
        result.unwrap();
        let want = [
            ("xyz", FinishReason::Eos, 3),
            ("bcd", FinishReason::Length, 3),
            ("bcd", FinishReason::Stop, 5),
        ];
        for ((text, end), (want_text, want_finish, tokens)) in ends.iter().zip(want) {
            assert_eq!(text, want_text);
            match end {
                Event::Done { finish, usage, .. } => {
                    assert_eq!((*finish, usage.completion_tokens), (want_finish, tokens));
                    assert_eq!(usage.prompt_tokens, 1);
                }
                other => panic!("{want_text}: {other:?}"),
            }
        }
        // Every sequence was closed.
        assert!(exec.open_slots().is_empty(), "{:?}", exec.open_slots());
    }

    /// The value of the metric line that starts with `name ` in `text`.
    pub(crate) fn metric(metrics: &Metrics, name: &str) -> f64 {
        let text = metrics.render();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    }

    /// Every request's text and end, run one at a time with memory to spare.
    fn alone(prompts: &[(String, usize)]) -> Vec<(String, Event)> {
        alone_on(prompts, || alphabet(true))
    }

    /// [`alone`] on the model `model` makes.
    fn alone_on(
        prompts: &[(String, usize)],
        model: impl Fn() -> ScriptedExecutor,
    ) -> Vec<(String, Event)> {
        prompts
            .iter()
            .map(|(p, max)| {
                let mut exec = model();
                let (j, mut r) = job(p, DecodeParams::greedy(*max));
                let (out, result) =
                    with_scheduler(&mut exec, &cfg(1000, 64), vec![j], |_| collect(&mut r));
                result.unwrap();
                out
            })
            .collect()
    }

    /// Text of a finished request, failing on any other end.
    pub(crate) fn done_text((text, end): &(String, Event)) -> &str {
        match end {
            Event::Done { .. } => text,
            other => panic!("{other:?}"),
        }
    }

    /// A model whose next token is the letter of the position it goes to: a request that
    /// lost part of its context (a recompute that skipped positions) gets other letters.
    fn positional() -> ScriptedExecutor {
        ScriptedExecutor::new(
            VOCAB,
            100_000,
            Box::new(|_, held| {
                let mut row = vec![0.0f32; VOCAB];
                row[usize::from(b'a') + held.len() % 26] = 10.0;
                row
            }),
        )
    }

    /// 32 requests of mixed lengths, prompts of 1 to 40 letters, 5 to 74 tokens each.
    fn mixed_prompts() -> Vec<(String, usize)> {
        (0..32)
            .map(|i| {
                let start = b'a' + (i % 26) as u8;
                let prompt: String = (0..1 + (i * 7) % 40)
                    .map(|k| (b'a' + (start - b'a' + k as u8) % 26) as char)
                    .collect();
                (prompt, 5 + (i * 13) % 70)
            })
            .collect()
    }

    #[test]
    fn a_budget_too_small_for_everyone_preempts_and_every_request_completes() {
        // 32 requests over 6 blocks (192 positions): at most a few fit at once, so running
        // requests are preempted and recomputed, some again before their recompute ended.
        // Both models: the alphabet (each token follows the last) and the positional one (each
        // token names its position: a recompute that lost positions changes the text).
        // With 2 and 3 steps in flight (pipeline stages) too.
        for model in [|| alphabet(true), positional] {
            for batch in [64, 16, 8] {
                for depth in [1, 2, 3] {
                    preempted_requests_complete(model, batch, depth);
                }
            }
        }
    }

    fn preempted_requests_complete(model: fn() -> ScriptedExecutor, batch: usize, depth: usize) {
        let prompts = mixed_prompts();
        let want = alone_on(&prompts, model);
        let mut exec = model();
        exec.depth = depth;
        let metrics = Metrics::new();
        let mut jobs = Vec::new();
        let mut rxs = Vec::new();
        for (p, max) in &prompts {
            let (j, r) = job(p, DecodeParams::greedy(*max));
            jobs.push(j);
            rxs.push(r);
        }
        let (got, result) = with_metrics(&mut exec, &cfg(6, batch), jobs, &metrics, |_| {
            rxs.iter_mut().map(collect).collect::<Vec<_>>()
        });
        result.unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                done_text(g),
                done_text(w),
                "request {i}, {batch} tokens a step, {depth} in flight"
            );
        }
        assert_eq!(exec.most_in_flight, if depth > 1 { depth } else { 0 });
        assert!(metric(&metrics, "tp_preemptions_total") > 0.0);
        assert_eq!(metric(&metrics, "tp_kv_blocks_used"), 0.0);
        assert!(exec.open_slots().is_empty(), "{:?}", exec.open_slots());
    }

    #[test]
    fn a_lone_request_that_fills_the_budget_ends_with_length() {
        let mut exec = alphabet(true);
        let (a, mut ra) = job("a", DecodeParams::greedy(500));
        let (big, mut rbig) = job(&"a".repeat(70), DecodeParams::greedy(1));
        let ((end, refused), result) = with_scheduler(&mut exec, &cfg(2, 64), vec![a, big], |_| {
            (collect(&mut ra), collect(&mut rbig))
        });
        result.unwrap();
        // 2 blocks hold 64 positions: the prompt and 63 tokens (the last never fed).
        match end.1 {
            Event::Done { finish, usage, .. } => {
                assert_eq!(
                    (finish, usage.completion_tokens),
                    (FinishReason::Length, 64)
                );
            }
            other => panic!("{other:?}"),
        }
        match refused.1 {
            Event::Failed { message, .. } => {
                assert!(message.contains("70 tokens"), "{message}");
                assert!(message.contains("64 positions"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn steps_in_flight_over_pipeline_stages_give_every_request_its_lone_text() {
        // 8 requests on 2 and 3 stages with room for all: a launch takes an even share of
        // the requests not in flight, so every stage has a step; each request still gets the
        // text it gets alone (the executor refuses any command touching a slot in flight).
        let prompts: Vec<(String, usize)> = mixed_prompts().into_iter().take(8).collect();
        for model in [|| alphabet(true), positional] {
            let want = alone_on(&prompts, model);
            for depth in [2, 3] {
                let mut exec = model();
                exec.depth = depth;
                let metrics = Metrics::new();
                let mut c = cfg(1000, 64);
                c.max_seqs = 8;
                let (jobs, mut rxs): (Vec<_>, Vec<_>) = prompts
                    .iter()
                    .map(|(p, max)| job(p, DecodeParams::greedy(*max)))
                    .unzip();
                let (got, result) = with_metrics(&mut exec, &c, jobs, &metrics, |_| {
                    rxs.iter_mut().map(collect).collect::<Vec<_>>()
                });
                result.unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(done_text(g), done_text(w), "request {i}, {depth} stages");
                }
                assert_eq!(exec.most_in_flight, depth, "{depth} stages");
                let pipelined = metric(&metrics, "tp_pipelined_steps_total");
                let steps = exec.log.iter().filter(|c| matches!(c, Command::Launch(_)));
                // Every launch but those that found the stages idle overlapped another.
                assert!(pipelined > 0.5 * steps.count() as f64, "{pipelined}");
                assert!(exec.open_slots().is_empty(), "{:?}", exec.open_slots());
            }
        }
    }

    /// Runs `requests` one after another (each submitted once the previous one ended) and
    /// checks that each gets its text alone.
    fn one_after_another(
        exec: &mut ScriptedExecutor,
        cfg: &SchedulerConfig,
        metrics: &Metrics,
        requests: &[(String, usize)],
    ) {
        let want = alone(requests);
        let (got, result) = with_metrics(exec, cfg, vec![], metrics, |tx| {
            let mut got = Vec::new();
            for (prompt, max) in requests {
                let (j, mut r) = job(prompt, DecodeParams::greedy(*max));
                submit(tx, j);
                got.push(collect(&mut r));
            }
            got
        });
        result.unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(done_text(g), done_text(w), "request {i}");
        }
    }

    #[test]
    fn a_finished_prefix_is_shared_by_a_later_request() {
        let mut exec = alphabet(true);
        let mut c = cfg(100, 64);
        c.prefix_cache_entries = 4;
        let metrics = Metrics::new();
        let system = "abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyz";
        let requests = [(format!("{system}q"), 5), (format!("{system}x"), 5)];
        one_after_another(&mut exec, &c, &metrics, &requests);
        // The second request forked the first one's 52 common positions and fed only its own
        // last token.
        assert!(exec.log.contains(&Command::Fork {
            dst: 1,
            src: 0,
            len: 52,
            capacity: 58
        }));
        assert_eq!(fed(&exec, 1)[0], 1);
        assert_eq!(metric(&metrics, "tp_prefix_cache_hits_total"), 1.0);
        assert_eq!(metric(&metrics, "tp_prefix_cache_hit_tokens_total"), 52.0);
    }

    #[test]
    fn a_cached_prefix_too_costly_to_keep_is_given_back_for_a_new_request() {
        // 3 blocks. The first request ends holding 2 (in the cache); the second shares only
        // 2 tokens with it and needs 2 blocks of its own: the cache must give its entry back.
        let mut exec = alphabet(true);
        let mut c = cfg(3, 64);
        c.prefix_cache_entries = 4;
        let requests = [
            ("ab".to_string() + &"c".repeat(38), 20),
            ("ab".to_string() + &"x".repeat(50), 10),
        ];
        one_after_another(&mut exec, &c, &Metrics::new(), &requests);
        assert!(exec.log.contains(&Command::Close { slot: 0 }));
    }

    #[test]
    fn requests_arriving_together_compute_a_shared_prompt_once() {
        let mut exec = alphabet(true);
        let system: String = "abcdefghijklmnopqrstuvwxyz".repeat(4); // 104 tokens
        let prompts: Vec<(String, usize)> = ["a", "b", "c"]
            .iter()
            .map(|s| (format!("{system}{s}"), 3))
            .collect();
        let want = alone(&prompts);
        let mut jobs = Vec::new();
        let mut rxs = Vec::new();
        for (p, max) in &prompts {
            let (j, r) = job(p, DecodeParams::greedy(*max));
            jobs.push(j);
            rxs.push(r);
        }
        // 32 tokens a step: the first prompt takes 4 steps; the others wait and fork it.
        let (got, result) = with_scheduler(&mut exec, &cfg(100, 32), jobs, |_| {
            rxs.iter_mut().map(collect).collect::<Vec<_>>()
        });
        result.unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(done_text(g), done_text(w));
        }
        let prompt_tokens: usize = (0..3)
            .map(|slot| fed(&exec, slot).iter().sum::<usize>())
            .sum();
        // 105 for the first, 1 + 1 for the others, and 2 decode tokens each.
        assert_eq!(prompt_tokens, 105 + 2 + 3 * 2, "{:?}", exec.log);
        let forks = exec
            .log
            .iter()
            .filter(|c| {
                matches!(
                    c,
                    Command::Fork {
                        src: 0,
                        len: 104,
                        ..
                    }
                )
            })
            .count();
        assert_eq!(forks, 2);
    }

    #[test]
    fn long_prompts_are_prefilled_in_chunks_beside_decoders() {
        let mut exec = alphabet(true);
        let (a, mut ra) = job("a", DecodeParams::greedy(6));
        // Nothing in common with the first prompt (no shared prefix).
        let (b, mut rb) = job("bcdefghijk", DecodeParams::greedy(2));
        let (ends, result) = with_scheduler(&mut exec, &cfg(1000, 4), vec![a, b], |_| {
            (collect(&mut ra), collect(&mut rb))
        });
        result.unwrap();
        assert_eq!((ends.0 .0.as_str(), ends.1 .0.as_str()), ("bcdefg", "lm"));
        // No step carries more than 4 tokens: the long prompt goes in pieces that fill what
        // the other request's one decode token leaves.
        for c in &exec.log {
            if let Command::Forward(chunks) = c {
                let n: usize = chunks.iter().map(|c| c.tokens.len()).sum();
                assert!(n <= 4, "{chunks:?}");
            }
        }
        assert_eq!(fed(&exec, 0), vec![1, 1, 1, 1, 1, 1]);
        // 3 (beside the first prompt), 3, 3, 1 (beside decodes), then its own decode token.
        assert_eq!(fed(&exec, 1), vec![3, 3, 3, 1, 1]);
    }

    #[test]
    fn a_request_whose_client_left_is_cancelled() {
        // 1 ms per row: 5000 tokens would take 5 s.
        let mut exec = slow_alphabet(true, Duration::from_millis(1));
        let (second, result) = with_scheduler(&mut exec, &cfg(10_000, 64), vec![], |tx| {
            let (a, mut ra) = job("a", DecodeParams::greedy(5000));
            submit(tx, a);
            match ra.blocking_recv() {
                Some(Event::Text { .. }) => {}
                other => panic!("{other:?}"),
            }
            drop(ra);
            let (b, mut rb) = job("a", DecodeParams::greedy(3));
            submit(tx, b);
            collect(&mut rb)
        });
        result.unwrap();
        assert_eq!(second.0, "bcd");
        assert!(exec.log.contains(&Command::Close { slot: 0 }));
        // The abandoned request stopped long before its 5000 tokens.
        assert!(fed(&exec, 0).len() < 1000, "{}", fed(&exec, 0).len());
    }

    #[test]
    fn an_idle_scheduler_sends_heartbeats() {
        let mut exec = alphabet(false);
        let (_, result) = with_scheduler(&mut exec, &cfg(100, 64), vec![], |_| {
            std::thread::sleep(Duration::from_millis(60));
        });
        result.unwrap();
        let idles = exec.log.iter().filter(|c| **c == Command::Idle).count();
        assert!(idles >= 3, "{idles} heartbeats in 60 ms at 5 ms");
        assert!(exec.forwards == 0);
    }

    #[test]
    fn an_engine_failure_fails_every_request() {
        let mut exec = alphabet(true);
        exec.fail_forward = Some(2);
        let (a, mut ra) = job("a", DecodeParams::greedy(50));
        let (end, result) = with_scheduler(&mut exec, &cfg(100, 64), vec![a], |_| collect(&mut ra));
        assert!(result.is_err());
        match end.1 {
            Event::Failed {
                message,
                shutting_down: false,
            } => assert!(message.contains("scripted"), "{message}"),
            other => panic!("{other:?}"),
        }
    }
}
