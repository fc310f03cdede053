//! The 1F1B pipeline schedule (PipeDream-Flush; Narayanan et al. 2021, §2.2.1, Fig. 4 top):
//! stage p runs `min(P - 1 - p, M)` warm-up forwards, then alternates one forward and one
//! backward, then drains the remaining backwards. At most `P - p` micro-batches are in
//! flight on stage p, instead of all M under GPipe.
//!
//! Its interleaved form ([`interleaved`], §2.2.2, Fig. 4 bottom; Megatron-LM's
//! `forward_backward_pipelining_with_interleaving`): each of the P ranks holds V model chunks
//! (chunk c of rank s is the model's chunk `c * P + s`), so a micro-batch passes every rank V
//! times and the bubble shrinks V-fold, to `(P - 1) / (V * M)` of the ideal step.

/// One step of a stage's schedule, on micro-batch `usize`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Forward(usize),
    Backward(usize),
}

/// The 1F1B order of stage `stage` of `stages` for `micro_batches` micro-batches.
pub fn one_f_one_b(stage: usize, stages: usize, micro_batches: usize) -> Vec<Action> {
    let m = micro_batches;
    let warmup = stages.saturating_sub(stage + 1).min(m);
    let mut out = Vec::with_capacity(2 * m);
    let (mut f, mut b) = (0, 0);
    while f < warmup {
        out.push(Action::Forward(f));
        f += 1;
    }
    while f < m {
        out.push(Action::Forward(f));
        f += 1;
        out.push(Action::Backward(b));
        b += 1;
    }
    while b < m {
        out.push(Action::Backward(b));
        b += 1;
    }
    out
}

/// One step of a rank's schedule on one of its model chunks (`0..V`, [`interleaved`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkAction {
    /// The rank's chunk: chunk c of rank s is the model's chunk `c * P + s`.
    pub chunk: usize,
    pub action: Action,
}

/// The schedule of rank `stage` of `stages` holding `chunks` model chunks: 1F1B
/// ([`one_f_one_b`], on chunk 0) for one chunk, else [`interleaved`].
pub fn rank_schedule(
    stage: usize,
    stages: usize,
    chunks: usize,
    micro_batches: usize,
) -> Vec<ChunkAction> {
    if chunks <= 1 {
        return one_f_one_b(stage, stages, micro_batches)
            .into_iter()
            .map(|action| ChunkAction { chunk: 0, action })
            .collect();
    }
    interleaved(stage, stages, chunks, micro_batches)
}

/// The interleaved 1F1B order of rank `stage` of `stages`, each holding `chunks` model
/// chunks, for `micro_batches` (a multiple of `stages`, as Megatron-LM requires; the trainer
/// checks it). The rank's `M * V` chunk forwards are taken in groups of `P` micro-batches:
/// forward k runs chunk `(k mod P V) / P` on micro-batch `(k / P V) P + k mod P`; backward k
/// the same micro-batch on the chunks in reverse order. Warm-up: `(P - s - 1) * 2 + (V - 1) *
/// P` forwards (at most `M * V`), then one forward and one backward in turn, then the
/// remaining backwards.
pub fn interleaved(
    stage: usize,
    stages: usize,
    chunks: usize,
    micro_batches: usize,
) -> Vec<ChunkAction> {
    let (p, v) = (stages.max(1), chunks.max(1));
    let total = micro_batches * v;
    let warmup = ((p.saturating_sub(stage + 1)) * 2 + (v - 1) * p).min(total);
    let group = p * v;
    let micro = |k: usize| (k / group) * p + k % p;
    let forward = |k: usize| ChunkAction {
        chunk: (k % group) / p,
        action: Action::Forward(micro(k)),
    };
    let backward = |k: usize| ChunkAction {
        chunk: v - 1 - (k % group) / p,
        action: Action::Backward(micro(k)),
    };
    let mut out = Vec::with_capacity(2 * total);
    out.extend((0..warmup).map(forward));
    for k in 0..total - warmup {
        out.push(forward(k + warmup));
        out.push(backward(k));
    }
    out.extend((total - warmup..total).map(backward));
    out
}

/// The most micro-batches (chunk micro-batches under [`interleaved`]) whose activations a
/// stage holds at once under `actions`.
pub fn peak_in_flight<'a>(actions: impl IntoIterator<Item = &'a Action>) -> usize {
    let (mut live, mut peak) = (0usize, 0usize);
    for a in actions {
        match a {
            Action::Forward(_) => live += 1,
            Action::Backward(_) => live = live.saturating_sub(1),
        }
        peak = peak.max(live);
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::*;

    #[test]
    fn four_stages_eight_micro_batches() {
        let s0 = one_f_one_b(0, 4, 8);
        assert_eq!(
            &s0[..5],
            &[Forward(0), Forward(1), Forward(2), Forward(3), Backward(0)]
        );
        let s3 = one_f_one_b(3, 4, 8);
        assert_eq!(
            &s3[..4],
            &[Forward(0), Backward(0), Forward(1), Backward(1)]
        );
        for p in 0..4 {
            let s = one_f_one_b(p, 4, 8);
            assert_eq!(s.len(), 16);
            assert_eq!(peak_in_flight(&s), 4 - p);
        }
    }

    #[test]
    fn every_micro_batch_once_and_backward_after_its_forward() {
        for stages in 1..=5 {
            for m in 1..=7 {
                for p in 0..stages {
                    let s = one_f_one_b(p, stages, m);
                    for i in 0..m {
                        let f = s.iter().position(|a| *a == Forward(i)).unwrap();
                        let b = s.iter().position(|a| *a == Backward(i)).unwrap();
                        assert!(f < b);
                    }
                    assert_eq!(s.len(), 2 * m);
                    // Backwards run in forward order (the pipeline's FIFO of activations).
                    let bs: Vec<usize> = s
                        .iter()
                        .filter_map(|a| match a {
                            Backward(i) => Some(*i),
                            _ => None,
                        })
                        .collect();
                    assert_eq!(bs, (0..m).collect::<Vec<_>>());
                }
            }
        }
    }

    /// Simulates all stages with blocking receives: the schedule must never deadlock.
    #[test]
    fn stages_never_wait_on_each_other_forever() {
        for stages in 1..=4 {
            for m in 1..=6 {
                let scheds: Vec<Vec<Action>> =
                    (0..stages).map(|p| one_f_one_b(p, stages, m)).collect();
                let mut pos = vec![0usize; stages];
                let mut fwd_done = vec![vec![false; m]; stages];
                let mut bwd_done = vec![vec![false; m]; stages];
                loop {
                    let mut progressed = false;
                    for p in 0..stages {
                        let Some(&a) = scheds[p].get(pos[p]) else {
                            continue;
                        };
                        let ready = match a {
                            Forward(i) => p == 0 || fwd_done[p - 1][i],
                            Backward(i) => p + 1 == stages || bwd_done[p + 1][i],
                        };
                        if ready {
                            match a {
                                Forward(i) => fwd_done[p][i] = true,
                                Backward(i) => bwd_done[p][i] = true,
                            }
                            pos[p] += 1;
                            progressed = true;
                        }
                    }
                    if !progressed {
                        break;
                    }
                }
                assert!(
                    (0..stages).all(|p| pos[p] == 2 * m),
                    "deadlock at P={stages} M={m}: {pos:?}"
                );
            }
        }
    }

    /// Every (p, v, m) of the issue: up to 4 ranks, 4 chunks each and 8 micro-batches (a
    /// multiple of p, as interleaving needs).
    fn interleaved_cases() -> impl Iterator<Item = (usize, usize, usize)> {
        (2..=4).flat_map(|p| {
            (2..=4).flat_map(move |v| (1..=8).filter(move |m| m % p == 0).map(move |m| (p, v, m)))
        })
    }

    /// All ranks of an interleaved pipeline run with blocking receives (sends are buffered,
    /// as tp-comm's are): each chunk forward waits for the model's previous chunk to have run
    /// that micro-batch forward, each chunk backward for the next chunk's backward (the last
    /// chunk for its own forward). Forwards take `tf`, backwards `tb`, messages no time.
    /// Returns the step's time and each rank's peak in-flight chunk micro-batches, or `None`
    /// when the ranks wait on each other forever.
    fn simulate(p: usize, v: usize, m: usize, tf: u64, tb: u64) -> Option<(u64, Vec<usize>)> {
        let scheds: Vec<Vec<ChunkAction>> = (0..p).map(|s| rank_schedule(s, p, v, m)).collect();
        let chunks = p * v;
        // Finish times of (global chunk, micro-batch) forwards and backwards.
        let mut fwd = vec![vec![None::<u64>; m]; chunks];
        let mut bwd = vec![vec![None::<u64>; m]; chunks];
        let (mut pos, mut clock) = (vec![0usize; p], vec![0u64; p]);
        loop {
            let mut progressed = false;
            for s in 0..p {
                let Some(&ChunkAction { chunk, action }) = scheds[s].get(pos[s]) else {
                    continue;
                };
                let g = chunk * p + s;
                let (dep, cost) = match action {
                    Forward(_) if g == 0 => (Some(0), tf),
                    Forward(i) => (fwd[g - 1][i], tf),
                    Backward(i) if g + 1 == chunks => (fwd[g][i], tb),
                    Backward(i) => (bwd[g + 1][i], tb),
                };
                let Some(ready) = dep else { continue };
                clock[s] = clock[s].max(ready) + cost;
                match action {
                    Forward(i) => fwd[g][i] = Some(clock[s]),
                    Backward(i) => bwd[g][i] = Some(clock[s]),
                }
                pos[s] += 1;
                progressed = true;
            }
            if !progressed {
                break;
            }
        }
        let done = (0..p).all(|s| pos[s] == scheds[s].len());
        let peaks = scheds
            .iter()
            .map(|sch| peak_in_flight(sch.iter().map(|a| &a.action)))
            .collect();
        done.then(|| (clock.into_iter().max().unwrap_or(0), peaks))
    }

    #[test]
    fn interleaved_runs_every_chunk_micro_batch_once_backward_after_forward() {
        for (p, v, m) in interleaved_cases() {
            for s in 0..p {
                let sch = interleaved(s, p, v, m);
                assert_eq!(sch.len(), 2 * m * v, "p={p} v={v} m={m} s={s}");
                for c in 0..v {
                    let at = |a: Action| {
                        let hits: Vec<usize> = sch
                            .iter()
                            .enumerate()
                            .filter(|(_, x)| {
                                **x == ChunkAction {
                                    chunk: c,
                                    action: a,
                                }
                            })
                            .map(|(k, _)| k)
                            .collect();
                        assert_eq!(hits.len(), 1, "p={p} v={v} m={m} s={s} {c} {a:?}");
                        hits[0]
                    };
                    for i in 0..m {
                        assert!(at(Forward(i)) < at(Backward(i)));
                    }
                    // Each chunk's forwards and backwards in micro-batch order (the runner
                    // keeps each chunk's activations in a FIFO).
                    let order = |fwd: bool| -> Vec<usize> {
                        sch.iter()
                            .filter(|x| x.chunk == c)
                            .filter_map(|x| match x.action {
                                Forward(i) if fwd => Some(i),
                                Backward(i) if !fwd => Some(i),
                                _ => None,
                            })
                            .collect()
                    };
                    assert_eq!(order(true), (0..m).collect::<Vec<_>>());
                    assert_eq!(order(false), (0..m).collect::<Vec<_>>());
                }
            }
        }
    }

    #[test]
    fn interleaved_starts_as_megatron_and_one_chunk_is_one_f_one_b() {
        // p = 2, v = 2, m = 4 on rank 0: warm-up 2 + 2 forwards, chunks 0 0 1 1 on
        // micro-batches 0 1 0 1; the first backward is chunk 1's micro-batch 0.
        let s0 = interleaved(0, 2, 2, 4);
        let f = |chunk, i| ChunkAction {
            chunk,
            action: Forward(i),
        };
        let b = |chunk, i| ChunkAction {
            chunk,
            action: Backward(i),
        };
        assert_eq!(
            &s0[..6],
            &[f(0, 0), f(0, 1), f(1, 0), f(1, 1), f(0, 2), b(1, 0)]
        );
        assert_eq!(&s0[s0.len() - 2..], &[b(0, 2), b(0, 3)]);
        for (p, m) in [(1, 3), (3, 5), (4, 8)] {
            for s in 0..p {
                let one: Vec<ChunkAction> = one_f_one_b(s, p, m)
                    .into_iter()
                    .map(|action| ChunkAction { chunk: 0, action })
                    .collect();
                assert_eq!(rank_schedule(s, p, 1, m), one);
            }
        }
    }

    #[test]
    fn interleaved_ranks_never_wait_on_each_other_forever() {
        for (p, v, m) in interleaved_cases() {
            assert!(
                simulate(p, v, m, 1, 1).is_some(),
                "deadlock at P={p} V={v} M={m}"
            );
        }
    }

    /// The planner's held activations (docs/planner.md, "Interleaved 1F1B"): Megatron's
    /// warm-up forwards plus the one of the first steady step, at most every chunk of every
    /// micro-batch.
    #[test]
    fn interleaved_peak_in_flight_is_megatrons_warm_up_plus_one() {
        for (p, v, m) in interleaved_cases() {
            let (_, peaks) = simulate(p, v, m, 1, 1).unwrap();
            for (s, peak) in peaks.into_iter().enumerate() {
                let want = (2 * (p - s - 1) + (v - 1) * p + 1).min(m * v);
                assert_eq!(peak, want, "P={p} V={v} M={m} rank {s}");
            }
        }
    }

    /// With unit-time chunk forwards (and backwards of 1 or 2 units), the step takes the
    /// ideal `M V (tf + tb)` plus a bubble of `(P - 1) / (V M)` of it; one chunk gives 1F1B's
    /// `(P - 1) / M`.
    #[test]
    fn interleaving_shrinks_the_bubble_to_p_minus_1_over_v_m() {
        for (tf, tb) in [(1u64, 1u64), (1, 2)] {
            let cases =
                interleaved_cases().chain((1..=4).flat_map(|p| (1..=8).map(move |m| (p, 1, m))));
            for (p, v, m) in cases {
                let (time, _) = simulate(p, v, m, tf, tb).unwrap();
                let ideal = (m * v) as u64 * (tf + tb);
                let bubble = time - ideal;
                // bubble / ideal == (p - 1) / (v m), in integers.
                assert_eq!(
                    bubble * (v * m) as u64,
                    (p as u64 - 1) * ideal,
                    "P={p} V={v} M={m} tf={tf} tb={tb}: step {time}, ideal {ideal}"
                );
            }
        }
    }
}
