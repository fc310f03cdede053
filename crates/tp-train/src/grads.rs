//! Gradients of one rank: a contiguous buffer for all its shards (Megatron-LM's grad
//! buffer), accumulation over micro-batches, completion of rows several tp ranks hold,
//! the bucketed data-parallel all-reduce, and the global norm with every element counted
//! once (Megatron's `clip_grad_norm`: replicated tensors counted on one rank only).

use crate::error::{Result, TrainError};
use crate::layout::{owned_local, ParamSpec};
use candle_core::backprop::GradStore;
use candle_core::{DType, Var};
use std::ops::Range;
use tp_comm::{CommExt, Group, ReduceOp};
use tp_nn::Placement;

/// Offsets of each parameter shard in a flat buffer.
#[derive(Clone, Debug)]
pub struct FlatLayout {
    ranges: Vec<Range<usize>>,
    total: usize,
}

impl FlatLayout {
    pub fn new(specs: &[ParamSpec]) -> Self {
        let mut ranges = Vec::with_capacity(specs.len());
        let mut at = 0;
        for s in specs {
            let n = s.local_len();
            ranges.push(at..at + n);
            at += n;
        }
        FlatLayout { ranges, total: at }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn range(&self, i: usize) -> Range<usize> {
        self.ranges[i].clone()
    }

    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}

/// Adds each parameter's gradient from `grads` into its range of `flat`. A parameter without
/// a gradient is an error: it would silently never train (candle's fused ops have no backward).
pub fn accumulate(
    flat: &mut [f32],
    layout: &FlatLayout,
    params: &[(&ParamSpec, &Var)],
    grads: &GradStore,
) -> Result<()> {
    for (i, (spec, var)) in params.iter().enumerate() {
        if spec.local_len() == 0 {
            continue; // another expert group's expert: nothing of it here
        }
        let g = grads
            .get(var.as_tensor())
            .ok_or_else(|| no_gradient(spec))?;
        add_into(&mut flat[layout.range(i)], spec, g)?;
    }
    Ok(())
}

/// [`accumulate`] of a backward through a part of the stage (a recomputed segment): adds the
/// gradients `grads` holds and marks their parameters in `seen`; [`all_seen`] checks, once
/// every part has run, that no parameter was left without one.
pub fn accumulate_present(
    flat: &mut [f32],
    layout: &FlatLayout,
    params: &[(&ParamSpec, &Var)],
    grads: &GradStore,
    seen: &mut [bool],
) -> Result<()> {
    for (i, (spec, var)) in params.iter().enumerate() {
        if let Some(g) = grads.get(var.as_tensor()) {
            if spec.local_len() > 0 {
                add_into(&mut flat[layout.range(i)], spec, g)?;
            }
            seen[i] = true;
        }
    }
    Ok(())
}

/// The error of the first parameter `seen` lacks ([`accumulate_present`]).
pub fn all_seen(params: &[(&ParamSpec, &Var)], seen: &[bool]) -> Result<()> {
    match params
        .iter()
        .zip(seen)
        .find(|((s, _), seen)| s.local_len() > 0 && !**seen)
    {
        Some(((spec, _), _)) => Err(no_gradient(spec)),
        None => Ok(()),
    }
}

fn no_gradient(spec: &ParamSpec) -> TrainError {
    TrainError::Config(format!(
        "{} received no gradient: an op without a backward is on its path",
        spec.name
    ))
}

/// Adds the gradient `g` of the shard `spec` into `dst`, its range of the flat buffer.
fn add_into(dst: &mut [f32], spec: &ParamSpec, g: &candle_core::Tensor) -> Result<()> {
    let g = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if g.len() != dst.len() {
        return Err(TrainError::Config(format!(
            "{}: gradient has {} elements, the shard {}",
            spec.name,
            g.len(),
            dst.len()
        )));
    }
    for (d, s) in dst.iter_mut().zip(&g) {
        *d += s;
    }
    Ok(())
}

/// Parameters whose rows several tp ranks hold (KV heads shared when the query heads of a
/// rank span two KV groups or tp exceeds the KV heads), and replicated parameters whose
/// gradient is partial on each rank (Qwen3's per-head q/k norms, [`ParamSpec::tp_partial_grad`],
/// as Megatron all-reduces layer-norm gradients under sequence parallelism): each holder
/// computes only its query heads' share, and the full gradient is the sum over holders (one
/// all-reduce for the whole stage, once per step after the micro-batches).
#[derive(Clone, Debug, Default)]
pub struct SharedRows {
    /// (param index, offset of the global tensor in the exchange buffer, row offset of this
    /// rank's shard in that tensor as an element offset)
    entries: Vec<(usize, usize, usize)>,
    total: usize,
}

impl SharedRows {
    /// `all_ranks[r]` are tp rank r's specs of the same stage (same order).
    pub fn plan(all_ranks: &[Vec<ParamSpec>], tp_rank: usize) -> Result<SharedRows> {
        let mut out = SharedRows::default();
        let Some(mine) = all_ranks.get(tp_rank) else {
            return Ok(out);
        };
        for (i, spec) in mine.iter().enumerate() {
            if spec.tp_partial_grad && all_ranks.len() > 1 {
                if spec.placement != Placement::Replicated {
                    return Err(TrainError::Config(format!(
                        "internal: {} has a partial gradient but is not replicated",
                        spec.name
                    )));
                }
                out.entries.push((i, out.total, 0));
                out.total += spec.global_len();
                continue;
            }
            let places: Vec<&Placement> = all_ranks.iter().map(|s| &s[i].placement).collect();
            let Placement::Sharded { dim, range } = &spec.placement else {
                continue;
            };
            let extent = spec.shape[*dim];
            let mut holders = vec![0usize; extent];
            for p in &places {
                if let Placement::Sharded { range, .. } = p {
                    for h in &mut holders[range.clone()] {
                        *h += 1;
                    }
                }
            }
            if holders.iter().all(|&h| h <= 1) {
                continue;
            }
            if *dim != 0 {
                return Err(TrainError::Config(format!(
                    "internal: {} has overlapping shards along dim {dim}",
                    spec.name
                )));
            }
            let per_row = spec.global_len() / extent;
            out.entries.push((i, out.total, range.start * per_row));
            out.total += spec.global_len();
        }
        Ok(out)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sums the shared rows over `tp` (one all-reduce; none when nothing is shared).
    pub fn complete(&self, flat: &mut [f32], layout: &FlatLayout, tp: &Group) -> Result<usize> {
        if self.entries.is_empty() {
            return Ok(0);
        }
        let mut buf = vec![0f32; self.total];
        for &(i, base, off) in &self.entries {
            let r = layout.range(i);
            buf[base + off..base + off + r.len()].copy_from_slice(&flat[r]);
        }
        tp.all_reduce(&mut buf, ReduceOp::Sum)?;
        for &(i, base, off) in &self.entries {
            let r = layout.range(i);
            let n = r.len();
            flat[r].copy_from_slice(&buf[base + off..base + off + n]);
        }
        Ok(1)
    }
}

/// Tied embeddings over pipeline stages (Megatron's embedding group): the first stage's
/// embedding and the last stage's copy used as the LM head each get part of the gradient;
/// one all-reduce over the pp group (the stages between add zeros) gives both the sum, so
/// the two copies take identical steps and stay equal.
#[derive(Clone, Debug)]
pub struct TiedCopy {
    /// This stage's index of the embedding or its copy, if it holds one.
    index: Option<usize>,
    /// Elements of the tp rank's shard (the same on every stage).
    len: usize,
}

impl TiedCopy {
    /// `None` when the model has no tied copy at this pipeline depth; `len` is the local
    /// shard's element count of the embedding on this tp rank.
    pub fn plan(specs: &[ParamSpec], tied_over_stages: bool) -> Option<TiedCopy> {
        if !tied_over_stages {
            return None;
        }
        let index = specs
            .iter()
            .position(|s| s.weight == tp_spec::WeightName::Embed);
        Some(TiedCopy { index, len: 0 })
    }

    /// Sets the shard length (`vocab_local x hidden`) that every stage exchanges.
    pub fn with_len(mut self, len: usize) -> TiedCopy {
        self.len = len;
        self
    }

    /// Collective over `pp`: sums the embedding gradient of the first and last stage.
    pub fn complete(&self, flat: &mut [f32], layout: &FlatLayout, pp: &Group) -> Result<()> {
        let mut buf = vec![0f32; self.len];
        if let Some(i) = self.index {
            let r = layout.range(i);
            if r.len() != self.len {
                return Err(TrainError::Config(format!(
                    "internal: the tied embedding shard holds {} elements, expected {}",
                    r.len(),
                    self.len
                )));
            }
            buf.copy_from_slice(&flat[r]);
        }
        pp.all_reduce(&mut buf, ReduceOp::Sum)?;
        if let Some(i) = self.index {
            flat[layout.range(i)].copy_from_slice(&buf);
        }
        Ok(())
    }
}

/// Sums gradients over the data-parallel group in buckets of `bucket_elems` elements of the
/// flat buffer (one all-reduce per bucket, not per tensor). Returns the number of calls.
pub fn all_reduce_buckets(flat: &mut [f32], dp: &Group, bucket_elems: usize) -> Result<usize> {
    if dp.size() == 1 || flat.is_empty() {
        return Ok(0);
    }
    let mut calls = 0;
    for chunk in flat.chunks_mut(bucket_elems.max(1)) {
        dp.all_reduce(chunk, ReduceOp::Sum)?;
        calls += 1;
    }
    Ok(calls)
}

/// The indices of `specs` where `pred` is false, then those where it is true.
pub fn split_by(
    specs: &[ParamSpec],
    pred: impl Fn(&ParamSpec) -> bool,
) -> (Vec<usize>, Vec<usize>) {
    (0..specs.len()).partition(|&i| !pred(&specs[i]))
}

/// [`all_reduce_buckets`] of the parameters `which` lists only (gathered into one buffer,
/// reduced over `group`, put back): the dense part of the gradients over dp, the experts'
/// over their expert-data-parallel group. Returns the all-reduce calls.
pub fn all_reduce_parts(
    flat: &mut [f32],
    layout: &FlatLayout,
    which: &[usize],
    group: &Group,
    bucket_elems: usize,
) -> Result<usize> {
    if group.size() == 1 {
        return Ok(0);
    }
    let mut buf = pack(flat, layout, which);
    let calls = all_reduce_buckets(&mut buf, group, bucket_elems)?;
    unpack(&buf, flat, layout, which);
    Ok(calls)
}

/// The elements of the parameters `which` lists, in that order, out of `flat` (one buffer of
/// a part of the flat layout: [`all_reduce_parts`], the distributed optimizer's parts).
pub fn pack(flat: &[f32], layout: &FlatLayout, which: &[usize]) -> Vec<f32> {
    which
        .iter()
        .flat_map(|&i| flat[layout.range(i)].iter().copied())
        .collect()
}

/// The inverse of [`pack`]: `buf`'s elements back into the ranges of `which` in `flat`.
pub fn unpack(buf: &[f32], flat: &mut [f32], layout: &FlatLayout, which: &[usize]) {
    let mut at = 0;
    for &i in which {
        let r = layout.range(i);
        flat[r.clone()].copy_from_slice(&buf[at..at + r.len()]);
        at += r.len();
    }
}

/// Which elements of each shard this rank counts in the global norm: for parameter i, a
/// range of indices along its sharded dim (or all / none for replicated tensors).
#[derive(Clone, Debug)]
pub struct NormOwnership {
    /// (param index, owned index range along the sharded dim, elements per index, dim)
    owned: Vec<(usize, Range<usize>, usize, usize)>,
}

impl NormOwnership {
    pub fn plan(all_ranks: &[Vec<ParamSpec>], tp_rank: usize) -> NormOwnership {
        let mut owned = Vec::new();
        if let Some(mine) = all_ranks.get(tp_rank) {
            for (i, spec) in mine.iter().enumerate() {
                if spec.tied_copy {
                    // Counted once, on the first stage.
                    continue;
                }
                let places: Vec<Placement> =
                    all_ranks.iter().map(|s| s[i].placement.clone()).collect();
                let Some(range) = owned_local(&places, tp_rank) else {
                    continue;
                };
                match &spec.placement {
                    Placement::Replicated => {
                        if !range.is_empty() {
                            let local = spec.local_shape();
                            let rows = local.first().copied().unwrap_or(1);
                            let inner: usize = local.iter().skip(1).product();
                            owned.push((i, 0..rows, inner, 0));
                        }
                    }
                    Placement::Sharded { dim, .. } => {
                        let local = spec.local_shape();
                        let inner: usize = local[dim + 1..].iter().product();
                        owned.push((i, range, inner, *dim));
                    }
                }
            }
        }
        NormOwnership { owned }
    }

    /// Sum of squares (f64) of the owned elements of `flat`.
    pub fn sum_sq(&self, flat: &[f32], layout: &FlatLayout, specs: &[ParamSpec]) -> f64 {
        self.sum_sq_where(flat, layout, specs, |_| true)
    }

    /// [`NormOwnership::sum_sq`] of the parameters `which` lists (indices, ascending).
    pub fn sum_sq_of(
        &self,
        flat: &[f32],
        layout: &FlatLayout,
        specs: &[ParamSpec],
        which: &[usize],
    ) -> f64 {
        self.sum_sq_where(flat, layout, specs, |i| which.binary_search(&i).is_ok())
    }

    fn sum_sq_where(
        &self,
        flat: &[f32],
        layout: &FlatLayout,
        specs: &[ParamSpec],
        keep: impl Fn(usize) -> bool,
    ) -> f64 {
        let mut total = 0f64;
        for (i, range, inner, dim) in self.owned.iter().filter(|o| keep(o.0)) {
            let data = &flat[layout.range(*i)];
            let local = specs[*i].local_shape();
            let extent = local.get(*dim).copied().unwrap_or(1);
            let outer: usize = local[..*dim].iter().product();
            let r = range.start.min(extent)..range.end.min(extent);
            for o in 0..outer.max(1) {
                let base = o * extent * inner;
                let s = &data[base + r.start * inner..base + r.end * inner];
                total += s.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>();
            }
        }
        total
    }
}

/// The global L2 norm: each rank's owned sum of squares, summed over the tp group and then
/// over the pipeline stages. (Data-parallel replicas hold identical gradients after the dp
/// all-reduce, so they are not summed.)
pub fn global_norm(local_sq: f64, tp: &Group, pp: &Group) -> Result<f64> {
    let mut v = [local_sq];
    if tp.size() > 1 {
        tp.all_reduce(&mut v, ReduceOp::Sum)?;
    }
    if pp.size() > 1 {
        pp.all_reduce(&mut v, ReduceOp::Sum)?;
    }
    Ok(v[0].sqrt())
}

/// The factor that brings a gradient of norm `norm` to at most `max_norm` (1 when under it or
/// when clipping is off).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if max_norm > 0.0 && norm > max_norm {
        max_norm / (norm + 1e-6)
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tp_comm::local::{run, LocalOptions};
    use tp_comm::OpKind;
    use tp_nn::RecordingComm;

    #[test]
    fn dp_all_reduce_goes_by_buckets_and_sums() {
        let outs = run(2, LocalOptions::default(), |g| {
            let (rec, g) = RecordingComm::wrap(g);
            let mut flat: Vec<f32> = (0..10).map(|i| (i + 100 * g.rank()) as f32).collect();
            let calls = all_reduce_buckets(&mut flat, &g, 4)?;
            Ok::<_, TrainError>((calls, rec.count(OpKind::AllReduce), flat))
        })
        .unwrap();
        for o in outs {
            let (calls, recorded, flat) = o.unwrap().unwrap();
            assert_eq!((calls, recorded), (3, 3)); // 10 elements in buckets of 4: 4 + 4 + 2
            let want: Vec<f32> = (0..10).map(|i| (2 * i + 100) as f32).collect();
            assert_eq!(flat, want);
        }
    }
}
