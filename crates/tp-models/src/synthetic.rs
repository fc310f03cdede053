//! Small random Llama-family checkpoints for tests (feature `test-support`): one set of
//! weights written as a GGUF file (candle's writer; f32 or ggml-quantized) or as an HF
//! directory (config.json + safetensors, optionally sharded with an index).
//!
//! Weights are kept in HF layout (rotate-half RoPE). A `llama` GGUF stores Q and K rows in
//! llama.cpp's permuted order (interleaved RoPE), so the same model written both ways must
//! give the same logits; `qwen2` GGUFs are not permuted.

use crate::checkpoint::GgmlDType;
use crate::checkpoint::{Expected, WeightName};
use crate::config::{Arch, ModelConfig, RopeStyle};
use crate::error::{ModelError, Result};
use crate::gguf::gguf_name;
use crate::hf::hf_name;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::Path;
use tp_spec::Rng;

/// Element type of the tensors of a synthetic HF directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfDType {
    F32,
    F16,
    BF16,
}

/// ggml types of a synthetic GGUF: `linear` for the block projections, `embed` for the
/// embedding and the untied head. Norms and biases are always F32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgufTypes {
    pub linear: GgmlDType,
    pub embed: GgmlDType,
}

impl GgufTypes {
    pub const F32: GgufTypes = GgufTypes {
        linear: GgmlDType::F32,
        embed: GgmlDType::F32,
    };
}

/// A random model: its config (HF semantics: rotate-half RoPE) and weights.
#[derive(Clone, Debug)]
pub struct SyntheticModel {
    pub cfg: ModelConfig,
    /// `(name, shape, values)`, matrices `[out, in]` row-major, in HF layout.
    weights: Vec<(WeightName, Vec<usize>, Vec<f32>)>,
    /// A GGUF holds each layer's experts in merged 3-D tensors (`ffn_gate_exps`, current
    /// llama.cpp) rather than one tensor per expert (`ffn_gate.E`, older Mixtral files).
    pub merged_experts: bool,
}

impl SyntheticModel {
    /// The test shape: 2 layers, hidden 256, 8 query / 2 KV heads of 32 (tp 4 > KV heads),
    /// FFN 544 (17 quant blocks: uneven at tp 2, 3, 4), vocab 1000 (divisible by neither 3
    /// nor 16), context 128. `llama` ties the head to the embedding; `qwen2` has QKV biases
    /// and an untied head; `qwen3` has q/k norms, heads of 64 and an untied head; `olmoe` has
    /// q/k norms over the whole projections and an untied head (give it experts); `gemma3`
    /// is Gemma-3's block with 4 query heads over one KV head of 64 (MQA: every tp > 1
    /// replicates it), layer 0 local with a window of 4 positions (local RoPE base 10 000),
    /// layer 1 global (base 10^6), a tied head.
    pub fn small(arch: Arch, seed: u64) -> Self {
        let gemma = arch == Arch::Gemma3;
        let cfg = ModelConfig {
            arch,
            layers: 2,
            hidden: 256,
            ffn: 544,
            heads: if gemma { 4 } else { 8 },
            kv_heads: if gemma { 1 } else { 2 },
            // Qwen3's heads are wider than hidden / heads (as in Qwen3-0.6B: 16 x 128 > 1024).
            head_dim: if matches!(arch, Arch::Qwen3 | Arch::Gemma3) {
                64
            } else {
                32
            },
            vocab: 1000,
            rms_eps: 1e-5,
            rope_theta: if gemma { 1e6 } else { 10_000.0 },
            rope_style: RopeStyle::RotateHalf,
            context: 128,
            qkv_bias: arch == Arch::Qwen2,
            qk_norm: arch.has_qk_norm(),
            tied_embeddings: matches!(arch, Arch::Llama | Arch::Gemma3),
            block: if gemma {
                let mut b = tp_spec::BlockStyle::gemma3(4);
                if let Some(s) = b.sliding.as_mut() {
                    s.period = 2;
                }
                b
            } else if arch == Arch::Olmoe {
                tp_spec::BlockStyle::OLMOE
            } else {
                tp_spec::BlockStyle::LLAMA
            },
            experts: None,
        };
        Self::new(cfg, seed)
    }

    /// Random weights for `cfg` (uniform, scaled so activations stay of order one), one per
    /// parameter of the table in its order: matrices scaled by their fan-in (the embedding
    /// and the LM head by fixed factors), norm weights near 1, biases near 0.
    pub fn new(cfg: ModelConfig, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let lin = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        let weights = tp_spec::model_params(&cfg)
            .into_iter()
            .map(|p| {
                let (center, spread) = match (p.name, p.shape) {
                    (WeightName::Embed, _) => (0.0, 1.0),
                    (WeightName::Output, _) => (0.0, 0.5),
                    (_, Expected::Matrix { cols, .. }) => (0.0, lin(cols)),
                    (WeightName::QBias(_) | WeightName::KBias(_) | WeightName::VBias(_), _) => {
                        (0.0, 0.3)
                    }
                    (WeightName::SharedExpertGate(_), Expected::Vector { len }) => (0.0, lin(len)),
                    (_, Expected::Vector { .. }) => (1.0, 0.2),
                };
                let dims = p.dims();
                let values = (0..dims.iter().product::<usize>())
                    .map(|_| center + spread * rng.signed_unit())
                    .collect();
                (p.name, dims, values)
            })
            .collect();
        SyntheticModel {
            cfg,
            weights,
            merged_experts: false,
        }
    }

    /// [`SyntheticModel::small`] with a mixture of experts in every layer: `count` experts of
    /// FFN 160 (5 quant blocks: uneven at tp 2, 3 and 4), `per_token` per token, and for
    /// `qwen2` a shared expert of 192 (its top-k weights not normalised, as Qwen2-MoE's; nor
    /// are OLMoE's).
    pub fn small_moe(arch: Arch, count: usize, per_token: usize, seed: u64) -> Self {
        let base = Self::small(arch, seed).cfg;
        let mut experts = crate::Experts::new(count, per_token);
        if arch == Arch::Qwen2 {
            experts.normalize = false;
            experts.shared_ffn = Some(192);
        }
        // OLMoE does not normalise its top-k weights.
        experts.normalize &= arch != Arch::Olmoe;
        let cfg = ModelConfig {
            ffn: 160,
            experts: Some(experts),
            ..base
        };
        Self::new(cfg, seed)
    }

    /// A mixture of `count` experts computing exactly `dense`'s function: each layer's FFN
    /// cut into `count` slices of columns (the experts), a zero router with every expert
    /// active (top-`count`, normalised: weight 1/count each) and each expert's down
    /// projection times `count`. With `count` a power of two both scalings are exact, so the
    /// products are the dense model's and only the order of the (f64) sums differs. Weights
    /// are read as f32 (dequantized); a GGUF `llama`'s Q/K rows are put back in HF order,
    /// as the writer expects.
    pub fn dense_as_experts(dense: &dyn crate::Checkpoint, count: usize) -> Result<Self> {
        let cfg = dense.config();
        if count == 0 || !cfg.ffn.is_multiple_of(count) || cfg.experts.is_some() {
            return Err(ModelError::Input(format!(
                "dense_as_experts: {count} experts cannot split a dense FFN of {}",
                cfg.ffn
            )));
        }
        let (ffn, h) = (cfg.ffn / count, cfg.hidden);
        let moe_cfg = ModelConfig {
            ffn,
            experts: Some(crate::Experts::new(count, count)),
            ..cfg.clone()
        };
        let full = |name: WeightName| dense.vector(name, None);
        let scale = count as f32;
        let mut weights = Vec::new();
        for p in tp_spec::model_params(&moe_cfg) {
            let values = match p.name {
                WeightName::Router(_) => vec![0.0; count * h],
                WeightName::ExpertGate(l, e) => {
                    full(WeightName::Gate(l))?[e * ffn * h..(e + 1) * ffn * h].to_vec()
                }
                WeightName::ExpertUp(l, e) => {
                    full(WeightName::Up(l))?[e * ffn * h..(e + 1) * ffn * h].to_vec()
                }
                WeightName::ExpertDown(l, e) => full(WeightName::Down(l))? // [hidden, ffn_total]
                    .chunks_exact(cfg.ffn)
                    .flat_map(|row| row[e * ffn..(e + 1) * ffn].iter().map(|x| x * scale))
                    .collect(),
                WeightName::Q(_)
                | WeightName::K(_)
                | WeightName::QBias(_)
                | WeightName::KBias(_)
                    if cfg.rope_style == RopeStyle::Interleaved =>
                {
                    unpermute_rows(&full(p.name)?, &p.dims(), cfg.head_dim)
                }
                name => full(name)?,
            };
            weights.push((p.name, p.dims(), values));
        }
        Ok(SyntheticModel {
            cfg: moe_cfg,
            weights,
            merged_experts: false,
        })
    }

    /// Replaces the weights of `name` (same length).
    pub fn set_weight(&mut self, name: WeightName, values: Vec<f32>) -> Result<()> {
        match self.weights.iter_mut().find(|(n, ..)| *n == name) {
            Some((_, _, v)) if v.len() == values.len() => {
                *v = values;
                Ok(())
            }
            _ => Err(ModelError::Input(format!(
                "set_weight: {name:?} is not a weight of this model with {} values",
                values.len()
            ))),
        }
    }

    /// Shape and values of a weight in HF layout.
    pub fn weight(&self, name: WeightName) -> Option<(&[usize], &[f32])> {
        self.weights
            .iter()
            .find(|(n, ..)| *n == name)
            .map(|(_, s, v)| (s.as_slice(), v.as_slice()))
    }

    fn arch_name(&self) -> &'static str {
        self.cfg.gguf_arch_name()
    }

    /// GGUF metadata: the hyper-parameters candle's and our readers need, plus one key of
    /// every GGUF value type (nested and empty arrays included) to exercise header parsers.
    pub fn gguf_metadata(&self) -> Vec<(String, Value)> {
        let a = self.arch_name();
        let c = &self.cfg;
        let u = |x: usize| Value::U32(x as u32);
        let mut md = vec![
            ("general.architecture".to_string(), Value::String(a.into())),
            ("general.name".into(), Value::String("synthetic".into())),
            ("general.alignment".into(), Value::U32(32)),
            (format!("{a}.context_length"), u(c.context)),
            (format!("{a}.embedding_length"), u(c.hidden)),
            (format!("{a}.feed_forward_length"), u(c.ffn)),
            (format!("{a}.block_count"), u(c.layers)),
            (format!("{a}.attention.head_count"), u(c.heads)),
            (format!("{a}.attention.head_count_kv"), u(c.kv_heads)),
            (format!("{a}.rope.dimension_count"), u(c.head_dim)),
            (format!("{a}.attention.key_length"), u(c.head_dim)),
            (format!("{a}.attention.value_length"), u(c.head_dim)),
            // candle's qwen3 computes in f16 unless told the weights are f32.
            ("general.dtype".into(), Value::U32(0)),
            (
                format!("{a}.attention.layer_norm_rms_epsilon"),
                Value::F32(c.rms_eps as f32),
            ),
            (
                format!("{a}.rope.freq_base"),
                Value::F32(c.rope_theta as f32),
            ),
        ];
        if let Some(e) = c.experts {
            md.extend([
                (format!("{a}.expert_count"), u(e.count)),
                (format!("{a}.expert_used_count"), u(e.per_token)),
                (format!("{a}.expert_feed_forward_length"), u(c.ffn)),
                (format!("{a}.expert_weights_norm"), Value::Bool(e.normalize)),
            ]);
            if let Some(s) = e.shared_ffn {
                md.push((format!("{a}.expert_shared_feed_forward_length"), u(s)));
            }
        }
        if let Some(w) = c.block.sliding {
            md.extend([
                (format!("{a}.attention.sliding_window"), u(w.window)),
                (format!("{a}.attention.sliding_window_pattern"), u(w.period)),
                (
                    format!("{a}.rope.freq_base_swa"),
                    Value::F32(w.rope_theta as f32),
                ),
            ]);
        }
        md.extend(self.exerciser_metadata());
        md
    }

    /// The keys [`SyntheticModel::gguf_metadata`] adds for header parsers: a token list and
    /// one key of every GGUF value type (nested and empty arrays included; llama.cpp refuses
    /// nested arrays, so [`SyntheticModel::write_gguf_with`] leaves them out).
    fn exerciser_metadata(&self) -> Vec<(String, Value)> {
        let c = &self.cfg;
        let mut md = Vec::new();
        let tokens = (0..c.vocab).map(|i| Value::String(format!("tok{i}")));
        md.extend([
            ("synthetic.tokens".into(), Value::Array(tokens.collect())),
            (
                "synthetic.scores".into(),
                Value::Array((0..c.vocab).map(|i| Value::F32(-(i as f32))).collect()),
            ),
            ("synthetic.u8".into(), Value::U8(200)),
            ("synthetic.i8".into(), Value::I8(-100)),
            ("synthetic.u16".into(), Value::U16(60_000)),
            ("synthetic.i16".into(), Value::I16(-30_000)),
            ("synthetic.i32".into(), Value::I32(-2_000_000_000)),
            ("synthetic.u64".into(), Value::U64(u64::MAX - 1)),
            ("synthetic.i64".into(), Value::I64(i64::MIN + 1)),
            ("synthetic.f64".into(), Value::F64(std::f64::consts::PI)),
            ("synthetic.bool".into(), Value::Bool(true)),
            ("synthetic.empty".into(), Value::Array(vec![])),
            (
                "synthetic.nested".into(),
                Value::Array(vec![
                    Value::Array(vec![Value::I16(1), Value::I16(-2)]),
                    Value::Array(vec![Value::I16(3)]),
                ]),
            ),
        ]);
        md
    }

    /// The GGUF tensors: ggml-typed, named as llama.cpp names them, Q/K permuted for llama.
    pub fn gguf_tensors(&self, types: GgufTypes) -> Result<Vec<(String, QTensor)>> {
        let dev = Device::Cpu;
        let mut out = Vec::with_capacity(self.weights.len());
        for (name, shape, values, dtype) in self.gguf_values(types) {
            let c = dtype.candle().ok_or_else(|| ModelError::UnsupportedDType {
                name: name.clone(),
                dtype: format!("{dtype:?} (candle cannot hold it; write_gguf can)"),
            })?;
            let t = Tensor::from_vec(values, shape.as_slice(), &dev)?;
            out.push((name, QTensor::quantize(&t, c)?));
        }
        Ok(out)
    }

    /// Every GGUF tensor as (name, shape, f32 values in file order, type to store).
    fn gguf_values(&self, types: GgufTypes) -> Vec<(String, Vec<usize>, Vec<f32>, GgmlDType)> {
        let mut out = Vec::with_capacity(self.weights.len());
        for (name, shape, values) in &self.weights {
            let mut values = values.clone();
            if self.cfg.arch == Arch::Llama {
                if let WeightName::Q(_)
                | WeightName::K(_)
                | WeightName::QBias(_)
                | WeightName::KBias(_) = name
                {
                    values = permute_rows_for_interleaved(&values, shape, self.cfg.head_dim);
                }
            }
            let dtype = match (name, shape.len()) {
                (_, 1) => GgmlDType::F32,
                (WeightName::Embed | WeightName::Output, _) => types.embed,
                _ => types.linear,
            };
            out.push((gguf_name(*name), shape.clone(), values, dtype));
        }
        if self.merged_experts {
            out = merge_experts(out, &self.weights);
        }
        out
    }

    /// Writes the model as a GGUF file: through candle's writer, or for IQ4_NL / IQ4_XS
    /// tensors (which candle cannot hold; quantized by [`quantize_iq4`]) through
    /// [`write_gguf_blocks`].
    pub fn write_gguf(&self, path: &Path, types: GgufTypes) -> Result<()> {
        self.write_gguf_metadata(path, types, self.gguf_metadata())
    }

    /// [`SyntheticModel::write_gguf`] with `extra` metadata (a real model's tokenizer keys)
    /// in place of the header exerciser keys, so that other readers (llama.cpp) open it.
    pub fn write_gguf_with(
        &self,
        path: &Path,
        types: GgufTypes,
        extra: Vec<(String, Value)>,
    ) -> Result<()> {
        let exerciser: Vec<String> = self.exerciser_metadata().into_iter().map(|e| e.0).collect();
        let mut md: Vec<(String, Value)> = self
            .gguf_metadata()
            .into_iter()
            .filter(|(k, _)| !exerciser.contains(k))
            .collect();
        md.extend(extra);
        self.write_gguf_metadata(path, types, md)
    }

    /// The model's tensors as a GGUF file with `md` as its metadata.
    fn write_gguf_metadata(
        &self,
        path: &Path,
        types: GgufTypes,
        md: Vec<(String, Value)>,
    ) -> Result<()> {
        if types.linear.candle().is_some() && types.embed.candle().is_some() {
            return write_gguf(path, &md, &self.gguf_tensors(types)?);
        }
        let dev = Device::Cpu;
        let mut tensors = Vec::new();
        for (name, shape, values, dtype) in self.gguf_values(types) {
            let bytes = match dtype.candle() {
                Some(c) => {
                    let t = Tensor::from_vec(values, shape.as_slice(), &dev)?;
                    QTensor::quantize(&t, c)?.data()?.into_owned()
                }
                None => quantize_iq4(dtype, &values)?,
            };
            tensors.push((name, shape, dtype, bytes));
        }
        write_gguf_blocks(path, &md, &tensors)
    }

    /// `config.json` of the HF directory.
    pub fn hf_config_json(&self) -> serde_json::Value {
        self.cfg.to_hf_json()
    }

    /// HF tensors `(name, shape, values)`.
    pub fn hf_tensors(&self) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        self.weights
            .iter()
            .map(|(n, s, v)| {
                let mut v = v.clone();
                if self.cfg.block.hf_norm_minus_one && n.is_norm() {
                    v.iter_mut().for_each(|x| *x -= 1.0);
                }
                // transformers stores the shared expert's gate as a [1, hidden] linear layer.
                let shape = match n {
                    WeightName::SharedExpertGate(_) => vec![1, s[0]],
                    _ => s.clone(),
                };
                (hf_name(self.cfg.arch, *n), shape, v)
            })
            .collect()
    }

    /// Writes `config.json` and the weights into `dir`: `model.safetensors` for one shard,
    /// else `model-0000i-of-0000n.safetensors` files and `model.safetensors.index.json`.
    pub fn write_hf(&self, dir: &Path, shards: usize, dtype: HfDType) -> Result<()> {
        let io = |p: &Path| {
            let shown = p.display().to_string();
            move |source| ModelError::Io {
                path: shown,
                source,
            }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let config = dir.join("config.json");
        let text = serde_json::to_string_pretty(&self.hf_config_json())
            .map_err(|e| ModelError::Input(e.to_string()))?;
        std::fs::write(&config, text).map_err(io(&config))?;
        let tensors = self.hf_tensors();
        let shards = shards.clamp(1, tensors.len());
        if shards == 1 {
            return write_safetensors(&dir.join("model.safetensors"), &tensors, dtype);
        }
        let per = tensors.len().div_ceil(shards);
        let mut weight_map = serde_json::Map::new();
        for (i, part) in tensors.chunks(per).enumerate() {
            let file = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
            write_safetensors(&dir.join(&file), part, dtype)?;
            for (name, ..) in part {
                weight_map.insert(name.clone(), file.clone().into());
            }
        }
        let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
        let path = dir.join("model.safetensors.index.json");
        std::fs::write(&path, index.to_string()).map_err(io(&path))?;
        Ok(())
    }
}

/// GGUF tensors with each layer's expert projections stacked into merged 3-D tensors
/// (`blk.N.ffn_gate_exps.weight`, `[experts, rows, cols]`, in expert order) where the first
/// expert's stood.
fn merge_experts(
    tensors: Vec<(String, Vec<usize>, Vec<f32>, GgmlDType)>,
    weights: &[(WeightName, Vec<usize>, Vec<f32>)],
) -> Vec<(String, Vec<usize>, Vec<f32>, GgmlDType)> {
    let mut out: Vec<(String, Vec<usize>, Vec<f32>, GgmlDType)> = Vec::new();
    for (t, (w, ..)) in tensors.into_iter().zip(weights) {
        match tp_spec::gguf_merged_name(*w) {
            None => out.push(t),
            Some((merged, _)) => match out.iter_mut().find(|m| m.0 == merged) {
                Some(m) => {
                    m.1[0] += 1;
                    m.2.extend_from_slice(&t.2);
                }
                None => {
                    let mut shape = vec![1];
                    shape.extend_from_slice(&t.1);
                    out.push((merged, shape, t.2, t.3));
                }
            },
        }
    }
    out
}

pub use tp_spec::rope_rows::{permute_rows_for_interleaved, unpermute_rows};

/// Writes a GGUF file with candle's writer (version 2, alignment 32).
pub fn write_gguf(
    path: &Path,
    metadata: &[(String, Value)],
    tensors: &[(String, QTensor)],
) -> Result<()> {
    let mut file = std::fs::File::create(path).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut file, &md, &ts)?;
    Ok(())
}

/// `values` as IQ4_NL or IQ4_XS ggml bytes, by tp-kernels' reference quantizer.
pub fn quantize_iq4(dtype: GgmlDType, values: &[f32]) -> Result<Vec<u8>> {
    let qtype = match dtype {
        GgmlDType::IQ4_NL => tp_kernels::QuantType::IQ4_NL,
        GgmlDType::IQ4_XS => tp_kernels::QuantType::IQ4_XS,
        other => {
            return Err(ModelError::Input(format!(
                "quantize_iq4: {other:?} is not an IQ4 type"
            )))
        }
    };
    tp_kernels::quantize_iq4(qtype, values).map_err(|e| ModelError::Input(e.to_string()))
}

/// One GGUF metadata value (type id, then the value), as the GGUF spec lays it out.
fn put_value(w: &mut Vec<u8>, v: &Value, with_type: bool) {
    let (id, bytes): (u32, Vec<u8>) = match v {
        Value::U8(x) => (0, vec![*x]),
        Value::I8(x) => (1, x.to_le_bytes().to_vec()),
        Value::U16(x) => (2, x.to_le_bytes().to_vec()),
        Value::I16(x) => (3, x.to_le_bytes().to_vec()),
        Value::U32(x) => (4, x.to_le_bytes().to_vec()),
        Value::I32(x) => (5, x.to_le_bytes().to_vec()),
        Value::F32(x) => (6, x.to_le_bytes().to_vec()),
        Value::Bool(x) => (7, vec![*x as u8]),
        Value::String(x) => {
            let mut b = (x.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(x.as_bytes());
            (8, b)
        }
        Value::Array(items) => {
            let mut b = Vec::new();
            let elem = items.first().map_or(4, value_type_id);
            b.extend_from_slice(&elem.to_le_bytes());
            b.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(&mut b, item, false);
            }
            (9, b)
        }
        Value::U64(x) => (10, x.to_le_bytes().to_vec()),
        Value::I64(x) => (11, x.to_le_bytes().to_vec()),
        Value::F64(x) => (12, x.to_le_bytes().to_vec()),
    };
    if with_type {
        w.extend_from_slice(&id.to_le_bytes());
    }
    w.extend_from_slice(&bytes);
}

fn value_type_id(v: &Value) -> u32 {
    let mut b = Vec::new();
    put_value(&mut b, v, true);
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Writes a GGUF file (version 3, alignment 32) from raw ggml blocks: `(name, shape, type,
/// bytes)` per tensor, for the types candle's writer cannot take (IQ4_NL, IQ4_XS).
pub fn write_gguf_blocks(
    path: &Path,
    metadata: &[(String, Value)],
    tensors: &[(String, Vec<usize>, GgmlDType, Vec<u8>)],
) -> Result<()> {
    let put_str = |w: &mut Vec<u8>, s: &str| {
        w.extend_from_slice(&(s.len() as u64).to_le_bytes());
        w.extend_from_slice(s.as_bytes());
    };
    let mut w = Vec::new();
    w.extend_from_slice(b"GGUF");
    w.extend_from_slice(&3u32.to_le_bytes());
    w.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    w.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_str(&mut w, k);
        put_value(&mut w, v, true);
    }
    let mut offset = 0u64;
    for (name, shape, dtype, bytes) in tensors {
        put_str(&mut w, name);
        w.extend_from_slice(&(shape.len() as u32).to_le_bytes());
        for &d in shape.iter().rev() {
            w.extend_from_slice(&(d as u64).to_le_bytes());
        }
        w.extend_from_slice(&dtype.type_id().to_le_bytes());
        w.extend_from_slice(&offset.to_le_bytes());
        offset += (bytes.len() as u64).div_ceil(32) * 32;
    }
    w.resize(w.len().div_ceil(32) * 32, 0);
    for (_, _, _, bytes) in tensors {
        w.extend_from_slice(bytes);
        w.resize(w.len().div_ceil(32) * 32, 0);
    }
    std::fs::write(path, w).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Writes `(name, shape, values)` as a safetensors file of `dtype`.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    dtype: HfDType,
) -> Result<()> {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| {
            let bytes = match dtype {
                HfDType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                HfDType::F16 => v
                    .iter()
                    .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                    .collect(),
                HfDType::BF16 => v
                    .iter()
                    .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                    .collect(),
            };
            (n.clone(), s.clone(), bytes)
        })
        .collect();
    let st = match dtype {
        HfDType::F32 => Dtype::F32,
        HfDType::F16 => Dtype::F16,
        HfDType::BF16 => Dtype::BF16,
    };
    let bad = |e: safetensors::SafeTensorError| ModelError::Input(format!("safetensors: {e}"));
    let mut views = Vec::with_capacity(encoded.len());
    for (n, s, b) in &encoded {
        views.push((n.clone(), TensorView::new(st, s.clone(), b).map_err(bad)?));
    }
    let bytes = safetensors::serialize(views, None).map_err(bad)?;
    std::fs::write(path, bytes).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Metadata as a map, as readers return it.
pub fn metadata_map(md: &[(String, Value)]) -> HashMap<String, Value> {
    md.iter().cloned().collect()
}

/// Layer `l`'s mixture of experts alone, whole on one rank (what an oracle of the layer is
/// compared with): its output for the normed input `xn [n, hidden]`, `[n, hidden]` in f64,
/// and the step's expert counts (tokens taken and pairs dropped per expert).
pub fn moe_layer_output(
    ckpt: &dyn crate::Checkpoint,
    l: usize,
    opts: crate::LoadOptions,
    xn: &[f32],
    n: usize,
) -> Result<(Vec<f64>, crate::Profile)> {
    use crate::shard::CheckpointPlan;
    let plan = crate::ShardPlan::for_checkpoint(ckpt, 0, 1)?;
    let layer = crate::moe::MoeLayer::load(ckpt, &plan, l, opts)?;
    let mut out = vec![0f64; n * ckpt.config().hidden]; // [n, hidden]
    let mut prof = crate::Profile::default();
    layer.forward(xn, n, &mut out, &mut prof)?;
    Ok((out, prof))
}
