//! Activation bytes as measured (issue 34): a counting global allocator, and the heap bytes a
//! stage's forward leaves alive until its backward, read from it. A program or test measures
//! by installing [`CountingAlloc`] as its `#[global_allocator]`; the counter then holds every
//! thread's live bytes (under mpirun, this rank's; on rank threads, all of them).

use crate::error::Result;
use crate::model::{StageInput, StageModel};
use crate::recompute;
use candle_core::{Device, Tensor};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use tp_comm::Group;
use tp_plan::workload::Recompute;

/// Heap bytes allocated and not yet freed, by every thread, while [`CountingAlloc`] is the
/// global allocator (0 otherwise).
static LIVE: AtomicIsize = AtomicIsize::new(0);

/// The system allocator, counting live bytes in [`live_bytes`].
pub struct CountingAlloc;

// SAFETY: every call is forwarded unchanged to `System`; the counter is only arithmetic.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        System.alloc_zeroed(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        System.realloc(p, l, new)
    }
}

/// Live heap bytes now ([`CountingAlloc`]).
pub fn live_bytes() -> isize {
    LIVE.load(Ordering::SeqCst)
}

/// For each of `modes`: the live bytes after `model`'s forward on `b` sequences of `s`
/// tokens (fixed ids; on the last stage with targets and their weights), its result held,
/// minus before: what the micro-batch keeps for its backward. Every tp rank calls it;
/// barriers around each reading keep the other ranks of this process (rank threads) from
/// allocating meanwhile. A first forward, dropped, keeps one-time allocations (thread pools,
/// caches) out.
pub fn kept_by_forward(
    model: &mut StageModel,
    b: usize,
    s: usize,
    tp: &Group,
    modes: &[Recompute],
) -> Result<Vec<isize>> {
    let dev = Device::Cpu;
    let n = b * s;
    let ids: Vec<u32> = (0..n).map(|i| (i * 7 % 251) as u32).collect();
    let ids = Tensor::from_vec(ids, (b, s), &dev)?; // [b, s]
    let targets = Tensor::from_vec(vec![1u32; n], n, &dev)?; // [b*s]
    let weights = Tensor::from_vec(vec![1f32 / n as f32; n], n, &dev)?; // [b*s]
    let tg = Some((&targets, &weights));
    let input = || StageInput::Tokens(&ids);
    drop(model.forward(input(), tg, tp)?);
    let mut kept = Vec::with_capacity(modes.len());
    for &r in modes {
        model.set_recompute(r);
        tp.barrier()?;
        let before = live_bytes();
        tp.barrier()?;
        let held: Box<dyn std::any::Any> = if r == Recompute::Full {
            Box::new(recompute::forward(model, input(), None, tg, tp)?)
        } else {
            Box::new(model.forward_aux(input(), tg, tp)?)
        };
        tp.barrier()?;
        kept.push(live_bytes() - before);
        tp.barrier()?;
        drop(held);
    }
    Ok(kept)
}
