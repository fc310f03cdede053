//! Activation memory measured (issue 34): the heap bytes one micro-batch's forward leaves
//! alive until its backward (live bytes after the forward, its result held, minus before), by
//! a counting global allocator, for the `small` preset (hidden 256, 8 heads, 6 layers) on one
//! rank, 2 sequences of 256 tokens: without recomputation, selective and full. Printed beside
//! Korthikanti et al.'s formula; checked: full < selective < none, selective saves at least
//! one `[b, heads, s, s]` f32 tensor per layer, and full keeps at least its counted layer
//! inputs. One test in this binary, so no other test allocates meanwhile.

use candle_core::{Device, Tensor};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use tp_comm::local::{run, LocalOptions};
use tp_comm::{ParallelDims, ProcessGroups};
use tp_train::init::SeededInit;
use tp_train::model::{StageInput, StageModel};
use tp_train::{recompute, ModelConfig, Recompute, TrainModel};

/// Heap bytes allocated and not yet freed, by every thread.
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct Counting;

unsafe impl GlobalAlloc for Counting {
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

#[global_allocator]
static ALLOC: Counting = Counting;

const MIB: f64 = (1u64 << 20) as f64;

#[test]
fn recomputation_keeps_less_activation_memory_as_measured() {
    let cfg = ModelConfig::preset("small").expect("preset");
    let (b, s) = (2usize, 256usize);
    let d = ParallelDims {
        tp: 1,
        pp: 1,
        dp: 1,
    };
    let out = run(1, LocalOptions::default(), |world| {
        let groups = ProcessGroups::new(world, d).expect("groups");
        let mut model =
            StageModel::new(&cfg, 0, 1, 0, 1, &SeededInit::new(&cfg, 3)).expect("model");
        let ids: Vec<u32> = (0..b * s).map(|i| (i * 7 % 251) as u32).collect();
        let dev = Device::Cpu;
        let ids = Tensor::from_vec(ids.clone(), (b, s), &dev).unwrap();
        let targets = Tensor::from_vec(vec![1u32; b * s], b * s, &dev).unwrap();
        let weights = Tensor::from_vec(vec![1f32 / (b * s) as f32; b * s], b * s, &dev).unwrap();
        let tg = Some((&targets, &weights));
        // A first forward, dropped: one-time allocations (thread pools, caches) are not counted.
        drop(
            model
                .forward(StageInput::Tokens(&ids), tg, &groups.tp)
                .unwrap(),
        );
        let mut measured = Vec::new();
        for r in [Recompute::None, Recompute::Selective, Recompute::Full] {
            model.set_recompute(r);
            let before = LIVE.load(Ordering::SeqCst);
            let (kept, counted) = if r == Recompute::Full {
                let f = recompute::forward(&model, StageInput::Tokens(&ids), None, tg, &groups.tp)
                    .unwrap();
                let live = LIVE.load(Ordering::SeqCst) - before;
                (live, f.kept.block_input_bytes())
            } else {
                let o = model
                    .forward_aux(StageInput::Tokens(&ids), tg, &groups.tp)
                    .unwrap();
                let live = LIVE.load(Ordering::SeqCst) - before;
                drop(o);
                (live, 0)
            };
            measured.push((r, kept, counted));
        }
        measured
    })
    .expect("world");
    let measured = match out.into_iter().next() {
        Some(Ok(m)) => m,
        _ => panic!("the rank failed"),
    };
    let (a, layers) = (cfg.heads, cfg.layers);
    let scores = (layers * b * a * s * s * 4) as isize; // one [b, heads, s, s] f32 per layer
    for &(r, kept, counted) in &measured {
        let f = recompute::formula_bytes(&cfg, d, b, s, r).unwrap();
        eprintln!(
            "{r:?}: measured {:.2} MiB kept from forward to backward (formula {:.2} MiB{})",
            kept as f64 / MIB,
            f / MIB,
            if counted > 0 {
                format!(", layer inputs counted {:.2} MiB", counted as f64 / MIB)
            } else {
                String::new()
            }
        );
    }
    let [(_, none, _), (_, sel, _), (_, full, counted)] = measured[..] else {
        panic!("three modes");
    };
    assert!(
        none - sel >= scores,
        "selective saves {} bytes, less than the {scores} of one [b, heads, s, s] per layer",
        none - sel
    );
    assert!(full < sel, "full keeps {full}, selective {sel}");
    assert!(
        full >= counted as isize,
        "full keeps {full} < its inputs {counted}"
    );
}
