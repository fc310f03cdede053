//! The Q/K row orders of the two RoPE layouts: llama.cpp's converter permutes each head's
//! rows of a Llama's Q and K projections so that rotated pairs are adjacent (interleaved
//! layout); HF checkpoints keep rotate-half pairs `i` and `i + hd/2`. Moving rows between
//! them is how a GGUF Llama becomes an HF one (fine-tuning) and back (synthetic files).

/// llama.cpp's Q/K permutation (`convert_hf_to_gguf.py`): within each head, HF row
/// `j * hd/2 + i` (rotate-half pairs i and i + hd/2) becomes row `2i + j` (adjacent pairs).
/// `values` is `shape[0]` rows of `shape[1]` (or a vector, one value a row).
pub fn permute_rows_for_interleaved(values: &[f32], shape: &[usize], head_dim: usize) -> Vec<f32> {
    let half = head_dim / 2;
    move_rows(values, shape, head_dim, |within| {
        let (j, i) = (within / half, within % half);
        2 * i + j
    })
}

/// The inverse of [`permute_rows_for_interleaved`]: file row `2i + j` of a head back to HF
/// row `j * hd/2 + i`.
pub fn unpermute_rows(values: &[f32], shape: &[usize], head_dim: usize) -> Vec<f32> {
    let half = head_dim / 2;
    move_rows(values, shape, head_dim, |within| {
        let (i, j) = (within / 2, within % 2);
        j * half + i
    })
}

/// `values` (`shape[0]` rows of `shape[1]`, or a vector) with row `within` of each head of
/// `head_dim` rows moved to row `dst(within)` of the same head.
fn move_rows(
    values: &[f32],
    shape: &[usize],
    head_dim: usize,
    dst: impl Fn(usize) -> usize,
) -> Vec<f32> {
    let rows = shape.first().copied().unwrap_or(0);
    let cols = if shape.len() > 1 { shape[1] } else { 1 };
    let mut out = vec![0f32; values.len()];
    for r in 0..rows.min(values.len() / cols.max(1)) {
        let (head, within) = (r / head_dim, r % head_dim);
        let to = head * head_dim + dst(within);
        out[to * cols..(to + 1) * cols].copy_from_slice(&values[r * cols..(r + 1) * cols]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_moves_are_inverse_and_pair_rotate_half_rows() {
        // Two heads of 4 rows, 2 columns: row r holds (r, r).
        let v: Vec<f32> = (0..8).flat_map(|r| [r as f32, r as f32]).collect();
        let p = permute_rows_for_interleaved(&v, &[8, 2], 4);
        // HF rows 0 and 2 (a rotate-half pair of head 0) become adjacent rows 0 and 1.
        let rows: Vec<f32> = p.chunks(2).map(|c| c[0]).collect();
        assert_eq!(rows, [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        assert_eq!(unpermute_rows(&p, &[8, 2], 4), v);
        let bias: Vec<f32> = (0..8).map(|r| r as f32).collect();
        assert_eq!(
            unpermute_rows(&permute_rows_for_interleaved(&bias, &[8], 4), &[8], 4),
            bias
        );
    }
}
