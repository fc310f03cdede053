//! `TP_KERNEL` picks the kernel path once per process. Its own test binary: the choice is
//! made at the first kernel call and kept, so no other test may run before it.

use tp_kernels::{kernel_path, kernel_report, simd_level, QuantMatrix, QuantType};

#[test]
fn tp_kernel_scalar_is_honoured_and_reported() {
    // Edition 2021: `set_var` is safe; this binary runs this one test, before any kernel call.
    std::env::set_var("TP_KERNEL", "scalar");
    assert_eq!(kernel_path(), "scalar");
    assert_eq!(simd_level(), "scalar");
    let report = kernel_report();
    assert!(
        report.contains("kernels scalar (TP_KERNEL; cpu up to "),
        "{report}"
    );
    // A product still runs (on the portable kernels) and the choice stays.
    let m = QuantMatrix::from_ggml_bytes(QuantType::Q8_0, 8, 32, vec![0u8; 8 * 34]).unwrap();
    let mut y = vec![1.0f32; 8];
    m.matmul(&[0.5; 32], 1, &mut y).unwrap();
    assert_eq!(y, vec![0.0; 8]);
    std::env::set_var("TP_KERNEL", "avx2");
    assert_eq!(kernel_path(), "scalar");
}
