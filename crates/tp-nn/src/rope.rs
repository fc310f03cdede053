//! Rotary position embedding (Su et al. 2021, RoFormer §3.4.2) in both layouts, written with
//! differentiable ops (candle's fused `rope`/`rope_i` have no backward).

use crate::error::{Result, TpError};
use crate::packing::Segments;
use candle_core::{Device, Tensor, D};

/// How the rotated pairs sit in a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(x[2i], x[2i+1])` (GGUF / original Llama).
    Interleaved,
    /// Pairs `(x[i], x[i + d/2])` (Hugging Face "rotate_half").
    RotateHalf,
}

#[derive(Clone, Debug)]
pub struct Rope {
    cos: Tensor, // [max_seq, head_dim / 2]
    sin: Tensor, // [max_seq, head_dim / 2]
    layout: RopeLayout,
}

impl Rope {
    pub fn new(
        head_dim: usize,
        max_seq: usize,
        theta: f64,
        layout: RopeLayout,
        device: &Device,
    ) -> Result<Self> {
        Self::scaled(head_dim, max_seq, theta, 1.0, layout, device)
    }

    /// With linear position scaling: position `p` rotates as `p / scale` would (Gemma-3's
    /// global layers; `scale` 1: none).
    pub fn scaled(
        head_dim: usize,
        max_seq: usize,
        theta: f64,
        scale: f64,
        layout: RopeLayout,
        device: &Device,
    ) -> Result<Self> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(TpError::Config(format!(
                "RoPE scaling factor {scale} must be a positive number"
            )));
        }
        if !head_dim.is_multiple_of(2) || head_dim == 0 {
            return Err(TpError::Config(format!(
                "RoPE needs an even head_dim, got {head_dim}"
            )));
        }
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(max_seq * half);
        let mut sin = Vec::with_capacity(max_seq * half);
        for p in 0..max_seq {
            for i in 0..half {
                let freq = theta.powf(-((2 * i) as f64) / head_dim as f64) / scale;
                let a = p as f64 * freq;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Ok(Rope {
            cos: Tensor::from_vec(cos, (max_seq, half), device)?,
            sin: Tensor::from_vec(sin, (max_seq, half), device)?,
            layout,
        })
    }

    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// `(cos, sin)` tables `[max_seq, head_dim / 2]`.
    pub fn tables(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// `x [batch, heads, seq, head_dim]` at positions `offset..offset + seq`.
    pub fn apply(&self, x: &Tensor, offset: usize) -> Result<Tensor> {
        let (_, _, s, d) = x.dims4()?;
        let half = d / 2;
        if offset + s > self.cos.dim(0)? || half != self.cos.dim(1)? {
            return Err(TpError::Shape(format!(
                "RoPE table is [{}, {}] but got positions {offset}..{} with head_dim {d}",
                self.cos.dim(0)?,
                self.cos.dim(1)?,
                offset + s
            )));
        }
        let cos = self.cos.narrow(0, offset, s)?; // [seq, half]
        let sin = self.sin.narrow(0, offset, s)?; // [seq, half]
        self.rotate(x, &cos, &sin)
    }

    /// `x [batch, heads, seq, head_dim]` of packed sequences, each token at its position in
    /// its document ([`Segments::positions`]).
    pub fn apply_packed(&self, x: &Tensor, segments: &Segments) -> Result<Tensor> {
        let (b, _, s, d) = x.dims4()?;
        let half = d / 2;
        let (positions, max_position) = (segments.positions(), segments.max_position());
        if max_position >= self.cos.dim(0)? || half != self.cos.dim(1)? || segments.dims() != (b, s)
        {
            return Err(TpError::Shape(format!(
                "RoPE table is [{}, {}] but got {:?} positions up to {max_position} for {b} x {s} \
                 tokens with head_dim {d}",
                self.cos.dim(0)?,
                self.cos.dim(1)?,
                positions.dims()
            )));
        }
        let cos = self
            .cos
            .index_select(positions, 0)?
            .reshape((b, 1, s, half))?; // [b, 1, s, half]
        let sin = self
            .sin
            .index_select(positions, 0)?
            .reshape((b, 1, s, half))?; // [b, 1, s, half]
        self.rotate(x, &cos, &sin)
    }

    /// The rotation of `x [b, h, s, d]` by `cos`, `sin` (`[s, d/2]`, or per token
    /// `[b, 1, s, d/2]`).
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (b, h, s, d) = x.dims4()?;
        let half = d / 2;
        match self.layout {
            RopeLayout::RotateHalf => {
                let x1 = x.narrow(D::Minus1, 0, half)?; // [b, h, s, half]
                let x2 = x.narrow(D::Minus1, half, half)?; // [b, h, s, half]
                let o1 = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?; // [b, h, s, half]
                let o2 = (x1.broadcast_mul(sin)? + x2.broadcast_mul(cos)?)?; // [b, h, s, half]
                Ok(Tensor::cat(&[o1, o2], D::Minus1)?)
            }
            RopeLayout::Interleaved => {
                let xr = x.reshape((b, h, s, half, 2))?; // [b, h, s, half, 2]
                let xe = xr.narrow(4, 0, 1)?.squeeze(4)?; // [b, h, s, half]
                let xo = xr.narrow(4, 1, 1)?.squeeze(4)?; // [b, h, s, half]
                let oe = (xe.broadcast_mul(cos)? - xo.broadcast_mul(sin)?)?; // [b, h, s, half]
                let oo = (xe.broadcast_mul(sin)? + xo.broadcast_mul(cos)?)?; // [b, h, s, half]
                Ok(Tensor::stack(&[oe, oo], 4)?.reshape((b, h, s, d))?)
            }
        }
    }
}
