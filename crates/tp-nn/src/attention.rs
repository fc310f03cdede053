//! Parallel causal self-attention split by heads, GQA-aware (Megatron §3, Fig. 3b;
//! grouped-query attention after Ainslie et al. 2023).
//!
//! Q, K, V are column-parallel over the rank's query heads and the KV heads they need; the
//! output projection is row-parallel over the query heads, so its result is a [`PartialSum`].

use crate::error::{Result, TpError};
use crate::linear::{ColumnParallelLinear, PartialSum, RowParallelLinear};
use crate::rope::Rope;
use candle_core::{Device, Tensor, Var, D};
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
}

/// `[seq, seq]` additive causal mask: 0 on and below the diagonal, -inf above.
pub fn causal_mask(seq: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..seq)
        .flat_map(|i| (0..seq).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
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
        })
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
        let (b, s, _) = x_par.dims3()?;
        let hd = self.head_dim;
        let hq_local = self.plan.q_range().len();
        let hkv_local = self.plan.kv_range().len();
        let q = self.wq.forward_local(x_par)?; // [b, s, hq_local * hd]
        let k = self.wk.forward_local(x_par)?; // [b, s, hkv_local * hd]
        let v = self.wv.forward_local(x_par)?; // [b, s, hkv_local * hd]
        let q = q
            .reshape((b, s, hq_local, hd))?
            .transpose(1, 2)?
            .contiguous()?; // [b, hq_local, s, hd]
        let k = k
            .reshape((b, s, hkv_local, hd))?
            .transpose(1, 2)?
            .contiguous()?; // [b, hkv_local, s, hd]
        let v = v
            .reshape((b, s, hkv_local, hd))?
            .transpose(1, 2)?
            .contiguous()?; // [b, hkv_local, s, hd]
        let q = rope.apply(&q, offset)?; // [b, hq_local, s, hd]
        let k = rope.apply(&k, offset)?; // [b, hkv_local, s, hd]
        let kv_of_q = self.plan.local_kv_of_q();
        let idx = Tensor::from_vec(kv_of_q, hq_local, x_par.device())?; // [hq_local]
        let k = k.index_select(&idx, 1)?.contiguous()?; // [b, hq_local, s, hd]
        let v = v.index_select(&idx, 1)?.contiguous()?; // [b, hq_local, s, hd]
        let scale = 1.0 / (hd as f64).sqrt();
        let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?; // [b, hq_local, s, s]
        let mask = causal_mask(s, x_par.device())?; // [s, s]
        let scores = scores.broadcast_add(&mask)?; // [b, hq_local, s, s]
        let probs = candle_nn::ops::softmax(&scores, D::Minus1)?; // [b, hq_local, s, s]
        let ctx = probs.matmul(&v)?; // [b, hq_local, s, hd]
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
