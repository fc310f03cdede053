//! Timing shared by the kernel benchmarks: median seconds per call, and single-thread read
//! bandwidth.

use std::hint::black_box;
use std::time::{Duration, Instant};

/// Median seconds per call of `f` (given a call counter) within about `budget`: samples of
/// several calls each, every sample at least `sample_secs` long, between 5 and `max_samples`.
pub fn time_per_call(
    mut f: impl FnMut(usize),
    budget: Duration,
    sample_secs: f64,
    max_samples: usize,
) -> f64 {
    f(0);
    let t = Instant::now();
    f(1);
    let once = t.elapsed().as_secs_f64().max(1e-7);
    let per_sample = ((sample_secs / once).ceil() as usize).max(1);
    let samples =
        ((budget.as_secs_f64() / (once * per_sample as f64)) as usize).clamp(5, max_samples);
    let mut times = Vec::with_capacity(samples);
    let mut i = 2;
    for _ in 0..samples {
        let t = Instant::now();
        for _ in 0..per_sample {
            f(i);
            i += 1;
        }
        times.push(t.elapsed().as_secs_f64() / per_sample as f64);
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Single-thread read bandwidth in GB/s: the median of `runs` sums of a `bytes`-long f32
/// array (16 independent accumulators).
pub fn read_bandwidth(bytes: usize, runs: usize) -> f64 {
    let data = vec![1.0f32; bytes / 4];
    let mut times = Vec::new();
    for _ in 0..runs {
        let t = Instant::now();
        let mut acc = [0.0f32; 16];
        for c in black_box(&data).chunks_exact(16) {
            for (a, v) in acc.iter_mut().zip(c) {
                *a += v;
            }
        }
        black_box(acc);
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    bytes as f64 / times[times.len() / 2] / 1e9
}
