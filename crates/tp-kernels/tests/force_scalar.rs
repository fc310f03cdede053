//! `force_scalar` switches the whole process to the portable kernels and back. Its own test
//! binary: the switch is process-wide, so it must not race other tests' kernel calls.

use tp_kernels::{force_scalar, simd_level, DenseMatrix, QuantMatrix, QuantType};

fn bytes(qtype: QuantType, rows: usize, cols: usize) -> Vec<u8> {
    let len = rows * cols / qtype.block_len() * qtype.block_bytes();
    let mut rng = tp_testkit::Rng::new(0x1234_5678);
    let mut out: Vec<u8> = (0..len).map(|_| (rng.next_u64() >> 56) as u8).collect();
    // Sane f16 scales (0x2000 ~ 0.0078) at the start of each 32-block.
    for b in out.chunks_exact_mut(qtype.block_bytes()) {
        b[..2].copy_from_slice(&[0x00, 0x20]);
        if qtype == QuantType::Q4_1 {
            b[2..4].copy_from_slice(&[0x00, 0xA0]);
        }
    }
    out
}

#[test]
fn force_scalar_switches_the_kernels_and_wide_results_keep_their_bits() {
    let hardware = simd_level();
    let (rows, cols, n) = (17, 576, 5);
    let x: Vec<f32> = (0..n * cols)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let dw: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 13) % 97) as f32 / 97.0 - 0.5)
        .collect();
    let dense = DenseMatrix::from_f32_as_f16(rows, cols, &dw).unwrap();
    let mut runs: Vec<Vec<f64>> = Vec::new();
    for scalar in [false, true] {
        force_scalar(scalar);
        assert_eq!(simd_level(), if scalar { "scalar" } else { hardware });
        let mut y = Vec::new();
        for qtype in [QuantType::Q4_1, QuantType::Q8_0, QuantType::Q5_0] {
            let m = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes(qtype, rows, cols));
            let mut yq = vec![0.0f64; n * rows];
            m.unwrap().matmul_wide_acc(&x, n, &mut yq).unwrap();
            y.extend(yq);
        }
        // The K-quants' sub-block form: columns 96..480 of two super-blocks.
        for qtype in [QuantType::Q4_K, QuantType::Q6_K] {
            let mut b = bytes(qtype, rows, 512);
            for blk in b.chunks_exact_mut(qtype.block_bytes()) {
                let at = if qtype == QuantType::Q6_K { 208 } else { 0 };
                blk[at..at + 2].copy_from_slice(&[0x00, 0x20]);
            }
            let m = QuantMatrix::from_ggml_sub_blocks(qtype, rows, 96, 384, b).unwrap();
            let xs: Vec<f32> = x
                .chunks_exact(cols)
                .flat_map(|t| &t[..384])
                .copied()
                .collect();
            let mut yq = vec![0.0f64; n * rows];
            m.matmul_wide_acc(&xs, n, &mut yq).unwrap();
            y.extend(yq);
        }
        let mut yd = vec![0.0f64; n * rows];
        dense.matmul_wide_acc(&x, n, &mut yd).unwrap();
        y.extend(yd);
        runs.push(y);
    }
    force_scalar(false);
    assert_eq!(simd_level(), hardware);
    let bits = |v: &[f64]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&runs[0]), bits(&runs[1]));
}
