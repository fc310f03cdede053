//! A mixture-of-experts MLP on one rank of the tensor-parallel group (docs/moe.md): the router
//! is replicated (every rank routes every token identically), the experts are split by the
//! plan's [`tp_spec::ExpertShard`] (whole experts per expert group, each sliced by FFN columns
//! inside its group), and each local expert runs once per step on all the tokens routed to it.
//! Outputs go into the block's f64 partial sums, which the block's one all-reduce adds up.
//!
//! tp-invariance: a token's weight scales its expert's activations (f32, elementwise: the
//! same bits however the columns are split) before the row-parallel down projection, whose
//! block contributions are summed in f64 like the dense MLP's. The sum over experts and ranks
//! is then the same set of exact f64 additions at every tp and every expert-parallel size.

use crate::checkpoint::{Checkpoint, WeightName};
use crate::error::{ModelError, Result};
use crate::matrix::{LoadOptions, Matrix, Projection};
use crate::ops::{gelu_tanh_mul, silu_mul};
use crate::profile::Profile;
use tp_spec::{drop_over, Activation, CapacityFactor, Experts, Gating, ShardPlan};

/// One expert's columns on this rank.
#[derive(Debug)]
struct Expert {
    index: usize,
    gate_up: Projection, // [2 cols, hidden]
    down: Matrix,        // [hidden, cols]
}

/// Qwen2-MoE's shared expert: every token runs it, scaled by `sigmoid(x . gate)`.
#[derive(Debug)]
struct Shared {
    gate: Vec<f32>,      // [hidden]
    gate_up: Projection, // [2 cols, hidden]
    down: Matrix,        // [hidden, cols]
}

/// One layer's mixture of experts on this rank.
#[derive(Debug)]
pub(crate) struct MoeLayer {
    experts: Experts,
    hidden: usize,
    activation: Activation,
    router: Vec<f32>, // [count, hidden]
    /// The aux-loss-free bias of the top-k choice (`[count]`, empty: none;
    /// [`WeightName::RouterBias`], read when the file has it).
    selection_bias: Vec<f32>,
    local: Vec<Expert>,
    shared: Option<Shared>,
    /// The capacity factor ([`LoadOptions::expert_capacity`]).
    capacity: Option<CapacityFactor>,
}

/// Tokens per pass of one expert's products (bounds the `[rows, 2 cols]` scratch).
const ROWS: usize = 128;

impl MoeLayer {
    /// Reads layer `l`'s router, this rank's expert slices and the shared expert's slice.
    pub(crate) fn load(
        ckpt: &dyn Checkpoint,
        plan: &ShardPlan,
        l: usize,
        opts: LoadOptions,
    ) -> Result<Self> {
        let cfg = ckpt.config();
        let (Some(experts), Some(shard)) = (cfg.experts, plan.experts.as_ref()) else {
            return Err(ModelError::Config(format!(
                "layer {l} has no experts to load (a dense config or plan)"
            )));
        };
        let router = ckpt.vector(WeightName::Router(l), None)?; // [count, hidden]
        let selection_bias = match ckpt.meta(WeightName::RouterBias(l)) {
            Ok(_) => ckpt.vector(WeightName::RouterBias(l), None)?, // [count]
            Err(_) => Vec::new(),
        };
        if !selection_bias.is_empty() && selection_bias.len() != experts.count {
            return Err(ModelError::Config(format!(
                "layer {l}'s router bias has {} values for {} experts",
                selection_bias.len(),
                experts.count
            )));
        }
        let mut local = Vec::new();
        for e in shard.local.clone() {
            let cols = shard.expert_cols(e);
            let gate_up = Projection::new(
                vec![
                    (ckpt.rows(WeightName::ExpertGate(l, e), cols.clone())?, None),
                    (ckpt.rows(WeightName::ExpertUp(l, e), cols.clone())?, None),
                ],
                opts,
            )?;
            let down = Matrix::from_row_parallel_slice(
                ckpt.cols(WeightName::ExpertDown(l, e), cols)?,
                shard.ffn_unit,
                opts,
            )?;
            local.push(Expert {
                index: e,
                gate_up,
                down,
            });
        }
        let shared = match &shard.shared {
            Some((_, unit)) => {
                let cols = shard.shared_cols(plan.tp_rank);
                Some(Shared {
                    gate: ckpt.vector(WeightName::SharedExpertGate(l), None)?,
                    gate_up: Projection::new(
                        vec![
                            (ckpt.rows(WeightName::SharedGate(l), cols.clone())?, None),
                            (ckpt.rows(WeightName::SharedUp(l), cols.clone())?, None),
                        ],
                        opts,
                    )?,
                    down: Matrix::from_row_parallel_slice(
                        ckpt.cols(WeightName::SharedDown(l), cols)?,
                        *unit,
                        opts,
                    )?,
                })
            }
            None => None,
        };
        Ok(MoeLayer {
            experts,
            hidden: cfg.hidden,
            activation: cfg.block.activation,
            router,
            selection_bias,
            local,
            shared,
            capacity: opts.expert_capacity,
        })
    }

    /// Bytes of weights this rank holds for the layer.
    pub(crate) fn bytes(&self) -> usize {
        self.expert_bytes() + self.router.len() * 4 + self.shared_bytes()
    }

    fn expert_bytes(&self) -> usize {
        self.local
            .iter()
            .map(|e| e.gate_up.bytes() + e.down.bytes())
            .sum()
    }

    fn shared_bytes(&self) -> usize {
        self.shared
            .as_ref()
            .map_or(0, |s| s.gate_up.bytes() + s.down.bytes() + s.gate.len() * 4)
    }

    /// Bytes streamed per decoded token on average: the router, the shared expert, and the
    /// active share (`per_token / count`) of this rank's experts.
    pub(crate) fn streamed_bytes_per_token(&self) -> usize {
        let active = self.expert_bytes() * self.experts.per_token / self.experts.count.max(1);
        active + self.router.len() * 4 + self.shared_bytes()
    }

    /// Each token's experts and weights: `[n][per_token]` pairs, best first.
    pub(crate) fn route(&self, xn: &[f32], n: usize) -> Vec<Vec<(usize, f32)>> {
        route(
            &self.router,
            &self.selection_bias,
            &self.experts,
            xn,
            n,
            self.hidden,
        )
    }

    /// Adds the layer's output for `xn [n, hidden]` into `partial [n, hidden]` (this rank's
    /// share; the block's all-reduce sums the ranks).
    pub(crate) fn forward(
        &self,
        xn: &[f32],
        n: usize,
        partial: &mut [f64],
        prof: &mut Profile,
    ) -> Result<()> {
        let h = self.hidden;
        let mut routes = self.route(xn, n);
        if let Some(f) = self.capacity {
            let cap = f.capacity(n, self.experts.per_token, self.experts.count);
            // The routing is replicated: every rank drops the same pairs.
            let dropped = drop_over(&mut routes, cap, self.experts.count);
            prof.count_dropped(&dropped);
        }
        prof.count_routes(&routes, self.experts.count);
        // Tokens of each local expert, with their weights.
        for ex in &self.local {
            let picked: Vec<(usize, f32)> = routes
                .iter()
                .enumerate()
                .filter_map(|(t, r)| r.iter().find(|(e, _)| *e == ex.index).map(|p| (t, p.1)))
                .collect();
            prof.expert_rows += picked.len() as u64;
            for group in picked.chunks(ROWS) {
                let m = group.len();
                let mut xs = Vec::with_capacity(m * h); // [m, hidden]
                for &(t, _) in group {
                    xs.extend_from_slice(&xn[t * h..(t + 1) * h]);
                }
                let weights: Vec<f32> = group.iter().map(|p| p.1).collect();
                let mut out = vec![0f64; m * h]; // [m, hidden]
                self.mlp(&ex.gate_up, &ex.down, &xs, &weights, &mut out)?;
                for (i, &(t, _)) in group.iter().enumerate() {
                    for (a, b) in partial[t * h..(t + 1) * h]
                        .iter_mut()
                        .zip(&out[i * h..(i + 1) * h])
                    {
                        *a += *b;
                    }
                }
            }
        }
        if let Some(s) = &self.shared {
            for t0 in (0..n).step_by(ROWS) {
                let m = ROWS.min(n - t0);
                let xs = &xn[t0 * h..(t0 + m) * h]; // [m, hidden]
                let weights: Vec<f32> = xs
                    .chunks_exact(h)
                    .map(|x| sigmoid(dot(x, &s.gate)))
                    .collect();
                let out = &mut partial[t0 * h..(t0 + m) * h]; // [m, hidden]
                self.mlp(&s.gate_up, &s.down, xs, &weights, out)?;
            }
        }
        Ok(())
    }

    /// `out [m, hidden] += down(act(gate(xs)) * up(xs) * w)`, each row's activations scaled
    /// by its weight before the row-parallel product.
    fn mlp(
        &self,
        gate_up: &Projection,
        down: &Matrix,
        xs: &[f32],
        weights: &[f32],
        out: &mut [f64],
    ) -> Result<()> {
        let m = weights.len();
        let cols = down.cols();
        let mut gu = vec![0f32; m * 2 * cols]; // [m, 2 cols]
        gate_up.forward(xs, m, &mut gu)?;
        let mut act = vec![0f32; m * cols]; // [m, cols]
        for (t, row) in gu.chunks_exact_mut(2 * cols).enumerate() {
            let (g, u) = row.split_at_mut(cols);
            match self.activation {
                Activation::Silu => silu_mul(g, u),
                Activation::GeluTanh => gelu_tanh_mul(g, u),
            }
            for (a, v) in act[t * cols..(t + 1) * cols].iter_mut().zip(g.iter()) {
                *a = v * weights[t];
            }
        }
        down.matmul_wide_acc(&act, m, out)
    }
}

/// `x . w` accumulated in f64, rounded to f32 (the same bits on every rank).
fn dot(x: &[f32], w: &[f32]) -> f32 {
    x.iter()
        .zip(w)
        .map(|(a, b)| f64::from(*a) * f64::from(*b))
        .sum::<f64>() as f32
}

fn sigmoid(x: f32) -> f32 {
    (1.0 / (1.0 + (-f64::from(x)).exp())) as f32
}

/// The router of `experts` over `xn [n, hidden]` with weights `router [count, hidden]`: per
/// token the `per_token` best experts (ties to the lower index) and their weights (softmax over
/// all experts, or sigmoid; divided by their sum when the family normalises). A `bias`
/// (`[count]`, empty: none) is added to the probabilities for the choice only; the weights
/// stay the unbiased probabilities (the aux-loss-free bias, as training applies it).
pub(crate) fn route(
    router: &[f32],
    bias: &[f32],
    experts: &Experts,
    xn: &[f32],
    n: usize,
    hidden: usize,
) -> Vec<Vec<(usize, f32)>> {
    let count = experts.count;
    (0..n)
        .map(|t| {
            let x = &xn[t * hidden..(t + 1) * hidden];
            let scores: Vec<f64> = (0..count)
                .map(|e| f64::from(dot(x, &router[e * hidden..(e + 1) * hidden])))
                .collect();
            let probs: Vec<f64> = match experts.gating {
                Gating::Softmax => {
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = exps.iter().sum();
                    exps.iter().map(|e| e / sum).collect()
                }
                Gating::Sigmoid => scores.iter().map(|s| 1.0 / (1.0 + (-s).exp())).collect(),
            };
            let order = if bias.is_empty() {
                experts.top_k(&probs)
            } else {
                let biased: Vec<f64> = probs
                    .iter()
                    .zip(bias)
                    .map(|(p, b)| p + f64::from(*b))
                    .collect();
                experts.top_k(&biased)
            };
            let total: f64 = order.iter().map(|&e| probs[e]).sum();
            order
                .into_iter()
                .map(|e| {
                    let w = if experts.normalize {
                        probs[e] / total
                    } else {
                        probs[e]
                    };
                    (e, w as f32)
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_router_picks_the_best_experts_and_weighs_them_as_the_family_does() {
        // 4 experts over hidden 2: scores are x . row.
        let router = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, -1.0, 0.0];
        let x = [2.0f32, 1.0]; // scores 2, 1, 3, -2
        let mut e = Experts::new(4, 2);
        let r = route(&router, &[], &e, &x, 1, 2);
        assert_eq!(r[0].iter().map(|p| p.0).collect::<Vec<_>>(), [2, 0]);
        // Normalised: softmax over the two picked = 1 / (1 + e^-1) and its complement.
        let w0 = 1.0 / (1.0 + (-1.0f64).exp());
        assert!((f64::from(r[0][0].1) - w0).abs() < 1e-6, "{r:?}");
        assert!((r[0][0].1 + r[0][1].1 - 1.0).abs() < 1e-6);
        // Not normalised: the softmax over all four.
        e.normalize = false;
        let r = route(&router, &[], &e, &x, 1, 2);
        let z: f64 = [2.0f64, 1.0, 3.0, -2.0].iter().map(|s| s.exp()).sum();
        assert!(
            (f64::from(r[0][0].1) - 3f64.exp() / z).abs() < 1e-6,
            "{r:?}"
        );
        // A bias moves the choice, not the weights: +1 on expert 3 (score -2) ranks it first
        // and leaves expert 0 out; it is weighed by its own probability.
        let r = route(&router, &[0.0, 0.0, 0.0, 1.0], &e, &x, 1, 2);
        assert_eq!(r[0].iter().map(|p| p.0).collect::<Vec<_>>(), [3, 2]);
        assert!(
            (f64::from(r[0][0].1) - (-2f64).exp() / z).abs() < 1e-6,
            "{r:?}"
        );
        // Ties go to the lower expert.
        let r = route(&[0.0; 8], &[], &Experts::new(4, 2), &x, 1, 2);
        assert_eq!(r[0].iter().map(|p| p.0).collect::<Vec<_>>(), [0, 1]);
    }
}
