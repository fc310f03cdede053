//! Helpers of this crate's unit tests: deterministic random values, bitwise comparison.

/// Deterministic values in [-2, 2) from `seed`.
pub(crate) fn rng(mut seed: u64) -> impl FnMut() -> f32 {
    move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) * 4.0 - 2.0
    }
}

/// Whether `a` and `b` hold the same bits, value by value.
pub(crate) fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
