//! R1-R3 on the local backend: a lost rank, a desync and a straggler each end every rank's
//! wait with an error naming the cause, well within the deadline; nothing hangs. The same
//! for all_to_all, plus disagreeing all_to_all counts (every rank names the pair).

use std::time::{Duration, Instant};
use tp_comm::fault::{FaultPlan, Faulty};
use tp_comm::local::{self, LocalOptions};
use tp_comm::{CommError, CommExt, Group, ReduceOp};

/// Runs `n` ranks that all-reduce 10 times through a fault plan; returns each rank's error
/// text (or panic text) and the wall time.
fn drill(n: usize, plan: &str, timeout: Duration) -> (Vec<String>, Duration) {
    drill_op(n, plan, timeout, |g| {
        let mut buf = vec![1.0f32; 4096];
        g.all_reduce(&mut buf, ReduceOp::Sum)
    })
}

/// An uneven all_to_all_v (rank i sends i + j + 1 f32 to rank j, 4 KiB-ish in all).
fn uneven_all_to_all(g: &Group) -> Result<(), CommError> {
    let (r, n) = (g.rank(), g.size());
    let send_counts: Vec<usize> = (0..n).map(|j| 300 * (r + j + 1)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|i| 300 * (i + r + 1)).collect();
    let send = vec![r as f32; send_counts.iter().sum()];
    let mut recv = vec![0f32; recv_counts.iter().sum()];
    g.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)
}

/// [`drill`] with `op` as the call each rank makes 10 times.
fn drill_op(
    n: usize,
    plan: &str,
    timeout: Duration,
    op: impl Fn(&Group) -> Result<(), CommError> + Sync,
) -> (Vec<String>, Duration) {
    let plan: FaultPlan = plan.parse().expect("valid plan");
    let t0 = Instant::now();
    let outcomes = local::run(n, LocalOptions { timeout }, |world| {
        let g = Faulty::wrap(world, plan.clone());
        for _ in 0..10 {
            op(&g)?;
        }
        Ok::<_, CommError>(())
    })
    .expect("world starts");
    let texts = outcomes
        .into_iter()
        .map(|o| match o {
            Ok(Ok(())) => "ok".to_string(),
            Ok(Err(e)) => format!("{e}\n{}", e.flight_record().unwrap_or("")),
            Err(panic) => format!("panic: {panic}"),
        })
        .collect();
    (texts, t0.elapsed())
}

#[test]
fn a_panicking_rank_is_named_by_every_survivor_at_2_3_and_4_ranks() {
    for n in [2, 3, 4] {
        let (texts, took) = drill(n, "panic:1@4", Duration::from_secs(30));
        assert!(took < Duration::from_secs(5), "took {took:?}");
        assert!(
            texts[1].starts_with("panic: panicked: injected fault"),
            "{}",
            texts[1]
        );
        for (r, t) in texts.iter().enumerate().filter(|(r, _)| *r != 1) {
            assert!(
                t.contains("rank 1 is gone (panicked: injected fault")
                    && t.contains("all_reduce #4"),
                "rank {r} of {n}: {t}"
            );
            assert!(t.contains("flight record"), "rank {r}: {t}");
        }
    }
}

#[test]
fn an_exiting_rank_is_named_by_every_survivor() {
    let (texts, took) = drill(3, "exit:2@2", Duration::from_secs(30));
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(
        texts[2].contains("fault injected on rank 2"),
        "{}",
        texts[2]
    );
    for t in &texts[..2] {
        assert!(t.contains("rank 2 is gone (exited"), "{t}");
    }
}

#[test]
fn a_desync_shows_both_fingerprints_on_every_rank() {
    let (texts, _) = drill(3, "mismatch:1@3", Duration::from_secs(30));
    for (r, t) in texts.iter().enumerate() {
        assert!(t.contains("collective mismatch"), "rank {r}: {t}");
        assert!(
            t.contains("all_reduce #3") && t.contains("barrier #3"),
            "rank {r}: {t}"
        );
    }
}

#[test]
fn a_straggler_past_the_deadline_is_a_timeout_naming_it() {
    let (texts, took) = drill(3, "slow:2@1:3", Duration::from_millis(500));
    assert!(took < Duration::from_secs(5), "took {took:?}");
    for t in &texts[..2] {
        assert!(
            t.contains("timed out") && t.contains("still waiting for ranks [2]")
                || t.contains("unusable after an earlier failure"),
            "{t}"
        );
    }
    assert!(texts
        .iter()
        .take(2)
        .any(|t| t.contains("still waiting for ranks [2]")));
    // The straggler wakes into a poisoned group and is told why.
    assert!(
        texts[2].contains("unusable after an earlier failure"),
        "{}",
        texts[2]
    );
}

#[test]
fn a_mismatched_point_to_point_message_is_an_error_not_garbage() {
    let outcomes = local::run(2, LocalOptions::default(), |g| {
        if g.rank() == 0 {
            g.send(&[1.0f32, 2.0], 1, 9).map(|_| String::new())
        } else {
            let mut wrong = [0i32; 3];
            g.recv(&mut wrong, 0, 9).map(|_| String::new())
        }
    })
    .unwrap();
    let err = outcomes[1]
        .as_ref()
        .unwrap()
        .as_ref()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("recv #0 dtype=i32 count=3") && err.contains("send #0 dtype=f32 count=2"),
        "{err}"
    );
}

#[test]
fn invalid_arguments_are_errors_not_panics() {
    let outcomes = local::run(2, LocalOptions::default(), |g| {
        let mut odd = vec![0u8; 5];
        let a = g.all_reduce_bytes(&mut odd, tp_comm::DType::F32, ReduceOp::Sum);
        let b = g.send(&[1u8], 7, 0);
        let c = g.all_gather_v(&[1u8], &mut [0u8; 2], &[1]);
        (a.is_err(), b.is_err(), c.is_err())
    })
    .unwrap();
    for o in outcomes {
        assert_eq!(o.unwrap(), (true, true, true));
    }
    assert!(local::run(0, LocalOptions::default(), |_| ()).is_err());
}

#[test]
fn all_to_all_lost_rank_desync_and_straggler_are_named() {
    let (texts, took) = drill_op(3, "panic:1@4", Duration::from_secs(30), uneven_all_to_all);
    assert!(took < Duration::from_secs(5), "took {took:?}");
    for t in [&texts[0], &texts[2]] {
        assert!(
            t.contains("rank 1 is gone (panicked: injected fault") && t.contains("all_to_all #4"),
            "{t}"
        );
    }
    // Rank 1 calls a barrier where the others call all_to_all.
    let (texts, _) = drill_op(
        3,
        "mismatch:1@3",
        Duration::from_secs(30),
        uneven_all_to_all,
    );
    for (r, t) in texts.iter().enumerate() {
        assert!(
            t.contains("collective mismatch")
                && t.contains("all_to_all #3 dtype=f32")
                && t.contains("barrier #3"),
            "rank {r}: {t}"
        );
    }
    let (texts, took) = drill_op(
        3,
        "slow:2@1:3",
        Duration::from_millis(500),
        uneven_all_to_all,
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(
        texts[..2].iter().any(|t| t.contains("timed out")
            && t.contains("in all_to_all #1")
            && t.contains("still waiting for ranks [2]")),
        "{texts:?}"
    );
    assert!(
        texts[2].contains("unusable after an earlier failure"),
        "{}",
        texts[2]
    );
}

#[test]
fn disagreeing_all_to_all_counts_are_an_error_on_every_rank() {
    // Rank 1 expects 5 elements from rank 2, which sends it 4: every rank names that pair,
    // and the group refuses the next call.
    let t0 = Instant::now();
    let outcomes = local::run(3, LocalOptions::default(), |g| {
        let r = g.rank();
        let send_counts = vec![4usize; 3];
        let mut recv_counts = vec![4usize; 3];
        if r == 1 {
            recv_counts[2] = 5;
        }
        let send = vec![r as u32; 12];
        let mut recv = vec![0u32; recv_counts.iter().sum()];
        let first = g.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts);
        let next = g.barrier();
        (
            first.map_err(|e| e.to_string()),
            next.map_err(|e| e.to_string()),
            recv,
        )
    })
    .expect("world starts");
    assert!(t0.elapsed() < Duration::from_secs(5));
    for (r, o) in outcomes.into_iter().enumerate() {
        let (first, next, recv) = o.expect("no panic");
        let e = first.expect_err("counts disagree");
        assert!(
            e.contains("counts disagree (desync) in all_to_all #0 of a 3-rank group")
                && e.contains("rank 2 sends 4 elements to rank 1, which expects 5"),
            "rank {r}: {e}"
        );
        assert!(
            next.expect_err("poisoned")
                .contains("unusable after an earlier failure"),
            "rank {r}"
        );
        // Nothing was delivered on a failed call.
        assert!(recv.iter().all(|&x| x == 0), "rank {r}: {recv:?}");
    }
    // One rank: sending 3 elements to itself while expecting 2 is the same error.
    let out = local::run(1, LocalOptions::default(), |g| {
        g.all_to_all_v(&[1u8, 2, 3], &[3], &mut [0u8; 2], &[2])
            .map_err(|e| e.to_string())
    })
    .expect("world starts");
    let e = out[0].as_ref().expect("no panic").as_ref().unwrap_err();
    assert!(
        e.contains("rank 0 sends 3 elements to rank 0, which expects 2"),
        "{e}"
    );
}

#[test]
fn bad_all_to_all_arguments_are_invalid_argument_errors() {
    let outcomes = local::run(2, LocalOptions::default(), |g| {
        let texts: Vec<String> = [
            // One count per rank is required.
            g.all_to_all_v(&[1u8, 2], &[2], &mut [0u8; 2], &[1, 1]),
            // The counts must add up to the buffers.
            g.all_to_all_v(&[1u8, 2], &[1, 2], &mut [0u8; 2], &[1, 1]),
            g.all_to_all_v(&[1u8, 2], &[1, 1], &mut [0u8; 3], &[1, 1]),
            // The even form needs a whole block per rank.
            g.all_to_all(&[1u8, 2, 3], &mut [0u8; 3]),
            // Bytes that are not whole elements.
            g.all_to_all_bytes(&[0u8; 3], &[0, 0], &mut [], &[0, 0], tp_comm::DType::F32),
        ]
        .into_iter()
        .map(|r| match r {
            Err(e @ CommError::InvalidArgument { .. }) => e.to_string(),
            other => format!("not an invalid argument: {other:?}"),
        })
        .collect();
        // The group is still usable: argument errors are refused before the call starts.
        let mut recv = [0u8; 2];
        g.all_to_all(&[g.rank() as u8; 2], &mut recv)
            .map(|()| (texts, recv))
    })
    .expect("world starts");
    for o in outcomes {
        let (texts, recv) = o.expect("no panic").expect("the valid call works");
        assert_eq!(recv, [0, 1]);
        for (t, want) in texts.iter().zip([
            "the send counts have 1 entries but the group has 2 ranks",
            "the send buffer holds 2 elements but the send counts add up to 3",
            "the receive buffer holds 3 elements but the receive counts add up to 2",
            "all_to_all: the send buffer holds 3 elements, not a whole block",
            "the send buffer has 3 bytes, not a multiple of 4",
        ]) {
            assert!(t.contains(want), "{t:?} lacks {want:?}");
        }
    }
}
