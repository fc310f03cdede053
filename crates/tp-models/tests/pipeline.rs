//! Pipeline stages give tp 1's bits: a layer does the same arithmetic on whichever rank holds
//! it, and the activations travel between stages as they are (f32, no conversion), so the
//! logits of a pp x tp layout equal the unpipelined tp 1 model's bit for bit. Checked on
//! synthetic models with an uneven layer count (5 layers: pp 2 and 3 split them unevenly;
//! tied and untied heads, Gemma-3's per-layer windows and RoPE bases, which a stage must
//! index by the model's layer), with explicit uneven layer splits, and on SmolLM2 where
//! installed.

mod common;

use common::Stepper;
use tp_comm::local::{self, LocalOptions};
use tp_models::checkpoint::GgmlDType;
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{
    open_checkpoint, world_plans, Arch, Checkpoint, Chunk, LoadOptions, ModelError, RankWeights,
    ShardedModel,
};

/// Logits of the prompt (every position) and of 3 decode steps at `pp` x `tp`, taken from
/// the last stage's tp rank 0, world rank 0 (the other stages return none).
fn logits(ckpt: &dyn Checkpoint, pp: usize, tp: usize, prompt: &[u32]) -> Vec<Vec<f32>> {
    let opts = LoadOptions {
        pipeline_stages: pp,
        ..LoadOptions::default()
    };
    logits_with(ckpt, opts, tp, prompt)
}

/// [`logits`] with `opts` (its `pipeline_stages` stages, split as it says).
fn logits_with(
    ckpt: &dyn Checkpoint,
    opts: LoadOptions,
    tp: usize,
    prompt: &[u32],
) -> Vec<Vec<f32>> {
    let pp = opts.pipeline_stages;
    let weights = RankWeights::even(tp);
    let out = local::run(pp * tp, LocalOptions::default(), |world| {
        let rank = world.rank();
        let (stage, tp_rank) = tp_spec::stage_of_rank(rank, tp, pp);
        let tp_group = world.split(Some(stage as u32), tp_rank).unwrap().unwrap();
        let pp_group = world.split(Some(tp_rank as u32), stage).unwrap().unwrap();
        let m = ShardedModel::load_weighted(ckpt, rank, &weights, opts, 64).unwrap();
        assert_eq!(m.stage().index, stage);
        let mut pool = m.new_pool();
        let mut prof = tp_models::Profile::default();
        let mut table = m.new_table(64);
        let mut rows = Vec::new();
        let steps: Vec<(Vec<u32>, bool)> = std::iter::once((prompt.to_vec(), true))
            .chain([7u32, 300, 42].map(|t| (vec![t], false)))
            .collect();
        for (tokens, all) in steps {
            let local = m
                .forward_stage(
                    &mut [Chunk {
                        tokens: &tokens,
                        table: &mut table,
                        all_logits: all,
                    }],
                    &mut pool,
                    &tp_group,
                    Some(&pp_group),
                    &mut prof,
                )
                .unwrap();
            if m.stage().is_last() {
                let n = if all { tokens.len() } else { 1 };
                rows.push(m.gather_logits(local, n, &tp_group, &mut prof).unwrap());
            } else {
                assert!(local.is_empty(), "stage {stage} returned logits");
            }
        }
        rows
    })
    .unwrap();
    out.into_iter().next().unwrap().unwrap()
}

/// Unpipelined tp 1.
fn reference(ckpt: &dyn Checkpoint, prompt: &[u32]) -> Vec<Vec<f32>> {
    local::run(1, LocalOptions::default(), |g| {
        let m = ShardedModel::load(ckpt, 0, 1, LoadOptions::default(), 64).unwrap();
        let mut step = Stepper::new(&m, &g);
        let mut cache = m.new_table(64);
        let mut rows = vec![step.logits(&mut cache, prompt, true)];
        for t in [7u32, 300, 42] {
            rows.push(step.logits(&mut cache, &[t], false));
        }
        rows
    })
    .unwrap()
    .remove(0)
    .unwrap()
}

fn assert_same_bits(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: step {step}");
        let differ = g
            .iter()
            .zip(w)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "{what}: step {step}: {differ} of {} logits differ",
            w.len()
        );
    }
}

fn assert_pipeline_invariant(ckpt: &dyn Checkpoint, what: &str, prompt: &[u32]) {
    let want = reference(ckpt, prompt);
    for (pp, tp) in [(2, 1), (3, 1), (2, 2)] {
        let got = logits(ckpt, pp, tp, prompt);
        assert_same_bits(&got, &want, &format!("{what}: pp {pp} x tp {tp}"));
    }
}

/// `SyntheticModel::small` with 5 layers.
fn five_layers(arch: Arch, seed: u64) -> SyntheticModel {
    let mut cfg = SyntheticModel::small(arch, seed).cfg;
    cfg.layers = 5;
    SyntheticModel::new(cfg, seed)
}

#[test]
fn synthetic_models_give_tp_1_bits_at_pp_2_3_and_2x2() {
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = vec![1, 17, 256, 999, 3, 512, 64, 8];
    use GgmlDType::*;
    for (i, (arch, linear, embed)) in [
        (Arch::Llama, Q4_1, Q8_0),
        (Arch::Qwen2, Q8_0, Q4_1),
        (Arch::Gemma3, Q8_0, Q8_0),
    ]
    .into_iter()
    .enumerate()
    {
        let path = dir.path().join(format!("p{i}.gguf"));
        five_layers(arch, 500 + i as u64)
            .write_gguf(&path, GgufTypes { linear, embed })
            .unwrap();
        let ckpt = open_checkpoint(&path).unwrap();
        // The stages really are uneven and cover the layers once.
        for pp in [2, 3] {
            let opts = LoadOptions {
                pipeline_stages: pp,
                ..LoadOptions::default()
            };
            let plans = world_plans(&*ckpt, &RankWeights::even(1), opts).unwrap();
            let lens: Vec<usize> = plans.iter().map(|p| p.stage.layers.len()).collect();
            assert_eq!(lens.iter().sum::<usize>(), 5, "{arch:?} pp {pp}: {lens:?}");
            assert!(lens.iter().min() < lens.iter().max(), "{lens:?}");
        }
        assert_pipeline_invariant(&*ckpt, &format!("{arch:?} GGUF {linear:?}"), &prompt);
    }
}

/// An explicit layer split (`--pp-layers`) gives the stages it names, as uneven as asked,
/// and the logits are still tp 1's bit for bit.
#[test]
fn explicit_uneven_layer_splits_give_their_stages_and_tp_1_bits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.gguf");
    five_layers(Arch::Qwen2, 77)
        .write_gguf(
            &path,
            GgufTypes {
                linear: GgmlDType::Q8_0,
                embed: GgmlDType::Q4_1,
            },
        )
        .unwrap();
    let ckpt = open_checkpoint(&path).unwrap();
    let prompt: Vec<u32> = vec![1, 17, 256, 999, 3, 512, 64, 8];
    let want = reference(&*ckpt, &prompt);
    for (counts, tp) in [("4,1", 1), ("1,4", 2), ("1,3,1", 1), ("3,1,1", 1)] {
        let split: tp_models::LayerCounts = counts.parse().unwrap();
        let opts = LoadOptions {
            pipeline_stages: split.len(),
            stage_split: tp_models::StageSplit::Layers(split),
            ..LoadOptions::default()
        };
        // World-rank order runs the last stage first: read the stages back first-first.
        let plans = world_plans(&*ckpt, &RankWeights::even(tp), opts).unwrap();
        let mut stages: Vec<(usize, usize)> = plans
            .iter()
            .step_by(tp)
            .map(|p| (p.stage.index, p.stage.layers.len()))
            .collect();
        stages.sort();
        let lens: Vec<String> = stages.iter().map(|(_, n)| n.to_string()).collect();
        assert_eq!(lens.join(","), counts);
        let got = logits_with(&*ckpt, opts, tp, &prompt);
        assert_same_bits(&got, &want, &format!("layers {counts} x tp {tp}"));
    }
}

#[test]
fn smollm2_gives_tp_1_bits_at_pp_2_3_and_2x2() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let ckpt = open_checkpoint(&path).unwrap();
    let prompt = [
        1u32, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308,
    ];
    assert_pipeline_invariant(&*ckpt, "SmolLM2 Q4_1", &prompt);
}

#[test]
fn more_stages_than_layers_is_refused_before_loading() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.gguf");
    five_layers(Arch::Llama, 9)
        .write_gguf(
            &path,
            GgufTypes {
                linear: GgmlDType::Q8_0,
                embed: GgmlDType::Q8_0,
            },
        )
        .unwrap();
    let ckpt = open_checkpoint(&path).unwrap();
    let opts = LoadOptions {
        pipeline_stages: 6,
        ..LoadOptions::default()
    };
    let e = ShardedModel::load_weighted(&*ckpt, 0, &RankWeights::even(1), opts, 64).unwrap_err();
    assert!(
        matches!(
            &e,
            ModelError::Shard(tp_spec::ShardError::InvalidPp { pp: 6, layers: 5 })
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("1 <= pp <= 5"), "{e}");
}

#[test]
fn a_stage_without_its_pipeline_group_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g.gguf");
    five_layers(Arch::Llama, 11)
        .write_gguf(
            &path,
            GgufTypes {
                linear: GgmlDType::Q8_0,
                embed: GgmlDType::Q8_0,
            },
        )
        .unwrap();
    let ckpt = open_checkpoint(&path).unwrap();
    let opts = LoadOptions {
        pipeline_stages: 2,
        ..LoadOptions::default()
    };
    local::run(1, LocalOptions::default(), |g| {
        let m = ShardedModel::load_weighted(&*ckpt, 0, &RankWeights::even(1), opts, 64).unwrap();
        let mut pool = m.new_pool();
        let mut table = m.new_table(64);
        let e = m
            .forward(
                &mut [Chunk {
                    tokens: &[1, 2],
                    table: &mut table,
                    all_logits: false,
                }],
                &mut pool,
                &g,
                &mut Default::default(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("pipeline group"), "{e}");
        // The failed pass left the cache as it was.
        assert_eq!(table.len(), 0);
    })
    .unwrap();
}
