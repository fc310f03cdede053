//! Where a stage's global weights come from: a seeded fresh initialization (this file) or a
//! checkpoint ([`crate::checkpoint`]). Each tensor's random stream depends only on the seed
//! and the tensor's name, so every layout initializes the same model.

use crate::config::ModelConfig;
use crate::error::Result;
use candle_core::{Device, Tensor};
use tp_nn::{RandomTensor, Rng};
use tp_spec::WeightName;

/// A source of global tensors: weight `w`, whose HF name is `name`.
pub trait WeightSource {
    /// The global tensor of `w` (HF name `name`), of `shape` (f32, CPU).
    fn global(&self, w: WeightName, name: &str, shape: &[usize]) -> Result<Tensor>;
}

/// Fresh weights: linears uniform with standard deviation `1/sqrt(fan_in)` (output
/// projections `o_proj` and `down_proj` further scaled by `1/sqrt(2 * layers)`, GPT-2's
/// residual scaling), embeddings and LM head with standard deviation 0.02, norms 1 (stored
/// as 0 where the norms compute `x * (1 + w)`: Gemma's), Q/K/V biases 0 (as HF initializes
/// Qwen2's).
#[derive(Clone, Debug)]
pub struct SeededInit {
    pub seed: u64,
    pub layers: usize,
    /// The stored value of a norm weight that scales by 1.
    pub norm_value: f32,
}

impl SeededInit {
    pub fn new(cfg: &ModelConfig, seed: u64) -> Self {
        SeededInit {
            seed,
            layers: cfg.layers,
            norm_value: if cfg.block.hf_norm_minus_one {
                0.0
            } else {
                1.0
            },
        }
    }

    /// The stream of one tensor: FNV-1a of its name mixed with the seed.
    fn rng(&self, name: &str) -> Rng {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ self.seed;
        for b in name.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        Rng::xorshift64_star(h)
    }
}

impl WeightSource for SeededInit {
    fn global(&self, w: WeightName, name: &str, shape: &[usize]) -> Result<Tensor> {
        let dev = Device::Cpu;
        if matches!(
            w,
            WeightName::QBias(_) | WeightName::KBias(_) | WeightName::VBias(_)
        ) {
            return Ok(Tensor::zeros(shape, candle_core::DType::F32, &dev)?);
        }
        if shape.len() == 1 {
            return Ok(Tensor::full(self.norm_value, shape, &dev)?);
        }
        let fan_in = shape.last().copied().unwrap_or(1).max(1) as f32;
        let std = if name.ends_with("embed_tokens.weight") || name.ends_with("lm_head.weight") {
            0.02
        } else if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
            1.0 / (fan_in * 2.0 * self.layers.max(1) as f32).sqrt()
        } else {
            1.0 / fan_in.sqrt()
        };
        // Uniform on [-a, a) has standard deviation a / sqrt(3).
        let a = std * 3f32.sqrt();
        Ok(self.rng(name).tensor(shape, 0.0, a, &dev)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainModel;

    #[test]
    fn streams_depend_on_name_and_seed_only() {
        let c = ModelConfig::preset("tiny").unwrap();
        let a = SeededInit::new(&c, 1);
        let t = |s: &SeededInit, n: &str| {
            s.global(WeightName::Q(0), n, &[4, 8])
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let x = t(&a, "model.layers.0.self_attn.q_proj.weight");
        assert_eq!(x, t(&a, "model.layers.0.self_attn.q_proj.weight"));
        assert_ne!(x, t(&a, "model.layers.1.self_attn.q_proj.weight"));
        assert_ne!(
            x,
            t(
                &SeededInit::new(&c, 2),
                "model.layers.0.self_attn.q_proj.weight"
            )
        );
        let std = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
        assert!(std > 0.1 && std < 0.6, "std {std} for fan_in 8");
    }
}
