//! Many-token products (prefill chunks, batched decode) before and after a kernel change, in
//! the same process and interleaved: each round times the current kernels and the previous
//! schedule (`tp_kernels::legacy_tiles(true)`: weights unpacked again for every tile of 4
//! tokens) one after the other on the same matrix and activations, so a change of machine
//! load hits both. Times are the calling thread's CPU time (not wall time: on a shared
//! machine a thread waiting for a core would count), median of 5 samples per round; the table
//! gives the median over rounds of each time and of the per-round ratio, plus GOP/s (2 per
//! multiply-add) of the current kernels. Shapes: SmolLM2-135M (Q4_1) and Qwen2.5-0.5B (its
//! Q5_0 / Q8_0 / Q4_K / Q6_K tensors), fused as the models run them (QKV, gate+up), its
//! K-quant down projection also in the sub-block form a model uses where tp shards cut
//! inside super-blocks; Q2_K and Q3_K at its down shape and, 896 columns not being a whole
//! number of super-blocks, a gate-like 4864 x 1024; IQ4_NL at SmolLM2's gate+up and down
//! shapes, IQ4_XS at a square one; Qwen2.5-Coder-1.5B Q4_K_M's Q4_K and Q6_K products.
//! Run: `cargo bench -p tp-kernels --bench gemm` (`TP_BENCH_ONLY=Q4_1` keeps the rows whose
//! name (format, shape, what it is) contains the substring, `TP_BENCH_N=128,32` sets the token counts, `TP_BENCH_ROUNDS`
//! the rounds, 7 by default). `TP_BENCH_VS=avx2-novnni` (any `TP_KERNEL` name) makes "old"
//! that kernel path (`tp_kernels::force_kernel`) instead of the previous schedule, and "new"
//! the process default (e.g. plain AVX2 against `avx2+vnni`).

mod timing;

use std::hint::black_box;
use timing::{ggml_bytes, load_average, values};
use tp_kernels::{force_kernel, kernel_report, legacy_tiles, QuantMatrix, QuantType};

/// (format, rows, cols, what it is).
fn cases() -> Vec<(QuantType, usize, usize, &'static str)> {
    use QuantType::*;
    vec![
        (Q4_1, 960, 576, "smollm2 qkv"),
        (Q4_1, 576, 576, "smollm2 o (wide)"),
        (Q4_1, 3072, 576, "smollm2 gate+up"),
        (Q4_1, 576, 1536, "smollm2 down (wide)"),
        (Q5_0, 1152, 896, "qwen qkv"),
        (Q8_0, 1152, 896, "qwen qkv q8"),
        (Q5_0, 896, 896, "qwen o (wide)"),
        (Q5_0, 9728, 896, "qwen gate+up"),
        (Q4_K, 896, 4864, "qwen down q4k (wide)"),
        (Q6_K, 896, 4864, "qwen down q6k (wide)"),
        (Q4_K, 896, 4864, "qwen down q4k (wide, sub-block form)"),
        (Q6_K, 896, 4864, "qwen down q6k (wide, sub-block form)"),
        (Q4_0, 1536, 576, "q4_0"),
        (Q5_1, 896, 896, "q5_1"),
        (Q2_K, 1536, 1536, "q2_k"),
        (Q3_K, 1536, 1536, "q3_k"),
        (Q2_K, 4864, 1024, "gate-like, 1024 cols q2k"),
        (Q2_K, 896, 4864, "qwen down q2k"),
        (Q2_K, 896, 4864, "qwen down q2k (wide)"),
        (Q3_K, 4864, 1024, "gate-like, 1024 cols q3k"),
        (Q3_K, 896, 4864, "qwen down q3k"),
        (Q3_K, 896, 4864, "qwen down q3k (wide)"),
        (Q5_K, 1536, 1536, "q5_k"),
        (Q4_K, 2048, 1536, "qwen1.5b qkv q4k"),
        (Q4_K, 1536, 1536, "qwen1.5b o q4k (wide, sub-block form)"),
        (Q4_K, 17920, 1536, "qwen1.5b gate+up q4k"),
        (Q6_K, 1536, 8960, "qwen1.5b down q6k (wide)"),
        (IQ4_NL, 3072, 576, "gate+up-like iq4_nl"),
        (IQ4_NL, 576, 1536, "down-like iq4_nl (wide)"),
        (IQ4_XS, 1536, 1536, "iq4_xs"),
    ]
}

/// Seconds of CPU time this thread has run (Linux `CLOCK_THREAD_CPUTIME_ID`): unlike wall
/// time, it does not count the time the thread waits for a core on a busy machine.
fn thread_cpu_secs() -> f64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = Timespec { sec: 0, nsec: 0 };
    // SAFETY: `ts` is a valid `struct timespec` for the C library to fill.
    unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.sec as f64 + ts.nsec as f64 * 1e-9
}

/// Median thread CPU seconds per call of `f` over `samples` samples of at least `min_secs`.
fn cpu_per_call(mut f: impl FnMut(), samples: usize, min_secs: f64) -> f64 {
    f();
    let t = thread_cpu_secs();
    f();
    let once = (thread_cpu_secs() - t).max(1e-7);
    let reps = ((min_secs / once).ceil() as usize).max(1);
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = thread_cpu_secs();
        for _ in 0..reps {
            f();
        }
        v.push((thread_cpu_secs() - t) / reps as f64);
    }
    median(v)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let only = std::env::var("TP_BENCH_ONLY").ok();
    let ns: Vec<usize> = std::env::var("TP_BENCH_N")
        .ok()
        .map(|s| s.split(',').filter_map(|v| v.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![128]);
    let rounds: usize = std::env::var("TP_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let vs = std::env::var("TP_BENCH_VS").ok();
    // "old": the previous schedule, or the kernel path `vs` names.
    let set_old = |on: bool| match &vs {
        Some(path) => force_kernel(on.then_some(path.as_str())).expect("TP_BENCH_VS"),
        None => legacy_tiles(on),
    };
    println!("# tp-kernels gemm bench: {}", kernel_report());
    println!("# load average before: {}", load_average());
    let what_old = match &vs {
        Some(path) => format!("kernel path {path}"),
        None => "unpacked per tile".into(),
    };
    println!(
        "# {rounds} rounds, old ({what_old}) and new timed alternately in each; thread CPU time"
    );
    println!();
    println!(
        "| weights | n | product | old ms | new ms | new GOP/s | old/new (median of rounds) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (qtype, rows, cols, what) in cases() {
        let name = format!("{}_{rows}x{cols}", qtype.name());
        let label = format!("{name} ({what})");
        if only.as_ref().is_some_and(|f| !label.contains(f.as_str())) {
            continue;
        }
        let bytes = ggml_bytes(qtype, rows, cols);
        let m = if what.contains("sub-block") {
            QuantMatrix::from_ggml_sub_blocks(qtype, rows, 0, cols, bytes)
        } else {
            QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes)
        }
        .expect("matrix");
        for &n in &ns {
            let x = values(n * cols);
            let mut y = vec![0.0f32; n * rows];
            let mut yw = vec![0.0f64; n * rows];
            let wide = what.contains("wide");
            let mut call = || {
                if wide {
                    m.matmul_wide_acc(black_box(&x), n, &mut yw).expect("mm");
                } else {
                    m.matmul(black_box(&x), n, &mut y).expect("mm");
                }
            };
            let (mut old, mut new, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..rounds {
                set_old(true);
                let to = cpu_per_call(&mut call, 5, 0.02);
                set_old(false);
                let tn = cpu_per_call(&mut call, 5, 0.02);
                old.push(to);
                new.push(tn);
                ratio.push(to / tn);
            }
            let ops = 2.0 * (rows * cols * n) as f64;
            let tn = median(new);
            println!(
                "| {name} ({what}) | {n} | {} | {:.3} | {:.3} | {:.1} | {:.2} |",
                if wide { "wide" } else { "f32" },
                median(old) * 1e3,
                tn * 1e3,
                ops / tn / 1e9,
                median(ratio)
            );
        }
    }
    println!();
    println!("# load average after: {}", load_average());
}
