//! Balanced or weighted contiguous shards of units (heads, FFN columns, vocab rows) and the GQA
//! head plan (docs/design.md "Uneven and head-granular shards"; Megatron §3 splits by heads).

use crate::error::ShardError;
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

/// The largest weight a rank may have. Weights are ratios (2,1 is 200,100); beyond 1000:1 the
/// small rank would hold less than one unit of any model this runs.
pub const MAX_RANK_WEIGHT: u32 = 1000;

/// How much of every split each tp rank takes, in rank order: rank r gets about
/// `weights[r] / sum(weights)` of the heads, FFN blocks and vocabulary rows (a faster or
/// larger host gets a larger contiguous shard). Validated once: at least one rank, every
/// weight in `1..=MAX_RANK_WEIGHT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankWeights(Weights);

#[derive(Clone, Debug, PartialEq, Eq)]
enum Weights {
    /// Weight 1 for each of this many ranks, stored as a count: a tp from user input is
    /// refused by the split ([`ShardError::InvalidTp`]) before anything of its size is allocated.
    Even(usize),
    /// Validated weights, one per rank.
    Given(Vec<u32>),
}

impl RankWeights {
    pub fn new(weights: Vec<u32>) -> Result<Self, ShardError> {
        if weights.is_empty() {
            return Err(ShardError::RankWeightCount { count: 0, tp: None });
        }
        for (rank, &weight) in weights.iter().enumerate() {
            if weight == 0 {
                return Err(ShardError::RankWeightZero { rank });
            }
            if weight > MAX_RANK_WEIGHT {
                return Err(ShardError::RankWeightTooLarge {
                    rank,
                    weight: u64::from(weight),
                    max: MAX_RANK_WEIGHT,
                });
            }
        }
        Ok(RankWeights(Weights::Given(weights)))
    }

    /// Weight 1 for each of `tp` ranks: exactly the balanced split of [`Partition::new`]
    /// (whose checks refuse a `tp` of 0 or above the units).
    pub fn even(tp: usize) -> Self {
        RankWeights(Weights::Even(tp))
    }

    /// The number of ranks.
    pub fn tp(&self) -> usize {
        match &self.0 {
            Weights::Even(tp) => *tp,
            Weights::Given(w) => w.len(),
        }
    }

    /// Rank `rank`'s weight (0 for a rank out of range).
    pub fn weight(&self, rank: usize) -> u32 {
        match &self.0 {
            Weights::Even(tp) => u32::from(rank < *tp),
            Weights::Given(w) => w.get(rank).copied().unwrap_or(0),
        }
    }

    /// Every rank has the same weight (the split is the balanced one).
    pub fn is_even(&self) -> bool {
        match &self.0 {
            Weights::Even(_) => true,
            Weights::Given(w) => w.iter().all(|&x| x == w[0]),
        }
    }

    /// Refuses weights that are not one per rank of a `tp`-rank group.
    pub fn check_tp(&self, tp: usize) -> Result<(), ShardError> {
        if self.tp() != tp {
            return Err(ShardError::RankWeightCount {
                count: self.tp(),
                tp: Some(tp),
            });
        }
        Ok(())
    }
}

impl fmt::Display for RankWeights {
    /// `2,1`: the form [`FromStr`] reads (given weights).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Weights::Even(tp) => write!(f, "even over {tp} ranks"),
            Weights::Given(w) => {
                for (i, x) in w.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{x}")?;
                }
                Ok(())
            }
        }
    }
}

impl FromStr for RankWeights {
    type Err = ShardError;

    /// Whole numbers separated by commas (`2,1`; spaces around a number are allowed).
    fn from_str(text: &str) -> Result<Self, ShardError> {
        let syntax = || ShardError::RankWeightSyntax {
            text: text.chars().take(64).collect(),
        };
        let mut weights = Vec::new();
        for (rank, part) in text.split(',').enumerate() {
            let part = part.trim();
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(syntax());
            }
            // All digits: a parse failure can only be an overflow.
            let weight = part.parse::<u64>().unwrap_or(u64::MAX);
            if weight > u64::from(MAX_RANK_WEIGHT) {
                return Err(ShardError::RankWeightTooLarge {
                    rank,
                    weight,
                    max: MAX_RANK_WEIGHT,
                });
            }
            weights.push(weight as u32);
        }
        RankWeights::new(weights)
    }
}

/// `units` split over `tp` ranks in contiguous ranges. Balanced ([`Partition::new`]): sizes
/// differ by at most one unit and lower ranks get the extra one. Weighted
/// ([`Partition::weighted`]): sizes proportional to the ranks' weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    units: usize,
    tp: usize,
    /// Weighted: rank r holds `bounds[r]..bounds[r + 1]` (`tp + 1` entries). `None`: balanced.
    bounds: Option<Vec<usize>>,
}

impl Partition {
    /// `what` is the plural noun used in errors ("heads"), `unit` its singular ("head").
    pub fn new(
        units: usize,
        tp: usize,
        what: &'static str,
        unit: &'static str,
    ) -> Result<Self, ShardError> {
        if tp == 0 || tp > units {
            return Err(ShardError::InvalidTp {
                units,
                what,
                unit,
                tp,
            });
        }
        Ok(Partition {
            units,
            tp,
            bounds: None,
        })
    }

    /// `units` over `weights.tp()` ranks, each rank's share proportional to its weight,
    /// rounded by largest remainder: rank r first gets `floor(units * w_r / W)` (W the sum of
    /// the weights), then the units left over go one each to the ranks with the largest
    /// remainders `units * w_r mod W`, lower rank first on ties. Deterministic, and equal
    /// weights give exactly [`Partition::new`]'s ranges. A rank whose share rounds to no unit
    /// is [`ShardError::EmptyWeightedShare`], naming it. [`RankWeights::even`] is
    /// [`Partition::new`].
    pub fn weighted(
        units: usize,
        weights: &RankWeights,
        what: &'static str,
        unit: &'static str,
    ) -> Result<Self, ShardError> {
        let w = match &weights.0 {
            Weights::Even(tp) => return Partition::new(units, *tp, what, unit),
            Weights::Given(w) => w,
        };
        let tp = w.len();
        if tp > units {
            return Err(ShardError::InvalidTp {
                units,
                what,
                unit,
                tp,
            });
        }
        let total: u128 = w.iter().map(|&x| u128::from(x)).sum();
        let share = |x: u32| (units as u128) * u128::from(x);
        let mut sizes: Vec<usize> = w.iter().map(|&x| (share(x) / total) as usize).collect();
        let left = units - sizes.iter().sum::<usize>(); // < tp
        let mut by_remainder: Vec<usize> = (0..tp).collect();
        by_remainder.sort_by_key(|&r| (std::cmp::Reverse(share(w[r]) % total), r));
        for &r in &by_remainder[..left] {
            sizes[r] += 1;
        }
        if let Some(rank) = sizes.iter().position(|&s| s == 0) {
            return Err(ShardError::EmptyWeightedShare {
                rank,
                weights: weights.to_string(),
                units,
                what,
                unit,
                share: share(w[rank]) as f64 / total as f64,
            });
        }
        let mut bounds = Vec::with_capacity(tp + 1);
        bounds.push(0);
        for s in &sizes {
            bounds.push(bounds[bounds.len() - 1] + s);
        }
        Ok(Partition {
            units,
            tp,
            bounds: Some(bounds),
        })
    }

    /// No units over `tp` ranks: every rank's range is empty (a plan of one block, which has
    /// no vocabulary rows).
    pub(crate) fn empty(tp: usize) -> Self {
        Partition {
            units: 0,
            tp,
            bounds: None,
        }
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
        if let Some(b) = &self.bounds {
            return b[tp_rank]..b[tp_rank + 1];
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

    pub fn check_rank(&self, tp_rank: usize) -> Result<(), ShardError> {
        if tp_rank >= self.tp {
            return Err(ShardError::InvalidRank {
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
    pub fn new(
        heads: usize,
        kv_heads: usize,
        tp_rank: usize,
        tp: usize,
    ) -> Result<Self, ShardError> {
        Self::check_groups(heads, kv_heads)?;
        Self::with_partition(
            heads,
            kv_heads,
            tp_rank,
            Partition::new(heads, tp, "heads", "head")?,
        )
    }

    /// Query heads split in proportion to `weights` ([`Partition::weighted`]); KV heads follow
    /// the query heads as in [`HeadPlan::new`].
    pub fn weighted(
        heads: usize,
        kv_heads: usize,
        tp_rank: usize,
        weights: &RankWeights,
    ) -> Result<Self, ShardError> {
        Self::check_groups(heads, kv_heads)?;
        Self::with_partition(
            heads,
            kv_heads,
            tp_rank,
            Partition::weighted(heads, weights, "heads", "head")?,
        )
    }

    fn check_groups(heads: usize, kv_heads: usize) -> Result<(), ShardError> {
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(ShardError::Groups(format!(
                "{heads} query heads are not a multiple of {kv_heads} KV heads; use a KV head count that divides the query heads"
            )));
        }
        Ok(())
    }

    fn with_partition(
        heads: usize,
        kv_heads: usize,
        tp_rank: usize,
        q: Partition,
    ) -> Result<Self, ShardError> {
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

    fn weights(w: &[u32]) -> RankWeights {
        RankWeights::new(w.to_vec()).unwrap()
    }

    /// Contiguous, covering `0..units`, in rank order.
    fn assert_tiles(p: &Partition) {
        let mut next = 0;
        for r in 0..p.tp() {
            let range = p.range(r);
            assert_eq!(range.start, next, "rank {r} of {p:?}");
            assert!(!range.is_empty(), "rank {r} of {p:?}");
            next = range.end;
        }
        assert_eq!(next, p.units());
        assert_eq!(p.sizes().iter().sum::<usize>(), p.units());
    }

    #[test]
    fn equal_weights_give_the_balanced_ranges() {
        for units in 1..=70 {
            for tp in 1..=units.min(9) {
                let even = Partition::new(units, tp, "u", "u").unwrap();
                for w in [1, 2, 7, MAX_RANK_WEIGHT] {
                    let p = Partition::weighted(units, &weights(&vec![w; tp]), "u", "u").unwrap();
                    let ranges: Vec<_> = (0..tp).map(|r| p.range(r)).collect();
                    let want: Vec<_> = (0..tp).map(|r| even.range(r)).collect();
                    assert_eq!(ranges, want, "{units} units, tp {tp}, weight {w}");
                }
            }
        }
        assert!(RankWeights::even(3).is_even());
        assert_eq!(
            Partition::weighted(9, &RankWeights::even(4), "u", "u").unwrap(),
            Partition::new(9, 4, "u", "u").unwrap()
        );
        // A huge tp from user input is refused, never allocated.
        let e = Partition::weighted(9, &RankWeights::even(1 << 60), "heads", "head")
            .unwrap_err()
            .to_string();
        assert!(e.contains("use 1 <= tp <= 9"), "{e}");
        assert!(!weights(&[2, 1]).is_even());
    }

    #[test]
    fn weighted_shares_are_proportional_and_contiguous() {
        let p = Partition::weighted(9, &weights(&[2, 1]), "heads", "head").unwrap();
        assert_eq!(p.sizes(), vec![6, 3]);
        assert_eq!(p.range(0), 0..6);
        assert_eq!(p.range(1), 6..9);
        let p = Partition::weighted(9, &weights(&[1, 2]), "heads", "head").unwrap();
        assert_eq!(p.sizes(), vec![3, 6]);
        // 48 blocks at 3:2:1 -> 24, 16, 8 exactly.
        let p = Partition::weighted(48, &weights(&[3, 2, 1]), "u", "u").unwrap();
        assert_eq!(p.sizes(), vec![24, 16, 8]);
        // 9 heads at 3:2:1: quotas 4.5, 3, 1.5 -> floors 4, 3, 1, one left over; ranks 0 and 2
        // tie on remainder (0.5), the lower rank takes it.
        let p = Partition::weighted(9, &weights(&[3, 2, 1]), "u", "u").unwrap();
        assert_eq!(p.sizes(), vec![5, 3, 1]);
        // Largest remainder: 10 units at 1:1:1:3 -> quotas 1.67, 1.67, 1.67, 5 -> 2, 2, 1, 5.
        let p = Partition::weighted(10, &weights(&[1, 1, 1, 3]), "u", "u").unwrap();
        assert_eq!(p.sizes(), vec![2, 2, 1, 5]);
        for (units, w) in [
            (49152, vec![2, 1]),
            (49152, vec![5, 3, 1]),
            (1536, vec![7, 1, 1, 2]),
            (9, vec![1, 1, 7]),
            (1001, vec![1, 1000]),
        ] {
            let rw = weights(&w);
            let p = Partition::weighted(units, &rw, "u", "u").unwrap();
            assert_tiles(&p);
            let total: f64 = w.iter().map(|&x| x as f64).sum();
            for (r, &x) in w.iter().enumerate() {
                // Largest remainder: every size within one unit of its exact quota.
                let quota = units as f64 * x as f64 / total;
                let got = p.len(r) as f64;
                assert!(
                    (got - quota).abs() < 1.0,
                    "{units} at {w:?}: rank {r} got {got}, quota {quota}"
                );
            }
        }
    }

    #[test]
    fn weighted_shares_that_round_to_nothing_name_the_rank() {
        let e = Partition::weighted(9, &weights(&[1, 1, 20]), "heads", "head")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("with rank weights 1,1,20, rank 1's share of the 9 heads is 0.41, less than one head; raise its weight"),
            "{e}"
        );
        let e = Partition::weighted(2, &weights(&[1, 1, 1]), "heads", "head")
            .unwrap_err()
            .to_string();
        assert!(e.contains("use 1 <= tp <= 2"), "{e}");
    }

    #[test]
    fn rank_weights_are_validated_and_parsed() {
        let w: RankWeights = " 2, 1".parse().unwrap();
        assert_eq!((w.weight(0), w.weight(1), w.weight(2)), (2, 1, 0));
        assert_eq!(w.to_string(), "2,1");
        assert_eq!(w.tp(), 2);
        w.check_tp(2).unwrap();
        let e = w.check_tp(3).unwrap_err().to_string();
        assert!(
            e.contains("2 rank weight(s) for 3 ranks; give exactly one weight per rank"),
            "{e}"
        );
        let err = |s: &str| s.parse::<RankWeights>().unwrap_err().to_string();
        assert!(err("2,0").contains("rank 1 has weight 0"), "{}", err("2,0"));
        assert!(
            err("1001,1").contains("rank 0 has weight 1001, more than the largest allowed (1000)")
        );
        assert!(err("1,99999999999999999999999").contains("rank 1 has weight 18446744073709551615"));
        for bad in ["", "2,", "a,1", "-1,2", "1.5,1", "2;1", "+2,1"] {
            assert!(
                err(bad).contains("are not whole numbers separated by commas"),
                "{bad}: {}",
                err(bad)
            );
        }
        assert!(RankWeights::new(vec![])
            .unwrap_err()
            .to_string()
            .contains("0 rank weight(s) given"));
        assert!(RankWeights::new(vec![1, 0]).is_err());
    }

    #[test]
    fn weighted_heads_keep_kv_groups() {
        // 9 heads, 3 KV heads (groups of 3) at 2:1: q 0..6 | 6..9, KV 0..2 | 2..3.
        let w = weights(&[2, 1]);
        let p0 = HeadPlan::weighted(9, 3, 0, &w).unwrap();
        let p1 = HeadPlan::weighted(9, 3, 1, &w).unwrap();
        assert_eq!((p0.q_range(), p0.kv_range()), (0..6, 0..2));
        assert_eq!((p1.q_range(), p1.kv_range()), (6..9, 2..3));
        // 1:2: q 0..3 | 3..9.
        let w = weights(&[1, 2]);
        assert_eq!(HeadPlan::weighted(9, 3, 1, &w).unwrap().kv_range(), 1..3);
        // 3:2:1 spans groups: q 0..5 | 5..8 | 8..9 -> KV 0..2 | 1..3 | 2..3.
        let w = weights(&[3, 2, 1]);
        let kv: Vec<_> = (0..3)
            .map(|r| HeadPlan::weighted(9, 3, r, &w).unwrap().kv_range())
            .collect();
        assert_eq!(kv, vec![0..2, 1..3, 2..3]);
        assert_eq!(
            HeadPlan::weighted(9, 3, 1, &w).unwrap().local_kv_of_q(),
            vec![0, 1, 1]
        );
    }
}
