//! OLMoE's q/k norms over the whole projections (all heads at once), on a rank that holds only
//! some heads, with the same bits at every tp: each rank sums the squares of each of its heads,
//! one small all-reduce (max, over a `[n, heads + kv_heads]` table where every other rank's
//! heads are 0: exact and order-free, and a KV head replicated on several ranks gives the same
//! value everywhere) hands every rank every head's sum, and each rank adds them in head order.

use crate::error::Result;
use crate::ops::sum_squares;
use crate::profile::Profile;
use std::ops::Range;
use tp_comm::{CommExt, Group, ReduceOp};

/// Where this rank's heads sit in a row of the QKV projection and in the model.
pub(crate) struct WholeNorm<'a> {
    /// This rank's slice of the query norm's weights (`[q_local * hd]`) and of the key norm's
    /// (`[kv_local * hd]`).
    pub q_weight: &'a [f32],
    pub k_weight: &'a [f32],
    /// The model's query and KV head counts, and this rank's heads of each (global indices).
    pub heads: usize,
    pub kv_heads: usize,
    pub q_local: Range<usize>,
    pub kv_local: Range<usize>,
    pub head_dim: usize,
    pub eps: f32,
}

impl WholeNorm<'_> {
    /// Normalises the queries and keys of `qkv` (`[n, q_local*hd + 2 kv_local*hd]`: q, k, v
    /// per row) in place: `x * w / sqrt(mean(x^2 over all heads) + eps)`.
    pub fn apply(
        &self,
        qkv: &mut [f32],
        n: usize,
        group: &Group,
        prof: &mut Profile,
    ) -> Result<()> {
        let hd = self.head_dim;
        let (q_w, kv_w) = (self.q_weight.len(), self.k_weight.len());
        let row_w = q_w + 2 * kv_w;
        let all = self.heads + self.kv_heads;
        let mut sums = vec![0f64; n * all]; // [n, heads + kv_heads]
        for (row, s) in qkv.chunks_exact(row_w).zip(sums.chunks_exact_mut(all)) {
            for (i, h) in row[..q_w].chunks_exact(hd).enumerate() {
                s[self.q_local.start + i] = f64::from(sum_squares(h));
            }
            for (i, h) in row[q_w..q_w + kv_w].chunks_exact(hd).enumerate() {
                s[self.heads + self.kv_local.start + i] = f64::from(sum_squares(h));
            }
        }
        if group.size() > 1 {
            prof.all_reduce(group, |g| g.all_reduce(&mut sums, ReduceOp::Max))?;
            prof.sent_all_reduce(std::mem::size_of_val(sums.as_slice()), group.size());
        }
        let scale = |total: f64, width: usize| -> f32 {
            (1.0 / (total / width as f64 + f64::from(self.eps)).sqrt()) as f32
        };
        for (row, s) in qkv.chunks_exact_mut(row_w).zip(sums.chunks_exact(all)) {
            let sq = scale(s[..self.heads].iter().sum(), self.heads * hd);
            let sk = scale(s[self.heads..].iter().sum(), self.kv_heads * hd);
            let (q, rest) = row.split_at_mut(q_w);
            for (v, w) in q.iter_mut().zip(self.q_weight) {
                *v = *v * sq * w;
            }
            for (v, w) in rest[..kv_w].iter_mut().zip(self.k_weight) {
                *v = *v * sk * w;
            }
        }
        Ok(())
    }
}
