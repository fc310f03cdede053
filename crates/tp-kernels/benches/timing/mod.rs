//! Timing shared by the kernel benchmarks: median seconds per call, single-thread read
//! bandwidth, the load average, and their synthetic weights and activations.

#![allow(dead_code)] // each benchmark uses a subset

use std::hint::black_box;
use std::time::{Duration, Instant};
use tp_kernels::QuantType;

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

/// Pseudo-random ggml blocks with small f16 scales (weights of magnitude ~0.01-0.1).
pub fn ggml_bytes(qtype: QuantType, rows: usize, cols: usize) -> Vec<u8> {
    let blocks = rows * cols / qtype.block_len();
    let mut rng = tp_testkit::Rng::new(0x2545_F491_4F6C_DD1D);
    let mut bytes: Vec<u8> = (0..blocks * qtype.block_bytes())
        .map(|_| rng.next_u64() as u8)
        .collect();
    // f16 0x2000 = 2^-7; 0xA000 = -2^-7.
    for b in bytes.chunks_exact_mut(qtype.block_bytes()) {
        match qtype {
            QuantType::Q6_K => b[208..210].copy_from_slice(&[0x00, 0x20]),
            QuantType::Q3_K => b[108..110].copy_from_slice(&[0x00, 0x20]),
            QuantType::Q2_K => {
                b[80..82].copy_from_slice(&[0x00, 0x20]);
                b[82..84].copy_from_slice(&[0x00, 0x20]);
            }
            QuantType::Q4_K | QuantType::Q5_K => {
                b[0..2].copy_from_slice(&[0x00, 0x20]);
                b[2..4].copy_from_slice(&[0x00, 0x20]);
            }
            QuantType::Q4_1 | QuantType::Q5_1 => {
                b[0..2].copy_from_slice(&[0x00, 0x20]);
                b[2..4].copy_from_slice(&[0x00, 0xA0]);
            }
            _ => b[0..2].copy_from_slice(&[0x00, 0x20]),
        }
    }
    bytes
}

/// Activations of magnitude ~0.1 from a fixed seeded stream.
pub fn values(len: usize) -> Vec<f32> {
    tp_testkit::Rng::new(12345).uniform_vec(len, -0.1, 0.1)
}

/// The load average of the last 1, 5 and 15 minutes, for the benchmark headers.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}
