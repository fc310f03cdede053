//! Parallel causal self-attention split by heads, GQA-aware (Megatron §3, Fig. 3b;
//! grouped-query attention after Ainslie et al. 2023).
//!
//! Q, K, V are column-parallel over the rank's query heads and the KV heads they need; the
//! output projection is row-parallel over the query heads, so its result is a [`PartialSum`].
//! With Qwen3's q/k norms ([`ParallelAttention::with_qk_norm`]) each query and key head is
//! RMS-normalised over its `head_dim` before RoPE; the norm weights are replicated, and each
//! rank's gradient of them covers only its own heads (the trainer sums it over tp).
//! Qwen2's Q/K/V biases ([`ParallelAttention::with_qkv_bias`]) are added after the
//! projections, before RoPE; each rank holds the entries of its own Q/K/V rows (a KV head's
//! on every rank that holds the head, whose gradients the trainer sums like the K/V rows').
//! Gemma-3's layers set the query scale and, on local layers, a sliding window
//! ([`ParallelAttention::with_scores`]).

use crate::attention_core::{core, core_recomputed};
use crate::error::{Result, TpError};
use crate::linear::{ColumnParallelLinear, PartialSum, RowParallelLinear};
use crate::norm::RmsNorm;
use crate::packing::Segments;
use crate::rope::Rope;
use candle_core::{Device, Tensor, Var};
use tp_comm::Group;
use tp_spec::{HeadPlan, Partition};

#[derive(Debug)]
pub struct ParallelAttention {
    plan: HeadPlan,
    head_dim: usize,
    wq: ColumnParallelLinear,
    wk: ColumnParallelLinear,
    wv: ColumnParallelLinear,
    wo: RowParallelLinear,
    /// Qwen3's per-head RMSNorms `(q_norm, k_norm)`, weights `[head_dim]` each.
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    /// What the scores `q . k` are multiplied by (`1 / sqrt(head_dim)` unless set).
    scale: f64,
    /// Positions a query sees, its own included (`None`: every earlier one).
    window: Option<usize>,
    /// Keep only q, k, v of the attention core for the backward and recompute its `[s, s]`
    /// parts there (selective recomputation, [`crate::attention_core`]).
    recompute_core: bool,
}

/// `[seq, seq]` additive causal mask: 0 on and below the diagonal, -inf above.
pub fn causal_mask(seq: usize, device: &Device) -> Result<Tensor> {
    window_mask(seq, None, device)
}

/// `[seq, seq]` additive mask of causal attention through a window of `window` positions:
/// query `i` sees keys `i + 1 - window ..= i` (0), the rest are -inf; `None`: plain causal.
pub fn window_mask(seq: usize, window: Option<usize>, device: &Device) -> Result<Tensor> {
    let w = window.unwrap_or(usize::MAX);
    let mask: Vec<f32> = (0..seq)
        .flat_map(|i| {
            (0..seq).map(move |j| {
                if j > i || i - j >= w {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (seq, seq), device)?)
}

impl ParallelAttention {
    /// Slices the global `wq [heads*hd, hidden]`, `wk`/`wv [kv_heads*hd, hidden]` and
    /// `wo [hidden, heads*hd]` for `tp_rank`.
    #[allow(clippy::too_many_arguments)]
    pub fn from_global(
        wq: &Tensor,
        wk: &Tensor,
        wv: &Tensor,
        wo: &Tensor,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        tp_rank: usize,
        tp: usize,
    ) -> Result<Self> {
        let plan = HeadPlan::new(heads, kv_heads, tp_rank, tp)?;
        let kv_sizes: Vec<usize> = (0..tp)
            .map(|r| HeadPlan::new(heads, kv_heads, r, tp).map(|p| p.kv_range().len() * head_dim))
            .collect::<std::result::Result<_, _>>()?;
        let wq = ColumnParallelLinear::from_global_units(wq, &plan.q, head_dim, tp_rank)?;
        let wk = ColumnParallelLinear::from_global_rows(
            wk,
            plan.kv_range(),
            head_dim,
            tp_rank,
            kv_sizes.clone(),
        )?;
        let wv = ColumnParallelLinear::from_global_rows(
            wv,
            plan.kv_range(),
            head_dim,
            tp_rank,
            kv_sizes,
        )?;
        let wo = RowParallelLinear::from_global_units(wo, &plan.q, head_dim, tp_rank)?;
        Ok(ParallelAttention {
            plan,
            head_dim,
            wq,
            wk,
            wv,
            wo,
            qk_norm: None,
            scale: 1.0 / (head_dim as f64).sqrt(),
            window: None,
            recompute_core: false,
        })
    }

    /// Scores multiplied by `scale` (`None`: `1 / sqrt(head_dim)`), and causal attention
    /// through a window of `window` positions (`None`: none; 0 is refused).
    pub fn with_scores(mut self, scale: Option<f64>, window: Option<usize>) -> Result<Self> {
        if window == Some(0) {
            return Err(TpError::Config(
                "a sliding window must hold at least one position".into(),
            ));
        }
        if let Some(s) = scale {
            if !(s.is_finite() && s > 0.0) {
                return Err(TpError::Config(format!(
                    "the query scale {s} must be a positive number"
                )));
            }
            self.scale = s;
        }
        self.window = window;
        Ok(self)
    }

    /// Adds Qwen3's per-head RMSNorms: `q_norm` and `k_norm` are the (replicated) global
    /// weights `[head_dim]`, shared by every query / key head; with `unit_offset` they are
    /// Gemma's (`x * (1 + w)`, [`RmsNorm::from_global_offset`]).
    pub fn with_qk_norm(
        mut self,
        q_norm: &Tensor,
        k_norm: &Tensor,
        eps: f64,
        unit_offset: bool,
    ) -> Result<Self> {
        for (name, w) in [("q_norm", q_norm), ("k_norm", k_norm)] {
            if w.dims() != [self.head_dim] {
                return Err(TpError::Shape(format!(
                    "{name} must be [head_dim] = [{}], got {:?}",
                    self.head_dim,
                    w.dims()
                )));
            }
        }
        self.qk_norm = Some((
            RmsNorm::from_global_offset(q_norm, eps, unit_offset)?,
            RmsNorm::from_global_offset(k_norm, eps, unit_offset)?,
        ));
        Ok(self)
    }

    /// Adds Qwen2's Q/K/V biases: `bq [q_local]`, `bk`, `bv [kv_local]` are this rank's
    /// shards, the entries of the rows its wq, wk, wv hold (cut where the parameter table
    /// places them: the same heads).
    pub fn with_qkv_bias(mut self, bq: &Tensor, bk: &Tensor, bv: &Tensor) -> Result<Self> {
        self.wq = self.wq.with_bias(bq)?;
        self.wk = self.wk.with_bias(bk)?;
        self.wv = self.wv.with_bias(bv)?;
        Ok(self)
    }

    /// The Q/K/V bias shards, when the attention has them.
    pub fn qkv_bias_vars(&self) -> Option<[&Var; 3]> {
        match (self.wq.bias(), self.wk.bias(), self.wv.bias()) {
            (Some(q), Some(k), Some(v)) => Some([q, k, v]),
            _ => None,
        }
    }

    /// Selective activation recomputation: the backward recomputes the attention core (scores,
    /// softmax, weighted sum of V) instead of keeping its `[s, s]` tensors from the forward.
    /// The results are bitwise those without it.
    pub fn set_recompute_core(&mut self, on: bool) {
        self.recompute_core = on;
    }

    /// The per-head norms' weights `(q_norm, k_norm)`, when the attention has them.
    pub fn qk_norm_vars(&self) -> Option<[(&'static str, &Var); 2]> {
        self.qk_norm
            .as_ref()
            .map(|(q, k)| [("q_norm", q.weight()), ("k_norm", k.weight())])
    }

    pub fn plan(&self) -> &HeadPlan {
        &self.plan
    }

    pub fn query_partition(&self) -> &Partition {
        &self.plan.q
    }

    /// `(name, var)` of every weight shard: wq, wk, wv, wo.
    pub fn vars(&self) -> [(&'static str, &Var); 4] {
        [
            ("wq", self.wq.weight()),
            ("wk", self.wk.weight()),
            ("wv", self.wv.weight()),
            ("wo", self.wo.weight()),
        ]
    }

    /// `x_par [batch, seq, hidden]` inside the parallel region (after f or a sequence
    /// gather), positions `offset..offset+seq` -> this rank's partial output.
    pub fn forward_local(
        &self,
        x_par: &Tensor,
        rope: &Rope,
        offset: usize,
        group: &Group,
    ) -> Result<PartialSum> {
        self.forward_packed(x_par, rope, offset, None, group)
    }

    /// [`ParallelAttention::forward_local`], or with `segments` over packed sequences (the
    /// whole `[batch, seq]`): each token rotated by its position in its document (`offset`
    /// unused) and attention block-diagonal causal ([`Segments::mask`]).
    pub fn forward_packed(
        &self,
        x_par: &Tensor,
        rope: &Rope,
        offset: usize,
        segments: Option<&Segments>,
        group: &Group,
    ) -> Result<PartialSum> {
        let (b, s, _) = x_par.dims3()?;
        let hd = self.head_dim;
        let hq_local = self.plan.q_range().len();
        let hkv_local = self.plan.kv_range().len();
        // With Qwen2's biases added, before the q/k norms and RoPE.
        let q = self.wq.forward_local(x_par)?; // [b, s, hq_local * hd]
        let k = self.wk.forward_local(x_par)?; // [b, s, hkv_local * hd]
        let v = self.wv.forward_local(x_par)?; // [b, s, hkv_local * hd]
        let q = q.reshape((b, s, hq_local, hd))?; // [b, s, hq_local, hd]
        let k = k.reshape((b, s, hkv_local, hd))?; // [b, s, hkv_local, hd]
        let (q, k) = match &self.qk_norm {
            // Each head normalised over its head_dim, before RoPE.
            Some((qn, kn)) => (qn.forward(&q)?, kn.forward(&k)?), // [b, s, h_local, hd]
            None => (q, k),
        };
        let q = q.transpose(1, 2)?.contiguous()?; // [b, hq_local, s, hd]
        let k = k.transpose(1, 2)?.contiguous()?; // [b, hkv_local, s, hd]
        let v = v
            .reshape((b, s, hkv_local, hd))?
            .transpose(1, 2)?
            .contiguous()?; // [b, hkv_local, s, hd]
        let (q, k, mask) = match segments {
            Some(seg) => (
                rope.apply_packed(&q, seg)?,            // [b, hq_local, s, hd]
                rope.apply_packed(&k, seg)?,            // [b, hkv_local, s, hd]
                seg.mask(self.window, x_par.device())?, // [b, 1, s, s]
            ),
            None => (
                rope.apply(&q, offset)?,                      // [b, hq_local, s, hd]
                rope.apply(&k, offset)?,                      // [b, hkv_local, s, hd]
                window_mask(s, self.window, x_par.device())?, // [s, s]
            ),
        };
        let kv_of_q = self.plan.local_kv_of_q();
        let idx = Tensor::from_vec(kv_of_q, hq_local, x_par.device())?; // [hq_local]
        let k = k.index_select(&idx, 1)?.contiguous()?; // [b, hq_local, s, hd]
        let v = v.index_select(&idx, 1)?.contiguous()?; // [b, hq_local, s, hd]
        let ctx = if self.recompute_core {
            core_recomputed(&q, &k, &v, self.scale, &mask)? // [b, hq_local, s, hd]
        } else {
            core(&q, &k, &v, self.scale, &mask)? // [b, hq_local, s, hd]
        };
        let ctx = ctx
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b, s, hq_local * hd))?; // [b, s, hq_local * hd]
        if ctx.dim(2)? != self.wo.weight().dim(1)? {
            return Err(TpError::Shape(
                "attention context width does not match wo".into(),
            ));
        }
        self.wo.forward(&ctx, group)
    }
}
