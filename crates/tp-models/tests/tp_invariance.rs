//! R10: the logits do not depend on tp. Row-parallel products sum their blocks in f64 and the
//! ranks' partial sums are added in f64, so tp 2, 3 and 4 give the SAME BITS as tp 1 whenever
//! every shard boundary falls on a quant block (32-element formats, dense weights split at
//! 32-column chunks) — on synthetic models of every such type and on the real SmolLM2. Weighted
//! shards (`ShardPlan::weighted`: rank weights 2,1, 1,2, 3,2,1, ...) keep those boundaries, so
//! they give the same bits too. K-quant shards that cut 256-wide super-blocks at multiples of
//! 32 columns stay quantized in the sub-block form and give the same bits as well.

mod common;

use common::Stepper;
use tp_comm::local::{self, LocalOptions};
use tp_models::checkpoint::GgmlDType;
use tp_models::synthetic::{GgufTypes, HfDType, SyntheticModel};
use tp_models::{
    open_checkpoint, rank_memory, Arch, Checkpoint, CheckpointPlan, KvDtype, LoadOptions,
    RankWeights, ShardPlan, ShardedModel,
};

/// Full logits of a prompt (every position) and of 3 decode steps, at `tp` (balanced shards).
fn logits(ckpt: &dyn Checkpoint, tp: usize, prompt: &[u32]) -> Vec<Vec<f32>> {
    logits_with(ckpt, tp, None, prompt, KvDtype::F32)
}

/// [`logits`] with shards in proportion to `weights` when given (`tp` = their count) and a
/// `kv` cache.
fn logits_with(
    ckpt: &dyn Checkpoint,
    tp: usize,
    weights: Option<&RankWeights>,
    prompt: &[u32],
    kv: KvDtype,
) -> Vec<Vec<f32>> {
    let opts = LoadOptions {
        kv_dtype: kv,
        ..LoadOptions::default()
    };
    let out = local::run(tp, LocalOptions::default(), |g| {
        let m = match weights {
            Some(w) => ShardedModel::load_weighted(ckpt, g.rank(), w, opts, 64).unwrap(),
            None => ShardedModel::load(ckpt, g.rank(), tp, opts, 64).unwrap(),
        };
        let mut step = Stepper::new(&m, &g);
        let mut cache = m.new_table(64);
        let mut rows = vec![step.logits(&mut cache, prompt, true)];
        for t in [7u32, 300, 42] {
            rows.push(step.logits(&mut cache, &[t], false));
        }
        rows
    })
    .unwrap();
    out.into_iter().next().unwrap().unwrap()
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
            "{what}: step {step}: {differ} of {} logits differ from tp 1",
            w.len()
        );
    }
}

fn assert_tp_invariant(ckpt: &dyn Checkpoint, what: &str, prompt: &[u32]) {
    let want = logits(ckpt, 1, prompt);
    for tp in 2..=4 {
        let got = logits(ckpt, tp, prompt);
        assert_same_bits(&got, &want, &format!("{what}: tp {tp}"));
    }
}

/// Weighted shards give tp 1's bits; the shards really are uneven (checked on the plan, so a
/// weighted load that silently fell back to the balanced split would fail here).
fn assert_weighted_invariant(ckpt: &dyn Checkpoint, what: &str, prompt: &[u32], all: &[&[u32]]) {
    let want = logits(ckpt, 1, prompt);
    for w in all {
        let weights = RankWeights::new(w.to_vec()).unwrap();
        let tp = weights.tp();
        let heads: Vec<usize> = (0..tp)
            .map(|r| {
                ShardPlan::for_checkpoint_weighted(ckpt, r, &weights)
                    .unwrap()
                    .q_heads()
                    .len()
            })
            .collect();
        let even: Vec<usize> = (0..tp)
            .map(|r| {
                ShardPlan::for_checkpoint(ckpt, r, tp)
                    .unwrap()
                    .q_heads()
                    .len()
            })
            .collect();
        assert_ne!(
            heads, even,
            "{what}: weights {weights} give the balanced heads"
        );
        let got = logits_with(ckpt, tp, Some(&weights), prompt, KvDtype::F32);
        assert_same_bits(
            &got,
            &want,
            &format!("{what}: weights {weights} (heads {heads:?})"),
        );
    }
}

#[test]
fn synthetic_models_give_the_same_bits_at_tp_1_to_4() {
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = vec![1, 17, 256, 999, 3, 512, 64, 8];
    use GgmlDType::*;
    for (i, (arch, linear, embed)) in [
        (Arch::Llama, Q4_0, Q8_0),
        (Arch::Llama, Q4_1, Q8_0),
        (Arch::Llama, Q8_0, Q8_0),
        (Arch::Llama, F32, F32),
        (Arch::Qwen2, Q8_0, Q4_1),
        // MQA (tp 2..4 replicate the one KV head), a window of 4 the prompt crosses.
        (Arch::Gemma3, Q8_0, Q8_0),
        (Arch::Gemma3, Q4_1, Q4_0),
    ]
    .into_iter()
    .enumerate()
    {
        let model = SyntheticModel::small(arch, 100 + i as u64);
        let path = dir.path().join(format!("m{i}.gguf"));
        model
            .write_gguf(&path, GgufTypes { linear, embed })
            .unwrap();
        let ckpt = open_checkpoint(&path).unwrap();
        assert_tp_invariant(&*ckpt, &format!("{arch:?} GGUF {linear:?}"), &prompt);
    }
    for (i, dtype) in [HfDType::F32, HfDType::F16].into_iter().enumerate() {
        let model = SyntheticModel::small(Arch::Qwen2, 200 + i as u64);
        let d = dir.path().join(format!("hf{i}"));
        model.write_hf(&d, 1, dtype).unwrap();
        let ckpt = open_checkpoint(&d).unwrap();
        assert_tp_invariant(&*ckpt, &format!("HF {dtype:?}"), &prompt);
    }
}

/// The small synthetic shape with an FFN of 4 super-blocks (so the FFN splits in whole
/// super-blocks at tp 1..4): the attention output projection's 256 columns (8 heads of 32)
/// split at 128 (tp 2), 96 and 192 (tp 3), 64/128/192 (tp 4), inside its super-block.
fn k_quant_model(arch: Arch, seed: u64) -> SyntheticModel {
    let mut cfg = SyntheticModel::small(arch, seed).cfg;
    cfg.ffn = 1024;
    SyntheticModel::new(cfg, seed)
}

#[test]
fn k_quant_models_whose_shards_cut_super_blocks_give_the_same_bits_at_tp_1_to_4() {
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = vec![1, 17, 256, 999, 3, 512, 64, 8];
    use GgmlDType::*;
    for (i, (arch, linear, embed)) in [
        (Arch::Qwen2, Q4K, Q6K),
        (Arch::Llama, Q6K, Q8_0),
        (Arch::Qwen2, Q5K, Q4K),
        (Arch::Llama, Q3K, Q8_0),
        (Arch::Qwen2, Q2K, Q8_0),
    ]
    .into_iter()
    .enumerate()
    {
        let model = k_quant_model(arch, 500 + i as u64);
        let path = dir.path().join(format!("k{i}.gguf"));
        model
            .write_gguf(&path, GgufTypes { linear, embed })
            .unwrap();
        let ckpt = open_checkpoint(&path).unwrap();
        let what = format!("{arch:?} GGUF {linear:?}");
        // The cut projections stay quantized: a rank holds what the plan says (the
        // super-blocks its columns touch), not a dequantized shard.
        local::run(3, LocalOptions::default(), |g| {
            let opts = LoadOptions::default();
            let m = ShardedModel::load(&*ckpt, g.rank(), 3, opts, 64).unwrap();
            let cfg = ckpt.config();
            let plan = ShardPlan::for_checkpoint(&*ckpt, g.rank(), 3).unwrap();
            let mem = rank_memory(&*ckpt, &plan, 64, 4, true, KvDtype::F32).unwrap();
            let norms = (2 * cfg.layers + 1) * cfg.hidden * 4;
            let (held, planned) = (m.weight_bytes(), mem.sharded + norms);
            // The packed K-quant layouts add unpacked scales (up to 19% for Q2_K).
            assert!(
                planned <= held && held * 100 <= planned * 120,
                "{what}: rank {} holds {held} bytes, planned {planned}",
                g.rank()
            );
        })
        .unwrap();
        assert_tp_invariant(&*ckpt, &what, &prompt);
        if i < 2 {
            // Uneven heads: rank 0 of 2,1 holds 5 heads, 160 columns.
            let weights: [&[u32]; 2] = [&[2, 1], &[3, 2, 1]];
            assert_weighted_invariant(&*ckpt, &what, &prompt, &weights);
        }
    }
}

#[test]
fn qwen25_coder_q4_k_m_gives_the_same_bits_at_tp_1_and_2() {
    let Some(path) = common::qwen25() else {
        return;
    };
    let ckpt = open_checkpoint(&path).unwrap();
    // Arbitrary token ids of Qwen2.5's vocabulary.
    let prompt = [
        750u32, 15801, 1445, 982, 198, 262, 421, 308, 2651, 220, 16, 25,
    ];
    let want = logits(&*ckpt, 1, &prompt);
    let got = logits(&*ckpt, 2, &prompt);
    assert_same_bits(&got, &want, "Qwen2.5-Coder-0.5B: tp 2");
}

#[test]
fn gemma3_270m_gives_the_same_bits_at_tp_1_to_4() {
    let Some(path) = common::gemma3() else {
        return;
    };
    let ckpt = open_checkpoint(&path).unwrap();
    // Arbitrary ids of Gemma's 262144-token vocabulary (BOS first).
    let prompt = [
        2u32, 9_259, 3_097, 496, 1_027, 236_764, 262_000, 107, 42, 1_000,
    ];
    assert_tp_invariant(&*ckpt, "Gemma-3-270M Q4_K_M", &prompt);
}

#[test]
fn smollm2_gives_the_same_bits_at_tp_1_to_4() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let ckpt = open_checkpoint(&path).unwrap();
    let prompt = [
        1u32, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308,
    ];
    assert_tp_invariant(&*ckpt, "SmolLM2 Q4_1", &prompt);
}

#[test]
fn synthetic_models_give_the_same_bits_with_rank_weights() {
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = vec![1, 17, 256, 999, 3, 512, 64, 8];
    let weights: [&[u32]; 4] = [&[2, 1], &[1, 2], &[3, 2, 1], &[1, 3, 1, 2]];
    use GgmlDType::*;
    for (i, (arch, linear, embed)) in [
        (Arch::Llama, Q4_1, Q8_0),
        (Arch::Llama, F32, F32),
        (Arch::Qwen2, Q8_0, Q4_1),
    ]
    .into_iter()
    .enumerate()
    {
        let model = SyntheticModel::small(arch, 300 + i as u64);
        let path = dir.path().join(format!("w{i}.gguf"));
        model
            .write_gguf(&path, GgufTypes { linear, embed })
            .unwrap();
        let ckpt = open_checkpoint(&path).unwrap();
        assert_weighted_invariant(
            &*ckpt,
            &format!("{arch:?} GGUF {linear:?}"),
            &prompt,
            &weights,
        );
    }
    let model = SyntheticModel::small(Arch::Qwen2, 400);
    let d = dir.path().join("hf");
    model.write_hf(&d, 1, HfDType::F16).unwrap();
    let ckpt = open_checkpoint(&d).unwrap();
    assert_weighted_invariant(&*ckpt, "HF F16", &prompt, &weights);
}

#[test]
fn smollm2_gives_the_same_bits_with_rank_weights() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let ckpt = open_checkpoint(&path).unwrap();
    let prompt = [
        1u32, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308,
    ];
    // 2,1: two thirds of the heads, FFN blocks (48 of 32 columns) and vocabulary on rank 0.
    let w = RankWeights::new(vec![2, 1]).unwrap();
    let plans: Vec<_> = (0..2)
        .map(|r| ShardPlan::for_checkpoint_weighted(&*ckpt, r, &w).unwrap())
        .collect();
    let shown: Vec<_> = plans
        .iter()
        .map(|p| (p.q_heads(), p.kv_heads(), p.ffn_cols(), p.vocab_rows()))
        .collect();
    assert_eq!(
        shown,
        vec![
            (0..6, 0..2, 0..1024, 0..32768),
            (6..9, 2..3, 1024..1536, 32768..49152)
        ]
    );
    assert_weighted_invariant(
        &*ckpt,
        "SmolLM2 Q4_1",
        &prompt,
        &[&[2, 1], &[1, 2], &[3, 2, 1]],
    );
}

/// A 2-byte KV cache rounds every key and value the same way at every tp (each rank rounds
/// its own heads' values, element by element), so the logits stay tp-invariant; and they stay
/// near the f32 cache's: within 5% of the logits' spread on SmolLM2 (measured: at most 3.3%
/// for f16 and 3.0% for bf16 over these 15 rows: SmolLM2's attention amplifies any rounding
/// of its keys), with the same most likely token at the last position of every step for
/// f16. Perplexity is the quality measure that matters: see tp-cli's kv_dtype test.
#[test]
fn two_byte_kv_caches_keep_the_same_bits_at_every_tp() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let ckpt = open_checkpoint(&path).unwrap();
    let prompt = [
        1u32, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308,
    ];
    let exact = logits(&*ckpt, 1, &prompt);
    for (kv, bound) in [(KvDtype::F16, 0.05), (KvDtype::Bf16, 0.05)] {
        let got = logits_with(&*ckpt, 1, None, &prompt, kv);
        for tp in 2..=4 {
            let other = logits_with(&*ckpt, tp, None, &prompt, kv);
            assert_same_bits(&other, &got, &format!("SmolLM2 Q4_1, {kv} KV: tp {tp}"));
        }
        for (step, (g, w)) in got.iter().zip(&exact).enumerate() {
            let spread = w.iter().fold(f32::MIN, |a, &b| a.max(b))
                - w.iter().fold(f32::MAX, |a, &b| a.min(b));
            let worst = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            println!(
                "{kv} KV, step {step}: max |diff| {worst:.5} = {:.2e} of the spread {spread:.2}",
                worst / spread
            );
            assert!(
                worst <= bound * spread,
                "{kv} KV step {step}: logits differ from f32's by {worst}, more than {bound} of the spread {spread}"
            );
            assert!(
                worst > 0.0,
                "{kv} KV step {step}: no rounding at all? the dtype is not applied"
            );
            if kv == KvDtype::F16 {
                let vocab = w.len() / if step == 0 { prompt.len() } else { 1 };
                let top = |r: &[f32]| {
                    let last = &r[r.len() - vocab..];
                    (0..vocab).max_by(|&a, &b| last[a].total_cmp(&last[b]))
                };
                assert_eq!(
                    top(g),
                    top(w),
                    "f16 KV step {step}: another most likely token"
                );
            }
        }
    }
}
