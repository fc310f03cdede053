//! R1-R3 on the local backend: a lost rank, a desync and a straggler each end every rank's
//! wait with an error naming the cause, well within the deadline; nothing hangs.

use std::time::{Duration, Instant};
use tp_comm::fault::{FaultPlan, Faulty};
use tp_comm::local::{self, LocalOptions};
use tp_comm::{CommError, CommExt, ReduceOp};

/// Runs `n` ranks that all-reduce 10 times through a fault plan; returns each rank's error
/// text (or panic text) and the wall time.
fn drill(n: usize, plan: &str, timeout: Duration) -> (Vec<String>, Duration) {
    let plan: FaultPlan = plan.parse().expect("valid plan");
    let t0 = Instant::now();
    let outcomes = local::run(n, LocalOptions { timeout }, |world| {
        let g = Faulty::wrap(world, plan.clone());
        let mut buf = vec![1.0f32; 4096];
        for _ in 0..10 {
            g.all_reduce(&mut buf, ReduceOp::Sum)?;
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
