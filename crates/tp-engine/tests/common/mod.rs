//! The engine tests' kit: a checkpoint's workers at tp N as rank threads, rank 0 leading.
#![allow(dead_code)] // each test binary uses a subset

use std::sync::Arc;
use tp_comm::local::{self, LocalOptions};
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
    let out = local::run(tp, LocalOptions::default(), |g| {
        let model = ShardedModel::load(ckpt, g.rank(), tp, opts, ctx).unwrap();
        let mut w = Worker::new(model, Arc::clone(&g));
        setup(&mut w);
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
