//! What a kernel call on one 8-row group leaves for the driver: results for a tile of up to
//! `MAX_TILE` tokens, f32 outputs (`matmul`) or f64 sums (`matmul_wide_acc`).

use crate::pack::GROUP_ROWS;

/// Most tokens one kernel call handles: each weight block is unpacked once per tile.
pub(crate) const MAX_TILE: usize = 4;

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
