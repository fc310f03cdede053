//! The live figures behind `/dashboard` and its JSON (`/dashboard.json`): per rank (host,
//! compute, collective and waiting milliseconds per step, bytes sent, KV blocks, load time and
//! memory, the slowest rank marked) and for the server (queue, running sequences, tokens/s,
//! TTFT and TPOT percentiles, prefix-cache hits, preemptions), with a history of the last
//! minutes for the charts.
//!
//! The scheduler gathers every rank's cumulative time split and bytes sent about once a second
//! ([`POLL_INTERVAL`], one small all-gather) and hands it to [`Board::ranks_polled`]; figures
//! per step are the differences between two polls over the steps run between them. Without
//! barrier profiling the time a rank spends in a collective includes waiting for the others:
//! the waiting of rank r is estimated as its collective time less the smallest collective time
//! of any rank in the same interval (the last to arrive barely waits), and the collective time
//! proper as that smallest one. What the polls cost is measured and set against the step time
//! of the same intervals ([`Snapshot`]'s `collection`).

use serde::Serialize;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tp_engine::RankProfile;

/// How often the scheduler gathers the ranks' figures.
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// How far back the charts and percentiles reach.
pub const HISTORY: Duration = Duration::from_secs(300);

/// Most latency samples kept for the percentiles.
const MAX_SAMPLES: usize = 8192;

/// What does not change while the server runs: where each rank is and what it loaded.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RankSetup {
    pub host: String,
    /// Seconds the rank took to load its shard (0 where not measured).
    pub load_seconds: f64,
    /// File bytes the rank read at load.
    pub load_bytes: u64,
    /// Memory the rank holds: weights and its KV cache at the context length.
    pub memory_bytes: u64,
}

/// One rank's figures in the dashboard.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RankFigures {
    pub rank: usize,
    #[serde(flatten)]
    pub setup: RankSetup,
    /// Per forward step, over the last interval with steps.
    pub compute_ms_per_step: f64,
    pub collective_ms_per_step: f64,
    pub wait_ms_per_step: f64,
    pub bytes_sent_per_step: f64,
    pub bytes_sent_total: u64,
    /// Seconds computing (inside forward passes, less collectives and waiting for the stage
    /// before) since the start: summed over the ranks of different stages and set against
    /// the wall time, what pipelining overlapped.
    pub compute_seconds_total: f64,
    /// Mixture of experts: (token, expert) rows this rank's experts computed (its share of
    /// the expert work: unequal under `--ep` when routing is unbalanced).
    pub expert_rows_total: u64,
    pub kv_blocks_used: usize,
    pub kv_blocks_free: usize,
    /// The rank the others wait for (most compute per step).
    pub slowest: bool,
}

/// The server's figures.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct ServerFigures {
    pub queue: usize,
    pub running: usize,
    /// Generated tokens per second over the last interval.
    pub tokens_per_second: f64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub tpot_p50_ms: Option<f64>,
    pub tpot_p99_ms: Option<f64>,
    pub prefix_cache_hits: u64,
    pub preemptions: u64,
    pub generated_tokens: u64,
    pub steps: u64,
    pub kv_blocks_total: usize,
    /// Mixture of experts: the tokens each expert took since the start, summed over layers
    /// (empty for a dense model).
    pub expert_tokens: Vec<u64>,
    /// Mixture of experts: the (token, expert) pairs routed to each expert that the capacity
    /// factor dropped since the start, summed over layers (empty without a capacity).
    pub expert_dropped: Vec<u64>,
}

/// One point of the charts.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Sample {
    /// Seconds since the server started.
    pub t: f64,
    pub tokens_per_second: f64,
    pub queue: usize,
    pub running: usize,
    /// Per rank: compute, collective and waiting ms per step (`None` in an interval without
    /// steps).
    pub compute_ms: Vec<Option<f64>>,
    pub collective_ms: Vec<Option<f64>>,
    pub wait_ms: Vec<Option<f64>>,
}

/// What gathering the figures cost, against the step time of the same intervals.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Collection {
    pub polls: u64,
    /// Polls made while requests ran, and their time.
    pub busy_polls: u64,
    pub busy_poll_seconds: f64,
    /// Forward step time over the intervals those polls closed.
    pub step_seconds: f64,
    /// `busy_poll_seconds / step_seconds` (0 before any step).
    pub share_of_step_time: f64,
    pub mean_poll_ms: f64,
}

/// Everything the dashboard shows, as `/dashboard.json` serves it.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Snapshot {
    pub model: String,
    pub tp: usize,
    pub uptime_seconds: f64,
    pub poll_interval_seconds: f64,
    pub ranks: Vec<RankFigures>,
    pub server: ServerFigures,
    pub collection: Collection,
    /// The canary's last run (`None` without a canary).
    pub canary: Option<CanaryStatus>,
    /// The models held, which one is live, switches and rollbacks.
    pub rollout: RolloutStatus,
    pub history: Vec<Sample>,
}

/// One held model.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct ModelEntry {
    /// The id reloads and rollbacks name it by (0: the model the server started with).
    pub id: u32,
    /// Its path (or the server's model name for the first).
    pub name: String,
    /// live, previous (ready for a rollback), candidate (loaded, not live) or retiring.
    pub role: String,
    /// Seconds since the server started, when it was loaded.
    pub loaded_t: f64,
    /// Sequences running on it.
    pub running: usize,
    /// The path it was loaded from (`None`: unknown, for a first model served without one).
    pub path: Option<String>,
}

/// Models in rollout (see [`crate::rollout`]).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RolloutStatus {
    pub live: ModelEntry,
    pub models: Vec<ModelEntry>,
    pub switches: u64,
    pub rollbacks: u64,
    pub reload_failures: u64,
    /// The path loading now, if any.
    pub loading: Option<String>,
    /// The last switch or rollback, in words.
    pub last_event: String,
    /// A drain swap in progress, in words.
    pub draining: Option<String>,
    /// The path a rollback loads back, when the previous model is not held (a drain swap
    /// dropped it).
    pub unheld_previous: Option<String>,
}

/// The canary's last run and the drift alarm.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct CanaryStatus {
    pub runs: u64,
    pub failures: u64,
    /// Seconds since the server started, at the last run.
    pub last_run_t: f64,
    /// The drift alarm: the last run failed.
    pub drift: bool,
    pub cases: usize,
    pub mismatches: usize,
    pub max_logprob_shift: f64,
    pub detail: String,
}

/// A poll's view of the scheduler.
#[derive(Clone, Copy, Debug, Default)]
pub struct SchedulerView {
    pub queue: usize,
    pub running: usize,
    pub steps: u64,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    /// Forward step time so far.
    pub step_time: Duration,
}

#[derive(Debug)]
struct State {
    started: Instant,
    last_poll: Option<(Instant, Vec<RankProfile>, SchedulerView, u64)>,
    snapshot: Snapshot,
    ttft: VecDeque<(Instant, f64)>,
    tpot: VecDeque<(Instant, f64)>,
    generated: u64,
}

/// The dashboard's figures, shared by the scheduler (which writes them) and the HTTP side.
#[derive(Debug)]
pub struct Board(Mutex<State>);

impl Default for Board {
    fn default() -> Self {
        Board(Mutex::new(State {
            started: Instant::now(),
            last_poll: None,
            snapshot: Snapshot {
                poll_interval_seconds: POLL_INTERVAL.as_secs_f64(),
                ..Snapshot::default()
            },
            ttft: VecDeque::new(),
            tpot: VecDeque::new(),
            generated: 0,
        }))
    }
}

/// The `q` quantile (0..=1) of `v` (sorted here), nearest rank.
pub fn quantile(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    Some(v[i])
}

fn push_sample(q: &mut VecDeque<(Instant, f64)>, v: f64) {
    let now = Instant::now();
    q.push_back((now, v));
    while q.len() > MAX_SAMPLES || q.front().is_some_and(|(t, _)| now - *t > HISTORY) {
        q.pop_front();
    }
}

/// A count per expert over every layer (`counts`: the tokens taken or the pairs dropped): the
/// sum of the ranks' reports (each stage's tp rank 0 reports its layers, the others nothing).
fn per_expert(profiles: &[RankProfile], counts: fn(&RankProfile) -> &[u64]) -> Vec<u64> {
    let mut sum: Vec<u64> = Vec::new();
    for p in profiles {
        let c = counts(p);
        if sum.len() < c.len() {
            sum.resize(c.len(), 0);
        }
        for (s, n) in sum.iter_mut().zip(c) {
            *s += n;
        }
    }
    sum
}

fn percentiles_ms(q: &VecDeque<(Instant, f64)>) -> (Option<f64>, Option<f64>) {
    let mut v: Vec<f64> = q.iter().map(|(_, s)| s * 1e3).collect();
    (quantile(&mut v, 0.5), quantile(&mut v, 0.99))
}

impl Board {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets what each rank is (at start).
    pub fn set_ranks(&self, model: &str, setup: Vec<RankSetup>) {
        let mut s = self.lock();
        s.snapshot.model = model.to_string();
        s.snapshot.tp = setup.len();
        s.snapshot.ranks = setup
            .into_iter()
            .enumerate()
            .map(|(rank, setup)| RankFigures {
                rank,
                setup,
                ..RankFigures::default()
            })
            .collect();
    }

    /// A finished request's time to first token and mean time per output token (seconds).
    pub fn request_done(&self, ttft: f64, tpot: Option<f64>) {
        let mut s = self.lock();
        push_sample(&mut s.ttft, ttft);
        if let Some(t) = tpot {
            push_sample(&mut s.tpot, t);
        }
    }

    /// Tokens sampled in a step.
    pub fn generated(&self, tokens: u64) {
        self.lock().generated += tokens;
    }

    pub fn prefix_hit(&self) {
        self.lock().snapshot.server.prefix_cache_hits += 1;
    }

    pub fn preempted(&self) {
        self.lock().snapshot.server.preemptions += 1;
    }

    /// The live model's id.
    pub fn live_model(&self) -> u32 {
        self.lock().snapshot.rollout.live.id
    }

    /// Takes the models' new state.
    pub fn rollout_changed(&self, r: &RolloutStatus) {
        self.lock().snapshot.rollout = r.clone();
    }

    /// Takes a canary run's verdict.
    pub fn canary_ran(&self, v: &crate::canary::Verdict) {
        let mut s = self.lock();
        let t = s.started.elapsed().as_secs_f64();
        let c = s.snapshot.canary.get_or_insert_with(CanaryStatus::default);
        c.runs += 1;
        c.failures += u64::from(!v.passed);
        c.last_run_t = t;
        c.drift = !v.passed;
        c.cases = v.cases;
        c.mismatches = v.mismatches;
        c.max_logprob_shift = v.max_shift;
        c.detail = v.detail.clone();
    }

    /// Whether a poll is due.
    pub fn poll_due(&self) -> bool {
        self.lock()
            .last_poll
            .as_ref()
            .is_none_or(|(t, ..)| t.elapsed() >= POLL_INTERVAL)
    }

    /// Time until the next poll is due.
    pub fn until_poll(&self) -> Duration {
        self.lock()
            .last_poll
            .as_ref()
            .map_or(Duration::ZERO, |(t, ..)| {
                POLL_INTERVAL.saturating_sub(t.elapsed())
            })
    }

    /// Takes a poll's result: every rank's cumulative profile (`None` from an executor
    /// without ranks), the scheduler's state, and what the poll cost.
    pub fn ranks_polled(
        &self,
        profiles: Option<Vec<RankProfile>>,
        view: SchedulerView,
        cost: Duration,
    ) {
        let now = Instant::now();
        let mut guard = self.lock();
        let s = &mut *guard;
        let snap = &mut s.snapshot;
        snap.uptime_seconds = (now - s.started).as_secs_f64();
        snap.server.queue = view.queue;
        snap.server.running = view.running;
        snap.server.steps = view.steps;
        snap.server.kv_blocks_total = view.kv_blocks_total;
        snap.server.generated_tokens = s.generated;
        (snap.server.ttft_p50_ms, snap.server.ttft_p99_ms) = percentiles_ms(&s.ttft);
        (snap.server.tpot_p50_ms, snap.server.tpot_p99_ms) = percentiles_ms(&s.tpot);
        let c = &mut snap.collection;
        c.polls += 1;
        let profiles = profiles.unwrap_or_default();
        snap.server.expert_tokens = per_expert(&profiles, |p| &p.routed_tokens);
        snap.server.expert_dropped = per_expert(&profiles, |p| &p.dropped_tokens);
        let n = profiles.len().max(snap.ranks.len());
        snap.ranks.resize_with(n, RankFigures::default);
        for (r, f) in snap.ranks.iter_mut().enumerate() {
            f.rank = r;
            f.kv_blocks_used = view.kv_blocks_used;
            f.kv_blocks_free = view.kv_blocks_total.saturating_sub(view.kv_blocks_used);
            if let Some(p) = profiles.get(r) {
                f.bytes_sent_total = p.sent_bytes;
                f.compute_seconds_total = p.compute_s();
                f.expert_rows_total = p.expert_rows;
            }
        }
        let mut sample = Sample {
            t: snap.uptime_seconds,
            tokens_per_second: 0.0,
            queue: view.queue,
            running: view.running,
            compute_ms: vec![None; n],
            collective_ms: vec![None; n],
            wait_ms: vec![None; n],
        };
        if let Some((t_prev, prev, prev_view, prev_generated)) = &s.last_poll {
            let dt = (now - *t_prev).as_secs_f64().max(1e-9);
            snap.server.tokens_per_second = (s.generated - prev_generated) as f64 / dt;
            sample.tokens_per_second = snap.server.tokens_per_second;
            let steps = view.steps.saturating_sub(prev_view.steps);
            if steps > 0 {
                let step_time = view.step_time.saturating_sub(prev_view.step_time);
                if view.running > 0 || prev_view.running > 0 {
                    c.busy_polls += 1;
                    c.busy_poll_seconds += cost.as_secs_f64();
                    c.step_seconds += step_time.as_secs_f64();
                }
                per_step(snap, prev, &profiles, steps as f64, &mut sample);
            }
        }
        let c = &mut snap.collection;
        c.share_of_step_time = if c.step_seconds > 0.0 {
            c.busy_poll_seconds / c.step_seconds
        } else {
            0.0
        };
        c.mean_poll_ms = if c.busy_polls > 0 {
            c.busy_poll_seconds * 1e3 / c.busy_polls as f64
        } else {
            0.0
        };
        snap.history.push(sample);
        let keep = (HISTORY.as_secs_f64() / POLL_INTERVAL.as_secs_f64()) as usize;
        if snap.history.len() > keep {
            let extra = snap.history.len() - keep;
            snap.history.drain(..extra);
        }
        s.last_poll = Some((now, profiles, view, s.generated));
    }

    /// The figures now.
    pub fn snapshot(&self) -> Snapshot {
        self.lock().snapshot.clone()
    }
}

/// The per-step figures of every rank between two polls, into the snapshot and the sample.
fn per_step(
    snap: &mut Snapshot,
    prev: &[RankProfile],
    now: &[RankProfile],
    steps: f64,
    sample: &mut Sample,
) {
    let deltas: Vec<(f64, f64, f64, f64)> = now
        .iter()
        .zip(prev)
        .map(|(a, b)| {
            (
                (a.total_s - b.total_s).max(0.0),
                (a.comm_s - b.comm_s).max(0.0),
                (a.wait_s - b.wait_s).max(0.0),
                a.sent_bytes.saturating_sub(b.sent_bytes) as f64,
            )
        })
        .collect();
    if deltas.is_empty() {
        return;
    }
    let measured_wait = deltas.iter().any(|d| d.2 > 0.0);
    let least_comm = deltas.iter().map(|d| d.1).fold(f64::INFINITY, f64::min);
    let ms = |s: f64| s * 1e3 / steps;
    let mut slowest = (0, f64::NEG_INFINITY);
    for (r, &(total, comm, wait, sent)) in deltas.iter().enumerate() {
        let (collective, wait) = if measured_wait {
            (comm, wait)
        } else {
            (least_comm, comm - least_comm)
        };
        let compute = (total - collective - wait).max(0.0);
        let f = &mut snap.ranks[r];
        f.compute_ms_per_step = ms(compute);
        f.collective_ms_per_step = ms(collective);
        f.wait_ms_per_step = ms(wait);
        f.bytes_sent_per_step = sent / steps;
        sample.compute_ms[r] = Some(f.compute_ms_per_step);
        sample.collective_ms[r] = Some(f.collective_ms_per_step);
        sample.wait_ms[r] = Some(f.wait_ms_per_step);
        if compute > slowest.1 {
            slowest = (r, compute);
        }
    }
    for (r, f) in snap.ranks.iter_mut().enumerate() {
        f.slowest = r == slowest.0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prof(total: f64, comm: f64, sent: u64) -> RankProfile {
        RankProfile {
            total_s: total,
            comm_s: comm,
            wait_s: 0.0,
            all_reduces: 0,
            sent_bytes: sent,
            expert_rows: 0,
            routed_tokens: Vec::new(),
            dropped_tokens: Vec::new(),
        }
    }

    #[test]
    fn tokens_per_expert_add_the_stages_reports() {
        let with = |routes: Vec<u64>, dropped: Vec<u64>| RankProfile {
            routed_tokens: routes,
            dropped_tokens: dropped,
            ..prof(1.0, 0.0, 0)
        };
        // Two stages of two tp ranks: each stage's tp rank 0 reports its layers' routes.
        let profiles = [
            with(vec![3, 1, 0, 2], vec![0, 1, 0, 0]),
            with(vec![], vec![]),
            with(vec![1, 1, 4, 0], vec![0, 0, 2, 0]),
            with(vec![], vec![]),
        ];
        assert_eq!(
            per_expert(&profiles, |p| &p.routed_tokens),
            vec![4, 2, 4, 2]
        );
        assert_eq!(
            per_expert(&profiles, |p| &p.dropped_tokens),
            vec![0, 1, 2, 0]
        );
        assert!(per_expert(&[prof(1.0, 0.0, 0)], |p| &p.routed_tokens).is_empty());
    }

    #[test]
    fn per_step_figures_split_waiting_from_the_collective_and_mark_the_straggler() {
        let b = Board::default();
        b.set_ranks("m", vec![RankSetup::default(), RankSetup::default()]);
        let view = |steps, ms| SchedulerView {
            queue: 1,
            running: 2,
            steps,
            kv_blocks_used: 3,
            kv_blocks_total: 10,
            step_time: Duration::from_millis(ms),
        };
        b.ranks_polled(
            Some(vec![prof(1.0, 0.5, 100), prof(1.0, 0.2, 100)]),
            view(10, 1000),
            Duration::from_millis(1),
        );
        // 10 steps: rank 0 computed 0.2 s and spent 0.3 s in collectives; rank 1 computed
        // 0.4 s and spent 0.1 s: rank 0 waited 0.2 s for rank 1, the collective took 0.1 s.
        b.ranks_polled(
            Some(vec![prof(1.5, 0.8, 1100), prof(1.5, 0.3, 2100)]),
            view(20, 1500),
            Duration::from_millis(2),
        );
        let s = b.snapshot();
        let r0 = &s.ranks[0];
        let r1 = &s.ranks[1];
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(r0.compute_ms_per_step, 20.0), "{r0:?}");
        assert!(close(r0.collective_ms_per_step, 10.0), "{r0:?}");
        assert!(close(r0.wait_ms_per_step, 20.0), "{r0:?}");
        assert!(close(r1.compute_ms_per_step, 40.0), "{r1:?}");
        assert!(close(r1.wait_ms_per_step, 0.0), "{r1:?}");
        assert!(close(r0.bytes_sent_per_step, 100.0) && close(r1.bytes_sent_per_step, 200.0));
        assert!(r1.slowest && !r0.slowest);
        assert_eq!((r0.kv_blocks_used, r0.kv_blocks_free), (3, 7));
        // The second poll closed an interval of 0.5 s of steps and cost 2 ms.
        assert!(
            close(s.collection.share_of_step_time, 0.002 / 0.5),
            "{:?}",
            s.collection
        );
        assert_eq!(s.history.len(), 2);
        let w = &s.history[1].wait_ms;
        assert!(
            close(w[0].unwrap(), 20.0) && close(w[1].unwrap(), 0.0),
            "{w:?}"
        );
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(quantile(&mut v, 0.5), Some(50.0));
        assert_eq!(quantile(&mut v, 0.99), Some(99.0));
        assert_eq!(quantile(&mut [], 0.5), None);
        let b = Board::default();
        for i in 1..=100 {
            b.request_done(f64::from(i) / 1e3, Some(0.01));
        }
        b.generated(500);
        b.ranks_polled(None, SchedulerView::default(), Duration::ZERO);
        let s = b.snapshot().server;
        assert_eq!(s.ttft_p50_ms, Some(50.0));
        assert_eq!(s.ttft_p99_ms, Some(99.0));
        assert_eq!(s.generated_tokens, 500);
    }
}
