//! `force_kernel` runs a named kernel path (any AVX2 variant included) whatever the process
//! default, and refuses names that are unknown or that the CPU cannot run. Its own test
//! binary: the switch is process-wide, so it must not race other tests' kernel calls.

use tp_kernels::{force_kernel, kernel_path, KernelError, QuantMatrix, QuantType};

/// Q8_0 and Q4_K / Q6_K products of 9 tokens (the many-token kernels), f32 and wide, as bits.
fn products() -> Vec<u64> {
    let mut rng = tp_testkit::Rng::new(0x5EED_0037);
    let (rows, cols, n) = (17, 512, 9);
    let x = rng.uniform_vec(n * cols, -1.5, 1.5);
    let mut out = Vec::new();
    for qtype in [QuantType::Q8_0, QuantType::Q4_K, QuantType::Q6_K] {
        let len = rows * cols / qtype.block_len() * qtype.block_bytes();
        let mut b: Vec<u8> = (0..len).map(|_| (rng.next_u64() >> 56) as u8).collect();
        // Sane f16 scales (0x2000 ~ 0.0078) where each format keeps them.
        let at = match qtype {
            QuantType::Q6_K => 208,
            _ => 0,
        };
        for blk in b.chunks_exact_mut(qtype.block_bytes()) {
            blk[at..at + 2].copy_from_slice(&[0x00, 0x20]);
            if qtype == QuantType::Q4_K {
                blk[2..4].copy_from_slice(&[0x00, 0x20]);
            }
        }
        let m = QuantMatrix::from_ggml_bytes(qtype, rows, cols, b).unwrap();
        let mut y = vec![0.0f32; n * rows];
        m.matmul(&x, n, &mut y).unwrap();
        out.extend(y.iter().map(|v| v.to_bits() as u64));
        let mut yw = vec![0.0f64; n * rows];
        m.matmul_wide_acc(&x, n, &mut yw).unwrap();
        out.extend(yw.iter().map(|v| v.to_bits()));
    }
    out
}

#[test]
fn force_kernel_runs_each_named_path_with_the_same_bits_and_refuses_bad_names() {
    let default = kernel_path();
    force_kernel(Some("scalar")).unwrap();
    assert_eq!(kernel_path(), "scalar");
    let scalar = products();
    let mut ran = vec![];
    for name in ["avx2-novnni", "avx2+vnni", "avx2", "avx512"] {
        match force_kernel(Some(name)) {
            Ok(()) => {
                let path = kernel_path();
                let want: &[&str] = match name {
                    "avx2-novnni" => &["avx2"],
                    "avx2" => &["avx2+vnni", "avx2"],
                    other => &[other],
                };
                assert!(want.contains(&path), "{name} ran {path}");
                assert!(products() == scalar, "{name} ({path}): not the scalar bits");
                ran.push(path);
            }
            Err(e) => {
                assert!(matches!(e, KernelError::KernelPath { .. }), "{e}");
                eprintln!("skipped {name}: {e}");
            }
        }
    }
    eprintln!("ran {ran:?} against scalar");
    // Bad names change nothing.
    force_kernel(Some("scalar")).unwrap();
    let e = force_kernel(Some("avx9000")).unwrap_err();
    assert!(e.to_string().contains("not one of"), "{e}");
    assert_eq!(kernel_path(), "scalar");
    force_kernel(None).unwrap();
    assert_eq!(kernel_path(), default);
}
