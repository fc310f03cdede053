//! IQ4_NL and IQ4_XS against a reference written in the tests from the format definition
//! (candle 0.11.1 has no IQ4 types): exact dequantization and ggml round trips, then
//! `matmul` and `matmul_wide_acc` against f64 dot products of the reference-dequantized
//! weights with the activations as the kernels quantize them (Q8_0 per 32 for IQ4_NL, Q8_K
//! per 256 for IQ4_XS), within the f32 accumulation bound, and against the unquantized
//! activations within the activation-rounding bound.

mod common;

use common::{block_scaled_values, dequantize_iq4, quantize_iq4};
use tp_kernels::{KernelError, QuantMatrix, QuantType};

const QTYPES: [QuantType; 2] = [QuantType::IQ4_NL, QuantType::IQ4_XS];

fn weights(qtype: QuantType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    quantize_iq4(qtype, &block_scaled_values(rows * cols, seed, 0.05, false))
}

/// The activations the kernels multiply by, in f64: IQ4_NL takes Q8_0 blocks (`d = amax /
/// 127`, `q = round(x * (1 / d))` half away from zero, `f16(d)`), IQ4_XS Q8_K blocks
/// (`iscale = -127 / max`, ties to even, `d = 1 / iscale` in f32).
fn quantized_x(qtype: QuantType, x: &[f32]) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    if qtype.block_len() == 32 {
        for xs in x.chunks_exact(32) {
            let amax = xs.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let dh = half::f16::from_f32(d).to_f32() as f64;
            out.extend(xs.iter().map(|&v| (v * id).round() as f64 * dh));
        }
    } else {
        for xs in x.chunks_exact(256) {
            let max = xs
                .iter()
                .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            if max == 0.0 {
                out.extend(std::iter::repeat_n(0.0, 256));
                continue;
            }
            let iscale = -127.0 / max;
            let d = (1.0 / iscale) as f64;
            out.extend(
                xs.iter()
                    .map(|&v| (iscale * v).round_ties_even().clamp(-128.0, 127.0) as f64 * d),
            );
        }
    }
    out
}

/// Checks one shape; returns the largest error relative to `sum |w x|` against the
/// quantized-activation reference (`matmul`, `matmul_wide_acc`) and the f32 product.
fn check_shape(qtype: QuantType, rows: usize, cols: usize, n: usize, seed: u64) -> [f64; 3] {
    let bytes = weights(qtype, rows, cols, seed);
    let deq = dequantize_iq4(qtype, &bytes);
    let m = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes).unwrap();
    let x = block_scaled_values(n * cols, seed ^ 0xABCD, 1.0, false);
    let mut y = vec![f32::NAN; n * rows];
    m.matmul(&x, n, &mut y).unwrap();
    let mut yw = vec![0.0f64; n * rows];
    m.matmul_wide_acc(&x, n, &mut yw).unwrap();
    let eps = f32::EPSILON as f64;
    let bl = qtype.block_len();
    let mut worst = [0.0f64; 3];
    for t in 0..n {
        let xt = &x[t * cols..(t + 1) * cols];
        let xq = quantized_x(qtype, xt);
        for r in 0..rows {
            let w = &deq[r * cols..(r + 1) * cols];
            let reference: f64 = w.iter().zip(&xq).map(|(&a, &b)| a as f64 * b).sum();
            let mag: f64 = w.iter().zip(&xq).map(|(&a, &b)| (a as f64 * b).abs()).sum();
            // Every product is exact in f64 (weights have at most 24 significant bits, the
            // activation quants 8); only the kernels' f32 rounding of per-block values and
            // their f32 (or f64) accumulation remain.
            let accum = 4.0 * cols as f64 * eps * mag + 1e-7;
            let got = y[t * rows + r] as f64;
            let err = (got - reference).abs();
            assert!(
                err <= accum,
                "{qtype} [{rows},{cols}] n={n} t={t} r={r}: matmul {got}, reference {reference}, \
                 |err| {err:e} > {accum:e}"
            );
            let wide = yw[t * rows + r];
            let werr = (wide - reference).abs();
            assert!(
                werr <= accum,
                "{qtype} [{rows},{cols}] n={n} t={t} r={r}: wide {wide}, reference {reference}"
            );
            // Against the unquantized activations: each activation is off by at most half a
            // step (amax / 254) plus f16's rounding of the step (IQ4_NL's Q8_0).
            let (mut exact, mut act, mut mag_x) = (0.0f64, 0.0f64, 0.0f64);
            for (ws, xs) in w.chunks_exact(bl).zip(xt.chunks_exact(bl)) {
                let amax = xs.iter().fold(0.0f64, |a, &v| a.max(v.abs() as f64));
                let sum_w: f64 = ws.iter().map(|&v| v.abs() as f64).sum();
                act += amax * (1.0 / 254.0 + 1.0 / 2048.0) * sum_w;
                for (&a, &b) in ws.iter().zip(xs) {
                    exact += a as f64 * b as f64;
                    mag_x += (a as f64 * b as f64).abs();
                }
            }
            let bound = act + accum;
            let ferr = (got - exact).abs();
            assert!(
                ferr <= bound,
                "{qtype} [{rows},{cols}] n={n} t={t} r={r}: matmul {got}, f32 product {exact}, \
                 |err| {ferr:e} > {bound:e}"
            );
            let m = mag.max(1e-30);
            worst[0] = worst[0].max(err / m);
            worst[1] = worst[1].max(werr / m);
            worst[2] = worst[2].max(ferr / mag_x.max(1e-30));
        }
    }
    worst
}

#[test]
fn dequantize_row_equals_the_reference_dequantization_exactly() {
    for qtype in QTYPES {
        let bl = qtype.block_len();
        for (rows, cols) in [(1, bl), (3, 2 * bl), (17, 8 * bl), (9, 2304)] {
            let bytes = weights(qtype, rows, cols, (rows * cols) as u64);
            let want = dequantize_iq4(qtype, &bytes);
            let m = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes.clone()).unwrap();
            let mut out = vec![f32::NAN; cols];
            for r in 0..rows {
                m.dequantize_row(r, &mut out).unwrap();
                for (i, (a, b)) in out.iter().zip(&want[r * cols..]).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{qtype} row {r} col {i}: {a} vs {b}"
                    );
                }
            }
            assert_eq!(
                m.to_ggml_bytes(),
                bytes,
                "{qtype} round trip of the ggml bytes"
            );
        }
    }
}

#[test]
fn the_reference_quantizer_stays_close_to_its_input() {
    // Sanity of the test's own quantizer: IQ4's largest step is 24 table units of 127, so
    // every weight is within 12/127 of its block's (sub-block's) largest magnitude, plus
    // IQ4_XS's 6-bit scale rounding.
    for qtype in QTYPES {
        let w = block_scaled_values(64 * 256, 9, 0.05, false);
        let deq = dequantize_iq4(qtype, &quantize_iq4(qtype, &w));
        for (ws, ds) in w.chunks_exact(32).zip(deq.chunks_exact(32)) {
            let amax = ws.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            for (a, b) in ws.iter().zip(ds) {
                assert!((a - b).abs() <= amax * 0.2 + 1e-6, "{qtype}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn matmul_matches_the_reference_on_odd_sizes() {
    let mut report = Vec::new();
    for qtype in QTYPES {
        let mut worst = [0.0f64; 3];
        for rows in [1usize, 3, 17, 40] {
            for cols in [qtype.block_len(), 2304] {
                for n in [1usize, 2, 5, 9] {
                    let seed = (rows * 7919 + cols * 31 + n) as u64;
                    let w = check_shape(qtype, rows, cols, n, seed);
                    for (a, b) in worst.iter_mut().zip(w) {
                        *a = a.max(b);
                    }
                }
            }
        }
        let [q, w, f] = worst;
        report.push(format!(
            "{qtype}: max |err| / sum|w x|: matmul vs quantized-x reference {q:.2e}, wide {w:.2e}, \
             matmul vs f32 product {f:.2e}"
        ));
    }
    println!("{}", report.join("\n"));
}

#[test]
fn matmul_matches_the_reference_on_model_shapes() {
    for (qtype, rows, cols, n) in [
        (QuantType::IQ4_NL, 192, 576, 7),
        (QuantType::IQ4_NL, 64, 1536, 4),
        (QuantType::IQ4_XS, 64, 1536, 5),
        (QuantType::IQ4_XS, 48, 2048, 3),
    ] {
        check_shape(qtype, rows, cols, n, (rows + cols + n) as u64);
    }
}

#[test]
fn bad_iq4_shapes_are_typed_errors() {
    let e = QuantMatrix::from_ggml_bytes(QuantType::IQ4_XS, 2, 288, vec![0; 2 * 136]).unwrap_err();
    assert!(
        matches!(e, KernelError::ColsNotBlockAligned { block_len: 256, .. }),
        "{e}"
    );
    let e = QuantMatrix::from_ggml_bytes(QuantType::IQ4_NL, 2, 64, vec![0; 71]).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::ByteLength {
                expected: 72,
                got: 71,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("IQ4_NL"), "{e}");
}
