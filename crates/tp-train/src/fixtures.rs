//! The small model, corpus slice and run settings that the tests and the MPI check share:
//! 4 heads (2 KV heads), FFN 64 and a 256-byte vocabulary, so tp 3 splits heads 2/1/1 with a
//! KV head held by two ranks, FFN 22/21/21 and vocabulary 86/85/85; 4 layers for pp up to 4.
//! The same sizes as a Qwen2 ([`qwen2_model`], [`qwen2_spec`]) add the Q/K/V biases; as a
//! Qwen3 ([`qwen3_model`], [`qwen3_spec`]) the per-head q/k norms;
//! as a Gemma-3 ([`gemma3_model`], [`gemma3_spec`]) they have one KV head (tp 2..4 above it),
//! Gemma's block and a window of 6 positions on layers 0 and 2 (sequences of 16); as a
//! Mixtral ([`moe_model`], [`moe_spec`]) every MLP is a mixture of 4 experts, top-2.
//! [`documents`] are short documents of unequal lengths to pack.

use crate::config::{ModelConfig, TrainModel};
use crate::data::{Corpus, DEFAULT_CORPUS};
use crate::error::Result;
use crate::optim::AdamWConfig;
use crate::trainer::TrainSpec;
use tp_comm::ParallelDims;

pub fn model() -> ModelConfig {
    crate::config::llama(256, 32, 64, 4, 4, 2, 8, 64)
}

/// [`model`] as a Qwen2: biases on Q, K and V.
pub fn qwen2_model() -> ModelConfig {
    model()
        .with_arch(tp_spec::Arch::Qwen2)
        .expect("Qwen2 is trainable")
}

/// [`model`] as a Qwen3: an RMSNorm over each query and key head.
pub fn qwen3_model() -> ModelConfig {
    ModelConfig {
        arch: tp_spec::Arch::Qwen3,
        qk_norm: true,
        ..model()
    }
}

/// [`model`] as a Gemma-3 (its block, q/k norms, one KV head): layers 0 and 2 attend through
/// a window of 6 positions with RoPE base 10^4, layers 1 and 3 globally with base 10^6 and
/// positions scaled by 2; queries scaled by 1/4 (not 1/sqrt(8)).
pub fn gemma3_model() -> ModelConfig {
    let mut m = model()
        .with_arch(tp_spec::Arch::Gemma3)
        .expect("Gemma-3 is trainable");
    m.kv_heads = 1;
    if let Some(s) = m.block.sliding.as_mut() {
        s.window = 6;
    }
    m.block.rope_scale = 2.0;
    m.block.query_scale = Some(0.25);
    m
}

/// [`model`] as a Mixtral: every MLP a mixture of 4 experts of FFN 64, top-2 with
/// normalised weights (a softmax router).
pub fn moe_model() -> ModelConfig {
    model().with_experts(Some(tp_spec::Experts::new(4, 2)))
}

/// The first 40 KB of the built-in corpus as bytes, windows of 16 tokens.
pub fn corpus() -> Result<Corpus> {
    let text = &DEFAULT_CORPUS[..40_000];
    Corpus::new(text.iter().map(|&b| u32::from(b)).collect(), 16, 7)
}

/// `count` documents of the built-in corpus as bytes, of unequal lengths 3..=17 (a window
/// of [`corpus`]'s sequences of 16 holds one of 17), each with its first third out of the
/// loss (a prompt) and the rest in it (a reply): data to pack ([`Corpus::packed`]).
pub fn documents(count: usize) -> Vec<(Vec<u32>, Vec<bool>)> {
    const LENGTHS: [usize; 11] = [17, 5, 9, 12, 3, 7, 11, 4, 6, 14, 8];
    let mut at = 0;
    (0..count)
        .map(|i| {
            let len = LENGTHS[i % LENGTHS.len()];
            let ids = DEFAULT_CORPUS[at..at + len]
                .iter()
                .map(|&b| u32::from(b))
                .collect();
            at += len;
            (ids, (0..len).map(|k| k >= len / 3).collect())
        })
        .collect()
}

/// 60 of [`documents`] packed into windows of 17 tokens (sequences of 16, as [`corpus`]).
pub fn packed_corpus() -> Result<Corpus> {
    Corpus::packed(&documents(60), 16, 0, 7)
}

/// A run of `steps` steps of 4 sequences at `dims` with `micro_batches` per replica.
pub fn spec(dims: ParallelDims, steps: u64, micro_batches: usize) -> TrainSpec {
    TrainSpec {
        model: model(),
        dims,
        steps,
        global_batch: 4,
        micro_batches,
        virtual_stages: 1,
        seq: 16,
        seed: 5,
        optim: AdamWConfig {
            lr: 1e-2,
            min_lr: 1e-3,
            warmup_steps: 3,
            ..AdamWConfig::default()
        },
        bucket_elems: 5000,
        distributed_optimizer: false,
        moe_aux_coef: crate::trainer::DEFAULT_MOE_AUX_COEF,
        ep: 1,
        moe_capacity: None,
        moe_bias_rate: None,
        sequence_parallel: false,
        recompute: crate::Recompute::None,
        pack: false,
        save_dir: None,
        save_every: 0,
        keep: 0,
        data_name: "test corpus".into(),
        val_every: 0,
    }
}

/// [`spec`] with [`qwen2_model`].
pub fn qwen2_spec(dims: ParallelDims, steps: u64, micro_batches: usize) -> TrainSpec {
    TrainSpec {
        model: qwen2_model(),
        ..spec(dims, steps, micro_batches)
    }
}

/// [`spec`] with [`qwen3_model`].
pub fn qwen3_spec(dims: ParallelDims, steps: u64, micro_batches: usize) -> TrainSpec {
    TrainSpec {
        model: qwen3_model(),
        ..spec(dims, steps, micro_batches)
    }
}

/// [`spec`] with [`moe_model`].
pub fn moe_spec(dims: ParallelDims, steps: u64, micro_batches: usize) -> TrainSpec {
    TrainSpec {
        model: moe_model(),
        ..spec(dims, steps, micro_batches)
    }
}

/// [`spec`] with [`gemma3_model`].
pub fn gemma3_spec(dims: ParallelDims, steps: u64, micro_batches: usize) -> TrainSpec {
    TrainSpec {
        model: gemma3_model(),
        ..spec(dims, steps, micro_batches)
    }
}
