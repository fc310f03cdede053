//! What a kernel call on one 8-row group leaves for the driver: results for a tile of up to
//! `MAX_TILE` tokens, f32 outputs (`matmul`) or f64 sums (`matmul_wide_acc`); and the
//! benchmarks' switch back to the kernels' previous schedule.

use crate::pack::GROUP_ROWS;
use std::sync::atomic::{AtomicBool, Ordering};

/// Most tokens one kernel call handles: each weight block is unpacked once per tile, or (AVX2:
/// Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K; from 5 tokens) once per product. Tiles of 8 were tried on AVX2: the 16 vector
/// registers then hold neither the tokens' accumulators nor their partial sums, and the
/// spills cost more than the shared unpacking saves.
pub(crate) const MAX_TILE: usize = 4;

static LEGACY: AtomicBool = AtomicBool::new(false);

/// Benchmarks only: `true` makes later products run as before the AVX2 kernels unpacked a
/// group's weights once per product (they unpack them again for every tile of tokens),
/// `false` switches back. Results are the same bits either way: a token's outputs never
/// depend on its tile or on where its weights were unpacked.
#[doc(hidden)]
pub fn legacy_tiles(on: bool) {
    LEGACY.store(on, Ordering::Relaxed);
}

/// Whether [`legacy_tiles`] is on.
pub(crate) fn legacy() -> bool {
    LEGACY.load(Ordering::Relaxed)
}

/// One group's results for a tile of tokens: `f32s[t]` from `matmul`'s kernels (the outputs
/// of token `t`), or `f64s[t]` from the wide ones (the f64 sums to add to `y`).
#[derive(Clone, Copy, Default)]
pub(crate) struct TileOut {
    pub f32s: [[f32; GROUP_ROWS]; MAX_TILE],
    pub f64s: [[f64; GROUP_ROWS]; MAX_TILE],
}

/// Which product a kernel call forms: `matmul`'s f32 outputs, `matmul_wide_acc`'s f64 sums of
/// per-block contributions, or (K-quant matrices built by `QuantMatrix::from_ggml_sub_blocks`)
/// f64 sums of per-32-wide-sub-block contributions against per-sub-block activation scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Form {
    F32,
    Wide,
    WideSub,
}

impl Form {
    /// Whether the results go to `TileOut::f64s`.
    pub(crate) fn wide(self) -> bool {
        self != Form::F32
    }
}
