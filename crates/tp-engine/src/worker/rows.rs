//! The last stage's rows of a forward step, from each tp rank's `[rows, vocab_local]` logits
//! of the vocab-parallel head: whole rows gathered ([`ShardedModel::gather_logits`]), the
//! others as candidates ([`crate::candidates`]) by two small all-gathers over the tp group:
//! each rank's top `k` of its shard with a NaN flag (`1 + 2k` u32 words a row), then, against
//! the merged maximum, each rank's fixed-point part of the normalizer (two u64 words a row;
//! only for rows that ask for it: log-probabilities need it, sampling does not).

use crate::candidates::{
    finish, merge_top, shard_sum, shard_top, shift, Candidates, RowNeed, StepLogits,
};
use crate::error::Result;
use tp_comm::{CommExt, Group};
use tp_models::{Profile, ShardedModel};

/// The step's rows as `needs` (one per row) asks, from this rank's `local [rows,
/// vocab_local]` logits. Every rank of `tp` calls it with the same `needs`.
pub(super) fn step_logits(
    model: &ShardedModel,
    local: Vec<f32>,
    needs: &[RowNeed],
    tp: &Group,
    prof: &mut Profile,
) -> Result<StepLogits> {
    let vocab = model.config().vocab;
    let rows = needs.len();
    let width = local.len() / rows.max(1);
    let cands = candidates(model, &local, width, needs, tp, prof)?;
    let full_rows = needs.iter().filter(|n| **n == RowNeed::Full).count();
    let full = if full_rows == rows {
        model.gather_logits(local, rows, tp, prof)?
    } else if full_rows > 0 {
        let picked: Vec<f32> = needs // [full_rows, vocab_local]
            .iter()
            .zip(local.chunks_exact(width.max(1)))
            .filter(|(n, _)| **n == RowNeed::Full)
            .flat_map(|(_, r)| r.iter().copied())
            .collect();
        model.gather_logits(picked, full_rows, tp, prof)?
    } else {
        Vec::new()
    };
    StepLogits::assemble(needs, full, cands, vocab)
}

/// The merged candidates of every [`RowNeed::Candidates`] row, in row order.
fn candidates(
    model: &ShardedModel,
    local: &[f32],
    width: usize,
    needs: &[RowNeed],
    tp: &Group,
    prof: &mut Profile,
) -> Result<Vec<Candidates>> {
    let asked: Vec<(usize, usize, bool)> = needs
        .iter()
        .enumerate()
        .filter_map(|(i, n)| match *n {
            RowNeed::Candidates { k, lse } => Some((i, k as usize, lse)),
            RowNeed::Full => None,
        })
        .collect();
    if asked.is_empty() {
        return Ok(Vec::new());
    }
    let row = |i: usize| &local[i * width..(i + 1) * width]; // [vocab_local]
    let offset = model.plan().vocab_rows().start as u32;
    let ranks = tp.size();
    // Round 1: per row, the NaN flag and k (logit bits, id) pairs; a shard shorter than k
    // pads with ids u32::MAX, dropped in the merge.
    let words: usize = asked.iter().map(|&(_, k, _)| 1 + 2 * k).sum();
    let mut mine: Vec<u32> = Vec::with_capacity(words);
    for &(i, k, _) in &asked {
        let (top, nan) = shard_top(row(i), offset, k);
        mine.push(u32::from(nan));
        for j in 0..k {
            let (v, id) = top.get(j).copied().unwrap_or((f32::NEG_INFINITY, u32::MAX));
            mine.extend([v.to_bits(), id]);
        }
    }
    let all = gather(mine, tp, prof)?; // [ranks, words]
    let mut merged = Vec::with_capacity(asked.len());
    let mut at = 0;
    for &(_, k, _) in &asked {
        let mut nan = false;
        let mut parts = Vec::with_capacity(ranks * k);
        for r in 0..ranks {
            let w = &all[r * words + at..r * words + at + 1 + 2 * k];
            nan |= w[0] != 0;
            parts.extend(
                w[1..]
                    .chunks_exact(2)
                    .filter(|p| p[1] != u32::MAX)
                    .map(|p| (f32::from_bits(p[0]), p[1])),
            );
        }
        at += 1 + 2 * k;
        merged.push((merge_top([&parts[..]], k), nan));
    }
    // Round 2, for the rows asking for it: each shard's fixed-point sum against the merged
    // maximum, added as integers (0 where the row has a NaN or no finite maximum).
    let mut sums: Vec<Option<i128>> = asked.iter().map(|a| a.2.then_some(0)).collect();
    let mine: Vec<u64> = asked
        .iter()
        .zip(&merged)
        .filter(|(a, _)| a.2)
        .flat_map(|(&(i, _, _), (top, nan))| {
            let s = shard_sum(row(i), shift(top, *nan)) as u128;
            [s as u64, (s >> 64) as u64]
        })
        .collect();
    let n = mine.len();
    if n > 0 {
        let all = gather(mine, tp, prof)?; // [ranks, rows asking * 2]
        for part in all.chunks_exact(n) {
            let mut words = part.chunks_exact(2);
            for sum in sums.iter_mut().flatten() {
                if let Some(w) = words.next() {
                    *sum = sum.wrapping_add((u128::from(w[0]) | u128::from(w[1]) << 64) as i128);
                }
            }
        }
    }
    let vocab = model.config().vocab;
    Ok(merged
        .into_iter()
        .zip(sums)
        .map(|((top, nan), sum)| finish(top, nan, sum, vocab))
        .collect())
}

/// Every rank's `mine` (the same length on every rank), in rank order.
fn gather<T: tp_comm::Elem + Default + Copy>(
    mine: Vec<T>,
    tp: &Group,
    prof: &mut Profile,
) -> Result<Vec<T>> {
    let ranks = tp.size();
    if ranks == 1 {
        return Ok(mine);
    }
    let mut all = vec![T::default(); mine.len() * ranks];
    prof.time_comm(|| tp.all_gather(&mine, &mut all))?;
    prof.sent_all_gather(std::mem::size_of_val(mine.as_slice()), ranks);
    Ok(all)
}
