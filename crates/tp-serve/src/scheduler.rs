//! The continuous-batching scheduler: a plain loop on rank 0's thread that owns the
//! [`Worker`]. Each step it admits queued requests whose KV reservation fits the budget,
//! builds ONE [`Command::Forward`] holding a decode token for every running request plus
//! prefill chunks of newly admitted ones (capped per step so decode latency stays bounded),
//! samples each row with its request's own [`Sampler`], streams text back and closes
//! finished or abandoned sequences at once (Orca-style iteration-level scheduling).
//!
//! Every row of a batched forward is computed independently of the others (per-row
//! activation quantization, per-sequence attention), so a greedy request gets the same
//! tokens alone or batched with any others; the end-to-end tests check it.
//!
//! Rank 0 holds every request's full row of logits, so presence/frequency penalties
//! (applied to a copy of the row before sampling) and log-probabilities (of the raw row) are
//! rank-0-only work: nothing changes in the step protocol.
//!
//! A token's log-probabilities are reported with the text that shows it: once some of its
//! text has passed the [`StopMatcher`]. Tokens whose text lies wholly inside a matched stop
//! sequence (or after it) are never reported; the last reported token may reach into the
//! stop sequence. Tokens that add no text of their own (the first bytes of a character split
//! over tokens, skipped special tokens) go with the text of the token that completes it.

use crate::api::{LogprobEntry, TokenInfo, Usage};
use crate::metrics::Metrics;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;
use tp_engine::{
    top_logprobs, ChunkSpec, Command, EngineError, FinishReason, Penalties, Sampler,
    SamplingParams, StopMatcher, Worker,
};
use tp_tokenizer::{TextStream, Tokenizer};

/// Limits of the scheduler.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Most sequences generated at once.
    pub max_seqs: usize,
    /// KV cache positions all admitted requests may reserve together (per rank).
    pub kv_budget_positions: usize,
    /// Most tokens in one forward step (decode tokens plus prefill chunks).
    pub max_batch_tokens: usize,
    /// How often an idle leader tells followers it is alive (well under `--timeout`).
    pub heartbeat: Duration,
}

impl SchedulerConfig {
    /// KV positions one request reserves: its prompt and every token it may generate.
    pub fn reservation(prompt_tokens: usize, max_tokens: usize) -> usize {
        prompt_tokens + max_tokens
    }
}

/// One request handed to the scheduler.
#[derive(Debug)]
pub struct Job {
    pub prompt: Vec<u32>,
    /// At least 1; `prompt.len() + max_tokens` fits the context and the KV budget.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Presence and frequency penalties (inactive when both are 0).
    pub penalties: Penalties,
    /// Report log-probabilities with this many alternatives per token.
    pub logprobs: Option<usize>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Where text goes; the request is cancelled at the next step once it is closed.
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
}

/// What a request's handler receives.
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
        /// The server is stopping (503), rather than broken (500).
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
    reserved: usize,
    /// Prompt tokens fed so far.
    fed: usize,
    /// Sampled, not yet fed (the next decode input).
    last: Option<u32>,
    generated: usize,
    sampler: Sampler,
    /// The request's penalties, with counts of its generated tokens.
    penalties: Penalties,
    /// The penalized copy of the row (reused).
    scratch: Vec<f32>,
    stop: StopMatcher,
    text: TextStream<'t>,
    /// Log-probabilities not yet shown (when asked for).
    logprobs: Option<LogprobTrack>,
    first_token: Option<Instant>,
}

/// Log-probability entries waiting for their text to pass the stop matcher.
#[derive(Debug, Default)]
struct LogprobTrack {
    /// Alternatives per token.
    k: usize,
    /// In generation order: each with the byte offset where its text starts in the text given
    /// to the stop matcher (`None` while its text has not come out of the detokenizer).
    pending: VecDeque<(LogprobEntry, Option<usize>)>,
    /// Text given to the stop matcher so far: bytes and characters.
    pushed_bytes: usize,
    pushed_chars: usize,
    /// Bytes the stop matcher let through so far.
    shown_bytes: usize,
}

impl LogprobTrack {
    /// Gives every token still without text a place at the start of `piece`.
    fn place(&mut self, piece: &str) {
        for (entry, start) in self.pending.iter_mut().rev() {
            if start.is_some() {
                break;
            }
            *start = Some(self.pushed_bytes);
            entry.text_offset = self.pushed_chars;
        }
        self.pushed_bytes += piece.len();
        self.pushed_chars += piece.chars().count();
    }

    /// Takes the entries of tokens some of whose text is now shown.
    fn release(&mut self, shown: &str) -> Vec<LogprobEntry> {
        self.shown_bytes += shown.len();
        let mut out = Vec::new();
        while let Some((_, Some(start))) = self.pending.front() {
            if *start >= self.shown_bytes {
                break;
            }
            if let Some((entry, _)) = self.pending.pop_front() {
                out.push(entry);
            }
        }
        out
    }

    /// Generation ended without a stop sequence: everything left is part of the answer.
    fn release_all(&mut self) -> Vec<LogprobEntry> {
        let chars = self.pushed_chars;
        self.pending
            .drain(..)
            .map(|(mut entry, start)| {
                if start.is_none() {
                    entry.text_offset = chars;
                }
                entry
            })
            .collect()
    }
}

/// What happened to a running request after its row was sampled.
enum Outcome {
    Continue,
    Finished(FinishReason),
    Failed(String),
}

/// Engine errors are boxed: they carry flight records and are large.
type StepResult<T> = std::result::Result<T, Box<EngineError>>;

/// Runs until [`Control::Shutdown`] or until every sender is gone. An engine error (a lost
/// rank, a timeout) ends it: every request gets [`Event::Failed`] and the error is returned.
pub fn run(
    worker: &mut Worker,
    tokenizer: &Tokenizer,
    cfg: &SchedulerConfig,
    rx: &Receiver<Control>,
    load: &Load,
    metrics: &Metrics,
) -> crate::error::Result<()> {
    let mut s = Scheduler {
        cfg,
        tokenizer,
        load,
        metrics,
        waiting: VecDeque::new(),
        running: Vec::new(),
        free_slots: (0..cfg.max_seqs as u32).rev().collect(),
        reserved: 0,
    };
    metrics
        .kv_budget_positions
        .set(cfg.kv_budget_positions as f64);
    let out = s.run(worker, rx);
    let end = match &out {
        Ok(()) => Event::Failed {
            message: "the server is shutting down".into(),
            shutting_down: true,
        },
        Err(e) => Event::failed(format!("the inference engine failed: {e}")),
    };
    s.abandon_all(worker, &end);
    Ok(out?)
}

struct Scheduler<'a, 't> {
    cfg: &'a SchedulerConfig,
    tokenizer: &'t Tokenizer,
    load: &'a Load,
    metrics: &'a Metrics,
    waiting: VecDeque<Job>,
    running: Vec<Running<'t>>,
    free_slots: Vec<u32>,
    /// KV positions reserved by `running`.
    reserved: usize,
}

impl<'t> Scheduler<'_, 't> {
    fn run(&mut self, worker: &mut Worker, rx: &Receiver<Control>) -> StepResult<()> {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match rx.recv_timeout(self.cfg.heartbeat) {
                    Ok(Control::Submit(job)) => self.waiting.push_back(job),
                    Ok(Control::Shutdown) | Err(RecvTimeoutError::Disconnected) => return Ok(()),
                    Err(RecvTimeoutError::Timeout) => {
                        worker.submit(Command::Idle)?;
                        continue;
                    }
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(Control::Submit(job)) => self.waiting.push_back(job),
                    Ok(Control::Shutdown) | Err(TryRecvError::Disconnected) => return Ok(()),
                    Err(TryRecvError::Empty) => break,
                }
            }
            self.drop_abandoned(worker)?;
            self.admit(worker)?;
            self.publish(worker);
            if self.running.is_empty() {
                continue;
            }
            self.step(worker)?;
        }
    }

    /// Frees the slots of requests whose client went away (the event receiver was dropped).
    fn drop_abandoned(&mut self, worker: &mut Worker) -> StepResult<()> {
        let before = self.waiting.len();
        self.waiting.retain(|j| !j.events.is_closed());
        let gone = before - self.waiting.len();
        self.load.pending.fetch_sub(gone, Ordering::Relaxed);
        self.metrics.cancelled.increment(gone as u64);
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].job.events.is_closed() {
                let r = self.running.swap_remove(i);
                self.metrics.cancelled.increment(1);
                self.release(worker, r)?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Admits queued requests in arrival order while their reservations fit.
    fn admit(&mut self, worker: &mut Worker) -> StepResult<()> {
        while let Some(front) = self.waiting.front() {
            let need = SchedulerConfig::reservation(front.prompt.len(), front.max_tokens);
            if need > self.cfg.kv_budget_positions {
                // The HTTP side checks this; never let one request block the queue forever.
                let job = self.waiting.pop_front().expect("front exists");
                self.load.pending.fetch_sub(1, Ordering::Relaxed);
                let _ = job.events.send(Event::failed(format!(
                    "the request needs {need} KV positions but the server's budget is {}",
                    self.cfg.kv_budget_positions
                )));
                continue;
            }
            if self.reserved + need > self.cfg.kv_budget_positions {
                break;
            }
            let Some(slot) = self.free_slots.pop() else {
                break;
            };
            let job = self.waiting.pop_front().expect("front exists");
            self.load.pending.fetch_sub(1, Ordering::Relaxed);
            let penalties = job.penalties.clone();
            let logprobs = job.logprobs.map(|k| LogprobTrack {
                k,
                ..LogprobTrack::default()
            });
            let sampler = match Sampler::new(job.sampling.clone()) {
                Ok(s) => s,
                Err(e) => {
                    self.free_slots.push(slot);
                    let _ = job.events.send(Event::failed(e.to_string()));
                    continue;
                }
            };
            if let Err(e) = worker.submit(Command::Open {
                slot,
                capacity: need as u32,
            }) {
                self.free_slots.push(slot);
                let _ = job.events.send(Event::failed(e.to_string()));
                return Err(Box::new(e));
            }
            let now = Instant::now();
            self.metrics
                .queue_time
                .record(now.duration_since(job.arrived).as_secs_f64());
            self.reserved += need;
            self.running.push(Running {
                stop: StopMatcher::new(&job.stop),
                job,
                slot,
                reserved: need,
                fed: 0,
                last: None,
                generated: 0,
                sampler,
                penalties,
                scratch: Vec::new(),
                text: self.tokenizer.stream(),
                logprobs,
                first_token: None,
            });
        }
        Ok(())
    }

    fn publish(&self, worker: &Worker) {
        let m = self.metrics;
        m.waiting.set(self.waiting.len() as f64);
        m.running.set(self.running.len() as f64);
        m.kv_reserved_positions.set(self.reserved as f64);
        m.kv_cache_bytes.set(worker.cache_bytes() as f64);
    }

    /// One batched forward: a decode token per running request that has one, then prefill
    /// chunks in admission order within the per-step token cap.
    fn step(&mut self, worker: &mut Worker) -> StepResult<()> {
        let mut chunks: Vec<ChunkSpec> = Vec::with_capacity(self.running.len());
        // (index into running, tokens fed by this chunk, sample its row)
        let mut rows: Vec<(usize, usize, bool)> = Vec::with_capacity(self.running.len());
        for (i, r) in self.running.iter().enumerate() {
            if let Some(t) = r.last {
                chunks.push(ChunkSpec {
                    slot: r.slot,
                    tokens: vec![t],
                    all_logits: false,
                });
                rows.push((i, 0, true));
            }
        }
        let mut budget = self
            .cfg
            .max_batch_tokens
            .saturating_sub(chunks.len())
            .max(1);
        for (i, r) in self.running.iter().enumerate() {
            let left = r.job.prompt.len() - r.fed;
            if left == 0 || budget == 0 {
                continue;
            }
            let n = left.min(budget);
            budget -= n;
            chunks.push(ChunkSpec {
                slot: r.slot,
                tokens: r.job.prompt[r.fed..r.fed + n].to_vec(),
                all_logits: false,
            });
            rows.push((i, n, n == left));
        }
        if chunks.is_empty() {
            return Ok(());
        }
        let comm_before = worker.profile.comm;
        let t0 = Instant::now();
        let n_rows = chunks.len();
        let logits = worker
            .submit(Command::Forward(chunks))?
            .ok_or_else(|| EngineError::Internal("a forward step returned no logits".into()))?;
        self.metrics.step_seconds.record(t0.elapsed().as_secs_f64());
        self.metrics.step_collective_seconds.record(
            worker
                .profile
                .comm
                .saturating_sub(comm_before)
                .as_secs_f64(),
        );
        self.metrics.step_rows.record(n_rows as f64);
        let vocab = logits.len() / n_rows.max(1);
        if vocab == 0 || logits.len() != n_rows * vocab {
            return Err(Box::new(EngineError::Internal(format!(
                "{} logits for {n_rows} rows",
                logits.len()
            ))));
        }
        let mut finished: Vec<(usize, Outcome)> = Vec::new();
        for (row, &(i, fed, sample)) in rows.iter().enumerate() {
            let r = &mut self.running[i];
            if fed > 0 {
                r.fed += fed;
                self.metrics.prompt_tokens.increment(fed as u64);
            }
            if !sample {
                continue;
            }
            let outcome = r.advance(&logits[row * vocab..(row + 1) * vocab], self.tokenizer);
            if let Outcome::Continue = outcome {
                continue;
            }
            finished.push((i, outcome));
        }
        // Highest index first so swap_remove keeps the others' indices valid.
        finished.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, outcome) in finished {
            let mut r = self.running.swap_remove(i);
            match outcome {
                Outcome::Finished(why) => r.finish(why, self.metrics),
                Outcome::Failed(msg) => {
                    let _ = r.job.events.send(Event::failed(msg));
                }
                Outcome::Continue => {}
            }
            self.release(worker, r)?;
        }
        self.publish(worker);
        Ok(())
    }

    /// Closes a request's sequence on every rank and returns its reservation.
    fn release(&mut self, worker: &mut Worker, r: Running<'t>) -> StepResult<()> {
        self.reserved -= r.reserved;
        self.free_slots.push(r.slot);
        worker.submit(Command::Close { slot: r.slot })?;
        Ok(())
    }

    /// Tells every request still held that it ends now, and closes what can be closed.
    fn abandon_all(&mut self, worker: &mut Worker, end: &Event) {
        for job in self.waiting.drain(..) {
            self.load.pending.fetch_sub(1, Ordering::Relaxed);
            let _ = job.events.send(end.clone());
        }
        for r in std::mem::take(&mut self.running) {
            let _ = r.job.events.send(end.clone());
            // After an engine failure this fails too; nothing more can be done then.
            let _ = worker.submit(Command::Close { slot: r.slot });
        }
        self.reserved = 0;
        self.publish(worker);
    }
}

impl Running<'_> {
    /// Samples this request's next token from its row and streams what it adds.
    fn advance(&mut self, logits: &[f32], tokenizer: &Tokenizer) -> Outcome {
        let sampled = if self.penalties.is_active() {
            self.scratch.clear();
            self.scratch.extend_from_slice(logits);
            self.penalties.apply(&mut self.scratch);
            self.sampler.sample(&self.scratch)
        } else {
            self.sampler.sample(logits)
        };
        let token = match sampled {
            Ok(t) => t,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        if self.first_token.is_none() {
            self.first_token = Some(Instant::now());
        }
        if !self.job.ignore_eos && tokenizer.eos_ids().contains(&token) {
            return Outcome::Finished(FinishReason::Eos);
        }
        self.generated += 1;
        self.penalties.observe(token);
        if let Some(track) = &mut self.logprobs {
            match logprob_entry(logits, token, track.k, tokenizer) {
                Ok(entry) => track.pending.push_back((entry, None)),
                Err(e) => return Outcome::Failed(e),
            }
        }
        let piece = match self.text.push(token) {
            Ok(p) => p,
            Err(e) => return Outcome::Failed(format!("cannot decode token {token}: {e}")),
        };
        if let Some(piece) = piece {
            if let Some(track) = &mut self.logprobs {
                track.place(&piece);
            }
            let shown = self.stop.push(&piece);
            let logprobs = match &mut self.logprobs {
                Some(track) => track.release(&shown),
                None => Vec::new(),
            };
            if !shown.is_empty() || !logprobs.is_empty() {
                let _ = self.job.events.send(Event::Text {
                    text: shown,
                    logprobs,
                });
            }
        }
        if self.stop.is_stopped() {
            return Outcome::Finished(FinishReason::Stop);
        }
        if self.generated >= self.job.max_tokens {
            return Outcome::Finished(FinishReason::Length);
        }
        self.last = Some(token);
        Outcome::Continue
    }

    /// Flushes held-back text, reports the end and records the request's figures.
    fn finish(&mut self, mut why: FinishReason, m: &Metrics) {
        let mut tail = String::new();
        if !self.stop.is_stopped() {
            if let Ok(Some(piece)) = self.text.finish() {
                if let Some(track) = &mut self.logprobs {
                    track.place(&piece);
                }
                tail.push_str(&self.stop.push(&piece));
            }
            if self.stop.is_stopped() {
                why = FinishReason::Stop;
            } else {
                tail.push_str(&self.stop.finish());
            }
        }
        let logprobs = match &mut self.logprobs {
            Some(track) if self.stop.is_stopped() => track.release(&tail),
            Some(track) => {
                let mut out = track.release(&tail);
                out.extend(track.release_all());
                out
            }
            None => Vec::new(),
        };
        if !tail.is_empty() || !logprobs.is_empty() {
            let _ = self.job.events.send(Event::Text {
                text: tail,
                logprobs,
            });
        }
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let ttft = first.duration_since(self.job.arrived);
        m.generation_tokens.increment(self.generated as u64);
        m.time_to_first_token.record(ttft.as_secs_f64());
        m.request_latency
            .record(now.duration_since(self.job.arrived).as_secs_f64());
        if self.generated >= 2 {
            let per = now.duration_since(first).as_secs_f64() / (self.generated - 1) as f64;
            m.time_per_output_token.record(per);
        }
        let _ = self.job.events.send(Event::Done {
            finish: why,
            usage: Usage {
                prompt_tokens: self.job.prompt.len(),
                completion_tokens: self.generated,
            },
            time_to_first_token: ttft,
        });
    }
}

/// The log-probability report of `token` sampled from the raw row `logits`.
fn logprob_entry(
    logits: &[f32],
    token: u32,
    k: usize,
    tokenizer: &Tokenizer,
) -> std::result::Result<LogprobEntry, String> {
    let lp = top_logprobs(logits, token, k).map_err(|e| e.to_string())?;
    let info = |id: u32, logprob: f64| {
        tokenizer
            .token_bytes(id)
            .map(|b| TokenInfo::new(b, logprob))
            .map_err(|e| format!("cannot decode token {id}: {e}"))
    };
    Ok(LogprobEntry {
        chosen: info(lp.token, lp.logprob)?,
        top: lp
            .top
            .iter()
            .map(|&(id, l)| info(id, l))
            .collect::<std::result::Result<_, _>>()?,
        text_offset: 0,
    })
}

/// A cheap handle the HTTP side keeps: the control channel and the shared queue counter.
#[derive(Clone, Debug)]
pub struct SchedulerHandle {
    pub control: std::sync::mpsc::Sender<Control>,
    pub load: Arc<Load>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(tag: u8) -> LogprobEntry {
        LogprobEntry {
            chosen: TokenInfo::new(vec![tag], -1.0),
            top: Vec::new(),
            text_offset: usize::MAX,
        }
    }

    /// Feeds `(tag, piece)` tokens through a track and a stop matcher as `advance` and
    /// `finish` do; returns the shown text and the tags and offsets of the reported tokens.
    fn run(stops: &[&str], tokens: &[(u8, Option<&str>)]) -> (String, Vec<(u8, usize)>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut stop = StopMatcher::new(&stops);
        let mut track = LogprobTrack::default();
        let mut text = String::new();
        let mut reported = Vec::new();
        for &(tag, piece) in tokens {
            if stop.is_stopped() {
                break;
            }
            track.pending.push_back((entry(tag), None));
            if let Some(piece) = piece {
                track.place(piece);
                let shown = stop.push(piece);
                reported.extend(track.release(&shown));
                text.push_str(&shown);
            }
        }
        let tail = stop.finish();
        reported.extend(track.release(&tail));
        if !stop.is_stopped() {
            reported.extend(track.release_all());
        }
        text.push_str(&tail);
        let tags = reported
            .iter()
            .map(|e| (e.chosen.bytes[0], e.text_offset))
            .collect();
        (text, tags)
    }

    #[test]
    fn tokens_are_reported_with_their_text() {
        // No stop: every token, offsets in characters.
        let (text, tags) = run(
            &[],
            &[(1, Some("é")), (2, None), (3, Some("ab")), (4, None)],
        );
        assert_eq!(text, "éab");
        assert_eq!(tags, vec![(1, 0), (2, 1), (3, 1), (4, 3)]);
    }

    #[test]
    fn tokens_inside_a_stop_sequence_are_dropped() {
        // "abc E" reaches into the stop "END": reported; "ND" and later: not.
        let (text, tags) = run(
            &["END"],
            &[(1, Some("abc E")), (2, Some("ND")), (3, Some("x"))],
        );
        assert_eq!(text, "abc ");
        assert_eq!(tags, vec![(1, 0)]);
        // A token that starts the stop sequence is not reported.
        let (text, tags) = run(
            &["END"],
            &[(1, Some("ab")), (2, Some("E")), (3, Some("ND"))],
        );
        assert_eq!(text, "ab");
        assert_eq!(tags, vec![(1, 0)]);
        // A near miss releases the held-back tokens.
        let (text, tags) = run(&["END"], &[(1, Some("a")), (2, Some("E")), (3, Some("x"))]);
        assert_eq!(text, "aEx");
        assert_eq!(tags, vec![(1, 0), (2, 1), (3, 2)]);
        // Held back at the end without a match: reported at finish.
        let (text, tags) = run(&["END"], &[(1, Some("a")), (2, Some("EN"))]);
        assert_eq!(text, "aEN");
        assert_eq!(tags, vec![(1, 0), (2, 1)]);
    }
}
