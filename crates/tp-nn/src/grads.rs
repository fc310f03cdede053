//! Completing the gradients of parameters that several ranks hold (docs/design.md "Uneven and
//! head-granular shards": replicated KV heads; Korthikanti et al. §4.2.2: norm weights under
//! sequence parallelism). Each holder computes only its share; the dense gradient is the sum.
//! Call once per step before the optimizer; it is not part of a block's pinned forward and
//! backward collectives.

use crate::block::{ParallelBlock, Placement};
use crate::error::{Result, TpError};
use crate::host;
use crate::partition::HeadPlan;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use tp_comm::{Group, ReduceOp};

/// Whether some KV head is held by more than one rank at this tp.
pub fn kv_heads_shared(heads: usize, kv_heads: usize, tp: usize) -> Result<bool> {
    let mut holders = vec![0usize; kv_heads];
    for r in 0..tp {
        for kv in HeadPlan::new(heads, kv_heads, r, tp)?.kv_range() {
            holders[kv] += 1;
        }
    }
    Ok(holders.iter().any(|&n| n > 1))
}

impl ParallelBlock {
    /// Sums, over the tp group, the gradients of replicated KV heads (when shared) and, with
    /// `sequence_parallel`, of the norm weights, so that every rank's gradient equals its
    /// slice of the dense one. One fused all-reduce, or none when nothing is shared.
    /// Returns the number of all-reduces issued.
    pub fn reduce_shared_grads(
        &self,
        grads: &mut GradStore,
        group: &Group,
        sequence_parallel: bool,
    ) -> Result<usize> {
        let c = self.config();
        let kv_shared = kv_heads_shared(c.heads, c.kv_heads, group.size())?;
        let kv_rows = c.kv_heads * c.head_dim;
        // (var tensor, offset in the global flattened tensor, global element count)
        let mut shared = Vec::new();
        for (name, var, place) in self.params() {
            match place {
                Placement::Replicated if sequence_parallel => {
                    shared.push((var.as_tensor().clone(), 0, var.elem_count()));
                }
                Placement::Sharded { dim: 0, range }
                    if kv_shared && (name == "wk" || name == "wv") =>
                {
                    let cols = var.dim(1)?;
                    shared.push((var.as_tensor().clone(), range.start * cols, kv_rows * cols));
                }
                _ => {}
            }
        }
        if shared.is_empty() {
            return Ok(0);
        }
        let total: usize = shared.iter().map(|s| s.2).sum();
        let mut buf = vec![0f32; total];
        let mut base = 0;
        for (t, off, len) in &shared {
            let g = grads.get(t).ok_or_else(|| {
                TpError::Shape("a shared parameter has no gradient; run backward first".into())
            })?;
            let g = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            buf[base + off..base + off + g.len()].copy_from_slice(&g);
            base += len;
        }
        host::all_reduce(group.as_ref(), &mut buf, ReduceOp::Sum)?;
        let mut base = 0;
        for (t, off, len) in &shared {
            let n = t.elem_count();
            let g = Tensor::from_vec(
                buf[base + off..base + off + n].to_vec(),
                t.dims(),
                t.device(),
            )?;
            grads.insert(t, g);
            base += len;
        }
        Ok(1)
    }
}

#[cfg(test)]
mod tests {
    use super::kv_heads_shared;

    #[test]
    fn kv_sharing_follows_the_head_plan() {
        assert!(!kv_heads_shared(4, 2, 2).unwrap()); // 2 q heads per rank, one KV group each
        assert!(kv_heads_shared(9, 3, 2).unwrap()); // q 0..5 and 5..9 both need KV head 1
        assert!(kv_heads_shared(8, 2, 8).unwrap()); // tp above the KV heads: replication
        assert!(!kv_heads_shared(9, 3, 3).unwrap());
    }
}
