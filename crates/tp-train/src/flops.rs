//! Model FLOPs and utilization (docs/performance.md): MFU = 6 x params x tokens/s over
//! (ranks x measured matmul peak), with the peak measured in the same process by the same
//! matmul the model uses (candle's gemm), so the ratio is honest on a noisy machine.

use crate::config::ModelConfig;
use crate::error::Result;
use candle_core::Device;
use std::time::Instant;
use tp_nn::RandomTensor;

/// Training FLOPs per token by the definition: 6 x parameters (forward 2, backward
/// 4; attention's score and context matmuls are not counted, as in that definition); in a
/// mixture of experts the parameters a token runs through (its top-k experts).
pub fn flops_per_token(cfg: &ModelConfig) -> f64 {
    6.0 * cfg.active_parameter_count() as f64
}

/// Model FLOPs utilization of `ranks` ranks at `tokens_per_s`, against `peak_flops` per rank.
pub fn mfu(cfg: &ModelConfig, tokens_per_s: f64, ranks: usize, peak_flops: f64) -> f64 {
    flops_per_token(cfg) * tokens_per_s / (ranks as f64 * peak_flops)
}

/// Best FLOP/s of `reps` products `[n, n] @ [n, n]` through candle on the calling thread's
/// compute pool (one core when `RAYON_NUM_THREADS=1`, as `tp bench train` runs it).
pub fn measure_matmul_peak(n: usize, reps: usize) -> Result<f64> {
    let dev = Device::Cpu;
    let mut rng = tp_nn::Rng::xorshift64_star(1);
    let a = rng.tensor(&[n, n], 0.0, 1.0, &dev)?; // [n, n]
    let b = rng.tensor(&[n, n], 0.0, 1.0, &dev)?; // [n, n]
    let _warm = a.matmul(&b)?;
    let mut best = 0f64;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        let c = a.matmul(&b)?; // [n, n]
        let dt = t0.elapsed().as_secs_f64();
        drop(c);
        best = best.max(2.0 * (n as f64).powi(3) / dt.max(1e-9));
    }
    Ok(best)
}

/// Mean per-thread peak when `threads` threads each run [`measure_matmul_peak`] at the same
/// time: what one rank can expect while the others compute too (shared memory bandwidth,
/// caches, and whatever else the machine is running).
pub fn measure_concurrent_peak(n: usize, reps: usize, threads: usize) -> Result<f64> {
    let peaks: Vec<Result<f64>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads.max(1))
            .map(|_| s.spawn(|| measure_matmul_peak(n, reps)))
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(crate::error::TrainError::Config(
                        "the matmul probe thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    let mut sum = 0.0;
    let count = peaks.len() as f64;
    for p in peaks {
        sum += p?;
    }
    Ok(sum / count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainModel;

    #[test]
    fn mfu_follows_the_definition() {
        let c = ModelConfig::preset("tiny").unwrap();
        let p = c.num_params() as f64;
        let got = mfu(&c, 1000.0, 2, 1e9);
        assert!((got - 6.0 * p * 1000.0 / 2e9).abs() < 1e-12);
        // A mixture of experts counts the experts a token runs through.
        let moe = c.clone().with_experts(Some(tp_spec::Experts::new(8, 2)));
        let active = p + (c.layers * 3 * c.hidden * c.ffn + c.layers * 8 * c.hidden) as f64;
        let got = mfu(&moe, 1000.0, 2, 1e9);
        assert!((got - 6.0 * active * 1000.0 / 2e9).abs() < 1e-12);
        assert!(measure_matmul_peak(64, 2).unwrap() > 0.0);
        assert!(measure_concurrent_peak(64, 2, 2).unwrap() > 0.0);
    }
}
