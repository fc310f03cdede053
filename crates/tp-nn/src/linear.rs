//! Column- and row-parallel linear layers (Megatron §3, Eq. 3 and the MLP split of Fig. 3a).
//!
//! Weights follow candle's layout `[out, in]`, `y = x W^T (+ b)`. A column-parallel layer
//! holds a contiguous range of output rows (and those entries of its bias, if any); a row-parallel layer a range of input columns, and its
//! output is a [`PartialSum`] that only [`PartialSum::reduce`] (g) or
//! [`PartialSum::reduce_scatter_seq`] turns into a usable tensor.

use crate::error::{Result, TpError};
use crate::mappings::{
    copy_to_tp, gather_last_dim, reduce_from_tp, reduce_scatter_to_sequence_parallel,
};
use candle_core::{Tensor, Var};
use std::ops::Range;
use tp_comm::Group;
use tp_spec::Partition;

/// Checks that `group` is the tp group a layer was sliced for.
pub(crate) fn check_group(group: &Group, tp_rank: usize, tp: usize) -> Result<()> {
    if group.rank() != tp_rank || group.size() != tp {
        return Err(TpError::GroupMismatch {
            built_rank: tp_rank,
            built_tp: tp,
            rank: group.rank(),
            size: group.size(),
        });
    }
    Ok(())
}

/// `x [.., in] @ w^T [in, out] -> [.., out]`.
pub(crate) fn matmul_t(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let (rows, inp) = match dims.split_last() {
        Some((&inp, lead)) => (lead.iter().product::<usize>(), inp),
        None => {
            return Err(TpError::Shape(
                "linear input must have at least one dim".into(),
            ))
        }
    };
    let (out, w_in) = w.dims2()?;
    if w_in != inp {
        return Err(TpError::Shape(format!(
            "linear expects input width {w_in}, got {inp} (input shape {dims:?})"
        )));
    }
    let x2 = x.reshape((rows, inp))?; // [rows, in]
    let y2 = x2.matmul(&w.t()?)?; // [rows, out]
    let mut out_dims = dims;
    if let Some(last) = out_dims.last_mut() {
        *last = out;
    }
    Ok(y2.reshape(out_dims)?)
}

/// Narrows `w` along `dim` to `units` (each `unit_len` wide) and makes it a trainable Var.
fn slice_var(w: &Tensor, dim: usize, units: &Range<usize>, unit_len: usize) -> Result<Var> {
    let start = units.start * unit_len;
    let len = units.len() * unit_len;
    if start + len > w.dim(dim)? {
        return Err(TpError::Shape(format!(
            "shard {start}..{} exceeds dim {dim} of extent {}",
            start + len,
            w.dim(dim)?
        )));
    }
    let local = w.narrow(dim, start, len)?.contiguous()?;
    Ok(Var::from_tensor(&local)?)
}

/// `Y_local = X W_local^T`, with `W_local` the rank's rows of the global `[out, in]` weight.
#[derive(Debug)]
pub struct ColumnParallelLinear {
    weight: Var, // [out_local, in]
    /// The rank's entries of the bias, the same rows as the weight's (Qwen2's Q/K/V).
    bias: Option<Var>, // [out_local]
    /// Every rank's output width, in rank order (for gathering the output).
    out_sizes: Vec<usize>,
    gather_output: bool,
    tp_rank: usize,
    tp: usize,
}

impl ColumnParallelLinear {
    /// Balanced split of the output rows of `weight [out_global, in]`.
    pub fn from_global(weight: &Tensor, tp_rank: usize, tp: usize) -> Result<Self> {
        let (out_global, _) = weight.dims2()?;
        let p = Partition::new(out_global, tp, "output features", "output feature")?;
        Self::from_global_units(weight, &p, 1, tp_rank)
    }

    /// Split by units of `unit_len` rows (a head is `head_dim` rows): the rank holds rows
    /// `units.range(tp_rank) * unit_len`.
    pub fn from_global_units(
        weight: &Tensor,
        units: &Partition,
        unit_len: usize,
        tp_rank: usize,
    ) -> Result<Self> {
        units.check_rank(tp_rank)?;
        let out_sizes = units.sizes().iter().map(|s| s * unit_len).collect();
        Self::from_global_rows(weight, units.range(tp_rank), unit_len, tp_rank, out_sizes)
    }

    /// Explicit rows (in units of `unit_len`), e.g. the replicated KV heads of a rank.
    /// `out_sizes` are every rank's widths (used only when gathering the output).
    pub fn from_global_rows(
        weight: &Tensor,
        units: Range<usize>,
        unit_len: usize,
        tp_rank: usize,
        out_sizes: Vec<usize>,
    ) -> Result<Self> {
        let tp = out_sizes.len();
        if tp_rank >= tp {
            return Err(tp_spec::ShardError::InvalidRank { tp_rank, tp }.into());
        }
        Ok(ColumnParallelLinear {
            weight: slice_var(weight, 0, &units, unit_len)?,
            bias: None,
            out_sizes,
            gather_output: false,
            tp_rank,
            tp,
        })
    }

    /// Gather the sharded output to every rank in [`ColumnParallelLinear::forward`].
    pub fn with_gather_output(mut self, gather: bool) -> Self {
        self.gather_output = gather;
        self
    }

    /// Adds a bias: `local [out_local]` is this rank's shard of it, the entries of the
    /// weight's rows (the caller cuts it where the parameter table places it).
    pub fn with_bias(mut self, local: &Tensor) -> Result<Self> {
        let rows = self.weight.dim(0)?;
        if local.dims() != [rows] {
            return Err(TpError::Shape(format!(
                "a bias shard of {:?} for a shard of {rows} output rows",
                local.dims()
            )));
        }
        self.bias = Some(Var::from_tensor(&local.contiguous()?)?);
        Ok(self)
    }

    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The bias shard, when the layer has one.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// Replicated `x [.., in]`: applies f, the local matmul, and gathers when configured.
    /// Returns `[.., out_local]`, or `[.., out_global]` when gathering.
    pub fn forward(&self, x: &Tensor, group: &Group) -> Result<Tensor> {
        check_group(group, self.tp_rank, self.tp)?;
        let x_par = copy_to_tp(x, group)?; // [.., in]
        let y_local = self.forward_local(&x_par)?; // [.., out_local]
        if self.gather_output {
            gather_last_dim(&y_local, group, &self.out_sizes)
        } else {
            Ok(y_local)
        }
    }

    /// Input already inside the parallel region (after f or a sequence-parallel gather).
    /// Its gradient w.r.t. the bias is the sum of the output gradient over every position.
    pub fn forward_local(&self, x_par: &Tensor) -> Result<Tensor> {
        let y = matmul_t(x_par, self.weight.as_tensor())?; // [.., out_local]
        match &self.bias {
            Some(b) => Ok(y.broadcast_add(b.as_tensor())?), // [.., out_local]
            None => Ok(y),
        }
    }
}

/// A row-parallel layer's output: this rank's term of a sum over ranks. Not a tensor until
/// reduced, so the reduction cannot be forgotten.
#[must_use = "a partial sum is wrong until reduced: call reduce() or reduce_scatter_seq()"]
#[derive(Debug)]
pub struct PartialSum {
    partial: Tensor, // [.., out]
    group: Group,
}

impl PartialSum {
    /// This rank's `partial` of a sum over `group`.
    pub(crate) fn new(partial: Tensor, group: &Group) -> Self {
        PartialSum {
            partial,
            group: group.clone(),
        }
    }

    /// g: all-reduce forward, identity backward. Replicated result.
    pub fn reduce(self) -> Result<Tensor> {
        reduce_from_tp(&self.partial, &self.group)
    }

    /// Sequence parallel: reduce-scatter along `seq_dim`, rank r keeping `seq_sizes[r]` positions.
    pub fn reduce_scatter_seq(self, seq_dim: usize, seq_sizes: &[usize]) -> Result<Tensor> {
        reduce_scatter_to_sequence_parallel(&self.partial, &self.group, seq_dim, seq_sizes)
    }

    /// The same partial sum viewed as `dims` (a reshape commutes with the sum over ranks).
    pub fn reshape(self, dims: &[usize]) -> Result<PartialSum> {
        Ok(PartialSum {
            partial: self.partial.reshape(dims)?,
            group: self.group,
        })
    }

    /// Shape of the (eventual) result.
    pub fn dims(&self) -> &[usize] {
        self.partial.dims()
    }
}

/// `Y = sum_r X_r W_r^T`, with `W_r` the rank's columns of the global `[out, in]` weight.
#[derive(Debug)]
pub struct RowParallelLinear {
    weight: Var, // [out, in_local]
    tp_rank: usize,
    tp: usize,
}

impl RowParallelLinear {
    /// Balanced split of the input columns of `weight [out, in_global]`.
    pub fn from_global(weight: &Tensor, tp_rank: usize, tp: usize) -> Result<Self> {
        let (_, in_global) = weight.dims2()?;
        let p = Partition::new(in_global, tp, "input features", "input feature")?;
        Self::from_global_units(weight, &p, 1, tp_rank)
    }

    /// Split by units of `unit_len` columns (a head is `head_dim` columns).
    pub fn from_global_units(
        weight: &Tensor,
        units: &Partition,
        unit_len: usize,
        tp_rank: usize,
    ) -> Result<Self> {
        units.check_rank(tp_rank)?;
        Ok(RowParallelLinear {
            weight: slice_var(weight, 1, &units.range(tp_rank), unit_len)?,
            tp_rank,
            tp: units.tp(),
        })
    }

    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// `x_local [.., in_local]` (sharded on the last dim) -> this rank's partial `[.., out]`.
    pub fn forward(&self, x_local: &Tensor, group: &Group) -> Result<PartialSum> {
        check_group(group, self.tp_rank, self.tp)?;
        let partial = matmul_t(x_local, self.weight.as_tensor())?; // [.., out]
        Ok(PartialSum {
            partial,
            group: group.clone(),
        })
    }
}
