//! Vocab-parallel cross-entropy (Megatron §3, "output embedding"): logits stay sharded by
//! vocab; all-reduce of the max, then one all-reduce of (sum of exponentials, target logit).
//!
//! Composed of differentiable ops around g (whose backward is the identity), so the gradient
//! of each rank's logits is `(softmax - onehot) / n` computed locally, with no gathering.

use crate::embedding::local_ids;
use crate::error::{Result, TpError};
use crate::host;
use crate::mappings::reduce_from_tp;
use candle_core::{Tensor, D};
use tp_comm::{Group, ReduceOp};
use tp_spec::Partition;

/// Mean cross-entropy over `n` rows. `logits_local [n, vocab_local]` are this rank's columns
/// `vocab.range(group.rank())`; `targets [n]` are global ids (u32). Returns a replicated scalar.
pub fn vocab_parallel_cross_entropy(
    logits_local: &Tensor,
    targets: &Tensor,
    vocab: &Partition,
    group: &Group,
) -> Result<Tensor> {
    Ok(per_row(logits_local, targets, vocab, group)?.mean_all()?)
}

/// `sum_i weights[i] * ce_i` over the `n` rows (`weights [n]` f32: a loss mask divided by the
/// number of tokens in the loss gives the masked mean). Otherwise as
/// [`vocab_parallel_cross_entropy`].
pub fn vocab_parallel_cross_entropy_weighted(
    logits_local: &Tensor,
    targets: &Tensor,
    weights: &Tensor,
    vocab: &Partition,
    group: &Group,
) -> Result<Tensor> {
    let ce = per_row(logits_local, targets, vocab, group)?; // [n, 1]
    if weights.dims() != [ce.dim(0)?] {
        return Err(TpError::Shape(format!(
            "expected weights [{}], got {:?}",
            ce.dim(0)?,
            weights.dims()
        )));
    }
    Ok(ce.flatten_all()?.mul(weights)?.sum_all()?)
}

/// Each row's cross-entropy, `[n, 1]`.
fn per_row(
    logits_local: &Tensor,
    targets: &Tensor,
    vocab: &Partition,
    group: &Group,
) -> Result<Tensor> {
    let tp_rank = group.rank();
    if vocab.tp() != group.size() {
        return Err(TpError::Shape(format!(
            "vocab partition is for tp={} but the group has {} ranks",
            vocab.tp(),
            group.size()
        )));
    }
    let (n, v_local) = logits_local.dims2()?;
    let range = vocab.range(tp_rank);
    if v_local != range.len() || targets.dims() != [n] {
        return Err(TpError::Shape(format!(
            "expected logits [{n}, {}] and targets [{n}], got {:?} and {:?}",
            range.len(),
            logits_local.dims(),
            targets.dims()
        )));
    }
    // Max over the whole vocab: a constant shift, no gradient needed.
    let mut max = logits_local
        .detach()
        .max_keepdim(D::Minus1)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    host::all_reduce(group.as_ref(), &mut max, ReduceOp::Max)?;
    let max = Tensor::from_vec(max, (n, 1), logits_local.device())?; // [n, 1]
    let shifted = logits_local.broadcast_sub(&max)?; // [n, vocab_local]
    let sum_exp = shifted.exp()?.sum_keepdim(D::Minus1)?; // [n, 1]
    let (ids, mask) = local_ids(targets, vocab.units(), range)?;
    let onehot = ids
        .unsqueeze(1)?
        .broadcast_eq(&Tensor::arange(0u32, v_local as u32, logits_local.device())?.unsqueeze(0)?)?
        .to_dtype(logits_local.dtype())?
        .broadcast_mul(&mask.unsqueeze(1)?)?; // [n, vocab_local]
    let target = (shifted * onehot)?.sum_keepdim(D::Minus1)?; // [n, 1]
    let both = Tensor::cat(&[sum_exp, target], 1)?; // [n, 2]
    let both = reduce_from_tp(&both, group)?; // [n, 2]
    let log_z = both.narrow(1, 0, 1)?.log()?; // [n, 1]
    let tgt = both.narrow(1, 1, 1)?; // [n, 1]
    Ok((log_z - tgt)?)
}
