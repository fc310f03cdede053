//! The model trained here is tp-spec's [`ModelConfig`] (a Llama; a Qwen2, which adds biases
//! to Q, K and V; a Qwen3, which adds an RMSNorm over each query and key head; or a Gemma-3,
//! which adds Gemma's block to Qwen3's); this adds what training needs on top: presets (of
//! each architecture), reading an HF `config.json` through tp-spec's reader, the checks
//! training adds (these architectures only, Q/K/V biases exactly on Qwen2, no shared
//! experts, weights and optimizer state that fit), each layer's block for tp-nn and the
//! `config.json` text a checkpoint carries.

use crate::error::{Result, TrainError};
use std::path::Path;
use tp_nn::BlockConfig;
pub use tp_spec::ModelConfig;
use tp_spec::{Arch, BlockStyle, Experts, Gating, RopeStyle, SlidingWindow};

/// Preset names accepted by `--config`.
pub const PRESETS: &[&str] = &["tiny", "small", "bench"];

/// The architectures training supports, by the name `--arch` takes (tp-spec's).
pub const TRAINABLE_ARCHS: [Arch; 4] = [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Gemma3];

/// What `--arch` names: a trainable family, with experts for the mixture-of-experts ones.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainArch {
    pub arch: Arch,
    /// The experts of an MoE preset (`mixtral`: a Llama with 8 experts, top-2; `qwen3moe`: a
    /// Qwen3 with 8, top-2; both softmax routers with normalised top-k weights).
    pub experts: Option<Experts>,
}

/// Experts of the MoE presets.
const PRESET_EXPERTS: Experts = Experts {
    count: 8,
    per_token: 2,
    gating: Gating::Softmax,
    normalize: true,
    shared_ffn: None,
};

/// The MoE architectures by name, with the family they extend.
const MOE_ARCHS: [(&str, Arch); 2] = [("mixtral", Arch::Llama), ("qwen3moe", Arch::Qwen3)];

impl TrainArch {
    /// The name `--arch` takes for this architecture.
    pub fn name(&self) -> &'static str {
        match self.experts {
            None => self.arch.name(),
            Some(_) => MOE_ARCHS
                .iter()
                .find(|(_, a)| *a == self.arch)
                .map_or(self.arch.name(), |(n, _)| *n),
        }
    }

    /// The architecture of `cfg`.
    pub fn of(cfg: &ModelConfig) -> TrainArch {
        TrainArch {
            arch: cfg.arch,
            experts: cfg.experts,
        }
    }
}

/// The trainable architecture named `name` (`llama`, `qwen2`, `qwen3`, `gemma3`, `mixtral`,
/// `qwen3moe`); the error lists them.
pub fn trainable_arch(name: &str) -> Result<TrainArch> {
    let dense = TRAINABLE_ARCHS
        .into_iter()
        .find(|a| a.name() == name)
        .map(|arch| TrainArch {
            arch,
            experts: None,
        });
    let moe = MOE_ARCHS
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, arch)| TrainArch {
            arch,
            experts: Some(PRESET_EXPERTS),
        });
    dense.or(moe).ok_or_else(|| {
        TrainError::Config(format!(
            "architecture {name:?} cannot be trained; use one of {}",
            arch_names()
        ))
    })
}

fn arch_names() -> String {
    let mut names: Vec<&str> = TRAINABLE_ARCHS.map(|a| a.name()).to_vec();
    names.extend(MOE_ARCHS.map(|(n, _)| n));
    names.join(", ")
}

fn only_trainable(arch: &str) -> String {
    format!(
        "model_type {arch:?}: only Llama, Qwen2, Qwen3 and Gemma-3 models (LlamaForCausalLM, \
         Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM) can be trained"
    )
}

/// RoPE base of a Gemma-3 preset's global layers (Gemma-3's own; its local layers keep
/// 10 000).
const GEMMA3_ROPE_THETA: f64 = 1_000_000.0;

/// Gemma-3's block for a preset of `context` positions and few layers: a window of a quarter
/// of the context on every other layer (Gemma-3 itself: 5 layers of 6, a window of 512 or
/// 1024; a config.json sets both).
fn gemma3_preset_block(context: usize) -> BlockStyle {
    let window = (context / 4).max(1);
    BlockStyle {
        sliding: Some(SlidingWindow {
            window,
            period: 2,
            rope_theta: 10_000.0,
        }),
        ..BlockStyle::gemma3(window)
    }
}

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
    /// Reads an HF Llama, Qwen2, Qwen3 or Gemma-3 `config.json`.
    fn read(path: &Path) -> Result<Self>;
    /// Parses the text of an HF `config.json`; the error says what is wrong.
    fn parse(text: &str) -> std::result::Result<Self, String>;
    /// The same model with another vocabulary size (a tokenizer's).
    fn with_vocab(self, vocab: usize) -> Self;
    /// The same sizes as a model of `arch` (one of [`TRAINABLE_ARCHS`]): Qwen2 adds the Q/K/V
    /// biases, Qwen3 the per-head q/k norms, Gemma-3 adds them and its block (GeGLU, post norms, scaled
    /// embeddings, a window of a quarter of the context on every other layer, RoPE bases
    /// 10^6 global and 10^4 local), Llama drops them.
    fn with_arch(self, arch: Arch) -> Result<Self>;
    /// The same model with every MLP a mixture of `experts` of the model's FFN width
    /// (`None`: dense).
    fn with_experts(self, experts: Option<Experts>) -> Self;
    /// The checks training adds to [`ModelConfig::validate`] (layout checks are in
    /// [`crate::layout`]).
    fn check_trainable(&self) -> Result<()>;
    /// Layer `layer`'s block for tp-nn (Gemma-3's local and global layers differ in window,
    /// RoPE base and scaling). RoPE is HF's rotate-half layout, so a checkpoint means the same
    /// thing to an HF-directory loader.
    fn block(&self, layer: usize) -> Result<BlockConfig>;
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
            tp_spec::SpecError::UnsupportedArch { arch } => only_trainable(&arch),
            other => format!("not a Llama, Qwen2, Qwen3 or Gemma-3 config.json ({other})"),
        })?;
        if !TRAINABLE_ARCHS.contains(&c.arch) {
            return Err(only_trainable(c.arch.name()));
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

    fn with_arch(mut self, arch: Arch) -> Result<Self> {
        if !TRAINABLE_ARCHS.contains(&arch) {
            return Err(TrainError::Config(format!(
                "a {} model cannot be trained; use one of {}",
                arch.name(),
                arch_names()
            )));
        }
        let was_gemma = self.arch == Arch::Gemma3;
        self.arch = arch;
        self.qk_norm = matches!(arch, Arch::Qwen3 | Arch::Gemma3);
        self.qkv_bias = arch == Arch::Qwen2;
        if arch == Arch::Gemma3 && !was_gemma {
            self.block = gemma3_preset_block(self.context);
            self.rope_theta = GEMMA3_ROPE_THETA;
        } else if arch != Arch::Gemma3 && was_gemma {
            self.block = BlockStyle::LLAMA;
            self.rope_theta = 10_000.0;
        }
        Ok(self)
    }

    fn with_experts(mut self, experts: Option<Experts>) -> Self {
        self.experts = experts;
        self
    }

    fn check_trainable(&self) -> Result<()> {
        let bad = |m: String| Err(TrainError::Config(m));
        self.validate()
            .map_err(|e| TrainError::Config(e.to_string()))?;
        if !TRAINABLE_ARCHS.contains(&self.arch) {
            return bad(format!(
                "a {} model; training supports Llama, Qwen2, Qwen3 and Gemma-3 models (and \
                 their mixtures of experts)",
                self.arch.name()
            ));
        }
        if self.qkv_bias != (self.arch == Arch::Qwen2) {
            // Qwen2ForCausalLM always has them; a Llama's `attention_bias` also biases the
            // output projection, which the training layers do not have.
            return bad(format!(
                "a {} model {} Q/K/V biases: training has them on Qwen2 models, and only there",
                self.arch.name(),
                if self.qkv_bias { "with" } else { "without" }
            ));
        }
        if let Some(e) = &self.experts {
            if e.shared_ffn.is_some() || e.gating != Gating::Softmax {
                return bad(format!(
                    "a {} mixture of experts with {}; training supports softmax routers \
                     without shared experts (Mixtral's, Qwen3-MoE's)",
                    self.arch.name(),
                    if e.shared_ffn.is_some() {
                        "a shared expert"
                    } else {
                        "a sigmoid router"
                    }
                ));
            }
        }
        let gemma = self.arch == Arch::Gemma3;
        if self.qk_norm != matches!(self.arch, Arch::Qwen3 | Arch::Gemma3) {
            return bad(format!(
                "a {} model with qk_norm = {}: per-head q/k norms are Qwen3's and Gemma-3's, \
                 and only theirs",
                self.arch.name(),
                self.qk_norm
            ));
        }
        if !gemma && self.block != BlockStyle::LLAMA {
            return bad(format!(
                "a {} model with Gemma's block ({}): only Gemma-3 models have it",
                self.arch.name(),
                self.block.summary(self.layers).unwrap_or_default()
            ));
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

    fn block(&self, layer: usize) -> Result<BlockConfig> {
        Ok(BlockConfig::from_spec(
            &self.layer_spec(layer),
            self.context,
        )?)
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
        // Tied embeddings train (the head is the embedding; over stages, a summed copy).
        c.tied_embeddings = true;
        c.check_trainable().unwrap();
        let e = ModelConfig::parse("{\"model_type\": \"gpt2\"}").unwrap_err();
        assert!(
            e.contains("only Llama, Qwen2, Qwen3 and Gemma-3 models"),
            "{e}"
        );
        let e = ModelConfig::parse("{\"model_type\": \"llama\"}").unwrap_err();
        assert!(
            e.contains("not a Llama, Qwen2, Qwen3 or Gemma-3 config.json"),
            "{e}"
        );
        // Q/K/V biases are Qwen2's: a Llama with them (HF's `attention_bias`, which also
        // biases o_proj) or a Qwen2 without them is refused.
        let mut biased = ModelConfig::preset("tiny").unwrap();
        biased.qkv_bias = true;
        let e = biased.check_trainable().unwrap_err().to_string();
        assert!(
            e.contains("a llama model with Q/K/V biases: training has them on Qwen2"),
            "{e}"
        );
        let mut plain = ModelConfig::preset("tiny")
            .unwrap()
            .with_arch(Arch::Qwen2)
            .unwrap();
        plain.qkv_bias = false;
        let e = plain.check_trainable().unwrap_err().to_string();
        assert!(e.contains("a qwen2 model without Q/K/V biases"), "{e}");
        let e = trainable_arch("phi3").unwrap_err().to_string();
        assert!(
            e.contains("use one of llama, qwen2, qwen3, gemma3, mixtral, qwen3moe"),
            "{e}"
        );
        // Mixtures of experts: a shared expert (Qwen2-MoE) or a sigmoid router is refused.
        let moe = |e: Experts| {
            ModelConfig::preset("tiny")
                .unwrap()
                .with_experts(Some(e))
                .check_trainable()
                .map_err(|e| e.to_string())
        };
        moe(PRESET_EXPERTS).unwrap();
        let e = moe(Experts {
            shared_ffn: Some(64),
            ..PRESET_EXPERTS
        })
        .unwrap_err();
        assert!(e.contains("a shared expert"), "{e}");
        let e = moe(Experts {
            gating: Gating::Sigmoid,
            ..PRESET_EXPERTS
        })
        .unwrap_err();
        assert!(e.contains("a sigmoid router"), "{e}");
        let mut odd = ModelConfig::preset("tiny").unwrap();
        odd.qk_norm = true;
        let e = odd.check_trainable().unwrap_err().to_string();
        assert!(e.contains("Qwen3's and Gemma-3's"), "{e}");
        let mut odd = ModelConfig::preset("tiny").unwrap();
        odd.block = BlockStyle::gemma3(8);
        let e = odd.check_trainable().unwrap_err().to_string();
        assert!(e.contains("only Gemma-3 models have it"), "{e}");
        let e = ModelConfig::from_arg("/no/such/config.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("tiny, small, bench"), "{e}");
    }

    #[test]
    fn moe_presets_name_their_family_and_round_trip_through_hf_json() {
        for (name, arch, class) in [
            ("mixtral", Arch::Llama, "MixtralForCausalLM"),
            ("qwen3moe", Arch::Qwen3, "Qwen3MoeForCausalLM"),
        ] {
            let a = trainable_arch(name).unwrap();
            assert_eq!((a.arch, a.experts), (arch, Some(PRESET_EXPERTS)));
            assert_eq!(a.name(), name);
            let c = ModelConfig::preset("tiny")
                .unwrap()
                .with_arch(a.arch)
                .unwrap()
                .with_experts(a.experts);
            assert_eq!(c.hf_class(), class);
            assert_eq!(ModelConfig::parse(&c.hf_json_text()).unwrap(), c, "{name}");
            assert_eq!(TrainArch::of(&c), a);
        }
    }

    #[test]
    fn qwen2_presets_round_trip_with_their_biases() {
        for name in PRESETS {
            let c = ModelConfig::preset(name)
                .unwrap()
                .with_arch(trainable_arch("qwen2").unwrap().arch)
                .unwrap();
            assert!(c.qkv_bias && !c.qk_norm && c.block(0).unwrap().qkv_bias);
            c.check_trainable().unwrap();
            let json = c.to_hf_json();
            assert_eq!(json["model_type"], "qwen2");
            assert_eq!(json["architectures"][0], "Qwen2ForCausalLM");
            assert_eq!(ModelConfig::parse(&c.hf_json_text()).unwrap(), c, "{name}");
            let back = c.with_arch(Arch::Llama).unwrap();
            assert_eq!(back, ModelConfig::preset(name).unwrap());
        }
        // Per layer, biases of Q (4 heads of 32) and K, V (2 KV heads of 32) more.
        let q = ModelConfig::preset("tiny")
            .unwrap()
            .with_arch(Arch::Qwen2)
            .unwrap();
        assert_eq!(
            q.num_params(),
            ModelConfig::preset("tiny").unwrap().num_params() + 4 * (128 + 2 * 64)
        );
    }

    #[test]
    fn qwen3_presets_round_trip_and_name_the_architecture() {
        for name in PRESETS {
            let c = ModelConfig::preset(name)
                .unwrap()
                .with_arch(trainable_arch("qwen3").unwrap().arch)
                .unwrap();
            assert!(c.qk_norm && c.block(0).unwrap().qk_norm);
            c.check_trainable().unwrap();
            let json = c.to_hf_json();
            assert_eq!(json["model_type"], "qwen3");
            assert_eq!(json["architectures"][0], "Qwen3ForCausalLM");
            assert_eq!(ModelConfig::parse(&c.hf_json_text()).unwrap(), c, "{name}");
            let back = c.with_arch(Arch::Llama).unwrap();
            assert_eq!(back, ModelConfig::preset(name).unwrap());
        }
        // Per layer, two norms of head_dim (32) more than the Llama.
        let q = ModelConfig::preset("tiny")
            .unwrap()
            .with_arch(Arch::Qwen3)
            .unwrap();
        assert_eq!(
            q.num_params(),
            ModelConfig::preset("tiny").unwrap().num_params() + 4 * 2 * 32
        );
    }

    #[test]
    fn gemma3_presets_round_trip_and_vary_by_layer() {
        for name in PRESETS {
            let c = ModelConfig::preset(name)
                .unwrap()
                .with_arch(trainable_arch("gemma3").unwrap().arch)
                .unwrap();
            c.check_trainable().unwrap();
            let json = c.to_hf_json();
            assert_eq!(json["model_type"], "gemma3_text");
            assert_eq!(json["architectures"][0], "Gemma3ForCausalLM");
            assert_eq!(json["tie_word_embeddings"], false);
            assert_eq!(ModelConfig::parse(&c.hf_json_text()).unwrap(), c, "{name}");
            let back = c.with_arch(Arch::Llama).unwrap();
            assert_eq!(back, ModelConfig::preset(name).unwrap());
        }
        let g = ModelConfig::preset("tiny")
            .unwrap()
            .with_arch(Arch::Gemma3)
            .unwrap();
        let (local, global) = (g.block(0).unwrap(), g.block(1).unwrap());
        assert_eq!(local.style.window, Some(128));
        assert_eq!((local.rope_theta, global.rope_theta), (1e4, 1e6));
        assert_eq!(global.style.window, None);
        assert!(local.qk_norm && local.style.post_norms && local.style.unit_offset_norms);
        assert_eq!(local.style.activation, tp_nn::Activation::GeluTanh);
        // Per layer, q/k norms of head_dim (32) and two post norms of hidden (128).
        assert_eq!(
            g.num_params(),
            ModelConfig::preset("tiny").unwrap().num_params() + 4 * (2 * 32 + 2 * 128)
        );
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
