//! Element-wise inference ops on row-major f32 slices: RMSNorm (its sum of squares in 16
//! lanes), RoPE (both layouts), SwiGLU and GeGLU; attention is in `attention.rs`. No
//! autograd: these serve the inference forward pass only.

use crate::config::RopeStyle;
use crate::exp::exp_det;
use crate::path::Path;

/// `x [n, d]` -> `out [n, d]` with `out = x / rms(x) * weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let scale = 1.0 / (sum_squares(row) / d as f32 + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// [`rms_norm`] in place: each `weight.len()`-wide row of `x` (a head, for Qwen3's q/k norms).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for row in x.chunks_exact_mut(d) {
        let scale = 1.0 / (sum_squares(row) / d as f32 + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

/// `Σ x²` in 16 lanes (element `i` in lane `i mod 16`, in order), folded by
/// [`fold16`]: an order a vector register follows, so the AVX-512 path gives the same bits.
pub(crate) fn sum_squares(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let full = x.len() / 16 * 16;
    match Path::current() {
        // SAFETY: the avx512 kernel path is chosen only on CPUs with AVX-512F.
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => lanes = unsafe { x86::square_lanes_avx512(&x[..full]) },
        _ => square_lanes(&x[..full], &mut lanes),
    }
    square_lanes(&x[full..], &mut lanes);
    fold16(lanes)
}

/// `lanes[i mod 16] += x[i]²`, in order.
fn square_lanes(x: &[f32], lanes: &mut [f32; 16]) {
    for c in x.chunks(16) {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v * v;
        }
    }
}

/// Sixteen partial sums folded in halves: lane `i` += lane `i + w` for `w` = 8, 4, 2, 1.
pub(crate) fn fold16(mut lanes: [f32; 16]) -> f32 {
    let mut w = 8;
    while w > 0 {
        for i in 0..w {
            lanes[i] += lanes[i + w];
        }
        w /= 2;
    }
    lanes[0]
}

/// `gate [n, f]` becomes `gelu_tanh(gate) * up` in place (GeGLU with GELU's tanh
/// approximation, Gemma's `gelu_pytorch_tanh`).
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh()) * u;
    }
}

/// `gate [n, f]` becomes `silu(gate) * up` in place: with `e = exp(-|g|)` ([`exp_det`]),
/// `silu(g) = g / (1 + e)` for `g >= 0` and `g e / (1 + e)` below (no overflow either way).
/// AVX2 and AVX-512 lanes compute the scalar bits.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    match Path::current() {
        // SAFETY: these kernel paths are chosen only on CPUs with AVX-512F / AVX2.
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { x86::silu_mul_avx512(gate, up) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { x86::silu_mul_avx2(gate, up) },
        Path::Portable => silu_mul_portable(gate, up),
    }
}

/// [`silu_mul`] as written.
pub(crate) fn silu_mul_portable(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

#[inline(always)]
fn silu(g: f32) -> f32 {
    let e = exp_det(f32::from_bits(g.to_bits() | 0x8000_0000)); // exp(-|g|)
    let num = if g >= 0.0 { g } else { g * e };
    num / (1.0 + e)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! [`silu_mul`](super::silu_mul) in vector lanes: the scalar operations, lane by lane.

    use crate::exp::x86::{exp16, exp8};
    use std::arch::x86_64::*;

    /// `lanes[i mod 16] += x[i]²` from zero, 16 at a time (`x.len()` a multiple of 16).
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn square_lanes_avx512(x: &[f32]) -> [f32; 16] {
        let mut acc = _mm512_setzero_ps();
        for c in x.chunks_exact(16) {
            // SAFETY: 16 values.
            let v = unsafe { _mm512_loadu_ps(c.as_ptr()) };
            acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
        }
        let mut out = [0f32; 16];
        // SAFETY: 16 values.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), acc) };
        out
    }

    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn silu_mul_avx512(gate: &mut [f32], up: &[f32]) {
        let n = gate.len().min(up.len());
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, inside both slices.
            unsafe {
                let g = _mm512_loadu_ps(gate.as_ptr().add(i));
                let u = _mm512_loadu_ps(up.as_ptr().add(i));
                let neg = _mm512_castsi512_ps(_mm512_or_si512(
                    _mm512_castps_si512(g),
                    _mm512_set1_epi32(i32::MIN),
                ));
                let e = exp16(neg);
                let pos = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(g, _mm512_setzero_ps());
                let num = _mm512_mask_blend_ps(pos, _mm512_mul_ps(g, e), g);
                let s = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0), e));
                _mm512_storeu_ps(gate.as_mut_ptr().add(i), _mm512_mul_ps(s, u));
            }
            i += 16;
        }
        super::silu_mul_portable(&mut gate[i..n], &up[i..n]);
    }

    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn silu_mul_avx2(gate: &mut [f32], up: &[f32]) {
        let n = gate.len().min(up.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, inside both slices.
            unsafe {
                let g = _mm256_loadu_ps(gate.as_ptr().add(i));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                let neg = _mm256_or_ps(g, _mm256_set1_ps(-0.0));
                let e = exp8(neg);
                let pos = _mm256_cmp_ps::<_CMP_GE_OQ>(g, _mm256_setzero_ps());
                let num = _mm256_blendv_ps(_mm256_mul_ps(g, e), g, pos);
                let s = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0), e));
                _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(s, u));
            }
            i += 8;
        }
        super::silu_mul_portable(&mut gate[i..n], &up[i..n]);
    }
}

/// RoPE of one base: the rotation frequency of each pair of a head's dimensions. Angles are
/// computed for the positions of each forward pass ([`Rope::angles`]), so nothing grows
/// with the context length.
#[derive(Clone, Debug)]
pub struct Rope {
    freqs: Vec<f64>, // [head_dim / 2]
    style: RopeStyle,
}

impl Rope {
    /// Frequencies `theta^(-2i / head_dim) / scale` (`scale`: linear position scaling, 1 for
    /// none).
    pub fn new(head_dim: usize, theta: f64, scale: f64, style: RopeStyle) -> Self {
        let freqs = (0..head_dim / 2)
            .map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64) / scale)
            .collect();
        Rope { freqs, style }
    }

    /// The rotation of each of `positions`, in order.
    pub fn angles(&self, positions: impl Iterator<Item = usize>) -> RopeAngles {
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in positions {
            for f in &self.freqs {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        RopeAngles {
            cos,
            sin,
            half: self.freqs.len(),
            style: self.style,
        }
    }
}

/// Rotation angles of some positions (rows) of a `2 * half`-wide head.
#[derive(Clone, Debug)]
pub struct RopeAngles {
    cos: Vec<f32>, // [rows, half]
    sin: Vec<f32>, // [rows, half]
    half: usize,
    style: RopeStyle,
}

impl RopeAngles {
    /// Rotates every head of `x [heads, head_dim]` (one token) by row `pos`'s angles.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let h = self.half;
        let cos = &self.cos[pos * h..(pos + 1) * h];
        let sin = &self.sin[pos * h..(pos + 1) * h];
        for head in x.chunks_exact_mut(2 * h) {
            match self.style {
                RopeStyle::Interleaved => {
                    for i in 0..h {
                        let (a, b) = (head[2 * i], head[2 * i + 1]);
                        head[2 * i] = a * cos[i] - b * sin[i];
                        head[2 * i + 1] = a * sin[i] + b * cos[i];
                    }
                }
                RopeStyle::RotateHalf => {
                    let (lo, hi) = head.split_at_mut(h);
                    for i in 0..h {
                        let (a, b) = (lo[i], hi[i]);
                        lo[i] = a * cos[i] - b * sin[i];
                        hi[i] = a * sin[i] + b * cos[i];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rows() {
        let x = [3.0, 4.0, 0.0, 0.0];
        let mut out = [0.0; 4];
        rms_norm(&x, &[1.0, 1.0], 1e-6, &mut out);
        let rms = (12.5f32 + 1e-6).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6 && (out[1] - 4.0 / rms).abs() < 1e-6);
        // An all-zero row stays zero thanks to eps.
        assert_eq!(&out[2..], &[0.0, 0.0]);
    }

    #[test]
    fn rope_layouts_rotate_the_same_pairs_differently() {
        let t_i = Rope::new(4, 10_000.0, 1.0, RopeStyle::Interleaved).angles(0..8);
        let t_h = Rope::new(4, 10_000.0, 1.0, RopeStyle::RotateHalf).angles(0..8);
        // Position 0 is the identity in both layouts.
        let mut x = [1.0, 2.0, 3.0, 4.0];
        t_i.apply(&mut x, 0);
        assert_eq!(x, [1.0, 2.0, 3.0, 4.0]);
        // Interleaved pair (x0, x1) at position 1, frequency 1: a rotation by 1 radian.
        let mut x = [1.0, 0.0, 0.0, 0.0];
        t_i.apply(&mut x, 1);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
        // Rotate-half pairs (x0, x2) instead.
        let mut x = [1.0, 0.0, 0.0, 0.0];
        t_h.apply(&mut x, 1);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
        // Linear scaling by 4: position 4 turns as far as position 1 unscaled; angles are
        // those of the positions asked for, in their order.
        let scaled = Rope::new(4, 10_000.0, 4.0, RopeStyle::RotateHalf).angles([4, 0].into_iter());
        let (mut a, mut b) = ([1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]);
        scaled.apply(&mut a, 0);
        t_h.apply(&mut b, 1);
        assert_eq!(a, b);
        scaled.apply(&mut b, 1);
        assert_eq!(a, b, "row 1 is position 0: the identity");
    }

    /// The sum of squares is the same on the AVX-512 path (lengths around multiples of 16)
    /// and within f32 rounding of the f64 sum.
    #[test]
    fn sum_of_squares_is_the_same_on_every_path() {
        let x: Vec<f32> = (0..1000)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.137)
            .collect();
        for n in [0, 1, 15, 16, 17, 31, 32, 576, 896, 1000] {
            let mut lanes = [0f32; 16];
            square_lanes(&x[..n], &mut lanes);
            let want = fold16(lanes);
            let exact: f64 = x[..n].iter().map(|&v| v as f64 * v as f64).sum();
            assert!(
                (want as f64 - exact).abs() <= 1e-5 * exact,
                "{n}: {want} vs {exact}"
            );
            assert_eq!(sum_squares(&x[..n]).to_bits(), want.to_bits(), "{n}");
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                let full = n / 16 * 16;
                // SAFETY: AVX-512F detected just now.
                let mut lanes = unsafe { x86::square_lanes_avx512(&x[..full]) };
                square_lanes(&x[full..n], &mut lanes);
                assert_eq!(fold16(lanes).to_bits(), want.to_bits(), "avx512, {n}");
            }
        }
    }

    /// SiLU within 4 ulp of its f64 value over both signs (and 0 far below, no overflow),
    /// and every vector path gives the portable bits.
    #[test]
    fn silu_is_accurate_and_the_same_on_every_path() {
        let mut g: Vec<f32> = (-4000..4000).map(|i| i as f32 * 0.0237).collect();
        g.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            -87.5,
            -200.0,
            88.0,
            200.0,
            f32::MAX,
            -f32::MAX,
        ]);
        let u: Vec<f32> = (0..g.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut want = g.clone();
        silu_mul_portable(&mut want, &u);
        for ((&x, &u), &w) in g.iter().zip(&u).zip(&want) {
            let exact = x as f64 / (1.0 + (-(x as f64)).exp()) * u as f64;
            // exp_det is 0 below -87, so SiLU is 0 where its value is under ~1e-35.
            let tol = 4.0 * f32::EPSILON as f64 * exact.abs() + 1e-35;
            assert!(
                (w as f64 - exact).abs() <= tol,
                "silu({x}) * {u}: {w} vs {exact}"
            );
        }
        #[cfg(target_arch = "x86_64")]
        for (name, has) in [
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("avx512", std::arch::is_x86_feature_detected!("avx512f")),
        ] {
            if !has {
                continue;
            }
            let mut got = g.clone();
            // SAFETY: the feature was detected just now.
            unsafe {
                match name {
                    "avx2" => x86::silu_mul_avx2(&mut got, &u),
                    _ => x86::silu_mul_avx512(&mut got, &u),
                }
            }
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name} SiLU differs from the portable bits");
        }
    }

    #[test]
    fn gelu_tanh_matches_its_definition() {
        for x in [-3.0f32, -0.5, 0.0, 0.7, 2.5] {
            let (mut g, u) = ([x], [2.0]);
            gelu_tanh_mul(&mut g, &u);
            let x64 = x as f64;
            let want = 0.5
                * x64
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt() * (x64 + 0.044715 * x64.powi(3)))
                        .tanh())
                * 2.0;
            assert!((g[0] as f64 - want).abs() < 1e-6, "{x}: {} vs {want}", g[0]);
        }
    }
}
