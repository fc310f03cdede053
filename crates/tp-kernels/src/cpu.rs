//! Runtime CPU feature detection, done once per process and cached.

use std::sync::OnceLock;

/// Which kernel family runs on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Simd {
    /// Portable Rust, any CPU.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C (every AVX2 CPU shipped has F16C; it is checked anyway).
    Avx2,
}

static LEVEL: OnceLock<Simd> = OnceLock::new();

/// The kernel family chosen for this process. Set `TP_KERNELS_SIMD=scalar` in the environment
/// before the first kernel call to force the portable path (for debugging and comparisons).
pub(crate) fn simd() -> Simd {
    *LEVEL.get_or_init(detect)
}

fn detect() -> Simd {
    if std::env::var("TP_KERNELS_SIMD").is_ok_and(|v| v.eq_ignore_ascii_case("scalar")) {
        return Simd::Scalar;
    }
    detect_hardware()
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn detect_hardware() -> Simd {
    if is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
    {
        Simd::Avx2
    } else {
        Simd::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn detect_hardware() -> Simd {
    Simd::Scalar
}

/// `"avx2+fma"` or `"scalar"`: the kernels this process uses (for logs and benchmarks).
pub fn simd_level() -> &'static str {
    match simd() {
        Simd::Avx2 => "avx2+fma",
        Simd::Scalar => "scalar",
    }
}
