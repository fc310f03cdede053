//! Gemma-3's block read from GGUF metadata and HF `config.json`, and written back.

use super::{Dims, Gguf, Hf, Json, ModelConfig};
use crate::block::{Activation, BlockStyle, SlidingWindow};
use crate::config::MetaValue;
use crate::error::SpecError;

/// Layers of Gemma-3-27B, the one size whose queries are scaled by `hidden / heads` rather
/// than `head_dim` (its GGUF does not say so; llama.cpp decides by the layer count too).
const GEMMA3_27B_LAYERS: usize = 62;

/// Layers per global layer when a file does not say (every Gemma-3 size: 5 local, 1 global).
const DEFAULT_PERIOD: usize = 6;

/// RoPE base of the local layers when a file does not say.
const DEFAULT_LOCAL_THETA: f64 = 10_000.0;

/// From `gemma3.*` keys: the window, its period and local base where given, linear RoPE
/// scaling of the global layers.
pub(super) fn gguf_block(g: &Gguf<'_>, d: &Dims) -> Result<BlockStyle, SpecError> {
    let mut b = BlockStyle::gemma3(g.int("attention.sliding_window")?);
    if let Some(s) = b.sliding.as_mut() {
        s.period = g
            .opt_int("attention.sliding_window_pattern")?
            .unwrap_or(DEFAULT_PERIOD);
        s.rope_theta = g.float("rope.freq_base_swa", DEFAULT_LOCAL_THETA)?;
    }
    let key = format!("{}.rope.scaling.type", g.arch);
    match g.md.meta(&key) {
        None => {}
        Some(MetaValue::Text(t)) if t == "linear" || t == "none" => {}
        Some(v) => {
            return Err(SpecError::Config(format!(
                "{key} is {v:?}; Gemma-3 models here support linear RoPE scaling only"
            )))
        }
    }
    b.rope_scale = g.float("rope.scaling.factor", 1.0)?;
    if d.layers == GEMMA3_27B_LAYERS {
        b.query_scale = Some(1.0 / (d.hidden as f64 / d.heads.max(1) as f64).sqrt());
    }
    Ok(b)
}

/// From a `Gemma3ForCausalLM` (`gemma3_text`) config.
pub(super) fn hf_block(v: &Json, d: &Dims) -> Result<BlockStyle, SpecError> {
    if v.get("text_config").is_some() {
        return Err(SpecError::Config(
            "a Gemma-3 vision-language config (text_config inside); give a text-only Gemma3ForCausalLM checkpoint".into(),
        ));
    }
    let hf = Hf(v);
    for k in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if !matches!(v.get(k), None | Some(Json::Null)) {
            return Err(SpecError::Config(format!(
                "{k} is set; logit soft-capping (Gemma-2) is not supported"
            )));
        }
    }
    let act = super::hf_activation(v);
    let activation = Activation::from_hf(act).ok_or_else(|| {
        SpecError::Config(format!(
            "hidden_activation {act:?}: Gemma-3 computes gelu_pytorch_tanh"
        ))
    })?;
    let window = hf.int(&["sliding_window"])?;
    let period = match v.get("layer_types").and_then(Json::as_array) {
        Some(kinds) => period_of(kinds, d.layers)?,
        None => hf
            .opt_int(&["sliding_window_pattern"])?
            .unwrap_or(DEFAULT_PERIOD),
    };
    let rope_scale = match v.get("rope_scaling") {
        None | Some(Json::Null) => 1.0,
        Some(r) => {
            let kind = r
                .get("rope_type")
                .or_else(|| r.get("type"))
                .and_then(Json::as_str);
            if kind != Some("linear") {
                return Err(SpecError::Config(format!(
                    "rope_scaling {r}: Gemma-3 models here support linear RoPE scaling only"
                )));
            }
            Hf(r).float("factor", 1.0)?
        }
    };
    let pre_attn = hf.float("query_pre_attn_scalar", d.head_dim as f64)?;
    Ok(BlockStyle {
        activation,
        // `None` is the default `1 / sqrt(head_dim)`: one spelling of each config.
        query_scale: (pre_attn != d.head_dim as f64).then(|| 1.0 / pre_attn.sqrt()),
        sliding: Some(SlidingWindow {
            window,
            period,
            rope_theta: hf.float("rope_local_base_freq", DEFAULT_LOCAL_THETA)?,
        }),
        rope_scale,
        ..BlockStyle::gemma3(window)
    })
}

/// The period of `layer_types` (`"sliding_attention"` / `"full_attention"`): every
/// `period`-th layer full, the rest sliding.
fn period_of(kinds: &[Json], layers: usize) -> Result<usize, SpecError> {
    let full: Vec<bool> = kinds
        .iter()
        .map(|k| k.as_str() == Some("full_attention"))
        .collect();
    let period = full.iter().position(|&f| f).map_or(layers + 1, |i| i + 1);
    let fits = full.len() == layers
        && full
            .iter()
            .enumerate()
            .all(|(l, &f)| f == (l + 1).is_multiple_of(period));
    if fits {
        Ok(period)
    } else {
        Err(SpecError::Config(format!(
            "layer_types lists {} layers in no repeating pattern of sliding layers ending in a full one; this model has {layers}",
            kinds.len()
        )))
    }
}

/// Writes Gemma-3's fields into an HF config.
pub(super) fn hf_fields(cfg: &ModelConfig, v: &mut Json) {
    let b = &cfg.block;
    v["model_type"] = "gemma3_text".into();
    v["hidden_activation"] = b.activation.hf_name().into();
    let pre_attn = 1.0 / (cfg.query_scale() * cfg.query_scale());
    v["query_pre_attn_scalar"] = if (pre_attn - pre_attn.round()).abs() < 1e-6 {
        (pre_attn.round() as u64).into()
    } else {
        pre_attn.into()
    };
    if let Some(s) = b.sliding {
        v["sliding_window"] = s.window.into();
        v["sliding_window_pattern"] = s.period.into();
        v["rope_local_base_freq"] = s.rope_theta.into();
    }
    v["rope_scaling"] = if b.rope_scale == 1.0 {
        Json::Null
    } else {
        serde_json::json!({"rope_type": "linear", "factor": b.rope_scale})
    };
    v["final_logit_softcapping"] = Json::Null;
    v["attn_logit_softcapping"] = Json::Null;
}
