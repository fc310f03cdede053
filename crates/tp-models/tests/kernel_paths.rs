//! The whole forward pass gives the same logits bit for bit on the portable kernels and on
//! the vector ones (products, attention, norms, SiLU, activation quantization): a host's
//! kernel path does not change its answers. Its own test binary: `force_scalar` is
//! process-wide, so it must not race other tests' kernel calls.

mod common;

use tp_models::{GgufCheckpoint, LoadOptions};

/// A 20-token prefill (the many-token kernels) then the same tokens one by one (per-group
/// kernels), at each of `tps`, portable against the CPU's own path.
fn same_bits_on_both_paths(path: &std::path::Path, tps: &[usize]) {
    let ckpt = GgufCheckpoint::open(path).unwrap();
    let tokens: Vec<u32> = (0..20).map(|i| 100 + 37 * i).collect();
    for &tp in tps {
        tp_kernels::force_scalar(false);
        let vector = common::sharded_logits(&ckpt, &tokens, tp, LoadOptions::default());
        tp_kernels::force_scalar(true);
        let scalar = common::sharded_logits(&ckpt, &tokens, tp, LoadOptions::default());
        tp_kernels::force_scalar(false);
        assert_eq!(vector.len(), scalar.len());
        for (row, (v, s)) in vector.iter().zip(&scalar).enumerate() {
            let same =
                v.len() == s.len() && v.iter().zip(s).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{}: tp {tp}, row {row}: the {} path and the portable one differ",
                path.display(),
                tp_kernels::kernel_path()
            );
        }
    }
}

/// One test, so that no other test of this binary runs while the kernels are switched.
/// SmolLM2 (in CI) at tp 1 and 2; Qwen2.5-Coder-0.5B where installed (Q5_0, Q8_0, Q4_K and
/// Q6_K products, a qkv bias) at tp 1.
#[test]
fn logits_are_the_same_bits_on_every_kernel_path() {
    if let Some(path) = common::smollm2() {
        same_bits_on_both_paths(&path, &[1, 2]);
    }
    if let Some(path) = common::qwen25() {
        same_bits_on_both_paths(&path, &[1]);
    }
}
