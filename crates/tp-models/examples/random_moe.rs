//! Writes a random mixture-of-experts GGUF (Mixtral layout: `llama` with experts, merged 3-D
//! expert tensors; or with ARCH `olmoe` OLMoE's: q/k norms over the whole projections, top-k
//! weights not normalised, an untied head) with a real model's tokenizer, for decode
//! benchmarks of the MoE path against llama.cpp on the same file and for comparing greedy text
//! with llama.cpp's (no MoE model is installable on these machines). Its text is noise; its
//! shapes and routing are an MoE's.
//!
//! `cargo run --release -p tp-models --features test-support --example random_moe -- \
//!     TOKENIZER.gguf OUT.gguf [LAYERS HIDDEN EXPERTS FFN TOP_K TYPE ARCH]` (defaults: 8 1024
//! 32 512 4 Q8_0 llama)

use tp_models::checkpoint::GgmlDType;
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{Arch, Checkpoint, Experts, GgufCheckpoint, ModelConfig, RopeStyle};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [tok, out, rest @ ..] = args.as_slice() else {
        return Err(
            "usage: random_moe TOKENIZER.gguf OUT.gguf [LAYERS HIDDEN EXPERTS FFN TOP_K TYPE ARCH]"
                .into(),
        );
    };
    let num = |i: usize, d: usize| -> Result<usize, Box<dyn std::error::Error>> {
        Ok(rest.get(i).map_or(Ok(d), |s| s.parse())?)
    };
    let (layers, hidden, count, ffn, k) = (
        num(0, 8)?,
        num(1, 1024)?,
        num(2, 32)?,
        num(3, 512)?,
        num(4, 4)?,
    );
    let linear = match rest.get(5).map_or("Q8_0", String::as_str) {
        "Q8_0" => GgmlDType::Q8_0,
        "Q4_0" => GgmlDType::Q4_0,
        "F32" => GgmlDType::F32,
        other => return Err(format!("type {other}: use Q8_0, Q4_0 or F32").into()),
    };
    let olmoe = match rest.get(6).map_or("llama", String::as_str) {
        "llama" => false,
        "olmoe" => true,
        other => return Err(format!("arch {other}: use llama or olmoe").into()),
    };
    let mut experts = Experts::new(count, k);
    experts.normalize = !olmoe;
    let source = GgufCheckpoint::open(std::path::Path::new(tok))?;
    let cfg = ModelConfig {
        arch: if olmoe { Arch::Olmoe } else { Arch::Llama },
        layers,
        hidden,
        ffn,
        heads: hidden / 64,
        // OLMoE is multi-head (llama.cpp sizes its key norm by the hidden width).
        kv_heads: if olmoe {
            hidden / 64
        } else {
            (hidden / 64 / 4).max(1)
        },
        head_dim: 64,
        vocab: source.config().vocab,
        rms_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_style: RopeStyle::RotateHalf,
        context: 2048,
        qkv_bias: false,
        qk_norm: olmoe,
        tied_embeddings: !olmoe,
        block: if olmoe {
            tp_spec::BlockStyle::OLMOE
        } else {
            tp_spec::BlockStyle::LLAMA
        },
        experts: Some(experts),
    };
    cfg.validate()?;
    let mut model = SyntheticModel::new(cfg, 7);
    model.merged_experts = true;
    let tokenizer = source.tokenizer_metadata();
    let types = GgufTypes {
        linear,
        embed: GgmlDType::Q8_0,
    };
    model.write_gguf_with(std::path::Path::new(out), types, tokenizer)?;
    eprintln!("wrote {out}: {layers} layers, hidden {hidden}, {count} experts of FFN {ffn}, top-{k}, {linear:?}");
    Ok(())
}
