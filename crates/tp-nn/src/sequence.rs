//! Sequence parallelism's layout of the tensors outside the tensor-parallel regions
//! (Korthikanti et al. 2022, §4.2.2): with it each tp rank holds `s/tp` of the positions of
//! the norms' and residual adds' tensors; a region is entered by an all-gather of the
//! sequence (instead of f) and left by a reduce-scatter of it (instead of g).

use crate::error::{Result, TpError};
use crate::linear::PartialSum;
use crate::mappings::{copy_to_tp, gather_from_sequence_parallel};
use candle_core::Tensor;
use tp_comm::Group;

/// The positions of a sequence split evenly over the tp ranks (rank r holds positions
/// `r * s/tp .. (r + 1) * s/tp`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqSplit {
    sizes: Vec<usize>,
}

impl SeqSplit {
    /// The sequence dim of the activations `[batch, seq, hidden]`.
    pub const DIM: usize = 1;

    /// `seq` positions over `tp` ranks; `seq` must be a positive multiple of `tp`.
    pub fn even(seq: usize, tp: usize) -> Result<SeqSplit> {
        if tp == 0 || seq == 0 || !seq.is_multiple_of(tp) {
            return Err(TpError::Config(format!(
                "sequence parallelism splits the sequence evenly over the tp ranks: {seq} \
                 positions do not divide by tp={tp}; use a sequence length that is a multiple \
                 of {tp}"
            )));
        }
        Ok(SeqSplit {
            sizes: vec![seq / tp; tp],
        })
    }

    /// Every rank's number of positions, in rank order.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Positions one rank holds (`s/tp`).
    pub fn local(&self) -> usize {
        self.sizes.first().copied().unwrap_or(0)
    }

    /// The whole sequence's length.
    pub fn total(&self) -> usize {
        self.sizes.iter().sum()
    }
}

/// Where the tensors outside the tensor-parallel regions live.
#[derive(Clone, Copy, Debug, Default)]
pub enum SeqLayout<'a> {
    /// Whole on every rank (Megatron §3): f enters a region, g leaves it.
    #[default]
    Replicated,
    /// Split along the sequence (sequence parallelism): `[batch, s/tp, hidden]` per rank.
    Split(&'a SeqSplit),
}

impl SeqLayout<'_> {
    /// Into a tensor-parallel region: `x [b, s or s/tp, hidden]` -> `[b, s, hidden]` (f, or
    /// an all-gather of the sequence whose backward reduce-scatters).
    pub fn enter(&self, x: &Tensor, group: &Group) -> Result<Tensor> {
        match self {
            SeqLayout::Replicated => copy_to_tp(x, group),
            SeqLayout::Split(s) => {
                gather_from_sequence_parallel(x, group, SeqSplit::DIM, s.sizes())
            }
        }
    }

    /// Out of it: a partial `[b, s, hidden]` -> `[b, s or s/tp, hidden]` (g, or a
    /// reduce-scatter of the sequence whose backward all-gathers).
    pub fn exit(&self, partial: PartialSum) -> Result<Tensor> {
        match self {
            SeqLayout::Replicated => partial.reduce(),
            SeqLayout::Split(s) => partial.reduce_scatter_seq(SeqSplit::DIM, s.sizes()),
        }
    }

    /// Positions a rank holds of a sequence of `seq`.
    pub fn local_seq(&self, seq: usize) -> usize {
        match self {
            SeqLayout::Replicated => seq,
            SeqLayout::Split(s) => s.local(),
        }
    }
}
