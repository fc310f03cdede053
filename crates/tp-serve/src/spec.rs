//! Speculative decoding inside continuous batching: each running request may carry its own
//! [`Speculator`] (n-gram lookup in its own prompt and output, or its own cache of the
//! server's draft model). Before a step the scheduler asks each decoding request for drafts
//! ([`SeqSpec::draft`]); its decode chunk is then `[next, d1..dk]` with every row's logits,
//! beside the other requests' rows in the same batched forward. The request's decoder walks
//! the rows in order until a token differs from its draft (the rule and why it keeps greedy
//! output and the sampled distribution: [`tp_engine::generate`]); the rejected positions are
//! dropped from that sequence's KV cache with one [`tp_engine::Command::Truncate`].
//!
//! A drafter's trouble never fails its request: a full draft KV pool skips that step's drafts
//! (`tp_spec_draft_kv_full_total`), a drafter error (or none to be had) stops drafting for
//! the request, logged once for it (`tp_spec_draft_errors_total`).

use crate::metrics::Metrics;
use std::sync::Arc;
use tp_engine::{DraftTokens, DrafterSource, Speculator};

/// Speculation settings of a server: who drafts, how many tokens per step, and in which
/// batched steps drafts are verified.
#[derive(Clone)]
pub struct ServeSpec {
    pub source: Arc<dyn DrafterSource>,
    pub tokens: DraftTokens,
    pub batch: SpecBatch,
}

impl std::fmt::Debug for ServeSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeSpec")
            .field("source", &self.source.describe())
            .field("tokens", &self.tokens)
            .field("batch", &self.batch)
            .finish()
    }
}

/// In which batched steps requests draft. A batch pays a verification row for every draft,
/// accepted or not, while the weights it streams are shared by all its rows: drafts pay when
/// a row costs little beside the step (few requests, or many cores) and are accepted often.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecBatch {
    /// In every step.
    Always,
    /// Only in steps where at most this many requests decode.
    UpTo(usize),
    /// Each request's drafts are kept when they are expected to raise the step's tokens per
    /// second, from the step cost measured on this server (a fixed part and a part per token
    /// fed, [`StepCost`]) and each request's chance that a draft is accepted
    /// ([`choose_drafts`]). Until steps of different sizes were timed: as `UpTo(1)`.
    Adaptive,
}

/// Weight of the older steps in [`StepCost`]'s fit, per step.
const COST_DECAY: f64 = 0.95;
/// Least weight of steps and spread of their sizes (tokens) before the fit is used.
const COST_MIN_WEIGHT: f64 = 3.0;
const COST_MIN_SPREAD: f64 = 0.5;
/// A fed token costs at least this fraction of a step's fixed part (a fit on noisy steps
/// must not make drafts look free).
const COST_MIN_PER_TOKEN: f64 = 0.01;

/// A batched step's seconds against the tokens it feeds, `fixed + per_token x tokens`, by
/// least squares over the steps so far, older ones decayed ([`COST_DECAY`] per step).
#[derive(Clone, Debug, Default)]
pub(crate) struct StepCost {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl StepCost {
    /// A step fed `tokens` and took `seconds`.
    pub(crate) fn observe(&mut self, tokens: usize, seconds: f64) {
        let (x, d) = (tokens as f64, COST_DECAY);
        self.w = self.w * d + 1.0;
        self.x = self.x * d + x;
        self.y = self.y * d + seconds;
        self.xx = self.xx * d + x * x;
        self.xy = self.xy * d + x * seconds;
    }

    /// `(fixed, per_token)` seconds, once enough steps of different sizes were timed.
    pub(crate) fn line(&self) -> Option<(f64, f64)> {
        if self.w < COST_MIN_WEIGHT {
            return None;
        }
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let var = self.xx / self.w - mx * mx;
        if var < COST_MIN_SPREAD * COST_MIN_SPREAD {
            return None;
        }
        let per = (self.xy / self.w - mx * my) / var;
        let fixed = (my - per * mx).max(0.0);
        Some((fixed, per.max(COST_MIN_PER_TOKEN * fixed)))
    }
}

/// Steps with drafts a request gets whatever they cost, so that its chance of acceptance is
/// measured before the adaptive policy judges its drafts by it; later, one step in
/// [`Speculator::PROBE_EVERY`] without verified drafts is a probe too (a quote that begins
/// later in the answer is noticed).
pub(crate) const PROBE_STEPS: usize = 2;

/// One request's drafts in a step, for [`choose_drafts`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Candidate {
    /// Drafted tokens.
    pub drafts: usize,
    /// How many of them are expected to be accepted.
    pub expected: f64,
    /// Kept whatever they cost (its acceptance is not measured yet, or not for a while:
    /// [`PROBE_STEPS`]).
    pub probe: bool,
}

/// Which requests keep their drafts in a step costing `cost` (`(fixed, per_token)` seconds)
/// that feeds `base` tokens and gives `given` tokens without drafts. Probes are kept; the
/// others are taken best first (expected accepted per draft) while each raises the step's
/// expected tokens per second. Returns the indices into `candidates` kept.
pub(crate) fn choose_drafts(
    cost: (f64, f64),
    base: usize,
    given: usize,
    candidates: &[Candidate],
) -> Vec<usize> {
    let (fixed, per) = cost;
    let rate = |fed: f64, tokens: f64| tokens / (fixed + per * fed);
    let (mut fed, mut tokens) = (base as f64, given as f64);
    let mut kept = Vec::new();
    for (i, c) in candidates.iter().enumerate() {
        if c.probe && c.drafts > 0 {
            fed += c.drafts as f64;
            tokens += c.expected;
            kept.push(i);
        }
    }
    let mut order: Vec<usize> = (0..candidates.len())
        .filter(|&i| candidates[i].drafts > 0 && !candidates[i].probe)
        .collect();
    let value = |i: usize| candidates[i].expected / candidates[i].drafts as f64;
    order.sort_by(|&a, &b| value(b).total_cmp(&value(a)));
    for i in order {
        let (k, e) = (candidates[i].drafts as f64, candidates[i].expected);
        if rate(fed + k, tokens + e) <= rate(fed, tokens) {
            break;
        }
        fed += k;
        tokens += e;
        kept.push(i);
    }
    kept
}

/// One request's speculation: its speculator and the drafts of the step being planned.
pub(crate) struct SeqSpec {
    speculator: Speculator,
    /// Tokens drafted for this step (fed after the request's next token); empty when it
    /// drafts none this step.
    pub(crate) drafts: Vec<u32>,
    /// The speculator's trouble counts already added to the metrics: full pool, errors.
    counted: (usize, usize),
}

impl SeqSpec {
    /// A request's speculation, its history starting with `prompt`; `None` (logged, counted)
    /// when no drafter can be had: the request runs without speculation.
    pub(crate) fn new(spec: &ServeSpec, prompt: &[u32], m: &Metrics) -> Option<Self> {
        let drafter = match spec.source.drafter() {
            Ok(d) => d,
            Err(e) => {
                m.spec_draft_trouble(0, 1);
                eprintln!(
                    "# tp serve: no drafter for a request ({}), it runs without drafts: {}",
                    spec.source.describe(),
                    tp_engine::report::chain(&e)
                );
                return None;
            }
        };
        let mut speculator = Speculator::new(drafter, spec.tokens);
        speculator.start(&[], prompt);
        Some(SeqSpec {
            speculator,
            drafts: Vec::new(),
            counted: (0, 0),
        })
    }

    /// Drafts at most `limit` tokens to follow the prompt and `generated` for this step; a
    /// drafter's trouble gives no drafts (counted in `m`; an error logged once per request).
    pub(crate) fn draft(&mut self, generated: &[u32], limit: usize, m: &Metrics) {
        self.drafts = if limit == 0 {
            Vec::new()
        } else {
            self.speculator.draft(generated, limit)
        };
        let st = self.speculator.stats;
        m.spec_draft_trouble(st.kv_full - self.counted.0, st.errors - self.counted.1);
        self.counted = (st.kv_full, st.errors);
        if let Some(why) = self.speculator.take_failure() {
            eprintln!("# tp serve: a request's drafter failed, it goes on without drafts: {why}");
        }
    }

    /// This step's drafts for [`choose_drafts`].
    pub(crate) fn candidate(&self) -> Candidate {
        Candidate {
            drafts: self.drafts.len(),
            expected: self.speculator.expected_accepted(self.drafts.len()),
            probe: self.speculator.stats.verify_steps < PROBE_STEPS
                || self.speculator.steps_without_drafts() >= Speculator::PROBE_EVERY,
        }
    }

    /// The step verified this step's drafts: `used` rows gave tokens, `accepted` drafts
    /// matched them; the batched step took `seconds`.
    pub(crate) fn record(&mut self, used: usize, accepted: usize, seconds: f64, m: &Metrics) {
        let drafted = self.drafts.len();
        self.speculator.record(drafted, accepted, seconds);
        m.spec_step(used, drafted, accepted);
        self.drafts.clear();
    }
}

/// How many fed tokens a sequence keeps after a step that fed its next token and `drafted`
/// drafts, of whose rows the first `used` gave tokens: the rows after the first rejected
/// draft are dropped (`None`: every row was used, nothing to drop).
pub(crate) fn rejected_positions(drafted: usize, used: usize) -> Option<usize> {
    (used <= drafted).then(|| drafted + 1 - used)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::tests::{
        alphabet, cfg, collect, done_text, job, metric, with_metrics, EOS,
    };
    use crate::scheduler::Event;
    use tp_engine::{Command, DecodeParams, Drafter, EngineError, SamplingParams, SpecMethod};

    /// The alphabet script's next token after `last` (see `scheduler::tests::alphabet`).
    fn next(last: u32, endless: bool) -> u32 {
        match u8::try_from(last) {
            Ok(b'z') if !endless => EOS as u32,
            Ok(c @ b'a'..=b'y') => u32::from(c) + 1,
            _ => u32::from(b'a'),
        }
    }

    /// Drafts the script's own continuation (`right`: every draft accepted, the end token
    /// included) or one off it (every draft rejected).
    struct Scripted {
        right: bool,
        endless: bool,
    }

    impl Drafter for Scripted {
        fn draft(&mut self, history: &[u32], k: usize) -> tp_engine::error::Result<Vec<u32>> {
            let mut last = *history.last().unwrap_or(&0);
            let mut out = Vec::new();
            while out.len() < k && last != EOS as u32 {
                last = next(last, self.endless);
                out.push(if self.right { last } else { (last + 1) % 257 });
            }
            Ok(out)
        }
    }

    struct ScriptedSource(bool, bool);

    impl DrafterSource for ScriptedSource {
        fn drafter(&self) -> tp_engine::error::Result<Box<dyn Drafter>> {
            Ok(Box::new(Scripted {
                right: self.0,
                endless: self.1,
            }))
        }
        fn describe(&self) -> String {
            format!("scripted (right: {})", self.0)
        }
    }

    /// Eight requests of mixed lengths: greedy ones ending by the end token (inside a run of
    /// accepted drafts with the scripted drafter), by `max_tokens` and by a stop string, and
    /// seeded sampled ones.
    fn requests() -> Vec<(String, DecodeParams)> {
        let sampled = |seed, top_k| DecodeParams {
            sampling: SamplingParams {
                temperature: 1.5,
                top_k,
                top_p: 0.95,
                seed,
            },
            ..DecodeParams::greedy(30)
        };
        vec![
            (
                "abcdefghijklmnopqrstuvwxyzabc".into(),
                DecodeParams::greedy(40),
            ),
            ("xyzab".into(), DecodeParams::greedy(100)),
            (
                "abcdefghij abcdef".into(),
                DecodeParams {
                    stop: vec!["klm".into()],
                    ..DecodeParams::greedy(50)
                },
            ),
            ("qrs".into(), DecodeParams::greedy(3)),
            ("abcdefghijklmnop".into(), sampled(7, 0)),
            ("klmnopqrstuvw klm".into(), sampled(3, 5)),
            (
                "abcdefghijklmnopqrstuvwxyz".repeat(2) + "ab",
                DecodeParams::greedy(20),
            ),
            ("m".into(), DecodeParams::greedy(200)),
        ]
    }

    /// Every request's (text, finish, completion tokens) served together with `spec` over
    /// `blocks` KV blocks, the metrics and the executor.
    fn serve_all(
        spec: Option<ServeSpec>,
        blocks: usize,
        endless: bool,
    ) -> (
        Vec<(String, String, usize)>,
        Metrics,
        tp_engine::ScriptedExecutor,
    ) {
        serve_all_at(spec, blocks, endless, 1)
    }

    /// [`serve_all`] with `depth` steps in flight (pipeline stages).
    fn serve_all_at(
        spec: Option<ServeSpec>,
        blocks: usize,
        endless: bool,
        depth: usize,
    ) -> (
        Vec<(String, String, usize)>,
        Metrics,
        tp_engine::ScriptedExecutor,
    ) {
        let mut exec = alphabet(endless);
        exec.depth = depth;
        let (got, metrics) = serve_on(&mut exec, spec, blocks);
        (got, metrics, exec)
    }

    /// The test's requests served on `exec`: each one's text, finish and generated count,
    /// and the metrics.
    fn serve_on(
        exec: &mut tp_engine::ScriptedExecutor,
        spec: Option<ServeSpec>,
        blocks: usize,
    ) -> (Vec<(String, String, usize)>, Metrics) {
        let mut c = cfg(blocks, 64);
        c.max_seqs = 8;
        c.spec = spec;
        let metrics = Metrics::new();
        let (jobs, mut rxs): (Vec<_>, Vec<_>) = requests()
            .into_iter()
            .map(|(p, params)| job(&p, params))
            .unzip();
        let (got, result) = with_metrics(exec, &c, jobs, &metrics, |_| {
            rxs.iter_mut().map(collect).collect::<Vec<_>>()
        });
        result.unwrap();
        let got = got
            .iter()
            .map(|g| {
                let text = done_text(g).to_string();
                match &g.1 {
                    Event::Done { finish, usage, .. } => {
                        (text, finish.as_str().to_string(), usage.completion_tokens)
                    }
                    other => panic!("{other:?}"),
                }
            })
            .collect();
        assert!(exec.open_slots().is_empty(), "{:?}", exec.open_slots());
        assert_eq!(metric(&metrics, "tp_kv_blocks_used"), 0.0);
        (got, metrics)
    }

    fn spec(source: Arc<dyn DrafterSource>, k: Option<usize>) -> Option<ServeSpec> {
        Some(ServeSpec {
            source,
            tokens: DraftTokens::new(k).unwrap(),
            batch: SpecBatch::Always,
        })
    }

    /// `UpTo(n)`: no drafts in a step where more requests decode; adaptive: drafts kept as
    /// the measured cost says; the text stays.
    #[test]
    fn no_request_drafts_in_a_step_with_more_decoding_requests_than_max_batch() {
        let (want, _, _) = serve_all(None, 1000, false);
        let source: Arc<dyn DrafterSource> = Arc::new(ScriptedSource(true, false));
        let drafted = |batch: SpecBatch| {
            let mut s = spec(source.clone(), Some(4));
            if let Some(s) = s.as_mut() {
                s.batch = batch;
            }
            let (got, m, _) = serve_all(s, 1000, false);
            assert_eq!(got, want, "{batch:?}");
            metric(&m, "tp_spec_drafted_tokens_total")
        };
        let all = drafted(SpecBatch::Always);
        // The 8 requests run together: with 1, only the last one left running drafts.
        let tail = drafted(SpecBatch::UpTo(1));
        assert_eq!(drafted(SpecBatch::UpTo(0)), 0.0);
        assert!(tail > 0.0 && tail < all, "{tail} of {all}");
        assert_eq!(drafted(SpecBatch::UpTo(8)), all);
        // Adaptive keeps the text whatever it decides (the scripted executor's steps take
        // no real time here: its decisions are tested on timed steps below).
        drafted(SpecBatch::Adaptive);
    }

    /// Adaptive speculation on steps that take time (a fixed part and a part per token
    /// fed): right drafts are kept in large batches, wrong ones dropped when rows are dear;
    /// the text stays.
    #[test]
    fn adaptive_speculation_keeps_the_drafts_that_pay() {
        use std::time::Duration;
        let (want, _, _) = serve_all(None, 1000, false);
        let run = |right: bool, batch: SpecBatch, per_token_us: u64| {
            let source: Arc<dyn DrafterSource> = Arc::new(ScriptedSource(right, false));
            let mut s = spec(source, Some(4));
            if let Some(s) = s.as_mut() {
                s.batch = batch;
            }
            let mut exec = alphabet(false);
            exec.step_time = Some((
                Duration::from_micros(2000),
                Duration::from_micros(per_token_us),
            ));
            let (got, m) = serve_on(&mut exec, s, 1000);
            assert_eq!(got, want, "{batch:?} right {right}");
            (
                metric(&m, "tp_spec_drafted_tokens_total"),
                metric(&m, "tp_spec_drafts_dropped_total"),
            )
        };
        // Right drafts always pay (each verified row gives a token): kept in batches of
        // several requests, far more than with drafts in lone steps only (measured: about
        // 100 drafted tokens of 128 with every step drafting, 11 in lone steps, 63 when
        // only the probes are kept).
        let (all, _) = run(true, SpecBatch::Always, 200);
        let (lone, _) = run(true, SpecBatch::UpTo(1), 200);
        let (adaptive, _) = run(true, SpecBatch::Adaptive, 200);
        assert!(
            adaptive > lone && adaptive > 0.65 * all,
            "{adaptive} vs {lone} lone, {all} all"
        );
        // Wrong drafts with rows as dear as the step's fixed part: dropped.
        let (all, _) = run(false, SpecBatch::Always, 2000);
        let (adaptive, dropped) = run(false, SpecBatch::Adaptive, 2000);
        assert!(
            dropped > 0.0 && adaptive < 0.5 * all,
            "{adaptive} vs {all} all, {dropped} dropped"
        );
    }

    /// The step cost's fit: a line through steps of two sizes, nothing before the sizes
    /// differ, and a floor under the cost per token.
    #[test]
    fn the_step_cost_is_fitted_from_timed_steps() {
        let mut c = StepCost::default();
        for _ in 0..10 {
            c.observe(4, 0.030);
        }
        assert_eq!(c.line(), None, "one size only");
        for _ in 0..10 {
            c.observe(12, 0.050);
        }
        let (fixed, per) = c.line().unwrap();
        assert!(
            (fixed - 0.020).abs() < 1e-9 && (per - 0.0025).abs() < 1e-9,
            "{fixed} {per}"
        );
        // Bigger steps no slower (noise): the per-token cost is floored.
        let mut flat = StepCost::default();
        for t in [4, 12, 4, 12] {
            flat.observe(t, 0.040);
        }
        let (fixed, per) = flat.line().unwrap();
        assert!(
            (per - COST_MIN_PER_TOKEN * fixed).abs() < 1e-12,
            "{fixed} {per}"
        );
    }

    /// Drafts are kept while they raise the step's expected tokens per second, best first.
    #[test]
    fn drafts_are_kept_while_they_pay() {
        // Rows cheap beside the step (weights streamed once for all): every request's
        // drafts pay, the most promising first.
        let c = |drafts, expected| Candidate {
            drafts,
            expected,
            probe: false,
        };
        let cheap = (0.020, 0.001);
        let all = [c(4, 3.0), c(4, 2.0), c(2, 1.8)];
        assert_eq!(choose_drafts(cheap, 8, 8, &all), vec![2, 0, 1]);
        // Rows as dear as a step's fixed part: only drafts accepted nearly always pay.
        let dear = (0.020, 0.020);
        assert_eq!(choose_drafts(dear, 8, 8, &all), vec![2]);
        assert!(choose_drafts(dear, 8, 8, &[c(4, 1.0)]).is_empty());
        // A probe is kept whatever it costs.
        let probe = Candidate {
            probe: true,
            ..c(4, 1.0)
        };
        assert_eq!(choose_drafts(dear, 8, 8, &[c(4, 1.0), probe]), vec![1]);
        // Nothing drafted, nothing kept.
        assert!(choose_drafts(cheap, 1, 1, &[c(0, 0.0)]).is_empty());
    }

    #[test]
    fn every_request_gets_its_text_without_speculation() {
        for endless in [false, true] {
            for blocks in [1000, 5] {
                let (want, pm, plain) = serve_all(None, blocks, endless);
                // The small budget preempts (and recomputes) requests.
                // The small budget preempts (and recomputes) requests when they run long,
                // and the 200-token request alone fills it: it ends with `length` early.
                let small = endless && blocks < 1000;
                assert_eq!(metric(&pm, "tp_preemptions_total") > 0.0, small);
                assert_eq!(want[7].2 == 160, small, "{:?}", want[7]);
                assert!(!plain
                    .log
                    .iter()
                    .any(|c| matches!(c, Command::Truncate { .. })));
                let sources: [(Arc<dyn DrafterSource>, &str); 3] = [
                    (Arc::new(SpecMethod::Ngram), "ngram"),
                    (Arc::new(ScriptedSource(true, endless)), "right"),
                    (Arc::new(ScriptedSource(false, endless)), "wrong"),
                ];
                for (source, name) in sources {
                    for k in [Some(1), Some(4), None] {
                        let (got, m, exec) = serve_all(spec(source.clone(), k), blocks, endless);
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(g, w, "{name} k {k:?} blocks {blocks} request {i}");
                        }
                        let (drafted, accepted) = (
                            metric(&m, "tp_spec_drafted_tokens_total"),
                            metric(&m, "tp_spec_accepted_tokens_total"),
                        );
                        let per_step = metric(&m, "tp_spec_tokens_per_step");
                        let truncates = exec
                            .log
                            .iter()
                            .filter(|c| matches!(c, Command::Truncate { .. }))
                            .count();
                        match name {
                            "wrong" => {
                                assert!(drafted > 0.0 && accepted == 0.0, "{drafted} {accepted}");
                                assert_eq!(per_step, 1.0);
                                assert!(truncates > 0);
                            }
                            "right" => {
                                assert!(accepted > 0.0, "{name}");
                                // Adaptive lengths (k None) follow timed step costs: under
                                // load they may stay short, so only fixed lengths are held
                                // to 1.5 tokens a step.
                                let least = if k.is_some() { 1.5 } else { 1.0 };
                                assert!(per_step > least, "{name} k {k:?}: {per_step}");
                            }
                            _ => assert!(accepted > 0.0 && per_step > 1.0, "{per_step}"),
                        }
                        if blocks == 1000 {
                            // Fewer forward steps than without speculation when drafts are
                            // accepted.
                            if name != "wrong" {
                                assert!(exec.forwards < plain.forwards, "{name} {k:?}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Right scripted drafts with faults: the `n`-th drafter made fails to be made when
    /// `n % 4 == 1`, its draft KV pool is "full" every third call when `n % 4 == 2`, and its
    /// fourth call is a forward error when `n % 4 == 3`.
    struct FaultySource(std::sync::atomic::AtomicUsize);

    struct Faulty {
        n: usize,
        calls: usize,
        right: Scripted,
    }

    impl Drafter for Faulty {
        fn draft(&mut self, history: &[u32], k: usize) -> tp_engine::error::Result<Vec<u32>> {
            self.calls += 1;
            match self.n % 4 {
                2 if self.calls.is_multiple_of(3) => Err(EngineError::DraftKvFull {
                    needed: 1,
                    free: 0,
                    limit: 8,
                }),
                3 if self.calls == 4 => Err(EngineError::Internal("draft forward failed".into())),
                _ => self.right.draft(history, k),
            }
        }
    }

    impl DrafterSource for FaultySource {
        fn drafter(&self) -> tp_engine::error::Result<Box<dyn Drafter>> {
            let n = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if n % 4 == 1 {
                return Err(EngineError::Internal("no draft today".into()));
            }
            Ok(Box::new(Faulty {
                n,
                calls: 0,
                right: Scripted {
                    right: true,
                    endless: false,
                },
            }))
        }
        fn describe(&self) -> String {
            "faulty".into()
        }
    }

    /// A drafter that cannot be made, a full draft pool and a drafter error fail no request:
    /// every text is the one without speculation, and the metrics count the trouble.
    #[test]
    fn drafter_faults_fail_no_request() {
        for blocks in [1000, 5] {
            let (want, _, _) = serve_all(None, blocks, false);
            let source = Arc::new(FaultySource(Default::default()));
            let (got, m, _) = serve_all(spec(source.clone(), Some(3)), blocks, false);
            assert_eq!(got, want, "blocks {blocks}");
            let made = source.0.load(std::sync::atomic::Ordering::Relaxed);
            // Requests preempted and restarted keep their speculation: one drafter each.
            assert_eq!(made, 8, "blocks {blocks}");
            let errors = metric(&m, "tp_spec_draft_errors_total");
            // Drafters 1 and 5 were not made; 3 and 7 failed if they drafted four times.
            assert!((2.0..=4.0).contains(&errors), "{errors}");
            assert!(metric(&m, "tp_spec_draft_kv_full_total") > 0.0);
            assert!(metric(&m, "tp_spec_accepted_tokens_total") > 0.0);
        }
    }

    /// Speculation with 2 steps in flight (pipeline stages): each launched step verifies the
    /// drafts it was launched with, and every text is the one without speculation, with room
    /// for all and under a budget that preempts.
    #[test]
    fn speculation_with_steps_in_flight_gives_every_request_its_text() {
        for blocks in [1000, 5] {
            let (want, _, _) = serve_all(None, blocks, true);
            let sources: [(Arc<dyn DrafterSource>, &str); 3] = [
                (Arc::new(SpecMethod::Ngram), "ngram"),
                (Arc::new(ScriptedSource(true, true)), "right"),
                (Arc::new(ScriptedSource(false, true)), "wrong"),
            ];
            for (source, name) in sources {
                let (got, m, exec) = serve_all_at(spec(source, Some(3)), blocks, true, 2);
                assert_eq!(got, want, "{name} blocks {blocks}");
                assert_eq!(exec.most_in_flight, 2, "{name} blocks {blocks}");
                if name == "right" {
                    assert!(metric(&m, "tp_spec_accepted_tokens_total") > 0.0);
                }
            }
        }
    }

    #[test]
    fn rejected_positions_are_the_rows_after_the_first_rejection() {
        assert_eq!(rejected_positions(0, 1), None);
        assert_eq!(rejected_positions(3, 4), None);
        assert_eq!(rejected_positions(3, 1), Some(3));
        assert_eq!(rejected_positions(3, 3), Some(1));
    }
}
