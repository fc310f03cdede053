//! Model hyper-parameters of the Llama family, read from GGUF metadata or an HF config.json.

use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::Value;
use std::collections::HashMap;

/// Architectures with the Llama block (RMSNorm, RoPE, GQA attention, SwiGLU MLP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    /// Qwen2: Llama plus biases on Q, K and V.
    Qwen2,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
        }
    }
}

/// How RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (x0,x1),(x2,x3): llama.cpp's permuted Q/K rows of `llama` GGUFs.
    Interleaved,
    /// First half with second half: HF checkpoints and qwen2 GGUFs.
    RotateHalf,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rms_eps: f64,
    pub rope_theta: f64,
    pub rope_style: RopeStyle,
    pub context: usize,
    /// Q/K/V projections carry biases.
    pub qkv_bias: bool,
    /// The LM head reuses the token embedding.
    pub tied_embeddings: bool,
}

impl ModelConfig {
    /// Checks relations a loader relies on, so a bad file fails here with a clear message.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.layers == 0 || self.hidden == 0 || self.ffn == 0 || self.vocab == 0 {
            return bad(format!(
                "layers {}, hidden {}, ffn {} and vocab {} must all be positive",
                self.layers, self.hidden, self.ffn, self.vocab
            ));
        }
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "{} query heads must be a positive multiple of {} KV heads",
                self.heads, self.kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even and positive",
                self.head_dim
            ));
        }
        let positive = |x: f64| x > 0.0 && x.is_finite();
        if !positive(self.rms_eps) || !positive(self.rope_theta) {
            return bad(format!(
                "rms epsilon {} and rope theta {} must be positive and finite",
                self.rms_eps, self.rope_theta
            ));
        }
        if self.context == 0 {
            return bad("the context length must be positive".into());
        }
        if self.checked_parameter_count().is_none() {
            return bad(format!(
                "sizes overflow: {} layers of hidden {}, ffn {}, {} heads of {} and vocab {}",
                self.layers, self.hidden, self.ffn, self.heads, self.head_dim, self.vocab
            ));
        }
        Ok(())
    }

    /// [`ModelConfig::parameter_count`], or `None` when a product overflows (a corrupt file).
    fn checked_parameter_count(&self) -> Option<usize> {
        let q = self.heads.checked_mul(self.head_dim)?;
        let kv = self.kv_heads.checked_mul(self.head_dim)?;
        let qkv = kv.checked_mul(2)?.checked_add(q)?;
        let attn = self
            .hidden
            .checked_mul(qkv)?
            .checked_add(q.checked_mul(self.hidden)?)?;
        let bias = if self.qkv_bias { qkv } else { 0 };
        let mlp = self.hidden.checked_mul(self.ffn)?.checked_mul(3)?;
        let block = attn
            .checked_add(bias)?
            .checked_add(mlp)?
            .checked_add(self.hidden.checked_mul(2)?)?;
        let embed = self.vocab.checked_mul(self.hidden)?;
        let head = if self.tied_embeddings { 0 } else { embed };
        self.layers
            .checked_mul(block)?
            .checked_add(embed)?
            .checked_add(head)?
            .checked_add(self.hidden)
    }

    /// Parameters of the whole model (embedding counted once when tied); saturates for sizes
    /// that [`ModelConfig::validate`] rejects.
    pub fn parameter_count(&self) -> usize {
        self.checked_parameter_count().unwrap_or(usize::MAX)
    }

    /// From GGUF metadata (`general.architecture` and its `<arch>.*` keys).
    pub fn from_gguf(
        md: &HashMap<String, Value>,
        embed_rows: Option<usize>,
        has_output: bool,
    ) -> Result<Self> {
        let arch_name = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .ok_or_else(|| {
                missing(
                    "general.architecture",
                    "it is not a model GGUF; pass a llama or qwen2 GGUF converted by llama.cpp",
                )
            })?
            .clone();
        let arch = match arch_name.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            other => {
                return Err(ModelError::UnsupportedArch {
                    arch: other.to_string(),
                    path: String::new(),
                })
            }
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        // A key that is present must be valid: a mistyped value is an error, not the default.
        let opt_int = |k: &str| -> Result<Option<usize>> {
            let full = key(k);
            match md.get(&full) {
                None => Ok(None),
                Some(v) => gguf_uint(v).map(Some).ok_or_else(|| {
                    ModelError::Config(format!("{full} is {v:?}, not a non-negative integer"))
                }),
            }
        };
        let int = |k: &str| -> Result<usize> {
            opt_int(k)?.ok_or_else(|| missing(&key(k), "the GGUF lacks a required hyper-parameter; convert the model again with a current llama.cpp"))
        };
        let float = |k: &str, default: f64| -> Result<f64> {
            let full = key(k);
            match md.get(&full) {
                None => Ok(default),
                Some(v) => v
                    .to_f32()
                    .ok()
                    .map(f64::from)
                    .or_else(|| v.to_f64().ok())
                    .or_else(|| gguf_uint(v).map(|x| x as f64))
                    .ok_or_else(|| ModelError::Config(format!("{full} is {v:?}, not a number"))),
            }
        };
        let hidden = int("embedding_length")?;
        let heads = int("attention.head_count")?;
        let kv_heads = opt_int("attention.head_count_kv")?.unwrap_or(heads);
        let head_dim = match opt_int("attention.key_length")? {
            Some(d) => d,
            None => {
                opt_int("rope.dimension_count")?.unwrap_or(hidden.checked_div(heads).unwrap_or(0))
            }
        };
        let vocab = match (opt_int("vocab_size")?, embed_rows) {
            (Some(v), _) => v,
            (None, Some(rows)) => rows,
            (None, None) => int("vocab_size")?,
        };
        let cfg = ModelConfig {
            arch,
            layers: int("block_count")?,
            hidden,
            ffn: int("feed_forward_length")?,
            heads,
            kv_heads,
            head_dim,
            vocab,
            rms_eps: float("attention.layer_norm_rms_epsilon", 1e-5)?,
            rope_theta: float("rope.freq_base", 10_000.0)?,
            rope_style: match arch {
                Arch::Llama => RopeStyle::Interleaved,
                Arch::Qwen2 => RopeStyle::RotateHalf,
            },
            context: opt_int("context_length")?.unwrap_or(2048),
            qkv_bias: arch == Arch::Qwen2,
            tied_embeddings: !has_output,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// From an HF `config.json` (`LlamaForCausalLM`, `Qwen2ForCausalLM`, or their model_type).
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| ModelError::Config(format!("config.json is not valid JSON: {e}")))?;
        let model_type = v.get("model_type").and_then(|m| m.as_str()).unwrap_or("");
        let arch_list: Vec<&str> = v
            .get("architectures")
            .and_then(|a| a.as_array())
            .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
            .unwrap_or_default();
        let arch = if model_type == "llama" || arch_list.contains(&"LlamaForCausalLM") {
            Arch::Llama
        } else if model_type == "qwen2" || arch_list.contains(&"Qwen2ForCausalLM") {
            Arch::Qwen2
        } else {
            if model_type.is_empty() && arch_list.is_empty() {
                return Err(missing(
                    "model_type",
                    "config.json names no model_type or architectures; it is not a transformers model config",
                ));
            }
            let what = if model_type.is_empty() {
                arch_list.join(",")
            } else {
                model_type.to_string()
            };
            return Err(ModelError::UnsupportedArch {
                arch: what,
                path: String::new(),
            });
        };
        // Absent or null: the default; present: must be valid (never silently the default).
        let opt_int = |k: &str| -> Result<Option<usize>> {
            match v.get(k) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .map(Some)
                    .ok_or_else(|| {
                        ModelError::Config(format!("{k} is {x}, not a non-negative integer"))
                    }),
            }
        };
        let int = |k: &str| -> Result<usize> {
            opt_int(k)?.ok_or_else(|| missing(k, "config.json lacks a required field; use the config.json that came with the model"))
        };
        let float = |k: &str, d: f64| -> Result<f64> {
            match v.get(k) {
                None | Some(serde_json::Value::Null) => Ok(d),
                Some(x) => x
                    .as_f64()
                    .ok_or_else(|| ModelError::Config(format!("{k} is {x}, not a number"))),
            }
        };
        let hidden = int("hidden_size")?;
        let heads = int("num_attention_heads")?;
        let cfg = ModelConfig {
            arch,
            layers: int("num_hidden_layers")?,
            hidden,
            ffn: int("intermediate_size")?,
            heads,
            kv_heads: opt_int("num_key_value_heads")?.unwrap_or(heads),
            head_dim: opt_int("head_dim")?.unwrap_or(hidden.checked_div(heads).unwrap_or(0)),
            vocab: int("vocab_size")?,
            rms_eps: float("rms_norm_eps", 1e-5)?,
            rope_theta: float("rope_theta", 10_000.0)?,
            rope_style: RopeStyle::RotateHalf,
            context: opt_int("max_position_embeddings")?.unwrap_or(2048),
            qkv_bias: arch == Arch::Qwen2
                || v.get("attention_bias").and_then(|b| b.as_bool()) == Some(true),
            tied_embeddings: v
                .get("tie_word_embeddings")
                .and_then(|b| b.as_bool())
                .unwrap_or(false),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

fn missing(key: &str, hint: &str) -> ModelError {
    ModelError::MissingMetadata {
        key: key.to_string(),
        hint: hint.to_string(),
        path: String::new(),
    }
}

fn gguf_uint(v: &Value) -> Option<usize> {
    match v {
        Value::U8(x) => Some(*x as usize),
        Value::U16(x) => Some(*x as usize),
        Value::U32(x) => Some(*x as usize),
        Value::U64(x) => usize::try_from(*x).ok(),
        Value::I8(x) => usize::try_from(*x).ok(),
        Value::I16(x) => usize::try_from(*x).ok(),
        Value::I32(x) => usize::try_from(*x).ok(),
        Value::I64(x) => usize::try_from(*x).ok(),
        _ => None,
    }
}
