//! Activation memory measured against this trainer's formula (issue 34): the heap bytes one
//! micro-batch's forward leaves alive until its backward (live bytes after the forward, its
//! result held, minus before), by a counting global allocator, equal
//! [`RankShapes::chunk_bytes`] (the model as one stage: embedding, every layer, head) within
//! 5%, without recomputation, selective and full, at tp 1 and at tp 2 without and with
//! sequence parallelism, at two sizes: the `small` preset with 2 x 256 tokens (the `[s, s]`
//! terms dominate) and `tiny` with 4 x 64 (the per-token terms do). The allocator counts
//! every thread, so at tp 2 it counts both rank threads together (between barriers, so
//! neither allocates while the other reads): that is compared with the sum of the ranks'
//! formulas (equal shares here, every split being even). Qwen2 (Q/K/V biases), Qwen3 (q/k
//! norms) and Gemma-3 (q/k norms, post-norms, scaled embeddings, GELU, windows) as `tiny`
//! also: their totals within 5%, and their extra bytes over the Llama `tiny` within 5% of the
//! formula's extra. One test in this binary, so no other test allocates meanwhile.

use tp_comm::local::{run, LocalOptions};
use tp_comm::{ParallelDims, ProcessGroups};
use tp_spec::Arch;
use tp_train::activations::RankShapes;
use tp_train::alloc_count::{kept_by_forward, CountingAlloc};
use tp_train::init::SeededInit;
use tp_train::model::StageModel;
use tp_train::{ModelConfig, Recompute, TrainModel};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const MIB: f64 = (1u64 << 20) as f64;
const MODES: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

/// Bytes kept by every rank together for each of [`MODES`]: `cfg` as one stage at `tp`,
/// `b` sequences of `s` tokens.
fn measure(cfg: &ModelConfig, tp: usize, sp: bool, b: usize, s: usize) -> Vec<isize> {
    let d = ParallelDims { tp, pp: 1, dp: 1 };
    let out = run(tp, LocalOptions::default(), |world| {
        let groups = ProcessGroups::new(world, d).expect("groups");
        let rank = groups.tp.rank();
        let mut model = StageModel::new(cfg, 0, 1, rank, tp, &SeededInit::new(cfg, 3))
            .expect("model")
            .with_sequence_parallel(sp);
        kept_by_forward(&mut model, b, s, &groups.tp, &MODES).expect("forward")
    })
    .expect("world");
    match out.into_iter().next() {
        Some(Ok(m)) => m,
        _ => panic!("rank 0 failed"),
    }
}

/// The formula's bytes of every rank together for `r`.
fn formula(cfg: &ModelConfig, tp: usize, sp: bool, b: usize, s: usize, r: Recompute) -> f64 {
    (0..tp)
        .map(|rank| {
            let shapes = RankShapes::new(cfg, rank, tp, b, s, sp).expect("shapes");
            shapes.chunk_bytes(cfg.layers, true, true, r)
        })
        .sum()
}

#[test]
fn activation_bytes_equal_the_formula_of_this_trainers_layer() {
    let mut failures = Vec::new();
    let preset = |name: &str| ModelConfig::preset(name).expect("preset");
    let tiny_as = |arch: Arch| preset("tiny").with_arch(arch).expect("arch");
    let cases = [
        ("small", preset("small"), 2usize, 256usize),
        ("tiny", preset("tiny"), 4, 64),
        // Q/K/V biases; q/k norms; those with post-norms, scaled embeddings, GELU, windows.
        ("tiny qwen2", tiny_as(Arch::Qwen2), 4, 64),
        ("tiny qwen3", tiny_as(Arch::Qwen3), 4, 64),
        ("tiny gemma3", tiny_as(Arch::Gemma3), 4, 64),
    ];
    // The plain tiny's (measured, formula) per layout and mode, for the variants' deltas.
    let mut plain = std::collections::HashMap::new();
    for (preset, cfg, b, s) in cases {
        for (tp, sp) in [(1, false), (2, false), (2, true)] {
            let measured = measure(&cfg, tp, sp, b, s);
            for (&r, &kept) in MODES.iter().zip(&measured) {
                let f = formula(&cfg, tp, sp, b, s, r);
                let key = (tp, sp, format!("{r:?}"));
                if preset == "tiny" {
                    plain.insert(key, (kept as f64, f));
                } else if let Some(&(pk, pf)) = plain.get(&key) {
                    // A variant's own terms, too small to show in its total: its extra bytes
                    // over the plain model, measured against the formula's, within 5% (or
                    // 1% of the total where the formula adds nothing).
                    let (dm, df) = (kept as f64 - pk, f - pf);
                    let tol = if df > 0.0 { 0.05 * df } else { 0.01 * f };
                    if (dm - df).abs() > tol {
                        failures.push(format!(
                            "{preset} tp {tp} sp {sp} {r:?}: {:.3} MiB over the plain model, \
                             the formula {:.3} MiB",
                            dm / MIB,
                            df / MIB
                        ));
                    }
                }
                let rel = (kept as f64 - f) / f;
                eprintln!(
                    "{preset} b {b} s {s} tp {tp} sp {sp:5} {r:?}: measured {:.2} MiB, \
                     formula {:.2} MiB ({:+.2}%)",
                    kept as f64 / MIB,
                    f / MIB,
                    100.0 * rel
                );
                if rel.abs() > 0.05 {
                    failures.push(format!(
                        "{preset} tp {tp} sp {sp} {r:?}: {:+.2}%",
                        100.0 * rel
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "off the formula by more than 5%: {failures:?}"
    );
}
