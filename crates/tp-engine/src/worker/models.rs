//! The models a rank holds beside the selected one, and the [`ModelCommand`]s that change
//! them: a background load (this rank keeps executing steps meanwhile), its adoption (every
//! rank learns whether all of them have their shard, so the group holds it on every rank or
//! on none), selection and dropping; and the replacement of the only held model in place
//! (its shard freed before the next one loads: a drain swap). Each model keeps its own
//! [`Slots`] (KV pool and block tables): selecting one swaps both in, so a sequence only ever
//! runs on the model it was opened on.

use super::Worker;
use crate::error::{EngineError, Result};
use crate::report::chain;
use crate::slots::Slots;
use crate::swap::ModelCommand;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;
use tp_comm::CommExt;
use tp_models::{open_checkpoint, LoadOptions, RankWeights, ShardedModel, SyncMode};

/// How a rank loads a further model: the layout and settings of the one it started with.
#[derive(Clone, Debug)]
pub struct ReloadSpec {
    pub weights: RankWeights,
    pub load: LoadOptions,
    /// KV positions per sequence.
    pub ctx: usize,
    pub sync: SyncMode,
    /// Longest wait for a background load when it is adopted.
    pub deadline: Duration,
}

/// A background load of one rank's shard.
struct Loading {
    id: u32,
    done: Arc<AtomicBool>,
    result: mpsc::Receiver<std::result::Result<ShardedModel, String>>,
}

/// The held models of one rank (the same ids on every rank).
#[derive(Default)]
pub(super) struct Held {
    spec: Option<ReloadSpec>,
    /// The id of the worker's own model (0 at start).
    selected: u32,
    others: BTreeMap<u32, (ShardedModel, Slots)>,
    loading: Option<Loading>,
    /// Rank 0: the last adoption's (or replacement's) outcome (why it failed, in words).
    adopted: Option<std::result::Result<(), String>>,
    /// A replacement failed: the selected model's weights are gone (only a replace runs).
    pub(super) hollow: bool,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("selected", &self.selected)
            .field("others", &self.others.keys().collect::<Vec<_>>())
            .field("loading", &self.loading.as_ref().map(|l| l.id))
            .field("hollow", &self.hollow)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// Lets this rank load further models (with [`ModelCommand::Load`]) as `spec` says.
    pub fn enable_reload(&mut self, spec: ReloadSpec) {
        self.held.spec = Some(spec);
    }

    /// How this rank loads further models (`None`: it cannot).
    pub fn reload_spec(&self) -> Option<&ReloadSpec> {
        self.held.spec.as_ref()
    }

    /// The id of the model commands apply to now.
    pub fn selected_model(&self) -> u32 {
        self.held.selected
    }

    /// Every held model's id, the selected one included.
    pub fn held_models(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.held.others.keys().copied().collect();
        ids.push(self.held.selected);
        ids.sort_unstable();
        ids
    }

    /// Rank 0's background load has ended (adopting it will not wait for rank 0's shard).
    pub fn load_finished(&self) -> bool {
        self.held
            .loading
            .as_ref()
            .is_some_and(|l| l.done.load(Ordering::Acquire))
    }

    /// Leader: adopts the background load of `id` on every rank. `Ok(Err(why))` when some
    /// rank could not load it (every rank then dropped its shard).
    pub fn adopt_model(&mut self, id: u32) -> Result<std::result::Result<(), String>> {
        self.submit(crate::Command::Model(ModelCommand::Adopt { id }))?;
        Ok(self
            .held
            .adopted
            .take()
            .unwrap_or_else(|| Err("the adoption left no outcome".into())))
    }

    /// Leader: frees the selected model on every rank, then loads `path` as model `id` in its
    /// place (see [`ModelCommand::Replace`]). `Ok(Err(why))` when some rank could not load
    /// it: no rank holds a model then, and only another replace may follow.
    pub fn replace_model(
        &mut self,
        id: u32,
        path: &str,
    ) -> Result<std::result::Result<(), String>> {
        let path = path.to_string();
        self.submit(crate::Command::Model(ModelCommand::Replace { id, path }))?;
        Ok(self
            .held
            .adopted
            .take()
            .unwrap_or_else(|| Err("the replacement left no outcome".into())))
    }

    /// After a failed replacement only model commands (another replace) and heartbeats run.
    pub(super) fn check_held(&self, cmd: &crate::Command) -> Result<()> {
        use crate::Command as C;
        if self.held.hollow && !matches!(cmd, C::Model(_) | C::Idle | C::Exit) {
            return Err(EngineError::Internal(
                "no model is held since a replacement failed on some rank".into(),
            ));
        }
        Ok(())
    }

    /// Whether `m` can run on the state every rank shares (rank 0 checks before sending;
    /// a follower that disagrees has diverged).
    pub(super) fn check_model(&self, m: &ModelCommand) -> Result<()> {
        let h = &self.held;
        let bad = |message: String| Err(EngineError::Internal(message));
        let held = |id: &u32| *id == h.selected || h.others.contains_key(id);
        if h.hollow && !matches!(m, ModelCommand::Replace { .. }) {
            return bad(format!(
                "{m:?} after a failed replacement: no model is held"
            ));
        }
        match m {
            ModelCommand::Replace { id, path } => {
                ModelCommand::check_path(path)?;
                if h.spec.is_none() {
                    return bad("this worker was started without a reload spec".into());
                }
                if let Some(l) = &h.loading {
                    return bad(format!("model {} is still loading", l.id));
                }
                if !h.others.is_empty() || self.slots.open().next().is_some() {
                    return bad("a replacement with other models held or sequences open".into());
                }
                if *id == h.selected {
                    return bad(format!("model {id} is already held"));
                }
            }
            ModelCommand::Load { id, path } => {
                ModelCommand::check_path(path)?;
                if h.spec.is_none() {
                    return bad("this worker was started without a reload spec".into());
                }
                if let Some(l) = &h.loading {
                    return bad(format!("model {} is still loading", l.id));
                }
                if held(id) {
                    return bad(format!("model {id} is already held"));
                }
            }
            ModelCommand::Adopt { id } => {
                if h.loading.as_ref().map(|l| l.id) != Some(*id) {
                    return bad(format!("model {id} is not loading"));
                }
            }
            ModelCommand::Select { id } => {
                if !held(id) {
                    return bad(format!("model {id} is not held"));
                }
            }
            ModelCommand::Drop { id } => {
                if *id == h.selected || !h.others.contains_key(id) {
                    return bad(format!("model {id} is not held beside the selected one"));
                }
            }
        }
        Ok(())
    }

    pub(super) fn execute_model(&mut self, m: ModelCommand) -> Result<()> {
        match m {
            ModelCommand::Load { id, path } => self.start_load(id, path),
            ModelCommand::Replace { id, path } => self.replace(id, &path)?,
            ModelCommand::Adopt { id } => self.adopt(id)?,
            ModelCommand::Select { id } => {
                if id != self.held.selected {
                    let (mut model, mut slots) =
                        self.held.others.remove(&id).ok_or_else(|| {
                            EngineError::Internal(format!("model {id} is not held"))
                        })?;
                    std::mem::swap(&mut self.model, &mut model);
                    std::mem::swap(&mut self.slots, &mut slots);
                    let old = std::mem::replace(&mut self.held.selected, id);
                    self.held.others.insert(old, (model, slots));
                }
            }
            ModelCommand::Drop { id } => {
                drop(self.held.others.remove(&id));
                crate::session::release_free_heap();
            }
        }
        Ok(())
    }

    /// Starts loading this rank's shard of `path` on its own thread.
    fn start_load(&mut self, id: u32, path: String) {
        let (tx, rx) = mpsc::channel();
        let done = Arc::new(AtomicBool::new(false));
        let loading = Loading {
            id,
            done: Arc::clone(&done),
            result: rx,
        };
        let Some(spec) = self.held.spec.clone() else {
            return;
        };
        let rank = self.group.rank();
        let work = move || {
            let r = load_shard(&spec, rank, &path);
            done.store(true, Ordering::Release);
            let _ = tx.send(r);
        };
        if let Err(e) = std::thread::Builder::new()
            .name(format!("tp-load-{rank}"))
            .spawn(work)
        {
            let (tx, rx) = mpsc::channel();
            let _ = tx.send(Err(format!("cannot start a loading thread: {e}")));
            self.held.loading = Some(Loading {
                id,
                done: Arc::new(AtomicBool::new(true)),
                result: rx,
            });
            return;
        }
        self.held.loading = Some(loading);
    }

    /// Frees the selected model and its KV cache, loads `path` as `id` in its place, and
    /// learns (one small all-gather) whether every rank did: selected everywhere, or no
    /// model anywhere ([`Held::hollow`]).
    fn replace(&mut self, id: u32, path: &str) -> Result<()> {
        let rank = self.group.rank();
        self.model.release_weights();
        // [blocks of 0 layers]: the old pool's blocks go with it.
        self.slots = Slots::new(self.model.new_pool(), 1, self.model.config().vocab);
        crate::session::release_free_heap();
        self.held.hollow = true;
        let Some(spec) = self.held.spec.clone() else {
            return Err(EngineError::Internal("no reload spec".into()));
        };
        let mine = load_shard(&spec, rank, path);
        let failed = self.agree(mine.is_ok())?;
        let outcome = match mine {
            Ok(model) if failed.is_empty() => {
                self.slots = Slots::new(
                    model.new_pool(),
                    model.max_positions(),
                    model.config().vocab,
                );
                self.model = model;
                self.held.selected = id;
                self.held.hollow = false;
                Ok(())
            }
            Ok(_) => Err(format!(
                "rank(s) {failed:?} could not load their shard (their logs say why)"
            )),
            Err(e) => {
                if rank != 0 {
                    eprintln!("# rank {rank}: cannot load model {id}: {e}");
                }
                Err(e)
            }
        };
        self.record_load(outcome);
        Ok(())
    }

    /// Keeps a load's outcome for rank 0 to report; a failed one gives its memory back.
    fn record_load(&mut self, outcome: std::result::Result<(), String>) {
        if outcome.is_err() {
            crate::session::release_free_heap();
        }
        if self.group.rank() == 0 {
            self.held.adopted = Some(outcome);
        }
    }

    /// The ranks that did not succeed, given whether this one did (every rank learns the same).
    fn agree(&self, ok: bool) -> Result<Vec<usize>> {
        let flag = [u32::from(ok)];
        let mut all = vec![0u32; self.group.size()];
        if all.len() == 1 {
            all.copy_from_slice(&flag);
        } else {
            self.group.all_gather(&flag, &mut all)?;
        }
        Ok((0..all.len()).filter(|&r| all[r] != 1).collect())
    }

    /// Waits for this rank's load of `id`, then every rank learns whether all succeeded (one
    /// small all-gather): held everywhere, or dropped everywhere.
    fn adopt(&mut self, id: u32) -> Result<()> {
        let rank = self.group.rank();
        let Some(loading) = self.held.loading.take().filter(|l| l.id == id) else {
            return Err(EngineError::Internal(format!("model {id} is not loading")));
        };
        let deadline = self
            .held
            .spec
            .as_ref()
            .map_or(Duration::from_secs(600), |s| s.deadline);
        let mine = match loading.result.recv_timeout(deadline) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => Err(format!(
                "rank {rank} did not finish loading within {} s",
                deadline.as_secs_f64()
            )),
            Err(RecvTimeoutError::Disconnected) => Err(format!(
                "rank {rank}'s loading thread ended without a result"
            )),
        };
        let failed = self.agree(mine.is_ok())?;
        let outcome = match mine {
            Ok(model) if failed.is_empty() => {
                let slots = Slots::new(
                    model.new_pool(),
                    model.max_positions(),
                    model.config().vocab,
                );
                self.held.others.insert(id, (model, slots));
                Ok(())
            }
            Ok(_) => Err(format!(
                "rank(s) {failed:?} could not load their shard (their logs say why)"
            )),
            Err(e) => {
                if rank != 0 && !failed.contains(&0) {
                    eprintln!("# rank {rank}: cannot load model {id}: {e}");
                }
                Err(e)
            }
        };
        self.record_load(outcome);
        Ok(())
    }
}

/// This rank's shard of the model at `path`, loaded as `spec` says (the loader's error in words).
fn load_shard(
    spec: &ReloadSpec,
    rank: usize,
    path: &str,
) -> std::result::Result<ShardedModel, String> {
    let ckpt = open_checkpoint(Path::new(path)).map_err(|e| chain(&e))?;
    let mut m = ShardedModel::load_weighted(&*ckpt, rank, &spec.weights, spec.load, spec.ctx)
        .map_err(|e| chain(&e))?;
    m.set_sync(spec.sync);
    Ok(m)
}
