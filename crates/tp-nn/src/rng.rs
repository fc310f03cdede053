//! Random tensors from the workspace's one seeded generator ([`tp_spec::Rng`]): random block
//! weights, training initialisation and the layer tests draw their values here.

use crate::error::Result;
use candle_core::{Device, Tensor};
pub use tp_spec::Rng;

/// Tensors of values drawn from an [`Rng`].
pub trait RandomTensor {
    /// A tensor of uniform values in `[center - scale, center + scale)`.
    fn tensor(
        &mut self,
        dims: &[usize],
        center: f32,
        scale: f32,
        device: &Device,
    ) -> Result<Tensor>;
}

impl RandomTensor for Rng {
    fn tensor(
        &mut self,
        dims: &[usize],
        center: f32,
        scale: f32,
        device: &Device,
    ) -> Result<Tensor> {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| center + scale * self.signed_unit())
            .collect();
        Ok(Tensor::from_vec(v, dims, device)?) // [dims]
    }
}
