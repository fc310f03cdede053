//! [`exp_det`] against f64 and its vector forms against it, bit for bit.

use super::*;
use crate::testutil::{rng, same_bits};

/// Units in the last place between `got` and the exact `want`.
fn ulps(got: f32, want: f64) -> f64 {
    let w = want as f32;
    let ulp = (f32::from_bits(w.to_bits() + 1) - w) as f64;
    (got as f64 - want).abs() / ulp
}

#[test]
fn exp_det_is_within_two_ulp_and_exact_at_the_ends() {
    let mut worst: f64 = 0.0;
    for i in 0..=2_000_000 {
        let x = -87.0 * i as f32 / 2_000_000.0;
        worst = worst.max(ulps(exp_det(x), (x as f64).exp()));
    }
    assert!(worst <= 2.0, "exp_det is {worst} ulp off");
    assert_eq!(exp_det(0.0), 1.0);
    assert_eq!(exp_det(-0.0), 1.0);
    assert_eq!(exp_det(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp_det(-87.001), 0.0);
    assert!(exp_det(-87.0) > 0.0);
    assert!(exp_det(f32::NAN).is_nan());
}

/// Inputs where rounding could go either way: ties of `x / ln 2`, the cut-off, zeros,
/// subnormals and a dense random spread.
fn exp_inputs() -> Vec<f32> {
    let mut x = vec![
        0.0, -0.0, -1e-45, -1e-30, -87.0, -86.999_99, -87.000_01, -200.0,
    ];
    x.push(f32::NEG_INFINITY);
    for k in 0..=250 {
        let half = (k as f32 + 0.5) * std::f32::consts::LN_2;
        x.extend([-half, -f32::from_bits(half.to_bits() + 1)]);
    }
    let mut next = rng(3);
    x.extend((0..4000).map(|_| (next() - 2.0) * 22.0));
    while x.len() % 16 != 0 {
        x.push(-1.0);
    }
    x
}

#[cfg(target_arch = "x86_64")]
#[test]
fn vector_exp_gives_the_scalar_bits() {
    use std::arch::x86_64::*;
    let x = exp_inputs();
    let want: Vec<f32> = x.iter().map(|&v| exp_det(v)).collect();
    if std::arch::is_x86_feature_detected!("avx512f") {
        let mut got = vec![0f32; x.len()];
        for (g, v) in got.chunks_exact_mut(16).zip(x.chunks_exact(16)) {
            // SAFETY: AVX-512F detected; both slices hold 16 values.
            unsafe { _mm512_storeu_ps(g.as_mut_ptr(), x86::exp16(_mm512_loadu_ps(v.as_ptr()))) };
        }
        assert!(same_bits(&got, &want), "AVX-512 exp differs");
    }
    if std::arch::is_x86_feature_detected!("avx2") {
        let mut got = vec![0f32; x.len()];
        for (g, v) in got.chunks_exact_mut(8).zip(x.chunks_exact(8)) {
            // SAFETY: AVX2 detected; both slices hold 8 values.
            unsafe { _mm256_storeu_ps(g.as_mut_ptr(), x86::exp8(_mm256_loadu_ps(v.as_ptr()))) };
        }
        assert!(same_bits(&got, &want), "AVX2 exp differs");
    }
}
