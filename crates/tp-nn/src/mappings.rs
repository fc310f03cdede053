//! The conjugate mappings f, g and their gather/scatter relatives, as candle custom ops with
//! a backward (Megatron §3, Fig. 3; sequence-parallel pair after Korthikanti et al. §4.2.2).
//!
//! | mapping | forward | backward |
//! |---|---|---|
//! | [`copy_to_tp`] (f) | identity | all-reduce |
//! | [`reduce_from_tp`] (g) | all-reduce | identity |
//! | [`gather_last_dim`] | all-gather (last dim) | keep own part |
//! | [`scatter_last_dim`] | keep own part | all-gather |
//! | [`gather_from_sequence_parallel`] | all-gather (seq dim) | reduce-scatter |
//! | [`reduce_scatter_to_sequence_parallel`] | reduce-scatter (seq dim) | all-gather |
//!
//! Only f32 CPU tensors are supported for now; other dtypes get a typed error.

use crate::error::{Result, TpError};
use crate::host;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use std::sync::Mutex;
use tp_comm::{CommError, Group, ReduceOp};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// f: identity forward, all-reduce backward.
    Copy,
    /// g: all-reduce forward, identity backward.
    Reduce,
    /// All-gather forward; backward keeps the own part.
    GatherSplitBwd,
    /// All-gather forward; backward reduce-scatters.
    GatherReduceScatterBwd,
    /// Own part forward; backward all-gathers.
    Split,
    /// Reduce-scatter forward; backward all-gathers.
    ReduceScatter,
}

struct Mapping {
    kind: Kind,
    group: Group,
    dim: usize,
    /// Each rank's extent along `dim`.
    sizes: Vec<usize>,
    /// The forward result, computed before entering candle so that a failed collective
    /// surfaces as a typed [`TpError::Comm`] rather than a stringly candle error.
    precomputed: Mutex<Option<(Vec<f32>, Vec<usize>)>>,
}

fn cerr(e: tp_comm::CommError) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// `(outer, inner)` of a shape around `dim`.
fn around(dims: &[usize], dim: usize) -> (usize, usize) {
    (
        dims[..dim].iter().product(),
        dims[dim + 1..].iter().product(),
    )
}

impl Mapping {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The forward (`fwd = true`) or backward data movement of this mapping on `x`.
    fn apply(
        &self,
        x: &[f32],
        dims: &[usize],
        fwd: bool,
    ) -> std::result::Result<(Vec<f32>, Vec<usize>), CommError> {
        let comm = self.group.as_ref();
        let (outer, inner) = around(dims, self.dim);
        let total: usize = self.sizes.iter().sum();
        let mut out_dims = dims.to_vec();
        let gather = |out_dims: &mut Vec<usize>| {
            out_dims[self.dim] = total;
            host::gather_dim(comm, x, outer, inner, &self.sizes)
        };
        let own = self.sizes[self.rank()];
        let out = match (self.kind, fwd) {
            (Kind::Copy, true) | (Kind::Reduce, false) => x.to_vec(),
            (Kind::Copy, false) | (Kind::Reduce, true) => {
                let mut v = x.to_vec();
                host::all_reduce(comm, &mut v, ReduceOp::Sum)?;
                v
            }
            (Kind::GatherSplitBwd | Kind::GatherReduceScatterBwd, true)
            | (Kind::Split | Kind::ReduceScatter, false) => gather(&mut out_dims)?,
            (Kind::GatherSplitBwd, false) | (Kind::Split, true) => {
                out_dims[self.dim] = own;
                host::split_dim(x, outer, inner, &self.sizes, self.rank())
            }
            (Kind::GatherReduceScatterBwd, false) | (Kind::ReduceScatter, true) => {
                out_dims[self.dim] = own;
                host::reduce_scatter_dim(comm, x, outer, inner, &self.sizes)?
            }
        };
        Ok((out, out_dims))
    }
}

impl CustomOp1 for Mapping {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Copy => "copy_to_tp",
            Kind::Reduce => "reduce_from_tp",
            Kind::GatherSplitBwd => "gather_last_dim",
            Kind::GatherReduceScatterBwd => "gather_from_sequence_parallel",
            Kind::Split => "scatter_last_dim",
            Kind::ReduceScatter => "reduce_scatter_to_sequence_parallel",
        }
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let data = storage.as_slice::<f32>()?;
        let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::msg(format!("{}: input must be contiguous", self.name()))
        })?;
        let pre = self.precomputed.lock().ok().and_then(|mut p| p.take());
        let (out, dims) = match pre {
            Some(done) => done,
            None => self
                .apply(&data[start..end], layout.dims(), true)
                .map_err(cerr)?,
        };
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.to_dtype(DType::F32)?.contiguous()?;
        let x = grad.flatten_all()?.to_vec1::<f32>()?;
        let (out, dims) = self.apply(&x, grad.dims(), false).map_err(cerr)?;
        Ok(Some(Tensor::from_vec(out, dims, grad.device())?))
    }
}

fn check(x: &Tensor, what: &str) -> Result<()> {
    if x.dtype() != DType::F32 {
        return Err(TpError::Shape(format!(
            "{what} supports f32 tensors, got {:?}; convert with to_dtype(DType::F32)",
            x.dtype()
        )));
    }
    if !x.device().is_cpu() {
        return Err(TpError::Shape(format!(
            "{what} supports CPU tensors only for now"
        )));
    }
    Ok(())
}

fn run(
    x: &Tensor,
    kind: Kind,
    group: &Group,
    dim: usize,
    sizes: Vec<usize>,
    what: &str,
) -> Result<Tensor> {
    check(x, what)?;
    let elementwise = matches!(kind, Kind::Copy | Kind::Reduce);
    if !elementwise && dim >= x.rank() {
        return Err(TpError::Shape(format!(
            "{what}: dim {dim} out of range for a rank-{} tensor",
            x.rank()
        )));
    }
    if sizes.len() != group.size() {
        return Err(TpError::Shape(format!(
            "{what}: {} shard sizes for a {}-rank group",
            sizes.len(),
            group.size()
        )));
    }
    let x = x.contiguous()?;
    let op = Mapping {
        kind,
        group: group.clone(),
        dim,
        sizes,
        precomputed: Mutex::new(None),
    };
    // Run the collective here, with a typed error; the custom op then only hands the result
    // to candle (and records the backward).
    let host_x = x.flatten_all()?.to_vec1::<f32>()?;
    let done = op.apply(&host_x, x.dims(), true)?;
    if let Ok(mut p) = op.precomputed.lock() {
        *p = Some(done);
    }
    Ok(x.apply_op1(op)?)
}

fn expect_extent(x: &Tensor, dim: usize, want: usize, what: &str) -> Result<()> {
    let got = x.dim(dim)?;
    if got != want {
        return Err(TpError::Shape(format!(
            "{what}: dim {dim} has extent {got}, but this rank's shard is {want}"
        )));
    }
    Ok(())
}

/// f: identity forward, all-reduce of the gradient backward. Put it before a column-parallel
/// layer whose input is replicated.
pub fn copy_to_tp(x: &Tensor, group: &Group) -> Result<Tensor> {
    let sizes = vec![0; group.size()];
    run(x, Kind::Copy, group, 0, sizes, "copy_to_tp")
}

/// g: all-reduce (sum) forward, identity backward. Put it after a row-parallel layer.
pub fn reduce_from_tp(x: &Tensor, group: &Group) -> Result<Tensor> {
    let sizes = vec![0; group.size()];
    run(x, Kind::Reduce, group, 0, sizes, "reduce_from_tp")
}

/// All-gather along the last dim (rank r holds `sizes[r]` columns); backward keeps the own part.
pub fn gather_last_dim(x: &Tensor, group: &Group, sizes: &[usize]) -> Result<Tensor> {
    let dim = x.rank().saturating_sub(1);
    expect_extent(
        x,
        dim,
        *sizes.get(group.rank()).unwrap_or(&0),
        "gather_last_dim",
    )?;
    run(
        x,
        Kind::GatherSplitBwd,
        group,
        dim,
        sizes.to_vec(),
        "gather_last_dim",
    )
}

/// Keep this rank's `sizes[rank]` columns of the last dim; backward all-gathers.
pub fn scatter_last_dim(x: &Tensor, group: &Group, sizes: &[usize]) -> Result<Tensor> {
    let dim = x.rank().saturating_sub(1);
    expect_extent(x, dim, sizes.iter().sum(), "scatter_last_dim")?;
    run(
        x,
        Kind::Split,
        group,
        dim,
        sizes.to_vec(),
        "scatter_last_dim",
    )
}

/// Sequence parallel: all-gather along `dim` (the sequence dim) forward, reduce-scatter backward.
pub fn gather_from_sequence_parallel(
    x: &Tensor,
    group: &Group,
    dim: usize,
    sizes: &[usize],
) -> Result<Tensor> {
    if dim < x.rank() {
        expect_extent(
            x,
            dim,
            *sizes.get(group.rank()).unwrap_or(&0),
            "gather_from_sequence_parallel",
        )?;
    }
    run(
        x,
        Kind::GatherReduceScatterBwd,
        group,
        dim,
        sizes.to_vec(),
        "gather_from_sequence_parallel",
    )
}

/// Sequence parallel: reduce-scatter (sum) along `dim` forward, all-gather backward.
pub fn reduce_scatter_to_sequence_parallel(
    x: &Tensor,
    group: &Group,
    dim: usize,
    sizes: &[usize],
) -> Result<Tensor> {
    if dim < x.rank() {
        expect_extent(
            x,
            dim,
            sizes.iter().sum(),
            "reduce_scatter_to_sequence_parallel",
        )?;
    }
    run(
        x,
        Kind::ReduceScatter,
        group,
        dim,
        sizes.to_vec(),
        "reduce_scatter_to_sequence_parallel",
    )
}
