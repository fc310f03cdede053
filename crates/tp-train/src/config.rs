//! The model trained here is tp-spec's [`ModelConfig`] (a Llama); this adds what training
//! needs on top: presets, reading an HF `config.json` through tp-spec's reader, the checks
//! training adds (untied embeddings, Llama only, weights and optimizer state that fit), the
//! block sizes for tp-nn and the `config.json` text a checkpoint carries.

use crate::error::{Result, TrainError};
use std::path::Path;
use tp_nn::{BlockConfig, RopeLayout};
pub use tp_spec::ModelConfig;
use tp_spec::{Arch, RopeStyle};

/// Preset names accepted by `--config`.
pub const PRESETS: &[&str] = &["tiny", "small", "bench"];

/// A Llama of these sizes with the defaults training uses (rms eps 1e-5, rope theta 10^4,
/// untied embeddings, HF's rotate-half RoPE).
#[allow(clippy::too_many_arguments)]
pub fn llama(
    vocab: usize,
    hidden: usize,
    ffn: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    context: usize,
) -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        layers,
        hidden,
        ffn,
        heads,
        kv_heads,
        head_dim,
        vocab,
        rms_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_style: RopeStyle::RotateHalf,
        context,
        qkv_bias: false,
        qk_norm: false,
        tied_embeddings: false,
        block: tp_spec::BlockStyle::LLAMA,
        experts: None,
    }
}

/// Training's view of a [`ModelConfig`].
pub trait TrainModel: Sized {
    /// A preset by name: `tiny` (0.8M parameters, learns visibly in a minute or two on 2
    /// cores), `small` (4.8M), `bench` (~51M, matmul bound: for `tp bench train`).
    /// Vocabulary 256 (bytes); replace it with a tokenizer's size via [`TrainModel::with_vocab`].
    fn preset(name: &str) -> Option<Self>;
    /// A preset name or the path of an HF `config.json` (or of a directory holding one).
    fn from_arg(arg: &str) -> Result<Self>;
    /// Reads an HF Llama `config.json`.
    fn read(path: &Path) -> Result<Self>;
    /// Parses the text of an HF `config.json`; the error says what is wrong.
    fn parse(text: &str) -> std::result::Result<Self, String>;
    /// The same model with another vocabulary size (a tokenizer's).
    fn with_vocab(self, vocab: usize) -> Self;
    /// The checks training adds to [`ModelConfig::validate`] (layout checks are in
    /// [`crate::layout`]).
    fn check_trainable(&self) -> Result<()>;
    /// One block's sizes for tp-nn. RoPE is HF's rotate-half layout, so a checkpoint means
    /// the same thing to an HF-directory loader.
    fn block(&self) -> BlockConfig;
    /// Trainable parameters of the whole model (saturating).
    fn num_params(&self) -> usize;
    /// The HF `config.json` text of this model.
    fn hf_json_text(&self) -> String;
}

impl TrainModel for ModelConfig {
    fn preset(name: &str) -> Option<ModelConfig> {
        let (hidden, ffn, layers, heads, kv, max_pos) = match name {
            "tiny" => (128, 384, 4, 4, 2, 512),
            "small" => (256, 768, 6, 8, 4, 1024),
            "bench" => (1024, 2816, 4, 16, 8, 1024),
            _ => return None,
        };
        Some(llama(
            256,
            hidden,
            ffn,
            layers,
            heads,
            kv,
            hidden / heads,
            max_pos,
        ))
    }

    fn from_arg(arg: &str) -> Result<ModelConfig> {
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
                "{arg}: no such preset or file; use one of {} or the path of an HF \
                 config.json",
                PRESETS.join(", ")
            )));
        }
        Self::read(&file)
    }

    fn read(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| TrainError::io("read", path, e))?;
        Self::parse(&text).map_err(|m| TrainError::Config(format!("{}: {m}", path.display())))
    }

    fn parse(text: &str) -> std::result::Result<ModelConfig, String> {
        let c = ModelConfig::from_hf_json(text).map_err(|e| match e {
            tp_spec::SpecError::UnsupportedArch { arch } => {
                format!("model_type {arch:?}: only Llama models (LlamaForCausalLM) can be trained")
            }
            other => format!("not a Llama config.json ({other})"),
        })?;
        if c.arch != Arch::Llama {
            return Err(format!(
                "model_type {:?}: only Llama models (LlamaForCausalLM) can be trained",
                c.arch.name()
            ));
        }
        c.check_trainable().map_err(|e| match e {
            TrainError::Config(m) => m,
            other => other.to_string(),
        })?;
        Ok(c)
    }

    fn with_vocab(mut self, vocab: usize) -> Self {
        self.vocab = vocab;
        self
    }

    fn check_trainable(&self) -> Result<()> {
        let bad = |m: String| Err(TrainError::Config(m));
        self.validate()
            .map_err(|e| TrainError::Config(e.to_string()))?;
        if self.arch != Arch::Llama || self.qkv_bias || self.experts.is_some() {
            return bad(format!(
                "a {} model{}; training supports Llama models without biases or experts",
                self.arch.name(),
                if self.experts.is_some() {
                    " with experts"
                } else {
                    ""
                }
            ));
        }
        if self.tied_embeddings {
            return bad(
                "tie_word_embeddings is true; training supports untied embeddings only: set \
                 it to false"
                    .into(),
            );
        }
        // Weights, gradients and two AdamW moments, f32 each: sizes whose bytes cannot even
        // be computed are refused before anything is allocated.
        let bytes = self
            .parameter_count()
            .checked_mul(16)
            .filter(|&b| b <= isize::MAX as usize);
        if bytes.is_none() {
            return bad(format!(
                "{} layers of hidden_size {}, intermediate_size {}, {} heads of {} and vocab_size {} need more than {} bytes of weights and optimizer state; use smaller sizes",
                self.layers,
                self.hidden,
                self.ffn,
                self.heads,
                self.head_dim,
                self.vocab,
                isize::MAX
            ));
        }
        Ok(())
    }

    fn block(&self) -> BlockConfig {
        BlockConfig {
            hidden: self.hidden,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            ffn: self.ffn,
            rope_theta: self.rope_theta,
            rope_layout: RopeLayout::RotateHalf,
            rms_eps: self.rms_eps,
            max_seq: self.context,
        }
    }

    fn num_params(&self) -> usize {
        self.parameter_count()
    }

    fn hf_json_text(&self) -> String {
        serde_json::to_string_pretty(&self.to_hf_json()).unwrap_or_default() + "\n"
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
            assert_eq!(ModelConfig::parse(&c.hf_json_text()).unwrap(), c, "{name}");
        }
        assert!(ModelConfig::preset("huge").is_none());
    }

    #[test]
    fn bad_configs_say_what_to_fix() {
        let mut c = ModelConfig::preset("tiny").unwrap();
        c.kv_heads = 3;
        let e = c.check_trainable().unwrap_err().to_string();
        assert!(e.contains("multiple of 3 KV heads"), "{e}");
        c.kv_heads = 2;
        c.tied_embeddings = true;
        assert!(c
            .check_trainable()
            .unwrap_err()
            .to_string()
            .contains("set it to false"));
        let e = ModelConfig::parse("{\"model_type\": \"gpt2\"}").unwrap_err();
        assert!(e.contains("only Llama models"), "{e}");
        let e = ModelConfig::parse("{\"model_type\": \"llama\"}").unwrap_err();
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
