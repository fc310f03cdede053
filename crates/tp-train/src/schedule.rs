//! The 1F1B pipeline schedule (PipeDream-Flush; Narayanan et al. 2021, §2.2.1, Fig. 4 top):
//! stage p runs `min(P - 1 - p, M)` warm-up forwards, then alternates one forward and one
//! backward, then drains the remaining backwards. At most `P - p` micro-batches are in
//! flight on stage p, instead of all M under GPipe.

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

/// The most micro-batches whose activations a stage holds at once under `actions`.
pub fn peak_in_flight(actions: &[Action]) -> usize {
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
}
