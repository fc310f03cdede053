//! Mixture-of-experts models: small random MoE GGUFs in both expert layouts against
//! candle-transformers (Mixtral's one-tensor-per-expert layout through `quantized_llama`,
//! Qwen3-MoE's merged 3-D tensors and Qwen2-MoE's shared expert through candle's `qwen3_moe`
//! and `qwen2_moe` on the same weights as HF directories), the same logits bits at
//! every tp and every expert-parallel size, and a dense-equivalent MoE cut from the real
//! SmolLM2 file that must give dense SmolLM2's logits.
//!
//! Tolerances: against candle, both sides see the same f32 weights (every weight dequantized,
//! `CANDLE_DEQUANTIZE_ALL=1` for candle) and differ in f32 summation order and in the router
//! (softmax in f64 here, f32 in candle): 1e-4 of each row's logit spread (a wrong expert,
//! weight or slice moves logits by orders of magnitude more), and every greedy token agrees.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{assert_close, prompt, sharded_logits, spread};
use tp_models::checkpoint::GgmlDType;
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{Arch, CapacityFactor, Checkpoint, GgufCheckpoint, LoadOptions, WeightName};

const TOL: f32 = 1e-4;

/// An oracle model: logits of the last of `tokens` fed at `pos`.
type Oracle = Box<dyn FnMut(&[u32], usize) -> Vec<f32>>;

fn dense() -> LoadOptions {
    LoadOptions {
        keep_quantized: false,
        ..LoadOptions::default()
    }
}

fn with_ep(opts: LoadOptions, ep: usize) -> LoadOptions {
    LoadOptions {
        expert_groups: ep,
        ..opts
    }
}

/// An oracle's rows in the order of `sharded_logits`: the whole prompt through a fresh model,
/// then each token fed one by one through another.
fn oracle_order(load: impl Fn() -> Oracle, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut out = vec![load()(tokens, 0)];
    let mut m = load();
    for (i, t) in tokens.iter().enumerate() {
        out.push(m(std::slice::from_ref(t), i));
    }
    out
}

/// Asserts equal bits, naming the first differing row and logit (not printing every logit).
fn assert_same_bits(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(got.len(), want.len(), "{what}: rows");
    for (r, (g, w)) in got.iter().zip(want).enumerate() {
        if let Some(i) = (0..w.len()).find(|&i| g[i].to_bits() != w[i].to_bits()) {
            panic!("{what}: row {r} logit {i}: {} vs {}", g[i], w[i]);
        }
    }
}

fn write(
    model: &SyntheticModel,
    types: GgufTypes,
    name: &str,
) -> (tempfile::TempDir, GgufCheckpoint) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    model.write_gguf(&path, types).unwrap();
    let ckpt = GgufCheckpoint::open(&path).unwrap();
    (dir, ckpt)
}

/// A model written as a GGUF and as an HF directory (2 safetensors shards) of the same f32
/// values, which must give the same logits bits at tp 1.
struct BothFiles {
    _gguf_dir: tempfile::TempDir,
    _hf_dir: tempfile::TempDir,
    gguf: GgufCheckpoint,
    /// The HF directory's config.json and shard files (sorted).
    config: String,
    shards: Vec<std::path::PathBuf>,
    /// `sharded_logits` of the tokens at tp 1, the same from either file.
    logits: Vec<Vec<f32>>,
}

impl BothFiles {
    fn write(model: &SyntheticModel, tokens: &[u32]) -> BothFiles {
        let (gguf_dir, gguf) = write(model, GgufTypes::F32, "moe.gguf");
        let hf_dir = tempfile::tempdir().unwrap();
        model
            .write_hf(hf_dir.path(), 2, tp_models::synthetic::HfDType::F32)
            .unwrap();
        let hf = tp_models::HfCheckpoint::open(hf_dir.path()).unwrap();
        let logits = sharded_logits(&gguf, tokens, 1, dense());
        let arch = model.cfg.arch;
        assert_same_bits(
            &format!("{arch:?}: GGUF vs HF"),
            &sharded_logits(&hf, tokens, 1, dense()),
            &logits,
        );
        let config = std::fs::read_to_string(hf_dir.path().join("config.json")).unwrap();
        let mut shards: Vec<_> = std::fs::read_dir(hf_dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        shards.sort();
        BothFiles {
            _gguf_dir: gguf_dir,
            _hf_dir: hf_dir,
            gguf,
            config,
            shards,
            logits,
        }
    }
}

#[test]
fn mixtral_per_expert_layout_matches_candle_at_every_tp() {
    // 8 experts, 2 per token, one GGUF tensor per expert (older Mixtral files).
    let model = SyntheticModel::small_moe(Arch::Llama, 8, 2, 11);
    let (dir, ckpt) = write(&model, GgufTypes::F32, "mixtral.gguf");
    assert_eq!(ckpt.config().experts.map(|e| e.count), Some(8));
    let tokens = prompt(1000, 6);
    // candle's quantized_llama runs Mixtral's per-expert layout; every weight dequantized.
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let want = common::GgufOracle::logits(&dir.path().join("mixtral.gguf"), Arch::Llama, &tokens);
    let tp1 = sharded_logits(&ckpt, &tokens, 1, dense());
    assert_close("mixtral tp 1 vs candle", &tp1, &want, TOL, true);
    for tp in 2..=4 {
        let got = sharded_logits(&ckpt, &tokens, tp, dense());
        assert_same_bits(&format!("mixtral tp {tp} vs tp 1"), &got, &tp1);
    }
}

/// Qwen3-MoE (merged 3-D expert tensors in the GGUF) and Qwen2-MoE (shared expert with its
/// sigmoid gate, top-k weights not normalised) against candle-transformers' `qwen3_moe` and
/// `qwen2_moe` on the same weights as an HF directory (candle's quantized Qwen3-MoE runs on
/// CUDA only). The GGUF and the HF directory hold the same f32 values, so ours gives the same
/// bits from either file.
#[test]
fn qwen_moe_models_match_candle_from_gguf_and_hf() {
    use candle_nn::VarBuilder;
    use candle_transformers::models::{qwen2_moe, qwen3_moe};
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    for arch in [Arch::Qwen3, Arch::Qwen2] {
        let mut model = SyntheticModel::small_moe(arch, 8, 2, 12);
        model.merged_experts = true;
        let tokens = prompt(1000, 6);
        let both = BothFiles::write(&model, &tokens);
        let (got, text, files) = (&both.logits, &both.config, &both.shards);
        let load = || -> Oracle {
            // SAFETY: the files are written by this test and not modified while mapped.
            let vb =
                unsafe { VarBuilder::from_mmaped_safetensors(files, DType::F32, &Device::Cpu) }
                    .unwrap();
            let x = |t: &[u32]| Tensor::new(t, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
            let out = |y: candle_core::Result<Tensor>| -> Vec<f32> {
                y.unwrap().flatten_all().unwrap().to_vec1().unwrap()
            };
            if arch == Arch::Qwen3 {
                let cfg: qwen3_moe::Config = serde_json::from_str(text).unwrap();
                let mut m = qwen3_moe::ModelForCausalLM::new(&cfg, vb).unwrap();
                Box::new(move |t, pos| out(m.forward(&x(t), pos)))
            } else {
                let cfg: qwen2_moe::Config = serde_json::from_str(text).unwrap();
                let mut m = qwen2_moe::Model::new(&cfg, vb).unwrap();
                Box::new(move |t, pos| out(m.forward(&x(t), pos)))
            }
        };
        let want = oracle_order(load, &tokens);
        assert_close(&format!("{arch:?} MoE vs candle"), got, &want, TOL, true);
    }
}

/// OLMoE (merged 3-D expert tensors, q/k norms over the whole projections, top-k weights not
/// normalised, rotate-half RoPE) against a reference written here from transformers'
/// `OlmoeForCausalLM` with candle ops (candle-transformers has no OLMoE) on the same weights as
/// an HF directory; the GGUF and the HF directory give the same bits. The whole-projection
/// norm is the part a per-head norm would get wrong: replacing it by Qwen3's per-head norm
/// moves the logits far past the tolerance (the test's last check).
#[test]
fn olmoe_matches_a_reference_from_gguf_and_hf() {
    let mut model = SyntheticModel::small_moe(Arch::Olmoe, 8, 2, 17);
    model.merged_experts = true;
    let tokens = prompt(1000, 6);
    let both = BothFiles::write(&model, &tokens);
    let (gguf, got, files) = (&both.gguf, &both.logits, &both.shards);
    assert_eq!(gguf.config().arch, Arch::Olmoe);
    let cfg: serde_json::Value = serde_json::from_str(&both.config).unwrap();
    assert_eq!(cfg["model_type"], "olmoe");
    let rows = olmoe_reference(files, &cfg, &tokens, true);
    // `sharded_logits`' order: the whole prompt's last row, then each position fed alone.
    let want: Vec<Vec<f32>> = std::iter::once(rows[tokens.len() - 1].clone())
        .chain(rows)
        .collect();
    assert_close("olmoe vs the reference", got, &want, TOL, true);
    for tp in 2..=4 {
        let at = sharded_logits(gguf, &tokens, tp, dense());
        assert_same_bits(&format!("olmoe tp {tp} vs tp 1"), &at, got);
    }
    // The reference with per-head q/k norms instead: far from ours at the last position (at
    // the first, a query sees only its own key, so q and k do not matter).
    let per_head = olmoe_reference(files, &cfg, &tokens, false);
    let moved = per_head[tokens.len() - 1]
        .iter()
        .zip(&want[0])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        moved > 100.0 * TOL * spread(&want[0]),
        "per-head norms moved the logits by only {moved}"
    );
}

/// transformers' `OlmoeForCausalLM` (pre-norm blocks; q and k RMS-normalised over the whole
/// projection, `whole`, or per head when not; rotate-half RoPE; softmax router, top-k by
/// probability with ties to the lower expert, weights normalised only with `norm_topk_prob`)
/// in candle ops on an HF directory's f32 weights: the causal logits of every position.
fn olmoe_reference(
    files: &[std::path::PathBuf],
    cfg: &serde_json::Value,
    tokens: &[u32],
    whole: bool,
) -> Vec<Vec<f32>> {
    use candle_core::D;
    use candle_nn::VarBuilder;
    let dev = Device::Cpu;
    // SAFETY: the files are written by the test and not modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(files, DType::F32, &dev) }.unwrap();
    let u = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (h, heads, kvh, hd) = (
        u("hidden_size"),
        u("num_attention_heads"),
        u("num_key_value_heads"),
        u("head_dim"),
    );
    let (vocab, ffn, count, top) = (
        u("vocab_size"),
        u("intermediate_size"),
        u("num_experts"),
        u("num_experts_per_tok"),
    );
    let normalize = cfg["norm_topk_prob"].as_bool().unwrap();
    let eps = cfg["rms_norm_eps"].as_f64().unwrap() as f32;
    let theta = cfg["rope_theta"].as_f64().unwrap();
    let n = tokens.len();
    let w = |name: &str, shape: &[usize]| vb.get(shape, name).unwrap();
    let rms = |x: &Tensor, weight: &Tensor| candle_nn::ops::rms_norm(x, weight, eps).unwrap();
    let lin = |x: &Tensor, weight: &Tensor| x.matmul(&weight.t().unwrap()).unwrap();
    // [n, width] normalised over the whole width, or over each `hd` slice.
    let qk_norm = |x: &Tensor, weight: &Tensor, width: usize| -> Tensor {
        if whole {
            rms(x, weight)
        } else {
            let per = weight.reshape((width / hd, hd)).unwrap();
            let ones = Tensor::ones(hd, DType::F32, &dev).unwrap();
            let x = rms(&x.reshape((n, width / hd, hd)).unwrap(), &ones);
            x.broadcast_mul(&per).unwrap().reshape((n, width)).unwrap()
        }
    };
    let inv: Vec<f32> = (0..hd / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / hd as f64) as f32)
        .collect();
    let angles: Vec<f32> = (0..n)
        .flat_map(|p| inv.iter().map(move |f| p as f32 * f))
        .collect();
    let angles = Tensor::from_vec(angles, (n, hd / 2), &dev).unwrap();
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    let mask: Vec<f32> = (0..n * n)
        .map(|i| {
            if i % n > i / n {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (n, n), &dev).unwrap();
    let ids = Tensor::new(tokens, &dev).unwrap();
    let mut x = w("model.embed_tokens.weight", &[vocab, h])
        .index_select(&ids, 0)
        .unwrap(); // [n, h]
    for l in 0..u("num_hidden_layers") {
        let p = format!("model.layers.{l}.");
        let g = |s: &str, shape: &[usize]| w(&format!("{p}{s}"), shape);
        let xn = rms(&x, &g("input_layernorm.weight", &[h]));
        let q = lin(&xn, &g("self_attn.q_proj.weight", &[heads * hd, h]));
        let k = lin(&xn, &g("self_attn.k_proj.weight", &[kvh * hd, h]));
        let v = lin(&xn, &g("self_attn.v_proj.weight", &[kvh * hd, h]));
        let q = qk_norm(&q, &g("self_attn.q_norm.weight", &[heads * hd]), heads * hd);
        let k = qk_norm(&k, &g("self_attn.k_norm.weight", &[kvh * hd]), kvh * hd);
        // [1, heads, n, hd] with RoPE; keys and values repeated over their query group.
        let split = |t: &Tensor, hs: usize| {
            t.reshape((1, n, hs, hd))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let repeat = |t: Tensor| {
            t.unsqueeze(2)
                .unwrap()
                .expand((1, kvh, heads / kvh, n, hd))
                .unwrap()
                .reshape((1, heads, n, hd))
                .unwrap()
        };
        let q = candle_nn::rotary_emb::rope(&split(&q, heads), &cos, &sin).unwrap();
        let k = repeat(candle_nn::rotary_emb::rope(&split(&k, kvh), &cos, &sin).unwrap());
        let v = repeat(split(&v, kvh));
        let scores = (q.matmul(&k.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
        let p_att =
            candle_nn::ops::softmax(&scores.broadcast_add(&mask).unwrap(), D::Minus1).unwrap();
        let ctx = p_att
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((n, heads * hd))
            .unwrap();
        x = (x + lin(&ctx, &g("self_attn.o_proj.weight", &[h, heads * hd]))).unwrap();
        let xn = rms(&x, &g("post_attention_layernorm.weight", &[h]));
        let probs =
            candle_nn::ops::softmax(&lin(&xn, &g("mlp.gate.weight", &[count, h])), D::Minus1)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
        let mut rows = Vec::with_capacity(n);
        for (t, pr) in probs.iter().enumerate() {
            let mut order: Vec<usize> = (0..count).collect();
            order.sort_by(|a, b| pr[*b].total_cmp(&pr[*a]).then(a.cmp(b)));
            let chosen = &order[..top];
            let total: f32 = chosen.iter().map(|&e| pr[e]).sum();
            let xt = xn.narrow(0, t, 1).unwrap(); // [1, h]
            let mut y = Tensor::zeros((1, h), DType::F32, &dev).unwrap();
            for &e in chosen {
                let ge = |s: &str, shape: &[usize]| g(&format!("mlp.experts.{e}.{s}"), shape);
                let a = lin(&xt, &ge("gate_proj.weight", &[ffn, h])).silu().unwrap();
                let b = lin(&xt, &ge("up_proj.weight", &[ffn, h]));
                let out = lin(&(a * b).unwrap(), &ge("down_proj.weight", &[h, ffn]));
                let weight = if normalize { pr[e] / total } else { pr[e] };
                y = (y + (out * f64::from(weight)).unwrap()).unwrap();
            }
            rows.push(y);
        }
        x = (x + Tensor::cat(&rows, 0).unwrap()).unwrap();
    }
    let x = rms(&x, &w("model.norm.weight", &[h]));
    lin(&x, &w("lm_head.weight", &[vocab, h]))
        .to_vec2()
        .unwrap()
}

/// Expert-TP at tp 1..4 and expert parallelism (whole experts per rank: 8 over 3 ranks is
/// 3|3|2) and their mix at tp 4 x ep 2, on quantized weights: the same bits everywhere.
#[test]
fn every_tp_and_expert_parallel_size_gives_the_same_bits() {
    for (arch, merged) in [
        (Arch::Qwen3, true),
        (Arch::Qwen2, false),
        (Arch::Olmoe, true),
    ] {
        let mut model = SyntheticModel::small_moe(arch, 8, 2, 13);
        model.merged_experts = merged;
        let types = GgufTypes {
            linear: GgmlDType::Q8_0,
            embed: GgmlDType::Q8_0,
        };
        let (_dir, ckpt) = write(&model, types, "moe.gguf");
        let tokens = prompt(1000, 7);
        let q = LoadOptions::default();
        let tp1 = sharded_logits(&ckpt, &tokens, 1, q);
        for (tp, ep) in [(2, 1), (3, 1), (4, 1), (2, 2), (3, 3), (4, 2), (4, 4)] {
            let got = sharded_logits(&ckpt, &tokens, tp, with_ep(q, ep));
            assert_same_bits(&format!("{arch:?} tp {tp} ep {ep} vs tp 1"), &got, &tp1);
        }
    }
}

fn capacity(f: f64) -> Option<CapacityFactor> {
    Some(CapacityFactor::new(f).unwrap())
}

/// The oracle of one MoE layer under a capacity factor, all in f64 from the f32 weights:
/// softmax router, top-k normalised, then each expert keeps the first `ceil(f x n x k / E)`
/// of the (token, expert) pairs routed to it in token order, and each token sums its kept
/// experts' weighted SwiGLU outputs. Returns the output `[n, hidden]` and the pairs dropped
/// per expert.
fn reference_moe_layer(
    model: &SyntheticModel,
    l: usize,
    f: Option<f64>,
    xn: &[f32],
    n: usize,
) -> (Vec<f64>, Vec<u64>) {
    let cfg = &model.cfg;
    let (h, ex) = (cfg.hidden, cfg.experts.unwrap());
    let (count, k) = (ex.count, ex.per_token);
    let w = |name| model.weight(name).unwrap().1;
    let row = |m: &[f32], r: usize, x: &[f64]| -> f64 {
        let cols = x.len();
        m[r * cols..(r + 1) * cols]
            .iter()
            .zip(x)
            .map(|(a, b)| f64::from(*a) * b)
            .sum()
    };
    let cap = f.map_or(n, |f| {
        ((f * (n * k) as f64 / count as f64).ceil() as usize).max(1)
    });
    let mut taken = vec![0usize; count];
    let mut dropped = vec![0u64; count];
    let mut out = vec![0f64; n * h];
    for t in 0..n {
        let x: Vec<f64> = xn[t * h..(t + 1) * h]
            .iter()
            .map(|v| f64::from(*v))
            .collect();
        let scores: Vec<f64> = (0..count)
            .map(|e| row(w(WeightName::Router(l)), e, &x))
            .collect();
        let max = scores.iter().copied().fold(f64::MIN, f64::max);
        let probs: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let mut order: Vec<usize> = (0..count).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        order.truncate(k);
        let total: f64 = order.iter().map(|&e| probs[e]).sum();
        for e in order {
            taken[e] += 1;
            if taken[e] > cap {
                dropped[e] += 1;
                continue;
            }
            let (gate, up, down) = (
                w(WeightName::ExpertGate(l, e)),
                w(WeightName::ExpertUp(l, e)),
                w(WeightName::ExpertDown(l, e)),
            );
            let ffn = gate.len() / h;
            let act: Vec<f64> = (0..ffn)
                .map(|c| {
                    let g = row(gate, c, &x);
                    g / (1.0 + (-g).exp()) * row(up, c, &x) * probs[e] / total
                })
                .collect();
            for (i, o) in out[t * h..(t + 1) * h].iter_mut().enumerate() {
                *o += row(down, i, &act);
            }
        }
    }
    (out, dropped)
}

/// One MoE layer against [`reference_moe_layer`] on 12 random tokens, top-2 of 8 experts:
/// without a capacity, and with factors 0.5 (capacity 2: most pairs dropped), 1 (3) and 100
/// (none). The pairs dropped per expert must be the reference's exactly, and the output equal
/// it within 1e-5 of its largest value (f32 products and sums against f64; a wrong kept or
/// dropped pair moves it by a whole expert's output).
#[test]
fn a_capacity_factor_drops_the_reference_pairs_of_a_layer() {
    let model = SyntheticModel::small_moe(Arch::Qwen3, 8, 2, 21);
    let (_dir, ckpt) = write(&model, GgufTypes::F32, "moe.gguf");
    let (n, h) = (12, model.cfg.hidden);
    let mut rng = tp_spec::Rng::new(5);
    let xn: Vec<f32> = (0..n * h).map(|_| 2.0 * rng.signed_unit()).collect(); // [n, hidden]
    let mut any_dropped = false;
    for f in [None, Some(0.5), Some(1.0), Some(100.0)] {
        let opts = LoadOptions {
            expert_capacity: f.map(|f| CapacityFactor::new(f).unwrap()),
            ..dense()
        };
        let (got, prof) = tp_models::synthetic::moe_layer_output(&ckpt, 1, opts, &xn, n).unwrap();
        let (want, dropped) = reference_moe_layer(&model, 1, f, &xn, n);
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 1e-5 * scale,
            "factor {f:?}: output off by {err} of {scale}"
        );
        let got_dropped = if prof.expert_dropped.is_empty() {
            vec![0; 8]
        } else {
            prof.expert_dropped.clone()
        };
        assert_eq!(
            got_dropped, dropped,
            "factor {f:?}: pairs dropped per expert"
        );
        let kept: u64 = prof.expert_tokens.iter().sum();
        assert_eq!(kept + prof.expert_dropped_total(), (n * 2) as u64, "{f:?}");
        any_dropped |= dropped.iter().sum::<u64>() > 0;
        if f == Some(100.0) {
            assert_eq!(dropped, vec![0; 8]);
            let (none, _) =
                tp_models::synthetic::moe_layer_output(&ckpt, 1, dense(), &xn, n).unwrap();
            assert!(
                got.iter()
                    .zip(&none)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "factor 100 vs none"
            );
        }
    }
    assert!(any_dropped, "the fixture must drop pairs");
}

/// Every row of `tokens` in one step at `tp` x `ep`, gathered, and rank 0's profile.
fn step_rows(
    ckpt: &dyn Checkpoint,
    tokens: &[u32],
    tp: usize,
    opts: LoadOptions,
) -> (Vec<Vec<f32>>, tp_models::Profile) {
    use tp_comm::local::{self, LocalOptions};
    let results = local::run(tp, LocalOptions::default(), |g| {
        let model = tp_models::ShardedModel::load(ckpt, g.rank(), tp, opts, 64).unwrap();
        let mut s = common::Stepper::new(&model, &g);
        let rows = s.logits(&mut model.new_table(64), tokens, true);
        let vocab = rows.len() / tokens.len();
        let rows = rows.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
        (rows, s.prof)
    })
    .unwrap();
    results.into_iter().next().unwrap().unwrap()
}

/// A capacity factor over a whole model: the drops come from the replicated router, so every
/// rank drops the same pairs and every row of a 7-token prompt (f = 0.5: capacity 1 of 8
/// experts, top-2) has the same bits at tp 1-3 with ep 1 and 2 (and tp 4 x ep 4), with the
/// same pairs dropped per expert. The drops move the logits; a lone token (n = 1, capacity 1)
/// loses none; a factor of 100 is no capacity, bit for bit.
#[test]
fn a_capacity_factor_drops_the_same_tokens_at_every_layout() {
    let model = SyntheticModel::small_moe(Arch::Qwen3, 8, 2, 16);
    let (_dir, ckpt) = write(&model, GgufTypes::F32, "moe.gguf");
    let tokens = prompt(1000, 7);
    let cap = |f| LoadOptions {
        expert_capacity: capacity(f),
        ..dense()
    };
    let (half, prof) = step_rows(&ckpt, &tokens, 1, cap(0.5));
    // Every layer drops 7 x 2 routed pairs down to at most 8 kept.
    let layers = model.cfg.layers as u64;
    assert!(prof.expert_dropped_total() >= layers * 6, "{prof:?}");
    assert_eq!(
        prof.expert_dropped_total() + prof.expert_tokens.iter().sum::<u64>(),
        layers * 14
    );
    for (tp, ep) in [(2, 1), (2, 2), (3, 1), (4, 4)] {
        let (got, p) = step_rows(&ckpt, &tokens, tp, with_ep(cap(0.5), ep));
        assert_same_bits(&format!("capacity 0.5 at tp {tp} ep {ep}"), &got, &half);
        assert_eq!(p.expert_dropped, prof.expert_dropped, "tp {tp} ep {ep}");
        assert_eq!(p.expert_tokens, prof.expert_tokens, "tp {tp} ep {ep}");
    }
    let (none, p) = step_rows(&ckpt, &tokens, 1, dense());
    assert!(p.expert_dropped.is_empty());
    let last = tokens.len() - 1;
    let moved = half[last]
        .iter()
        .zip(&none[last])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        moved > 1e-3 * spread(&none[last]),
        "dropping tokens moved the logits by {moved}"
    );
    let (wide, _) = step_rows(&ckpt, &tokens, 1, cap(100.0));
    assert_same_bits("capacity 100", &wide, &none);
    // A lone token per step: the capacity rounds up to 1, nothing is dropped.
    let one_by_one = sharded_logits(&ckpt, &tokens, 1, cap(0.5));
    let plain = sharded_logits(&ckpt, &tokens, 1, dense());
    assert_same_bits(
        "a lone token under capacity 0.5",
        &one_by_one[1..],
        &plain[1..],
    );
}

/// A capacity factor is a number above 0, and a dense model takes none: typed errors before
/// any weight is read, naming the valid values.
#[test]
fn a_bad_capacity_factor_is_refused() {
    for bad in ["0", "-1", "NaN", "inf", "x"] {
        let e = bad.parse::<CapacityFactor>().unwrap_err().to_string();
        assert!(e.contains("a number above 0"), "{bad}: {e}");
    }
    let (_dir, ckpt) = write(
        &SyntheticModel::small(Arch::Qwen3, 3),
        GgufTypes::F32,
        "dense.gguf",
    );
    let opts = LoadOptions {
        expert_capacity: capacity(1.25),
        ..dense()
    };
    let e = tp_models::ShardedModel::load(&ckpt, 0, 1, opts, 64).unwrap_err();
    assert!(
        e.to_string()
            .contains("has no experts (it is dense); leave it unset"),
        "{e}"
    );
}

/// The weights each rank holds: whole experts under expert parallelism, slices of all of them
/// under expert-TP; the bytes add up to the file's experts either way.
#[test]
fn ranks_hold_only_their_experts() {
    let model = SyntheticModel::small_moe(Arch::Qwen3, 8, 2, 14);
    let (_dir, ckpt) = write(&model, GgufTypes::F32, "moe.gguf");
    let bytes = |tp: usize, ep: usize| -> Vec<usize> {
        (0..tp)
            .map(|r| {
                tp_models::ShardedModel::load(&ckpt, r, tp, with_ep(dense(), ep), 64)
                    .unwrap()
                    .weight_bytes()
            })
            .collect()
    };
    let one = bytes(1, 1)[0];
    let (etp, ep) = (bytes(2, 1), bytes(2, 2));
    // Replicated: norms and routers; everything else is split. Both layouts hold the same
    // expert bytes in total, so their sums agree.
    assert_eq!(etp.iter().sum::<usize>(), ep.iter().sum::<usize>());
    assert!(etp[0] < one && ep[0] < one, "{one} {etp:?} {ep:?}");
    let e = tp_models::ShardedModel::load(&ckpt, 0, 4, with_ep(dense(), 3), 64).unwrap_err();
    assert!(e.to_string().contains("must divide tp"), "{e}");
}

#[test]
fn missing_or_misshapen_expert_tensors_are_named() {
    let mut model = SyntheticModel::small_moe(Arch::Qwen3, 4, 2, 15);
    model.merged_experts = true;
    let dir = tempfile::tempdir().unwrap();
    // A merged tensor with fewer experts than the config says.
    let mut md = model.gguf_metadata();
    for (k, v) in md.iter_mut() {
        if k.ends_with(".expert_count") {
            *v = candle_core::quantized::gguf_file::Value::U32(5);
        }
    }
    let tensors = model.gguf_tensors(GgufTypes::F32).unwrap();
    let path = dir.path().join("bad.gguf");
    tp_models::synthetic::write_gguf(&path, &md, &tensors).unwrap();
    let e = GgufCheckpoint::open(&path).unwrap_err().to_string();
    assert!(
        e.contains("ffn_") && e.contains("_exps") && e.contains("5 experts"),
        "{e}"
    );
    // A per-expert file missing expert 3's up projection.
    let model = SyntheticModel::small_moe(Arch::Llama, 4, 2, 15);
    let tensors: Vec<_> = model
        .gguf_tensors(GgufTypes::F32)
        .unwrap()
        .into_iter()
        .filter(|(n, _)| n != "blk.1.ffn_up.3.weight")
        .collect();
    let path = dir.path().join("missing.gguf");
    tp_models::synthetic::write_gguf(&path, &model.gguf_metadata(), &tensors).unwrap();
    let e = GgufCheckpoint::open(&path).unwrap_err().to_string();
    assert!(e.contains("blk.1.ffn_up.3.weight"), "{e}");
}

/// SmolLM2's FFN (1536 columns) cut into 8 experts of 192 columns, every expert active with
/// weight 1/8 (a zero router, top-8, normalised) and each expert's down projection times 8:
/// the same function as the dense MLP. Both scalings are powers of two, so every product is
/// the dense one; only the order of the f64 sums differs, and those are exact for these
/// magnitudes, so the logits must agree to 1e-5 of their spread (f32 rounding of the
/// residual) and every greedy token must agree.
#[test]
fn smollm2_cut_into_eight_equal_experts_is_dense_smollm2() {
    let Some(dir) = common::smollm2() else {
        eprintln!("skipped: SmolLM2 is not installed (scripts/fetch-models.sh installs it)");
        return;
    };
    let dense_ckpt = tp_models::open_checkpoint(&dir).unwrap();
    let cfg = dense_ckpt.config().clone();
    let moe = SyntheticModel::dense_as_experts(dense_ckpt.as_ref(), 8).unwrap();
    let out = tempfile::tempdir().unwrap();
    let path = out.path().join("smollm2-moe.gguf");
    moe.write_gguf(&path, GgufTypes::F32).unwrap();
    let moe_ckpt = GgufCheckpoint::open(&path).unwrap();
    let tokens = prompt(cfg.vocab, 8);
    let want = sharded_logits(dense_ckpt.as_ref(), &tokens, 1, dense());
    for (tp, ep) in [(1, 1), (2, 1), (2, 2)] {
        let got = sharded_logits(&moe_ckpt, &tokens, tp, with_ep(dense(), ep));
        assert_close(
            &format!("SmolLM2 as 8 experts, tp {tp} ep {ep}"),
            &got,
            &want,
            1e-5,
            true,
        );
    }
}
