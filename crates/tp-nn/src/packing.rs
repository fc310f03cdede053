//! Packed sequences (Megatron's `--reset-position-ids --reset-attention-mask`): several
//! documents one after another in one sequence, each token carrying its document and its
//! position inside it. RoPE rotates by those positions and attention is block-diagonal
//! causal: a query sees the earlier keys of its own document only (within a layer's window).

use crate::error::{Result, TpError};
use candle_core::{Device, Tensor};

/// The documents of a batch of packed sequences, per token: for `batch` sequences of `seq`
/// tokens, each token's document (any ids; a change of id starts a document) and position
/// inside it. For the whole sequence, also with sequence parallelism (attention sees it all).
#[derive(Clone, Debug)]
pub struct Segments {
    batch: usize,
    seq: usize,
    docs: Vec<u32>, // [batch * seq]
    /// Positions as a tensor, to gather the RoPE tables with.
    positions: Tensor, // [batch * seq] u32
    max_position: u32,
}

impl Segments {
    /// `docs` and `positions` are `[batch * seq]`, row-major. Within a sequence a document's
    /// tokens are consecutive and its positions count up by one from 0.
    pub fn new(docs: Vec<u32>, positions: Vec<u32>, batch: usize, seq: usize) -> Result<Self> {
        if docs.len() != batch * seq || positions.len() != batch * seq {
            return Err(TpError::Shape(format!(
                "packed sequences: {} document ids and {} positions for {batch} sequences of \
                 {seq} tokens",
                docs.len(),
                positions.len()
            )));
        }
        for (r, (d, p)) in docs.chunks(seq).zip(positions.chunks(seq)).enumerate() {
            for i in 0..seq {
                let starts = i == 0 || d[i] != d[i - 1];
                let want = if starts { 0 } else { p[i - 1] + 1 };
                if p[i] != want {
                    return Err(TpError::Shape(format!(
                        "packed sequence {r}: token {i} is at position {} of its document, \
                         expected {want}",
                        p[i]
                    )));
                }
            }
        }
        let max_position = positions.iter().copied().max().unwrap_or(0);
        Ok(Segments {
            batch,
            seq,
            docs,
            positions: Tensor::from_vec(positions, batch * seq, &Device::Cpu)?,
            max_position,
        })
    }

    /// `(batch, seq)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.batch, self.seq)
    }

    /// Each token's position in its document, `[batch * seq]` u32.
    pub fn positions(&self) -> &Tensor {
        &self.positions
    }

    /// The largest position.
    pub fn max_position(&self) -> usize {
        self.max_position as usize
    }

    /// `[batch, 1, seq, seq]` additive mask: query `i` sees key `j` (0) when `j <= i`, both are
    /// in the same document and `i - j < window`; -inf otherwise.
    pub fn mask(&self, window: Option<usize>, device: &Device) -> Result<Tensor> {
        let (s, w) = (self.seq, window.unwrap_or(usize::MAX));
        let mut mask = vec![f32::NEG_INFINITY; self.batch * s * s];
        for (r, d) in self.docs.chunks(s).enumerate() {
            for i in 0..s {
                let row = &mut mask[(r * s + i) * s..(r * s + i + 1) * s];
                // Keys j <= i of the same document: a run ending at i.
                for j in (0..=i).rev() {
                    if d[j] != d[i] || i - j >= w {
                        break;
                    }
                    row[j] = 0.0;
                }
            }
        }
        Ok(Tensor::from_vec(mask, (self.batch, 1, s, s), device)?)
    }
}
