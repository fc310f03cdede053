//! Model configuration of the Llama-style model trained here: presets, and the Hugging Face
//! `config.json` it reads and writes (LlamaForCausalLM field names, so a checkpoint directory
//! is an HF model directory).

use crate::error::{Result, TrainError};
use serde::{Deserialize, Serialize};
use std::path::Path;
use tp_nn::{BlockConfig, RopeLayout};

/// Whole-model sizes. Field names are those of an HF Llama `config.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
}

/// The subset of an HF `config.json` this reads; optional fields get Llama's defaults.
#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    tie_word_embeddings: Option<bool>,
}

/// Preset names accepted by `--config`.
pub const PRESETS: &[&str] = &["tiny", "small", "bench"];

impl ModelConfig {
    /// A preset by name: `tiny` (0.8M parameters, learns visibly in a minute or two on 2
    /// cores), `small` (4.8M), `bench` (~51M, matmul bound: for `tp bench train`).
    /// Vocabulary 256 (bytes); replace it with a tokenizer's size via [`ModelConfig::with_vocab`].
    pub fn preset(name: &str) -> Option<ModelConfig> {
        let (hidden, ffn, layers, heads, kv, max_pos) = match name {
            "tiny" => (128, 384, 4, 4, 2, 512),
            "small" => (256, 768, 6, 8, 4, 1024),
            "bench" => (1024, 2816, 4, 16, 8, 1024),
            _ => return None,
        };
        Some(ModelConfig {
            vocab_size: 256,
            hidden_size: hidden,
            intermediate_size: ffn,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim: hidden / heads,
            max_position_embeddings: max_pos,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            tie_word_embeddings: false,
        })
    }

    /// A preset name or the path of an HF `config.json` (or of a directory holding one).
    pub fn from_arg(arg: &str) -> Result<ModelConfig> {
        if let Some(c) = Self::preset(arg) {
            return Ok(c);
        }
        let path = Path::new(arg);
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        if !file.exists() {
            return Err(TrainError::Config(format!(
                "--config {arg}: no such preset or file; use one of {} or the path of an HF \
                 config.json",
                PRESETS.join(", ")
            )));
        }
        Self::read(&file)
    }

    /// Reads an HF Llama `config.json`.
    pub fn read(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| TrainError::io("read", path, e))?;
        Self::parse(&text).map_err(|m| TrainError::Config(format!("{}: {m}", path.display())))
    }

    /// Parses the text of an HF `config.json`; the error says what is wrong.
    pub fn parse(text: &str) -> std::result::Result<ModelConfig, String> {
        let hf: HfConfig =
            serde_json::from_str(text).map_err(|e| format!("not a Llama config.json ({e})"))?;
        let llama = hf.model_type.as_deref().is_none_or(|t| t == "llama")
            && (hf.architectures.is_empty()
                || hf.architectures.iter().any(|a| a == "LlamaForCausalLM"));
        if !llama {
            return Err(format!(
                "model_type {:?} / architectures {:?}: only Llama models (LlamaForCausalLM) \
                 can be trained",
                hf.model_type, hf.architectures
            ));
        }
        let heads = hf.num_attention_heads;
        let c = ModelConfig {
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim: hf
                .head_dim
                .or_else(|| hf.hidden_size.checked_div(heads))
                .unwrap_or(0),
            max_position_embeddings: hf.max_position_embeddings.unwrap_or(2048),
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: hf.rope_theta.unwrap_or(10_000.0),
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
        };
        c.validate().map_err(|e| match e {
            TrainError::Config(m) => m,
            other => other.to_string(),
        })?;
        Ok(c)
    }

    /// The same model with another vocabulary size (a tokenizer's).
    pub fn with_vocab(mut self, vocab: usize) -> Self {
        self.vocab_size = vocab;
        self
    }

    /// Checks the sizes on their own (layout checks are in [`crate::layout`]).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TrainError::Config(m));
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in positive {
            if v == 0 {
                return bad(format!("{name} is 0; it must be positive"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "{} attention heads are not a multiple of {} KV heads; use a KV head count \
                 that divides the heads",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} is odd; RoPE needs an even head_dim",
                self.head_dim
            ));
        }
        if self.tie_word_embeddings {
            return bad(
                "tie_word_embeddings is true; training supports untied embeddings only: set \
                 it to false"
                    .into(),
            );
        }
        if !(self.rms_norm_eps > 0.0 && self.rope_theta > 0.0) {
            return bad("rms_norm_eps and rope_theta must be positive".into());
        }
        // Weights, gradients and two AdamW moments, f32 each: sizes whose bytes cannot even
        // be computed are refused before anything is allocated.
        let bytes = self
            .checked_num_params()
            .and_then(|p| p.checked_mul(16))
            .filter(|&b| b <= isize::MAX as usize);
        if bytes.is_none() {
            return bad(format!(
                "{} layers of hidden_size {}, intermediate_size {}, {} heads of {} and vocab_size {} need more than {} bytes of weights and optimizer state; use smaller sizes",
                self.num_hidden_layers,
                self.hidden_size,
                self.intermediate_size,
                self.num_attention_heads,
                self.head_dim,
                self.vocab_size,
                isize::MAX
            ));
        }
        Ok(())
    }

    /// One block's sizes for tp-nn. RoPE is HF's rotate-half layout, so a checkpoint means
    /// the same thing to an HF-directory loader.
    pub fn block(&self) -> BlockConfig {
        BlockConfig {
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            ffn: self.intermediate_size,
            rope_theta: self.rope_theta,
            rope_layout: RopeLayout::RotateHalf,
            rms_eps: self.rms_norm_eps,
            max_seq: self.max_position_embeddings,
        }
    }

    /// Trainable parameters of the whole model (saturating; [`ModelConfig::validate`]
    /// refuses sizes whose count overflows).
    pub fn num_params(&self) -> usize {
        self.checked_num_params().unwrap_or(usize::MAX)
    }

    /// [`ModelConfig::num_params`], or `None` when a product overflows.
    fn checked_num_params(&self) -> Option<usize> {
        let (h, v, f) = (self.hidden_size, self.vocab_size, self.intermediate_size);
        let q = self.num_attention_heads.checked_mul(self.head_dim)?;
        let kv = self.num_key_value_heads.checked_mul(self.head_dim)?;
        let layer = [
            h.checked_mul(2)?,
            q.checked_mul(h)?.checked_mul(2)?,
            kv.checked_mul(h)?.checked_mul(2)?,
            f.checked_mul(h)?.checked_mul(3)?,
        ]
        .into_iter()
        .try_fold(0usize, |a, x| a.checked_add(x))?;
        v.checked_mul(h)?
            .checked_mul(2)?
            .checked_add(h)?
            .checked_add(self.num_hidden_layers.checked_mul(layer)?)
    }

    /// The HF `config.json` text of this model.
    pub fn to_hf_json(&self) -> String {
        let v = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "torch_dtype": "float32",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
        });
        serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_round_trip_through_hf_json() {
        for name in PRESETS {
            let c = ModelConfig::preset(name).unwrap();
            c.validate().unwrap();
            assert_eq!(ModelConfig::parse(&c.to_hf_json()).unwrap(), c, "{name}");
        }
        assert!(ModelConfig::preset("huge").is_none());
    }

    #[test]
    fn bad_configs_say_what_to_fix() {
        let mut c = ModelConfig::preset("tiny").unwrap();
        c.num_key_value_heads = 3;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("not a multiple of 3 KV heads"), "{e}");
        c.num_key_value_heads = 2;
        c.tie_word_embeddings = true;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("set it to false"));
        let e = ModelConfig::parse("{\"model_type\": \"gpt2\"}").unwrap_err();
        assert!(e.contains("not a Llama config.json"), "{e}");
        let e = ModelConfig::from_arg("/no/such/config.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("tiny, small, bench"), "{e}");
    }

    #[test]
    fn parameter_count_of_tiny() {
        let c = ModelConfig::preset("tiny").unwrap();
        // embeddings 2*256*128, final norm 128, 4 layers of (2*128 + 128*128*2 + 2*64*128 + 3*384*128)
        assert_eq!(
            c.num_params(),
            2 * 256 * 128 + 128 + 4 * (256 + 32768 + 16384 + 147456)
        );
    }
}
