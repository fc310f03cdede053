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
}

/// Every supported architecture: (family, GGUF `general.architecture`, HF `architectures[0]`).
const SUPPORTED: [(Arch, &str, &str); 4] = [
    (Arch::Llama, "llama", "LlamaForCausalLM"),
    (Arch::Qwen2, "qwen2", "Qwen2ForCausalLM"),
    (Arch::Qwen3, "qwen3", "Qwen3ForCausalLM"),
    (Arch::Gemma3, "gemma3", "Gemma3ForCausalLM"),
];

/// HF `model_type` spellings besides the GGUF names: (family, model_type).
const HF_MODEL_TYPES: [(Arch, &str); 1] = [(Arch::Gemma3, "gemma3_text")];

/// Mixture-of-experts spellings of a family: (family, GGUF `general.architecture`, HF class,
/// HF `model_type`). Mixtral's GGUF says `llama` and carries `llama.expert_count`.
const MOE_FAMILIES: [(Arch, &str, &str, &str); 3] = [
    (Arch::Llama, "llama", "MixtralForCausalLM", "mixtral"),
    (Arch::Qwen2, "qwen2moe", "Qwen2MoeForCausalLM", "qwen2_moe"),
    (Arch::Qwen3, "qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
];

/// Mixture-of-experts names this project recognises but cannot run (their layers differ from
/// the families above: OLMoE's q/k norms span all heads).
const UNSUPPORTED_MOE: [&str; 3] = ["olmoe", "OlmoeForCausalLM", "deepseek2"];

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
            Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 => RopeStyle::RotateHalf,
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
        assert!(!is_moe_name("llama") && is_unsupported_moe_name("olmoe"));
        assert_eq!(Arch::from_gguf("qwen3moe"), Ok(Arch::Qwen3));
        assert_eq!(Arch::from_hf("", &["MixtralForCausalLM"]), Ok(Arch::Llama));
        assert_eq!(Arch::from_hf("qwen2_moe", &[]), Ok(Arch::Qwen2));
    }
}
