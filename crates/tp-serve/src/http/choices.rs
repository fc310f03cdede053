//! The scheduler's side of a request, seen from HTTP: a request for `n` choices becomes `n`
//! scheduler [`Job`]s (the same prompt, so the scheduler computes it once and forks it),
//! queued all or none; their [`Event`]s are read as they arrive, each wait bounded by the
//! event deadline, and a failed job becomes the [`ApiError`] the client sees.

use super::server::AppState;
use crate::error::ApiError;
use crate::scheduler::{Control, Event, Job};
use std::future::poll_fn;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;
use tp_engine::DecodeParams;

/// Queues one scheduler job per choice, all with the prompt `ids` and `params` except the
/// seed: choice `i` samples with `seed + i`, so choices differ and a seeded request is
/// reproducible. The jobs take `n` places in the admission queue: all of them are queued, or
/// none (429 when the queue has no room for all, 503 once the scheduler has stopped).
pub(crate) fn submit(
    st: &AppState,
    ids: Vec<u32>,
    params: &DecodeParams,
    n: usize,
    arrived: Instant,
    model: Option<u32>,
) -> std::result::Result<Choices, ApiError> {
    let max_queue = st.cfg.max_queue;
    if n > max_queue.max(1) {
        return Err(ApiError::invalid(
            "n",
            "invalid_value",
            format!(
                "n is {n} but this server queues at most {max_queue} requests (each choice is one); ask for at most {max_queue} choices"
            ),
        ));
    }
    let pending = &st.sched.load.pending;
    let reserved = pending.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |p| {
        p.checked_add(n).filter(|&q| q <= max_queue)
    });
    if let Err(waiting) = reserved {
        let message = if n == 1 {
            format!("{waiting} requests are already waiting; retry later")
        } else {
            format!(
                "{waiting} requests are already waiting and this one's {n} choices would pass the queue's limit of {max_queue}; retry later"
            )
        };
        return Err(ApiError::unavailable(429, "queue_full", message));
    }
    let mut rxs = Vec::with_capacity(n);
    for i in 0..n {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut params = params.clone();
        params.sampling.seed = params.sampling.seed.wrapping_add(i as u64);
        let job = Job {
            prompt: ids.clone(),
            params,
            events: tx,
            arrived,
            model,
        };
        if st.sched.control.send(Control::Submit(job)).is_err() {
            // Choices i.. never reached the scheduler; the ones before went down with it.
            pending.fetch_sub(n - i, Ordering::Relaxed);
            if let Some(why) = st.metrics.engine_failure() {
                return Err(ApiError::unavailable(
                    503,
                    "engine_failed",
                    format!("the inference engine failed: {why}"),
                ));
            }
            return Err(ApiError::unavailable(
                503,
                "shutting_down",
                "the server is shutting down",
            ));
        }
        rxs.push(Some(rx));
    }
    Ok(Choices { rxs, next: 0 })
}

/// The event receivers of one request's choices, read in the order their events arrive. A
/// choice's receiver is dropped once it has finished (or failed); dropping [`Choices`], or
/// [`Choices::close`], drops the others, and the scheduler cancels those jobs (freeing their
/// KV blocks) at its next step.
pub(crate) struct Choices {
    rxs: Vec<Option<UnboundedReceiver<Event>>>,
    /// The choice polled first next time, so that a busy choice cannot starve the others.
    next: usize,
}

impl Choices {
    pub(crate) fn len(&self) -> usize {
        self.rxs.len()
    }

    /// Every choice has ended (or [`Choices::close`] gave them up).
    pub(crate) fn all_finished(&self) -> bool {
        self.rxs.iter().all(Option::is_none)
    }

    /// Gives up every choice still running.
    pub(crate) fn close(&mut self) {
        self.rxs.iter_mut().for_each(|rx| *rx = None);
    }

    /// The next event of a running choice, with the choice's index; `Some((i, None))` when
    /// choice `i`'s sender went away before it ended; `None` when no choice is left.
    pub(crate) async fn recv(&mut self) -> Option<(usize, Option<Event>)> {
        poll_fn(|cx| {
            let n = self.rxs.len();
            let mut running = false;
            for k in 0..n {
                let i = (self.next + k) % n;
                let Some(rx) = self.rxs[i].as_mut() else {
                    continue;
                };
                running = true;
                if let Poll::Ready(event) = rx.poll_recv(cx) {
                    if !matches!(event, Some(Event::Text { .. })) {
                        self.rxs[i] = None;
                    }
                    self.next = (i + 1) % n;
                    return Poll::Ready(Some((i, event)));
                }
            }
            if running {
                Poll::Pending
            } else {
                Poll::Ready(None)
            }
        })
        .await
    }
}

/// A failed job as the client sees it: 503 when the scheduler was shutting down, else 500.
pub(crate) fn failure(msg: String, shutting_down: bool) -> ApiError {
    if shutting_down {
        ApiError::unavailable(503, "shutting_down", msg)
    } else {
        ApiError::internal(msg)
    }
}

/// The next event of any running choice, bounded by the event deadline.
pub(crate) async fn next_event(
    st: &AppState,
    choices: &mut Choices,
) -> std::result::Result<(usize, Event), ApiError> {
    match tokio::time::timeout(st.cfg.event_timeout, choices.recv()).await {
        Ok(Some((i, Some(e)))) => Ok((i, e)),
        Ok(Some((_, None))) => Err(ApiError::internal(
            "the scheduler stopped before the request finished",
        )),
        Ok(None) => Err(ApiError::internal(
            "no choice of this request is left to wait for",
        )),
        Err(_) => Err(ApiError::internal(format!(
            "no progress on this request for {:.0} s; the server is overloaded or stuck",
            st.cfg.event_timeout.as_secs_f64()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::server::tests::state;
    use crate::scheduler::Usage;
    use std::time::Duration;
    use tp_engine::FinishReason;

    fn submitted(rx: &std::sync::mpsc::Receiver<Control>) -> Vec<Job> {
        rx.try_iter()
            .map(|c| match c {
                Control::Submit(job) => job,
                _ => panic!("not a job"),
            })
            .collect()
    }

    #[test]
    fn choices_are_jobs_with_consecutive_seeds_queued_all_or_none() {
        let (st, rx) = state(8);
        let mut params = DecodeParams::greedy(4);
        params.sampling.temperature = 1.0;
        params.sampling.seed = u64::MAX - 1;
        let now = Instant::now();
        let choices = submit(&st, vec![5, 6, 7], &params, 3, now, None).unwrap();
        assert_eq!(choices.len(), 3);
        let jobs = submitted(&rx);
        let seeds: Vec<u64> = jobs.iter().map(|j| j.params.sampling.seed).collect();
        assert_eq!(seeds, [u64::MAX - 1, u64::MAX, 0]);
        for j in &jobs {
            assert_eq!(j.prompt, [5, 6, 7]);
            assert_eq!(
                DecodeParams {
                    sampling: params.sampling.clone(),
                    ..j.params.clone()
                },
                params
            );
        }
        assert_eq!(st.sched.load.pending.load(Ordering::Relaxed), 3);
        // 3 of 8 places taken: 6 more choices do not fit, and none is queued.
        let e = submit(&st, vec![1], &params, 6, now, None).err().unwrap();
        assert_eq!((e.status, e.code), (429, Some("queue_full")));
        assert!(e.message.contains("6 choices"), "{}", e.message);
        assert!(submitted(&rx).is_empty());
        assert_eq!(st.sched.load.pending.load(Ordering::Relaxed), 3);
        // 5 do.
        let _more = submit(&st, vec![1], &params, 5, now, None).unwrap();
        assert_eq!(submitted(&rx).len(), 5);
        assert_eq!(st.sched.load.pending.load(Ordering::Relaxed), 8);
        let e = submit(&st, vec![1], &params, 1, now, None).err().unwrap();
        assert_eq!(e.status, 429);
        // More choices than the queue ever holds: a request to change, not to retry.
        let (small, _rx) = state(2);
        let e = submit(&small, vec![1], &params, 3, now, None)
            .err()
            .unwrap();
        assert_eq!((e.status, e.param.as_deref()), (400, Some("n")));
        // A stopped scheduler: 503, and the places are given back.
        let (gone, rx) = state(8);
        drop(rx);
        let e = submit(&gone, vec![1], &params, 4, now, None).err().unwrap();
        assert_eq!(e.status, 503);
        assert_eq!(gone.sched.load.pending.load(Ordering::Relaxed), 0);
        drop(choices);
    }

    #[tokio::test]
    async fn choices_are_read_as_their_events_arrive_and_dropped_together() {
        let (st, rx) = state(8);
        let params = DecodeParams::greedy(4);
        let mut choices = submit(&st, vec![1, 2], &params, 3, Instant::now(), None).unwrap();
        let jobs = submitted(&rx);
        let text = |t: &str| Event::Text {
            text: t.into(),
            logprobs: Vec::new(),
        };
        let done = Event::Done {
            finish: FinishReason::Length,
            usage: Usage {
                prompt_tokens: 2,
                completion_tokens: 1,
            },
            time_to_first_token: Duration::ZERO,
        };
        jobs[2].events.send(text("c")).unwrap();
        assert_eq!(choices.recv().await, Some((2, Some(text("c")))));
        jobs[0].events.send(done.clone()).unwrap();
        assert_eq!(choices.recv().await, Some((0, Some(done.clone()))));
        // A finished choice's receiver is dropped at once; the others stay open.
        assert!(jobs[0].events.is_closed());
        assert!(!jobs[1].events.is_closed() && !jobs[2].events.is_closed());
        assert!(!choices.all_finished());
        // A sender gone without an ending is reported as such.
        let (tx1, tx2) = (jobs[1].events.clone(), jobs[2].events.clone());
        drop(jobs);
        drop(tx1);
        assert_eq!(choices.recv().await, Some((1, None)));
        // Dropping the rest (a client that went away) closes every remaining channel.
        drop(choices);
        assert!(tx2.is_closed());
    }
}
