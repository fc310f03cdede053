//! `matmul_wide_acc` through the public API on weights quantized by candle-core (the SmolLM2
//! row-parallel shapes, Qwen2.5-like shapes for the other formats): a tensor-parallel split
//! of the input columns, each rank's f64 part summed in rank order, rounds to the same f32
//! bits as the unsplit product, for 1 to 4 ranks and balanced or uneven splits.

mod common;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use common::{block_scaled_values, ggml_dtype};
use tp_kernels::{DenseMatrix, QuantMatrix, QuantType};

/// Row-major ggml bytes of a `[rows, cols]` matrix quantized by candle.
fn quantize(qtype: QuantType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let w = block_scaled_values(rows * cols, seed, 0.05, true);
    let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, ggml_dtype(qtype)).unwrap();
    q.data().unwrap().into_owned()
}

/// Block boundaries for 1 to 4 ranks: balanced (as tensor parallelism splits), one block
/// alone first or last, and a lopsided split.
fn splits(nb: usize) -> Vec<Vec<usize>> {
    let mut out = vec![vec![0, nb]];
    for parts in 2..=4usize.min(nb) {
        out.push((0..=parts).map(|p| p * nb / parts).collect());
        let mut first: Vec<usize> = (0..parts).collect();
        first.push(nb);
        out.push(first);
        let mut last = vec![0];
        last.extend((1..parts).map(|p| nb - parts + p));
        last.push(nb);
        out.push(last);
        let mut lopsided = vec![0];
        lopsided.extend((1..parts).map(|p| p * nb / (2 * parts)));
        lopsided.push(nb);
        out.push(lopsided);
    }
    out.retain(|c| c.windows(2).all(|w| w[0] < w[1]));
    out.sort();
    out.dedup();
    out
}

fn x_columns(x: &[f32], cols: usize, c0: usize, c1: usize) -> Vec<f32> {
    x.chunks_exact(cols)
        .flat_map(|t| &t[c0..c1])
        .copied()
        .collect()
}

/// Every split of `qtype [rows, cols]`, for each n: returns (outputs compared, outputs where
/// the f32 `matmul` summed over the same parts differs from the unsplit f32 `matmul`).
fn check_splits(qtype: QuantType, rows: usize, cols: usize, ns: &[usize]) -> (usize, usize) {
    let (bl, bb) = (qtype.block_len(), qtype.block_bytes());
    let nb = cols / bl;
    let bytes = quantize(qtype, rows, cols, (rows * 3 + cols) as u64);
    let full = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes.clone()).unwrap();
    let (mut compared, mut f32_differ) = (0, 0);
    for &n in ns {
        let x = block_scaled_values(n * cols, n as u64 * 17 + 1, 1.0, true);
        let mut want = vec![0.0f64; n * rows];
        full.matmul_wide_acc(&x, n, &mut want).unwrap();
        let mut want32 = vec![0.0f32; n * rows];
        full.matmul(&x, n, &mut want32).unwrap();
        for cuts in splits(nb) {
            let mut sum = vec![0.0f64; n * rows];
            let mut sum32 = vec![0.0f32; n * rows];
            for p in cuts.windows(2) {
                let (b0, b1) = (p[0], p[1]);
                let part: Vec<u8> = (0..rows)
                    .flat_map(|r| &bytes[(r * nb + b0) * bb..(r * nb + b1) * bb])
                    .copied()
                    .collect();
                let m = QuantMatrix::from_ggml_bytes(qtype, rows, (b1 - b0) * bl, part).unwrap();
                let xp = x_columns(&x, cols, b0 * bl, b1 * bl);
                let mut yp = vec![0.0f64; n * rows];
                m.matmul_wide_acc(&xp, n, &mut yp).unwrap();
                for (s, v) in sum.iter_mut().zip(&yp) {
                    *s += v;
                }
                let mut yp32 = vec![0.0f32; n * rows];
                m.matmul(&xp, n, &mut yp32).unwrap();
                for (s, v) in sum32.iter_mut().zip(&yp32) {
                    *s += v;
                }
            }
            for (i, (s, w)) in sum.iter().zip(&want).enumerate() {
                assert_eq!(
                    (*s as f32).to_bits(),
                    (*w as f32).to_bits(),
                    "{qtype} [{rows},{cols}] n={n} block cuts {cuts:?} output {i}: {s} vs {w}"
                );
            }
            if cuts.len() > 2 {
                compared += sum.len();
                f32_differ += sum32
                    .iter()
                    .zip(&want32)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
            }
        }
        // And the wide result is the f32 one up to f32 accumulation error.
        let mut deq = vec![0.0f32; cols];
        for r in 0..rows {
            full.dequantize_row(r, &mut deq).unwrap();
            for t in 0..n {
                let mag: f64 = x[t * cols..(t + 1) * cols]
                    .iter()
                    .zip(&deq)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                let tol = 4.0 * cols as f64 * f32::EPSILON as f64 * mag + 1e-6;
                let (a, b) = (want[t * rows + r], want32[t * rows + r] as f64);
                assert!(
                    (a - b).abs() <= tol,
                    "{qtype} t={t} r={r}: wide {a}, f32 {b}"
                );
            }
        }
    }
    (compared, f32_differ)
}

#[test]
fn smollm2_row_parallel_shapes_give_the_same_bits_at_every_split() {
    let mut report = Vec::new();
    for (qtype, rows, cols) in [
        (QuantType::Q4_1, 576, 576),  // attention output projection
        (QuantType::Q4_1, 576, 1536), // MLP down projection
        (QuantType::Q8_0, 576, 576),
        (QuantType::Q8_0, 576, 1536),
    ] {
        let (compared, differ) = check_splits(qtype, rows, cols, &[1, 2, 5, 128]);
        report.push(format!(
            "{qtype} {rows}x{cols}: wide identical at every split; f32 matmul differs from \
             unsplit in {differ} of {compared} split outputs"
        ));
    }
    println!("{}", report.join("\n"));
}

#[test]
fn other_formats_give_the_same_bits_at_every_split() {
    for (qtype, rows, cols) in [
        (QuantType::Q4_0, 40, 1536),
        (QuantType::Q5_0, 48, 896),
        (QuantType::Q4_K, 40, 1536),
        (QuantType::Q6_K, 40, 1536),
    ] {
        check_splits(qtype, rows, cols, &[1, 2, 5, 128]);
    }
}

/// Row-major ggml bytes of whole super-blocks `[b0, b1)` of each row.
fn super_blocks(
    qtype: QuantType,
    bytes: &[u8],
    rows: usize,
    nb: usize,
    b0: usize,
    b1: usize,
) -> Vec<u8> {
    let bb = qtype.block_bytes();
    (0..rows)
        .flat_map(|r| &bytes[(r * nb + b0) * bb..(r * nb + b1) * bb])
        .copied()
        .collect()
}

#[test]
fn k_quant_shards_that_cut_super_blocks_give_the_same_bits_at_every_head_split() {
    // Qwen2.5-1.5B's attention output projection: 1536 columns, 12 heads of 128; tp 4 gives
    // 384 columns a rank, uneven weights 160/96-column multiples of 32 too.
    let (rows, cols) = (48, 1536);
    let nb = cols / 256;
    let cut_sets: [&[usize]; 6] = [
        &[0, 1536],
        &[0, 768, 1536],
        &[0, 512, 1024, 1536],
        &[0, 384, 768, 1152, 1536],
        &[0, 640, 1536],
        &[0, 32, 1056, 1504, 1536],
    ];
    for qtype in [
        QuantType::Q4_K,
        QuantType::Q6_K,
        QuantType::Q5_K,
        QuantType::Q3_K,
        QuantType::Q2_K,
    ] {
        let bytes = quantize(qtype, rows, cols, 11);
        let full = QuantMatrix::from_ggml_sub_blocks(qtype, rows, 0, cols, bytes.clone()).unwrap();
        for n in [1usize, 3, 7] {
            let x = block_scaled_values(n * cols, n as u64 + 3, 1.0, true);
            let mut want = vec![0.0f64; n * rows];
            full.matmul_wide_acc(&x, n, &mut want).unwrap();
            for cuts in cut_sets {
                let mut sum = vec![0.0f64; n * rows];
                for w in cuts.windows(2) {
                    let (c0, c1) = (w[0], w[1]);
                    let part = super_blocks(qtype, &bytes, rows, nb, c0 / 256, c1.div_ceil(256));
                    let m = QuantMatrix::from_ggml_sub_blocks(qtype, rows, c0 % 256, c1 - c0, part)
                        .unwrap();
                    let mut yp = vec![0.0f64; n * rows];
                    m.matmul_wide_acc(&x_columns(&x, cols, c0, c1), n, &mut yp)
                        .unwrap();
                    for (s, p) in sum.iter_mut().zip(&yp) {
                        *s += p;
                    }
                }
                for (i, (s, w)) in sum.iter().zip(&want).enumerate() {
                    assert_eq!(
                        s.to_bits(),
                        w.to_bits(),
                        "{qtype} n={n} cuts {cuts:?} output {i}"
                    );
                }
            }
        }
    }
}

#[test]
fn wide_accumulates_into_y() {
    // `+=`: two matrices into one buffer equal the sum of their separate results.
    let (rows, cols, n) = (24, 576, 3);
    let a = QuantMatrix::from_ggml_bytes(
        QuantType::Q4_1,
        rows,
        cols,
        quantize(QuantType::Q4_1, rows, cols, 1),
    )
    .unwrap();
    let b = QuantMatrix::from_ggml_bytes(
        QuantType::Q8_0,
        rows,
        cols,
        quantize(QuantType::Q8_0, rows, cols, 2),
    )
    .unwrap();
    let x = block_scaled_values(n * cols, 3, 1.0, true);
    let mut both = vec![0.0f64; n * rows];
    a.matmul_wide_acc(&x, n, &mut both).unwrap();
    b.matmul_wide_acc(&x, n, &mut both).unwrap();
    let (mut ya, mut yb) = (vec![0.0f64; n * rows], vec![0.0f64; n * rows]);
    a.matmul_wide_acc(&x, n, &mut ya).unwrap();
    b.matmul_wide_acc(&x, n, &mut yb).unwrap();
    for ((s, p), q) in both.iter().zip(&ya).zip(&yb) {
        assert_eq!(s.to_bits(), (p + q).to_bits());
    }
}

#[test]
fn wide_rejects_wrong_lengths_and_handles_zero_sizes() {
    let m = QuantMatrix::from_ggml_bytes(QuantType::Q4_0, 2, 32, vec![0; 36]).unwrap();
    assert!(m.matmul_wide_acc(&[0.0; 31], 1, &mut [0.0; 2]).is_err());
    assert!(m.matmul_wide_acc(&[0.0; 32], 1, &mut [0.0; 3]).is_err());
    m.matmul_wide_acc(&[], 0, &mut []).unwrap();
    let empty = QuantMatrix::from_ggml_bytes(QuantType::Q6_K, 0, 256, vec![]).unwrap();
    empty.matmul_wide_acc(&[0.0; 256], 1, &mut []).unwrap();
    let d = DenseMatrix::from_f32(2, 3, vec![1.0; 6]).unwrap();
    assert!(d.matmul_wide_acc(&[0.0; 3], 1, &mut [0.0; 1]).is_err());
    let mut y = [1.5f64; 2];
    d.matmul_wide_acc(&[1.0, 2.0, 3.0], 1, &mut y).unwrap();
    assert_eq!(y, [7.5, 7.5]);
    let z = DenseMatrix::from_f32(2, 0, vec![]).unwrap();
    let mut y = [1.5f64; 2];
    z.matmul_wide_acc(&[], 1, &mut y).unwrap();
    assert_eq!(y, [1.5, 1.5]);
}
