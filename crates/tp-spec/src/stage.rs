//! Pipeline stages for inference: each stage holds a contiguous range of layers (the
//! embedding on the first, the final norm and the LM head on the last), chosen so that the
//! cost of each stage (its layers, and the head on the last: [`crate::stage_split`] says
//! what a layer costs, or gives the ranges outright) is as even as contiguous ranges allow.
//! The ranks of a stage split its layers by tensor parallelism as [`crate::ShardPlan`] says.

use crate::config::ModelConfig;
use crate::error::ShardError;
use crate::params::{embed_params, head_params, Param};
use std::ops::Range;

/// One pipeline stage of a model: which layers it holds and where it sits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stage {
    /// This stage's index, `0..count`.
    pub index: usize,
    /// Stages in the pipeline.
    pub count: usize,
    /// The layers it holds (global indices).
    pub layers: Range<usize>,
}

impl Stage {
    /// The one stage of an unpipelined model of `layers` layers.
    pub fn whole(layers: usize) -> Self {
        Stage {
            index: 0,
            count: 1,
            layers: 0..layers,
        }
    }

    /// Holds the embedding (the first stage).
    pub fn is_first(&self) -> bool {
        self.index == 0
    }

    /// Holds the final norm and the LM head (the last stage).
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }

    /// The parameters this stage holds, in the table's order: the embedding on the first
    /// stage, its layers', then the final norm and the head on the last. A tied head is the
    /// embedding matrix, so a last stage that is not also the first holds the embedding too
    /// (as its head).
    pub fn params(&self, cfg: &ModelConfig) -> Vec<Param> {
        let mut out = if self.is_first() {
            embed_params(cfg)
        } else {
            Vec::new()
        };
        for l in self.layers.clone() {
            out.extend(cfg.layer_spec(l).params());
        }
        if self.is_last() {
            out.extend(head_params(cfg));
            if cfg.tied_embeddings && !self.is_first() {
                out.extend(embed_params(cfg));
            }
        }
        out
    }
}

/// Where world rank `rank` of a mesh of `pp` stages of `tp` ranks sits: `(stage, tp rank)`.
/// A stage is `tp` consecutive ranks (one host's, under mpirun), and the stages run in
/// reverse rank order: ranks `0..tp` are the LAST stage, so rank 0 (the leader, which
/// samples) holds the head and the logits never cross a host; the first stage (the
/// embedding) is the highest ranks.
pub fn stage_of_rank(rank: usize, tp: usize, pp: usize) -> (usize, usize) {
    let tp = tp.max(1);
    let pp = pp.max(1);
    (pp - 1 - (rank / tp).min(pp - 1), rank % tp)
}

/// The world rank of `tp_rank` in stage `stage` ([`stage_of_rank`]'s inverse).
pub fn rank_of_stage(stage: usize, tp_rank: usize, tp: usize, pp: usize) -> usize {
    (pp - 1 - stage) * tp + tp_rank
}

/// Splits layers into `pp` contiguous stages, every stage at least one layer, minimising the
/// largest stage's cost: `layer_costs[l]` is layer `l`'s, `head_cost` is added to the last
/// stage (the final norm and the head it reads every token). Among splits with the same
/// largest cost the one found first (earlier stages as long as allowed) is taken, so every
/// rank computing it gets the same answer.
pub fn balanced_stages(
    layer_costs: &[u64],
    head_cost: u64,
    pp: usize,
) -> Result<Vec<Range<usize>>, ShardError> {
    balanced_stages_weighted(layer_costs, head_cost, 1000, pp)
}

/// [`balanced_stages`] with the last stage's cost (its layers and the head) multiplied by
/// `last_permille / 1000`: a last stage whose core also does other work (rank 0's).
pub fn balanced_stages_weighted(
    layer_costs: &[u64],
    head_cost: u64,
    last_permille: u32,
    pp: usize,
) -> Result<Vec<Range<usize>>, ShardError> {
    let n = layer_costs.len();
    if pp == 0 || pp > n {
        return Err(ShardError::InvalidPp { pp, layers: n });
    }
    // prefix[i] = cost of layers 0..i.
    let mut prefix = vec![0u64; n + 1];
    for (i, c) in layer_costs.iter().enumerate() {
        prefix[i + 1] = prefix[i].saturating_add(*c);
    }
    // In thousandths, so the last stage's weight scales it exactly.
    let cost = |a: usize, b: usize, last: bool| match last {
        true => (prefix[b] - prefix[a])
            .saturating_add(head_cost)
            .saturating_mul(u64::from(last_permille)),
        false => (prefix[b] - prefix[a]).saturating_mul(1000),
    };
    // best[s][i]: the least largest cost of splitting layers i..n into stages s..pp, and
    // the end of stage s's range in that split.
    let mut best = vec![vec![(u64::MAX, 0usize); n + 1]; pp + 1];
    best[pp][n] = (0, n);
    for s in (0..pp).rev() {
        let last = s + 1 == pp;
        // Stage s starts at i with at least one layer for each later stage.
        for i in s..=n - (pp - s) {
            let mut pick = (u64::MAX, 0);
            let ends = if last {
                n..=n
            } else {
                i + 1..=n - (pp - s - 1)
            };
            for e in ends {
                let rest = best[s + 1][e].0;
                if rest == u64::MAX {
                    continue;
                }
                let m = cost(i, e, last).max(rest);
                // `<=`: a later end of an equal split wins, so earlier stages are as long as
                // allowed.
                if m <= pick.0 {
                    pick = (m, e);
                }
            }
            best[s][i] = pick;
        }
    }
    let mut out = Vec::with_capacity(pp);
    let mut i = 0;
    for row in &best[..pp] {
        let e = row[i].1;
        out.push(i..e);
        i = e;
    }
    Ok(out)
}

/// The stages of `pp` over `cfg`'s layers with each layer's cost from `layer_cost`, the
/// head's from `head_cost` (the last stage unweighted).
pub fn stages(
    cfg: &ModelConfig,
    pp: usize,
    layer_cost: impl Fn(usize) -> u64,
    head_cost: u64,
) -> Result<Vec<Stage>, ShardError> {
    let costs: Vec<u64> = (0..cfg.layers).map(layer_cost).collect();
    Ok(balanced_stages(&costs, head_cost, pp)?
        .into_iter()
        .enumerate()
        .map(|(index, layers)| Stage {
            index,
            count: pp,
            layers,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every contiguous split of `costs` into `pp` non-empty stages, by brute force: the
    /// least largest cost.
    fn brute(costs: &[u64], head: u64, pp: usize) -> u64 {
        fn go(costs: &[u64], head: u64, at: usize, left: usize) -> u64 {
            let n = costs.len();
            if left == 1 {
                return costs[at..].iter().sum::<u64>() + head;
            }
            (at + 1..=n - (left - 1))
                .map(|e| {
                    costs[at..e]
                        .iter()
                        .sum::<u64>()
                        .max(go(costs, head, e, left - 1))
                })
                .min()
                .unwrap_or(u64::MAX)
        }
        go(costs, head, 0, pp)
    }

    #[test]
    fn the_split_is_contiguous_covers_every_layer_and_is_optimal() {
        let mut rng = crate::Rng::new(7);
        for _ in 0..300 {
            let n = 1 + rng.below(9) as usize;
            let costs: Vec<u64> = (0..n).map(|_| 1 + rng.below(20)).collect();
            let head = rng.below(40);
            for pp in 1..=n {
                let split = balanced_stages(&costs, head, pp).unwrap();
                assert_eq!(split.len(), pp);
                assert_eq!(split[0].start, 0);
                assert_eq!(split[pp - 1].end, n);
                for w in split.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                assert!(split.iter().all(|r| !r.is_empty()));
                let worst = split
                    .iter()
                    .enumerate()
                    .map(|(s, r)| {
                        costs[r.clone()].iter().sum::<u64>() + if s + 1 == pp { head } else { 0 }
                    })
                    .max()
                    .unwrap();
                assert_eq!(
                    worst,
                    brute(&costs, head, pp),
                    "{costs:?} head {head} pp {pp}"
                );
            }
        }
    }

    #[test]
    fn equal_layers_split_evenly_and_the_head_shortens_the_last_stage() {
        let even = balanced_stages(&[10; 30], 0, 2).unwrap();
        assert_eq!(even, vec![0..15, 15..30]);
        let uneven = balanced_stages(&[10; 7], 0, 3).unwrap();
        assert_eq!(uneven.iter().map(|r| r.len()).max(), Some(3));
        let headed = balanced_stages(&[10; 30], 40, 2).unwrap();
        assert_eq!(headed, vec![0..17, 17..30]);
    }

    #[test]
    fn rank_zero_is_on_the_last_stage_and_stages_are_consecutive_ranks() {
        for (tp, pp) in [(1, 1), (1, 3), (2, 2), (3, 2)] {
            let mut seen = std::collections::BTreeSet::new();
            for r in 0..tp * pp {
                let (s, t) = stage_of_rank(r, tp, pp);
                assert_eq!(rank_of_stage(s, t, tp, pp), r);
                assert_eq!(
                    stage_of_rank(r - r % tp, tp, pp).0,
                    s,
                    "a stage is consecutive"
                );
                seen.insert((s, t));
            }
            assert_eq!(seen.len(), tp * pp);
            assert_eq!(stage_of_rank(0, tp, pp), (pp - 1, 0));
        }
    }

    #[test]
    fn more_stages_than_layers_names_the_valid_range() {
        let e = balanced_stages(&[1; 3], 0, 4).unwrap_err();
        assert_eq!(e, ShardError::InvalidPp { pp: 4, layers: 3 });
        assert!(e.to_string().contains("1 <= pp <= 3"), "{e}");
        assert!(balanced_stages(&[1; 3], 0, 0).is_err());
    }
}
