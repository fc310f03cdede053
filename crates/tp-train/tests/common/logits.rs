//! The two forwards the training-vs-inference tests compare: the training model's (tp-nn
//! layers, candle autograd) and the inference engine's (tp-models kernels), on the same weights.

use candle_core::{Device, Tensor};
use tp_comm::local::{self, LocalOptions};
use tp_models::{open_checkpoint, Chunk, LoadOptions, Profile, ShardedModel};
use tp_train::init::WeightSource;
use tp_train::model::{StageInput, StageModel};
use tp_train::ModelConfig;

/// The training model's logits `[n, vocab]` for `tokens` at tp 1, built as `cfg` from
/// `weights`.
pub fn training_logits(
    cfg: &ModelConfig,
    weights: &(dyn WeightSource + Sync),
    tokens: &[u32],
) -> Vec<f32> {
    training_logits_biased(cfg, weights, &[], tokens)
}

/// [`training_logits`] with the MoE layers choosing experts with the aux-loss-free router
/// `bias` (`[layers][count]`; empty: none).
pub fn training_logits_biased(
    cfg: &ModelConfig,
    weights: &(dyn WeightSource + Sync),
    bias: &[Vec<f32>],
    tokens: &[u32],
) -> Vec<f32> {
    let out = local::run(1, LocalOptions::default(), |g| {
        let mut m = StageModel::new(cfg, 0, 1, 0, 1, weights)?;
        m.set_moe_bias(bias);
        let ids = Tensor::from_vec(tokens.to_vec(), (1, tokens.len()), &Device::Cpu)?; // [1, n]
        let h = m.hidden(StageInput::Tokens(&ids), &g)?; // [1, n, hidden]
        let logits = m
            .logits_local(&h, &g)?
            .ok_or_else(|| tp_train::TrainError::Config("a whole model has a head".into()))?; // [1, n, vocab]
        Ok::<_, tp_train::TrainError>(logits.flatten_all()?.to_vec1::<f32>()?)
    })
    .expect("world starts");
    out.into_iter()
        .next()
        .expect("one rank")
        .expect("no panic")
        .expect("training forward")
}

/// Inference logits `[n, vocab]` of every position of `tokens` at `tp`, from the model
/// file or directory at `path`.
pub fn inference_logits(path: &std::path::Path, tp: usize, tokens: &[u32]) -> Vec<f32> {
    let ckpt = open_checkpoint(path).expect("the model opens for inference");
    let out = local::run(tp, LocalOptions::default(), |g| {
        let m = ShardedModel::load(&*ckpt, g.rank(), tp, LoadOptions::default(), 64)?;
        let mut pool = m.new_pool();
        let mut table = m.new_table(64);
        let mut prof = Profile::default();
        let local = m.forward(
            &mut [Chunk {
                tokens,
                table: &mut table,
                all_logits: true,
            }],
            &mut pool,
            &g,
            &mut prof,
        )?; // [n, vocab_local]
        m.gather_logits(local, tokens.len(), &g, &mut prof) // [n, vocab]
    })
    .expect("world starts");
    out.into_iter()
        .next()
        .expect("rank 0")
        .expect("no panic")
        .expect("inference forward")
}

/// max |a - b| / max |b|.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit counts");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}
