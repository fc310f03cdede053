//! Choosing the next token from logits: greedy, temperature, top-k, top-p, with a seeded
//! generator so the same seed gives the same text on every run and at every tp.

use crate::candidates::order;
use crate::error::{EngineError, Result};
use tp_spec::Rng;

/// How to pick tokens. `temperature == 0` is greedy (the other fields are then ignored).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        }
    }

    /// Rejects values no sampler can honour, naming the parameter.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 || self.temperature > 100.0 {
            return Err(EngineError::Param {
                name: "temperature",
                message: format!("{} is not in [0, 100]; use 0 for greedy", self.temperature),
            });
        }
        if !self.top_p.is_finite() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(EngineError::Param {
                name: "top_p",
                message: format!("{} is not in (0, 1]", self.top_p),
            });
        }
        Ok(())
    }
}

/// A sampler for one sequence.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Scratch: (logit, id) candidates.
    candidates: Vec<(f32, u32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Sampler {
            rng: Rng::new(params.seed),
            params,
            candidates: Vec::new(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token for `logits [vocab]`. NaN logits are an error (a broken model), not a pick.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(EngineError::Internal("no logits to sample from".into()));
        }
        if logits.iter().any(|v| v.is_nan()) {
            return Err(EngineError::NanLogits);
        }
        if self.params.temperature == 0.0 {
            return Ok(argmax(logits));
        }
        let p = &self.params;
        self.candidates.clear();
        self.candidates
            .extend(logits.iter().enumerate().map(|(i, &l)| (l, i as u32)));
        let k = if p.top_k == 0 {
            logits.len()
        } else {
            p.top_k.min(logits.len())
        };
        if k < self.candidates.len() {
            self.candidates.select_nth_unstable_by(k - 1, order);
            self.candidates.truncate(k);
        }
        // Highest first, ties by id, so the order never depends on the selection algorithm.
        self.candidates.sort_unstable_by(order);
        Ok(self.pick())
    }

    /// Whether [`Sampler::sample_candidates`] can sample from the `k` most likely ids of a
    /// row: greedy, or top-k within `k` (a nucleus over the whole vocabulary needs the row).
    pub fn candidates_suffice(&self, k: usize) -> bool {
        let p = &self.params;
        p.temperature == 0.0 || (p.top_k > 0 && p.top_k <= k)
    }

    /// The next token from `top`, the most likely ids of a row of `vocab` logits (highest
    /// first, ties by id; at least `min(top_k, vocab)` of them): the token [`Sampler::sample`]
    /// draws from the whole row, for the same random state (it only ever looks at the top-k).
    pub fn sample_candidates(&mut self, top: &[(f32, u32)], vocab: usize) -> Result<u32> {
        let Some(&(_, first)) = top.first() else {
            return Err(EngineError::Internal("no candidates to sample from".into()));
        };
        if self.params.temperature == 0.0 {
            return Ok(first);
        }
        let k = self.params.top_k.min(vocab);
        if self.params.top_k == 0 || k > top.len() {
            return Err(EngineError::Internal(format!(
                "sampling the top {} of {vocab} ids from {} candidates",
                self.params.top_k,
                top.len()
            )));
        }
        self.candidates.clear();
        self.candidates.extend_from_slice(&top[..k]);
        Ok(self.pick())
    }

    /// Draws from `self.candidates` (sorted, at least one): temperature, then the nucleus.
    fn pick(&mut self) -> u32 {
        let p = &self.params;
        let max = self.candidates[0].0;
        let inv_t = 1.0 / p.temperature as f64;
        let mut probs: Vec<f64> = self
            .candidates
            .iter()
            .map(|(l, _)| ((*l - max) as f64 * inv_t).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        // Nucleus: the shortest prefix whose mass reaches top_p.
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, q) in probs.iter().enumerate() {
                acc += q / total;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        probs.truncate(keep);
        let total: f64 = probs.iter().sum();
        let mut u = self.rng.unit_f64() * total;
        for (i, q) in probs.iter().enumerate() {
            if u < *q {
                return self.candidates[i].1;
            }
            u -= q;
        }
        self.candidates[keep - 1].1
    }
}

/// Index of the largest logit (the lowest index among ties), in the order of `f32::total_cmp`
/// as the candidates of distributed sampling are ordered ([`order`]).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v.total_cmp(&logits[best]).is_gt() {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn greedy_picks_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]).unwrap(), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_bounds_the_choice() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 5,
            top_p: 1.0,
            seed: 42,
        };
        let run = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone()).unwrap();
            (0..50)
                .map(|_| s.sample(&logits).unwrap())
                .collect::<Vec<_>>()
        };
        let a = run(&params);
        assert_eq!(a, run(&params));
        // The 5 largest logits are 1.8 at ids 6, 13, 20, 27, 34 (ties broken by id).
        assert!(a.iter().all(|t| [6, 13, 20, 27, 34].contains(t)), "{a:?}");
        let b = run(&SamplingParams { seed: 43, ..params });
        assert_ne!(a, b);
    }

    #[test]
    fn top_p_keeps_the_nucleus_only() {
        // Probabilities ~0.88, 0.12, ~0: top_p 0.5 keeps only the first.
        let logits = [2.0f32, 0.0, -30.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            seed: 1,
        })
        .unwrap();
        for _ in 0..100 {
            assert_eq!(s.sample(&logits).unwrap(), 0);
        }
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // p = softmax([ln 3, 0]) = [0.75, 0.25].
        let logits = [3f32.ln(), 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 7,
        })
        .unwrap();
        let n = 20_000;
        let zeros = (0..n).filter(|_| s.sample(&logits).unwrap() == 0).count();
        let frac = zeros as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.015, "{frac}");
    }

    /// Pearson's chi-square statistic of `counts` against probabilities `p` (all > 0).
    pub(crate) fn chi_square(counts: &[usize], p: &[f64]) -> f64 {
        let n: usize = counts.iter().sum();
        counts
            .iter()
            .zip(p)
            .map(|(&c, &q)| {
                let e = q * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    #[test]
    fn bad_parameters_are_named() {
        for (p, name) in [
            (
                SamplingParams {
                    temperature: -1.0,
                    ..SamplingParams::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..SamplingParams::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..SamplingParams::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.5,
                    ..SamplingParams::default()
                },
                "top_p",
            ),
        ] {
            let e = Sampler::new(p).unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert!(matches!(
            s.sample(&[f32::NAN, 1.0]),
            Err(EngineError::NanLogits)
        ));
    }
}
