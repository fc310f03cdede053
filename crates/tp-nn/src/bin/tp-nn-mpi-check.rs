//! Under mpirun: the SmolLM2-shaped block (9 heads, 3 KV heads), sharded over the MPI world
//! (tp = number of processes, uneven at 2 and 4), forward against the dense reference on
//! every rank. Rank 0 prints `N passed, N failed`.

use candle_core::Device;
use std::process::ExitCode;
use tp_comm::mpi::{check, MpiOptions};
use tp_nn::{BlockConfig, DenseBlock, LayerStyle, ParallelBlock, RandomTensor, Rng, RopeLayout};

/// Relative tolerance: f32 with a different summation order (the unit tests measure < 1e-6).
const TOLERANCE: f32 = 1e-5;

fn max_rel_diff(got: &candle_core::Tensor, want: &candle_core::Tensor) -> tp_nn::Result<f32> {
    let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let scale = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-2);
    Ok(diff / scale)
}

fn check(world: &tp_comm::Group) -> tp_nn::Result<Vec<(String, f32)>> {
    let cfg = BlockConfig {
        hidden: 48,
        heads: 9,
        kv_heads: 3,
        head_dim: 8,
        ffn: 80,
        rope_theta: 10_000.0,
        rope_layout: RopeLayout::RotateHalf,
        rms_eps: 1e-5,
        max_seq: 16,
        qk_norm: false,
        qkv_bias: false,
        style: LayerStyle::LLAMA,
    };
    let dev = Device::Cpu;
    let w = cfg.random_weights(7, &dev)?;
    let (batch, seq) = (2, 7);
    let h = Rng::xorshift64_star(11).tensor(&[batch, seq, cfg.hidden], 0.0, 1.0, &dev)?; // [b, s, hidden]
    let want = DenseBlock::new(&cfg, &w)?.forward(&h)?; // [b, s, hidden]
    let (rank, tp) = (world.rank(), world.size());
    let block = ParallelBlock::from_global(&cfg, &w, rank, tp)?;
    let got = block.forward(&h, world)?; // [b, s, hidden]
    Ok(vec![(
        format!("block forward tp={tp}"),
        max_rel_diff(&got, &want)?,
    )])
}

fn main() -> ExitCode {
    // Each collective's deadline: 60 s.
    let runtime = match check::init("tp-nn-mpi-check", MpiOptions::default()) {
        Ok(r) => r,
        Err(code) => return code,
    };
    let world = runtime.world();
    let rank = world.rank();
    let (mut passed, mut failed) = (0u64, 0u64);
    match check(&world) {
        Ok(results) => {
            for (name, d) in results {
                if d <= TOLERANCE {
                    passed += 1;
                } else {
                    failed += 1;
                    eprintln!(
                        "rank {rank}: FAILED {name}: relative difference {d:e} > {TOLERANCE:e}"
                    );
                }
            }
        }
        Err(e) => {
            failed += 1;
            eprintln!("rank {rank}: error: {e}");
        }
    }
    check::totals(&world, passed, failed)
}
