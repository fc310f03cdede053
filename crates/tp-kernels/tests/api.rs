//! Public API behaviour that needs no oracle: typed errors on bad inputs, zero-size edge
//! cases, and the dense f32/f16 matrices against an f64 reference.

mod common;

use common::uniform_values;
use proptest::prelude::*;
use tp_kernels::{simd_level, DenseMatrix, KernelError, QuantMatrix, QuantType};

fn zeros_q(qtype: QuantType, rows: usize, cols: usize) -> QuantMatrix {
    let bytes = vec![0u8; rows * cols / qtype.block_len() * qtype.block_bytes()];
    QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes).unwrap()
}

#[test]
fn quant_type_constants() {
    use QuantType::*;
    let t = [
        Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
    ];
    assert_eq!(
        t.map(|q| q.block_len()),
        [32, 32, 32, 32, 32, 256, 256, 256, 256, 256, 32, 256]
    );
    assert_eq!(
        t.map(|q| q.block_bytes()),
        [18, 20, 34, 22, 24, 84, 110, 144, 176, 210, 18, 136]
    );
    assert_eq!(
        t.map(|q| q.name()),
        [
            "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
            "IQ4_NL", "IQ4_XS"
        ]
    );
    assert!(["avx512+vnni", "avx2+fma+vnni", "avx2+fma", "scalar"].contains(&simd_level()));
}

#[test]
fn from_ggml_bytes_rejects_bad_shapes_with_typed_errors() {
    let e = QuantMatrix::from_ggml_bytes(QuantType::Q4_1, 2, 48, vec![0; 60]).unwrap_err();
    assert!(
        matches!(e, KernelError::ColsNotBlockAligned { cols: 48, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("multiple of 32"), "{e}");
    let e = QuantMatrix::from_ggml_bytes(QuantType::Q8_0, 2, 64, vec![0; 135]).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::ByteLength {
                expected: 136,
                got: 135,
                ..
            }
        ),
        "{e}"
    );
    let e = QuantMatrix::from_ggml_bytes(QuantType::Q4_K, 1, 288, vec![0; 162]).unwrap_err();
    assert!(
        matches!(e, KernelError::ColsNotBlockAligned { block_len: 256, .. }),
        "{e}"
    );
    let e = QuantMatrix::from_ggml_bytes(QuantType::Q6_K, 2, 256, vec![0; 421]).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::ByteLength {
                expected: 420,
                got: 421,
                ..
            }
        ),
        "{e}"
    );
    let e = QuantMatrix::from_ggml_bytes(QuantType::Q4_0, usize::MAX, 64, vec![]).unwrap_err();
    assert!(matches!(e, KernelError::ShapeOverflow { .. }), "{e}");
}

#[test]
fn matmul_and_dequantize_reject_wrong_lengths() {
    let m = zeros_q(QuantType::Q4_1, 3, 64);
    let mut y = vec![0.0; 6];
    let e = m.matmul(&[0.0; 127], 2, &mut y).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::SliceLength {
                expected: 128,
                got: 127,
                ..
            }
        ),
        "{e}"
    );
    let e = m.matmul(&[0.0; 128], 2, &mut y[..5]).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::SliceLength {
                expected: 6,
                got: 5,
                ..
            }
        ),
        "{e}"
    );
    let e = m.matmul(&[0.0; 64], usize::MAX, &mut y).unwrap_err();
    assert!(matches!(e, KernelError::ShapeOverflow { .. }), "{e}");
    let mut out = vec![0.0; 64];
    let e = m.dequantize_row(3, &mut out).unwrap_err();
    assert_eq!(e, KernelError::RowOutOfRange { row: 3, rows: 3 });
    let e = m.dequantize_row(0, &mut out[..63]).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::SliceLength {
                expected: 64,
                got: 63,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn concat_rows_rejects_mismatches() {
    let e = QuantMatrix::concat_rows(vec![]).unwrap_err();
    assert_eq!(e, KernelError::EmptyConcat);
    let parts = vec![
        zeros_q(QuantType::Q4_1, 2, 64),
        zeros_q(QuantType::Q4_0, 2, 64),
    ];
    let e = QuantMatrix::concat_rows(parts).unwrap_err();
    assert!(
        matches!(e, KernelError::ConcatMismatch { index: 1, .. }),
        "{e}"
    );
    let parts = vec![
        zeros_q(QuantType::Q8_0, 2, 64),
        zeros_q(QuantType::Q8_0, 2, 32),
    ];
    assert!(QuantMatrix::concat_rows(parts).is_err());
    let d = vec![
        DenseMatrix::from_f32(1, 2, vec![1.0, 2.0]).unwrap(),
        DenseMatrix::from_f32_as_f16(1, 2, &[1.0, 2.0]).unwrap(),
    ];
    let e = DenseMatrix::concat_rows(d).unwrap_err();
    assert!(e.to_string().contains("f16"), "{e}");
    assert_eq!(
        DenseMatrix::concat_rows(vec![]).unwrap_err(),
        KernelError::EmptyConcat
    );
}

#[test]
fn zero_sized_calls_are_fine() {
    let m = zeros_q(QuantType::Q4_1, 4, 32);
    m.matmul(&[], 0, &mut []).unwrap();
    let empty = zeros_q(QuantType::Q8_0, 0, 64);
    empty.matmul(&[1.0; 128], 2, &mut []).unwrap();
    assert_eq!(empty.storage_bytes(), 0);
    let nocols = zeros_q(QuantType::Q4_0, 3, 0);
    let mut y = [f32::NAN; 3];
    nocols.matmul(&[], 1, &mut y).unwrap();
    assert_eq!(y, [0.0; 3]);
    for m in [
        DenseMatrix::from_f32(3, 0, vec![]).unwrap(),
        DenseMatrix::from_f32_as_f16(3, 0, &[]).unwrap(),
    ] {
        let mut y = [f32::NAN; 6];
        m.matmul(&[], 2, &mut y).unwrap();
        assert_eq!(y, [0.0; 6]);
    }
    DenseMatrix::from_f32(0, 4, vec![])
        .unwrap()
        .matmul(&[1.0; 8], 2, &mut [])
        .unwrap();
    let k = zeros_q(QuantType::Q6_K, 2, 0);
    k.matmul(&[], 1, &mut [f32::NAN; 2]).unwrap();
}

#[test]
fn storage_bytes_is_the_ggml_size_padded_to_8_rows() {
    assert_eq!(
        zeros_q(QuantType::Q4_1, 576, 576).storage_bytes(),
        576 * 18 * 20
    );
    assert_eq!(zeros_q(QuantType::Q8_0, 3, 64).storage_bytes(), 8 * 2 * 34);
    assert_eq!(
        zeros_q(QuantType::Q6_K, 8, 512).storage_bytes(),
        8 * 2 * 210
    );
    assert_eq!(
        zeros_q(QuantType::Q4_K, 8, 512).storage_bytes(),
        8 * 2 * 148
    );
    assert_eq!(
        DenseMatrix::from_f32(3, 5, vec![0.0; 15])
            .unwrap()
            .storage_bytes(),
        60
    );
    assert_eq!(
        DenseMatrix::from_f32_as_f16(3, 5, &[0.0; 15])
            .unwrap()
            .storage_bytes(),
        30
    );
}

#[test]
fn dense_constructors_and_calls_reject_wrong_lengths() {
    let e = DenseMatrix::from_f32(2, 3, vec![0.0; 5]).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::ValueCount {
                expected: 6,
                got: 5,
                ..
            }
        ),
        "{e}"
    );
    let e = DenseMatrix::from_f32_as_f16(2, 3, &[0.0; 7]).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::ValueCount {
                expected: 6,
                got: 7,
                ..
            }
        ),
        "{e}"
    );
    let m = DenseMatrix::from_f32(2, 3, vec![0.0; 6]).unwrap();
    assert!(m.matmul(&[0.0; 5], 2, &mut [0.0; 4]).is_err());
    assert!(m.matmul(&[0.0; 6], 2, &mut [0.0; 3]).is_err());
    assert!(m.dequantize_row(2, &mut [0.0; 3]).is_err());
    assert!(m.dequantize_row(1, &mut [0.0; 2]).is_err());
}

/// Dense matmul against an f64 reference: f32 accumulation of `cols` products errs by at most
/// about `cols * eps * sum |x w|` (a loose, always-valid bound).
fn check_dense(rows: usize, cols: usize, n: usize, seed: u64) {
    let w = uniform_values(rows * cols, seed);
    let x = uniform_values(n * cols, seed + 1);
    let f32m = DenseMatrix::from_f32(rows, cols, w.clone()).unwrap();
    let f16m = DenseMatrix::from_f32_as_f16(rows, cols, &w).unwrap();
    for (m, is_f16) in [(f32m, false), (f16m, true)] {
        let mut y = vec![f32::NAN; n * rows];
        m.matmul(&x, n, &mut y).unwrap();
        let mut wrow = vec![0.0; cols];
        for r in 0..rows {
            m.dequantize_row(r, &mut wrow).unwrap();
            let src = &w[r * cols..(r + 1) * cols];
            if is_f16 {
                for (a, &b) in wrow.iter().zip(src) {
                    assert_eq!(*a, half::f16::from_f32(b).to_f32());
                }
            } else {
                assert_eq!(&wrow[..], src);
            }
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                let exact: f64 = xt
                    .iter()
                    .zip(&wrow)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum();
                let mag: f64 = xt
                    .iter()
                    .zip(&wrow)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                let bound = (cols as f64 + 2.0) * f32::EPSILON as f64 * mag + 1e-12;
                let got = y[t * rows + r] as f64;
                assert!(
                    (got - exact).abs() <= bound,
                    "[{rows},{cols}] n={n} f16={is_f16} t={t} r={r}: {got} vs {exact}"
                );
            }
        }
    }
}

#[test]
fn dense_matmul_matches_f64_reference_on_odd_sizes() {
    for rows in [1usize, 3, 17, 50] {
        for cols in [1usize, 7, 32, 33, 2048] {
            for n in [1usize, 2, 5, 9] {
                check_dense(rows, cols, n, (rows * 100 + cols + n) as u64);
            }
        }
    }
}

#[test]
fn dense_concat_rows_stacks_rows() {
    let a = DenseMatrix::from_f32(1, 2, vec![1.0, 2.0]).unwrap();
    let b = DenseMatrix::from_f32(2, 2, vec![3.0, 4.0, 5.0, 6.0]).unwrap();
    let c = DenseMatrix::concat_rows(vec![a, b]).unwrap();
    assert_eq!((c.rows(), c.cols()), (3, 2));
    let mut y = [0.0; 3];
    c.matmul(&[1.0, 10.0], 1, &mut y).unwrap();
    assert_eq!(y, [21.0, 43.0, 65.0]);
    let h = DenseMatrix::concat_rows(vec![
        DenseMatrix::from_f32_as_f16(1, 2, &[1.0, 2.0]).unwrap(),
        DenseMatrix::from_f32_as_f16(1, 2, &[3.0, 4.0]).unwrap(),
    ])
    .unwrap();
    let mut y = [0.0; 2];
    h.matmul(&[1.0, 10.0], 1, &mut y).unwrap();
    assert_eq!(y, [21.0, 43.0]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn dense_random_shapes(rows in 1usize..30, cols in 1usize..300, n in 1usize..8, seed in any::<u64>()) {
        check_dense(rows, cols, n, seed);
    }
}
