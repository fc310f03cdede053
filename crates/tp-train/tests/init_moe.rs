//! Fine-tuning starts from a mixture of experts too (issues 33 and 34): a Mixtral GGUF (one
//! tensor per expert, interleaved RoPE rows) and a Qwen3-MoE GGUF (merged 3-D expert
//! tensors) open as training's initial weights (`tp train --init`), and the training forward
//! (tp-nn's layers: candle f32, router softmax in f32, tokens grouped by expert) gives the
//! inference engine's logits on the same file (tp-models: its own kernels, router in f64) at
//! tp 1 and tp 2, within 1e-4 of the largest logit: f32 summation order, and a top-2 choice
//! that flips only if two router probabilities tie within ~1e-7 (none does in these files).
//! Reading the experts in another order, or dropping the RoPE row permutation, moves the
//! logits by far more.

use candle_core::{Device, Tensor};
use tp_comm::local::{self, LocalOptions};
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{open_checkpoint, Chunk, LoadOptions, Profile, ShardedModel};
use tp_spec::Arch;
use tp_train::model::{StageInput, StageModel};
use tp_train::Pretrained;

const TOKENS: [u32; 9] = [1, 17, 256, 999, 3, 512, 64, 8, 700];

/// The training model's logits `[n, vocab]` at tp 1, its weights from `init`.
fn training_logits(init: &Pretrained) -> Vec<f32> {
    let out = local::run(1, LocalOptions::default(), |g| {
        let m = StageModel::new(&init.config, 0, 1, 0, 1, init)?;
        let ids = Tensor::from_vec(TOKENS.to_vec(), (1, TOKENS.len()), &Device::Cpu)?; // [1, n]
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

/// Inference logits `[n, vocab]` of every position at `tp`, from the file (f32 weights).
fn inference_logits(path: &std::path::Path, tp: usize) -> Vec<f32> {
    let ckpt = open_checkpoint(path).expect("the file opens for inference");
    let out = local::run(tp, LocalOptions::default(), |g| {
        let m = ShardedModel::load(&*ckpt, g.rank(), tp, LoadOptions::default(), 64)?;
        let mut pool = m.new_pool();
        let mut table = m.new_table(64);
        let mut prof = Profile::default();
        let local = m.forward(
            &mut [Chunk {
                tokens: &TOKENS,
                table: &mut table,
                all_logits: true,
            }],
            &mut pool,
            &g,
            &mut prof,
        )?; // [n, vocab_local]
        m.gather_logits(local, TOKENS.len(), &g, &mut prof) // [n, vocab]
    })
    .expect("world starts");
    out.into_iter()
        .next()
        .expect("rank 0")
        .expect("no panic")
        .expect("inference forward")
}

/// max |a - b| / max |b|.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit counts");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn moe_files_open_as_initial_weights_and_train_on_inference_logits() {
    let dir = tempfile::tempdir().unwrap();
    for (arch, merged) in [(Arch::Llama, false), (Arch::Qwen3, true)] {
        let mut model = SyntheticModel::small_moe(arch, 8, 2, 21);
        model.merged_experts = merged;
        let path = dir.path().join(format!("{arch:?}.gguf"));
        model.write_gguf(&path, GgufTypes::F32).unwrap();
        let init = Pretrained::open(&path).expect("an MoE file is trainable");
        assert_eq!(init.config.experts.map(|e| e.count), Some(8));
        let want = training_logits(&init);
        for tp in [1, 2] {
            let d = rel_diff(&inference_logits(&path, tp), &want);
            eprintln!("{arch:?} (merged {merged}) at tp {tp}: max relative difference {d:.2e}");
            assert!(
                d <= 1e-4,
                "{arch:?} tp {tp}: training and inference differ by {d:e}"
            );
        }
    }
}
