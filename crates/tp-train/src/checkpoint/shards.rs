//! Moving between a tensor's global layout and one rank's shard of it (docs/design.md "Loading":
//! checkpoints hold global shapes, so any tp can slice its part).

use std::ops::Range;
use tp_nn::Placement;

/// `(outer, extent, inner)` of `shape` around `dim`.
fn around(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    (
        shape[..dim].iter().product(),
        shape[dim],
        shape[dim + 1..].iter().product(),
    )
}

/// This rank's shard of the global row-major `data` of `shape`.
pub fn slice_global(data: &[f32], shape: &[usize], placement: &Placement) -> Vec<f32> {
    match placement {
        Placement::Replicated => data.to_vec(),
        Placement::Sharded { dim, range } => {
            let (outer, extent, inner) = around(shape, *dim);
            let mut out = Vec::with_capacity(outer * range.len() * inner);
            for o in 0..outer {
                let base = o * extent * inner;
                out.extend_from_slice(&data[base + range.start * inner..base + range.end * inner]);
            }
            out
        }
    }
}

/// Writes a rank's shard `local` into the global row-major buffer `global` of `shape`.
pub fn place_local(global: &mut [f32], shape: &[usize], placement: &Placement, local: &[f32]) {
    match placement {
        Placement::Replicated => global.copy_from_slice(local),
        Placement::Sharded { dim, range } => {
            let (outer, extent, inner) = around(shape, *dim);
            let run = range.len() * inner;
            for o in 0..outer {
                let dst = o * extent * inner + range.start * inner;
                global[dst..dst + run].copy_from_slice(&local[o * run..(o + 1) * run]);
            }
        }
    }
}

/// The element range of a placement along its dim (the whole extent when replicated).
pub fn index_range(shape: &[usize], placement: &Placement) -> Range<usize> {
    match placement {
        Placement::Replicated => 0..shape.first().copied().unwrap_or(1),
        Placement::Sharded { range, .. } => range.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_tile_back_into_the_global_tensor() {
        let shape = [4, 6];
        let data: Vec<f32> = (0..24).map(|x| x as f32).collect();
        for dim in 0..2 {
            let cuts = [0..1, 1..3, 3..shape[dim]];
            let mut rebuilt = vec![0f32; 24];
            for r in cuts {
                let p = Placement::Sharded { dim, range: r };
                let local = slice_global(&data, &shape, &p);
                place_local(&mut rebuilt, &shape, &p, &local);
            }
            assert_eq!(rebuilt, data, "dim {dim}");
        }
        let cols = slice_global(
            &data,
            &shape,
            &Placement::Sharded {
                dim: 1,
                range: 2..4,
            },
        );
        assert_eq!(cols, vec![2., 3., 8., 9., 14., 15., 20., 21.]);
    }
}
