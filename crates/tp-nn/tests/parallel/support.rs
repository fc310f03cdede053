//! Shared test helpers: running a local world, comparing tensors, assembling shards.

use candle_core::{Device, Tensor};
use tp_comm::local::{run, LocalOptions};
use tp_comm::Group;
use tp_nn::Placement;

pub const TOL: f32 = 1e-5;

pub fn dev() -> Device {
    Device::Cpu
}

/// Runs `f` on `tp` rank threads and returns each rank's value; panics with the rank's error.
pub fn world<R: Send>(tp: usize, f: impl Fn(Group) -> Result<R, tp_nn::TpError> + Sync) -> Vec<R> {
    let outs = run(tp, LocalOptions::default(), |g| {
        f(g).map_err(|e| e.to_string())
    })
    .expect("world starts");
    outs.into_iter()
        .enumerate()
        .map(|(r, o)| match o {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => panic!("rank {r} failed: {e}"),
            Err(p) => panic!("rank {r} panicked: {p}"),
        })
        .collect()
}

pub fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Fails with a message naming `what` when `got` and `want` differ by more than the tolerance.
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    assert_close_tol(what, got, want, TOL);
}

/// [`assert_close`] with relative tolerance `tol`.
pub fn assert_close_tol(what: &str, got: &Tensor, want: &Tensor, tol: f32) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let scale = max_abs(want).max(1e-2);
    let err = max_abs(&(got - want).unwrap());
    assert!(
        err <= tol * scale,
        "{what}: max error {err:e} exceeds {tol:e} * {scale:e}"
    );
}

/// `local` placed into zeros of `global_dims` (or returned as is when replicated).
pub fn embed(local: &Tensor, global_dims: &[usize], place: &Placement) -> Tensor {
    match place {
        Placement::Replicated => local.clone(),
        Placement::Sharded { dim, range } => {
            let mut parts = Vec::new();
            let mut before = global_dims.to_vec();
            before[*dim] = range.start;
            let mut after = global_dims.to_vec();
            after[*dim] = global_dims[*dim] - range.end;
            if range.start > 0 {
                parts.push(Tensor::zeros(before, local.dtype(), local.device()).unwrap());
            }
            parts.push(local.clone());
            if range.end < global_dims[*dim] {
                parts.push(Tensor::zeros(after, local.dtype(), local.device()).unwrap());
            }
            Tensor::cat(&parts, *dim).unwrap()
        }
    }
}
