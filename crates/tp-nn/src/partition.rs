//! Balanced contiguous shards of units (heads, FFN columns, vocab rows) and the GQA head plan
//! (docs/design.md "Uneven and head-granular shards"; Megatron §3 splits by heads).

use crate::error::{Result, TpError};
use std::ops::Range;

/// `units` split over `tp` ranks in contiguous ranges; sizes differ by at most one unit and
/// lower ranks get the extra one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    units: usize,
    tp: usize,
}

impl Partition {
    /// `what` is the plural noun used in errors ("heads"), `unit` its singular ("head").
    pub fn new(units: usize, tp: usize, what: &'static str, unit: &'static str) -> Result<Self> {
        if tp == 0 || tp > units {
            return Err(TpError::InvalidTp {
                units,
                what,
                unit,
                tp,
            });
        }
        Ok(Partition { units, tp })
    }

    pub fn units(&self) -> usize {
        self.units
    }
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// The units of `tp_rank` (empty for a rank out of range).
    pub fn range(&self, tp_rank: usize) -> Range<usize> {
        if tp_rank >= self.tp {
            return self.units..self.units;
        }
        let base = self.units / self.tp;
        let extra = self.units % self.tp;
        let start = tp_rank * base + tp_rank.min(extra);
        let len = base + usize::from(tp_rank < extra);
        start..start + len
    }

    pub fn len(&self, tp_rank: usize) -> usize {
        self.range(tp_rank).len()
    }

    pub fn is_empty(&self) -> bool {
        self.units == 0
    }

    /// Every rank's size, in rank order.
    pub fn sizes(&self) -> Vec<usize> {
        (0..self.tp).map(|r| self.len(r)).collect()
    }

    pub fn check_rank(&self, tp_rank: usize) -> Result<()> {
        if tp_rank >= self.tp {
            return Err(TpError::InvalidRank {
                tp_rank,
                tp: self.tp,
            });
        }
        Ok(())
    }
}

/// Which query and KV heads a rank holds under grouped-query attention.
///
/// Query heads are split by [`Partition`]; a rank holds the KV heads its query heads need,
/// `kv(first q head)..=kv(last q head)`, so KV heads are replicated when tp exceeds them or
/// a rank's query heads span two KV groups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadPlan {
    pub heads: usize,
    pub kv_heads: usize,
    pub q: Partition,
    tp_rank: usize,
}

impl HeadPlan {
    pub fn new(heads: usize, kv_heads: usize, tp_rank: usize, tp: usize) -> Result<Self> {
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(TpError::Config(format!(
                "{heads} query heads are not a multiple of {kv_heads} KV heads; use a KV head count that divides the query heads"
            )));
        }
        let q = Partition::new(heads, tp, "heads", "head")?;
        q.check_rank(tp_rank)?;
        Ok(HeadPlan {
            heads,
            kv_heads,
            q,
            tp_rank,
        })
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    pub fn q_range(&self) -> Range<usize> {
        self.q.range(self.tp_rank)
    }

    pub fn kv_range(&self) -> Range<usize> {
        let q = self.q_range();
        let g = self.group();
        q.start / g..(q.end - 1) / g + 1
    }

    /// For each local query head, the index of its KV head among the local KV heads.
    pub fn local_kv_of_q(&self) -> Vec<u32> {
        let kv0 = self.kv_range().start;
        self.q_range()
            .map(|h| (h / self.group() - kv0) as u32)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_lower_ranks_get_extra() {
        let p = Partition::new(9, 4, "heads", "head").unwrap();
        assert_eq!(p.sizes(), vec![3, 2, 2, 2]);
        assert_eq!(p.range(0), 0..3);
        assert_eq!(p.range(3), 7..9);
    }

    #[test]
    fn tp_too_large_names_range() {
        let e = Partition::new(9, 12, "heads", "head")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("9 heads cannot give every rank a head at tp=12; use 1 <= tp <= 9"),
            "{e}"
        );
        assert!(Partition::new(9, 0, "heads", "head").is_err());
    }

    #[test]
    fn kv_heads_follow_query_heads() {
        // 9 heads, 3 KV heads (groups of 3), tp=4: q ranges 0..3, 3..5, 5..7, 7..9.
        let kv: Vec<_> = (0..4)
            .map(|r| HeadPlan::new(9, 3, r, 4).unwrap().kv_range())
            .collect();
        assert_eq!(kv, vec![0..1, 1..2, 1..3, 2..3]);
        let p = HeadPlan::new(9, 3, 2, 4).unwrap();
        assert_eq!(p.local_kv_of_q(), vec![0, 1]);
        // 8 heads, 2 KV heads, tp=8: every rank holds one KV head (replication).
        let kv: Vec<_> = (0..8)
            .map(|r| HeadPlan::new(8, 2, r, 8).unwrap().kv_range())
            .collect();
        assert_eq!(kv[3], 0..1);
        assert_eq!(kv[4], 1..2);
    }
}
