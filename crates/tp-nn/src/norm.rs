//! RMSNorm in a differentiable form (Zhang & Sennrich 2019, Eq. 4); replicated weights, or
//! Gemma's form that stores the weight minus one and computes `x * (1 + w)`.
//! candle's fused `rms_norm` has no backward, so this is composed of ops that do.

use crate::error::Result;
use candle_core::{Tensor, Var, D};

#[derive(Debug)]
pub struct RmsNorm {
    weight: Var, // [hidden]
    eps: f64,
    /// Added to the weight before it scales (0, or 1 for Gemma's `x * (1 + w)`).
    offset: f64,
}

impl RmsNorm {
    /// Replicated: every rank holds the whole `[hidden]` weight.
    pub fn from_global(weight: &Tensor, eps: f64) -> Result<Self> {
        Self::from_global_offset(weight, eps, false)
    }

    /// As [`RmsNorm::from_global`]; with `unit_offset` the weight is Gemma's (stored minus
    /// one: the norm computes `x * (1 + w)`, and `w`, not `1 + w`, is the parameter).
    pub fn from_global_offset(weight: &Tensor, eps: f64, unit_offset: bool) -> Result<Self> {
        Ok(RmsNorm {
            weight: Var::from_tensor(&weight.contiguous()?)?,
            eps,
            offset: if unit_offset { 1.0 } else { 0.0 },
        })
    }

    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// `x [.., hidden] -> [.., hidden]`: `x / sqrt(mean(x^2) + eps) * (offset + w)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?; // [.., 1]
        let inv = (ms + self.eps)?.sqrt()?.recip()?; // [.., 1]
        let w = self.weight.as_tensor(); // [hidden]
        let scale = if self.offset == 0.0 {
            w.clone()
        } else {
            (w + self.offset)? // [hidden]
        };
        Ok(x.broadcast_mul(&inv)?.broadcast_mul(&scale)?)
    }
}
