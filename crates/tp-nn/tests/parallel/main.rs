//! Integration tests of the parallel layers against single-device references, on the local
//! backend (Megatron §3: every parallel layer equals its dense counterpart).
//!
//! Tolerance: f32 results are compared with max |got - want| <= 1e-4 * max(max |want|, 1e-2).
//! The parallel path sums partial products in a different order (per-rank partial matmuls,
//! then a rank-ordered all-reduce), so errors of a few f32 ulps of the largest value (~1e-6
//! relative) are expected; 1e-4 leaves room for accumulation over hidden sizes up to ~100
//! while still catching any wrong slice, missing reduction or doubled gradient (errors of O(1)).

mod block;
mod layers;
mod support;
