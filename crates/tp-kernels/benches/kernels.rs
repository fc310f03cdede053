//! Benchmark of the kernels on SmolLM2-135M (and Qwen2.5) shapes against this machine's single-thread read
//! bandwidth and candle-core's QMatMul (also pinned to one thread). Run: `cargo bench -p tp-kernels`.
//!
//! Every figure is the median of repeated timed samples. "hot": the same matrix over and over
//! (it may sit in cache); "stream": calls cycle through copies of the matrix totalling at least
//! 128 MiB, so weights come from DRAM as in real decode, where a token touches every weight once.
//!
//! A second table compares `matmul_wide_acc` (split-invariant f64 accumulation) with `matmul`
//! on the row-parallel shapes, timing the two alternately so that both see the same machine
//! load; `TP_BENCH_ONLY=wide` runs only that table.

#[path = "../tests/common/mod.rs"]
mod common;
mod timing;

use candle_core::quantized::{ggml_file::qtensor_from_ggml, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use common::ggml_dtype;
use std::hint::black_box;
use std::time::{Duration, Instant};
use tp_kernels::{simd_level, DenseMatrix, QuantMatrix, QuantType};

const STREAM_BYTES: usize = 128 << 20;

/// Median seconds per call of `f`, from samples of at least 0.01 s each (at most 41).
fn time_per_call(f: impl FnMut(usize), budget: Duration) -> f64 {
    timing::time_per_call(f, budget, 0.01, 41)
}

/// Single-thread read bandwidth: the median of 7 sums of a 256 MiB f32 array.
fn read_bandwidth() -> f64 {
    timing::read_bandwidth(256 << 20, 7)
}

/// Small weights and activations: [`common::uniform_values`] scaled by 0.1.
fn values(len: usize, seed: u64) -> Vec<f32> {
    common::uniform_values(len, seed)
        .into_iter()
        .map(|v| v * 0.1)
        .collect()
}

struct Row {
    name: String,
    n: usize,
    macs: f64,
    bytes: f64,
    ours_hot: f64,
    ours_stream: Option<f64>,
    candle_hot: Option<f64>,
    candle_stream: Option<f64>,
}

fn bench_quant(qtype: QuantType, rows: usize, cols: usize, n: usize) -> Row {
    let cpu = Device::Cpu;
    let w = Tensor::from_vec(
        values(rows * cols, (rows + cols) as u64),
        (rows, cols),
        &cpu,
    )
    .expect("tensor");
    let q = QTensor::quantize(&w, ggml_dtype(qtype)).expect("quantize");
    let bytes = q.data().expect("data").into_owned();
    let ours = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes.clone()).expect("matrix");
    let x = values(n * cols, 7);
    let mut y = vec![0.0f32; n * rows];
    let budget = Duration::from_millis(if n == 1 { 400 } else { 1500 });
    let ours_hot = time_per_call(
        |_| ours.matmul(black_box(&x), n, &mut y).expect("matmul"),
        budget,
    );
    let copies = STREAM_BYTES.div_ceil(bytes.len()).max(2);
    let xt = Tensor::from_vec(x.clone(), (n, cols), &cpu).expect("x");
    let candle = QMatMul::from_qtensor(q).expect("qmatmul");
    let candle_hot = time_per_call(
        |_| drop(black_box(candle.forward(&xt).expect("fwd"))),
        budget,
    );
    let (mut ours_stream, mut candle_stream) = (None, None);
    if n == 1 {
        let many: Vec<QuantMatrix> = (0..copies).map(|_| ours.clone()).collect();
        ours_stream = Some(time_per_call(
            |i| many[i % copies].matmul(&x, n, &mut y).expect("matmul"),
            budget,
        ));
        drop(many);
        let many: Vec<QMatMul> = (0..copies)
            .map(|_| {
                let t = qtensor_from_ggml(ggml_dtype(qtype), &bytes, vec![rows, cols], &cpu);
                QMatMul::from_qtensor(t.expect("qtensor")).expect("qmatmul")
            })
            .collect();
        // candle repacks some formats lazily on first use: do that before timing.
        for m in &many {
            drop(black_box(m.forward(&xt).expect("fwd")));
        }
        candle_stream = Some(time_per_call(
            |i| drop(black_box(many[i % copies].forward(&xt).expect("fwd"))),
            budget,
        ));
    }
    Row {
        name: format!("{} {rows}x{cols}", qtype.name()),
        n,
        macs: (rows * cols * n) as f64,
        bytes: ours.storage_bytes() as f64,
        ours_hot,
        ours_stream,
        candle_hot: Some(candle_hot),
        candle_stream,
    }
}

fn bench_dense(f16: bool, rows: usize, cols: usize, n: usize) -> Row {
    let w = values(rows * cols, 3);
    let m = if f16 {
        DenseMatrix::from_f32_as_f16(rows, cols, &w)
    } else {
        DenseMatrix::from_f32(rows, cols, w)
    }
    .expect("dense");
    let x = values(n * cols, 9);
    let mut y = vec![0.0f32; n * rows];
    let budget = Duration::from_millis(600);
    let ours_hot = time_per_call(|_| m.matmul(black_box(&x), n, &mut y).expect("mm"), budget);
    let copies = STREAM_BYTES.div_ceil(m.storage_bytes()).max(2);
    let ours_stream = (n == 1).then(|| {
        let many: Vec<DenseMatrix> = (0..copies).map(|_| m.clone()).collect();
        time_per_call(
            |i| many[i % copies].matmul(&x, n, &mut y).expect("mm"),
            budget,
        )
    });
    Row {
        name: format!("{} {rows}x{cols}", if f16 { "F16" } else { "F32" }),
        n,
        macs: (rows * cols * n) as f64,
        bytes: m.storage_bytes() as f64,
        ours_hot,
        ours_stream,
        candle_hot: None,
        candle_stream: None,
    }
}

/// `f` against `g`, alternating one sample of each (several calls per sample) per round so
/// that a change of machine load hits both.
#[derive(Clone, Copy)]
struct Pair {
    /// Median seconds per call of `f` and of `g`.
    f: f64,
    g: f64,
    /// Median over rounds of `g / f`.
    ratio: f64,
    /// `min g / min f`: the least disturbed samples of each (on a shared machine the
    /// fastest sample is the one least interrupted).
    ratio_best: f64,
}

fn time_pair(mut f: impl FnMut(usize), mut g: impl FnMut(usize), budget: Duration) -> Pair {
    f(0);
    g(0);
    let t = Instant::now();
    f(1);
    g(1);
    let once = t.elapsed().as_secs_f64().max(1e-7) / 2.0;
    let per_sample = ((0.002 / once).ceil() as usize).max(1);
    let rounds = ((budget.as_secs_f64() / (2.0 * once * per_sample as f64)) as usize).clamp(9, 201);
    let (mut tf, mut tg, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    let mut i = 2;
    for _ in 0..rounds {
        let t = Instant::now();
        for k in 0..per_sample {
            f(i + k);
        }
        let a = t.elapsed().as_secs_f64() / per_sample as f64;
        let t = Instant::now();
        for k in 0..per_sample {
            g(i + k);
        }
        let b = t.elapsed().as_secs_f64() / per_sample as f64;
        i += per_sample;
        tf.push(a);
        tg.push(b);
        ratio.push(b / a);
    }
    for v in [&mut tf, &mut tg, &mut ratio] {
        v.sort_by(f64::total_cmp);
    }
    let mid = |v: &[f64]| v[v.len() / 2];
    Pair {
        f: mid(&tf),
        g: mid(&tg),
        ratio: mid(&ratio),
        ratio_best: tg[0] / tf[0],
    }
}

/// One row of the wide-vs-f32 table: hot, and streamed at n = 1 (`f` = f32, `g` = wide).
struct WideRow {
    name: String,
    n: usize,
    hot: Pair,
    stream: Option<Pair>,
}

/// A matrix both products can run on.
trait Product: Clone {
    fn f32(&self, x: &[f32], n: usize, y: &mut [f32]);
    fn wide(&self, x: &[f32], n: usize, y: &mut [f64]);
    fn bytes(&self) -> usize;
}

impl Product for QuantMatrix {
    fn f32(&self, x: &[f32], n: usize, y: &mut [f32]) {
        self.matmul(x, n, y).expect("matmul");
    }
    fn wide(&self, x: &[f32], n: usize, y: &mut [f64]) {
        self.matmul_wide_acc(x, n, y).expect("matmul_wide_acc");
    }
    fn bytes(&self) -> usize {
        self.storage_bytes()
    }
}

impl Product for DenseMatrix {
    fn f32(&self, x: &[f32], n: usize, y: &mut [f32]) {
        self.matmul(x, n, y).expect("matmul");
    }
    fn wide(&self, x: &[f32], n: usize, y: &mut [f64]) {
        self.matmul_wide_acc(x, n, y).expect("matmul_wide_acc");
    }
    fn bytes(&self) -> usize {
        self.storage_bytes()
    }
}

fn bench_wide<M: Product>(name: String, m: M, rows: usize, cols: usize, n: usize) -> WideRow {
    let x = values(n * cols, 7);
    let mut y = vec![0.0f32; n * rows];
    let mut y64 = vec![0.0f64; n * rows];
    let budget = Duration::from_millis(if n == 1 { 800 } else { 3000 });
    let hot = time_pair(
        |_| m.f32(black_box(&x), n, &mut y),
        |_| m.wide(black_box(&x), n, &mut y64),
        budget,
    );
    let stream = (n == 1).then(|| {
        let copies = STREAM_BYTES.div_ceil(m.bytes()).max(2);
        let many: Vec<M> = (0..copies).map(|_| m.clone()).collect();
        // A round's two samples take the same call numbers: `g` reads the copies half the
        // ring away, last read 64 MiB ago, not the ones `f` just brought into cache.
        let half = copies / 2;
        time_pair(
            |i| many[i % copies].f32(&x, n, &mut y),
            |i| many[(i + half) % copies].wide(&x, n, &mut y64),
            budget,
        )
    });
    WideRow {
        name,
        n,
        hot,
        stream,
    }
}

fn quant_matrix(qtype: QuantType, rows: usize, cols: usize) -> QuantMatrix {
    let w = Tensor::from_vec(
        values(rows * cols, (rows + cols) as u64),
        (rows, cols),
        &Device::Cpu,
    )
    .expect("tensor");
    let q = QTensor::quantize(&w, ggml_dtype(qtype)).expect("quantize");
    let bytes = q.data().expect("data").into_owned();
    QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes).expect("matrix")
}

fn wide_table(want: &dyn Fn(&str) -> bool) {
    let mut rows = Vec::new();
    for n in [1usize, 128] {
        for (q, r, c) in [
            (QuantType::Q4_1, 576, 576),
            (QuantType::Q4_1, 576, 1536),
            (QuantType::Q8_0, 576, 576),
            (QuantType::Q8_0, 576, 1536),
            // Qwen2.5-1.5B row-parallel shapes (attention output, MLP down).
            (QuantType::Q4_K, 1536, 1536),
            (QuantType::Q6_K, 1536, 8960),
        ] {
            let name = format!("wide {} {r}x{c}", q.name());
            if want(&name) {
                rows.push(bench_wide(name, quant_matrix(q, r, c), r, c, n));
            }
        }
        for f16 in [false, true] {
            let name = format!("wide {} 576x1536", if f16 { "F16" } else { "F32" });
            if want(&name) {
                let w = values(576 * 1536, 3);
                let m = if f16 {
                    DenseMatrix::from_f32_as_f16(576, 1536, &w)
                } else {
                    DenseMatrix::from_f32(576, 1536, w)
                }
                .expect("dense");
                rows.push(bench_wide(name, m, 576, 1536, n));
            }
        }
    }
    if rows.is_empty() {
        return;
    }
    println!(
        "\nmatmul_wide_acc (f64 accumulation) vs matmul (f32), timed alternately; ratio = wide / \
         f32: median of per-round ratios (and ratio of each one's fastest sample)\n"
    );
    println!(
        "| weights | n | f32 hot | wide hot | ratio hot | f32 stream | wide stream | ratio stream |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let ms = |t: f64| format!("{:.3} ms", t * 1e3);
    let ratio = |p: &Pair| format!("{:.3} ({:.3})", p.ratio, p.ratio_best);
    for r in &rows {
        let (sf, sw, sr) = match &r.stream {
            Some(p) => (ms(p.f), ms(p.g), ratio(p)),
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r.name.trim_start_matches("wide "),
            r.n,
            ms(r.hot.f),
            ms(r.hot.g),
            ratio(&r.hot),
            sf,
            sw,
            sr
        );
    }
}

fn main() {
    // candle must run on one thread like our kernels: set before its first use.
    std::env::set_var("RAYON_NUM_THREADS", "1");
    std::env::set_var("CANDLE_NUM_THREADS", "1");
    let bw_start = read_bandwidth();

    let shapes = [
        (QuantType::Q4_1, 576, 576),
        (QuantType::Q4_1, 192, 576),
        (QuantType::Q4_1, 1536, 576),
        (QuantType::Q4_1, 576, 1536),
        (QuantType::Q8_0, 49152, 576),
        (QuantType::Q8_0, 1536, 576),
        (QuantType::Q4_0, 1536, 576),
        // Qwen2.5 shapes for the other formats (0.5B: hidden 896; 1.5B: hidden 1536, FFN 8960).
        (QuantType::Q5_0, 896, 896),
        (QuantType::Q5_1, 896, 896),
        (QuantType::Q2_K, 1536, 1536),
        (QuantType::Q3_K, 1536, 1536),
        (QuantType::Q4_K, 1536, 1536),
        (QuantType::Q4_K, 8960, 1536),
        (QuantType::Q5_K, 1536, 1536),
        (QuantType::Q6_K, 1536, 8960),
    ];
    // `TP_BENCH_ONLY=Q6_K` (any substring of the row names) runs a subset.
    let only = std::env::var("TP_BENCH_ONLY").unwrap_or_default();
    let want = |name: &str| name.contains(only.as_str());
    let mut rows = Vec::new();
    for n in [1usize, 128] {
        for &(q, r, c) in &shapes {
            if want(&format!("{} {r}x{c}", q.name())) {
                rows.push(bench_quant(q, r, c, n));
            }
        }
        for f16 in [false, true] {
            let name = format!("{} 576x1536", if f16 { "F16" } else { "F32" });
            if want(&name) {
                rows.push(bench_dense(f16, 576, 1536, n));
            }
        }
    }

    // The machine is shared: probe again at the end and keep the less disturbed figure.
    let bw_end = read_bandwidth();
    let bw = bw_start.max(bw_end);
    println!(
        "tp-kernels bench: simd = {}, single-thread read bandwidth = {bw:.1} GB/s \
         (start {bw_start:.1}, end {bw_end:.1}; sum of a 256 MiB f32 array)",
        simd_level()
    );
    // With `TP_BENCH_ONLY` selecting only the wide table, skip the empty main one.
    if !rows.is_empty() {
        println!(
            "GB/s = weight bytes per call / time (n = 1 only; at n = 128 weights are reused)\n"
        );
        println!(
            "| weights | n | ours hot | GMAC/s | stream | GMAC/s | GB/s (x read bw) | candle hot | candle stream | ours/candle |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|");
        let ms = |t: f64| format!("{:.3} ms", t * 1e3);
        for r in &rows {
            let stream = r.ours_stream.map_or("-".into(), ms);
            let stream_gmac = r
                .ours_stream
                .map_or("-".into(), |t| format!("{:.1}", r.macs / t / 1e9));
            let gbs = r.bytes / r.ours_stream.unwrap_or(r.ours_hot) / 1e9;
            let gbs = if r.n == 1 {
                format!("{gbs:.1} ({:.2})", gbs / bw)
            } else {
                "-".into()
            };
            let ch = r.candle_hot.map_or("-".into(), ms);
            let cs = r.candle_stream.map_or("-".into(), ms);
            let speedup = match (r.candle_stream, r.ours_stream, r.candle_hot) {
                (Some(c), Some(o), _) => format!("{:.1}x", c / o),
                (_, _, Some(c)) => format!("{:.1}x", c / r.ours_hot),
                _ => "-".into(),
            };
            println!(
                "| {} | {} | {} | {:.1} | {} | {} | {} | {} | {} | {} |",
                r.name,
                r.n,
                ms(r.ours_hot),
                r.macs / r.ours_hot / 1e9,
                stream,
                stream_gmac,
                gbs,
                ch,
                cs,
                speedup
            );
        }

        // Decode estimate: one SmolLM2-135M token = 30 layers x (q, k, v, o, gate, up, down) + LM head.
        let find = |name: &str| rows.iter().find(|r| r.n == 1 && r.name == name);
        let layer = [
            ("Q4_1 576x576", 2.0),
            ("Q4_1 192x576", 2.0),
            ("Q4_1 1536x576", 2.0),
            ("Q4_1 576x1536", 1.0),
        ];
        let mut ours = 0.0;
        let mut candle = 0.0;
        let mut macs = 0.0;
        for (name, count) in layer {
            if let Some(r) = find(name) {
                ours += 30.0 * count * r.ours_stream.unwrap_or(r.ours_hot);
                candle += 30.0 * count * r.candle_stream.or(r.candle_hot).unwrap_or(0.0);
                macs += 30.0 * count * r.macs;
            }
        }
        if let Some(head) = find("Q8_0 49152x576") {
            ours += head.ours_stream.unwrap_or(head.ours_hot);
            candle += head.candle_stream.or(head.candle_hot).unwrap_or(0.0);
            macs += head.macs;
        }
        println!(
            "\nSmolLM2-135M decode, matmuls only, weights streamed ({:.0} M MAC/token): ours {:.2} ms \
             ({:.0} tok/s, {:.1} GMAC/s), candle {:.2} ms ({:.0} tok/s)",
            macs / 1e6,
            ours * 1e3,
            1.0 / ours,
            macs / ours / 1e9,
            candle * 1e3,
            1.0 / candle
        );
    }

    wide_table(&want);
}
