//! Under `mpirun -n T`: activation bytes per rank, measured, against the formula of this
//! trainer's layer (issue 34). One rank per process, so the counting allocator
//! ([`CountingAlloc`]) counts this rank alone: each rank's bytes kept from the forward to the
//! backward ([`kept_by_forward`]; the model as one stage at tp = T) must equal its own
//! [`RankShapes::chunk_bytes`] within 5%, without recomputation, selective and full, without
//! and with sequence parallelism, for the `small` preset on 2 x 256 tokens and `tiny` on
//! 4 x 64. Rank 0 prints `N passed, N failed`.

use std::process::ExitCode;
use tp_comm::mpi::{check, MpiOptions};
use tp_comm::{ParallelDims, ProcessGroups};
use tp_train::activations::RankShapes;
use tp_train::alloc_count::{kept_by_forward, CountingAlloc};
use tp_train::init::SeededInit;
use tp_train::model::StageModel;
use tp_train::{ModelConfig, Recompute, TrainError, TrainModel};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const MODES: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];
const TOLERANCE: f64 = 0.05;
const MIB: f64 = (1u64 << 20) as f64;

fn main() -> ExitCode {
    let runtime = match check::init("tp-train-mpi-activations", MpiOptions::default()) {
        Ok(r) => r,
        Err(code) => return code,
    };
    let world = runtime.world();
    let (rank, tp) = (world.rank(), world.size());
    let (mut passed, mut failed) = (0u64, 0u64);
    for (preset, b, s) in [("small", 2usize, 256usize), ("tiny", 4, 64)] {
        for sp in [false, true] {
            let run = || -> Result<Vec<(Recompute, isize, f64)>, TrainError> {
                let cfg = ModelConfig::preset(preset)
                    .ok_or_else(|| TrainError::Config(format!("no preset {preset}")))?;
                let d = ParallelDims { tp, pp: 1, dp: 1 };
                let groups = ProcessGroups::new(world.clone(), d)?;
                let mut model = StageModel::new(&cfg, 0, 1, rank, tp, &SeededInit::new(&cfg, 3))?
                    .with_sequence_parallel(sp);
                let kept = kept_by_forward(&mut model, b, s, &groups.tp, &MODES)?;
                let shapes = RankShapes::new(&cfg, rank, tp, b, s, sp)?;
                Ok(MODES
                    .iter()
                    .zip(kept)
                    .map(|(&r, k)| (r, k, shapes.chunk_bytes(cfg.layers, true, true, r)))
                    .collect())
            };
            match run() {
                Ok(rows) => {
                    for (r, kept, f) in rows {
                        let rel = (kept as f64 - f) / f;
                        let line = format!(
                            "rank {rank}: {preset} {b} x {s} tp {tp} sp {sp} {r:?}: measured \
                             {:.2} MiB, formula {:.2} MiB ({:+.2}%)",
                            kept as f64 / MIB,
                            f / MIB,
                            100.0 * rel
                        );
                        if rel.abs() <= TOLERANCE {
                            passed += 1;
                            println!("{line}");
                        } else {
                            failed += 1;
                            eprintln!("FAILED {line}");
                        }
                    }
                }
                Err(e) => {
                    eprintln!("rank {rank}: error at {preset} sp {sp}: {e}");
                    failed += 1;
                    return check::totals(&world, passed, failed);
                }
            }
        }
    }
    check::totals(&world, passed, failed)
}
