//! The attention core (scores `q k^T`, scale, causal/window mask, softmax, weighted sum of V:
//! the parts that grow with s^2) and its selectively recomputed form (Korthikanti et al. 2022
//! §5): one candle op whose graph node keeps only its inputs `q, k, v` (and its output), and
//! whose backward recomputes the core with a graph of its own to backpropagate through it.
//! Both forms run the same ops on the same values, so their results are bitwise equal. The
//! additive mask is the caller's: causal (`[s, s]`, with a window or not) or, for packed
//! sequences, block-diagonal causal per sequence (`[b, 1, s, s]`, [`crate::Segments::mask`]).

use candle_core::{CpuStorage, CustomOp3, Device, Layout, Shape, Tensor, Var, D};

/// `q, k, v [b, heads, s, hd]` (k and v already expanded to the query heads) and the
/// additive `mask [s, s]` or `[b, 1, s, s]` -> `ctx [b, heads, s, hd]`, with candle's graph
/// over every intermediate.
pub(crate) fn core(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: &Tensor,
) -> candle_core::Result<Tensor> {
    let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?; // [b, heads, s, s]
    let scores = scores.broadcast_add(mask)?; // [b, heads, s, s]
    let probs = candle_nn::ops::softmax(&scores, D::Minus1)?; // [b, heads, s, s]
    probs.matmul(v) // [b, heads, s, hd]
}

/// [`core`] as one op that keeps no `[s, s]` tensor for the backward (recomputes them).
pub(crate) fn core_recomputed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: &Tensor,
) -> candle_core::Result<Tensor> {
    let mask = mask.detach();
    q.apply_op3(k, v, RecomputedCore { scale, mask })
}

struct RecomputedCore {
    scale: f64,
    mask: Tensor, // [s, s] or [b, 1, s, s], graph-free
}

/// A contiguous f32 CPU storage as a graph-free tensor (a copy; another dtype is an error).
fn to_tensor(s: &CpuStorage, l: &Layout) -> candle_core::Result<Tensor> {
    let data = s.as_slice::<f32>()?;
    let (a, b) = l.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg("the recomputed attention core takes contiguous inputs".into())
    })?;
    Tensor::from_slice(&data[a..b], l.shape(), &Device::Cpu)
}

impl CustomOp3 for RecomputedCore {
    fn name(&self) -> &'static str {
        "recomputed-attention-core"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        // Graph-free inputs: the intermediates die when this returns.
        let (q, k, v) = (to_tensor(s1, l1)?, to_tensor(s2, l2)?, to_tensor(s3, l3)?);
        let ctx = core(&q, &k, &v, self.scale, &self.mask)?; // [b, heads, s, hd]
        let shape = ctx.shape().clone();
        Ok((CpuStorage::F32(ctx.flatten_all()?.to_vec1::<f32>()?), shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _ctx: &Tensor,
        grad_ctx: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The recompute: the core again on leaf copies of its inputs, with a graph, then the
        // vector-Jacobian product of grad_ctx through it (d/dx sum(ctx * grad_ctx)).
        let leaf = |t: &Tensor| Var::from_tensor(&t.detach());
        let (q, k, v) = (leaf(q)?, leaf(k)?, leaf(v)?);
        let ctx = core(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            self.scale,
            &self.mask,
        )?;
        let grads = (ctx * grad_ctx.detach())?.sum_all()?.backward()?;
        let get = |x: &Var| grads.get(x.as_tensor()).cloned();
        Ok((get(&q), get(&k), get(&v)))
    }
}
