//! Work on one row of logits besides sampling: OpenAI's presence and frequency penalties
//! ([`Penalties`], applied before the [`crate::Sampler`] sees the row) and log-probabilities
//! of the model's own distribution ([`log_softmax`], [`top_logprobs`]).
//!
//! Log-probabilities are computed from the raw logits (before penalties, temperature, top-k
//! or top-p), in f64 so that a row of 150k logits still sums to one within 1e-9.

use crate::candidates::{order, Candidates};
use crate::error::{EngineError, Result};
use std::collections::HashMap;

/// Presence and frequency penalties over the tokens a sequence generated so far (OpenAI's
/// definition): `logit[j] -= count[j] * frequency + (count[j] > 0) * presence`.
#[derive(Clone, Debug, Default)]
pub struct Penalties {
    presence: f32,
    frequency: f32,
    /// How often each generated id occurred.
    counts: HashMap<u32, u32>,
}

/// Largest magnitude of either penalty (OpenAI's range is [-2, 2]).
pub const MAX_PENALTY: f32 = 2.0;

impl Penalties {
    /// Penalties in `[-2, 2]`; anything else (NaN included) is refused, naming the parameter.
    pub fn new(presence: f32, frequency: f32) -> Result<Self> {
        for (name, v) in [
            ("presence_penalty", presence),
            ("frequency_penalty", frequency),
        ] {
            if !v.is_finite() || v.abs() > MAX_PENALTY {
                return Err(EngineError::Param {
                    name,
                    message: format!("{v} is not in [-2, 2]"),
                });
            }
        }
        Ok(Penalties {
            presence,
            frequency,
            counts: HashMap::new(),
        })
    }

    /// Whether [`Penalties::apply`] changes anything at all.
    pub fn is_active(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0
    }

    /// Counts one generated token.
    pub fn observe(&mut self, token: u32) {
        if self.is_active() {
            *self.counts.entry(token).or_insert(0) += 1;
        }
    }

    /// Penalizes `logits [vocab]` in place; ids beyond the row are ignored.
    pub fn apply(&self, logits: &mut [f32]) {
        if !self.is_active() {
            return;
        }
        for (&id, &n) in &self.counts {
            if let Some(l) = logits.get_mut(id as usize) {
                *l -= n as f32 * self.frequency + self.presence;
            }
        }
    }
}

/// Fractional bits of the fixed-point sum in [`exp_sum`].
const EXP_FRAC_BITS: i32 = 100;

/// `sum(exp(l - max))` over `logits` as a fixed-point integer with [`EXP_FRAC_BITS`]
/// fractional bits (`max` at least every logit, finite). Integer addition is associative, so
/// the sum is the same bits in any order and over any split of the row: a rank sums its
/// vocabulary shard and the shards' sums add up to the whole row's exactly (distributed
/// sampling, [`crate::candidates`]).
///
/// Precision: each term is `exp(x)` in f64 (relative error about 2^-53, as in a plain f64
/// sum), scaled by 2^100 and truncated, an absolute error below 2^-100 per term. The term of
/// the maximum is 1, so the sum is at least 1 and the truncations add a relative error below
/// `n * 2^-100` (2^-80 for 2^20 terms); the plain f64 sum's rounding grows with `n * 2^-53`
/// instead. Terms are at most 2^100, so 2^26 of them fit an i128 (2^126): a row of
/// up to 67M logits. Underflow: terms below e^-69 (2^-100) count as 0, far under the
/// rounding of the result.
pub fn exp_sum(logits: &[f32], max: f64) -> i128 {
    let scale = 2f64.powi(EXP_FRAC_BITS);
    logits
        .iter()
        .map(|&l| ((f64::from(l) - max).exp() * scale) as i128)
        .sum()
}

/// `max + ln(sum)` for a fixed-point `sum` from [`exp_sum`] (over the whole row, possibly
/// added up from shards).
pub fn lse_from_sum(max: f64, sum: i128) -> f64 {
    max + (sum as f64 * 2f64.powi(-EXP_FRAC_BITS)).ln()
}

/// `ln(sum(exp(logits)))`, in f64, shifted by the maximum so it never overflows; the sum is
/// the order-independent [`exp_sum`], so shards of a row give the same bits. NaN in, NaN out.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let mut max = f64::NEG_INFINITY;
    for &l in logits {
        if l.is_nan() {
            return f64::NAN;
        }
        max = max.max(f64::from(l));
    }
    if !max.is_finite() {
        // All -inf (or +inf somewhere): the shift would give NaN; the max is the answer.
        return max;
    }
    lse_from_sum(max, exp_sum(logits, max))
}

/// The log-probability of every id: `logit - log_sum_exp(logits)`.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let lse = log_sum_exp(logits);
    logits.iter().map(|&l| f64::from(l) - lse).collect()
}

/// The log-probabilities of one generated token: its own and those of the `k` most likely
/// ids (highest first, ties by id), all of the raw distribution of `logits`.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f64,
    pub top: Vec<(u32, f64)>,
}

/// Log-probabilities of `token` and of the `k` most likely ids of `logits [vocab]`. NaN logits
/// and a token outside the row are errors.
pub fn top_logprobs(logits: &[f32], token: u32, k: usize) -> Result<TokenLogprobs> {
    let Some(&chosen) = logits.get(token as usize) else {
        return Err(EngineError::Internal(format!(
            "token {token} is outside a row of {} logits",
            logits.len()
        )));
    };
    if logits.iter().any(|v| v.is_nan()) {
        return Err(EngineError::NanLogits);
    }
    let lse = log_sum_exp(logits);
    let k = k.min(logits.len());
    let mut top: Vec<(f32, u32)> = Vec::new();
    if k > 0 {
        // Highest first, ties by id: a total order, so the result never depends on the
        // selection algorithm.
        top = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (l, i as u32))
            .collect();
        if k < top.len() {
            top.select_nth_unstable_by(k - 1, order);
            top.truncate(k);
        }
        top.sort_unstable_by(order);
    }
    Ok(TokenLogprobs {
        token,
        logprob: f64::from(chosen) - lse,
        top: top
            .into_iter()
            .map(|(l, id)| (id, f64::from(l) - lse))
            .collect(),
    })
}

/// [`top_logprobs`] from a row's candidates (`token` among them, at least `k` of them unless
/// the row is shorter): the same bits, as the candidates are the row's top and its normalizer.
pub fn candidate_logprobs(c: &Candidates, token: u32, k: usize) -> Result<TokenLogprobs> {
    if c.nan {
        return Err(EngineError::NanLogits);
    }
    let Some(lse) = c.lse else {
        return Err(EngineError::Internal(
            "log-probabilities from candidates without the normalizer".into(),
        ));
    };
    let Some(&(chosen, _)) = c.top.iter().find(|t| t.1 == token) else {
        return Err(EngineError::Internal(format!(
            "token {token} is not among the {} candidates",
            c.top.len()
        )));
    };
    let k = k.min(c.vocab);
    if k > c.top.len() {
        return Err(EngineError::Internal(format!(
            "{k} alternatives asked of {} candidates",
            c.top.len()
        )));
    }
    Ok(TokenLogprobs {
        token,
        logprob: f64::from(chosen) - lse,
        top: c.top[..k]
            .iter()
            .map(|&(l, id)| (id, f64::from(l) - lse))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic row with a wide spread and repeated values.
    fn row(n: usize) -> Vec<f32> {
        let mut rng = tp_spec::Rng::new(0x2545_F491_4F6C_DD1D);
        (0..n)
            .map(|i| {
                let x = rng.below(4000);
                if i % 97 == 0 {
                    5.0
                } else {
                    x as f32 / 100.0 - 20.0
                }
            })
            .collect()
    }

    #[test]
    fn log_softmax_is_a_distribution() {
        for n in [1, 2, 1000, 151_936] {
            let lp = log_softmax(&row(n));
            let total: f64 = lp.iter().map(|l| l.exp()).sum();
            assert!((total - 1.0).abs() < 1e-9, "n={n}: {total}");
            assert!(lp.iter().all(|&l| l <= 0.0));
        }
        // Huge logits neither overflow nor lose the distribution.
        let lp = log_softmax(&[1000.0, 1000.0, f32::NEG_INFINITY]);
        assert!((lp[0] - 0.5f64.ln()).abs() < 1e-12);
        assert_eq!(lp[2], f64::NEG_INFINITY);
    }

    #[test]
    fn fixed_point_sum_matches_the_f64_sum_and_ignores_order() {
        for n in [1, 2, 1000, 151_936] {
            let r = row(n);
            let max = r
                .iter()
                .fold(f64::NEG_INFINITY, |m, &l| m.max(f64::from(l)));
            let plain: f64 = r.iter().map(|&l| (f64::from(l) - max).exp()).sum();
            let fixed = exp_sum(&r, max);
            let got = fixed as f64 * 2f64.powi(-EXP_FRAC_BITS);
            assert!(
                ((got - plain) / plain).abs() < 1e-12,
                "n={n}: {got} vs {plain}"
            );
            // Any split of the row adds up to the same integer.
            let split: i128 = r.chunks(n.div_ceil(3)).map(|c| exp_sum(c, max)).sum();
            assert_eq!(split, fixed, "n={n}");
            let mut reversed = r.clone();
            reversed.reverse();
            assert_eq!(exp_sum(&reversed, max), fixed, "n={n}");
        }
        assert!(log_sum_exp(&[1.0, f32::NAN]).is_nan());
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY; 3]), f64::NEG_INFINITY);
    }

    #[test]
    fn top_k_is_sorted_with_ties_by_id() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, 3.0, 0.5];
        let t = top_logprobs(&logits, 3, 4).unwrap();
        let ids: Vec<u32> = t.top.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, vec![1, 2, 4, 0]);
        let lp = log_softmax(&logits);
        assert_eq!(t.logprob, lp[3]);
        for &(id, l) in &t.top {
            assert_eq!(l, lp[id as usize]);
        }
        assert!(t.top.windows(2).all(|w| w[0].1 >= w[1].1));
        // k beyond the row, and k = 0.
        assert_eq!(top_logprobs(&logits, 0, 50).unwrap().top.len(), 6);
        assert!(top_logprobs(&logits, 0, 0).unwrap().top.is_empty());
        // On a big row the selection agrees with a full sort.
        let big = row(5000);
        let t = top_logprobs(&big, 7, 20).unwrap();
        let mut all: Vec<(f32, u32)> = big
            .iter()
            .enumerate()
            .map(|(i, &l)| (l, i as u32))
            .collect();
        all.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let want: Vec<u32> = all[..20].iter().map(|&(_, id)| id).collect();
        let got: Vec<u32> = t.top.iter().map(|&(id, _)| id).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn bad_rows_are_errors() {
        assert!(top_logprobs(&[0.0, 1.0], 2, 1).is_err());
        assert!(top_logprobs(&[f32::NAN, 1.0], 1, 1).is_err());
        assert!(top_logprobs(&[], 0, 0).is_err());
    }

    #[test]
    fn penalties_follow_openai() {
        let mut p = Penalties::new(0.5, 1.0).unwrap();
        for t in [2, 2, 5, 9] {
            p.observe(t);
        }
        let mut logits = vec![0.0f32; 6];
        p.apply(&mut logits);
        // id 2: twice (2 * 1.0 + 0.5); id 5: once (1.0 + 0.5); id 9 is outside the row.
        assert_eq!(logits, vec![0.0, 0.0, -2.5, 0.0, 0.0, -1.5]);
        // Negative penalties encourage repeats.
        let mut p = Penalties::new(-1.0, 0.0).unwrap();
        p.observe(1);
        p.observe(1);
        let mut logits = vec![0.0f32; 3];
        p.apply(&mut logits);
        assert_eq!(logits, vec![0.0, 1.0, 0.0]);
        // Zero penalties change nothing and count nothing.
        let mut p = Penalties::new(0.0, 0.0).unwrap();
        p.observe(0);
        assert!(!p.is_active() && p.counts.is_empty());
    }

    #[test]
    fn penalties_out_of_range_are_named() {
        for (pres, freq, name) in [
            (2.5, 0.0, "presence_penalty"),
            (0.0, -2.01, "frequency_penalty"),
            (f32::NAN, 0.0, "presence_penalty"),
            (0.0, f32::INFINITY, "frequency_penalty"),
        ] {
            let e = Penalties::new(pres, freq).unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
        assert!(Penalties::new(-2.0, 2.0).is_ok());
    }
}
