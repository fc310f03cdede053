//! Writes a mixture-of-experts GGUF that computes exactly a dense GGUF's function (its FFN cut
//! into N equal experts, every expert active with weight 1/N, see
//! `SyntheticModel::dense_as_experts`), with the dense file's tokenizer, so that MoE loading,
//! routing and expert parallelism can be tried on a real model's text:
//!
//! `cargo run --release -p tp-models --features test-support --example dense_as_experts -- IN.gguf OUT.gguf 8`

use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::GgufCheckpoint;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output, count] = args.as_slice() else {
        return Err("usage: dense_as_experts IN.gguf OUT.gguf EXPERTS (a power of two)".into());
    };
    let count: usize = count.parse()?;
    let dense = GgufCheckpoint::open(std::path::Path::new(input))?;
    let moe = SyntheticModel::dense_as_experts(&dense, count)?;
    let tokenizer = dense.tokenizer_metadata();
    moe.write_gguf_with(std::path::Path::new(output), GgufTypes::F32, tokenizer)?;
    eprintln!("wrote {output}: {count} experts of FFN {}", moe.cfg.ffn);
    Ok(())
}
