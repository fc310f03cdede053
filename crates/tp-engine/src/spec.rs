//! Speculative decoding, the drafting side: a [`Drafter`] proposes the tokens likely to come
//! next, the generation loop ([`crate::generate`]) has the target verify them all in one
//! forward step (the last fed token plus the drafts, every row's logits), keeps the run of
//! drafts the decoder's own choices confirm and drops the rest
//! from the KV cache. A [`Speculator`] holds the drafter, how many tokens it drafts (fixed,
//! or adapted to how many were accepted) and the counts the bench reports.
//!
//! Drafters here are deterministic (their distribution is a point mass), so the
//! speculative-sampling rule needs no draft probabilities ([`crate::generate`] says why).
//!
//! Drafting is optional: a drafter that fails never fails its sequence. A full draft KV
//! pool ([`EngineError::DraftKvFull`]) skips drafting for that step; any other error stops
//! drafting for the rest of the sequence, its message kept once for the caller to log.

use crate::error::{EngineError, Result};

/// Most tokens one step may draft: a verification step is `1 + k` tokens on the many-token
/// path, and acceptance runs longer than this are rare enough not to pay for the extra rows.
pub const MAX_DRAFT_TOKENS: usize = 32;

/// The adaptive policy's ceiling, its first length and its cost guess before measuring.
const ADAPTIVE_MAX: usize = 16;
const ADAPTIVE_START: usize = 4;
/// Before any verification was timed: an extra row costs this fraction of a one-token step.
const PRIOR_ROW_COST: f64 = 0.25;
/// Weight of the newest observation in the running estimates.
const EMA: f64 = 0.2;
/// When drafting does not pay, one step in this many still drafts a token, so a change in
/// the text (a quote begins) is noticed.
const PROBE_EVERY: usize = 16;

/// Which drafter proposes tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecMethod {
    /// Prompt lookup: continue the latest earlier occurrence of the last few tokens of the
    /// prompt and output ([`NgramDrafter`]).
    Ngram,
}

impl SpecMethod {
    /// Every method's name, as [`SpecMethod::parse`] takes them.
    pub const NAMES: &'static [&'static str] = &["ngram"];

    /// A method by name; an unknown name is [`EngineError::Param`] listing the known ones.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "ngram" => Ok(SpecMethod::Ngram),
            other => Err(EngineError::Param {
                name: "spec",
                message: format!(
                    "unknown method {other:?}; the methods are {}",
                    Self::NAMES.join(", ")
                ),
            }),
        }
    }
}

/// How many tokens each step drafts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftTokens {
    /// Exactly this many (fewer when the drafter has no more, or near the end of the
    /// context or of `max_tokens`).
    Fixed(usize),
    /// The length (0 to 16) that maximises the expected tokens per second, from running
    /// estimates of the chance that a draft is accepted (each draft after an accepted one,
    /// a geometric run) and of what a step costs per token fed (timed steps).
    Adaptive,
}

impl DraftTokens {
    /// `Fixed(k)` for `Some(k)` (checked: 1..=[`MAX_DRAFT_TOKENS`]), else adaptive.
    pub fn new(k: Option<usize>) -> Result<Self> {
        match k {
            None => Ok(DraftTokens::Adaptive),
            Some(k) if (1..=MAX_DRAFT_TOKENS).contains(&k) => Ok(DraftTokens::Fixed(k)),
            Some(k) => Err(EngineError::Param {
                name: "draft_tokens",
                message: format!(
                    "{k} tokens per step; draft 1 to {MAX_DRAFT_TOKENS} (or leave it out for the adaptive default)"
                ),
            }),
        }
    }
}

/// Whether a costly drafter drafts ahead on a free core while the target verifies
/// ([`Speculator::draft_ahead`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftAhead {
    /// When the drafter is costly and this process has a core its ranks leave free.
    #[default]
    Auto,
    On,
    Off,
}

impl DraftAhead {
    /// Every value's name, as [`DraftAhead::parse`] takes them.
    pub const NAMES: &'static [&'static str] = &["auto", "on", "off"];

    /// A value by name; an unknown one is [`EngineError::Param`] listing the known ones.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "auto" => Ok(DraftAhead::Auto),
            "on" => Ok(DraftAhead::On),
            "off" => Ok(DraftAhead::Off),
            other => Err(EngineError::Param {
                name: "draft_ahead",
                message: format!("{other:?}; give one of {}", Self::NAMES.join(", ")),
            }),
        }
    }

    /// On or off for a drafter (`costly`: [`Drafter::costly`]) in a process running
    /// `ranks_here` rank threads on `cores` cores.
    pub fn resolve(self, costly: bool, ranks_here: usize, cores: usize) -> bool {
        match self {
            DraftAhead::On => true,
            DraftAhead::Off => false,
            DraftAhead::Auto => costly && cores > ranks_here,
        }
    }
}

/// Proposes tokens likely to follow a sequence.
pub trait Drafter: Send {
    /// At most `k` tokens to follow `history` (the sequence's every token so far, prompt
    /// first). May return fewer, or none.
    fn draft(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>>;
    /// Whether drafting costs enough time to be worth doing ahead, on another core, while
    /// the target verifies ([`Speculator::draft_ahead`]): a model's forward steps do, a
    /// lookup does not.
    fn costly(&self) -> bool {
        false
    }
}

/// Makes one drafter per sequence: a server's requests each draft from their own text (and,
/// with a draft model, each keeps its own cache of it).
pub trait DrafterSource: Send + Sync {
    /// A drafter for a new sequence.
    fn drafter(&self) -> Result<Box<dyn Drafter>>;
    /// What drafts, for logs and figures (`ngram`, the draft model's file name).
    fn describe(&self) -> String;
}

impl DrafterSource for SpecMethod {
    fn drafter(&self) -> Result<Box<dyn Drafter>> {
        Ok(match self {
            SpecMethod::Ngram => Box::new(NgramDrafter),
        })
    }
    fn describe(&self) -> String {
        match self {
            SpecMethod::Ngram => "ngram".into(),
        }
    }
}

/// Prompt lookup: the last `n` tokens (n from [`NgramDrafter::MAX_N`] down to 1, longest
/// first) are searched for earlier in the history, latest occurrence first; the tokens that
/// followed that occurrence are the draft. Free to compute, and right exactly when the model
/// quotes or edits text it was given.
#[derive(Clone, Debug, Default)]
pub struct NgramDrafter;

impl NgramDrafter {
    /// Longest suffix matched.
    pub const MAX_N: usize = 4;
}

impl Drafter for NgramDrafter {
    fn draft(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>> {
        Ok(ngram_lookup(history, Self::MAX_N, k))
    }
}

/// The continuation (at most `k` tokens) of the latest earlier occurrence of the longest
/// suffix of `history` of at most `max_n` tokens that occurs earlier.
pub fn ngram_lookup(history: &[u32], max_n: usize, k: usize) -> Vec<u32> {
    let len = history.len();
    if k == 0 {
        return Vec::new();
    }
    for n in (1..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &history[len - n..];
        // Occurrences starting at `start`, ending before the suffix itself; latest first.
        for start in (0..len - n).rev() {
            if &history[start..start + n] == suffix {
                let from = start + n;
                let to = (from + k).min(len);
                return history[from..to].to_vec();
            }
        }
    }
    Vec::new()
}

/// What speculation did over a generation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// Target forward steps after the prompt (each verifies its drafts, if any).
    pub steps: usize,
    /// Steps that carried at least one draft.
    pub verify_steps: usize,
    /// Tokens drafted, all steps together.
    pub drafted: usize,
    /// Drafted tokens the target accepted.
    pub accepted: usize,
    /// Seconds spent drafting.
    pub draft_s: f64,
    /// Seconds of the target's decode steps (verifications included).
    pub target_s: f64,
    /// Steps that drafted nothing because the draft model's KV pool was full.
    pub kv_full: usize,
    /// Drafter errors (at most one per sequence: drafting stops after it).
    pub errors: usize,
    /// Drafts made ahead, while the target verified the drafts before them
    /// ([`Speculator::draft_ahead`]), and the steps that used them (every draft before was
    /// accepted and the target's next token was the one drafted).
    pub ahead: usize,
    pub ahead_used: usize,
    /// Seconds spent drafting ahead (beside the target's steps, not after them).
    pub ahead_s: f64,
}

impl SpecStats {
    /// Accepted drafts over drafted ones (0 when nothing was drafted).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// A drafter, its draft length and its counts, for one sequence at a time.
pub struct Speculator {
    drafter: Box<dyn Drafter>,
    tokens: DraftTokens,
    /// Whether the generation loop drafts ahead during verification steps.
    ahead_on: bool,
    /// The drafts made ahead during the last verification step, if any.
    ahead: Option<Ahead>,
    /// The adaptive policy's estimates.
    policy: Adaptive,
    /// Tokens before the generated ones: cached ones, then the prompt fed now.
    history: Vec<u32>,
    base: usize,
    pub stats: SpecStats,
    /// Why drafting stopped for this sequence (a drafter error), once stopped.
    stopped: Option<String>,
    /// Whether [`Speculator::take_failure`] gave `stopped` out already.
    told: bool,
}

impl std::fmt::Debug for Speculator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Speculator")
            .field("tokens", &self.tokens)
            .field("ahead_on", &self.ahead_on)
            .field("policy", &self.policy)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Speculator {
    pub fn new(drafter: Box<dyn Drafter>, tokens: DraftTokens) -> Self {
        Speculator {
            drafter,
            tokens,
            ahead_on: false,
            ahead: None,
            policy: Adaptive::default(),
            history: Vec::new(),
            base: 0,
            stats: SpecStats::default(),
            stopped: None,
            told: false,
        }
    }

    /// A speculator for `method`.
    pub fn for_method(method: SpecMethod, tokens: DraftTokens) -> Self {
        match method {
            SpecMethod::Ngram => Speculator::new(Box::new(NgramDrafter), tokens),
        }
    }

    /// A new sequence: `cached` tokens already in its cache, then `prompt` (fed now). The
    /// counts start again; an adaptive length carries over (the text tends to stay alike).
    pub fn start(&mut self, cached: &[u32], prompt: &[u32]) {
        self.history.clear();
        self.history.extend_from_slice(cached);
        self.history.extend_from_slice(prompt);
        self.base = self.history.len();
        self.ahead = None;
        self.stats = SpecStats::default();
        self.stopped = None;
        self.told = false;
    }

    /// At most `limit` drafts to follow the sequence after `generated`. Never fails: a
    /// drafter error gives no drafts (counted in [`SpecStats`]; see the module's text).
    pub fn draft(&mut self, generated: &[u32], limit: usize) -> Vec<u32> {
        let k = match self.tokens {
            DraftTokens::Fixed(k) => k,
            DraftTokens::Adaptive => self.policy.length(),
        }
        .min(limit);
        let ahead = self.ahead.take();
        if k == 0 || self.stopped.is_some() {
            return Vec::new();
        }
        if let Some(mut d) = ahead.and_then(|a| a.continuing(generated)) {
            // Drafted while the target verified: no time on this step's path.
            d.truncate(k);
            self.stats.ahead_used += 1;
            self.policy.observe_draft(d.len(), 0.0);
            return d;
        }
        self.history.truncate(self.base);
        self.history.extend_from_slice(generated);
        let t = std::time::Instant::now();
        let d = self.call_drafter(k);
        let seconds = t.elapsed().as_secs_f64();
        self.stats.draft_s += seconds;
        self.policy.observe_draft(d.len(), seconds);
        d
    }

    /// Drafts ahead, meant to run on another core while the target verifies `drafts` (fed
    /// after `generated`): the drafter continues as if every draft is accepted, guessing the
    /// target's next token and the next step's drafts after it (the next draft length plus
    /// one, at most `limit`). [`Speculator::draft`] uses them when the step went that way;
    /// otherwise they are dropped. Nothing happens unless drafting ahead is on
    /// ([`Speculator::set_draft_ahead`]) and `drafts` is not empty.
    pub fn draft_ahead(&mut self, generated: &[u32], drafts: &[u32], limit: usize) {
        self.ahead = None;
        if !self.ahead_on || drafts.is_empty() || self.stopped.is_some() {
            return;
        }
        let k = match self.tokens {
            DraftTokens::Fixed(k) => k,
            DraftTokens::Adaptive => self.policy.length().max(1),
        };
        let m = (k + 1).min(limit);
        if m < 2 {
            return;
        }
        self.history.truncate(self.base);
        self.history.extend_from_slice(generated);
        self.history.extend_from_slice(drafts);
        let t = std::time::Instant::now();
        let tokens = self.call_drafter(m);
        self.stats.ahead_s += t.elapsed().as_secs_f64();
        self.stats.ahead += 1;
        let mut assumed = generated.to_vec();
        assumed.extend_from_slice(drafts);
        self.ahead = Some(Ahead { assumed, tokens });
    }

    /// Whether drafting ahead is on: worth it when the drafter is costly
    /// ([`Drafter::costly`]) and a core is free while the target verifies.
    pub fn set_draft_ahead(&mut self, on: bool) {
        self.ahead_on = on;
        self.ahead = None;
    }

    /// Drafts expected to be accepted out of `k` (a run that ends at the first rejection,
    /// each draft accepted with the running estimate of the chance): `a + a^2 + .. + a^k`.
    pub fn expected_accepted(&self, k: usize) -> f64 {
        let a = self.policy.accept_rate();
        (1..=k).map(|j| a.powi(j as i32)).sum()
    }

    /// Steps since the last one that verified drafts (all steps before the first).
    pub fn steps_without_drafts(&self) -> usize {
        self.policy.idle
    }

    /// When the drafts would not pay, one step in this many still drafts (a probe).
    pub const PROBE_EVERY: usize = PROBE_EVERY;

    /// Whether this speculator's drafter is costly enough to draft ahead.
    pub fn drafter_is_costly(&self) -> bool {
        self.drafter.costly()
    }

    /// Whether the generation loop should call [`Speculator::draft_ahead`].
    pub fn drafts_ahead(&self) -> bool {
        self.ahead_on && self.stopped.is_none()
    }

    /// At most `k` drafts after `self.history`; trouble gives none (counted; an error stops
    /// drafting for the sequence).
    fn call_drafter(&mut self, k: usize) -> Vec<u32> {
        match self.drafter.draft(&self.history, k) {
            Ok(mut d) => {
                d.truncate(k);
                d
            }
            Err(EngineError::DraftKvFull { .. }) => {
                self.stats.kv_full += 1;
                Vec::new()
            }
            Err(e) => {
                self.stats.errors += 1;
                self.stopped = Some(crate::report::chain(&e));
                Vec::new()
            }
        }
    }

    /// Drafting stops for the rest of the sequence for `why` (a drafter that panicked on
    /// another thread).
    pub fn stop(&mut self, why: &str) {
        self.stats.errors += 1;
        self.ahead = None;
        self.stopped.get_or_insert_with(|| why.to_string());
    }

    /// Why drafting stopped for this sequence (a drafter error), the first time it is asked
    /// after the error (to log it once); `None` otherwise.
    pub fn take_failure(&mut self) -> Option<&str> {
        if self.told {
            return None;
        }
        self.told = self.stopped.is_some();
        self.stopped.as_deref()
    }

    /// One target step verified `drafted` tokens, of which the first `accepted` were kept;
    /// it took `seconds` (the forward pass of `1 + drafted` tokens).
    pub fn record(&mut self, drafted: usize, accepted: usize, seconds: f64) {
        self.stats.steps += 1;
        self.stats.target_s += seconds;
        self.policy.observe(drafted, accepted, seconds);
        if drafted == 0 {
            return;
        }
        self.stats.verify_steps += 1;
        self.stats.drafted += drafted;
        self.stats.accepted += accepted;
    }
}

/// Drafts made ahead: the generated tokens they assumed (ending with the drafts then being
/// verified), then the guess of the target's next token and the drafts to follow it.
#[derive(Clone, Debug)]
struct Ahead {
    assumed: Vec<u32>,
    tokens: Vec<u32>,
}

impl Ahead {
    /// The drafts for the step after `generated`, when it is what these assumed plus the
    /// guessed token; `None` otherwise (a draft was rejected or the guess was wrong).
    fn continuing(self, generated: &[u32]) -> Option<Vec<u32>> {
        let (&last, before) = generated.split_last()?;
        let (&guess, rest) = self.tokens.split_first()?;
        (before == self.assumed.as_slice() && last == guess && !rest.is_empty())
            .then(|| rest.to_vec())
    }
}

/// The adaptive draft length's running estimates.
#[derive(Clone, Debug, Default)]
struct Adaptive {
    /// Decayed counts of accepted drafts and of rejections (a run ends at a rejection).
    kept: f64,
    rejected: f64,
    /// Seconds of a one-token step, and per extra row of a verification step.
    step_s: Option<f64>,
    row_s: Option<f64>,
    /// Seconds of drafting per drafted token (about 0 for n-gram lookup).
    draft_s: Option<f64>,
    /// Steps since the last one that drafted.
    idle: usize,
}

impl Adaptive {
    /// The chance a draft is accepted (after the ones before it were): a prior of 1/2.
    fn accept_rate(&self) -> f64 {
        (self.kept + 1.0) / (self.kept + self.rejected + 2.0)
    }

    fn observe_draft(&mut self, drafted: usize, seconds: f64) {
        if drafted > 0 {
            let per = seconds / drafted as f64;
            self.draft_s = Some(self.draft_s.map_or(per, |d| d + EMA * (per - d)));
        }
    }

    fn observe(&mut self, drafted: usize, accepted: usize, seconds: f64) {
        if drafted == 0 {
            self.idle += 1;
            let t = self.step_s.map_or(seconds, |s| s + EMA * (seconds - s));
            self.step_s = Some(t);
            return;
        }
        self.idle = 0;
        let decay = 1.0 - EMA;
        self.kept = self.kept * decay + accepted as f64;
        self.rejected = self.rejected * decay + f64::from(u8::from(accepted < drafted));
        if let Some(step) = self.step_s {
            let row = ((seconds - step) / drafted as f64).max(0.0);
            self.row_s = Some(self.row_s.map_or(row, |r| r + EMA * (row - r)));
        }
    }

    /// The draft length with the most expected tokens per second: `(1 - a^(k+1)) / (1 - a)`
    /// tokens for a step costing `step + k (row + draft)`.
    fn length(&self) -> usize {
        let Some(step) = self.step_s else {
            return ADAPTIVE_START;
        };
        let row = self.row_s.unwrap_or(PRIOR_ROW_COST * step) + self.draft_s.unwrap_or(0.0);
        let a = self.accept_rate();
        let mut best = (1.0 / step, 0);
        let mut tokens = 1.0;
        let mut run = 1.0;
        for k in 1..=ADAPTIVE_MAX {
            run *= a;
            tokens += run;
            let rate = tokens / (step + row * k as f64);
            if rate > best.0 {
                best = (rate, k);
            }
        }
        if best.1 == 0 && self.idle >= PROBE_EVERY {
            return 1;
        }
        best.1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafting_ahead_is_on_for_a_costly_drafter_with_a_free_core() {
        assert!(DraftAhead::Auto.resolve(true, 1, 2));
        assert!(!DraftAhead::Auto.resolve(true, 2, 2));
        assert!(!DraftAhead::Auto.resolve(false, 1, 2));
        assert!(DraftAhead::On.resolve(false, 4, 2));
        assert!(!DraftAhead::Off.resolve(true, 1, 8));
        assert_eq!(DraftAhead::parse("on").ok(), Some(DraftAhead::On));
        let e = DraftAhead::parse("yes").unwrap_err().to_string();
        assert!(e.contains("auto, on, off"), "{e}");
    }

    /// Drafts made ahead are used only when the step went as they assumed.
    #[test]
    fn drafts_ahead_continue_only_the_assumed_sequence() {
        let a = || Ahead {
            assumed: vec![1, 2, 3],
            tokens: vec![4, 5, 6],
        };
        assert_eq!(a().continuing(&[1, 2, 3, 4]), Some(vec![5, 6]));
        // The target chose another token after the drafts, or rejected one of them.
        assert_eq!(a().continuing(&[1, 2, 3, 7]), None);
        assert_eq!(a().continuing(&[1, 2, 9]), None);
        assert_eq!(a().continuing(&[1, 2, 3, 4, 5]), None);
        // Only the guess, nothing after it: nothing to use.
        let short = Ahead {
            assumed: vec![1],
            tokens: vec![2],
        };
        assert_eq!(short.continuing(&[1, 2]), None);
    }

    #[test]
    fn lookup_continues_the_latest_longest_match() {
        // "a b c d | x b c e | ... b c": the suffix "b c" last occurred before "e".
        let h = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3];
        assert_eq!(ngram_lookup(&h, 4, 3), vec![5, 7, 2]);
        // A longer suffix wins over a later short one: "1 2" occurs once, followed by 3 4.
        let h = [1, 2, 3, 4, 2, 5, 1, 2];
        assert_eq!(ngram_lookup(&h, 4, 2), vec![3, 4]);
        // The continuation stops at the end of the history; no match, no draft.
        let h = [1, 2, 3, 1];
        assert_eq!(ngram_lookup(&h, 4, 8), vec![2, 3, 1]);
        assert!(ngram_lookup(&[1, 2, 3], 4, 3).is_empty());
        assert!(ngram_lookup(&[5], 4, 3).is_empty());
        assert!(ngram_lookup(&[5, 5], 4, 0).is_empty());
    }

    #[test]
    fn adaptive_length_follows_acceptance_and_cost() {
        let mut s = Speculator::new(Box::new(NgramDrafter), DraftTokens::Adaptive);
        s.start(&[], &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1]);
        // Before any step is timed: 4, bounded by the caller's limit.
        assert_eq!(s.draft(&[], 100), vec![2, 3, 4, 5]);
        assert_eq!(s.draft(&[], 2), vec![2, 3]);
        // One-token steps of 10 ms, cheap rows (1 ms) and every draft accepted: long drafts.
        s.record(0, 0, 0.010);
        for _ in 0..10 {
            s.record(8, 8, 0.018);
        }
        assert_eq!(s.draft(&[], 100).len(), 12);
        // Acceptance falls to about 1 in 4: short drafts.
        for _ in 0..20 {
            s.record(4, 1, 0.014);
        }
        let k = s.policy.length();
        assert!((1..=2).contains(&k), "{k}");
        // Expensive rows (as much as a step) and poor acceptance: no drafts, but a probe
        // of one token after 16 steps without.
        for _ in 0..20 {
            s.record(4, 0, 0.050);
        }
        assert_eq!(s.policy.length(), 0);
        for _ in 0..PROBE_EVERY {
            s.record(0, 0, 0.010);
        }
        assert_eq!(s.policy.length(), 1);
        assert_eq!(s.stats.steps, 1 + 10 + 20 + 20 + PROBE_EVERY);
        assert_eq!(s.stats.drafted, 80 + 80 + 80);
        assert_eq!(s.stats.accepted, 80 + 20);
        // Fixed: the length never changes.
        let mut f = Speculator::new(Box::new(NgramDrafter), DraftTokens::Fixed(2));
        f.start(&[1, 2, 3], &[1]);
        f.record(2, 0, 0.1);
        assert_eq!(f.draft(&[2], 100), vec![3, 1]);
    }

    #[test]
    fn bad_settings_name_the_parameter_and_the_valid_values() {
        for k in [0, MAX_DRAFT_TOKENS + 1] {
            let e = DraftTokens::new(Some(k)).unwrap_err();
            assert!(
                matches!(&e, EngineError::Param { name: "draft_tokens", message } if message.contains("1 to 32")),
                "{e}"
            );
        }
        assert_eq!(DraftTokens::new(Some(3)).unwrap(), DraftTokens::Fixed(3));
        assert_eq!(DraftTokens::new(None).unwrap(), DraftTokens::Adaptive);
        let e = SpecMethod::parse("medusa").unwrap_err();
        assert!(
            matches!(&e, EngineError::Param { name: "spec", message } if message.contains("ngram")),
            "{e}"
        );
        assert_eq!(SpecMethod::parse("ngram").unwrap(), SpecMethod::Ngram);
    }
}
