//! Vocab-parallel embedding (Megatron §3, "input embedding"): each rank holds a contiguous
//! range of vocab rows, looks up its own ids, zeros the rest, and g all-reduces the sum (with
//! sequence parallelism a reduce-scatter of the sequence).

use crate::error::{Result, TpError};
use crate::linear::check_group;
use crate::linear::PartialSum;
use crate::sequence::SeqLayout;
use candle_core::{DType, Tensor, Var};
use std::ops::Range;
use tp_comm::Group;
use tp_spec::Partition;

#[derive(Debug)]
pub struct VocabParallelEmbedding {
    table: Var, // [vocab_local, hidden]
    vocab: Partition,
    tp_rank: usize,
}

impl VocabParallelEmbedding {
    /// Slices rows `vocab.range(tp_rank)` of the global `table [vocab, hidden]`.
    pub fn from_global(table: &Tensor, tp_rank: usize, tp: usize) -> Result<Self> {
        let (vocab_global, _) = table.dims2()?;
        let vocab = Partition::new(vocab_global, tp, "vocab rows", "vocab row")?;
        vocab.check_rank(tp_rank)?;
        let r = vocab.range(tp_rank);
        let local = table.narrow(0, r.start, r.len())?.contiguous()?; // [vocab_local, hidden]
        Ok(VocabParallelEmbedding {
            table: Var::from_tensor(&local)?,
            vocab,
            tp_rank,
        })
    }

    pub fn weight(&self) -> &Var {
        &self.table
    }

    pub fn vocab_range(&self) -> Range<usize> {
        self.vocab.range(self.tp_rank)
    }

    /// `ids [..]` (u32, global ids) -> replicated `[.., hidden]`; one all-reduce.
    pub fn forward(&self, ids: &Tensor, group: &Group) -> Result<Tensor> {
        self.forward_layout(ids, group, SeqLayout::Replicated)
    }

    /// `ids [b, s]` -> `[b, s, hidden]` laid out by `layout`: replicated (one all-reduce), or
    /// with sequence parallelism this rank's positions `[b, s/tp, hidden]` (one
    /// reduce-scatter of the sequence).
    pub fn forward_layout(
        &self,
        ids: &Tensor,
        group: &Group,
        layout: SeqLayout<'_>,
    ) -> Result<Tensor> {
        check_group(group, self.tp_rank, self.vocab.tp())?;
        if let SeqLayout::Split(_) = layout {
            if ids.rank() != 2 {
                return Err(TpError::Shape(format!(
                    "a sequence-parallel embedding takes ids [batch, seq], got {:?}",
                    ids.dims()
                )));
            }
        }
        let (local_ids, mask) = local_ids(ids, self.vocab.units(), self.vocab_range())?;
        let hidden = self.table.dim(1)?;
        let flat = self.table.embedding(&local_ids)?; // [n, hidden]
        let flat = flat.broadcast_mul(&mask.unsqueeze(1)?)?; // [n, hidden]
        let mut dims = ids.dims().to_vec();
        dims.push(hidden);
        let local = flat.reshape(dims)?; // [.., hidden], this rank's vocab rows only
        layout.exit(PartialSum::new(local, group))
    }
}

/// Flattened ids mapped into `range` (0 where outside) and a `[n]` f32 mask of the in-range ones.
pub(crate) fn local_ids(
    ids: &Tensor,
    vocab: usize,
    range: Range<usize>,
) -> Result<(Tensor, Tensor)> {
    let flat = ids.flatten_all()?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
    let mut local = Vec::with_capacity(flat.len());
    let mut mask = Vec::with_capacity(flat.len());
    for &id in &flat {
        let id = id as usize;
        if id >= vocab {
            return Err(TpError::Shape(format!(
                "token id {id} is outside the vocabulary of {vocab}; check the tokenizer matches the model"
            )));
        }
        let own = range.contains(&id);
        local.push(if own { (id - range.start) as u32 } else { 0 });
        mask.push(if own { 1f32 } else { 0.0 });
    }
    let n = flat.len();
    Ok((
        Tensor::from_vec(local, n, ids.device())?,
        Tensor::from_vec(mask, n, ids.device())?,
    ))
}
