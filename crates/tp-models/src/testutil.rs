//! Helpers of this crate's unit tests: deterministic random values, bitwise comparison.

/// Deterministic values in [-2, 2) from `seed`.
pub(crate) fn rng(seed: u64) -> impl FnMut() -> f32 {
    let mut rng = tp_spec::Rng::new(seed);
    move || rng.uniform(-2.0, 2.0)
}

/// Whether `a` and `b` hold the same bits, value by value.
pub(crate) fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
