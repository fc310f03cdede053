//! AdamW (Loshchilov & Hutter 2019, Alg. 2, decoupled weight decay; the update as PyTorch's
//! `torch.optim.AdamW` computes it) on a rank's flat shard buffer: the moments have the
//! shape of the rank's shards, so the optimizer state is sharded exactly like the weights.
//! Plus the learning-rate schedule: linear warm-up, then cosine decay to `min_lr`.

use crate::grads::FlatLayout;
use crate::layout::ParamSpec;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Optimizer hyper-parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Clip the gradient to this global L2 norm (0 = off).
    pub clip_norm: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 20,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            clip_norm: 1.0,
        }
    }
}

impl AdamWConfig {
    /// Learning rate of 0-based step `step` of `total`.
    pub fn lr_at(&self, step: u64, total: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = total.saturating_sub(self.warmup_steps).max(1);
        let t = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
        self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

/// The moments of one rank's shards.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
    /// Updates applied so far (bias correction uses `step + 1` for the next one).
    pub step: u64,
}

impl AdamW {
    pub fn new(elems: usize) -> Self {
        AdamW {
            exp_avg: vec![0.0; elems],
            exp_avg_sq: vec![0.0; elems],
            step: 0,
        }
    }

    /// One update of `params` with `grads * grad_scale` (the clipping factor) at rate `lr`.
    /// Weight decay applies to parameters whose spec says so (matrices, not norms).
    #[allow(clippy::too_many_arguments)] // buffers, their layout, and the step's two scalars
    pub fn update(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        layout: &FlatLayout,
        specs: &[ParamSpec],
        cfg: &AdamWConfig,
        lr: f64,
        grad_scale: f64,
    ) {
        let all = 0..layout.total();
        self.update_window(params, grads, all, layout, specs, cfg, lr, grad_scale);
    }

    /// [`AdamW::update`] of the elements `window` of the flat buffer only (the distributed
    /// optimizer's shard): `params`, `grads` and the moments hold just those elements, and a
    /// parameter cut by the window's edges keeps its own weight decay on the part inside.
    #[allow(clippy::too_many_arguments)] // buffers, their window and layout, the step's scalars
    pub fn update_window(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        window: Range<usize>,
        layout: &FlatLayout,
        specs: &[ParamSpec],
        cfg: &AdamWConfig,
        lr: f64,
        grad_scale: f64,
    ) {
        self.step += 1;
        let t = self.step as i32;
        let bc1 = 1.0 - cfg.beta1.powi(t);
        let bc2 = 1.0 - cfg.beta2.powi(t);
        let step_size = (lr / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        let (b1, b2) = (cfg.beta1 as f32, cfg.beta2 as f32);
        let eps = cfg.eps as f32;
        let scale = grad_scale as f32;
        for (i, spec) in specs.iter().enumerate() {
            let full = layout.range(i);
            // This parameter's elements inside the window, as offsets into the window.
            let (lo, hi) = (full.start.max(window.start), full.end.min(window.end));
            if lo >= hi {
                continue;
            }
            let r = lo - window.start..hi - window.start;
            let decay = if spec.decay {
                (1.0 - lr * cfg.weight_decay) as f32
            } else {
                1.0
            };
            let p = &mut params[r.clone()];
            let m = &mut self.exp_avg[r.clone()];
            let v = &mut self.exp_avg_sq[r.clone()];
            for (((p, m), v), &g) in p.iter_mut().zip(m).zip(v).zip(&grads[r.clone()]) {
                let g = g * scale;
                *p *= decay;
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                let denom = v.sqrt() / bc2_sqrt + eps;
                *p -= step_size * *m / denom;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_min() {
        let c = AdamWConfig {
            lr: 1.0,
            min_lr: 0.1,
            warmup_steps: 4,
            ..AdamWConfig::default()
        };
        assert_eq!(c.lr_at(0, 100), 0.25);
        assert_eq!(c.lr_at(3, 100), 1.0);
        assert!((c.lr_at(4, 100) - 1.0).abs() < 1e-12);
        assert!((c.lr_at(52, 100) - 0.55).abs() < 1e-12);
        assert!((c.lr_at(100, 100) - 0.1).abs() < 1e-12);
        assert!((c.lr_at(500, 100) - 0.1).abs() < 1e-12);
    }

    /// One step by hand: m = 0.1 g, v = 0.05 g^2 (beta2 0.95), bias-corrected ratio g / |g|.
    #[test]
    fn first_step_moves_each_weight_by_lr_against_its_gradient_sign() {
        let spec = ParamSpec {
            weight: tp_spec::WeightName::OutputNorm,
            name: "w".into(),
            shape: vec![3],
            placement: tp_nn::Placement::Replicated,
            decay: false,
            tp_partial_grad: false,
            tied_copy: false,
        };
        let specs = vec![spec];
        let layout = FlatLayout::new(&specs);
        let mut p = vec![1.0f32, 2.0, 3.0];
        let mut opt = AdamW::new(3);
        let cfg = AdamWConfig {
            eps: 0.0,
            ..AdamWConfig::default()
        };
        opt.update(&mut p, &[0.5, -2.0, 1e-3], &layout, &specs, &cfg, 0.01, 1.0);
        for (got, want) in p.iter().zip([0.99f32, 2.01, 2.99]) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
    }
    /// Three windows cutting a decayed matrix and a norm weight in the middle update exactly as
    /// the whole buffer does (each element keeps its parameter's weight decay).
    #[test]
    fn windows_update_like_the_whole_buffer() {
        let spec = |name: &str, n: usize, decay: bool| ParamSpec {
            weight: tp_spec::WeightName::OutputNorm,
            name: name.into(),
            shape: vec![n],
            placement: tp_nn::Placement::Replicated,
            decay,
            tp_partial_grad: false,
            tied_copy: false,
        };
        let specs = vec![spec("a", 5, true), spec("b", 4, false), spec("c", 3, true)];
        let layout = FlatLayout::new(&specs);
        let p0: Vec<f32> = (0..12).map(|i| 0.1 * i as f32 - 0.5).collect();
        let g: Vec<f32> = (0..12).map(|i| ((i * 7) % 5) as f32 - 2.0).collect();
        let cfg = AdamWConfig::default();
        let (mut whole, mut opt) = (p0.clone(), AdamW::new(12));
        let mut cut = p0.clone();
        let mut opts = [AdamW::new(3), AdamW::new(4), AdamW::new(5)];
        for _ in 0..3 {
            opt.update(&mut whole, &g, &layout, &specs, &cfg, 0.01, 0.5);
            for (o, w) in opts.iter_mut().zip([0..3, 3..7, 7..12]) {
                let (p, gw) = (&mut cut[w.clone()], &g[w.clone()]);
                o.update_window(p, gw, w, &layout, &specs, &cfg, 0.01, 0.5);
            }
        }
        assert_eq!(whole, cut);
        assert_eq!(opt.exp_avg[3..7], opts[1].exp_avg[..]);
    }
}
