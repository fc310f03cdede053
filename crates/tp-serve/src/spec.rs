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

/// Speculation settings of a server: who drafts, how many tokens per step, and up to how
/// many decoding requests a step drafts for.
#[derive(Clone)]
pub struct ServeSpec {
    pub source: Arc<dyn DrafterSource>,
    pub tokens: DraftTokens,
    /// Draft only in steps where at most this many requests decode (`None`: in every step).
    /// A batch that already keeps the cores busy pays a verification row for every draft,
    /// accepted or not, so speculation slows large batches down.
    pub max_batch: Option<usize>,
}

impl std::fmt::Debug for ServeSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeSpec")
            .field("source", &self.source.describe())
            .field("tokens", &self.tokens)
            .field("max_batch", &self.max_batch)
            .finish()
    }
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
        let mut c = cfg(blocks, 64);
        c.max_seqs = 8;
        c.spec = spec;
        let metrics = Metrics::new();
        let (jobs, mut rxs): (Vec<_>, Vec<_>) = requests()
            .into_iter()
            .map(|(p, params)| job(&p, params))
            .unzip();
        let (got, result) = with_metrics(&mut exec, &c, jobs, &metrics, |_| {
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
        (got, metrics, exec)
    }

    fn spec(source: Arc<dyn DrafterSource>, k: Option<usize>) -> Option<ServeSpec> {
        Some(ServeSpec {
            source,
            tokens: DraftTokens::new(k).unwrap(),
            max_batch: None,
        })
    }

    /// `max_batch`: no drafts in a step where more requests decode; the text stays.
    #[test]
    fn no_request_drafts_in_a_step_with_more_decoding_requests_than_max_batch() {
        let (want, _, _) = serve_all(None, 1000, false);
        let source: Arc<dyn DrafterSource> = Arc::new(ScriptedSource(true, false));
        let drafted = |max_batch: Option<usize>| {
            let mut s = spec(source.clone(), Some(4));
            if let Some(s) = s.as_mut() {
                s.max_batch = max_batch;
            }
            let (got, m, _) = serve_all(s, 1000, false);
            assert_eq!(got, want, "max_batch {max_batch:?}");
            metric(&m, "tp_spec_drafted_tokens_total")
        };
        let all = drafted(None);
        // The 8 requests run together: with 1, only the last one left running drafts.
        let tail = drafted(Some(1));
        assert_eq!(drafted(Some(0)), 0.0);
        assert!(tail > 0.0 && tail < all, "{tail} of {all}");
        assert_eq!(drafted(Some(8)), all);
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
