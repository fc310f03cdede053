//! GShard's expert capacity factor of a mixture of experts: how many of a step's tokens each
//! expert may take, and the (token, expert) pairs past it dropped in the step's token order;
//! the one rule inference (tp-models) and training (tp-nn) follow.

use crate::config::ModelConfig;
use thiserror::Error;

/// A capacity factor that cannot be used.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CapacityError {
    #[error("{0} is not a capacity factor; give a number above 0 (1 lets each expert take its even share of a step's tokens, 1.25 a quarter more)")]
    Invalid(String),
    #[error("a capacity factor of {0} was asked for, but the model has no experts (it is dense); leave it unset")]
    Dense(f64),
}

type Result<T> = std::result::Result<T, CapacityError>;

/// A capacity factor `f`: each expert takes at most `ceil(f x n x k / E)` (at least 1) of the
/// (token, expert) pairs a step of `n` tokens routes to it, first come first served. A
/// finite number above 0 (checked by [`CapacityFactor::new`]); 1 is each expert's even
/// share, 1.25 a quarter more.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CapacityFactor(f64);

// Never NaN (refused by `new`), so equality is an equivalence.
impl Eq for CapacityFactor {}

impl CapacityFactor {
    /// `factor` if it is a finite number above 0, else [`CapacityError::Invalid`].
    pub fn new(factor: f64) -> Result<Self> {
        if factor.is_finite() && factor > 0.0 {
            Ok(CapacityFactor(factor))
        } else {
            Err(CapacityError::Invalid(factor.to_string()))
        }
    }

    pub fn get(self) -> f64 {
        self.0
    }

    /// Pairs one of `count` experts may take of a step of `n` tokens with `per_token` experts
    /// each: `ceil(f x n x per_token / count)`, at least 1.
    pub fn capacity(self, n: usize, per_token: usize, count: usize) -> usize {
        let c = (self.0 * (n * per_token) as f64 / count.max(1) as f64).ceil();
        // Saturating: a huge factor is no capacity at all.
        (c as usize).max(1)
    }
}

impl std::str::FromStr for CapacityFactor {
    type Err = CapacityError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().parse::<f64>() {
            Ok(f) => CapacityFactor::new(f),
            Err(_) => Err(CapacityError::Invalid(format!("{s:?}"))),
        }
    }
}

/// A capacity factor asked of a model without experts is refused (it would change nothing and
/// says the user meant another model).
pub fn check_capacity(cfg: &ModelConfig, capacity: Option<CapacityFactor>) -> Result<()> {
    match capacity {
        Some(f) if cfg.experts.is_none() => Err(CapacityError::Dense(f.get())),
        _ => Ok(()),
    }
}

/// Drops from `routes` (`[n][k]` (expert, weight) pairs of a step, in token order) each
/// expert's pairs past `cap`: the first `cap` tokens routed to an expert keep it, the later
/// ones lose it (their other experts and weights unchanged). Returns the pairs dropped per
/// expert (`[count]`).
pub fn drop_over(routes: &mut [Vec<(usize, f32)>], cap: usize, count: usize) -> Vec<u64> {
    let mut taken = vec![0usize; count];
    let mut dropped = vec![0u64; count];
    for r in routes.iter_mut() {
        r.retain(|&(e, _)| {
            taken[e] += 1;
            let keep = taken[e] <= cap;
            if !keep {
                dropped[e] += 1;
            }
            keep
        });
    }
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_capacity_is_the_rounded_up_share_and_at_least_one() {
        let f = |x| CapacityFactor::new(x).unwrap();
        // 8 tokens, top-2 of 8 experts: an even share of 2.
        assert_eq!(f(1.0).capacity(8, 2, 8), 2);
        assert_eq!(f(1.25).capacity(8, 2, 8), 3);
        assert_eq!(f(0.5).capacity(8, 2, 8), 1);
        assert_eq!(f(0.01).capacity(1, 2, 8), 1);
        assert_eq!(f(1e300).capacity(8, 2, 8), usize::MAX);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(CapacityFactor::new(bad).is_err(), "{bad}");
        }
        assert!("x".parse::<CapacityFactor>().is_err());
        assert_eq!("1.5".parse::<CapacityFactor>().unwrap(), f(1.5));
    }

    #[test]
    fn later_tokens_lose_a_full_expert_and_keep_the_others() {
        let mut routes = vec![
            vec![(0, 0.6), (1, 0.4)],
            vec![(0, 0.7), (2, 0.3)],
            vec![(2, 0.5), (0, 0.5)],
        ];
        let dropped = drop_over(&mut routes, 1, 3);
        assert_eq!(dropped, [2, 0, 1]);
        assert_eq!(
            routes,
            vec![vec![(0, 0.6), (1, 0.4)], vec![(2, 0.3)], vec![]]
        );
    }
}
