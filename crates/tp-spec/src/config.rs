//! The model description (hyper-parameters of a supported architecture) and its one reader for
//! GGUF metadata and one for HF `config.json`, plus the architecture-independent shape
//! ([`Dims`]) the planner reads from files of any architecture.

use crate::arch::{is_unsupported_moe_name, Arch, RopeStyle};
use crate::block::BlockStyle;
use crate::error::SpecError;
use serde_json::Value as Json;

mod gemma3;

/// Experts of a mixture-of-experts MLP: a router `[count, hidden]` scores every expert per
/// token, the `per_token` best run, and their outputs are summed with the router's weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Experts {
    pub count: usize,
    /// Experts each token is routed to (top-k).
    pub per_token: usize,
    /// How router scores become weights.
    pub gating: Gating,
    /// The top-k weights are divided by their sum (Mixtral, Qwen3-MoE's released models);
    /// otherwise they stay as the gate gives them over all experts (Qwen2-MoE).
    pub normalize: bool,
    /// Width of a shared expert every token runs (Qwen2-MoE), its output scaled per token by
    /// `sigmoid(x . w)` of its own gate vector.
    pub shared_ffn: Option<usize>,
}

impl Experts {
    /// `count` experts, `per_token` per token, softmax gating with normalised top-k weights
    /// and no shared expert (Mixtral's router).
    pub fn new(count: usize, per_token: usize) -> Self {
        Experts {
            count,
            per_token,
            gating: Gating::Softmax,
            normalize: true,
            shared_ffn: None,
        }
    }

    /// The `per_token` experts a token with router probabilities `probs` (one per expert) is
    /// routed to, best first, equal probabilities to the lower expert: the one routing rule
    /// both executors follow.
    pub fn top_k(&self, probs: &[f64]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..probs.len()).collect();
        // Stable: equal probabilities keep the lower expert first.
        order.sort_by(|a, b| probs[*b].total_cmp(&probs[*a]));
        order.truncate(self.per_token);
        order
    }
}

/// How a router's scores become expert weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts' scores (Mixtral, Qwen-MoE).
    Softmax,
    /// Each score through a sigmoid (DeepSeek-V3's style).
    Sigmoid,
}

/// Hyper-parameters of a model of a supported architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub layers: usize,
    pub hidden: usize,
    /// FFN width (of one expert for a mixture of experts).
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
    /// Each query and key head is RMS-normalised (over its `head_dim`, weights shared by the
    /// heads) before RoPE.
    pub qk_norm: bool,
    /// The LM head reuses the token embedding.
    pub tied_embeddings: bool,
    /// Departures from Llama's block (Gemma's GeGLU, post norms, sliding windows, ...).
    pub block: BlockStyle,
    /// A mixture-of-experts MLP (read from the file; no engine runs one yet:
    /// [`ModelConfig::check_runnable`]).
    pub experts: Option<Experts>,
}

/// A GGUF metadata value as the readers see it (arrays keep only their length).
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    Uint(u64),
    Int(i64),
    Float(f64),
    Bool(bool),
    Text(String),
    Array { len: usize },
}

/// GGUF metadata by key: implemented by each header parser's map.
pub trait Metadata {
    fn meta(&self, key: &str) -> Option<MetaValue>;
}

impl Metadata for std::collections::HashMap<String, MetaValue> {
    fn meta(&self, key: &str) -> Option<MetaValue> {
        self.get(key).cloned()
    }
}

/// The shape of a decoder of any architecture, as the planner needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct Dims {
    /// GGUF `general.architecture`, or the HF `model_type` / first class name.
    pub arch_name: String,
    pub layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context: usize,
    pub tied_embeddings: bool,
    /// Three MLP matrices (gate, up, down) rather than two.
    pub gated_mlp: bool,
    pub experts: Option<Experts>,
}

/// Architectures whose MLP has two matrices (GELU), for the planner.
const UNGATED: [&str; 8] = [
    "gpt2",
    "gptj",
    "gptneox",
    "bloom",
    "falcon",
    "mpt",
    "gpt_neox",
    "starcoder",
];

fn missing(key: &str, hint: &str) -> SpecError {
    SpecError::MissingMetadata {
        key: key.to_string(),
        hint: hint.to_string(),
    }
}

fn meta_uint(v: &MetaValue) -> Option<usize> {
    match v {
        MetaValue::Uint(x) => usize::try_from(*x).ok(),
        MetaValue::Int(x) => usize::try_from(*x).ok(),
        _ => None,
    }
}

/// Typed access to `<arch>.<key>`: a key that is present must be valid (a mistyped value is
/// an error, never the default).
struct Gguf<'a> {
    md: &'a dyn Metadata,
    arch: String,
}

impl Gguf<'_> {
    fn opt_int(&self, k: &str) -> Result<Option<usize>, SpecError> {
        let full = format!("{}.{k}", self.arch);
        match self.md.meta(&full) {
            None => Ok(None),
            Some(v) => meta_uint(&v).map(Some).ok_or_else(|| {
                SpecError::Config(format!("{full} is {v:?}, not a non-negative integer"))
            }),
        }
    }
    fn int(&self, k: &str) -> Result<usize, SpecError> {
        self.opt_int(k)?.ok_or_else(|| {
            missing(
                &format!("{}.{k}", self.arch),
                "the GGUF lacks a required hyper-parameter; convert the model again with a current llama.cpp",
            )
        })
    }
    fn float(&self, k: &str, default: f64) -> Result<f64, SpecError> {
        let full = format!("{}.{k}", self.arch);
        match self.md.meta(&full) {
            None => Ok(default),
            Some(MetaValue::Float(x)) => Ok(x),
            Some(v) => meta_uint(&v)
                .map(|x| x as f64)
                .ok_or_else(|| SpecError::Config(format!("{full} is {v:?}, not a number"))),
        }
    }
}

impl Gguf<'_> {
    /// The experts of a GGUF (`expert_count` above 1): top-k, gating function (llama.cpp's
    /// `expert_gating_func`: 1 softmax, 2 sigmoid), whether top-k weights are normalised
    /// (`expert_weights_norm`; by default yes except for `qwen2moe` and `olmoe`, as llama.cpp
    /// runs them)
    /// and the shared expert's width.
    fn experts(&self) -> Result<Option<Experts>, SpecError> {
        let count = match self.opt_int("expert_count")? {
            Some(n) if n > 1 => n,
            _ => return Ok(None),
        };
        let gating = match self.opt_int("expert_gating_func")? {
            None | Some(0) | Some(1) => Gating::Softmax,
            Some(2) => Gating::Sigmoid,
            Some(x) => {
                return Err(SpecError::Config(format!(
                    "{}.expert_gating_func is {x}; 1 (softmax) and 2 (sigmoid) are known",
                    self.arch
                )))
            }
        };
        let key = format!("{}.expert_weights_norm", self.arch);
        let normalize = match self.md.meta(&key) {
            None => !matches!(self.arch.as_str(), "qwen2moe" | "olmoe"),
            Some(MetaValue::Bool(b)) => b,
            Some(v) => {
                return Err(SpecError::Config(format!(
                    "{key} is {v:?}, not true or false"
                )))
            }
        };
        Ok(Some(Experts {
            count,
            per_token: self.opt_int("expert_used_count")?.unwrap_or(1),
            gating,
            normalize,
            shared_ffn: self
                .opt_int("expert_shared_feed_forward_length")?
                .filter(|&f| f > 0),
        }))
    }
}

impl Dims {
    /// From GGUF metadata (`general.architecture` and its `<arch>.*` keys). `embed_rows` is
    /// the token embedding's row count (the vocabulary when the metadata omits it);
    /// `has_output` whether the file holds a separate LM head.
    pub fn from_gguf(
        md: &dyn Metadata,
        embed_rows: Option<usize>,
        has_output: bool,
    ) -> Result<Dims, SpecError> {
        let arch = match md.meta("general.architecture") {
            Some(MetaValue::Text(a)) => a,
            _ => {
                return Err(missing(
                    "general.architecture",
                    "it is not a model GGUF; pass a GGUF converted by llama.cpp",
                ))
            }
        };
        let g = Gguf {
            md,
            arch: arch.clone(),
        };
        let hidden = g.int("embedding_length")?;
        let heads = g.int("attention.head_count")?;
        let head_dim = match g.opt_int("attention.key_length")? {
            Some(d) => d,
            None => g
                .opt_int("rope.dimension_count")?
                .unwrap_or(hidden.checked_div(heads).unwrap_or(0)),
        };
        let tokens = match md.meta("tokenizer.ggml.tokens") {
            Some(MetaValue::Array { len }) => Some(len),
            _ => None,
        };
        let vocab = match (g.opt_int("vocab_size")?, embed_rows.or(tokens)) {
            (Some(v), _) => v,
            (None, Some(rows)) => rows,
            (None, None) => g.int("vocab_size")?,
        };
        let experts = g.experts()?;
        let ffn = match (experts, g.opt_int("expert_feed_forward_length")?) {
            (Some(_), Some(f)) => f,
            _ => g.int("feed_forward_length")?,
        };
        Ok(Dims {
            layers: g.int("block_count")?,
            hidden,
            ffn,
            heads,
            kv_heads: g.opt_int("attention.head_count_kv")?.unwrap_or(heads),
            head_dim,
            vocab,
            context: g.opt_int("context_length")?.unwrap_or(2048),
            tied_embeddings: !has_output,
            gated_mlp: !UNGATED.contains(&arch.as_str()),
            experts,
            arch_name: arch,
        })
    }

    /// From an HF `config.json` (Llama/Mistral/Mixtral/Qwen field names, and GPT-2's).
    pub fn from_hf(v: &Json) -> Result<Dims, SpecError> {
        if !v.is_object() {
            return Err(SpecError::Config(
                "config.json's top level is not a JSON object".into(),
            ));
        }
        let hf = Hf(v);
        let hidden = hf.int(&["hidden_size", "n_embd", "d_model"])?;
        let heads = hf.int(&["num_attention_heads", "n_head"])?;
        let activation = hf_activation(v);
        let gated = matches!(
            activation,
            "silu" | "swiglu" | "swish" | "geglu" | "gelu_pytorch_tanh"
        ) || (v.get("intermediate_size").is_some() && activation.is_empty());
        let experts = hf_experts(v, &hf)?;
        let ffn = match (experts, hf.opt_int(&["moe_intermediate_size"])?) {
            (Some(_), Some(f)) => f,
            _ => match hf.opt_int(&["intermediate_size", "n_inner", "ffn_dim"])? {
                Some(f) => f,
                None if !gated => hidden.saturating_mul(4),
                None => hf.int(&["intermediate_size"])?,
            },
        };
        let (model_type, classes) = hf_names(v);
        Ok(Dims {
            arch_name: if model_type.is_empty() {
                classes.first().copied().unwrap_or("").to_string()
            } else {
                model_type.to_string()
            },
            layers: hf.int(&["num_hidden_layers", "n_layer", "num_layers"])?,
            hidden,
            ffn,
            heads,
            kv_heads: hf
                .opt_int(&["num_key_value_heads", "num_kv_heads"])?
                .unwrap_or(heads),
            head_dim: hf
                .opt_int(&["head_dim"])?
                .unwrap_or(hidden.checked_div(heads).unwrap_or(0)),
            vocab: hf.int(&["vocab_size"])?,
            context: hf
                .opt_int(&["max_position_embeddings", "n_positions"])?
                .unwrap_or(2048),
            tied_embeddings: hf.bool("tie_word_embeddings")?.unwrap_or(false),
            gated_mlp: gated,
            experts,
        })
    }
}

/// The experts of an HF config (`num_local_experts` / `num_experts` above 1): top-k, whether
/// top-k weights are normalised (`norm_topk_prob`; Mixtral always, transformers' default
/// otherwise: no) and Qwen2-MoE's shared expert. Layer patterns this project cannot run (dense
/// layers between MoE layers) are refused.
fn hf_experts(v: &Json, hf: &Hf) -> Result<Option<Experts>, SpecError> {
    let count = match hf.opt_int(&["num_local_experts", "num_experts"])? {
        Some(n) if n > 1 => n,
        _ => return Ok(None),
    };
    let (model_type, classes) = hf_names(v);
    let mixtral = model_type == "mixtral" || classes.contains(&"MixtralForCausalLM");
    if hf
        .opt_int(&["decoder_sparse_step"])?
        .is_some_and(|s| s != 1)
        || v.get("mlp_only_layers")
            .and_then(Json::as_array)
            .is_some_and(|a| !a.is_empty())
    {
        return Err(SpecError::Config(
            "the config mixes dense and mixture-of-experts layers (decoder_sparse_step or mlp_only_layers); only models whose every layer has experts run here".into(),
        ));
    }
    Ok(Some(Experts {
        count,
        per_token: hf.opt_int(&["num_experts_per_tok"])?.unwrap_or(1),
        gating: Gating::Softmax,
        normalize: mixtral || hf.bool("norm_topk_prob")?.unwrap_or(false),
        shared_ffn: hf
            .opt_int(&["shared_expert_intermediate_size"])?
            .filter(|&f| f > 0),
    }))
}

/// The MLP's activation as an HF config names it (`""` when it does not).
fn hf_activation(v: &Json) -> &str {
    ["hidden_activation", "hidden_act", "activation_function"]
        .iter()
        .find_map(|k| v.get(*k).and_then(Json::as_str))
        .unwrap_or("")
}

/// `model_type` and the `architectures` class names of an HF config.
fn hf_names(v: &Json) -> (&str, Vec<&str>) {
    let model_type = v.get("model_type").and_then(Json::as_str).unwrap_or("");
    let classes = v
        .get("architectures")
        .and_then(Json::as_array)
        .map(|a| a.iter().filter_map(Json::as_str).collect())
        .unwrap_or_default();
    (model_type, classes)
}

/// Typed access to an HF config's fields (the first present of several spellings). Absent or
/// null: the default; present: must be valid (never silently the default).
struct Hf<'a>(&'a Json);

impl Hf<'_> {
    fn opt_int(&self, keys: &[&str]) -> Result<Option<usize>, SpecError> {
        for k in keys {
            match self.0.get(*k) {
                None | Some(Json::Null) => continue,
                Some(x) => {
                    return x
                        .as_u64()
                        .and_then(|x| usize::try_from(x).ok())
                        .map(Some)
                        .ok_or_else(|| {
                            SpecError::Config(format!("{k} is {x}, not a non-negative integer"))
                        })
                }
            }
        }
        Ok(None)
    }
    fn int(&self, keys: &[&str]) -> Result<usize, SpecError> {
        self.opt_int(keys)?.ok_or_else(|| {
            missing(
                keys[0],
                "config.json lacks a required field; use the config.json that came with the model",
            )
        })
    }
    fn float(&self, k: &str, default: f64) -> Result<f64, SpecError> {
        match self.0.get(k) {
            None | Some(Json::Null) => Ok(default),
            Some(x) => x
                .as_f64()
                .ok_or_else(|| SpecError::Config(format!("{k} is {x}, not a number"))),
        }
    }
    fn bool(&self, k: &str) -> Result<Option<bool>, SpecError> {
        match self.0.get(k) {
            None | Some(Json::Null) => Ok(None),
            Some(x) => x
                .as_bool()
                .map(Some)
                .ok_or_else(|| SpecError::Config(format!("{k} is {x}, not true or false"))),
        }
    }
}

impl ModelConfig {
    /// From GGUF metadata; see [`Dims::from_gguf`]. A mixture-of-experts architecture name is
    /// [`SpecError::Experts`]; an unknown one [`SpecError::UnsupportedArch`].
    pub fn from_gguf(
        md: &dyn Metadata,
        embed_rows: Option<usize>,
        has_output: bool,
    ) -> Result<Self, SpecError> {
        let name = match md.meta("general.architecture") {
            Some(MetaValue::Text(a)) => a,
            _ => String::new(),
        };
        if is_unsupported_moe_name(&name) {
            // Refused as what it is, even when its sizes cannot be read.
            let d = Dims::from_gguf(md, embed_rows, has_output).ok();
            return Err(moe_error(&name, d.as_ref()));
        }
        // An unknown architecture is named before any of its keys is looked for.
        let arch = match Arch::from_gguf(&name) {
            Ok(a) => a,
            Err(e) if !name.is_empty() => return Err(e),
            Err(_) => Arch::Llama, // Dims names the missing key.
        };
        let d = Dims::from_gguf(md, embed_rows, has_output)?;
        let g = Gguf {
            md,
            arch: d.arch_name.clone(),
        };
        let block = match arch {
            Arch::Gemma3 => gemma3::gguf_block(&g, &d)?,
            Arch::Olmoe => BlockStyle::OLMOE,
            _ => BlockStyle::LLAMA,
        };
        let cfg = ModelConfig {
            rms_eps: g.float("attention.layer_norm_rms_epsilon", 1e-5)?,
            rope_theta: g.float("rope.freq_base", 10_000.0)?,
            rope_style: RopeStyle::of_gguf(arch),
            qkv_bias: arch == Arch::Qwen2,
            qk_norm: arch.has_qk_norm(),
            block,
            ..Self::from_dims(arch, d)
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// From the text of an HF `config.json` (`LlamaForCausalLM`, `Qwen2ForCausalLM`, or their
    /// model_type).
    pub fn from_hf_json(text: &str) -> Result<Self, SpecError> {
        let v: Json = serde_json::from_str(text)
            .map_err(|e| SpecError::Config(format!("config.json is not valid JSON: {e}")))?;
        let (model_type, classes) = hf_names(&v);
        let arch = match Arch::from_hf(model_type, &classes) {
            Ok(a) => a,
            Err(e) => {
                let moe = is_unsupported_moe_name(model_type)
                    || classes.iter().any(|c| is_unsupported_moe_name(c));
                let name = if model_type.is_empty() {
                    classes.join(",")
                } else {
                    model_type.to_string()
                };
                return Err(if moe {
                    moe_error(&name, Dims::from_hf(&v).ok().as_ref())
                } else {
                    e
                });
            }
        };
        let d = Dims::from_hf(&v)?;
        let hf = Hf(&v);
        let block = match arch {
            Arch::Gemma3 => gemma3::hf_block(&v, &d)?,
            Arch::Olmoe => BlockStyle::OLMOE,
            _ => BlockStyle::LLAMA,
        };
        if !matches!(v.get("clip_qkv"), None | Some(Json::Null)) {
            return Err(SpecError::Config(format!(
                "clip_qkv is {}: clamping the Q/K/V projections is not implemented here; only \
                 configs with clip_qkv null (OLMoE-1B-7B's) run",
                v["clip_qkv"]
            )));
        }
        let cfg = ModelConfig {
            // transformers' default for Llama and Qwen configs.
            rms_eps: hf.float("rms_norm_eps", 1e-6)?,
            rope_theta: hf.float("rope_theta", 10_000.0)?,
            rope_style: RopeStyle::RotateHalf,
            qkv_bias: arch == Arch::Qwen2 || hf.bool("attention_bias")? == Some(true),
            qk_norm: arch.has_qk_norm(),
            // transformers' default is tied for Gemma (untied for the others); an explicit
            // `false` unties it there too.
            tied_embeddings: match arch {
                Arch::Gemma3 => hf.bool("tie_word_embeddings")?.unwrap_or(true),
                _ => d.tied_embeddings,
            },
            block,
            ..Self::from_dims(arch, d)
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The sizes of `d` with Llama's defaults for the rest (callers set them).
    fn from_dims(arch: Arch, d: Dims) -> Self {
        ModelConfig {
            arch,
            layers: d.layers,
            hidden: d.hidden,
            ffn: d.ffn,
            heads: d.heads,
            kv_heads: d.kv_heads,
            head_dim: d.head_dim,
            vocab: d.vocab,
            rms_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_style: RopeStyle::RotateHalf,
            context: d.context,
            qkv_bias: false,
            qk_norm: false,
            tied_embeddings: d.tied_embeddings,
            block: BlockStyle::LLAMA,
            experts: d.experts,
        }
    }

    /// The HF class of this model (`MixtralForCausalLM` for a Llama with experts).
    pub fn hf_class(&self) -> &'static str {
        match (self.experts, self.arch.moe_hf_names()) {
            (Some(_), Some((class, _))) => class,
            _ => self.arch.hf_class(),
        }
    }

    /// The HF `config.json` of this model (the class and `model_type` of its architecture).
    pub fn to_hf_json(&self) -> Json {
        let mut v = serde_json::json!({
            "architectures": [self.hf_class()],
            "model_type": self.arch.name(),
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.context,
            "tie_word_embeddings": self.tied_embeddings,
            "hidden_act": self.block.activation.hf_name(),
            "torch_dtype": "float32",
        });
        v["attention_bias"] = self.qkv_bias.into();
        v["mlp_bias"] = false.into();
        if matches!(self.arch, Arch::Qwen2 | Arch::Qwen3) {
            v["sliding_window"] = self.context.into();
            v["max_window_layers"] = self.layers.into();
            v["use_sliding_window"] = false.into();
        }
        if self.arch == Arch::Gemma3 {
            gemma3::hf_fields(self, &mut v);
        }
        if let (Some(e), Some((class, model_type))) = (self.experts, self.arch.moe_hf_names()) {
            v["architectures"] = serde_json::json!([class]);
            v["model_type"] = model_type.into();
            v["num_local_experts"] = e.count.into();
            v["num_experts"] = e.count.into();
            v["num_experts_per_tok"] = e.per_token.into();
            v["moe_intermediate_size"] = self.ffn.into();
            v["norm_topk_prob"] = e.normalize.into();
            v["shared_expert_intermediate_size"] = e.shared_ffn.unwrap_or(0).into();
            v["decoder_sparse_step"] = 1.into();
            v["mlp_only_layers"] = serde_json::json!([]);
        }
        v
    }

    /// The GGUF `general.architecture` of this model (`qwen3moe` for Qwen3 with experts).
    pub fn gguf_arch_name(&self) -> &'static str {
        match self.experts {
            Some(_) => self.arch.moe_gguf_name().unwrap_or(self.arch.name()),
            None => self.arch.name(),
        }
    }

    /// Refuses what no engine here runs (experts in a family without an MoE form, sigmoid
    /// gating, a shared expert outside Qwen2-MoE), before anything loads.
    pub fn check_runnable(&self) -> Result<(), SpecError> {
        let Some(e) = self.experts else {
            return Ok(());
        };
        let refuse = |why: &str| {
            Err(SpecError::Experts {
                arch: format!("{} {why}", self.gguf_arch_name()),
                experts: e.count,
                used: e.per_token,
            })
        };
        if self.arch.moe_gguf_name().is_none() {
            return refuse("(this family has no mixture-of-experts form here)");
        }
        if e.gating != Gating::Softmax {
            return refuse("(sigmoid expert gating)");
        }
        Ok(())
    }

    /// Checks relations a loader relies on, so a bad file fails here with a clear message.
    pub fn validate(&self) -> Result<(), SpecError> {
        let bad = |m: String| Err(SpecError::Config(m));
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
        let b = &self.block;
        if !positive(b.rope_scale) || b.query_scale.is_some_and(|q| !positive(q)) {
            return bad(format!(
                "RoPE scaling {} and query scale {:?} must be positive and finite",
                b.rope_scale, b.query_scale
            ));
        }
        if let Some(w) = b.sliding {
            if w.window == 0 || w.period == 0 || !positive(w.rope_theta) {
                return bad(format!(
                    "a sliding window of {} positions every {} layers with RoPE base {}: each must be positive",
                    w.window, w.period, w.rope_theta
                ));
            }
        }
        if let Some(e) = self.experts {
            if e.per_token == 0 || e.per_token > e.count {
                return bad(format!(
                    "{} experts per token of {} experts; it must be between 1 and the expert count",
                    e.per_token, e.count
                ));
            }
        }
        if self.checked_parameter_count().is_none() {
            return bad(format!(
                "sizes overflow: {} layers of hidden {}, ffn {}, {} heads of {} and vocab {}",
                self.layers, self.hidden, self.ffn, self.heads, self.head_dim, self.vocab
            ));
        }
        Ok(())
    }

    /// The factor queries are scaled by before their dot products with the keys.
    pub fn query_scale(&self) -> f64 {
        self.block
            .query_scale
            .unwrap_or(1.0 / (self.head_dim as f64).sqrt())
    }

    /// The window of `layer`'s attention (`None`: every earlier position).
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.block
            .sliding
            .filter(|s| s.is_local(layer))
            .map(|s| s.window)
    }

    /// The RoPE base and linear position scale of `layer` (Gemma-3's local layers have their
    /// own base and no scaling).
    pub fn rope(&self, layer: usize) -> (f64, f64) {
        match self.block.sliding.filter(|s| s.is_local(layer)) {
            Some(s) => (s.rope_theta, 1.0),
            None => (self.rope_theta, self.block.rope_scale),
        }
    }

    /// Query heads sharing one KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
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
        let qk_norms = match (self.qk_norm, self.block.qk_norm_whole) {
            (false, _) => 0,
            (true, false) => 2 * self.head_dim,
            (true, true) => q.checked_add(kv)?,
        };
        let post_norms = if self.block.post_norms { 2 } else { 0 };
        let (experts, router) = match self.experts {
            Some(e) => (e.count, e.count.checked_mul(self.hidden)?),
            None => (1, 0),
        };
        // Qwen2-MoE's shared expert and its gate vector.
        let shared = match self.experts.and_then(|e| e.shared_ffn) {
            Some(f) => self
                .hidden
                .checked_mul(f)?
                .checked_mul(3)?
                .checked_add(self.hidden)?,
            None => 0,
        };
        let mlp = self
            .hidden
            .checked_mul(self.ffn)?
            .checked_mul(3)?
            .checked_mul(experts)?
            .checked_add(router)?
            .checked_add(shared)?;
        let block = attn
            .checked_add(bias)?
            .checked_add(qk_norms)?
            .checked_add(mlp)?
            .checked_add(self.hidden.checked_mul(2 + post_norms)?)?;
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

    /// Parameters one token runs through: [`ModelConfig::parameter_count`] less, in a mixture
    /// of experts, the gate, up and down of the experts a token is not routed to (saturating).
    pub fn active_parameter_count(&self) -> usize {
        let idle = self.experts.map_or(0, |e| {
            let per_expert = 3usize.saturating_mul(self.hidden).saturating_mul(self.ffn);
            self.layers
                .saturating_mul(e.count.saturating_sub(e.per_token))
                .saturating_mul(per_expert)
        });
        self.parameter_count().saturating_sub(idle)
    }
}

/// The refusal of a mixture-of-experts architecture `arch`, with its expert counts where its
/// sizes could be read.
fn moe_error(arch: &str, d: Option<&Dims>) -> SpecError {
    let (experts, used) = d
        .and_then(|d| d.experts)
        .map_or((0, 0), |e| (e.count, e.per_token));
    SpecError::Experts {
        arch: arch.to_string(),
        experts,
        used,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::Activation;
    use std::collections::HashMap;

    fn gguf(arch: &str, extra: &[(&str, u64)]) -> HashMap<String, MetaValue> {
        let mut m = HashMap::new();
        m.insert(
            "general.architecture".to_string(),
            MetaValue::Text(arch.to_string()),
        );
        for (k, v) in [
            ("block_count", 2),
            ("embedding_length", 64),
            ("feed_forward_length", 128),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 2),
            ("context_length", 256),
        ]
        .into_iter()
        .chain(extra.iter().copied())
        {
            m.insert(format!("{arch}.{k}"), MetaValue::Uint(v));
        }
        m
    }

    #[test]
    fn gguf_and_hf_readers_agree_on_a_llama() {
        let g = ModelConfig::from_gguf(&gguf("llama", &[]), Some(100), false).unwrap();
        assert_eq!(
            (g.arch, g.head_dim, g.vocab, g.context),
            (Arch::Llama, 16, 100, 256)
        );
        assert_eq!(g.rope_style, RopeStyle::Interleaved);
        assert!(g.tied_embeddings && g.experts.is_none());
        let h = ModelConfig::from_hf_json(&g.to_hf_json().to_string()).unwrap();
        assert_eq!(
            h,
            ModelConfig {
                rope_style: RopeStyle::RotateHalf,
                ..g.clone()
            }
        );
        let q = ModelConfig::from_gguf(&gguf("qwen2", &[]), Some(100), true).unwrap();
        assert!(q.qkv_bias && !q.tied_embeddings && q.rope_style == RopeStyle::RotateHalf);
        assert_eq!(
            ModelConfig::from_hf_json(&q.to_hf_json().to_string()).unwrap(),
            q
        );
    }

    #[test]
    fn top_k_takes_the_best_experts_and_ties_to_the_lower() {
        let e = Experts::new(5, 3);
        assert_eq!(e.top_k(&[0.1, 0.3, 0.05, 0.3, 0.25]), [1, 3, 4]);
        assert_eq!(e.top_k(&[0.2; 5]), [0, 1, 2]);
    }

    #[test]
    fn mixtures_of_experts_are_read_with_their_routers() {
        // Mixtral's GGUF says `llama` with an expert count.
        let md = gguf("llama", &[("expert_count", 8), ("expert_used_count", 2)]);
        let c = ModelConfig::from_gguf(&md, Some(100), true).unwrap();
        assert_eq!(c.experts, Some(Experts::new(8, 2)));
        c.check_runnable().unwrap();
        assert_eq!(c.gguf_arch_name(), "llama");
        // Qwen2-MoE: top-k weights not normalised, a shared expert.
        let md = gguf(
            "qwen2moe",
            &[
                ("expert_count", 60),
                ("expert_used_count", 4),
                ("expert_feed_forward_length", 32),
                ("expert_shared_feed_forward_length", 64),
            ],
        );
        let c = ModelConfig::from_gguf(&md, Some(100), true).unwrap();
        let e = c.experts.unwrap();
        assert!(!e.normalize && e.shared_ffn == Some(64) && c.ffn == 32 && c.qkv_bias);
        assert_eq!(c.gguf_arch_name(), "qwen2moe");
        assert_eq!(Dims::from_gguf(&md, Some(100), true).unwrap().ffn, 32);
        // Through HF config.json and back.
        assert_eq!(
            ModelConfig::from_hf_json(&c.to_hf_json().to_string()).unwrap(),
            c
        );
        let q3 = gguf("qwen3moe", &[("expert_count", 8), ("expert_used_count", 2)]);
        let c = ModelConfig::from_gguf(&q3, Some(100), true).unwrap();
        assert!(c.experts.unwrap().normalize && c.qk_norm && c.arch == Arch::Qwen3);
        let hf = r#"{"architectures":["MixtralForCausalLM"],"model_type":"mixtral","hidden_size":64,
            "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"vocab_size":100,"num_local_experts":8,"num_experts_per_tok":2,
            "hidden_act":"silu"}"#;
        let m = ModelConfig::from_hf_json(hf).unwrap();
        assert_eq!((m.arch, m.experts), (Arch::Llama, Some(Experts::new(8, 2))));
        // Top-k of 0 or above the expert count, and unknown MoE families, are refused.
        for k in [0, 9] {
            let md = gguf("llama", &[("expert_count", 8), ("expert_used_count", k)]);
            let e = ModelConfig::from_gguf(&md, Some(100), true)
                .unwrap_err()
                .to_string();
            assert!(e.contains("between 1 and the expert count"), "{e}");
        }
        let e =
            ModelConfig::from_gguf(&gguf("deepseek2", &[("expert_count", 64)]), Some(100), true)
                .unwrap_err()
                .to_string();
        assert!(e.contains("deepseek2") && e.contains("cannot run"), "{e}");
        // OLMoE: q/k norms over the whole projections, top-k weights not normalised (llama.cpp
        // runs olmoe without `expert_weights_norm`), rotate-half RoPE; HF the same.
        let md = gguf("olmoe", &[("expert_count", 64), ("expert_used_count", 8)]);
        let o = ModelConfig::from_gguf(&md, Some(100), true).unwrap();
        assert_eq!(o.arch, Arch::Olmoe);
        assert!(o.qk_norm && o.block.qk_norm_whole && !o.experts.unwrap().normalize);
        assert_eq!(o.rope_style, RopeStyle::RotateHalf);
        o.check_runnable().unwrap();
        let mut hf = o.to_hf_json();
        assert_eq!(hf["model_type"], "olmoe");
        assert_eq!(
            ModelConfig::from_hf_json(&hf.to_string()).unwrap().block,
            o.block
        );
        hf["clip_qkv"] = 8.into();
        let e = ModelConfig::from_hf_json(&hf.to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("clip_qkv"), "{e}");
        let sig = gguf(
            "qwen3moe",
            &[
                ("expert_count", 8),
                ("expert_used_count", 2),
                ("expert_gating_func", 2),
            ],
        );
        let c = ModelConfig::from_gguf(&sig, Some(100), true).unwrap();
        assert!(c
            .check_runnable()
            .unwrap_err()
            .to_string()
            .contains("sigmoid"));
    }

    #[test]
    fn unsupported_architectures_are_named_before_their_keys() {
        let mut md = HashMap::new();
        md.insert(
            "general.architecture".into(),
            MetaValue::Text("gemma2".into()),
        );
        let e = ModelConfig::from_gguf(&md, None, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"gemma2\"") && e.contains("supported: llama"),
            "{e}"
        );
        let e = ModelConfig::from_hf_json(r#"{"model_type":"phi3"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"phi3\"") && e.contains("gemma3"), "{e}");
        // Present but mistyped keys are errors, not defaults.
        let mut md = gguf("llama", &[]);
        md.insert(
            "llama.context_length".into(),
            MetaValue::Text("long".into()),
        );
        let e = ModelConfig::from_gguf(&md, Some(10), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("llama.context_length") && e.contains("not a non-negative integer"),
            "{e}"
        );
        let e = ModelConfig::from_hf_json(r#"{"model_type":"llama","hidden_size":-1}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden_size is -1"), "{e}");
    }

    /// Gemma-3-270M's header (the keys its GGUF carries) and its HF config read alike.
    #[test]
    fn gemma3_gguf_and_hf_readers_agree() {
        let mut md = gguf(
            "gemma3",
            &[
                ("attention.key_length", 256),
                ("attention.sliding_window", 512),
            ],
        );
        md.insert("gemma3.attention.head_count_kv".into(), MetaValue::Uint(1));
        md.insert("gemma3.rope.freq_base".into(), MetaValue::Float(1e6));
        let g = ModelConfig::from_gguf(&md, Some(100), false).unwrap();
        assert_eq!((g.arch, g.head_dim, g.kv_heads), (Arch::Gemma3, 256, 1));
        assert!(g.qk_norm && g.tied_embeddings && g.block.post_norms && g.block.embed_scale);
        assert_eq!(g.block.activation, Activation::GeluTanh);
        assert_eq!(g.query_scale(), 1.0 / 16.0);
        assert_eq!(
            (g.window(0), g.window(4), g.window(5), g.window(11)),
            (Some(512), Some(512), None, None)
        );
        assert_eq!(g.block.sliding.unwrap().rope_theta, 10_000.0);
        let text = g.to_hf_json().to_string();
        assert!(text.contains("\"gemma3_text\"") && text.contains("gelu_pytorch_tanh"));
        assert_eq!(ModelConfig::from_hf_json(&text).unwrap(), g);
        // Post norms: two more vectors a layer than Qwen3's block.
        let q3 = ModelConfig {
            arch: Arch::Qwen3,
            block: BlockStyle::LLAMA,
            ..g.clone()
        };
        assert_eq!(g.parameter_count() - q3.parameter_count(), 2 * 2 * 64);
        // HF spellings: layer_types, linear RoPE scaling, an explicit query scalar.
        let mut v = g.to_hf_json();
        v["layer_types"] = serde_json::json!(["sliding_attention", "full_attention"]);
        v["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 8.0});
        v["query_pre_attn_scalar"] = 64.into();
        let h = ModelConfig::from_hf_json(&v.to_string()).unwrap();
        assert_eq!(h.block.sliding.unwrap().period, 2);
        assert_eq!((h.block.rope_scale, h.query_scale()), (8.0, 0.125));
        // Local layers: their own base, unscaled; global ones: the model's, scaled.
        assert_eq!((h.rope(0), h.rope(1)), ((10_000.0, 1.0), (1e6, 8.0)));
        // Tied unless the config unties it (transformers' default for Gemma is tied).
        assert!(h.tied_embeddings);
        v.as_object_mut().unwrap().remove("tie_word_embeddings");
        assert!(
            ModelConfig::from_hf_json(&v.to_string())
                .unwrap()
                .tied_embeddings
        );
        v["tie_word_embeddings"] = false.into();
        assert!(
            !ModelConfig::from_hf_json(&v.to_string())
                .unwrap()
                .tied_embeddings
        );
        // What no engine here computes is refused by name.
        for (k, val, says) in [
            (
                "final_logit_softcapping",
                serde_json::json!(30.0),
                "soft-capping",
            ),
            (
                "rope_scaling",
                serde_json::json!({"rope_type": "yarn"}),
                "linear",
            ),
            ("hidden_activation", serde_json::json!("relu"), "relu"),
            (
                "layer_types",
                serde_json::json!(["full_attention", "sliding_attention"]),
                "pattern",
            ),
            ("text_config", serde_json::json!({}), "vision-language"),
        ] {
            let mut bad = g.to_hf_json();
            bad[k] = val;
            let e = ModelConfig::from_hf_json(&bad.to_string())
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{k}: {e}");
        }
    }

    #[test]
    fn parameter_count_counts_experts_and_their_router() {
        let dense = ModelConfig::from_gguf(&gguf("llama", &[]), Some(100), true).unwrap();
        let moe = ModelConfig {
            experts: Some(Experts::new(8, 2)),
            ..dense.clone()
        };
        let mlp = 3 * 64 * 128;
        assert_eq!(
            moe.parameter_count() - dense.parameter_count(),
            2 * (7 * mlp + 8 * 64)
        );
        // A token runs through 2 of the 8 experts (and the router).
        assert_eq!(dense.active_parameter_count(), dense.parameter_count());
        assert_eq!(
            moe.active_parameter_count() - dense.active_parameter_count(),
            2 * (mlp + 8 * 64)
        );
    }
}
