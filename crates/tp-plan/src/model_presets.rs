//! Built-in model shapes: GPT-3, Llama-2/3, Mixtral, Qwen2.5, SmolLM2 and the ten
//! GPT models of Narayanan et al. 2021, Table 1 (vocabulary 51,200).

use crate::model::ModelSpec;
use crate::PlanError;

/// (layers, hidden, heads) of the Megatron-LM 2021 Table 1 models, by preset name.
pub const MEGATRON_2021_SHAPES: [(&str, u64, u64, u64); 10] = [
    ("megatron-1.7b", 24, 2304, 24),
    ("megatron-3.6b", 30, 3072, 32),
    ("megatron-7.5b", 36, 4096, 32),
    ("megatron-18b", 40, 6144, 48),
    ("megatron-39b", 48, 8192, 64),
    ("megatron-76b", 60, 10240, 80),
    ("megatron-145b", 80, 12288, 96),
    ("megatron-310b", 96, 16384, 128),
    ("megatron-530b", 105, 20480, 128),
    ("megatron-1t", 128, 25600, 160),
];

/// Vocabulary of every Megatron-LM 2021 model (paper §5.1).
pub const MEGATRON_2021_VOCAB: u64 = 51_200;

#[allow(clippy::too_many_arguments)]
fn llama_like(
    name: &str,
    layers: u64,
    hidden: u64,
    ffn: u64,
    heads: u64,
    kv_heads: u64,
    vocab: u64,
    tied: bool,
) -> ModelSpec {
    ModelSpec {
        name: name.to_string(),
        num_layers: layers,
        hidden_size: hidden,
        ffn_hidden_size: ffn,
        num_query_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hidden / heads,
        vocab_size: vocab,
        tied_embeddings: tied,
        gated_mlp: true,
        num_experts: 1,
        experts_per_token: 1,
        ffn_unit: 1,
        stored: None,
    }
}

fn named_presets() -> Vec<ModelSpec> {
    let mut presets = vec![
        ModelSpec::gpt("gpt3-175b", 96, 12288, 96, 50257),
        llama_like("llama-2-7b", 32, 4096, 11008, 32, 32, 32000, false),
        llama_like("llama-2-13b", 40, 5120, 13824, 40, 40, 32000, false),
        llama_like("llama-2-70b", 80, 8192, 28672, 64, 8, 32000, false),
        llama_like("llama-3-8b", 32, 4096, 14336, 32, 8, 128256, false),
        llama_like("llama-3-70b", 80, 8192, 28672, 64, 8, 128256, false),
        llama_like("llama-3-405b", 126, 16384, 53248, 128, 8, 128256, false),
        ModelSpec {
            num_experts: 8,
            experts_per_token: 2,
            ..llama_like("mixtral-8x7b", 32, 4096, 14336, 32, 8, 32000, false)
        },
        llama_like("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, false),
        llama_like("qwen2.5-72b", 80, 8192, 29568, 64, 8, 152064, false),
        llama_like("smollm2-135m", 30, 576, 1536, 9, 3, 49152, true),
    ];
    for (name, layers, hidden, heads) in MEGATRON_2021_SHAPES {
        presets.push(ModelSpec::gpt(
            name,
            layers,
            hidden,
            heads,
            MEGATRON_2021_VOCAB,
        ));
    }
    presets
}

/// Names of all model presets, comma separated (used in error messages).
pub fn model_preset_names() -> String {
    named_presets()
        .iter()
        .map(|m| m.name.clone())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Looks a preset up by name (case-insensitive).
pub fn model_preset(name: &str) -> Result<ModelSpec, PlanError> {
    let wanted = name.to_ascii_lowercase();
    named_presets()
        .into_iter()
        .find(|m| m.name == wanted)
        .ok_or_else(|| PlanError::UnknownModelPreset {
            name: name.to_string(),
            valid: model_preset_names(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_is_valid() {
        for m in named_presets() {
            m.validate().unwrap();
        }
    }

    #[test]
    fn unknown_preset_lists_valid_names() {
        let err = model_preset("llama-9").unwrap_err().to_string();
        assert!(
            err.contains("llama-9") && err.contains("smollm2-135m") && err.contains("gpt3-175b")
        );
    }

    #[test]
    fn published_parameter_counts_within_two_percent() {
        // Published sizes; our count omits biases and position embeddings.
        let cases = [
            ("gpt3-175b", 175.0e9),
            ("llama-2-70b", 69.0e9),
            ("llama-3-8b", 8.03e9),
            ("llama-3-405b", 405.0e9),
            ("mixtral-8x7b", 46.7e9),
            ("qwen2.5-72b", 72.7e9),
            ("smollm2-135m", 134.5e6),
            ("megatron-1t", 1008.0e9),
            // Table 1 prints 1.7; its own formula 12lh²(1 + 13/12h + (V+s)/12lh) gives 1.653e9.
            ("megatron-1.7b", 1.653e9),
        ];
        for (name, published) in cases {
            let p = model_preset(name).unwrap().total_params() as f64;
            assert!(
                (p / published - 1.0).abs() < 0.02,
                "{name}: {p} vs {published}"
            );
        }
    }
}
