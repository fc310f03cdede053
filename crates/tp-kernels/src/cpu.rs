//! Run-time choice of the kernel path (scalar, AVX2, AVX2 with 256-bit VNNI, AVX-512), made
//! once per process and cached: the default path for this CPU, unless
//! `TP_KERNEL=scalar|avx2|avx2-novnni|avx512` asks for another one; plus the process-wide
//! switch that forces the portable kernels.
//!
//! The default is the widest path that measured fastest on that kind of CPU: AVX-512 on
//! Intel CPUs with AVX-512 VNNI (full-width 512-bit units; measured faster on the fleet's
//! Intel kind, docs/performance.md), AVX2 elsewhere, AMD Zen 4 included: it runs 512-bit
//! operations as two 256-bit halves, and batch-1 decode measured no faster with the AVX-512
//! kernels there. The AVX2 path takes 256-bit VNNI (`vpdpbusd ymm`, [`Simd::Avx2Vnni`]) where
//! the CPU has it (AVX-512 VNNI + VL, or AVX-VNNI): `TP_KERNEL=avx2` means the best AVX2
//! variant, `TP_KERNEL=avx2-novnni` the plain one (for comparisons, and what CPUs without VNNI
//! run).
//! Every path gives the same bits (`matmul_wide_acc`; `matmul` between AVX2 and AVX-512), so
//! the choice only affects speed.
//! Where that default is `avx2+vnni` on a CPU that also runs the AVX-512 path (AMD Zen 4),
//! products of many tokens (prefill, verification) take the AVX-512 many-token kernels
//! ([`wide_many_tokens`]: they prefilled 1.23x faster there, while one-token products are
//! faster on the AVX2 code); `TP_KERNEL` naming a path turns that off.
//!
//! A `TP_KERNEL` value this CPU cannot run (or an unknown value) is not fatal: the library
//! prints one warning on stderr and uses the default path, and [`kernel_path`] /
//! [`kernel_report`] name the path really in use, so a benchmark figure is never labelled
//! with a path that did not run.

use crate::error::KernelError;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::OnceLock;

/// Which kernel family runs on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Simd {
    /// Portable Rust, any CPU.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C (every AVX2 CPU shipped has F16C; it is checked anyway).
    Avx2,
    /// The AVX2 kernels, with `vpdpbusd` on 256-bit registers (`crate::vnni`) in the Q8_0 and
    /// the many-token K-quant kernels: the same exact integer sums, so the same bits.
    Avx2Vnni,
    /// AVX2 as above plus AVX-512 F/BW/VL and VNNI (`vpdpbusd`): the quantized kernels use
    /// 512-bit registers and VNNI dot products; the dense kernels and the activation
    /// quantization stay on their AVX2 code (bit-identical either way).
    Avx512,
}

impl Simd {
    /// The name `TP_KERNEL` takes and [`kernel_path`] returns.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Simd::Scalar => "scalar",
            Simd::Avx2 => "avx2",
            Simd::Avx2Vnni => "avx2+vnni",
            Simd::Avx512 => "avx512",
        }
    }

    /// Whether this is one of the AVX2 variants (the AVX2 code, with or without VNNI).
    pub(crate) fn is_avx2(self) -> bool {
        matches!(self, Simd::Avx2 | Simd::Avx2Vnni)
    }

    /// The `vpdpbusd ymm` encoding the AVX2 kernels use on this path (`crate::vnni::NONE`
    /// off [`Simd::Avx2Vnni`]).
    pub(crate) fn vnni(self) -> u8 {
        match self {
            Simd::Avx2Vnni => crate::vnni::encoding(),
            _ => crate::vnni::NONE,
        }
    }
}

/// Every kernel family, scalar first (tests and benchmarks go through them).
pub(crate) const ALL: [Simd; 4] = [Simd::Scalar, Simd::Avx2, Simd::Avx2Vnni, Simd::Avx512];

static SELECTED: OnceLock<Simd> = OnceLock::new();
static FORCE_SCALAR: AtomicBool = AtomicBool::new(false);
/// [`force_kernel`]'s path: 0 for none, else 1 + its index in [`ALL`].
static FORCED: AtomicU8 = AtomicU8::new(0);

/// The kernel family for the next kernel call: the portable one while [`force_scalar`] is on,
/// else the one [`force_kernel`] named, otherwise the one chosen once for this process (see
/// [`kernel_path`]).
pub(crate) fn simd() -> Simd {
    if FORCE_SCALAR.load(Ordering::Relaxed) {
        return Simd::Scalar;
    }
    match FORCED.load(Ordering::Relaxed) {
        0 => *SELECTED.get_or_init(select),
        i => ALL[(i as usize - 1).min(ALL.len() - 1)],
    }
}

/// Benchmarks and tests: makes every later kernel call in this process run the path `path`
/// names (the names `TP_KERNEL` takes: `"avx2-novnni"`, `"avx2+vnni"`, ...), whatever the
/// process default; `None` (or `"auto"`) goes back to the default. A name that is unknown or
/// that this CPU cannot run is an error and changes nothing. [`force_scalar`] still wins
/// while it is on; [`kernel_path`] names the path in use. Every path gives the same bits.
#[doc(hidden)]
pub fn force_kernel(path: Option<&str>) -> Result<(), KernelError> {
    let want = path.unwrap_or("").trim().to_ascii_lowercase();
    let simd = match named(&want) {
        None => {
            let reason = format!("not one of {NAMES}");
            return Err(KernelError::KernelPath { path: want, reason });
        }
        Some(None) => {
            FORCED.store(0, Ordering::Relaxed);
            return Ok(());
        }
        Some(Some(s)) if !supports(s) => {
            let reason = format!("this CPU ({}) cannot run it", cpu_model());
            return Err(KernelError::KernelPath { path: want, reason });
        }
        Some(Some(s)) => s,
    };
    let i = ALL.iter().position(|&s| s == simd).unwrap_or(0);
    FORCED.store(i as u8 + 1, Ordering::Relaxed);
    Ok(())
}

/// The default path for this CPU, or the one `TP_KERNEL` names when the CPU supports it
/// (a warning on stderr otherwise).
fn select() -> Simd {
    let (simd, warning) = resolve(std::env::var("TP_KERNEL").ok().as_deref());
    if let Some(w) = warning {
        eprintln!("warning: {w}");
    }
    simd
}

/// The path for a `TP_KERNEL` value (`None`: unset), and a warning when the value is unknown
/// or names a path this CPU cannot run (then the default path is used).
fn resolve(want: Option<&str>) -> (Simd, Option<String>) {
    let best = default_path();
    let want = want.unwrap_or("").trim().to_ascii_lowercase();
    let asked = match named(&want) {
        Some(Some(asked)) => asked,
        Some(None) => return (best, None),
        None => {
            let w = format!(
                "TP_KERNEL={want} is not one of {NAMES}; using {}",
                best.name()
            );
            return (best, Some(w));
        }
    };
    if supports(asked) {
        (asked, None)
    } else {
        let w = format!(
            "TP_KERNEL={want} but this CPU ({}) cannot run it; using {}",
            cpu_model(),
            best.name()
        );
        (best, Some(w))
    }
}

/// The names [`named`] takes.
const NAMES: &str = "scalar, avx2, avx2-novnni, avx2+vnni, avx512, auto";

/// The path a (lower-case, trimmed) name asks for: `Some(None)` for the default (`""`,
/// `"auto"`), `None` for an unknown name. `"avx2"` is the best AVX2 variant this CPU runs.
fn named(want: &str) -> Option<Option<Simd>> {
    Some(Some(match want {
        "" | "auto" => return Some(None),
        "scalar" => Simd::Scalar,
        "avx2" if supports(Simd::Avx2Vnni) => Simd::Avx2Vnni,
        "avx2" | "avx2-novnni" => Simd::Avx2,
        "avx2+vnni" => Simd::Avx2Vnni,
        "avx512" => Simd::Avx512,
        _ => return None,
    }))
}

/// Whether this CPU can run the kernels of `simd`.
pub(crate) fn supports(simd: Simd) -> bool {
    match simd {
        Simd::Scalar => true,
        Simd::Avx2 => has_avx2(),
        Simd::Avx2Vnni => has_avx2() && crate::vnni::encoding() != crate::vnni::NONE,
        Simd::Avx512 => has_avx2() && has_avx512(),
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx2() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx512() -> bool {
    false
}

/// The path used when `TP_KERNEL` is unset: AVX-512 on Intel CPUs that support it, else
/// the best this CPU supports short of AVX-512 (see the module comment).
pub(crate) fn default_path() -> Simd {
    let best = detect_hardware();
    let intel = cpu_vendor().is_some_and(|v| v == "GenuineIntel");
    if best == Simd::Avx512 && !intel {
        // AVX-512 VNNI + VL include `vpdpbusd ymm`.
        Simd::Avx2Vnni
    } else {
        best
    }
}

/// `/proc/cpuinfo`'s first `vendor_id` (`"GenuineIntel"`, `"AuthenticAMD"`), if readable.
fn cpu_vendor() -> Option<String> {
    cpuinfo_field("vendor_id")
}

fn cpuinfo_field(key: &str) -> Option<String> {
    std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|t| {
        t.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    })
}

/// The best kernel family this CPU supports (ignores `TP_KERNEL`).
pub(crate) fn detect_hardware() -> Simd {
    [Simd::Avx512, Simd::Avx2Vnni, Simd::Avx2]
        .into_iter()
        .find(|&s| supports(s))
        .unwrap_or(Simd::Scalar)
}

/// Every kernel family this CPU supports, scalar first (tests compare them all), with a
/// printed line for each one it cannot run (so a skipped variant is seen, not silently
/// counted as passing).
#[cfg(test)]
pub(crate) fn available() -> Vec<Simd> {
    ALL.into_iter()
        .filter(|&s| {
            let ok = supports(s);
            if !ok {
                eprintln!("skipped {s:?}: this CPU ({}) cannot run it", cpu_model());
            }
            ok
        })
        .collect()
}

/// Makes every later kernel call in this process use the portable scalar kernels (`true`) or
/// the chosen ones again (`false`), for debugging and comparisons. Calls already running
/// finish on the family they started with.
///
/// `matmul_wide_acc` gives the same bits on every family; `matmul` agrees to f32 rounding.
pub fn force_scalar(on: bool) {
    FORCE_SCALAR.store(on, Ordering::Relaxed);
}

/// `"avx512+vnni"`, `"avx2+fma+vnni"`, `"avx2+fma"` or `"scalar"`: the kernels the next
/// call in this process will use (for logs and benchmarks).
pub fn simd_level() -> &'static str {
    match simd() {
        Simd::Avx512 => "avx512+vnni",
        Simd::Avx2Vnni => "avx2+fma+vnni",
        Simd::Avx2 => "avx2+fma",
        Simd::Scalar => "scalar",
    }
}

/// `"avx512"`, `"avx2+vnni"`, `"avx2"` or `"scalar"`: the kernel path the next call will
/// use, in the spelling `TP_KERNEL` takes.
pub fn kernel_path() -> &'static str {
    simd().name()
}

/// The CPU's model name (`/proc/cpuinfo`'s first `model name`), or `"unknown CPU"`.
pub fn cpu_model() -> String {
    cpuinfo_field("model name").unwrap_or_else(|| "unknown CPU".into())
}

/// Whether quantized products of many tokens run on the AVX-512 kernels while the path is
/// `avx2+vnni`: when that path is this CPU's default (not asked for by `TP_KERNEL`, not
/// forced) and the CPU runs the AVX-512 path too. On the fleet's AMD kind (512-bit operations
/// in two halves) the AVX-512 many-token kernels prefilled Qwen2.5-Coder-1.5B Q4_K_M 1.23x
/// faster while one-token decode ran 0.67x (docs/performance.md), so each size takes the
/// faster; every path gives the same bits.
pub(crate) fn wide_many_tokens() -> bool {
    static WIDE: OnceLock<bool> = OnceLock::new();
    FORCED.load(Ordering::Relaxed) == 0
        && !FORCE_SCALAR.load(Ordering::Relaxed)
        && *WIDE.get_or_init(|| {
            let asked = std::env::var("TP_KERNEL").ok();
            let asked = asked.as_deref().map(|a| a.trim().to_ascii_lowercase());
            matches!(asked.as_deref(), None | Some("") | Some("auto"))
                && default_path() == Simd::Avx2Vnni
                && supports(Simd::Avx512)
        })
}

/// One line for logs and benchmark headers: the CPU model, the kernel path in use and the
/// widest one this CPU supports, e.g. `"AMD EPYC, kernels avx2 (TP_KERNEL; cpu up to avx512)"`
/// (`avx2+vnni, many-token avx512` where [`wide_many_tokens`]).
pub fn kernel_report() -> String {
    let (path, best) = (simd(), detect_hardware());
    let how = if FORCE_SCALAR.load(Ordering::Relaxed) {
        "forced scalar; ".to_string()
    } else if FORCED.load(Ordering::Relaxed) != 0 {
        "forced; ".to_string()
    } else if std::env::var_os("TP_KERNEL").is_some() {
        "TP_KERNEL; ".to_string()
    } else {
        String::new()
    };
    let wide = if path == Simd::Avx2Vnni && wide_many_tokens() {
        ", many-token avx512"
    } else {
        ""
    };
    format!(
        "{}, kernels {}{wide} ({how}cpu up to {})",
        cpu_model(),
        path.name(),
        best.name()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tp_kernel_values_resolve_or_warn_and_fall_back() {
        let best = default_path();
        assert!(supports(best));
        assert_eq!(resolve(None), (best, None));
        assert_eq!(resolve(Some(" Auto ")), (best, None));
        assert_eq!(resolve(Some("scalar")), (Simd::Scalar, None));
        let (s, w) = resolve(Some("avx9000"));
        assert_eq!(s, best);
        assert!(w.is_some_and(|w| w.contains("not one of")));
        let avx2 = resolve(Some("avx2")).0;
        let best_avx2 = [Simd::Avx2Vnni, Simd::Avx2]
            .into_iter()
            .find(|&s| supports(s));
        assert_eq!(
            avx2,
            best_avx2.unwrap_or(best),
            "avx2: the best AVX2 variant"
        );
        if supports(Simd::Avx2) {
            assert_eq!(resolve(Some("AVX2-novnni")), (Simd::Avx2, None));
        }
        for simd in [Simd::Avx2, Simd::Avx2Vnni, Simd::Avx512] {
            if simd == Simd::Avx2 {
                continue; // "avx2" asks for the best variant, checked above
            }
            let (s, w) = resolve(Some(simd.name()));
            if supports(simd) {
                assert_eq!((s, w), (simd, None));
            } else {
                eprintln!("{simd:?} unsupported here: checking the fallback");
                assert_eq!(s, best);
                assert!(w.is_some_and(|w| w.contains("cannot run it")));
            }
        }
        assert!(kernel_report().contains(kernel_path()));
    }
}
