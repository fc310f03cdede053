//! Integration tests of the parallel layers against single-device references, on the local
//! backend (Megatron §3: every parallel layer equals its dense counterpart).
//!
//! Tolerance: f32 results are compared with max |got - want| <= 1e-5 * max(max |want|, 1e-2).
//! The parallel path sums partial products in a different order (per-rank partial matmuls,
//! then a rank-ordered all-reduce), so errors of a few f32 ulps of the largest value are
//! expected (every case here measured below 1e-6 relative); 1e-5 (~80 ulps) leaves room for
//! other SIMD paths while any wrong slice, missing reduction or doubled gradient gives
//! errors of O(1e-1..1) relative, which mutation runs confirmed fail these tests.

mod block;
mod end_to_end;
mod layers;
mod moe;
mod packing;
mod sequence;
mod support;
