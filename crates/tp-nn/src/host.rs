//! Host-side collectives along one tensor dimension (Megatron §3 f/g, Korthikanti §4.2.2):
//! a tensor is viewed as `[outer, n, inner]` and ranks own contiguous runs of `n`.

use tp_comm::{CommError, CommExt, Communicator, ReduceOp};

/// `[outer, sizes[rank], inner]` on each rank -> `[outer, sum(sizes), inner]` on every rank.
pub(crate) fn gather_dim(
    comm: &dyn Communicator,
    local: &[f32],
    outer: usize,
    inner: usize,
    sizes: &[usize],
) -> Result<Vec<f32>, CommError> {
    let counts: Vec<usize> = sizes.iter().map(|s| outer * s * inner).collect();
    let total: usize = sizes.iter().sum();
    let mut blocks = vec![0f32; counts.iter().sum()];
    comm.all_gather_v(local, &mut blocks, &counts)?;
    // blocks: rank-major [rank][outer, n_r, inner]; rearrange to [outer, total, inner].
    let mut out = vec![0f32; outer * total * inner];
    let mut block_start = 0;
    let mut offset = 0;
    for &n in sizes {
        let run = n * inner;
        for o in 0..outer {
            let src = block_start + o * run;
            let dst = (o * total + offset) * inner;
            out[dst..dst + run].copy_from_slice(&blocks[src..src + run]);
        }
        block_start += outer * run;
        offset += n;
    }
    Ok(out)
}

/// Own part of `[outer, sum(sizes), inner]`: `[outer, sizes[rank], inner]`; no communication.
pub(crate) fn split_dim(
    full: &[f32],
    outer: usize,
    inner: usize,
    sizes: &[usize],
    rank: usize,
) -> Vec<f32> {
    let total: usize = sizes.iter().sum();
    let offset: usize = sizes[..rank].iter().sum();
    let run = sizes[rank] * inner;
    let mut out = Vec::with_capacity(outer * run);
    for o in 0..outer {
        let src = (o * total + offset) * inner;
        out.extend_from_slice(&full[src..src + run]);
    }
    out
}

/// Sum over ranks of `[outer, sum(sizes), inner]`, each rank keeping its `[outer, sizes[rank], inner]`.
pub(crate) fn reduce_scatter_dim(
    comm: &dyn Communicator,
    full: &[f32],
    outer: usize,
    inner: usize,
    sizes: &[usize],
) -> Result<Vec<f32>, CommError> {
    // Reorder to rank-major blocks, as reduce_scatter_v expects.
    let mut blocks = Vec::with_capacity(full.len());
    for r in 0..sizes.len() {
        blocks.extend(split_dim(full, outer, inner, sizes, r));
    }
    let counts: Vec<usize> = sizes.iter().map(|s| outer * s * inner).collect();
    let mut out = vec![0f32; counts[comm.rank()]];
    comm.reduce_scatter_v(&blocks, &mut out, &counts, ReduceOp::Sum)?;
    Ok(out)
}

pub(crate) fn all_reduce(
    comm: &dyn Communicator,
    data: &mut [f32],
    op: ReduceOp,
) -> Result<(), CommError> {
    comm.all_reduce(data, op)
}
