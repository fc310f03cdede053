//! Sampling without gathering the logits: what a forward step returns per row. A row the
//! decoder needs whole ([`RowNeed::Full`]: penalties, a nucleus over the whole vocabulary,
//! more alternatives than [`MAX_CANDIDATES`]) is gathered as before; otherwise
//! ([`RowNeed::Candidates`]) each rank takes the `k` most likely ids of its own vocabulary
//! shard ([`shard_top`]) and the shards are merged ([`merge_top`]): the global top `k` is
//! exactly the full row's, in the same order (value descending by `f32::total_cmp`, ties to
//! the lower id). The softmax normalizer is the fixed-point [`exp_sum`] of every shard against
//! the global maximum, added as integers, so its bits are those of [`log_sum_exp`] over the
//! gathered row. Greedy, top-k and top-p sampling and log-probabilities therefore give the
//! same tokens and bits from candidates as from the full row.
//!
//! [`log_sum_exp`]: crate::logits::log_sum_exp

use crate::error::{EngineError, Result};
use crate::logits::{exp_sum, lse_from_sum};
use crate::protocol::ChunkSpec;

/// Most candidates a row may ask for; a request needing more gets the full row.
pub const MAX_CANDIDATES: usize = 64;

/// What the decoder needs of one row of logits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowNeed {
    /// The whole `[vocab]` row, gathered from every rank.
    #[default]
    Full,
    /// The `k` (1..=[`MAX_CANDIDATES`]) most likely ids, and the softmax normalizer when
    /// `lse` (log-probabilities need it, sampling does not: a second collective).
    Candidates { k: u32, lse: bool },
}

/// Whether rows are always gathered whole: the environment variable `TP_GATHER_LOGITS=1`
/// (the path before distributed sampling, for comparisons; read once).
pub fn force_gather() -> bool {
    static FORCE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FORCE.get_or_init(|| std::env::var("TP_GATHER_LOGITS").is_ok_and(|v| v == "1"))
}

/// A row as candidates: its most likely ids and the log of its softmax normalizer.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidates {
    /// `(logit, id)`, highest first, ties by id: `min(k, vocab)` of them.
    pub top: Vec<(f32, u32)>,
    /// `log_sum_exp` of the whole row (NaN when the row has a NaN), when asked for.
    pub lse: Option<f64>,
    /// Whether the row has a NaN logit (a broken model).
    pub nan: bool,
    /// The row's length.
    pub vocab: usize,
}

/// One row of a step, as the decoder reads it.
#[derive(Clone, Copy, Debug)]
pub enum Row<'a> {
    Full(&'a [f32]),
    Candidates(&'a Candidates),
}

/// The order of candidates: value descending (`total_cmp`), then id ascending.
pub fn order(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// The `k` most likely ids of a shard `row [vocab_shard]` whose first id is `offset`, in
/// [`order`], and whether the shard has a NaN. One pass keeping the best `k` sorted (k is
/// small: a candidate is compared with the worst kept one first), no copy of the row.
pub fn shard_top(row: &[f32], offset: u32, k: usize) -> (Vec<(f32, u32)>, bool) {
    let mut nan = false;
    let mut top: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    for (i, &l) in row.iter().enumerate() {
        nan |= l.is_nan();
        let c = (l, offset + i as u32);
        if top.len() == k && top.last().is_none_or(|w| order(&c, w).is_ge()) {
            continue;
        }
        let at = top.partition_point(|t| order(t, &c).is_lt());
        top.insert(at, c);
        top.truncate(k);
    }
    (top, nan)
}

/// The `k` first of every shard's candidates together, in [`order`].
pub fn merge_top<'a>(
    parts: impl IntoIterator<Item = &'a [(f32, u32)]>,
    k: usize,
) -> Vec<(f32, u32)> {
    let mut all: Vec<(f32, u32)> = parts.into_iter().flatten().copied().collect();
    all.sort_unstable_by(order);
    all.truncate(k);
    all
}

/// The maximum the normalizer is shifted by, from the merged candidates: `None` when the
/// row has a NaN or no finite maximum (then [`exp_sum`] is not needed).
pub fn shift(top: &[(f32, u32)], nan: bool) -> Option<f64> {
    let max = f64::from(top.first()?.0);
    (!nan && max.is_finite()).then_some(max)
}

/// This shard's part of the normalizer for a row shifted by `shift` (0 without a shift).
pub fn shard_sum(row: &[f32], shift: Option<f64>) -> i128 {
    shift.map_or(0, |m| exp_sum(row, m))
}

/// The merged row: candidates `top`, the NaN flag and the shards' summed normalizer parts
/// (`None`: not asked for).
pub fn finish(top: Vec<(f32, u32)>, nan: bool, sum: Option<i128>, vocab: usize) -> Candidates {
    let lse = sum.map(|sum| {
        if nan {
            f64::NAN
        } else {
            match shift(&top, nan) {
                Some(max) => lse_from_sum(max, sum),
                // All -inf (or +inf somewhere): the maximum, as `log_sum_exp` gives it.
                None => top.first().map_or(f64::NEG_INFINITY, |t| f64::from(t.0)),
            }
        }
    });
    Candidates {
        top,
        lse,
        nan,
        vocab,
    }
}

/// Candidates of a whole row split into `shards` contiguous parts (as a vocab-parallel head
/// splits it, the first ones one longer): what the ranks compute, without ranks. With one
/// shard it is the gathered row's candidates. The normalizer only `lse`.
pub fn split_candidates(row: &[f32], k: usize, lse: bool, shards: usize) -> Candidates {
    let shards = shards.clamp(1, row.len().max(1));
    let (base, extra) = (row.len() / shards, row.len() % shards);
    let mut parts = Vec::with_capacity(shards);
    let mut start = 0;
    for s in 0..shards {
        let len = base + usize::from(s < extra);
        parts.push((start, &row[start..start + len]));
        start += len;
    }
    let tops: Vec<(Vec<(f32, u32)>, bool)> = parts
        .iter()
        .map(|&(at, p)| shard_top(p, at as u32, k))
        .collect();
    let nan = tops.iter().any(|t| t.1);
    let top = merge_top(tops.iter().map(|t| t.0.as_slice()), k);
    let m = shift(&top, nan);
    let sum = lse.then(|| parts.iter().map(|&(_, p)| shard_sum(p, m)).sum());
    finish(top, nan, sum, row.len())
}

/// A forward step's rows: whole where asked for, else candidates.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepLogits {
    vocab: usize,
    /// The whole rows, `[full rows, vocab]`.
    full: Vec<f32>,
    rows: Vec<Slot>,
}

#[derive(Clone, Debug, PartialEq)]
enum Slot {
    /// Row index into `full`.
    Full(usize),
    Candidates(Candidates),
}

impl StepLogits {
    /// Every row whole: `full [rows, vocab]`.
    pub fn full(full: Vec<f32>, vocab: usize) -> Self {
        let rows = full.len().checked_div(vocab).unwrap_or(0);
        StepLogits {
            vocab,
            full,
            rows: (0..rows).map(Slot::Full).collect(),
        }
    }

    /// Rows in order from `needs` (one per row): the whole rows from `full [rows with
    /// RowNeed::Full, vocab]` in order, the others from `candidates` in order.
    pub fn assemble(
        needs: &[RowNeed],
        full: Vec<f32>,
        candidates: Vec<Candidates>,
        vocab: usize,
    ) -> Result<Self> {
        let mut cands = candidates.into_iter();
        let mut next_full = 0;
        let mut rows = Vec::with_capacity(needs.len());
        for need in needs {
            rows.push(match need {
                RowNeed::Full => {
                    next_full += 1;
                    Slot::Full(next_full - 1)
                }
                RowNeed::Candidates { .. } => Slot::Candidates(cands.next().ok_or_else(|| {
                    EngineError::Internal("fewer candidate rows than asked for".into())
                })?),
            });
        }
        if next_full * vocab != full.len() || cands.next().is_some() {
            return Err(EngineError::Internal(format!(
                "a step of {} rows got {} logits and other candidates than asked for",
                needs.len(),
                full.len()
            )));
        }
        Ok(StepLogits { vocab, full, rows })
    }

    /// Rows in the step.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> Option<Row<'_>> {
        Some(match self.rows.get(i)? {
            Slot::Full(j) => Row::Full(&self.full[j * self.vocab..(j + 1) * self.vocab]),
            Slot::Candidates(c) => Row::Candidates(c),
        })
    }

    /// Every row in order.
    pub fn rows(&self) -> impl Iterator<Item = Row<'_>> {
        (0..self.len()).filter_map(|i| self.row(i))
    }

    /// The `[rows, vocab]` logits of a step whose rows are all whole.
    pub fn into_full(self) -> Result<Vec<f32>> {
        if self.rows.iter().any(|r| matches!(r, Slot::Candidates(_))) {
            return Err(EngineError::Internal(
                "the step returned candidates, not whole rows".into(),
            ));
        }
        Ok(self.full)
    }
}

/// Rows of logits each chunk returns: every token's with `all_logits`, else the last one.
pub fn chunk_rows(c: &ChunkSpec) -> usize {
    if c.all_logits {
        c.tokens.len()
    } else {
        1
    }
}

/// What a step's rows are returned as, one per row in order.
pub fn row_needs(chunks: &[ChunkSpec]) -> Vec<RowNeed> {
    chunks
        .iter()
        .flat_map(|c| std::iter::repeat_n(c.need, chunk_rows(c)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logits::{log_sum_exp, top_logprobs};

    fn row(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = tp_spec::Rng::new(seed);
        (0..n)
            .map(|_| rng.below(2000) as f32 / 100.0 - 10.0)
            .collect()
    }

    #[test]
    fn shards_merge_to_the_full_rows_top_and_normalizer() {
        for (n, k) in [(1000, 1), (1000, 40), (37, 64), (5, 3), (151_936, 20)] {
            let r = row(n, n as u64);
            let whole = split_candidates(&r, k, true, 1);
            let want = top_logprobs(&r, 0, k).unwrap();
            let ids: Vec<u32> = whole.top.iter().map(|t| t.1).collect();
            let want_ids: Vec<u32> = want.top.iter().map(|t| t.0).collect();
            assert_eq!(ids, want_ids, "n={n} k={k}");
            assert_eq!(whole.lse.map(f64::to_bits), Some(log_sum_exp(&r).to_bits()));
            assert_eq!(split_candidates(&r, k, false, 3).lse, None);
            for shards in [2, 3, 4, 7] {
                assert_eq!(
                    split_candidates(&r, k, true, shards),
                    whole,
                    "n={n} k={k} /{shards}"
                );
            }
        }
    }

    #[test]
    fn ties_across_shards_go_to_the_lower_id() {
        // Equal maxima at 2 (shard 0 of 2) and 7 (shard 1), and a tie at the boundary.
        let mut r = vec![0.0f32; 10];
        r[2] = 5.0;
        r[7] = 5.0;
        r[4] = 3.0;
        r[5] = 3.0;
        let c = split_candidates(&r, 4, true, 2);
        let ids: Vec<u32> = c.top.iter().map(|t| t.1).collect();
        assert_eq!(ids, vec![2, 7, 4, 5]);
        // The same when the later shard is searched first.
        let (a, _) = shard_top(&r[..5], 0, 4);
        let (b, _) = shard_top(&r[5..], 5, 4);
        assert_eq!(merge_top([&b[..], &a[..]], 4), c.top);
    }

    #[test]
    fn nan_and_infinite_rows() {
        let mut r = row(100, 1);
        r[60] = f32::NAN;
        let c = split_candidates(&r, 5, true, 3);
        assert!(c.nan && c.lse.is_some_and(f64::is_nan));
        let c = split_candidates(&[f32::NEG_INFINITY; 6], 2, true, 2);
        assert_eq!(c.lse, Some(f64::NEG_INFINITY));
        let mut r = vec![0.0f32; 6];
        r[4] = f32::INFINITY;
        assert_eq!(split_candidates(&r, 2, true, 2).lse, Some(log_sum_exp(&r)));
    }
}
