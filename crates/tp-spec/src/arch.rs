//! Architecture families by their GGUF and Hugging Face names, the supported list, and the
//! mixture-of-experts spellings of the families (Mixtral is a Llama with experts, Qwen2-MoE
//! and Qwen3-MoE are Qwen2 and Qwen3 with experts).

use crate::error::SpecError;

/// Architectures with the Llama block (RMSNorm, RoPE, GQA attention, SwiGLU MLP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    /// Qwen2: Llama plus biases on Q, K and V.
    Qwen2,
    /// Qwen3: Llama plus an RMSNorm over each query and key head (no biases).
    Qwen3,
    /// Gemma-3: Qwen3's q/k norms plus the [`crate::BlockStyle::gemma3`] block (GeGLU, post
    /// norms, scaled embeddings, sliding-window layers).
    Gemma3,
    /// OLMoE: Llama's block with experts, an RMSNorm over the whole query and the whole key
    /// projection (all heads at once: [`crate::BlockStyle::qk_norm_whole`]) before RoPE, and
    /// RoPE on rotate-half pairs.
    Olmoe,
}

/// Every supported architecture: (family, GGUF `general.architecture`, HF `architectures[0]`).
/// OLMoE exists only with experts; its names are also its mixture-of-experts names.
const SUPPORTED: [(Arch, &str, &str); 5] = [
    (Arch::Llama, "llama", "LlamaForCausalLM"),
    (Arch::Qwen2, "qwen2", "Qwen2ForCausalLM"),
    (Arch::Qwen3, "qwen3", "Qwen3ForCausalLM"),
    (Arch::Gemma3, "gemma3", "Gemma3ForCausalLM"),
    (Arch::Olmoe, "olmoe", "OlmoeForCausalLM"),
];

/// HF `model_type` spellings besides the GGUF names: (family, model_type).
const HF_MODEL_TYPES: [(Arch, &str); 1] = [(Arch::Gemma3, "gemma3_text")];

/// Mixture-of-experts spellings of a family: (family, GGUF `general.architecture`, HF class,
/// HF `model_type`). Mixtral's GGUF says `llama` and carries `llama.expert_count`.
const MOE_FAMILIES: [(Arch, &str, &str, &str); 4] = [
    (Arch::Llama, "llama", "MixtralForCausalLM", "mixtral"),
    (Arch::Qwen2, "qwen2moe", "Qwen2MoeForCausalLM", "qwen2_moe"),
    (Arch::Qwen3, "qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
    (Arch::Olmoe, "olmoe", "OlmoeForCausalLM", "olmoe"),
];

/// Mixture-of-experts names this project recognises but cannot run (their layers differ from
/// the families above: DeepSeek-V2/V3's latent attention and grouped sigmoid routing).
const UNSUPPORTED_MOE: [&str; 2] = ["deepseek2", "DeepseekV3ForCausalLM"];

impl Arch {
    /// The GGUF architecture name (`llama`, `qwen2`).
    pub fn name(self) -> &'static str {
        SUPPORTED
            .iter()
            .find(|s| s.0 == self)
            .map_or("llama", |s| s.1)
    }

    /// The HF class name (`LlamaForCausalLM`).
    pub fn hf_class(self) -> &'static str {
        SUPPORTED
            .iter()
            .find(|s| s.0 == self)
            .map_or("LlamaForCausalLM", |s| s.2)
    }

    /// Whether the family RMS-normalises queries and keys before RoPE (per head, or over the
    /// whole projection for OLMoE).
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Gemma3 | Arch::Olmoe)
    }

    /// From a GGUF `general.architecture`.
    /// The MoE spellings (`qwen3moe`) give their family.
    pub fn from_gguf(name: &str) -> Result<Arch, SpecError> {
        SUPPORTED
            .iter()
            .find(|s| s.1 == name)
            .map(|s| s.0)
            .or_else(|| MOE_FAMILIES.iter().find(|m| m.1 == name).map(|m| m.0))
            .ok_or_else(|| SpecError::UnsupportedArch {
                arch: name.to_string(),
            })
    }

    /// The GGUF architecture name of this family with experts (`qwen3moe`; Mixtral: `llama`).
    pub fn moe_gguf_name(self) -> Option<&'static str> {
        MOE_FAMILIES.iter().find(|m| m.0 == self).map(|m| m.1)
    }

    /// The HF class and `model_type` of this family with experts (`Qwen3MoeForCausalLM`,
    /// `qwen3_moe`).
    pub fn moe_hf_names(self) -> Option<(&'static str, &'static str)> {
        MOE_FAMILIES
            .iter()
            .find(|m| m.0 == self)
            .map(|m| (m.2, m.3))
    }

    /// From an HF config's `model_type` (`llama`, `qwen2`) or `architectures` entries.
    pub fn from_hf(model_type: &str, classes: &[&str]) -> Result<Arch, SpecError> {
        if let Some(s) = SUPPORTED
            .iter()
            .find(|s| s.1 == model_type || classes.contains(&s.2))
        {
            return Ok(s.0);
        }
        if let Some(t) = HF_MODEL_TYPES.iter().find(|t| t.1 == model_type) {
            return Ok(t.0);
        }
        if let Some(m) = MOE_FAMILIES
            .iter()
            .find(|m| m.3 == model_type || classes.contains(&m.2))
        {
            return Ok(m.0);
        }
        if model_type.is_empty() && classes.is_empty() {
            return Err(SpecError::MissingMetadata {
                key: "model_type".into(),
                hint: "config.json names no model_type or architectures; it is not a transformers model config".into(),
            });
        }
        let arch = if model_type.is_empty() {
            classes.join(",")
        } else {
            model_type.to_string()
        };
        Err(SpecError::UnsupportedArch { arch })
    }
}

/// `llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM)`: for messages.
pub fn supported_list() -> String {
    SUPPORTED
        .iter()
        .map(|s| format!("{} ({})", s.1, s.2))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether `name` (a GGUF architecture, an HF class or model_type) is a mixture-of-experts
/// family this project does not run.
pub fn is_unsupported_moe_name(name: &str) -> bool {
    UNSUPPORTED_MOE.contains(&name)
}

/// Whether `name` (an HF class or model_type, or a GGUF architecture other than `llama`) names
/// a mixture-of-experts family.
pub fn is_moe_name(name: &str) -> bool {
    is_unsupported_moe_name(name)
        || MOE_FAMILIES
            .iter()
            .any(|m| (m.1 == name && m.1 != "llama") || m.2 == name || m.3 == name)
}

/// How RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (x0,x1),(x2,x3): llama.cpp's permuted Q/K rows of `llama` GGUFs.
    Interleaved,
    /// First half with second half: HF checkpoints and qwen2/qwen3 GGUFs.
    RotateHalf,
}

impl RopeStyle {
    /// The layout a GGUF file of `arch` stores Q and K rows in.
    pub fn of_gguf(arch: Arch) -> RopeStyle {
        match arch {
            Arch::Llama => RopeStyle::Interleaved,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 | Arch::Olmoe => RopeStyle::RotateHalf,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_supported() {
        for (arch, gguf, hf) in SUPPORTED {
            assert_eq!(Arch::from_gguf(gguf), Ok(arch));
            assert_eq!(Arch::from_hf("", &[hf]), Ok(arch));
            assert_eq!(Arch::from_hf(gguf, &[]), Ok(arch));
            assert_eq!((arch.name(), arch.hf_class()), (gguf, hf));
        }
        assert_eq!(Arch::from_hf("gemma3_text", &[]), Ok(Arch::Gemma3));
        let e = Arch::from_gguf("gemma2").unwrap_err().to_string();
        assert!(
            e.contains("\"gemma2\"") && e.contains("llama (LlamaForCausalLM)"),
            "{e}"
        );
        let e = Arch::from_hf("", &["Phi3ForCausalLM"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("Phi3ForCausalLM") && e.contains("qwen2"), "{e}");
        assert!(matches!(
            Arch::from_hf("", &[]),
            Err(SpecError::MissingMetadata { .. })
        ));
        assert!(is_moe_name("qwen2moe") && is_moe_name("MixtralForCausalLM"));
        assert!(!is_moe_name("llama") && is_unsupported_moe_name("deepseek2"));
        assert!(is_moe_name("olmoe") && !is_unsupported_moe_name("olmoe"));
        assert_eq!(Arch::from_gguf("olmoe"), Ok(Arch::Olmoe));
        assert_eq!(Arch::Olmoe.moe_gguf_name(), Some("olmoe"));
        assert_eq!(Arch::from_gguf("qwen3moe"), Ok(Arch::Qwen3));
        assert_eq!(Arch::from_hf("", &["MixtralForCausalLM"]), Ok(Arch::Llama));
        assert_eq!(Arch::from_hf("qwen2_moe", &[]), Ok(Arch::Qwen2));
    }
}
