//! Which form of the forward pass's own vector code runs (attention, SiLU, RMSNorm): the
//! one that matches the kernels in use, so `TP_KERNEL` and `force_scalar` steer both.

/// How the arithmetic is run: as written, or in AVX2 or AVX-512 vectors (the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Path {
    /// The path of the kernels in use (`tp_kernels::kernel_path`).
    pub fn current() -> Path {
        match tp_kernels::kernel_path() {
            #[cfg(target_arch = "x86_64")]
            "avx512" => Path::Avx512,
            #[cfg(target_arch = "x86_64")]
            "avx2" | "avx2+vnni" => Path::Avx2,
            _ => Path::Portable,
        }
    }
}
