//! Drain-first swaps: when the memory plan says a second model cannot be held beside the
//! live one (or the server's [`SwapPolicy`] says never to hold two), a reload, or a rollback
//! to a model no longer held, stops starting requests on the live model, lets the running
//! ones finish on it, frees every held model on every rank and loads the next one in the
//! live one's place. Requests that arrive meanwhile wait (parked here) and run on whichever
//! model goes live next. When the new model cannot be loaded, or fails its canary, the model
//! live before is loaded back from its path. No model serves from the free to the switch:
//! that downtime is reported with the swap.

use super::{Fleet, StepResult, Switched};
use crate::dashboard::ModelEntry;
use crate::scheduler::{Event, Job, Load};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Instant;
use tokio::sync::oneshot;
use tp_engine::{EngineError, StepExecutor};

/// How a reload makes room for the new model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SwapPolicy {
    /// Hold the new model beside the live one when the memory plan says both fit; drain
    /// first otherwise.
    #[default]
    Auto,
    /// Always drain first (a host that must never hold two models).
    Drain,
}

/// How a drain swap went (in the reload's and the rollback's answers).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct DrainReport {
    /// Seconds from the drain's start until nothing ran on the old model.
    pub drain_seconds: f64,
    /// Seconds no model served: from freeing the old model until a model went live.
    pub downtime_seconds: f64,
    /// Requests that arrived during the swap and waited for it.
    pub waited: usize,
    /// Why it drained (the memory plan's figures, or the policy).
    pub why: String,
}

/// What a drain swap is for.
pub(super) enum Purpose {
    /// A reload: the candidate's id goes to `reply` once loaded (its canary runs next).
    Reload {
        reply: oneshot::Sender<Result<u32, String>>,
    },
    /// A rollback to a model no longer held: live as soon as it is loaded.
    Rollback {
        reason: String,
        reply: Option<oneshot::Sender<Result<Switched, String>>>,
    },
}

impl Purpose {
    /// Tells the admin side (when it waits for an answer) that the swap failed: `why`.
    fn refuse(self, why: String) {
        match self {
            Purpose::Reload { reply } => {
                let _ = reply.send(Err(why));
            }
            Purpose::Rollback { reply, .. } => {
                if let Some(reply) = reply {
                    let _ = reply.send(Err(why));
                }
            }
        }
    }
}

/// A drain swap in progress.
pub(super) struct Drain {
    purpose: Option<Purpose>,
    /// What to load once nothing runs (its path, and its name: the path unless it was the
    /// server's first model), and as which id.
    target: String,
    target_name: String,
    id: u32,
    /// The model live when the drain began (name, path): loaded back when `target` fails.
    restore: (String, String),
    /// What a rollback went back to before this swap (the held previous model's, or the
    /// unheld one's, name and path).
    before_previous: Option<(String, String)>,
    why: String,
    started: Instant,
    /// When nothing ran any more.
    drained: Option<Instant>,
    /// When the old model was freed.
    dark: Option<Instant>,
    /// Requests for the live model that arrived since the drain began.
    parked: VecDeque<Job>,
    /// The candidate is loaded and waits for its canary's verdict (a switch or a discard).
    awaiting: bool,
}

impl Drain {
    /// The drain in words (the dashboard's rollout status).
    pub(super) fn describe(&self) -> String {
        let stage = if self.awaiting {
            "loaded, its canary runs"
        } else if self.drained.is_some() {
            "loading"
        } else {
            "draining"
        };
        format!(
            "{} ({stage}; {} requests wait): {}",
            self.target,
            self.parked.len(),
            self.why
        )
    }

    /// The live model `id` once the drain dropped it (until another goes live).
    pub(super) fn dropped_live(&self, id: u32) -> ModelEntry {
        ModelEntry {
            id,
            name: self.restore.0.clone(),
            role: "live, dropped for a drain swap".into(),
            path: Some(self.restore.1.clone()),
            ..ModelEntry::default()
        }
    }

    fn report(&self) -> DrainReport {
        let now = Instant::now();
        DrainReport {
            drain_seconds: self
                .drained
                .unwrap_or(now)
                .duration_since(self.started)
                .as_secs_f64(),
            downtime_seconds: self
                .dark
                .map_or(0.0, |d| now.duration_since(d).as_secs_f64()),
            waited: self.parked.len(),
            why: self.why.clone(),
        }
    }

    /// Ends the drain with the server: waiting requests and the admin's reply are told.
    pub(super) fn abandon(self, load: &Load, end: &Event) {
        for job in self.parked {
            load.pending.fetch_sub(1, Ordering::Relaxed);
            let _ = job.events.send(end.clone());
        }
        if let Some(p) = self.purpose {
            p.refuse("the server is shutting down".to_string());
        }
    }
}

impl<'a, 't> Fleet<'a, 't> {
    /// Starts a drain swap to `target`; refused (the reply told) when the live model's path
    /// is unknown (it could not be loaded back).
    pub(super) fn start_drain(
        &mut self,
        (target_name, target): (String, String),
        purpose: Purpose,
        why: &str,
    ) {
        let live = self.live;
        let Some((name, path)) = self
            .held(live)
            .and_then(|m| Some((m.name.clone(), m.path.clone()?)))
        else {
            purpose.refuse("the live model's path is unknown, so it could not be loaded back: this server does not drain and swap in place".to_string());
            return;
        };
        let before_previous = match self.previous {
            Some(p) => self
                .held(p)
                .and_then(|m| Some((m.name.clone(), m.path.clone()?))),
            None => self.unheld_previous.clone(),
        };
        let id = self.next_id;
        self.next_id += 1;
        eprintln!(
            "# tp serve: drain swap: no new request starts on model {live} ({name}); once the running ones end it is dropped on every rank and {target} loads in its place, because {why}"
        );
        self.drain = Some(Drain {
            purpose: Some(purpose),
            target,
            target_name,
            id,
            restore: (name, path),
            before_previous,
            why: why.to_string(),
            started: Instant::now(),
            drained: None,
            dark: None,
            parked: VecDeque::new(),
            awaiting: false,
        });
    }

    /// A rollback to the previous model, which a drain swap dropped: drains and reloads it.
    pub(super) fn rollback_drained(
        &mut self,
        reason: String,
        reply: Option<oneshot::Sender<Result<Switched, String>>>,
    ) {
        let Some((name, path)) = self.unheld_previous.clone() else {
            return;
        };
        let why = format!(
            "a rollback ({reason}) goes back to {path}, which is no longer held (a drain swap dropped it)"
        );
        self.start_drain((name, path), Purpose::Rollback { reason, reply }, &why);
    }

    /// `job` back unless a drain swap parks it (a request for the live model).
    pub(super) fn park(&mut self, job: Job) -> Option<Job> {
        match &mut self.drain {
            Some(d) if job.model.is_none() => {
                d.parked.push_back(job);
                None
            }
            _ => Some(job),
        }
    }

    /// Whether `id` is a drain swap's loaded candidate.
    pub(super) fn awaits(&self, id: u32) -> bool {
        self.drain
            .as_ref()
            .is_some_and(|d| d.awaiting && d.id == id)
    }

    /// Once nothing runs: frees every held model on every rank and loads the target in the
    /// live one's place (or, when it cannot be loaded, the model live before).
    pub(super) fn progress_drain(&mut self, exec: &mut dyn StepExecutor) -> StepResult<()> {
        let ready = self
            .drain
            .as_ref()
            .is_some_and(|d| !d.awaiting && d.drained.is_none());
        if !ready || self.loading.is_some() || self.running() > 0 || self.waiting() > 0 {
            return Ok(());
        }
        let Some(d) = self.drain.as_mut() else {
            return Ok(());
        };
        d.drained = Some(Instant::now());
        let (id, target, name) = (d.id, d.target.clone(), d.target_name.clone());
        let waited = d.started.elapsed().as_secs_f64();
        eprintln!(
            "# tp serve: drain swap: drained in {waited:.1} s; dropping every model and loading {target}"
        );
        self.free_selected(exec);
        let selected = self.selected;
        for m in &self.models {
            let other = m.sched.model;
            if other != selected {
                exec.drop_model(other)?;
            }
        }
        if let Some(d) = self.drain.as_mut() {
            d.dark = Some(Instant::now());
        }
        match exec.replace_model(id, &target)? {
            Ok(()) => {
                self.hold_only(exec, id, name, target.clone());
                self.previous = None;
                let purpose = self.drain.as_mut().and_then(|d| d.purpose.take());
                match purpose {
                    Some(Purpose::Reload { reply }) => {
                        if let Some(d) = self.drain.as_mut() {
                            d.awaiting = true;
                        }
                        eprintln!(
                            "# tp serve: drain swap: model {id} loaded on every rank; not live yet"
                        );
                        // The dashboard shows it before the canary runs.
                        self.publish();
                        let _ = reply.send(Ok(id));
                    }
                    Some(Purpose::Rollback { reason, reply }) => {
                        let r = self.rolled_back_drained(id, &reason);
                        if let Some(reply) = reply {
                            let _ = reply.send(Ok(r));
                        }
                    }
                    None => {}
                }
            }
            Err(why) => {
                self.status.reload_failures += 1;
                eprintln!("# tp serve: drain swap: cannot load {target}: {why}");
                let purpose = self.drain.as_mut().and_then(|d| d.purpose.take());
                let message = match self.restore(exec, &format!("it could not be loaded: {why}"))? {
                    Ok(s) => format!(
                        "cannot load {target}: {why}; the model live before, {}, was loaded back and serves ({:.3} s without a model)",
                        s.live.name,
                        s.drained.map_or(0.0, |d| d.downtime_seconds)
                    ),
                    Err(e) => e,
                };
                if let Some(p) = purpose {
                    p.refuse(message);
                }
            }
        }
        self.publish();
        Ok(())
    }

    /// Model `id` (just loaded in place of every other) is the only one held and selected.
    fn hold_only(&mut self, exec: &mut dyn StepExecutor, id: u32, name: String, path: String) {
        self.selected = id;
        exec.set_block_limit(self.cfg().kv_blocks);
        self.models = vec![self.new_held(id, name, path)];
    }

    /// The drained candidate goes live (its canary passed, or none ran).
    pub(super) fn switch_drained(&mut self, id: u32) -> Switched {
        let Some(d) = self.drain.take() else {
            return self.switched();
        };
        let old = self.live;
        self.live = id;
        self.previous = None;
        self.unheld_previous = Some(d.restore.clone());
        self.status.switches += 1;
        self.switched_in = true;
        self.start_watch();
        let report = d.report();
        self.status.last_event = format!(
            "switched to model {id} ({}) from model {old} ({}) by a drain swap: drained in {:.1} s, no model served for {:.3} s, {} requests waited; because {}",
            d.target, d.restore.0, report.drain_seconds, report.downtime_seconds, report.waited, d.why
        );
        eprintln!("# tp serve: {}", self.status.last_event);
        self.unpark(d.parked);
        Switched {
            drained: Some(report),
            ..self.switched()
        }
    }

    /// A drained rollback's model (`id`, just loaded) goes live.
    fn rolled_back_drained(&mut self, id: u32, reason: &str) -> Switched {
        let Some(d) = self.drain.take() else {
            return self.switched();
        };
        let from = self.live;
        self.live = id;
        self.previous = None;
        self.unheld_previous = Some(d.restore.clone());
        self.watch = None;
        self.switched_in = false;
        self.status.rollbacks += 1;
        let report = d.report();
        self.status.last_event = format!(
            "rolled back from model {from} ({}) to model {id} ({}), reloaded by a drain swap (no model served for {:.3} s): {reason}",
            d.restore.0, d.target_name, report.downtime_seconds
        );
        eprintln!("# tp serve: {}", self.status.last_event);
        self.unpark(d.parked);
        Switched {
            drained: Some(report),
            ..self.switched()
        }
    }

    /// The drain swap's target is given up (`why`): the model live before is loaded back in
    /// its place and goes live, the waiting requests run on it. Neither loading is fatal.
    pub(super) fn restore(
        &mut self,
        exec: &mut dyn StepExecutor,
        why: &str,
    ) -> StepResult<Result<Switched, String>> {
        let Some(d) = self.drain.take() else {
            return Ok(Err("no drain swap is in progress".into()));
        };
        let (name, path) = d.restore.clone();
        let id = self.next_id;
        self.next_id += 1;
        eprintln!(
            "# tp serve: drain swap: {} is given up ({why}); loading the model live before, {path}, back",
            d.target
        );
        // A loaded candidate is the selected model (its canary's sequences go); after a
        // failed load no model is held.
        if d.awaiting {
            self.free_selected(exec);
        }
        if let Err(e) = exec.replace_model(id, &path)? {
            return Err(Box::new(EngineError::Internal(format!(
                "after a drain swap, neither {} ({why}) nor the model live before, {path} ({e}), could be loaded: no model to serve",
                d.target
            ))));
        }
        self.hold_only(exec, id, name.clone(), path);
        self.live = id;
        self.previous = None;
        self.unheld_previous = d.before_previous.clone();
        self.watch = None;
        self.switched_in = false;
        let report = d.report();
        self.status.last_event = format!(
            "drain swap to {} given up ({why}): model {id} ({name}) loaded back after {:.3} s without a model",
            d.target, report.downtime_seconds
        );
        eprintln!("# tp serve: {}", self.status.last_event);
        self.unpark(d.parked);
        Ok(Ok(Switched {
            drained: Some(report),
            ..self.switched()
        }))
    }

    /// Closes every sequence of the selected model (it is about to be replaced): none runs
    /// after a drain but the prefix cache's; a discarded candidate's canary leftovers end.
    fn free_selected(&mut self, exec: &mut dyn StepExecutor) {
        let selected = self.selected;
        let end = Event::Failed {
            message: "the model was dropped by a drain swap".into(),
            shutting_down: false,
        };
        if let Some(m) = self.held(selected) {
            m.sched.abandon_all(exec, &end);
        }
    }

    /// The requests that waited for a drain swap, queued on the live model in arrival order.
    fn unpark(&mut self, parked: VecDeque<Job>) {
        for job in parked {
            self.route(job);
        }
    }
}
