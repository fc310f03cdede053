//! Models in rollout: the scheduler loop over every model the ranks hold. One model is live
//! (new requests run on it); a reload loads a candidate in the background on every rank
//! (steps go on meanwhile), the HTTP side runs the canary against it (requests that name it),
//! and only then switches traffic; the model that was live stays held as the previous one,
//! ready for a rollback (by the admin endpoint, the periodic canary, or the error rate of the
//! first requests after a switch).
//!
//! Each held model has its own [`Scheduler`] (queue, running sequences, prefix cache), and
//! the executor has its own KV pool and slots per model, selected before that scheduler's
//! turn: a sequence finishes on the model it started on, and a prefix is only ever shared
//! within one model. A model that is neither live nor previous (a replaced previous one, a
//! candidate that failed its canary) is dropped on every rank once its last sequence ends.
//!
//! When two models cannot be held at once, a swap drains first (see `rollout/drain.rs`).

mod drain;

pub use drain::{DrainReport, SwapPolicy};

use crate::dashboard::{ModelEntry, RolloutStatus, SchedulerView};
use crate::scheduler::{Control, Event, Job, Scheduler};
use drain::{Drain, Purpose};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tp_engine::{Command, EngineError, StepExecutor};

/// After a switch, requests on the new model that are watched for failures.
pub const WATCH_REQUESTS: u64 = 50;
/// Failures among the watched requests that roll back when they are also more than half.
pub const WATCH_MIN_FAILURES: u64 = 3;

/// What the admin side asks of the scheduler.
#[derive(Debug)]
pub enum Admin {
    /// Load `path` on every rank as a candidate (not live); the reply is its id once every
    /// rank holds it, or the loader's error. With `drain` (why, in words), a drain swap: the
    /// held models go first (see `rollout/drain.rs`) and the candidate is the only model held.
    Load {
        path: String,
        drain: Option<String>,
        reply: oneshot::Sender<Result<u32, String>>,
    },
    /// Make candidate `id` live; the model live until now becomes the previous one.
    Switch {
        id: u32,
        reply: oneshot::Sender<Result<Switched, String>>,
    },
    /// Make the previous model live again. An `automatic` one (the canary, the error rate)
    /// only undoes a switch: never a rollback, so two models cannot take turns.
    Rollback {
        reason: String,
        automatic: bool,
        reply: Option<oneshot::Sender<Result<Switched, String>>>,
    },
    /// Give candidate `id` up (`failed`: its canary failed): dropped once its requests end.
    /// A drain swap's candidate is replaced by the model live before, loaded back from its
    /// path; `reply` then tells how that went.
    Discard {
        id: u32,
        failed: bool,
        reply: Option<oneshot::Sender<Result<Switched, String>>>,
    },
}

/// The models after a switch or a rollback.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Switched {
    pub live: ModelEntry,
    pub previous: Option<ModelEntry>,
    /// After a drain swap: how long it drained and how long no model served.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drained: Option<DrainReport>,
}

/// Engine errors are boxed: they carry flight records and are large.
type StepResult<T> = std::result::Result<T, Box<EngineError>>;

struct Held<'a, 't> {
    sched: Scheduler<'a, 't>,
    name: String,
    /// Where it was loaded from (to load it back after a drain swap); `None`: unknown.
    path: Option<String>,
    /// Dropped on every rank once nothing runs on it.
    retiring: bool,
    loaded: Instant,
}

struct Loading {
    id: u32,
    name: String,
    started: Instant,
    reply: oneshot::Sender<Result<u32, String>>,
}

/// The live model's counts when it went live.
struct Watch {
    model: u32,
    finished: u64,
    failed: u64,
}

/// Every held model's scheduler and which one is live.
pub(crate) struct Fleet<'a, 't> {
    models: Vec<Held<'a, 't>>,
    live: u32,
    previous: Option<u32>,
    /// The executor's selected model.
    selected: u32,
    next_id: u32,
    loading: Option<Loading>,
    watch: Option<Watch>,
    /// The live model went live by a switch (an automatic rollback may undo it).
    switched_in: bool,
    /// The model a rollback goes back to when it is no longer held (a drain swap dropped
    /// it): its name and path.
    unheld_previous: Option<(String, String)>,
    /// A drain swap in progress.
    drain: Option<Drain>,
    status: RolloutStatus,
    started: Instant,
}

impl<'a, 't> Fleet<'a, 't> {
    /// The fleet of the first model (the executor's model 0), live.
    pub(crate) fn new(first: Scheduler<'a, 't>, name: String, path: Option<String>) -> Self {
        let live = first.model;
        let mut f = Fleet {
            models: vec![Held {
                sched: first,
                name,
                path,
                retiring: false,
                loaded: Instant::now(),
            }],
            live,
            previous: None,
            selected: live,
            next_id: live + 1,
            loading: None,
            watch: None,
            switched_in: false,
            unheld_previous: None,
            drain: None,
            status: RolloutStatus::default(),
            started: Instant::now(),
        };
        f.publish();
        f
    }

    /// Runs until [`Control::Shutdown`] or until every sender is gone.
    pub(crate) fn run(
        &mut self,
        exec: &mut dyn StepExecutor,
        rx: &Receiver<Control>,
    ) -> StepResult<()> {
        loop {
            self.poll_ranks(exec)?;
            self.progress_drain(exec)?;
            if self.running() == 0 {
                // Nothing to run (admission always succeeds for a queue's head when nothing
                // runs, so nothing is queued): wait for input, telling followers we live.
                let mut wait = self.cfg().heartbeat.min(self.metrics().board.until_poll());
                if self.loading.is_some() {
                    wait = wait.min(Duration::from_millis(20));
                }
                match rx.recv_timeout(wait.max(Duration::from_millis(1))) {
                    Ok(Control::Shutdown) | Err(RecvTimeoutError::Disconnected) => return Ok(()),
                    Ok(c) => self.take(exec, c)?,
                    Err(RecvTimeoutError::Timeout) => {
                        self.adopt_if_loaded(exec)?;
                        if self.waiting() == 0 {
                            if !self.metrics().board.poll_due() {
                                exec.submit(Command::Idle)?;
                            }
                            self.retire(exec)?;
                            continue;
                        }
                    }
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(Control::Shutdown) | Err(TryRecvError::Disconnected) => return Ok(()),
                    Ok(c) => self.take(exec, c)?,
                    Err(TryRecvError::Empty) => break,
                }
            }
            self.adopt_if_loaded(exec)?;
            for i in 0..self.models.len() {
                let m = &self.models[i].sched;
                if m.running() == 0 && m.waiting() == 0 {
                    continue;
                }
                let id = m.model;
                self.select(exec, id)?;
                self.models[i].sched.turn(exec)?;
            }
            self.check_errors();
            self.retire(exec)?;
        }
    }

    /// A model just loaded as `id` (from `path`), with a scheduler of its own configured like
    /// the others.
    fn new_held(&self, id: u32, name: String, path: String) -> Held<'a, 't> {
        let first = &self.models[0].sched;
        Held {
            sched: Scheduler::new(
                first.cfg(),
                first.tokenizer(),
                first.load(),
                first.metrics(),
                id,
            ),
            name,
            path: Some(path),
            retiring: false,
            loaded: Instant::now(),
        }
    }

    fn cfg(&self) -> &'a crate::scheduler::SchedulerConfig {
        self.models[0].sched.cfg()
    }

    fn metrics(&self) -> &'a crate::metrics::Metrics {
        self.models[0].sched.metrics()
    }

    fn running(&self) -> usize {
        self.models.iter().map(|m| m.sched.running()).sum()
    }

    fn waiting(&self) -> usize {
        self.models.iter().map(|m| m.sched.waiting()).sum()
    }

    fn held(&mut self, id: u32) -> Option<&mut Held<'a, 't>> {
        self.models.iter_mut().find(|m| m.sched.model == id)
    }

    fn select(&mut self, exec: &mut dyn StepExecutor, id: u32) -> StepResult<()> {
        if self.selected != id {
            // Steps in flight belong to the selected model: they land on it.
            let selected = self.selected;
            if let Some(m) = self.held(selected) {
                m.sched.land_all(exec)?;
            }
            exec.select_model(id)?;
            self.selected = id;
        }
        Ok(())
    }

    /// Gathers every rank's figures for the dashboard when a poll is due (the gather also
    /// tells idle followers that rank 0 lives).
    fn poll_ranks(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        let metrics = self.metrics();
        if !metrics.board.poll_due() {
            return Ok(());
        }
        let t0 = Instant::now();
        let profiles = exec.rank_profiles()?;
        let (steps, step_time) = self.models.iter().fold((0, Duration::ZERO), |(n, t), m| {
            let (sn, st) = m.sched.steps();
            (n + sn, t + st)
        });
        let view = SchedulerView {
            queue: self.waiting(),
            running: self.running(),
            steps,
            // The selected model's pool (the live one's, unless another just ran).
            kv_blocks_used: exec.slots().pool().in_use(),
            kv_blocks_total: self.cfg().kv_blocks,
            step_time,
        };
        metrics.ranks_polled(profiles, view, t0.elapsed());
        Ok(())
    }

    /// A message from the HTTP side.
    fn take(&mut self, exec: &mut dyn StepExecutor, c: Control) -> StepResult<()> {
        match c {
            Control::Submit(job) => self.route(job),
            Control::Admin(a) => self.admin(exec, a)?,
            Control::Shutdown => {}
        }
        Ok(())
    }

    /// Queues a request on the live model, or on the one it names; during a drain swap, one
    /// for the live model waits for the model that goes live.
    fn route(&mut self, job: Job) {
        let Some(job) = self.park(job) else {
            return;
        };
        let id = job.model.unwrap_or(self.live);
        match self.held(id).filter(|m| !m.retiring) {
            Some(m) => m.sched.push(job),
            None => {
                let load = self.models[0].sched.load();
                load.pending.fetch_sub(1, Ordering::Relaxed);
                let _ = job.events.send(Event::Failed {
                    message: format!("model {id} is not held by this server"),
                    shutting_down: false,
                });
            }
        }
    }

    fn admin(&mut self, exec: &mut dyn StepExecutor, a: Admin) -> StepResult<()> {
        match a {
            Admin::Load { path, drain, reply } => {
                if let Some(l) = &self.loading {
                    let _ = reply.send(Err(format!("{} is still loading", l.name)));
                    return Ok(());
                }
                if self.drain.is_some() {
                    let _ = reply.send(Err("a drain swap is in progress".into()));
                    return Ok(());
                }
                if let Some(why) = drain {
                    self.start_drain((path.clone(), path), Purpose::Reload { reply }, &why);
                    self.publish();
                    return Ok(());
                }
                // A candidate left over (its reload was abandoned before the switch) goes.
                let (live, previous) = (self.live, self.previous);
                for m in &mut self.models {
                    let id = m.sched.model;
                    if id != live && Some(id) != previous {
                        m.retiring = true;
                    }
                }
                let id = self.next_id;
                self.next_id += 1;
                if let Err(e) = exec.load_model(id, &path) {
                    let _ = reply.send(Err(e.to_string()));
                    return Ok(());
                }
                eprintln!("# tp serve: loading model {id} from {path} on every rank");
                self.loading = Some(Loading {
                    id,
                    name: path.clone(),
                    started: Instant::now(),
                    reply,
                });
                self.status.loading = Some(path);
            }
            Admin::Switch { id, reply } => {
                let r = if self.awaits(id) {
                    Ok(self.switch_drained(id))
                } else if self.drain.is_some() {
                    Err("a drain swap is in progress".into())
                } else {
                    self.switch(id)
                };
                let _ = reply.send(r);
            }
            Admin::Rollback {
                reason,
                automatic,
                reply,
            } => {
                let r = if automatic && !self.switched_in {
                    Err("the live model did not come in by a switch".into())
                } else if self.drain.is_some() {
                    Err("a drain swap is in progress".into())
                } else if self.previous.is_none() && self.unheld_previous.is_some() {
                    // Reloaded from its path once nothing runs: the reply comes then.
                    self.rollback_drained(reason, reply);
                    self.publish();
                    return Ok(());
                } else {
                    self.rollback(&reason)
                };
                if let Some(reply) = reply {
                    let _ = reply.send(r);
                }
            }
            Admin::Discard { id, failed, reply } => {
                if failed {
                    self.status.reload_failures += 1;
                }
                if self.awaits(id) {
                    let why = if failed {
                        "it failed its canary"
                    } else {
                        "the reload was given up"
                    };
                    let r = self.restore(exec, why)?;
                    if let Some(reply) = reply {
                        let _ = reply.send(r);
                    }
                    self.publish();
                    return Ok(());
                }
                if id != self.live {
                    if self.previous == Some(id) {
                        self.previous = None;
                    }
                    if let Some(m) = self.held(id) {
                        m.retiring = true;
                    }
                }
            }
        }
        self.publish();
        Ok(())
    }

    /// Adopts the background load once rank 0 has its shard (every rank then tells whether
    /// it has its own).
    fn adopt_if_loaded(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        if self.loading.is_none() || !exec.load_finished() {
            return Ok(());
        }
        let Some(l) = self.loading.take() else {
            return Ok(());
        };
        self.status.loading = None;
        match exec.adopt_model(l.id)? {
            Ok(()) => {
                // Its own pool gets the same block limit (the same KV shape: checked before).
                let live = self.selected;
                self.select(exec, l.id)?;
                exec.set_block_limit(self.cfg().kv_blocks);
                self.select(exec, live)?;
                let held = self.new_held(l.id, l.name.clone(), l.name.clone());
                self.models.push(held);
                eprintln!(
                    "# tp serve: model {} ({}) loaded on every rank in {:.1} s; not live yet",
                    l.id,
                    l.name,
                    l.started.elapsed().as_secs_f64()
                );
                let _ = l.reply.send(Ok(l.id));
            }
            Err(why) => {
                self.status.reload_failures += 1;
                eprintln!("# tp serve: cannot load {}: {why}", l.name);
                let _ = l.reply.send(Err(why));
            }
        }
        self.publish();
        Ok(())
    }

    fn switch(&mut self, id: u32) -> Result<Switched, String> {
        if id == self.live {
            return Err(format!("model {id} is live already"));
        }
        if self.held(id).is_none_or(|m| m.retiring) {
            return Err(format!("model {id} is not a loaded candidate"));
        }
        let old = self.live;
        if let Some(p) = self.previous.filter(|&p| p != id) {
            if let Some(m) = self.held(p) {
                m.retiring = true;
            }
        }
        self.previous = Some(old);
        self.unheld_previous = None;
        self.live = id;
        self.status.switches += 1;
        self.switched_in = true;
        self.start_watch();
        let s = self.switched();
        self.status.last_event = format!(
            "switched to model {} ({}) from model {} ({})",
            s.live.id,
            s.live.name,
            old,
            s.previous.as_ref().map_or("", |p| p.name.as_str())
        );
        eprintln!("# tp serve: {}", self.status.last_event);
        Ok(s)
    }

    fn rollback(&mut self, reason: &str) -> Result<Switched, String> {
        let Some(prev) = self.previous else {
            return Err("there is no previous model to roll back to".into());
        };
        let from = self.live;
        self.previous = Some(from);
        self.live = prev;
        self.watch = None;
        self.switched_in = false;
        self.status.rollbacks += 1;
        let s = self.switched();
        self.status.last_event = format!(
            "rolled back from model {from} to model {} ({}): {reason}",
            s.live.id, s.live.name
        );
        eprintln!("# tp serve: {}", self.status.last_event);
        Ok(s)
    }

    fn start_watch(&mut self) {
        let live = self.live;
        self.watch = self.held(live).map(|m| Watch {
            model: live,
            finished: m.sched.finished,
            failed: m.sched.failed,
        });
    }

    /// Rolls back when most of the first requests after a switch failed.
    fn check_errors(&mut self) {
        let Some(w) = &self.watch else {
            return;
        };
        let model = w.model;
        let (f0, e0) = (w.finished, w.failed);
        let Some(m) = self.models.iter().find(|m| m.sched.model == model) else {
            self.watch = None;
            return;
        };
        let failed = m.sched.failed - e0;
        let seen = m.sched.finished - f0 + failed;
        if failed >= WATCH_MIN_FAILURES && 2 * failed > seen && self.switched_in {
            let reason = format!("{failed} of the {seen} requests since the switch failed");
            if self.previous.is_none() && self.unheld_previous.is_some() {
                self.watch = None;
                self.rollback_drained(reason, None);
            } else {
                let _ = self.rollback(&reason);
            }
            self.publish();
        } else if seen >= WATCH_REQUESTS {
            self.watch = None;
        }
    }

    /// Models that are not live: their prefix caches given back once idle; retiring ones
    /// dropped on every rank once nothing runs on them.
    fn retire(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        let mut i = 0;
        let mut changed = false;
        while i < self.models.len() {
            let m = &self.models[i];
            let id = m.sched.model;
            let idle = m.sched.running() == 0 && m.sched.waiting() == 0;
            if id == self.live || !idle || (!m.retiring && m.sched.cached() == 0) {
                i += 1;
                continue;
            }
            self.select(exec, id)?;
            self.models[i].sched.clear_cache(exec)?;
            if self.models[i].retiring {
                let live = self.live;
                self.select(exec, live)?;
                exec.drop_model(id)?;
                let m = self.models.remove(i);
                eprintln!("# tp serve: model {id} ({}) dropped", m.name);
                changed = true;
                continue;
            }
            i += 1;
        }
        if changed {
            self.publish();
        }
        Ok(())
    }

    fn entry(&self, m: &Held<'_, '_>) -> ModelEntry {
        let id = m.sched.model;
        ModelEntry {
            id,
            name: m.name.clone(),
            role: if id == self.live {
                "live"
            } else if Some(id) == self.previous {
                "previous"
            } else if m.retiring {
                "retiring"
            } else {
                "candidate"
            }
            .into(),
            loaded_t: m.loaded.duration_since(self.started).as_secs_f64(),
            running: m.sched.running(),
            path: m.path.clone(),
        }
    }

    fn switched(&self) -> Switched {
        let find = |id: u32| {
            self.models
                .iter()
                .find(|m| m.sched.model == id)
                .map(|m| self.entry(m))
        };
        // During a drain swap the live model may be dropped already: still the one named.
        let dropped = || self.drain.as_ref().map(|d| d.dropped_live(self.live));
        Switched {
            live: find(self.live).or_else(dropped).unwrap_or_default(),
            previous: self.previous.and_then(find),
            drained: None,
        }
    }

    /// The models, switches and rollbacks on the dashboard and `/metrics`.
    fn publish(&mut self) {
        self.status.models = self.models.iter().map(|m| self.entry(m)).collect();
        self.status.live = self.switched().live;
        self.status.draining = self.drain.as_ref().map(Drain::describe);
        self.status.unheld_previous = self.unheld_previous.as_ref().map(|(_, p)| p.clone());
        self.metrics().rollout_changed(&self.status);
    }

    /// Tells every request of every model that it ends now.
    pub(crate) fn abandon_all(&mut self, exec: &mut dyn StepExecutor, end: &Event) {
        for i in 0..self.models.len() {
            let id = self.models[i].sched.model;
            // After an engine failure selecting fails too: the requests are told all the same.
            let _ = self.select(exec, id);
            self.models[i].sched.abandon_all(exec, end);
        }
        if let Some(l) = self.loading.take() {
            let _ = l.reply.send(Err("the server is shutting down".into()));
        }
        if let Some(d) = self.drain.take() {
            d.abandon(self.models[0].sched.load(), end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::scheduler::{run_models, Load, SchedulerConfig};
    use std::collections::BTreeMap;
    use std::sync::mpsc;
    use tp_engine::{ChunkSpec, DecodeParams, ScriptedExecutor, Slots, StepLogits};
    use tp_tokenizer::Tokenizer;

    const VOCAB: usize = 257;

    /// A byte model by name: "alphabet" answers the next letter; "nan" gives NaN logits (every
    /// request on it fails, as on a broken model file).
    fn scripted(name: &str) -> ScriptedExecutor {
        let nan = name == "nan";
        ScriptedExecutor::new(
            VOCAB,
            10_000,
            Box::new(move |_, held| {
                let mut row = vec![if nan { f32::NAN } else { 0.0 }; VOCAB];
                if !nan {
                    let next = match held.last().map(|&t| t as u8) {
                        Some(c @ b'a'..=b'y') => (c + 1) as usize,
                        _ => b'a' as usize,
                    };
                    row[next] = 10.0;
                }
                row
            }),
        )
    }

    /// Held models as the worker holds them: one executor per id, the selected one driven.
    struct Models {
        all: BTreeMap<u32, ScriptedExecutor>,
        selected: u32,
        loading: Option<(u32, String)>,
    }

    impl Models {
        fn current(&mut self) -> &mut ScriptedExecutor {
            self.all
                .get_mut(&self.selected)
                .expect("the selected model is held")
        }
    }

    impl StepExecutor for Models {
        fn submit(&mut self, cmd: Command) -> tp_engine::Result<Option<Vec<f32>>> {
            self.current().submit(cmd)
        }
        fn forward(&mut self, chunks: Vec<ChunkSpec>) -> tp_engine::Result<StepLogits> {
            self.current().forward(chunks)
        }
        fn slots(&self) -> &Slots {
            self.all[&self.selected].slots()
        }
        fn set_block_limit(&mut self, blocks: usize) {
            self.current().set_block_limit(blocks)
        }
        fn comm_time(&self) -> Duration {
            Duration::ZERO
        }
        fn load_model(&mut self, id: u32, path: &str) -> tp_engine::Result<()> {
            self.loading = Some((id, path.to_string()));
            Ok(())
        }
        fn load_finished(&self) -> bool {
            self.loading.is_some()
        }
        fn adopt_model(&mut self, id: u32) -> tp_engine::Result<Result<(), String>> {
            let (loading, path) = self.loading.take().expect("a load to adopt");
            assert_eq!(loading, id);
            if path == "missing" {
                return Ok(Err("no such file".into()));
            }
            self.all.insert(id, scripted(&path));
            Ok(Ok(()))
        }
        fn select_model(&mut self, id: u32) -> tp_engine::Result<()> {
            assert!(
                self.all.contains_key(&id),
                "model {id} selected but not held"
            );
            self.selected = id;
            Ok(())
        }
        fn drop_model(&mut self, id: u32) -> tp_engine::Result<()> {
            assert_ne!(id, self.selected, "the selected model dropped");
            self.all.remove(&id);
            Ok(())
        }
        fn replace_model(&mut self, id: u32, path: &str) -> tp_engine::Result<Result<(), String>> {
            // None held after a failed replacement.
            assert!(self.all.len() <= 1, "a replacement beside other models");
            self.all.clear();
            if path == "missing" {
                return Ok(Err("no such file".into()));
            }
            self.all.insert(id, scripted(path));
            self.selected = id;
            Ok(Ok(()))
        }
    }

    fn job(prompt: &str, max: usize) -> (Job, tokio::sync::mpsc::UnboundedReceiver<Event>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            prompt: prompt.bytes().map(u32::from).collect(),
            params: DecodeParams::greedy(max),
            events: tx,
            arrived: Instant::now(),
            model: None,
        };
        (job, rx)
    }

    /// A request's text, or its failure.
    fn ask(tx: &mpsc::Sender<Control>, load: &Load, prompt: &str) -> Result<String, String> {
        let (j, mut rx) = job(prompt, 4);
        load.pending.fetch_add(1, Ordering::Relaxed);
        tx.send(Control::Submit(j)).unwrap();
        let mut text = String::new();
        loop {
            match rx.blocking_recv() {
                Some(Event::Text { text: t, .. }) => text.push_str(&t),
                Some(Event::Done { .. }) => return Ok(text),
                Some(Event::Failed { message, .. }) => return Err(message),
                None => panic!("no end event"),
            }
        }
    }

    fn admin<T>(tx: &mpsc::Sender<Control>, a: impl FnOnce(oneshot::Sender<T>) -> Admin) -> T {
        let (reply, rx) = oneshot::channel();
        tx.send(Control::Admin(a(reply))).unwrap();
        rx.blocking_recv().expect("a reply")
    }

    /// Ranks that hold one scripted model, the alphabet, as model 0.
    fn alphabet_only() -> Models {
        Models {
            all: BTreeMap::from([(0, scripted("alphabet"))]),
            selected: 0,
            loading: None,
        }
    }

    /// A scheduler of 4 requests over 100 blocks, with a prefix cache.
    fn rollout_config() -> SchedulerConfig {
        SchedulerConfig {
            max_seqs: 4,
            kv_blocks: 100,
            max_batch_tokens: 64,
            heartbeat: Duration::from_millis(5),
            prefix_sharing: true,
            prefix_cache_entries: 4,
            spec: None,
        }
    }

    /// Runs the fleet over [`alphabet_only`] (its first model "a", loaded from `path`) on its
    /// own thread while `drive` talks to it, then shuts it down; the executor afterwards.
    fn with_fleet(
        path: Option<String>,
        drive: impl FnOnce(&mpsc::Sender<Control>, &Load, &Metrics),
    ) -> Models {
        let mut exec = alphabet_only();
        let cfg = rollout_config();
        let tok = Tokenizer::bytes(&["<|endoftext|>"]);
        let load = Load::default();
        let metrics = Metrics::new();
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|s| {
            // Owned here: a failed assertion drops it, and the scheduler ends (no hang).
            let tx = tx;
            let (exec, tok, cfg, load, metrics) = (&mut exec, &tok, &cfg, &load, &metrics);
            let sched =
                s.spawn(move || run_models(exec, tok, cfg, &rx, load, metrics, "a".into(), path));
            drive(&tx, load, metrics);
            tx.send(Control::Shutdown).unwrap();
            sched.join().unwrap().unwrap();
        });
        exec
    }

    #[test]
    fn failing_requests_after_a_switch_roll_back_and_models_are_dropped_when_replaced() {
        let exec = with_fleet(None, |tx, load, metrics| {
            assert_eq!(ask(tx, load, "a").unwrap(), "bcde");
            // A load that fails on the ranks changes nothing.
            let e = admin(tx, |reply| Admin::Load {
                path: "missing".into(),
                drain: None,
                reply,
            });
            assert_eq!(e, Err("no such file".into()));
            let id = admin(tx, |reply| Admin::Load {
                path: "nan".into(),
                drain: None,
                reply,
            })
            .unwrap();
            // Requests naming the candidate run on it (the canary's way in).
            let (mut j, mut rx_nan) = job("a", 4);
            j.model = Some(id);
            load.pending.fetch_add(1, Ordering::Relaxed);
            tx.send(Control::Submit(j)).unwrap();
            loop {
                match rx_nan.blocking_recv() {
                    Some(Event::Failed { message, .. }) => {
                        assert!(message.contains("NaN"), "{message}");
                        break;
                    }
                    Some(Event::Text { .. }) => {}
                    other => panic!("{other:?}"),
                }
            }
            let s1 = admin(tx, |reply| Admin::Switch { id, reply }).unwrap();
            assert_eq!((s1.live.id, s1.previous.map(|p| p.id)), (id, Some(0)));
            // The live model fails every request: after 3 of 3, the previous one is back.
            for _ in 0..WATCH_MIN_FAILURES {
                assert!(ask(tx, load, "a").is_err());
            }
            assert_eq!(ask(tx, load, "a").unwrap(), "bcde");
            let r = metrics.board.snapshot().rollout;
            assert_eq!((r.live.id, r.switches, r.rollbacks), (0, 1, 1), "{r:?}");
            assert!(r.last_event.contains("failed"), "{r:?}");
            // An automatic rollback only undoes a switch: not this rollback.
            let again = admin(tx, |reply| Admin::Rollback {
                reason: "test".into(),
                automatic: true,
                reply: Some(reply),
            });
            assert!(again.is_err());
            // Two more switches: the model before the previous one is dropped once idle.
            let b = admin(tx, |reply| Admin::Load {
                path: "alphabet".into(),
                drain: None,
                reply,
            })
            .unwrap();
            admin(tx, |reply| Admin::Switch { id: b, reply }).unwrap();
            let t0 = Instant::now();
            loop {
                let ids: Vec<u32> = metrics
                    .board
                    .snapshot()
                    .rollout
                    .models
                    .iter()
                    .map(|m| m.id)
                    .collect();
                if ids == vec![0, b] {
                    break;
                }
                assert!(t0.elapsed() < Duration::from_secs(5), "{ids:?}");
                std::thread::sleep(Duration::from_millis(5));
            }
            // New requests run on the new live model.
            assert_eq!(ask(tx, load, "x").unwrap(), "yzab");
        });
        assert_eq!(exec.all.keys().copied().collect::<Vec<_>>(), vec![0, 3]);
    }

    #[test]
    fn a_drain_swap_that_cannot_load_or_fails_its_requests_brings_the_old_model_back() {
        let exec = with_fleet(Some("alphabet".into()), |tx, load, metrics| {
            // A prefix is cached on the live model: the drain closes it before the swap.
            assert_eq!(ask(tx, load, "a").unwrap(), "bcde");
            let drain = || Some("the test says so".to_string());
            // The candidate cannot be loaded: the old model is loaded back (as model 2).
            let e = admin(tx, |reply| Admin::Load {
                path: "missing".into(),
                drain: drain(),
                reply,
            })
            .unwrap_err();
            assert!(
                e.contains("no such file") && e.contains("was loaded back"),
                "{e}"
            );
            assert_eq!(ask(tx, load, "a").unwrap(), "bcde");
            let r = metrics.board.snapshot().rollout;
            assert_eq!((r.live.id, r.reload_failures), (2, 1), "{r:?}");
            assert_eq!(r.live.path.as_deref(), Some("alphabet"), "{r:?}");
            // Drained in, a model whose requests all fail is rolled back by draining.
            let id = admin(tx, |reply| Admin::Load {
                path: "nan".into(),
                drain: drain(),
                reply,
            })
            .unwrap();
            // Loaded in its place, not live yet: the live model is still the one named.
            let r = metrics.board.snapshot().rollout;
            assert_eq!(
                (r.live.id, r.live.path.as_deref()),
                (2, Some("alphabet")),
                "{r:?}"
            );
            assert!(r.draining.is_some(), "{r:?}");
            let s1 = admin(tx, |reply| Admin::Switch { id, reply }).unwrap();
            assert!(s1.drained.is_some() && s1.previous.is_none(), "{s1:?}");
            for _ in 0..WATCH_MIN_FAILURES {
                assert!(ask(tx, load, "a").is_err());
            }
            assert_eq!(ask(tx, load, "a").unwrap(), "bcde");
            let r = metrics.board.snapshot().rollout;
            assert_eq!((r.live.id, r.switches, r.rollbacks), (4, 1, 1), "{r:?}");
            assert!(r.last_event.contains("reloaded by a drain swap"), "{r:?}");
        });
        assert_eq!(exec.all.keys().copied().collect::<Vec<_>>(), vec![4]);
    }
}
