//! Prometheus metrics of the server (`GET /metrics`): requests, tokens, time to first token,
//! time per output token, queue length, KV cache use, time in collectives per step, and per
//! rank (label `rank`, with `host`) the time split per step, bytes sent, load time and memory;
//! and the dashboard's figures ([`Board`]), which the same events feed.
//!
//! The recorder is this server's own (not installed as the process-wide `metrics` recorder),
//! so several servers in one process, as in tests, keep separate figures.

use crate::dashboard::{Board, RankSetup, SchedulerView};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

const META: Metadata<'static> = Metadata::new("tp_serve", metrics::Level::INFO, None);

/// Latency buckets in seconds (1 ms .. 60 s).
const LATENCY: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
];
/// Per-token and per-step buckets in seconds (0.1 ms .. 5 s).
const FINE: &[f64] = &[
    0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0,
];
/// Rows (sequences) per forward step.
const ROWS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

fn rank_labels(rank: usize, host: &str) -> Vec<Label> {
    vec![
        Label::new("rank", rank.to_string()),
        Label::new("host", host.to_string()),
    ]
}

/// Speculative decoding's series, and their totals for the two ratios.
struct SpecFigures {
    steps: Counter,
    tokens: Counter,
    drafted: Counter,
    accepted: Counter,
    acceptance: Gauge,
    tokens_per_step: Gauge,
    /// Steps a request drafted nothing because the draft model's KV pool was full.
    kv_full: Counter,
    /// Requests whose drafter failed (they went on without drafts).
    errors: Counter,
    /// Drafted tokens the adaptive batch policy left out of a step (they would not pay).
    dropped: Counter,
    /// Steps, tokens, drafted, accepted.
    totals: std::sync::Mutex<[u64; 4]>,
}

/// Every metric the server records.
pub struct Metrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub time_to_first_token: Histogram,
    pub time_per_output_token: Histogram,
    pub request_latency: Histogram,
    pub queue_time: Histogram,
    pub waiting: Gauge,
    pub running: Gauge,
    pub kv_blocks_total: Gauge,
    pub kv_blocks_used: Gauge,
    pub kv_cache_bytes: Gauge,
    pub prefix_cache_entries: Gauge,
    pub prefix_cache_hits: Counter,
    pub prefix_cache_hit_tokens: Counter,
    pub preemptions: Counter,
    /// Steps launched while another was still in flight (pipeline stages computing at once).
    pub pipelined_steps: Counter,
    pub step_seconds: Histogram,
    pub step_collective_seconds: Histogram,
    pub step_rows: Histogram,
    pub cancelled: Counter,
    pub connections_open: Gauge,
    pub connections_max: Gauge,
    pub connections_refused: Counter,
    pub connections_dropped: Counter,
    pub connections_evicted: Counter,
    pub stats_collection_seconds: Gauge,
    /// Speculative decoding's figures (requests that draft).
    spec: SpecFigures,
    /// The dashboard's figures.
    pub board: Board,
    /// Each rank's host (the `host` label of the per-rank series).
    hosts: std::sync::Mutex<Vec<String>>,
    /// Every model held so far (`tp_model_live` keeps a series for each).
    models: std::sync::Mutex<Vec<(u32, String)>>,
    /// Why the inference engine failed (a lost or stalled rank), once it has: the server
    /// is then unhealthy.
    engine_failure: std::sync::Mutex<Option<String>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut builder = PrometheusBuilder::new();
        for (name, buckets) in [
            ("tp_time_to_first_token_seconds", LATENCY),
            ("tp_request_latency_seconds", LATENCY),
            ("tp_queue_time_seconds", LATENCY),
            ("tp_time_per_output_token_seconds", FINE),
            ("tp_step_seconds", FINE),
            ("tp_step_collective_seconds", FINE),
            ("tp_step_rows", ROWS),
        ] {
            builder = builder
                .set_buckets_for_metric(Matcher::Full(name.into()), buckets)
                .expect("bucket lists are non-empty constants");
        }
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        let r = &recorder;
        let describe = |name: &'static str, help: &'static str| {
            r.describe_counter(KeyName::from(name), None, SharedString::const_str(help));
        };
        r.describe_gauge(
            KeyName::from("tp_canary_drift"),
            None,
            SharedString::const_str("1 while the canary's last run failed (a continuation differed or its mean logprob moved beyond the threshold)"),
        );
        describe(
            "tp_canary_runs_total",
            "Canary runs by result (pass, drift)",
        );
        describe("tp_requests_total", "HTTP requests by endpoint and status");
        describe(
            "tp_expert_tokens_total",
            "Mixture of experts: tokens each expert took, summed over layers",
        );
        describe(
            "tp_expert_tokens_dropped_total",
            "Mixture of experts: (token, expert) pairs routed to each expert that the capacity factor dropped, summed over layers",
        );
        describe(
            "tp_rank_expert_rows_total",
            "Mixture of experts: (token, expert) rows this rank's experts computed, over layers (0 for a dense model)",
        );
        describe(
            "tp_model_switches_total",
            "Switches of traffic to a newly loaded model",
        );
        describe(
            "tp_model_rollbacks_total",
            "Switches back to the previous model (admin, canary or error rate)",
        );
        describe(
            "tp_model_reload_failures_total",
            "Reloads refused: the model could not be loaded, or its canary failed",
        );
        r.describe_gauge(
            KeyName::from("tp_model_live"),
            None,
            SharedString::const_str(
                "1 for the model serving new requests, 0 for the others held or once held",
            ),
        );
        r.describe_gauge(
            KeyName::from("tp_engine_healthy"),
            None,
            SharedString::const_str(
                "1 while the inference engine runs; 0 once it failed (a lost or stalled rank): the server then only answers /health 503 until it exits",
            ),
        );
        r.register_gauge(&Key::from_static_name("tp_engine_healthy"), &META)
            .set(1.0);
        describe("tp_prompt_tokens_total", "Prompt tokens processed");
        describe("tp_generation_tokens_total", "Tokens generated");
        describe(
            "tp_requests_cancelled_total",
            "Requests whose client went away before the end",
        );
        describe(
            "tp_connections_refused_total",
            "Connections answered 503 because the connection cap was reached",
        );
        describe(
            "tp_connections_dropped_total",
            "Connections over the connection cap whose 503 could not be written (closed unanswered)",
        );
        describe(
            "tp_connections_timed_out_total",
            "Connections closed by a deadline: header (request headers too slow), idle (keep-alive), write_stall (the client stopped reading)",
        );
        let h = |name: &'static str, help: &'static str| {
            r.describe_histogram(KeyName::from(name), None, SharedString::const_str(help));
            r.register_histogram(&Key::from_static_name(name), &META)
        };
        let g = |name: &'static str, help: &'static str| {
            r.describe_gauge(KeyName::from(name), None, SharedString::const_str(help));
            r.register_gauge(&Key::from_static_name(name), &META)
        };
        let c = |name: &'static str| r.register_counter(&Key::from_static_name(name), &META);
        Metrics {
            prompt_tokens: c("tp_prompt_tokens_total"),
            generation_tokens: c("tp_generation_tokens_total"),
            cancelled: c("tp_requests_cancelled_total"),
            connections_refused: c("tp_connections_refused_total"),
            connections_dropped: c("tp_connections_dropped_total"),
            stats_collection_seconds: g(
                "tp_stats_collection_seconds_total",
                "Time rank 0 spent gathering every rank's figures for the dashboard and the tp_rank_* series",
            ),
            connections_evicted: {
                describe("tp_connections_evicted_total", "Connections without a complete request closed at the connection cap to make room for a new one (oldest first)");
                c("tp_connections_evicted_total")
            },
            connections_open: g("tp_connections_open", "HTTP connections open (served)"),
            connections_max: g(
                "tp_connections_max",
                "HTTP connections served at once; more are refused with 503",
            ),
            time_to_first_token: h(
                "tp_time_to_first_token_seconds",
                "From the request's arrival to its first generated token",
            ),
            time_per_output_token: h(
                "tp_time_per_output_token_seconds",
                "Mean time between generated tokens of a request, after the first",
            ),
            request_latency: h(
                "tp_request_latency_seconds",
                "From arrival to the last token",
            ),
            queue_time: h(
                "tp_queue_time_seconds",
                "From arrival to admission (KV cache reserved)",
            ),
            waiting: g(
                "tp_queue_length",
                "Requests waiting for KV cache room or a sequence slot",
            ),
            running: g("tp_running_requests", "Requests being generated"),
            kv_blocks_total: g(
                "tp_kv_blocks_total",
                "KV cache blocks (of 32 positions) all sequences may hold together (per rank)",
            ),
            kv_blocks_used: g(
                "tp_kv_blocks_used",
                "KV cache blocks held by running requests and the prefix cache (per rank)",
            ),
            kv_cache_bytes: g(
                "tp_kv_cache_bytes",
                "Bytes held by KV cache blocks on rank 0",
            ),
            prefix_cache_entries: g(
                "tp_prefix_cache_entries",
                "Finished sequences kept for requests that begin alike",
            ),
            prefix_cache_hits: {
                describe("tp_prefix_cache_hits_total", "Requests that started from a shared prefix (of a running or cached sequence)");
                c("tp_prefix_cache_hits_total")
            },
            prefix_cache_hit_tokens: {
                describe("tp_prefix_cache_hit_tokens_total", "Prompt tokens not computed because a shared prefix held them");
                c("tp_prefix_cache_hit_tokens_total")
            },
            preemptions: {
                describe("tp_preemptions_total", "Running requests whose KV blocks were freed for older ones (recomputed later)");
                c("tp_preemptions_total")
            },
            pipelined_steps: {
                describe("tp_pipelined_steps_total", "Forward steps launched while another was still in flight: with pipeline stages, the earlier stages computed this one while the last stage computed that one");
                c("tp_pipelined_steps_total")
            },
            step_seconds: h(
                "tp_step_seconds",
                "Duration of one batched forward step (all ranks, logits gathered)",
            ),
            step_collective_seconds: h(
                "tp_step_collective_seconds",
                "Time rank 0 spent in collectives (all-reduces, logit gather, waiting for peers) per step",
            ),
            step_rows: h(
                "tp_step_rows",
                "Sequences (prefill chunks and decode tokens) per forward step",
            ),
            spec: SpecFigures {
                steps: {
                    describe("tp_spec_steps_total", "Decode steps of speculating requests (one per request per forward step, drafts or not)");
                    c("tp_spec_steps_total")
                },
                tokens: {
                    describe("tp_spec_tokens_total", "Tokens generated by speculating requests' decode steps");
                    c("tp_spec_tokens_total")
                },
                drafted: {
                    describe("tp_spec_drafted_tokens_total", "Drafted tokens verified");
                    c("tp_spec_drafted_tokens_total")
                },
                accepted: {
                    describe("tp_spec_accepted_tokens_total", "Drafted tokens the model accepted");
                    c("tp_spec_accepted_tokens_total")
                },
                acceptance: g(
                    "tp_spec_acceptance_rate",
                    "Accepted over drafted tokens since the start",
                ),
                tokens_per_step: g(
                    "tp_spec_tokens_per_step",
                    "Tokens per decode step of a speculating request since the start (1 without drafts)",
                ),
                kv_full: {
                    describe("tp_spec_draft_kv_full_total", "Decode steps of speculating requests that drafted nothing because the draft model's KV pool was full");
                    c("tp_spec_draft_kv_full_total")
                },
                errors: {
                    describe("tp_spec_draft_errors_total", "Requests whose drafter failed; each went on without drafts");
                    c("tp_spec_draft_errors_total")
                },
                dropped: {
                    describe("tp_spec_drafts_dropped_total", "Drafted tokens left out of a batched step because the measured step cost said they would not pay (adaptive speculation)");
                    c("tp_spec_drafts_dropped_total")
                },
                totals: std::sync::Mutex::default(),
            },
            board: Board::default(),
            hosts: std::sync::Mutex::default(),
            models: std::sync::Mutex::default(),
            engine_failure: std::sync::Mutex::default(),
            recorder,
            handle,
        }
    }

    /// Sets what each rank is (at start): the dashboard's table and the per-rank series of
    /// load time and memory.
    pub fn set_ranks(&self, model: &str, setup: Vec<RankSetup>) {
        for (r, s) in setup.iter().enumerate() {
            self.rank_gauge("tp_rank_load_seconds", r, &s.host)
                .set(s.load_seconds);
            self.rank_gauge("tp_rank_memory_bytes", r, &s.host)
                .set(s.memory_bytes as f64);
        }
        *self.hosts.lock().unwrap_or_else(|e| e.into_inner()) =
            setup.iter().map(|s| s.host.clone()).collect();
        self.board.set_ranks(model, setup);
    }

    /// Takes a poll of every rank's figures (see [`Board::ranks_polled`]) and sets the
    /// per-rank series from it.
    pub fn ranks_polled(
        &self,
        profiles: Option<Vec<tp_engine::RankProfile>>,
        view: SchedulerView,
        cost: std::time::Duration,
    ) {
        self.board.ranks_polled(profiles, view, cost);
        self.stats_collection_seconds.increment(cost.as_secs_f64());
        let snap = self.board.snapshot();
        for (name, counts) in [
            ("tp_expert_tokens_total", &snap.server.expert_tokens),
            (
                "tp_expert_tokens_dropped_total",
                &snap.server.expert_dropped,
            ),
        ] {
            for (e, &n) in counts.iter().enumerate() {
                let key = Key::from_parts(name, vec![Label::new("expert", e.to_string())]);
                self.recorder.register_counter(&key, &META).absolute(n);
            }
        }
        for f in &snap.ranks {
            let host = &f.setup.host;
            for (name, v) in [
                (
                    "tp_rank_compute_seconds_per_step",
                    f.compute_ms_per_step / 1e3,
                ),
                (
                    "tp_rank_collective_seconds_per_step",
                    f.collective_ms_per_step / 1e3,
                ),
                ("tp_rank_wait_seconds_per_step", f.wait_ms_per_step / 1e3),
                ("tp_rank_compute_seconds", f.compute_seconds_total),
                ("tp_rank_bytes_sent_per_step", f.bytes_sent_per_step),
                ("tp_rank_kv_blocks_used", f.kv_blocks_used as f64),
                ("tp_rank_slowest", if f.slowest { 1.0 } else { 0.0 }),
            ] {
                self.rank_gauge(name, f.rank, host).set(v);
            }
            for (name, v) in [
                ("tp_rank_bytes_sent_total", f.bytes_sent_total),
                ("tp_rank_expert_rows_total", f.expert_rows_total),
            ] {
                let key = Key::from_parts(name, rank_labels(f.rank, host));
                self.recorder.register_counter(&key, &META).absolute(v);
            }
        }
    }

    /// The inference engine failed with `why`: `/health` answers 503 with it, and
    /// `tp_engine_healthy` drops to 0.
    pub fn engine_failed(&self, why: String) {
        *self
            .engine_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(why);
        self.recorder
            .register_gauge(&Key::from_static_name("tp_engine_healthy"), &META)
            .set(0.0);
    }

    /// Why the inference engine failed, once it has.
    pub fn engine_failure(&self) -> Option<String> {
        self.engine_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Takes a canary run: the drift alarm, the largest log-probability shift, the runs.
    pub fn canary_ran(&self, v: &crate::canary::Verdict) {
        self.board.canary_ran(v);
        let r = &self.recorder;
        r.register_gauge(&Key::from_static_name("tp_canary_drift"), &META)
            .set(if v.passed { 0.0 } else { 1.0 });
        r.register_gauge(&Key::from_static_name("tp_canary_max_logprob_shift"), &META)
            .set(v.max_shift);
        let key = Key::from_parts(
            "tp_canary_runs_total",
            vec![Label::new(
                "result",
                if v.passed { "pass" } else { "drift" },
            )],
        );
        r.register_counter(&key, &META).increment(1);
    }

    /// Takes the models' new state: `tp_model_live{id, name}` (1 for the live model, 0 for the
    /// others held or once held), switches, rollbacks and failed reloads.
    pub fn rollout_changed(&self, s: &crate::dashboard::RolloutStatus) {
        self.board.rollout_changed(s);
        let r = &self.recorder;
        let mut known = self.models.lock().unwrap_or_else(|e| e.into_inner());
        for m in &s.models {
            if !known.iter().any(|(id, _)| *id == m.id) {
                known.push((m.id, m.name.clone()));
            }
        }
        for (id, name) in known.iter() {
            let key = Key::from_parts(
                "tp_model_live",
                vec![
                    Label::new("id", id.to_string()),
                    Label::new("name", name.clone()),
                ],
            );
            r.register_gauge(&key, &META)
                .set(if *id == s.live.id { 1.0 } else { 0.0 });
        }
        for (name, v) in [
            ("tp_model_switches_total", s.switches),
            ("tp_model_rollbacks_total", s.rollbacks),
            ("tp_model_reload_failures_total", s.reload_failures),
        ] {
            r.register_counter(&Key::from_static_name(name), &META)
                .absolute(v);
        }
    }

    fn rank_gauge(&self, name: &'static str, rank: usize, host: &str) -> Gauge {
        let key = Key::from_parts(name, rank_labels(rank, host));
        self.recorder.register_gauge(&key, &META)
    }

    /// Records one speculating request's decode step: `tokens` generated, `drafted` tokens
    /// verified, `accepted` of them kept.
    pub fn spec_step(&self, tokens: usize, drafted: usize, accepted: usize) {
        let f = &self.spec;
        f.steps.increment(1);
        f.tokens.increment(tokens as u64);
        f.drafted.increment(drafted as u64);
        f.accepted.increment(accepted as u64);
        let mut t = f.totals.lock().unwrap_or_else(|e| e.into_inner());
        t[0] += 1;
        t[1] += tokens as u64;
        t[2] += drafted as u64;
        t[3] += accepted as u64;
        f.tokens_per_step.set(t[1] as f64 / t[0] as f64);
        if t[2] > 0 {
            f.acceptance.set(t[3] as f64 / t[2] as f64);
        }
    }

    /// Records a speculating request's drafting troubles since the last call: `kv_full`
    /// steps without drafts for a full draft KV pool, `errors` drafter failures.
    pub fn spec_draft_trouble(&self, kv_full: usize, errors: usize) {
        self.spec.kv_full.increment(kv_full as u64);
        self.spec.errors.increment(errors as u64);
    }

    /// Counts `n` drafted tokens the adaptive batch policy left out of a step.
    pub fn spec_drafts_dropped(&self, n: usize) {
        self.spec.dropped.increment(n as u64);
    }

    /// Counts one answered HTTP request.
    pub fn request(&self, endpoint: &'static str, status: u16) {
        let key = Key::from_parts(
            "tp_requests_total",
            vec![
                Label::new("endpoint", endpoint),
                Label::new("status", status.to_string()),
            ],
        );
        self.recorder.register_counter(&key, &META).increment(1);
    }

    /// Counts a connection closed by its watchdog (`why`: header, idle, write_stall).
    pub fn connection_timed_out(&self, why: &'static str) {
        let key = Key::from_parts(
            "tp_connections_timed_out_total",
            vec![Label::new("reason", why)],
        );
        self.recorder.register_counter(&key, &META).increment(1);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        self.handle.run_upkeep();
        self.handle.render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_histograms() {
        let m = Metrics::new();
        m.request("chat", 200);
        m.request("chat", 400);
        m.generation_tokens.increment(5);
        m.waiting.set(3.0);
        m.time_to_first_token.record(0.03);
        let text = m.render();
        assert!(
            text.contains(r#"tp_requests_total{endpoint="chat",status="400"} 1"#),
            "{text}"
        );
        assert!(text.contains("tp_generation_tokens_total 5"), "{text}");
        assert!(text.contains("tp_queue_length 3"), "{text}");
        assert!(
            text.contains(r#"tp_time_to_first_token_seconds_bucket{le="0.05"} 1"#),
            "{text}"
        );
    }
}
