//! Checks the quantized kernels against candle-core 0.11.1, an independent implementation of
//! the same ggml formats: exact dequantization, matmul against the f32 product within a
//! derived bound, and matmul against candle's own quantized matmul within a much tighter one;
//! `matmul_wide_acc` against llama.cpp's arithmetic written out in f64.

mod common;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use common::{block_scaled_values, ggml_dtype};
use proptest::prelude::*;
use tp_kernels::{QuantMatrix, QuantType};

const QTYPES: [QuantType; 10] = [
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q8_0,
    QuantType::Q5_0,
    QuantType::Q5_1,
    QuantType::Q2_K,
    QuantType::Q3_K,
    QuantType::Q4_K,
    QuantType::Q5_K,
    QuantType::Q6_K,
];

/// Keeps candle on its ggml-style kernels (Q8_0/Q8_1 activation blocks of 32). On AVX-512
/// VNNI machines candle 0.11.1 otherwise routes some Q8_0 shapes (rows % 16 == 0 and
/// cols % 256 == 0) through repacked kernels with 256-wide activation blocks, a different
/// rounding. Every test sets the same value before its first candle call.
fn pin_candle_kernels() {
    std::env::set_var("MISTRALRS_FORCE_AVX2", "1");
}

/// Weights quantized by candle: (raw ggml bytes, candle's dequantized f32 rows, QMatMul).
struct Oracle {
    bytes: Vec<u8>,
    deq: Vec<f32>,
    qmm: QMatMul,
}

fn oracle(qtype: QuantType, rows: usize, cols: usize, seed: u64) -> Oracle {
    pin_candle_kernels();
    let w = block_scaled_values(rows * cols, seed, 0.05, false);
    let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, ggml_dtype(qtype)).unwrap();
    let bytes = q.data().unwrap().into_owned();
    let deq = q
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let qmm = QMatMul::from_qtensor(q).unwrap();
    Oracle { bytes, deq, qmm }
}

fn candle_matmul(o: &Oracle, x: &[f32], n: usize, cols: usize) -> Vec<f32> {
    let xt = Tensor::from_vec(x.to_vec(), (n, cols), &Device::Cpu).unwrap();
    o.qmm
        .forward(&xt)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// Q4_1's or Q5_1's per-block minimum `m` of row `r`, block `b`, read from the ggml bytes.
fn block_min(qtype: QuantType, bytes: &[u8], cols: usize, r: usize, b: usize) -> f32 {
    if !matches!(qtype, QuantType::Q4_1 | QuantType::Q5_1) {
        return 0.0;
    }
    let at = (r * cols / 32 + b) * qtype.block_bytes() + 2;
    half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Error terms for output (token x, row w), summed over activation blocks `b` (32 wide; 256
/// for the K-quants), with `amax_b = max |x_i|` over the block and `d_b = amax_b / 127`:
/// - `act`: 8-bit activation rounding. `x̂_i = q_i * f16(d_b)` with `|q_i * d_b - x_i| <= d_b / 2`
///   and `|f16(d_b) - d_b| <= 2^-11 d_b`, `|q_i| <= 127`, so
///   `|x̂_i - x_i| <= amax_b (1/254 + 2^-11)`; times `sum_{i in b} |w_i|`. (Q8_K keeps `d`
///   in f32, so the f16 term is an overestimate there.)
/// - `smin` (Q4_1, Q5_1): the kernel multiplies `m_b` by `s_b = f16(d_b * sum q)` rather than by
///   `sum x̂_i = f16(d_b) * sum q`; the two differ by at most `2^-10 d_b |sum q|
///   <= 2^-10 sum_{i in b} (|x_i| + d_b / 2)`; times `|m_b|`.
/// - `mag`: `sum |x_i w_i|`, for f32 accumulation error (relative eps per addition).
struct Terms {
    act: f64,
    smin: f64,
    mag: f64,
}

fn terms(qtype: QuantType, bytes: &[u8], x: &[f32], w: &[f32], r: usize) -> Terms {
    let cols = x.len();
    let mut t = Terms {
        act: 0.0,
        smin: 0.0,
        mag: 0.0,
    };
    let bl = if qtype.block_len() == 256 { 256 } else { 32 };
    for b in 0..cols / bl {
        let xs = &x[b * bl..(b + 1) * bl];
        let ws = &w[b * bl..(b + 1) * bl];
        let amax = xs.iter().fold(0.0f64, |a, &v| a.max(v.abs() as f64));
        let d = amax / 127.0;
        let sum_w: f64 = ws.iter().map(|&v| v.abs() as f64).sum();
        let sum_x: f64 = xs.iter().map(|&v| v.abs() as f64 + d / 2.0).sum();
        t.act += amax * (1.0 / 254.0 + 1.0 / 2048.0) * sum_w;
        t.smin += block_min(qtype, bytes, cols, r, b).abs() as f64 * sum_x / 1024.0;
        t.mag += xs
            .iter()
            .zip(ws)
            .map(|(&a, &c)| (a as f64 * c as f64).abs())
            .sum::<f64>();
    }
    t
}

/// llama.cpp's arithmetic written out from the format spec, in f64: x quantized per block
/// (`d = amax / 127`, `q = round(x * (1 / d))` half away from zero, `f16(d)`, and for Q4_1
/// and Q5_1 `s = f16(d * sum q)`), then `sum_b f16(d_w) f16(d_x) sum_i q_w q_x (+ m_b s_b)`
/// with the weight quants decoded from the raw ggml bytes (Q4_0 as `q - 8`, Q5_0 as
/// `q - 16`).
/// K-quants: x quantized per 256 as Q8_K (`iscale = -127 / max`, ties to even, `d = 1 /
/// iscale` in f32), then `sum_i w_i x̂_i` with candle's dequantized `w` (exact products of
/// the integer scales and quants).
fn llama_reference(qtype: QuantType, bytes: &[u8], x: &[f32], w: &[f32], r: usize) -> f64 {
    let cols = x.len();
    if qtype.block_len() == 256 {
        let mut y = 0.0f64;
        for (xs, ws) in x.chunks_exact(256).zip(w.chunks_exact(256)) {
            let max = xs
                .iter()
                .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            if max == 0.0 {
                continue;
            }
            let iscale = -127.0 / max;
            let d = 1.0 / iscale;
            for (&xv, &wv) in xs.iter().zip(ws) {
                let q = (iscale * xv).round_ties_even().clamp(-128.0, 127.0);
                y += q as f64 * d as f64 * wv as f64;
            }
        }
        return y;
    }
    let bb = qtype.block_bytes();
    let f16 = |at: usize| half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32() as f64;
    let mut y = 0.0f64;
    for b in 0..cols / 32 {
        let xs = &x[b * 32..b * 32 + 32];
        let amax = xs.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let qx: Vec<i64> = xs.iter().map(|&v| (v * id).round() as i64).collect();
        let dx = half::f16::from_f32(d).to_f32() as f64;
        let sx = half::f16::from_f32(qx.iter().sum::<i64>() as f32 * d).to_f32() as f64;
        let at = (r * cols / 32 + b) * bb;
        let qw: Vec<i64> = match qtype {
            QuantType::Q8_0 => bytes[at + 2..at + 34]
                .iter()
                .map(|&v| v as i8 as i64)
                .collect(),
            QuantType::Q5_0 | QuantType::Q5_1 => {
                // Q5_1 has `m` before `qh` and no offset.
                let (o, off) = if qtype == QuantType::Q5_1 {
                    (at + 2, 0)
                } else {
                    (at, 16)
                };
                let qh =
                    u32::from_le_bytes([bytes[o + 2], bytes[o + 3], bytes[o + 4], bytes[o + 5]]);
                (0..32)
                    .map(|e| {
                        let byte = bytes[o + 6 + e % 16];
                        let nib = if e < 16 { byte & 15 } else { byte >> 4 };
                        (nib as i64 | (((qh >> e) & 1) as i64) << 4) - off
                    })
                    .collect()
            }
            _ => {
                let qs = &bytes[at + qtype.block_bytes() - 16..at + qtype.block_bytes()];
                let off = if qtype == QuantType::Q4_0 { 8 } else { 0 };
                let lo = qs.iter().map(|&v| (v & 15) as i64 - off);
                lo.chain(qs.iter().map(|&v| (v >> 4) as i64 - off))
                    .collect()
            }
        };
        let isum: i64 = qw.iter().zip(&qx).map(|(a, b)| a * b).sum();
        y += f16(at) * dx * isum as f64;
        if matches!(qtype, QuantType::Q4_1 | QuantType::Q5_1) {
            y += f16(at + 2) * sx;
        }
    }
    y
}

/// What candle's Q8_K activations may add to the product: candle rounds `iscale * x` half
/// away from zero where ggml (and we) round ties to even, so at an exact tie the quants differ
/// by one step `1 / |iscale|`, moving the product by `|w| / |iscale|` (0 for the 32-wide
/// formats, whose activations both round alike).
fn q8k_ties(qtype: QuantType, x: &[f32], w: &[f32]) -> f64 {
    if qtype.block_len() != 256 {
        return 0.0;
    }
    let mut extra = 0.0;
    for (xb, wb) in x.chunks(256).zip(w.chunks(256)) {
        let (mut max, mut amax) = (0.0f32, 0.0f32);
        for &v in xb {
            if v.abs() > amax {
                (amax, max) = (v.abs(), v);
            }
        }
        if amax == 0.0 {
            continue;
        }
        let iscale = -127.0 / max;
        for (&v, &wv) in xb.iter().zip(wb) {
            if (iscale * v).abs().fract() == 0.5 {
                extra += (wv as f64).abs() / (iscale as f64).abs();
            }
        }
    }
    extra
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Runs one shape through every check; returns the largest error relative to `sum |x w|`
/// seen against the f32 product, candle's quantized matmul and llama.cpp's arithmetic, and
/// of `matmul_wide_acc` against llama.cpp's arithmetic.
fn check_shape(qtype: QuantType, rows: usize, cols: usize, n: usize, seed: u64) -> [f64; 4] {
    let o = oracle(qtype, rows, cols, seed);
    let m = QuantMatrix::from_ggml_bytes(qtype, rows, cols, o.bytes.clone()).unwrap();
    let x = block_scaled_values(n * cols, seed ^ 0xABCD, 1.0, false);
    let mut y = vec![f32::NAN; n * rows];
    m.matmul(&x, n, &mut y).unwrap();
    let mut yw = vec![0.0f64; n * rows];
    m.matmul_wide_acc(&x, n, &mut yw).unwrap();
    let yc = candle_matmul(&o, &x, n, cols);
    let eps = f32::EPSILON as f64;
    let (mut worst_f32, mut worst_candle, mut worst_llama) = (0.0f64, 0.0f64, 0.0f64);
    let mut worst_wide = 0.0f64;
    for t in 0..n {
        let xt = &x[t * cols..(t + 1) * cols];
        for r in 0..rows {
            let wr = &o.deq[r * cols..(r + 1) * cols];
            let got = y[t * rows + r] as f64;
            let exact = dot64(xt, wr);
            let k = terms(qtype, &o.bytes, xt, wr, r);
            let accum = 4.0 * (cols as f64) * eps * k.mag;
            let bound = k.act + k.smin + accum + 1e-6;
            let err = (got - exact).abs();
            assert!(
                err <= bound,
                "{qtype} [{rows},{cols}] n={n} t={t} r={r}: got {got}, f32 product {exact}, \
                 |err| {err:e} > derived bound {bound:e}"
            );
            // The rule of thumb from the brief holds as well on this data (32-wide activation
            // blocks; Q8_K's 256-wide blocks are coarser where magnitudes vary within them).
            if qtype.block_len() == 32 {
                assert!(
                    err <= 0.01 * k.mag + 1e-5,
                    "{qtype} t={t} r={r}: {err:e} vs {:e}",
                    k.mag
                );
            }
            worst_f32 = worst_f32.max(err / k.mag.max(1e-30));

            // candle quantizes x to the same 8-bit blocks: identical integer sums, so only the
            // f32 accumulation order and (Q4_1, Q5_1) candle's `s = f16(sum q) * f16(d)` rounding differ.
            let c = yc[t * rows + r] as f64;
            let tight = 1e-5 * k.mag + 2.0 * k.smin + 1e-7 + q8k_ties(qtype, xt, wr);
            let diff = (got - c).abs();
            assert!(
                diff <= tight,
                "{qtype} [{rows},{cols}] n={n} t={t} r={r}: ours {got}, candle QMatMul {c}, \
                 |diff| {diff:e} > {tight:e}"
            );
            worst_candle = worst_candle.max(diff / k.mag.max(1e-30));

            // llama.cpp's own arithmetic: only f32 accumulation error remains.
            let l = llama_reference(qtype, &o.bytes, xt, wr, r);
            let diff = (got - l).abs();
            assert!(
                diff <= accum + 1e-7,
                "{qtype} [{rows},{cols}] n={n} t={t} r={r}: ours {got}, llama.cpp arithmetic {l}"
            );
            worst_llama = worst_llama.max(diff / k.mag.max(1e-30));

            // The wide variant: same integer sums, f32 rounding per block only.
            let wide = yw[t * rows + r];
            let diff = (wide - l).abs();
            assert!(
                diff <= accum + 1e-7,
                "{qtype} [{rows},{cols}] n={n} t={t} r={r}: wide {wide}, llama.cpp arithmetic {l}"
            );
            worst_wide = worst_wide.max(diff / k.mag.max(1e-30));
        }
    }
    [worst_f32, worst_candle, worst_llama, worst_wide]
}

#[test]
fn dequantize_row_equals_candle_dequantize_exactly() {
    for qtype in QTYPES {
        let shapes = if qtype.block_len() == 256 {
            [(1, 256), (3, 512), (17, 2048), (9, 1536)]
        } else {
            [(1, 32), (3, 64), (17, 2048), (9, 576)]
        };
        for (rows, cols) in shapes {
            let o = oracle(qtype, rows, cols, (rows * cols) as u64);
            let m = QuantMatrix::from_ggml_bytes(qtype, rows, cols, o.bytes.clone()).unwrap();
            let mut out = vec![f32::NAN; cols];
            for r in 0..rows {
                m.dequantize_row(r, &mut out).unwrap();
                let want = &o.deq[r * cols..(r + 1) * cols];
                for (i, (a, b)) in out.iter().zip(want).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{qtype} row {r} col {i}: {a} vs {b}"
                    );
                }
            }
            assert_eq!(
                m.to_ggml_bytes(),
                o.bytes,
                "{qtype} round trip of the ggml bytes"
            );
        }
    }
}

#[test]
fn matmul_matches_f32_product_and_candle_qmatmul_on_odd_sizes() {
    let mut report = Vec::new();
    for qtype in QTYPES {
        let mut worst = [0.0f64; 4];
        for rows in [1usize, 3, 17] {
            for cols in [qtype.block_len(), 2048] {
                for n in [1usize, 2, 5] {
                    let seed = (rows * 7919 + cols * 31 + n) as u64;
                    let w = check_shape(qtype, rows, cols, n, seed);
                    for (a, b) in worst.iter_mut().zip(w) {
                        *a = a.max(b);
                    }
                }
            }
        }
        let [f, c, l, w] = worst;
        report.push(format!(
            "{qtype}: max |err| / sum|x w|: vs f32 product {f:.2e}, vs candle QMatMul {c:.2e}, \
             vs llama.cpp arithmetic {l:.2e}; wide vs llama.cpp arithmetic {w:.2e}"
        ));
    }
    println!("{}", report.join("\n"));
}

#[test]
fn matmul_matches_on_smollm2_shapes_with_prefill_batches() {
    // The attention and MLP shapes of SmolLM2-135M, batched like a short prefill.
    for (qtype, rows, cols, n) in [
        (QuantType::Q4_1, 192, 576, 7),
        (QuantType::Q4_1, 576, 1536, 4),
        (QuantType::Q8_0, 64, 576, 9),
        (QuantType::Q4_0, 40, 1536, 6),
        // Qwen2.5-0.5B-like shapes for the other formats.
        (QuantType::Q5_0, 128, 896, 5),
        (QuantType::Q5_1, 128, 896, 5),
        (QuantType::Q2_K, 64, 1536, 5),
        (QuantType::Q3_K, 64, 1536, 5),
        (QuantType::Q4_K, 64, 1536, 5),
        (QuantType::Q5_K, 64, 1536, 5),
        (QuantType::Q6_K, 48, 1536, 6),
    ] {
        check_shape(qtype, rows, cols, n, (rows + cols + n) as u64);
    }
}

#[test]
fn concat_rows_equals_the_parts_side_by_side() {
    for qtype in QTYPES {
        let cols = 2 * qtype.block_len();
        let parts: Vec<Oracle> = [5usize, 16, 3]
            .iter()
            .enumerate()
            .map(|(i, &r)| oracle(qtype, r, cols, 100 + i as u64))
            .collect();
        let mats: Vec<QuantMatrix> = parts
            .iter()
            .zip([5usize, 16, 3])
            .map(|(o, r)| QuantMatrix::from_ggml_bytes(qtype, r, cols, o.bytes.clone()).unwrap())
            .collect();
        let fused = QuantMatrix::concat_rows(mats.clone()).unwrap();
        assert_eq!(
            (fused.rows(), fused.cols(), fused.qtype()),
            (24, cols, qtype)
        );
        let n = 3;
        let x = block_scaled_values(n * cols, 5, 1.0, false);
        let mut y = vec![0.0; n * 24];
        fused.matmul(&x, n, &mut y).unwrap();
        let mut row0 = 0;
        for m in &mats {
            let mut yp = vec![0.0; n * m.rows()];
            m.matmul(&x, n, &mut yp).unwrap();
            for t in 0..n {
                assert_eq!(
                    &y[t * 24 + row0..t * 24 + row0 + m.rows()],
                    &yp[t * m.rows()..(t + 1) * m.rows()]
                );
            }
            row0 += m.rows();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random shapes and seeds: every check of `check_shape` holds.
    #[test]
    fn random_shapes_stay_within_the_derived_bounds(
        q in 0usize..QTYPES.len(),
        rows in 1usize..40,
        blocks in 1usize..24,
        n in 1usize..7,
        seed in any::<u64>(),
    ) {
        let qtype = QTYPES[q];
        let blocks = if qtype.block_len() == 256 { blocks.div_ceil(6) } else { blocks };
        check_shape(qtype, rows, blocks * qtype.block_len(), n, seed);
    }
}
