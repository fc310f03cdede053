//! Kernel paths side by side: GOP/s (2 operations per multiply-add) of every quantized format
//! on the scalar, AVX2 (plain and with 256-bit VNNI) and AVX-512 paths, with the CPU model, the load average, this
//! machine's single-thread read bandwidth and measured integer dot-product peaks for
//! comparison. Run: `cargo bench -p tp-kernels --bench paths` (`TP_BENCH_ONLY=Q4_1` keeps the
//! rows whose name contains the substring).
//!
//! The path is chosen once per process (`TP_KERNEL`), so the parent re-runs this binary once
//! per path with `TP_KERNEL` set and collects the children's figures; a path the CPU cannot
//! run is reported as skipped (the child reports the path it really used). The SIMD paths
//! alternate over 3 rounds and each figure keeps its fastest round.
//!
//! Columns: "hot n=1" repeats one matrix (cache resident when it fits); "stream n=1" cycles
//! through copies totalling 128 MiB, as in decode, where each weight is read once per token;
//! "n=128" is a prefill-sized product (tiles of 4 tokens; on AVX-512, chunks of 16 for the
//! formats with many-token kernels); "wide n=128" the same through
//! `matmul_wide_acc`, the split-invariant product of row-parallel layers.

mod timing;

use std::hint::black_box;
use std::process::Command;
use std::time::Duration;
use timing::{ggml_bytes, load_average, values};
use tp_kernels::{kernel_path, kernel_report, QuantMatrix, QuantType};

const STREAM_BYTES: usize = 128 << 20;
/// `TP_KERNEL` values: `avx2-novnni` is the plain AVX2 path (the child reports `avx2`),
/// `avx2+vnni` the AVX2 path with 256-bit VNNI.
const PATHS: [&str; 4] = ["scalar", "avx2-novnni", "avx2+vnni", "avx512"];
const ROUNDS: usize = 3;

/// (format, rows, cols): SmolLM2-135M and Qwen2.5-0.5B shapes.
fn cases() -> Vec<(QuantType, usize, usize)> {
    use QuantType::*;
    vec![
        (Q4_0, 1536, 576),
        (Q4_1, 1536, 576),
        (Q4_1, 576, 1536),
        (Q8_0, 1536, 576),
        (Q5_0, 896, 896),
        (Q5_1, 896, 896),
        (Q2_K, 1536, 1536),
        (Q3_K, 1536, 1536),
        (Q4_K, 1536, 1536),
        (Q5_K, 1536, 1536),
        (Q6_K, 1536, 1536),
        (IQ4_NL, 1536, 576),
        (IQ4_XS, 1536, 1536),
    ]
}

/// Median seconds per call of `f`, from samples of at least 0.005 s each (at most 31).
fn time_per_call(f: impl FnMut(usize), budget: Duration) -> f64 {
    timing::time_per_call(f, budget, 0.005, 31)
}

fn wanted(name: &str) -> bool {
    std::env::var("TP_BENCH_ONLY").map_or(true, |f| name.contains(&f))
}

/// The child: times every case on this process's path and prints one line per figure:
/// `fig <case> <column> <seconds> <ops>`.
fn child() {
    println!("path {}", kernel_path());
    for (qtype, rows, cols) in cases() {
        let name = format!("{}_{rows}x{cols}", qtype.name());
        if !wanted(&name) {
            continue;
        }
        let m = QuantMatrix::from_ggml_bytes(qtype, rows, cols, ggml_bytes(qtype, rows, cols))
            .expect("matrix");
        let ops = |n: usize| 2.0 * (rows * cols * n) as f64;
        let x1 = values(cols);
        let mut y1 = vec![0.0f32; rows];
        let budget = Duration::from_millis(300);
        let t = time_per_call(
            |_| m.matmul(black_box(&x1), 1, &mut y1).expect("mm"),
            budget,
        );
        println!("fig {name} hot1 {t:e} {:e}", ops(1));
        let copies = STREAM_BYTES.div_ceil(m.storage_bytes()).max(2);
        let many: Vec<QuantMatrix> = (0..copies).map(|_| m.clone()).collect();
        let t = time_per_call(
            |i| many[i % copies].matmul(&x1, 1, &mut y1).expect("mm"),
            budget,
        );
        drop(many);
        println!("fig {name} stream1 {t:e} {:e}", ops(1));
        let n = 128;
        let xn = values(n * cols);
        let mut yn = vec![0.0f32; n * rows];
        let t = time_per_call(
            |_| m.matmul(black_box(&xn), n, &mut yn).expect("mm"),
            budget,
        );
        println!("fig {name} hot128 {t:e} {:e}", ops(n));
        let mut yw = vec![0.0f64; n * rows];
        let t = time_per_call(
            |_| m.matmul_wide_acc(black_box(&xn), n, &mut yw).expect("mm"),
            budget,
        );
        println!("fig {name} wide128 {t:e} {:e}", ops(n));
    }
}

/// Single-thread read bandwidth: the median of 5 sums of a 128 MiB f32 array.
fn read_bandwidth() -> f64 {
    timing::read_bandwidth(128 << 20, 5)
}

/// Measured int8 dot-product peaks of one core (GOP/s, 2 per u8 x i8 multiply-add): AVX2
/// `vpmaddubsw` + `vpmaddwd` + `vpaddd` (the AVX2 kernels' sequence) and AVX-512 VNNI
/// `vpdpbusd` on 512-bit registers, 12 independent accumulators each.
#[cfg(target_arch = "x86_64")]
mod peak {
    use std::arch::x86_64::*;
    use std::hint::black_box;
    use std::time::Instant;

    const ITERS: usize = 2_000_000;

    #[target_feature(enable = "avx2")]
    fn avx2_loop(a: __m256i, b: __m256i) -> [__m256i; 12] {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [a; 12];
        for _ in 0..ITERS {
            for s in acc.iter_mut() {
                // The accumulator feeds the next product, so nothing can be hoisted.
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(*s, b), ones);
                *s = _mm256_add_epi32(*s, p);
            }
        }
        acc
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    fn vnni_loop(a: __m512i, b: __m512i) -> [__m512i; 12] {
        let mut acc = [_mm512_setzero_si512(); 12];
        for _ in 0..ITERS {
            for s in acc.iter_mut() {
                *s = _mm512_dpbusd_epi32(*s, a, b);
            }
        }
        acc
    }

    fn best_of(mut f: impl FnMut()) -> f64 {
        (0..3)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    }

    pub fn avx2() -> Option<f64> {
        if !is_x86_feature_detected!("avx2") {
            return None;
        }
        let s = best_of(|| {
            // SAFETY: AVX2 was detected just above.
            let r = unsafe { avx2_loop(_mm256_set1_epi8(3), _mm256_set1_epi8(-2)) };
            black_box(r);
        });
        // Each step: 32 u8 x i8 products per register.
        Some(2.0 * 32.0 * 12.0 * ITERS as f64 / s / 1e9)
    }

    pub fn vnni512() -> Option<f64> {
        let ok = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni");
        if !ok {
            return None;
        }
        let s = best_of(|| {
            // SAFETY: AVX-512 F/BW and VNNI were detected just above.
            let r = unsafe { vnni_loop(_mm512_set1_epi8(3), _mm512_set1_epi8(-2)) };
            black_box(r);
        });
        Some(2.0 * 64.0 * 12.0 * ITERS as f64 / s / 1e9)
    }
}

/// One child figure: (case, column, seconds per call, operations per call).
type Fig = (String, String, f64, f64);

fn main() {
    if std::env::var_os("TP_BENCH_PATHS_CHILD").is_some() {
        child();
        return;
    }
    let exe = std::env::current_exe().expect("own path");
    println!("# tp-kernels paths bench: {}", kernel_report());
    println!("# load average before: {}", load_average());
    let bw = read_bandwidth();
    println!("# single-thread read bandwidth: {bw:.1} GB/s (sum of a 128 MiB f32 array)");
    #[cfg(target_arch = "x86_64")]
    {
        let show = |v: Option<f64>| v.map_or("not on this CPU".to_string(), |g| format!("{g:.0}"));
        println!(
            "# measured int8 peak, one core, GOP/s: avx2 maddubs+madd {}, avx512 vpdpbusd {}",
            show(peak::avx2()),
            show(peak::vnni512())
        );
    }
    let mut figures: Vec<(String, Vec<Fig>)> = Vec::new();
    // The machine may be shared: the SIMD paths run alternately in ROUNDS rounds and each
    // figure keeps its fastest round (the least disturbed); scalar runs once.
    let rounds: Vec<&str> = (0..ROUNDS)
        .flat_map(|r| PATHS.into_iter().filter(move |&p| r == 0 || p != "scalar"))
        .collect();
    for asked in rounds {
        // The name the child reports for the path it runs.
        let want = if asked == "avx2-novnni" {
            "avx2"
        } else {
            asked
        };
        let out = Command::new(&exe)
            .env("TP_BENCH_PATHS_CHILD", "1")
            .env("TP_KERNEL", asked)
            .output()
            .expect("run the bench child");
        let text = String::from_utf8_lossy(&out.stdout);
        let got = text
            .lines()
            .find_map(|l| l.strip_prefix("path "))
            .unwrap_or("?");
        if got != want {
            if !figures.iter().any(|f| f.0 == "skip ".to_string() + want) {
                println!("# path {want}: skipped, this CPU cannot run it (child used {got})");
                figures.push(("skip ".to_string() + want, Vec::new()));
            }
            continue;
        }
        let mut rows = Vec::new();
        for l in text.lines().filter_map(|l| l.strip_prefix("fig ")) {
            let f: Vec<&str> = l.split_whitespace().collect();
            if let [case, col, secs, ops] = f[..] {
                let (Ok(secs), Ok(ops)) = (secs.parse::<f64>(), ops.parse::<f64>()) else {
                    continue;
                };
                rows.push((case.to_string(), col.to_string(), secs, ops));
            }
        }
        match figures.iter_mut().find(|f| f.0 == want) {
            Some((_, old)) => {
                for r in rows {
                    match old.iter_mut().find(|o| o.0 == r.0 && o.1 == r.1) {
                        Some(o) => o.2 = o.2.min(r.2),
                        None => old.push(r),
                    }
                }
            }
            None => figures.push((want.to_string(), rows)),
        }
    }
    figures.retain(|f| !f.0.starts_with("skip "));
    println!("# load average after: {}", load_average());
    println!();
    let cols = [
        ("hot1", "hot n=1"),
        ("stream1", "stream n=1"),
        ("hot128", "n=128"),
        ("wide128", "wide n=128"),
    ];
    print!("| weights | path |");
    for (_, title) in cols {
        print!(" {title} GOP/s |");
    }
    println!(" stream n=1 GB/s |");
    println!("|---|---|---|---|---|---|---|");
    let Some((_, first)) = figures.first() else {
        return;
    };
    let mut names: Vec<String> = first.iter().map(|r| r.0.clone()).collect();
    names.dedup();
    for name in &names {
        for (path, rows) in &figures {
            print!("| {name} | {path} |");
            for (key, _) in cols {
                match rows.iter().find(|r| &r.0 == name && r.1 == key) {
                    Some(r) => print!(" {:.1} |", r.3 / r.2 / 1e9),
                    None => print!(" - |"),
                }
            }
            // Weight bytes per streamed call: ops / 2 MACs at the format's bits per weight.
            let gbs = rows
                .iter()
                .find(|r| &r.0 == name && r.1 == "stream1")
                .map(|r| {
                    let macs = r.3 / 2.0;
                    let q = name.split('_').take(2).collect::<Vec<_>>().join("_");
                    let bpw = match q.as_str() {
                        "Q4_0" => 18.0 / 32.0,
                        "Q4_1" => 20.0 / 32.0,
                        "Q8_0" => 34.0 / 32.0,
                        "Q5_0" => 22.0 / 32.0,
                        "Q5_1" => 24.0 / 32.0,
                        "Q2_K" => 100.0 / 256.0,
                        "Q3_K" => 114.0 / 256.0,
                        "Q4_K" => 148.0 / 256.0,
                        "Q5_K" => 180.0 / 256.0,
                        "Q6_K" => 210.0 / 256.0,
                        "IQ4_NL" => 18.0 / 32.0,
                        "IQ4_XS" => 138.0 / 256.0,
                        _ => f64::NAN,
                    };
                    macs * bpw / r.2 / 1e9
                });
            match gbs {
                Some(g) => println!(" {g:.1} ({:.2}x bw) |", g / bw),
                None => println!(" - |"),
            }
        }
    }
    // AVX-512 over AVX2, per column.
    let get = |p: &str| figures.iter().find(|f| f.0 == p).map(|f| &f.1);
    if let (Some(a2), Some(a5)) = (get("avx2"), get("avx512")) {
        println!();
        print!("| weights | avx512 / avx2 speed |");
        for (_, title) in cols {
            print!(" {title} |");
        }
        println!();
        println!("|---|---|---|---|---|---|");
        for name in &names {
            print!("| {name} | |");
            for (key, _) in cols {
                let t = |rows: &Vec<Fig>| {
                    rows.iter()
                        .find(|r| &r.0 == name && r.1 == key)
                        .map(|r| r.2)
                };
                match (t(a2), t(a5)) {
                    (Some(x), Some(y)) => print!(" {:.2}x |", x / y),
                    _ => print!(" - |"),
                }
            }
            println!();
        }
    }
}
