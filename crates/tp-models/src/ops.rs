//! Element-wise inference ops on row-major f32 slices: RMSNorm, RoPE (both layouts), SwiGLU
//! and an in-place softmax. No autograd: these serve the inference forward pass only.

use crate::config::RopeStyle;

/// `x [n, d]` -> `out [n, d]` with `out = x / rms(x) * weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = row.iter().map(|v| v * v).sum();
        let scale = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// [`rms_norm`] in place: each `weight.len()`-wide row of `x` (a head, for Qwen3's q/k norms).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for row in x.chunks_exact_mut(d) {
        let ss: f32 = row.iter().map(|v| v * v).sum();
        let scale = 1.0 / (ss / d as f32 + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

/// `gate [n, f]` becomes `silu(gate) * up` in place.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Softmax of `x` in place (max-subtracted, so any finite input is safe).
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Precomputed rotation angles for positions `0..max_pos` of a `head_dim`-wide head.
#[derive(Clone, Debug)]
pub struct RopeTable {
    cos: Vec<f32>, // [max_pos, head_dim / 2]
    sin: Vec<f32>, // [max_pos, head_dim / 2]
    half: usize,
    style: RopeStyle,
}

impl RopeTable {
    /// Bytes of the table for `max_pos` positions (`None`: more than 2^128).
    pub fn bytes_for(head_dim: usize, max_pos: usize) -> Option<u128> {
        // cos and sin, [max_pos, head_dim / 2] f32 each.
        crate::limits::product(&[max_pos as u64, (head_dim / 2) as u64, 2, 4])
    }

    /// The table, after checking its size against the machine's memory: a context length
    /// too large to hold is a [`crate::ModelError::TooLarge`] naming it, not an abort.
    pub fn new(
        head_dim: usize,
        max_pos: usize,
        theta: f64,
        style: RopeStyle,
    ) -> crate::Result<Self> {
        crate::limits::check_bytes(
            "a RoPE table for a context length of",
            max_pos,
            Self::bytes_for(head_dim, max_pos),
            crate::limits::memory_limit(),
            "ask for a shorter context",
        )?;
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        let freqs: Vec<f64> = (0..half)
            .map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64))
            .collect();
        for p in 0..max_pos {
            for f in &freqs {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Ok(RopeTable {
            cos,
            sin,
            half,
            style,
        })
    }

    /// Positions the table covers.
    pub fn max_pos(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotates every head of `x [heads, head_dim]` (one token) for position `pos`
    /// (`pos < max_pos`, checked by the caller).
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

/// `a · b` with four independent accumulators (lets the compiler vectorize).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `out += w * v`.
#[inline]
pub fn axpy(out: &mut [f32], w: f32, v: &[f32]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o += w * x;
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
        let t_i = RopeTable::new(4, 8, 10_000.0, RopeStyle::Interleaved).unwrap();
        let t_h = RopeTable::new(4, 8, 10_000.0, RopeStyle::RotateHalf).unwrap();
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
        assert_eq!(t_i.max_pos(), 8);
    }

    #[test]
    fn softmax_sums_to_one_with_large_inputs() {
        let mut x = [1000.0, 1000.0, f32::NEG_INFINITY];
        softmax(&mut x);
        assert_eq!(x, [0.5, 0.5, 0.0]);
    }

    #[test]
    fn dot_matches_naive_for_odd_lengths() {
        let a: Vec<f32> = (0..19).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..19).map(|i| 1.0 - i as f32 * 0.1).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-4);
    }
}
