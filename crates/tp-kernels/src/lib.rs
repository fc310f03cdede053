//! tp-kernels: single-threaded CPU matrix-vector and small matrix-matrix products over GGUF
//! quantized blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
//! IQ4_XS) and dense
//! f32/f16 weights, with AVX2+FMA (with 256-bit VNNI where the CPU has it) and AVX-512 VNNI
//! kernels chosen at run time (`TP_KERNEL` overrides) and a portable scalar fallback.
//!
//! Every product runs on the calling thread only: a tensor-parallel rank is one thread.
//! `matmul_wide_acc` accumulates in f64 from per-block f32 contributions, so a product split
//! by input columns across ranks (at block boundaries) sums to the same bits at every split.

mod cpu;
mod dense;
#[cfg(target_arch = "x86_64")]
mod dense_avx2;
#[cfg(target_arch = "x86_64")]
mod dot_avx2;
#[cfg(target_arch = "x86_64")]
mod dot_avx2_k;
#[cfg(target_arch = "x86_64")]
mod dot_avx512;
#[cfg(target_arch = "x86_64")]
mod dot_avx512_k;
mod dot_scalar;
mod dot_scalar_k;
mod error;
mod expand;
mod format;
#[cfg(target_arch = "x86_64")]
mod gemm_avx2_k;
#[cfg(target_arch = "x86_64")]
mod gemm_avx512;
#[cfg(target_arch = "x86_64")]
mod gemm_avx512_iq4xs;
#[cfg(target_arch = "x86_64")]
mod gemm_avx512_k;
#[cfg(target_arch = "x86_64")]
mod gemm_avx512_k23;
#[cfg(target_arch = "x86_64")]
mod gemm_avx512_k4;
mod matrix;
mod pack;
mod pack_k;
mod quantize;
mod quantize_iq4;
mod quantize_k;
mod tile;
mod vnni;
mod wide;

pub use cpu::{cpu_model, force_kernel, force_scalar, kernel_path, kernel_report, simd_level};
pub use dense::{DenseData, DenseMatrix};
pub use error::KernelError;
pub use format::QuantType;
pub use matrix::QuantMatrix;
pub use quantize_iq4::quantize_iq4;
#[doc(hidden)]
pub use tile::legacy_tiles;
