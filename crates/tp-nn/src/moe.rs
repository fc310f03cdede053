//! A mixture-of-experts MLP for training (docs/moe.md), on one rank of the tp group, with
//! exact gradients through candle's autograd, router included. The router is replicated; the
//! experts are placed by [`ExpertShard`] (whole experts per expert group, each sliced by FFN
//! columns inside its group, like the dense MLP); the output is this rank's [`PartialSum`],
//! summed by the block's one all-reduce (g). Tokens are grouped by expert: each local expert
//! runs once on the rows routed to it (`index_select`), and its weighted outputs are added
//! back to those rows (`index_add`), both differentiable, so an expert costs what its tokens
//! cost (k/E of running every expert on every token).
//!
//! Gradients over the tp group: the router weights reach the loss through every rank's partial
//! output, so each rank's router gradient is its share (the sum over the group is the whole,
//! as for the q/k norms). The load-balancing loss is computed whole on every rank from the
//! replicated router, so each rank backpropagates `aux / tp`: summed over the group (the
//! router gradient, and the input's through f's all-reduce) it counts once.

use crate::dispatch::Dispatch;
use crate::error::{Result, TpError};
use crate::linear::PartialSum;
use candle_core::{Tensor, Var, D};
use tp_comm::Group;
use tp_spec::{drop_over, Activation, CapacityFactor, ExpertShard, Experts, Gating};

/// One expert's columns on this rank.
#[derive(Debug)]
pub(crate) struct Expert {
    pub(crate) index: usize,
    gate: Var, // [cols, hidden]
    up: Var,   // [cols, hidden]
    down: Var, // [hidden, cols]
}

/// The forward's results: this rank's partial output, the load-balancing loss to add to the
/// training loss on this rank (`aux / tp`), and the whole loss's value for reports.
#[derive(Debug)]
pub struct MoeOutput {
    pub partial: PartialSum,
    /// `aux / tp`: add it to this rank's loss before `backward`.
    pub aux_share: Tensor,
    /// The load-balancing loss `E * sum_e f_e * P_e` (Switch Transformer; 1 when balanced).
    pub aux: f32,
    /// (token, expert) pairs the capacity factor dropped, per expert (`[count]`; zeros
    /// without a capacity).
    pub dropped: Vec<u64>,
}

/// How [`route`] picks experts beyond the family's rule: the default routes every token to
/// its top-k experts.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouteOptions {
    /// The aux-loss-free load-balancing bias (DeepSeek-V3; Wang et al. 2024), one per expert
    /// (empty: none): added to the router probabilities for the top-k *selection only*; the
    /// weights stay the unbiased probabilities, so the bias gets no gradient.
    pub bias: Vec<f32>,
    /// Each expert takes at most `ceil(f x n x k / E)` of the step's (token, expert) pairs in
    /// token order ([`CapacityFactor`], the rule inference follows); the later ones are
    /// dropped, the token keeping its other experts with their weights unchanged.
    pub capacity: Option<CapacityFactor>,
}

/// A tensor-parallel mixture of experts.
#[derive(Debug)]
pub struct ParallelMoe {
    experts: Experts,
    activation: Activation,
    router: Var, // [count, hidden], replicated
    local: Vec<Expert>,
    /// Another group's expert's gate or up shard here (`[0, hidden]`) and its down
    /// (`[hidden, 0]`): the table's empty placement, held so every rank lists every parameter.
    empty_rows: Var,
    empty_cols: Var,
    tp: usize,
    /// Expert parallelism across data-parallel replicas: tokens dispatched by all-to-all
    /// ([`ParallelMoe::with_dispatch`]); `None` when every token stays on its rank.
    dispatch: Option<Dispatch>,
    routing: RouteOptions,
    /// Tokens routed to each expert since [`ParallelMoe::take_load`] (`[count]`).
    load: std::sync::Mutex<Vec<u64>>,
}

impl ParallelMoe {
    /// From the global router `[count, hidden]` and every expert's global gate and up
    /// `[ffn, hidden]` and down `[hidden, ffn]`, this rank's part by `shard`.
    pub fn from_global(
        router: &Tensor,
        experts: Experts,
        weights: &[(Tensor, Tensor, Tensor)],
        shard: &ExpertShard,
        tp: usize,
        activation: Activation,
    ) -> Result<Self> {
        if weights.len() != experts.count || router.dims2()?.0 != experts.count {
            return Err(TpError::Config(format!(
                "{} experts' weights and a router of {:?} for {} experts",
                weights.len(),
                router.dims(),
                experts.count
            )));
        }
        if shard.shared.is_some() {
            return Err(TpError::Config(
                "a shared expert is not built in the training layer yet".into(),
            ));
        }
        let mut local = Vec::new();
        for e in shard.local.clone() {
            let cols = shard.expert_cols(e);
            let (g, u, d) = &weights[e];
            local.push(Expert {
                index: e,
                gate: Var::from_tensor(&g.narrow(0, cols.start, cols.len())?.contiguous()?)?,
                up: Var::from_tensor(&u.narrow(0, cols.start, cols.len())?.contiguous()?)?,
                down: Var::from_tensor(&d.narrow(1, cols.start, cols.len())?.contiguous()?)?,
            });
        }
        let hidden = router.dims2()?.1;
        let empty = |dims: (usize, usize)| Var::zeros(dims, router.dtype(), router.device());
        Ok(ParallelMoe {
            experts,
            activation,
            router: Var::from_tensor(&router.copy()?)?,
            local,
            empty_rows: empty((0, hidden))?,
            empty_cols: empty((hidden, 0))?,
            tp,
            routing: RouteOptions::default(),
            load: std::sync::Mutex::new(vec![0; experts.count]),
            dispatch: None,
        })
    }

    /// This layer with its tokens dispatched over `group`, the ranks of this rank's ep block
    /// with its tp index (docs/moe.md "Expert parallelism in training"): `peers[e]` is the
    /// rank of `group` holding expert `e` whole, `None` for an expert a rank of another tp
    /// index holds. The layer must have been built with this rank's whole experts.
    pub fn with_dispatch(mut self, group: Group, peers: Vec<Option<usize>>) -> Result<Self> {
        self.dispatch = Some(Dispatch::new(group, peers, &self)?);
        Ok(self)
    }

    /// Rows this rank's experts computed in trained micro-batches so far, with tokens
    /// dispatched ([`ParallelMoe::with_dispatch`]); `None` without.
    pub fn dispatched_rows(&self) -> Option<u64> {
        self.dispatch.as_ref().map(Dispatch::rows)
    }

    /// The experts' count and routing rule.
    pub fn experts(&self) -> &Experts {
        &self.experts
    }

    /// `(index, cols)` of each local expert's shard.
    pub(crate) fn local(&self) -> &[Expert] {
        &self.local
    }

    /// `x [m, hidden]` (the rows routed to local expert `e`) through its shard: `[m, hidden]`.
    pub(crate) fn run_expert(&self, e: &Expert, x: &Tensor) -> Result<Tensor> {
        let g = x.matmul(&e.gate.as_tensor().t()?)?; // [m, cols]
        let u = x.matmul(&e.up.as_tensor().t()?)?; // [m, cols]
        let a = match self.activation {
            Activation::Silu => g.silu()?,
            Activation::GeluTanh => g.gelu()?,
        };
        Ok((a * u)?.matmul(&e.down.as_tensor().t()?)?) // [m, hidden]
    }

    /// A zero scalar that depends on idle expert `e`'s weights, so an expert no token chose
    /// stays in the graph with a zero gradient (a product with a zero tensor; candle prunes a
    /// multiplication by the constant 0).
    pub(crate) fn idle(e: &Expert) -> Result<Tensor> {
        let sum = (e.gate.as_tensor().sum_all()? + e.up.as_tensor().sum_all()?)?;
        let sum = (sum + e.down.as_tensor().sum_all()?)?;
        let zero = sum.zeros_like()?;
        Ok((sum * zero)?)
    }

    /// This layer routing with `routing` (a capacity factor).
    pub fn with_routing(mut self, routing: RouteOptions) -> Self {
        self.set_routing(routing);
        self
    }

    /// Routes with `routing` from now on.
    pub fn set_routing(&mut self, routing: RouteOptions) {
        self.routing = routing;
    }

    /// Selects experts with the aux-loss-free `bias` (`[count]`) from now on.
    pub fn set_selection_bias(&mut self, bias: Vec<f32>) {
        self.routing.bias = bias;
    }

    /// The tokens routed to each expert (`[count]`, before capacity drops) by the forwards
    /// since the last call, and starts counting anew.
    pub fn take_load(&self) -> Vec<u64> {
        let mut load = self.load.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *load, vec![0; self.experts.count])
    }

    /// The router (replicated; its gradient is partial per rank).
    pub fn router(&self) -> &Var {
        &self.router
    }

    /// This rank's shard of expert `e`'s gate (`which` 0), up (1) or down (2): an empty
    /// tensor for an expert of another group.
    pub fn expert_var(&self, e: usize, which: usize) -> &Var {
        match (self.local.iter().find(|x| x.index == e), which) {
            (Some(x), 0) => &x.gate,
            (Some(x), 1) => &x.up,
            (Some(x), _) => &x.down,
            (None, 0 | 1) => &self.empty_rows,
            (None, _) => &self.empty_cols,
        }
    }

    /// `(expert, gate, up, down)` of each local expert's shard.
    pub fn expert_vars(&self) -> Vec<(usize, &Var, &Var, &Var)> {
        self.local
            .iter()
            .map(|e| (e.index, &e.gate, &e.up, &e.down))
            .collect()
    }

    /// `x_par [n, hidden]` inside the parallel region (after f) -> this rank's partial
    /// `[n, hidden]` and the load-balancing loss.
    pub fn forward_local(&self, x_par: &Tensor, group: &Group) -> Result<MoeOutput> {
        let (probs, weights, counts, dropped) =
            route(x_par, self.router.as_tensor(), &self.experts, &self.routing)?;
        {
            let mut load = self.load.lock().unwrap_or_else(|e| e.into_inner());
            for (l, &c) in load.iter_mut().zip(&counts) {
                *l += c as u64;
            }
        }
        if let Some(d) = &self.dispatch {
            let routed = Routed {
                probs,
                weights,
                counts,
                dropped,
            };
            return d.forward(self, x_par, group, routed);
        }
        let picked: Vec<Vec<f32>> = weights.to_vec2()?; // [n][count]
        let mut out = x_par.zeros_like()?; // [n, hidden]
        for e in &self.local {
            let rows: Vec<u32> = (0..picked.len() as u32)
                .filter(|&t| picked[t as usize][e.index] != 0.0)
                .collect();
            if rows.is_empty() {
                out = out.broadcast_add(&Self::idle(e)?)?;
                continue;
            }
            let ids = Tensor::from_vec(rows.clone(), rows.len(), x_par.device())?; // [m]
            let x = x_par.index_select(&ids, 0)?; // [m, hidden]
            let y = self.run_expert(e, &x)?; // [m, hidden]
            let w = weights.index_select(&ids, 0)?.narrow(1, e.index, 1)?; // [m, 1]
            out = out.index_add(&ids, &y.broadcast_mul(&w)?, 0)?; // [n, hidden]
        }
        let aux = balance_loss(&probs, &counts, &self.experts)?;
        let value = aux.to_scalar::<f32>()?;
        Ok(MoeOutput {
            partial: PartialSum::new(out, group),
            aux_share: (aux / self.tp as f64)?,
            aux: value,
            dropped,
        })
    }
}

/// One forward's routing ([`route`]'s results), handed to the dispatch of expert parallelism
/// across replicas.
pub(crate) struct Routed {
    pub probs: Tensor,   // [n, count]
    pub weights: Tensor, // [n, count]
    pub counts: Vec<usize>,
    pub dropped: Vec<u64>,
}

/// Router probabilities `[n, count]`, the top-k weights `[n, count]` (zero for experts a
/// token is not routed to or whose pair `opts`' capacity dropped; divided by the sum over
/// the top-k when the family normalises, dropped pairs included), the tokens routed to each
/// expert (before any drop: the load-balancing loss's `f_e`) and the pairs dropped per
/// expert. Top-k picks the highest probabilities, ties to the lower expert.
pub fn route(
    x: &Tensor,
    router: &Tensor,
    experts: &Experts,
    opts: &RouteOptions,
) -> Result<(Tensor, Tensor, Vec<usize>, Vec<u64>)> {
    let scores = x.matmul(&router.t()?)?; // [n, count]
    let probs = match experts.gating {
        Gating::Softmax => candle_nn::ops::softmax(&scores, D::Minus1)?,
        Gating::Sigmoid => candle_nn::ops::sigmoid(&scores)?,
    }; // [n, count]
    let rows: Vec<Vec<f32>> = probs.to_vec2()?;
    let count = experts.count;
    let mut mask = vec![0f32; rows.len() * count]; // [n, count]
    let mut counts = vec![0usize; count];
    let mut routes: Vec<Vec<(usize, f32)>> = Vec::with_capacity(rows.len()); // [n][k]
    for (t, p) in rows.iter().enumerate() {
        let p: Vec<f64> = p
            .iter()
            .enumerate()
            .map(|(e, &x)| f64::from(x) + opts.bias.get(e).map_or(0.0, |&b| f64::from(b)))
            .collect(); // biased for the selection only
        let top = experts.top_k(&p);
        for &e in &top {
            mask[t * count + e] = 1.0;
            counts[e] += 1;
        }
        routes.push(top.into_iter().map(|e| (e, 1.0)).collect());
    }
    let n = rows.len();
    let dropped = match opts.capacity {
        Some(f) => drop_over(&mut routes, f.capacity(n, experts.per_token, count), count),
        None => vec![0; count],
    };
    let mask = Tensor::from_vec(mask, (n, count), x.device())?;
    let picked = (&probs * mask)?; // [n, count]
    let mut weights = if experts.normalize {
        picked.broadcast_div(&picked.sum_keepdim(1)?)?
    } else {
        picked
    };
    if dropped.iter().any(|&d| d > 0) {
        let mut keep = vec![0f32; n * count]; // [n, count]
        for (t, r) in routes.iter().enumerate() {
            for &(e, _) in r {
                keep[t * count + e] = 1.0;
            }
        }
        weights = (weights * Tensor::from_vec(keep, (n, count), x.device())?)?;
    }
    Ok((probs, weights, counts, dropped))
}

/// Switch Transformer's load-balancing loss `E * sum_e f_e * P_e`: `f_e` the fraction of
/// routed (token, expert) pairs that went to `e` (a constant), `P_e` the mean router
/// probability of `e` (differentiable).
pub fn balance_loss(probs: &Tensor, counts: &[usize], experts: &Experts) -> Result<Tensor> {
    let (n, count) = probs.dims2()?;
    let total = (n * experts.per_token).max(1) as f32;
    let f: Vec<f32> = counts.iter().map(|&c| c as f32 / total).collect();
    let f = Tensor::from_vec(f, (count,), probs.device())?;
    let p = probs.mean(0)?; // [count]
    Ok(((f * p)?.sum_all()? * count as f64)?)
}
