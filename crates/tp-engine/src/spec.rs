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

/// Proposes tokens likely to follow a sequence.
pub trait Drafter: Send {
    /// At most `k` tokens to follow `history` (the sequence's every token so far, prompt
    /// first). May return fewer, or none.
    fn draft(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>>;
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
        if k == 0 || self.stopped.is_some() {
            return Vec::new();
        }
        self.history.truncate(self.base);
        self.history.extend_from_slice(generated);
        let t = std::time::Instant::now();
        let drafted = self.drafter.draft(&self.history, k);
        let seconds = t.elapsed().as_secs_f64();
        self.stats.draft_s += seconds;
        let mut d = match drafted {
            Ok(d) => d,
            Err(EngineError::DraftKvFull { .. }) => {
                self.stats.kv_full += 1;
                return Vec::new();
            }
            Err(e) => {
                self.stats.errors += 1;
                self.stopped = Some(crate::report::chain(&e));
                return Vec::new();
            }
        };
        d.truncate(k);
        self.policy.observe_draft(d.len(), seconds);
        d
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
