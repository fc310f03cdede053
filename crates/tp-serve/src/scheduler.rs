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
//! Rank 0 holds every request's full row of logits, so each request's
//! [`SequenceDecoder`] (penalties, sampling, log-probabilities, stop strings, text; the same
//! one `tp generate` and `tp chat` use) is rank-0-only work: nothing changes in the step
//! protocol.
//!
//! The scheduler drives a [`StepExecutor`]: rank 0's [`tp_engine::Worker`] in the server, a
//! [`tp_engine::ScriptedExecutor`] in the unit tests below.

use crate::api::{LogprobEntry, Usage};
use crate::metrics::Metrics;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;
use tp_engine::{
    ChunkSpec, Command, DecodeParams, Emitted, EngineError, FinishReason, Finished,
    SequenceDecoder, StepExecutor,
};
use tp_tokenizer::Tokenizer;

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
    /// How to decode; `prompt.len() + params.max_tokens` fits the context and the KV budget.
    pub params: DecodeParams,
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
    decoder: SequenceDecoder<'t>,
    first_token: Option<Instant>,
}

/// What happened to a running request after its row was sampled.
enum Outcome {
    Continue,
    Finished(Finished),
    Failed(String),
}

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
    let out = s.run(exec, rx);
    let end = match &out {
        Ok(()) => Event::Failed {
            message: "the server is shutting down".into(),
            shutting_down: true,
        },
        Err(e) => Event::failed(format!("the inference engine failed: {e}")),
    };
    s.abandon_all(exec, &end);
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
    fn run(&mut self, exec: &mut dyn StepExecutor, rx: &Receiver<Control>) -> StepResult<()> {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match rx.recv_timeout(self.cfg.heartbeat) {
                    Ok(Control::Submit(job)) => self.waiting.push_back(job),
                    Ok(Control::Shutdown) | Err(RecvTimeoutError::Disconnected) => return Ok(()),
                    Err(RecvTimeoutError::Timeout) => {
                        exec.submit(Command::Idle)?;
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
            self.drop_abandoned(exec)?;
            self.admit(exec)?;
            self.publish(exec);
            if self.running.is_empty() {
                continue;
            }
            self.step(exec)?;
        }
    }

    /// Frees the slots of requests whose client went away (the event receiver was dropped).
    fn drop_abandoned(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
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
                self.release(exec, r)?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Admits queued requests in arrival order while their reservations fit.
    fn admit(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        while let Some(front) = self.waiting.front() {
            let need = SchedulerConfig::reservation(front.prompt.len(), front.params.max_tokens);
            if need > self.cfg.kv_budget_positions {
                // The HTTP side checks this; never let one request block the queue forever.
                let Some(job) = self.waiting.pop_front() else {
                    break;
                };
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
            let Some(job) = self.waiting.pop_front() else {
                self.free_slots.push(slot);
                break;
            };
            self.load.pending.fetch_sub(1, Ordering::Relaxed);
            let decoder = match SequenceDecoder::new(self.tokenizer, job.params.clone()) {
                Ok(d) => d,
                Err(e) => {
                    self.free_slots.push(slot);
                    let _ = job.events.send(Event::failed(e.to_string()));
                    continue;
                }
            };
            if let Err(e) = exec.submit(Command::Open {
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
                job,
                slot,
                reserved: need,
                fed: 0,
                decoder,
                first_token: None,
            });
        }
        Ok(())
    }

    fn publish(&self, exec: &dyn StepExecutor) {
        let m = self.metrics;
        m.waiting.set(self.waiting.len() as f64);
        m.running.set(self.running.len() as f64);
        m.kv_reserved_positions.set(self.reserved as f64);
        m.kv_cache_bytes.set(exec.cache_bytes() as f64);
    }

    /// One batched forward: a decode token per running request that has one, then prefill
    /// chunks in admission order within the per-step token cap.
    fn step(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        let mut chunks: Vec<ChunkSpec> = Vec::with_capacity(self.running.len());
        // (index into running, tokens fed by this chunk, sample its row)
        let mut rows: Vec<(usize, usize, bool)> = Vec::with_capacity(self.running.len());
        for (i, r) in self.running.iter().enumerate() {
            if let Some(t) = r.decoder.next_input() {
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
        let comm_before = exec.comm_time();
        let t0 = Instant::now();
        let n_rows = chunks.len();
        let logits = exec
            .submit(Command::Forward(chunks))?
            .ok_or_else(|| EngineError::Internal("a forward step returned no logits".into()))?;
        self.metrics.step_seconds.record(t0.elapsed().as_secs_f64());
        self.metrics
            .step_collective_seconds
            .record(exec.comm_time().saturating_sub(comm_before).as_secs_f64());
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
            let outcome = r.advance(&logits[row * vocab..(row + 1) * vocab]);
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
                Outcome::Finished(done) => r.finish(done, self.metrics),
                Outcome::Failed(msg) => {
                    let _ = r.job.events.send(Event::failed(msg));
                }
                Outcome::Continue => {}
            }
            self.release(exec, r)?;
        }
        self.publish(exec);
        Ok(())
    }

    /// Closes a request's sequence on every rank and returns its reservation.
    fn release(&mut self, exec: &mut dyn StepExecutor, r: Running<'t>) -> StepResult<()> {
        self.reserved -= r.reserved;
        self.free_slots.push(r.slot);
        exec.submit(Command::Close { slot: r.slot })?;
        Ok(())
    }

    /// Tells every request still held that it ends now, and closes what can be closed.
    fn abandon_all(&mut self, exec: &mut dyn StepExecutor, end: &Event) {
        for job in self.waiting.drain(..) {
            self.load.pending.fetch_sub(1, Ordering::Relaxed);
            let _ = job.events.send(end.clone());
        }
        for r in std::mem::take(&mut self.running) {
            let _ = r.job.events.send(end.clone());
            // After an engine failure this fails too; nothing more can be done then.
            let _ = exec.submit(Command::Close { slot: r.slot });
        }
        self.reserved = 0;
        self.publish(exec);
    }
}

impl Running<'_> {
    /// Samples this request's next token from its row and streams what it shows.
    fn advance(&mut self, logits: &[f32]) -> Outcome {
        if self.first_token.is_none() {
            self.first_token = Some(Instant::now());
        }
        let step = match self.decoder.step(logits) {
            Ok(s) => s,
            Err(e) => return Outcome::Failed(chain(&e)),
        };
        self.send(step.shown);
        match step.finished {
            Some(done) => Outcome::Finished(done),
            None => Outcome::Continue,
        }
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
        if generated >= 2 {
            let per = now.duration_since(first).as_secs_f64() / (generated - 1) as f64;
            m.time_per_output_token.record(per);
        }
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
mod tests {
    use super::*;
    use std::sync::mpsc;
    use tp_engine::ScriptedExecutor;

    const VOCAB: usize = 257;
    const EOS: usize = 256;

    /// A byte "model": after a lowercase letter the next one, after `z` the end token; after
    /// anything else `a`. With `endless`, `z` is followed by `a` instead.
    fn alphabet(endless: bool) -> ScriptedExecutor {
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

    fn cfg(kv: usize, batch: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_seqs: 4,
            kv_budget_positions: kv,
            max_batch_tokens: batch,
            heartbeat: Duration::from_millis(5),
        }
    }

    fn job(
        prompt: &str,
        params: DecodeParams,
    ) -> (Job, tokio::sync::mpsc::UnboundedReceiver<Event>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            prompt: prompt.bytes().map(u32::from).collect(),
            params,
            events: tx,
            arrived: Instant::now(),
        };
        (job, rx)
    }

    /// A request's events up to its end: the text, and the end event.
    fn collect(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Event>) -> (String, Event) {
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
        let tok = Tokenizer::bytes(&["<|endoftext|>"]);
        let load = Load::default();
        let metrics = Metrics::new();
        let (tx, rx) = mpsc::channel();
        for job in initial {
            load.pending.fetch_add(1, Ordering::Relaxed);
            submit(&tx, job);
        }
        std::thread::scope(|s| {
            let sched = s.spawn(move || run(exec, &tok, cfg, &rx, &load, &metrics));
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

    #[test]
    fn admission_waits_for_the_kv_budget() {
        // Each request reserves 1 + 10 positions; the budget holds one at a time.
        let mut exec = alphabet(true);
        let (a, mut ra) = job("a", DecodeParams::greedy(10));
        let (b, mut rb) = job("a", DecodeParams::greedy(10));
        let (c, mut rc) = job("a", DecodeParams::greedy(20));
        let ((one, two, too_big), result) =
            with_scheduler(&mut exec, &cfg(15, 64), vec![a, b, c], |_| {
                (collect(&mut ra), collect(&mut rb), collect(&mut rc))
            });
        result.unwrap();
        assert_eq!(one.0, "bcdefghijk");
        assert_eq!(two.0, "bcdefghijk");
        match too_big.1 {
            Event::Failed { message, .. } => assert!(message.contains("KV positions"), "{message}"),
            other => panic!("{other:?}"),
        }
        // The second request was opened only after the first was closed.
        let opens_and_closes: Vec<&Command> = exec
            .log
            .iter()
            .filter(|c| matches!(c, Command::Open { .. } | Command::Close { .. }))
            .collect();
        assert_eq!(
            opens_and_closes,
            vec![
                &Command::Open {
                    slot: 0,
                    capacity: 11
                },
                &Command::Close { slot: 0 },
                &Command::Open {
                    slot: 0,
                    capacity: 11
                },
                &Command::Close { slot: 0 },
            ]
        );
    }

    #[test]
    fn long_prompts_are_prefilled_in_chunks_beside_decoders() {
        let mut exec = alphabet(true);
        let (a, mut ra) = job("a", DecodeParams::greedy(6));
        let (b, mut rb) = job("abcdefghij", DecodeParams::greedy(2));
        let (ends, result) = with_scheduler(&mut exec, &cfg(1000, 4), vec![a, b], |_| {
            (collect(&mut ra), collect(&mut rb))
        });
        result.unwrap();
        assert_eq!((ends.0 .0.as_str(), ends.1 .0.as_str()), ("bcdefg", "kl"));
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
