//! Reads a Hugging Face `config.json` (Llama/Mistral/Mixtral/Qwen2 and GPT-2 field names)
//! into a [`ModelSpec`] through tp-spec's one config reader.

use crate::model::ModelSpec;
use crate::PlanError;
use serde_json::Value;
use std::path::Path;

/// Parses config.json text; `path` is used for the error messages and the model name.
pub fn parse_hf_config(text: &str, path: &Path) -> Result<ModelSpec, PlanError> {
    let malformed = |message: String| PlanError::MalformedModelConfig {
        path: path.to_path_buf(),
        message,
    };
    let root: Value = serde_json::from_str(text).map_err(|e| malformed(e.to_string()))?;
    let dims = tp_spec::Dims::from_hf(&root).map_err(|e| malformed(e.to_string()))?;
    if dims.heads == 0 {
        return Err(malformed("num_attention_heads is 0".to_string()));
    }
    let name = root
        .get("_name_or_path")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| path.display().to_string());
    // The runtime splits float weights' FFN in 32-column chunks.
    let model = ModelSpec::from_dims(&name, &dims, tp_spec::DENSE_CHUNK as u64);
    model.validate()?;
    Ok(model)
}

/// Reads and parses a config.json file.
pub fn load_hf_config(path: &Path) -> Result<ModelSpec, PlanError> {
    let text = std::fs::read_to_string(path).map_err(|source| PlanError::FileRead {
        path: path.to_path_buf(),
        source,
    })?;
    parse_hf_config(&text, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_act":"silu",
        "hidden_size":576,"intermediate_size":1536,"num_attention_heads":9,
        "num_hidden_layers":30,"num_key_value_heads":3,"tie_word_embeddings":true,
        "vocab_size":49152}"#;

    #[test]
    fn llama_style_config_matches_preset() {
        let m = parse_hf_config(SMOLLM2, Path::new("config.json")).unwrap();
        let preset = crate::model_presets::model_preset("smollm2-135m").unwrap();
        assert_eq!(m.total_params(), preset.total_params());
        assert!(m.gated_mlp && m.tied_embeddings);
    }

    #[test]
    fn gpt2_style_config() {
        let text = r#"{"n_embd":768,"n_layer":12,"n_head":12,"vocab_size":50257,"activation_function":"gelu_new"}"#;
        let m = parse_hf_config(text, Path::new("gpt2.json")).unwrap();
        assert_eq!(m.ffn_hidden_size, 3072);
        assert!(!m.gated_mlp);
    }

    #[test]
    fn malformed_configs_name_the_problem() {
        let p = Path::new("cfg.json");
        let cases = [
            ("{not json", "cfg.json"),
            ("[1,2]", "not a JSON object"),
            (r#"{"hidden_size":576}"#, "lacks num_attention_heads"),
            (
                r#"{"hidden_size":"big","num_hidden_layers":1,"num_attention_heads":1,"vocab_size":1}"#,
                "hidden_size is \"big\", not a non-negative integer",
            ),
        ];
        for (text, needle) in cases {
            let e = parse_hf_config(text, p).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
        let bad_groups = r#"{"hidden_size":64,"num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":3,"vocab_size":10}"#;
        assert!(matches!(
            parse_hf_config(bad_groups, p),
            Err(PlanError::InvalidModel { .. })
        ));
    }
}
