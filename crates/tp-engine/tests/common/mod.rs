//! The engine tests' kit: a checkpoint's workers at tp N (or pp x tp) as rank threads, rank 0
//! leading.
#![allow(dead_code)] // each test binary uses a subset

use std::sync::Arc;
use tp_comm::local::{self, LocalOptions};
use tp_comm::Group;
use tp_engine::{Command, Worker};
use tp_models::{Checkpoint, LoadOptions, ShardedModel};

/// Runs `lead` on rank 0's worker of `ckpt` at `tp` (the followers follow); its result.
pub fn on_workers<T: Send>(
    ckpt: &dyn Checkpoint,
    tp: usize,
    opts: LoadOptions,
    ctx: usize,
    lead: impl Fn(&mut Worker) -> T + Sync,
) -> T {
    on_set_workers(ckpt, tp, opts, ctx, |_| {}, lead)
}

/// [`on_workers`], every rank's worker first passed to `setup`.
pub fn on_set_workers<T: Send>(
    ckpt: &dyn Checkpoint,
    tp: usize,
    opts: LoadOptions,
    ctx: usize,
    setup: impl Fn(&mut Worker) + Sync,
    lead: impl Fn(&mut Worker) -> T + Sync,
) -> T {
    lead_and_follow(
        tp,
        |g| {
            let model = ShardedModel::load(ckpt, g.rank(), tp, opts, ctx).unwrap();
            let mut w = Worker::new(model, Arc::clone(g));
            setup(&mut w);
            w
        },
        lead,
    )
}

/// `ranks` rank threads, each with the worker `worker` makes for it: rank 0 runs `lead`
/// and then tells the others to exit, the others follow; rank 0's result.
fn lead_and_follow<T: Send>(
    ranks: usize,
    worker: impl Fn(&Group) -> Worker + Sync,
    lead: impl Fn(&mut Worker) -> T + Sync,
) -> T {
    let out = local::run(ranks, LocalOptions::default(), |g| {
        let mut w = worker(&g);
        if g.rank() == 0 {
            let out = lead(&mut w);
            w.submit(Command::Exit).unwrap();
            Some(out)
        } else {
            w.follow().unwrap();
            None
        }
    })
    .unwrap();
    out.into_iter().next().unwrap().unwrap().unwrap()
}

/// World rank `world.rank()`'s worker of `ckpt` in a mesh of `pp` stages of `tp` ranks (rank
/// 0 on the last stage, as `tp` commands place it). Collective over `world`.
pub fn staged_worker(
    ckpt: &dyn Checkpoint,
    world: &Group,
    pp: usize,
    tp: usize,
    ctx: usize,
) -> Worker {
    let opts = LoadOptions {
        pipeline_stages: pp,
        ..LoadOptions::default()
    };
    let (tp_group, pipe) = tp_engine::pipeline::stage_groups(world, tp, pp).unwrap();
    let weights = tp_models::RankWeights::even(tp);
    let model = ShardedModel::load_weighted(ckpt, world.rank(), &weights, opts, ctx).unwrap();
    Worker::staged(model, Arc::clone(world), tp_group, pipe)
}

/// [`on_workers`] over `pp` stages of `tp` ranks.
pub fn on_staged_workers<T: Send>(
    ckpt: &dyn Checkpoint,
    pp: usize,
    tp: usize,
    ctx: usize,
    lead: impl Fn(&mut Worker) -> T + Sync,
) -> T {
    lead_and_follow(pp * tp, |g| staged_worker(ckpt, g, pp, tp, ctx), lead)
}
