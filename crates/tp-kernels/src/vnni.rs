//! 256-bit VNNI for the AVX2 kernels: `vpdpbusd ymm` (unsigned bytes times signed bytes, 4
//! products summed into each i32 lane, no intermediate saturation), in the encoding this CPU
//! runs: EVEX (AVX-512 VNNI + VL: AMD Zen 4 and later, Intel server cores) or VEX (AVX-VNNI:
//! Intel Alder Lake and later without AVX-512). Written as inline assembly so that the AVX2
//! kernels take it as a const generic parameter (`V`) instead of being compiled once more
//! per target feature set.
//!
//! Where the kernels' `maddubs` i16 pair sums never saturate (the formats' quants are chosen
//! so, see `dot_avx2` and `gemm_avx2_k`), `vpdpbusd` gives the same exact i32 sums as
//! `maddubs` then `madd` with ones (or with a scale), so every variant gives the same bits.

#[cfg(target_arch = "x86_64")]
use std::arch::{asm, x86_64::*};

/// No VNNI: the kernels' plain AVX2 code.
pub(crate) const NONE: u8 = 0;
/// `vpdpbusd ymm`, EVEX-encoded (AVX-512 VNNI + AVX-512 VL).
pub(crate) const EVEX: u8 = 1;
/// `{vex} vpdpbusd ymm` (AVX-VNNI).
pub(crate) const VEX: u8 = 2;

/// The encoding this CPU runs (EVEX preferred), or [`NONE`]; detected once.
#[cfg(target_arch = "x86_64")]
pub(crate) fn encoding() -> u8 {
    static ENC: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
    *ENC.get_or_init(|| {
        if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
            EVEX
        } else if is_x86_feature_detected!("avxvnni") {
            VEX
        } else {
            NONE
        }
    })
}

/// No VNNI off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn encoding() -> u8 {
    NONE
}

/// `acc + (the 4 products u[4l..4l+4] * s[4l..4l+4] summed per i32 lane l)`, `u` unsigned and
/// `s` signed bytes: `vpdpbusd` in encoding `V` (exact; no saturation).
///
/// # Safety
/// The CPU must run encoding `V` ([`encoding`] returned it); `V` must be [`EVEX`] or [`VEX`].
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dpbusd<const V: u8>(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    let mut acc = acc;
    // SAFETY: register-only instruction the caller promises the CPU has.
    unsafe {
        if V == VEX {
            asm!("{{vex}} vpdpbusd {acc}, {u}, {s}", acc = inout(ymm_reg) acc, u = in(ymm_reg) u,
                 s = in(ymm_reg) s, options(pure, nomem, nostack, preserves_flags));
        } else {
            asm!("vpdpbusd {acc}, {u}, {s}", acc = inout(ymm_reg) acc, u = in(ymm_reg) u,
                 s = in(ymm_reg) s, options(pure, nomem, nostack, preserves_flags));
        }
    }
    acc
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn dpbusd_sums_four_products_per_lane_exactly_in_each_encoding() {
        // Extremes included: 255 * -128 four times does not fit an i16 pair sum.
        let u: [u8; 32] = std::array::from_fn(|i| if i < 8 { 255 } else { (i * 37) as u8 });
        let s: [i8; 32] = std::array::from_fn(|i| if i < 8 { -128 } else { (i * 53) as i8 });
        let want: [i32; 8] = std::array::from_fn(|l| {
            7 - l as i32
                + (0..4)
                    .map(|k| u[4 * l + k] as i32 * s[4 * l + k] as i32)
                    .sum::<i32>()
        });
        let runs = [
            (
                EVEX,
                is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl"),
            ),
            (VEX, is_x86_feature_detected!("avxvnni")),
        ];
        for (enc, ok) in runs {
            if !ok || !is_x86_feature_detected!("avx2") {
                eprintln!("skipped encoding {enc}: this CPU cannot run it");
                continue;
            }
            let mut got = [0i32; 8];
            // SAFETY: the CPU runs this encoding (checked above); loads and stores are of
            // 32-byte arrays.
            unsafe {
                let acc = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
                let uv = _mm256_loadu_si256(u.as_ptr() as *const __m256i);
                let sv = _mm256_loadu_si256(s.as_ptr() as *const __m256i);
                let r = if enc == VEX {
                    dpbusd::<VEX>(acc, uv, sv)
                } else {
                    dpbusd::<EVEX>(acc, uv, sv)
                };
                _mm256_storeu_si256(got.as_mut_ptr() as *mut __m256i, r);
            }
            assert_eq!(got, want, "encoding {enc}");
        }
    }
}
