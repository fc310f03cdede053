//! The expert-parallel size of a training run and its two meanings (docs/moe.md "Expert
//! parallelism in training"; Megatron-Core's EP x expert-TP). With `tp` ranks per replica and
//! `dp` data-parallel replicas, `--ep N` is:
//!
//! - **inside the tp group** when N divides tp: N expert groups of `tp / N` ranks, each expert
//!   sliced over its group ([`ExpertShard`]; N = 1 is expert-TP), activations replicated, no
//!   all-to-all;
//! - **across replicas** when N is tp times a divisor `b > 1` of dp: the `b` consecutive
//!   replicas of an *ep block* hold whole experts, `E / N` per rank (uneven counts fine), rank
//!   `(block position p, tp rank t)` holding slot `t * b + p` of N balanced slots (so the
//!   ranks of tp index t in a block hold one contiguous run of experts); tokens
//!   reach their experts by all-to-all over the ranks of the block with the same tp index.
//!
//! Any other N is refused, naming the valid values. The rule is tried in that order, so at
//! tp 1 N = 1 is expert-TP and every N > 1 is across replicas.

use crate::config::Experts;
use crate::error::ShardError;
use crate::partition::Partition;
use crate::shard::ExpertShard;
use std::ops::Range;

/// Where `ep` expert-parallel ranks sit in a (tp, dp) layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EpLayout {
    /// Expert groups inside the tp group: the [`ExpertShard`] `ep` (dividing tp).
    InsideTp(usize),
    /// Whole experts over the replicas of an ep block.
    AcrossReplicas(ReplicaExperts),
}

/// Expert parallelism across data-parallel replicas: `ep = tp * block` slots of whole
/// experts, slot `t * block + p` on tp rank `t` of the block's replica `p`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaExperts {
    pub ep: usize,
    pub tp: usize,
    /// Replicas per ep block (`ep / tp`).
    pub block: usize,
    /// The experts over the `ep` slots.
    slots: Partition,
}

impl EpLayout {
    /// The meaning of `ep` for `experts` experts at `tp` x `dp`; a typed error naming the
    /// valid sizes otherwise.
    pub fn new(ep: usize, tp: usize, dp: usize, experts: usize) -> Result<Self, ShardError> {
        let refuse = || ShardError::ExpertParallel {
            ep,
            tp,
            dp,
            experts,
            valid: Self::valid(tp, dp, experts)
                .iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join(", "),
        };
        if ep == 0 || tp == 0 || dp == 0 || ep > experts.max(1) {
            return Err(refuse());
        }
        if tp.is_multiple_of(ep) {
            return Ok(EpLayout::InsideTp(ep));
        }
        if !ep.is_multiple_of(tp) || !dp.is_multiple_of(ep / tp) {
            return Err(refuse());
        }
        Ok(EpLayout::AcrossReplicas(ReplicaExperts {
            ep,
            tp,
            block: ep / tp,
            slots: Partition::new(experts, ep, "experts", "expert")?,
        }))
    }

    /// Every valid expert-parallel size, ascending: the divisors of tp, then tp times each
    /// divisor above 1 of dp, all at most the expert count (1 always).
    pub fn valid(tp: usize, dp: usize, experts: usize) -> Vec<usize> {
        let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
        let mut v: Vec<usize> = divisors(tp)
            .chain(divisors(dp).filter(|&b| b > 1).map(|b| b * tp))
            .filter(|&n| n == 1 || n <= experts)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The expert-parallel size inside the tp group the shard plan takes
    /// ([`crate::ShardPlan::with_expert_groups`]); across replicas each rank's experts come
    /// from [`ReplicaExperts::shard`] instead.
    pub fn inside_tp(&self) -> usize {
        match self {
            EpLayout::InsideTp(ep) => *ep,
            EpLayout::AcrossReplicas(_) => 1,
        }
    }

    /// The across-replicas layout, if that is this one.
    pub fn across(&self) -> Option<&ReplicaExperts> {
        match self {
            EpLayout::AcrossReplicas(r) => Some(r),
            EpLayout::InsideTp(_) => None,
        }
    }
}

impl ReplicaExperts {
    /// The experts of tp rank `tp_rank` on the block's replica `pos`.
    pub fn experts(&self, pos: usize, tp_rank: usize) -> Range<usize> {
        self.slots.range(tp_rank * self.block + pos)
    }

    /// The experts the ranks of tp index `tp_rank` hold together over the block's replicas
    /// (a checkpoint gathers them there before the tp gather).
    pub fn block_experts(&self, tp_rank: usize) -> Range<usize> {
        let first = self.experts(0, tp_rank);
        let last = self.experts(self.block - 1, tp_rank);
        first.start..last.end
    }

    /// The block position of the replica holding `expert` among those of tp index
    /// `tp_rank`, or `None` when a rank of another tp index holds it.
    pub fn peer_of(&self, expert: usize, tp_rank: usize) -> Option<usize> {
        (0..self.block).find(|&p| self.experts(p, tp_rank).contains(&expert))
    }

    /// For every expert, [`ReplicaExperts::peer_of`] at `tp_rank`.
    pub fn peers(&self, tp_rank: usize) -> Vec<Option<usize>> {
        (0..self.slots.units())
            .map(|e| self.peer_of(e, tp_rank))
            .collect()
    }

    /// The block position of data-parallel rank `dp_rank` (blocks are consecutive replicas).
    pub fn position(&self, dp_rank: usize) -> usize {
        dp_rank % self.block
    }

    /// The [`ExpertShard`] of tp rank `tp_rank` on block position `pos` (`None`: the whole
    /// block's experts of that tp index, [`ReplicaExperts::block_experts`]): whole experts of
    /// FFN `ffn` (in units of `ffn_unit` where they divide it), no expert-TP.
    pub fn shard(
        &self,
        e: Experts,
        ffn: usize,
        ffn_unit: usize,
        pos: Option<usize>,
        tp_rank: usize,
    ) -> Result<ExpertShard, ShardError> {
        let mut shard = ExpertShard::for_experts(e, ffn, ffn_unit, 0, 1, 1)?;
        shard.ep = self.ep;
        shard.local = match pos {
            Some(p) => self.experts(p, tp_rank),
            None => self.block_experts(tp_rank),
        };
        Ok(shard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_meanings_and_the_refusal_name_the_valid_sizes() {
        assert_eq!(EpLayout::new(2, 4, 1, 8).unwrap(), EpLayout::InsideTp(2));
        assert_eq!(EpLayout::new(1, 1, 2, 8).unwrap(), EpLayout::InsideTp(1));
        let r = EpLayout::new(4, 2, 2, 8).unwrap();
        let r = r.across().unwrap();
        // Slot t * block + p: tp rank 0 of the block holds 0..4 (0..2 and 2..4), tp rank 1 4..8.
        assert_eq!((r.block, r.experts(0, 1), r.experts(1, 0)), (2, 4..6, 2..4));
        assert_eq!(
            r.peers(1),
            [None, None, None, None, Some(0), Some(0), Some(1), Some(1)]
        );
        assert_eq!((r.block_experts(0), r.block_experts(1)), (0..4, 4..8));
        assert_eq!((r.position(0), r.position(3)), (0, 1));
        // 8 experts over 3 slots: 3 | 3 | 2.
        let r = EpLayout::new(3, 1, 3, 8).unwrap();
        let r = r.across().unwrap();
        assert_eq!((r.experts(0, 0), r.experts(2, 0)), (0..3, 6..8));
        assert_eq!(EpLayout::valid(2, 4, 8), vec![1, 2, 4, 8]);
        let e = EpLayout::new(3, 2, 2, 8).unwrap_err().to_string();
        assert!(e.contains("valid: 1, 2, 4"), "{e}");
        let e = EpLayout::new(16, 2, 8, 8).unwrap_err().to_string();
        assert!(e.contains("valid: 1, 2, 4, 8"), "{e}");
    }
}
