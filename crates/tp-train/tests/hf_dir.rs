//! A checkpoint is a Hugging Face Llama directory: read back with the safetensors crate and
//! evaluated by an independent dense implementation (tp-nn's single-device `DenseBlock`,
//! candle's `rms_norm_slow` and `cross_entropy`, HF tensor names, rotate-half RoPE), it
//! gives the loss the trainer computes at another tp; its tokenizer.json loads in HF
//! `tokenizers` and maps text to the byte ids training used.

mod common;
use candle_core::{Device, Tensor};
use common::*;
use safetensors::SafeTensors;
use tp_nn::{BlockWeights, DenseBlock, MlpWeights};
use tp_train::{Checkpoint, ModelConfig, TrainModel, TrainOptions};

fn tensor(st: &SafeTensors<'_>, name: &str) -> Tensor {
    let v = st.tensor(name).unwrap_or_else(|_| panic!("{name} missing"));
    assert_eq!(v.dtype(), safetensors::Dtype::F32, "{name}");
    let data: Vec<f32> = v
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Tensor::from_vec(data, v.shape(), &Device::Cpu).unwrap()
}

/// Mean cross-entropy of `ids [n, seq]` predicting `targets [n * seq]`, from the directory alone.
fn dense_loss(dir: &std::path::Path, ids: &Tensor, targets: &Tensor) -> f32 {
    let cfg = ModelConfig::read(&dir.join("config.json")).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (n, seq) = ids.dims2().unwrap();
    let emb = tensor(&st, "model.embed_tokens.weight");
    let mut h = emb
        .embedding(&ids.flatten_all().unwrap())
        .unwrap()
        .reshape((n, seq, cfg.hidden))
        .unwrap(); // [n, seq, hidden]
    for i in 0..cfg.layers {
        let t = |s: &str| tensor(&st, &format!("model.layers.{i}.{s}.weight"));
        let w = BlockWeights {
            attn_norm: t("input_layernorm"),
            wq: t("self_attn.q_proj"),
            wk: t("self_attn.k_proj"),
            wv: t("self_attn.v_proj"),
            wo: t("self_attn.o_proj"),
            mlp_norm: t("post_attention_layernorm"),
            mlp: MlpWeights::Dense {
                gate: t("mlp.gate_proj"),
                up: t("mlp.up_proj"),
                down: t("mlp.down_proj"),
            },
            // Qwen3's per-head norms, when config.json says qwen3.
            q_norm: cfg.qk_norm.then(|| t("self_attn.q_norm")),
            k_norm: cfg.qk_norm.then(|| t("self_attn.k_norm")),
            // (Gemma's post norms: its own test, gemma3_inference.rs.)
            post_attn_norm: None,
            post_mlp_norm: None,
            qkv_bias: None,
        };
        h = DenseBlock::new(&cfg.block(i).unwrap(), &w)
            .unwrap()
            .forward(&h)
            .unwrap();
    }
    let norm = tensor(&st, "model.norm.weight");
    let h = candle_nn::ops::rms_norm_slow(&h, &norm, cfg.rms_eps as f32).unwrap();
    let lm = tensor(&st, "lm_head.weight"); // [vocab, hidden]
    let logits = h
        .reshape((n * seq, cfg.hidden))
        .unwrap()
        .matmul(&lm.t().unwrap())
        .unwrap(); // [n * seq, vocab]
    candle_nn::loss::cross_entropy(&logits, targets)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn checkpoint_is_an_hf_directory_an_independent_model_agrees_with() {
    let dir = scratch("hf");
    let mut s = spec(dims(2, 1, 1), 3, 2);
    s.save_dir = Some(dir.clone());
    train(&s, None);
    let step = dir.join("step-00000003");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(step.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    assert_eq!(cfg["model_type"], "llama");
    assert_eq!(cfg["tie_word_embeddings"], false);

    // The next batch, evaluated by the trainer resumed at tp 3 and by the dense reading.
    let ck = Checkpoint::open(&dir).unwrap();
    let pos = ck.state.data_position;
    let resumed = spec(dims(3, 1, 1), 4, 1);
    let loss = with_trainers(&resumed, Some(&ck), TrainOptions::default(), |t| {
        Ok(t.compute_gradients()?.0)
    })
    .swap_remove(0)
    .unwrap();
    let (ids, tgt, _) = corpus().batch(pos, 4);
    let ids = Tensor::from_vec(ids, (4, 16), &Device::Cpu).unwrap();
    let tgt = Tensor::from_vec(tgt, 64, &Device::Cpu).unwrap();
    let want = dense_loss(&step, &ids, &tgt);
    let rel = (loss - f64::from(want)).abs() / f64::from(want);
    assert!(
        rel < 1e-5,
        "trainer at tp3 {loss} vs dense from the files {want}"
    );

    let tok = tokenizers::Tokenizer::from_file(step.join("tokenizer.json")).unwrap();
    let text = "And God said, Let there be light";
    let enc = tok.encode(text, false).unwrap();
    let want: Vec<u32> = text.bytes().map(u32::from).collect();
    assert_eq!(enc.get_ids(), want.as_slice());
    let _ = std::fs::remove_dir_all(&dir);
}
