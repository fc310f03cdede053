//! Runtime CPU feature detection, done once per process and cached, and the process-wide
//! switch that forces the portable kernels.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// Which kernel family runs on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Simd {
    /// Portable Rust, any CPU.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C (every AVX2 CPU shipped has F16C; it is checked anyway).
    Avx2,
}

static HARDWARE: OnceLock<Simd> = OnceLock::new();
static FORCE_SCALAR: AtomicBool = AtomicBool::new(false);

/// The kernel family for the next kernel call: the portable one while [`force_scalar`] is on,
/// otherwise the best this CPU supports (detected once).
pub(crate) fn simd() -> Simd {
    if FORCE_SCALAR.load(Ordering::Relaxed) {
        return Simd::Scalar;
    }
    *HARDWARE.get_or_init(detect_hardware)
}

/// Makes every later kernel call in this process use the portable scalar kernels (`true`) or
/// the best ones this CPU supports again (`false`), for debugging and comparisons. The
/// library reads no environment variables; a binary that wants a switch calls this. Calls
/// already running finish on the family they started with.
///
/// `matmul_wide_acc` gives the same bits on either family; `matmul` agrees to f32 rounding.
pub fn force_scalar(on: bool) {
    FORCE_SCALAR.store(on, Ordering::Relaxed);
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

/// `"avx2+fma"` or `"scalar"`: the kernels the next call in this process will use (for logs
/// and benchmarks).
pub fn simd_level() -> &'static str {
    match simd() {
        Simd::Avx2 => "avx2+fma",
        Simd::Scalar => "scalar",
    }
}
