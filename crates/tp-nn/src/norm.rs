//! RMSNorm in a differentiable form (Zhang & Sennrich 2019, Eq. 4); replicated weights.
//! candle's fused `rms_norm` has no backward, so this is composed of ops that do.

use crate::error::Result;
use candle_core::{Tensor, Var, D};

#[derive(Debug)]
pub struct RmsNorm {
    weight: Var, // [hidden]
    eps: f64,
}

impl RmsNorm {
    /// Replicated: every rank holds the whole `[hidden]` weight.
    pub fn from_global(weight: &Tensor, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: Var::from_tensor(&weight.contiguous()?)?,
            eps,
        })
    }

    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// `x [.., hidden] -> [.., hidden]`: `x / sqrt(mean(x^2) + eps) * w`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?; // [.., 1]
        let inv = (ms + self.eps)?.sqrt()?.recip()?; // [.., 1]
        Ok(x.broadcast_mul(&inv)?
            .broadcast_mul(self.weight.as_tensor())?)
    }
}
