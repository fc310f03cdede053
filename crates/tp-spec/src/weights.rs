//! The canonical weights of a model, their shapes, and their names in GGUF and HF spelling
//! (the one table both checkpoint readers and the trainer's checkpoints use).

use crate::arch::Arch;
use crate::config::ModelConfig;

/// A weight of the Llama family, independent of the file format's naming.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightName {
    Embed,
    Output,
    OutputNorm,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    QBias(usize),
    KBias(usize),
    VBias(usize),
    /// Qwen3's per-head RMSNorm weights of the queries and keys (`[head_dim]`).
    QNorm(usize),
    KNorm(usize),
    O(usize),
    /// Gemma's norm of the attention output, before the residual add.
    PostAttnNorm(usize),
    /// The norm before the MLP (Gemma's `pre_feedforward_layernorm`).
    FfnNorm(usize),
    /// Gemma's norm of the MLP output, before the residual add.
    PostFfnNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    /// A mixture-of-experts router, `[experts, hidden]`.
    Router(usize),
    /// The router's aux-loss-free load-balancing bias, `[experts]` (DeepSeek-V3's
    /// `e_score_correction_bias`; llama.cpp's `exp_probs_b`): added to the router's
    /// probabilities to choose the top-k experts, not to their weights. Optional: a file
    /// without it routes unbiased.
    RouterBias(usize),
    /// Expert `e`'s gate, up and down projections in layer `l`: `(l, e)`.
    ExpertGate(usize, usize),
    ExpertUp(usize, usize),
    ExpertDown(usize, usize),
    /// Qwen2-MoE's shared expert: its projections and the vector (`[hidden]`) whose sigmoid
    /// scales its output per token.
    SharedGate(usize),
    SharedUp(usize),
    SharedDown(usize),
    SharedExpertGate(usize),
}

impl WeightName {
    /// The layer of a per-layer weight.
    pub fn layer(self) -> Option<usize> {
        use WeightName::*;
        match self {
            Embed | Output | OutputNorm => None,
            AttnNorm(l) | Q(l) | K(l) | V(l) | QBias(l) | KBias(l) | VBias(l) | QNorm(l)
            | KNorm(l) | O(l) | PostAttnNorm(l) | FfnNorm(l) | PostFfnNorm(l) | Gate(l) | Up(l)
            | Down(l) | Router(l) | RouterBias(l) | SharedGate(l) | SharedUp(l) | SharedDown(l)
            | SharedExpertGate(l) => Some(l),
            ExpertGate(l, _) | ExpertUp(l, _) | ExpertDown(l, _) => Some(l),
        }
    }

    /// The expert of an expert's projection.
    pub fn expert(self) -> Option<usize> {
        use WeightName::*;
        match self {
            ExpertGate(_, e) | ExpertUp(_, e) | ExpertDown(_, e) => Some(e),
            _ => None,
        }
    }

    /// Whether the weight is an RMSNorm's (stored minus one in Gemma's HF checkpoints).
    pub fn is_norm(self) -> bool {
        use WeightName::*;
        matches!(
            self,
            OutputNorm
                | AttnNorm(_)
                | FfnNorm(_)
                | PostAttnNorm(_)
                | PostFfnNorm(_)
                | QNorm(_)
                | KNorm(_)
        )
    }

    /// Whether the weight is a vector every rank holds whole or slices (norms, biases).
    pub fn is_vector(self) -> bool {
        use WeightName::*;
        self.is_norm() || matches!(self, QBias(_) | KBias(_) | VBias(_) | SharedExpertGate(_))
    }
}

/// A per-layer weight's constructor (`WeightName::Q`).
type LayerWeight = fn(usize) -> WeightName;

/// A per-layer weight's constructor, its GGUF suffix and its HF suffix (Llama's spelling).
type LayerName = (LayerWeight, &'static str, &'static str);

/// Each per-layer weight with its names, in the order of a block. The post norms have no
/// Llama spelling (`""`): only [`GEMMA_HF`] names them.
const LAYER_NAMES: [LayerName; 16] = [
    (
        WeightName::AttnNorm,
        "attn_norm.weight",
        "input_layernorm.weight",
    ),
    (WeightName::Q, "attn_q.weight", "self_attn.q_proj.weight"),
    (WeightName::K, "attn_k.weight", "self_attn.k_proj.weight"),
    (WeightName::V, "attn_v.weight", "self_attn.v_proj.weight"),
    (WeightName::QBias, "attn_q.bias", "self_attn.q_proj.bias"),
    (WeightName::KBias, "attn_k.bias", "self_attn.k_proj.bias"),
    (WeightName::VBias, "attn_v.bias", "self_attn.v_proj.bias"),
    (
        WeightName::QNorm,
        "attn_q_norm.weight",
        "self_attn.q_norm.weight",
    ),
    (
        WeightName::KNorm,
        "attn_k_norm.weight",
        "self_attn.k_norm.weight",
    ),
    (
        WeightName::O,
        "attn_output.weight",
        "self_attn.o_proj.weight",
    ),
    (WeightName::PostAttnNorm, "post_attention_norm.weight", ""),
    (
        WeightName::FfnNorm,
        "ffn_norm.weight",
        "post_attention_layernorm.weight",
    ),
    (WeightName::PostFfnNorm, "post_ffw_norm.weight", ""),
    (WeightName::Gate, "ffn_gate.weight", "mlp.gate_proj.weight"),
    (WeightName::Up, "ffn_up.weight", "mlp.up_proj.weight"),
    (WeightName::Down, "ffn_down.weight", "mlp.down_proj.weight"),
];

/// (weight, GGUF name, HF name) of the weights outside the layers.
const GLOBAL_NAMES: [(WeightName, &str, &str); 3] = [
    (
        WeightName::Embed,
        "token_embd.weight",
        "model.embed_tokens.weight",
    ),
    (WeightName::Output, "output.weight", "lm_head.weight"),
    (
        WeightName::OutputNorm,
        "output_norm.weight",
        "model.norm.weight",
    ),
];

/// Gemma's HF spellings where they differ from Llama's: its `post_attention_layernorm` is the
/// attention output's norm, not the norm before the MLP.
const GEMMA_HF: [(LayerWeight, &str); 3] = [
    (WeightName::PostAttnNorm, "post_attention_layernorm.weight"),
    (WeightName::FfnNorm, "pre_feedforward_layernorm.weight"),
    (WeightName::PostFfnNorm, "post_feedforward_layernorm.weight"),
];

/// The HF suffix of a per-layer weight in `arch`'s spelling (`""`: none).
fn hf_suffix(arch: Arch, e: &LayerName) -> &'static str {
    let own = (arch == Arch::Gemma3)
        .then(|| GEMMA_HF.iter().find(|g| g.0(0) == e.0(0)))
        .flatten();
    own.map_or(e.2, |g| g.1)
}

fn layer_entry(name: WeightName) -> Option<(usize, &'static LayerName)> {
    let l = name.layer()?;
    LAYER_NAMES
        .iter()
        .find(|(make, _, _)| make(l) == name)
        .map(|e| (l, e))
}

/// The projections of an expert: (constructor, GGUF per-expert stem, GGUF merged stem,
/// Mixtral's HF name, Qwen-MoE's HF name).
type ExpertName = (
    fn(usize, usize) -> WeightName,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
);

const EXPERT_NAMES: [ExpertName; 3] = [
    (
        WeightName::ExpertGate,
        "ffn_gate",
        "ffn_gate_exps",
        "w1",
        "gate_proj",
    ),
    (
        WeightName::ExpertUp,
        "ffn_up",
        "ffn_up_exps",
        "w3",
        "up_proj",
    ),
    (
        WeightName::ExpertDown,
        "ffn_down",
        "ffn_down_exps",
        "w2",
        "down_proj",
    ),
];

/// The per-layer MoE weights that are not an expert's: (constructor, GGUF suffix, Mixtral's HF
/// suffix, Qwen-MoE's HF suffix; `""` where the spelling has none).
const MOE_LAYER_NAMES: [LayerName2; 6] = [
    (
        WeightName::Router,
        "ffn_gate_inp.weight",
        "block_sparse_moe.gate.weight",
        "mlp.gate.weight",
    ),
    (
        WeightName::RouterBias,
        "exp_probs_b.bias",
        "block_sparse_moe.gate.e_score_correction_bias",
        "mlp.gate.e_score_correction_bias",
    ),
    (
        WeightName::SharedGate,
        "ffn_gate_shexp.weight",
        "",
        "mlp.shared_expert.gate_proj.weight",
    ),
    (
        WeightName::SharedUp,
        "ffn_up_shexp.weight",
        "",
        "mlp.shared_expert.up_proj.weight",
    ),
    (
        WeightName::SharedDown,
        "ffn_down_shexp.weight",
        "",
        "mlp.shared_expert.down_proj.weight",
    ),
    (
        WeightName::SharedExpertGate,
        "ffn_gate_inp_shexp.weight",
        "",
        "mlp.shared_expert_gate.weight",
    ),
];

type LayerName2 = (LayerWeight, &'static str, &'static str, &'static str);

fn expert_entry(name: WeightName) -> Option<(usize, usize, &'static ExpertName)> {
    let (l, e) = (name.layer()?, name.expert()?);
    EXPERT_NAMES
        .iter()
        .find(|x| x.0(l, e) == name)
        .map(|x| (l, e, x))
}

fn moe_layer_entry(name: WeightName) -> Option<(usize, &'static LayerName2)> {
    let l = name.layer()?;
    MOE_LAYER_NAMES
        .iter()
        .find(|x| x.0(l) == name)
        .map(|x| (l, x))
}

/// The merged 3-D GGUF tensor (`blk.3.ffn_gate_exps.weight`, `[experts, rows, cols]`) holding
/// an expert's projection, and the expert's index in it; `None` for other weights.
pub fn gguf_merged_name(name: WeightName) -> Option<(String, usize)> {
    let (l, e, x) = expert_entry(name)?;
    Some((format!("blk.{l}.{}.weight", x.2), e))
}

/// The GGUF tensor name of a weight (`blk.3.attn_q.weight`); an expert's projection in the
/// one-tensor-per-expert layout (`blk.3.ffn_gate.5.weight`, [`gguf_merged_name`] gives the
/// merged layout's).
pub fn gguf_name(name: WeightName) -> String {
    if let Some((l, e, x)) = expert_entry(name) {
        return format!("blk.{l}.{}.{e}.weight", x.1);
    }
    if let Some((l, x)) = moe_layer_entry(name) {
        return format!("blk.{l}.{}", x.1);
    }
    match layer_entry(name) {
        Some((l, e)) => format!("blk.{l}.{}", e.1),
        None => GLOBAL_NAMES
            .iter()
            .find(|e| e.0 == name)
            .map_or_else(String::new, |e| e.1.to_string()),
    }
}

/// The HF tensor name of a weight in `arch`'s spelling
/// (`model.layers.3.self_attn.q_proj.weight`).
pub fn hf_name(arch: Arch, name: WeightName) -> String {
    let mixtral = arch == Arch::Llama;
    if let Some((l, e, x)) = expert_entry(name) {
        return match mixtral {
            true => format!(
                "model.layers.{l}.block_sparse_moe.experts.{e}.{}.weight",
                x.3
            ),
            false => format!("model.layers.{l}.mlp.experts.{e}.{}.weight", x.4),
        };
    }
    if let Some((l, x)) = moe_layer_entry(name) {
        return format!("model.layers.{l}.{}", if mixtral { x.2 } else { x.3 });
    }
    match layer_entry(name) {
        Some((l, e)) => format!("model.layers.{l}.{}", hf_suffix(arch, e)),
        None => GLOBAL_NAMES
            .iter()
            .find(|e| e.0 == name)
            .map_or_else(String::new, |e| e.2.to_string()),
    }
}

/// The weight an HF tensor name stands for in `arch`'s spelling (`None` for names the
/// family does not use).
pub fn parse_hf_name(arch: Arch, name: &str) -> Option<WeightName> {
    parse_name(name, "model.layers.", |e| hf_suffix(arch, e), |g| g.2)
        .or_else(|| parse_moe_name(name, |w| hf_name(arch, w)))
}

/// The weight a GGUF tensor name stands for (`None` for names this family does not use; a
/// merged expert tensor is not one weight).
pub fn parse_gguf_name(name: &str) -> Option<WeightName> {
    parse_name(name, "blk.", |e| e.1, |g| g.1).or_else(|| parse_moe_name(name, gguf_name))
}

/// An MoE weight by its name in a spelling (`spell`): the layer and expert numbers are read
/// from the name, then the candidate is spelled back and compared.
fn parse_moe_name(name: &str, spell: impl Fn(WeightName) -> String) -> Option<WeightName> {
    let numbers: Vec<usize> = name
        .split('.')
        .filter_map(|p| p.parse::<usize>().ok())
        .collect();
    let l = *numbers.first()?;
    let e = numbers.get(1).copied().unwrap_or(0);
    EXPERT_NAMES
        .iter()
        .map(|x| x.0(l, e))
        .chain(MOE_LAYER_NAMES.iter().map(|x| x.0(l)))
        .find(|w| !name.ends_with('.') && spell(*w) == name)
}

/// `name` looked up in the global table by `global`'s spelling, or as `<prefix><layer>.<suffix>`
/// with `suffix` in the layer table by `layer`'s spelling.
fn parse_name(
    name: &str,
    prefix: &str,
    layer: impl Fn(&LayerName) -> &'static str,
    global: fn(&(WeightName, &'static str, &'static str)) -> &'static str,
) -> Option<WeightName> {
    if let Some(e) = GLOBAL_NAMES.iter().find(|e| global(e) == name) {
        return Some(e.0);
    }
    let (l, suffix) = name.strip_prefix(prefix)?.split_once('.')?;
    let l = l.parse::<usize>().ok()?;
    LAYER_NAMES
        .iter()
        .find(|e| !suffix.is_empty() && layer(e) == suffix)
        .map(|(make, _, _)| make(l))
}

/// Tensor-name fragments of mixture-of-experts weights in GGUF (`blk.N.ffn_gate_exps.weight`,
/// the router `ffn_gate_inp`, Qwen's shared expert `*_shexp`) and HF spelling (Mixtral's
/// `block_sparse_moe.*`, Qwen-MoE's `mlp.experts.*`, `mlp.gate.weight`, `mlp.shared_expert*`).
const EXPERT_FRAGMENTS: [&str; 8] = [
    "_exps.",
    ".ffn_gate_inp.",
    "_shexp.",
    ".block_sparse_moe.",
    ".mlp.experts.",
    ".mlp.gate.weight",
    ".mlp.shared_expert.",
    ".mlp.shared_expert_gate.",
];

/// Whether a tensor name is a mixture-of-experts weight (router, experts, shared expert).
pub fn is_expert_tensor(name: &str) -> bool {
    EXPERT_FRAGMENTS.iter().any(|f| name.contains(f))
}

/// A weight's shape: a matrix `[rows, cols]` or a vector of `len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expected {
    Matrix { rows: usize, cols: usize },
    Vector { len: usize },
}

/// Fewest tensors a layer has (two norms, Q, K, V, O, gate, up, down).
pub const TENSORS_PER_LAYER: usize = 9;

/// The weights a checkpoint of `cfg` must hold, with their shapes, from the parameter table
/// (biases only when the config has them, the output head only when untied): the embedding,
/// the head and the final norm first, then each layer.
pub fn expected_weights(cfg: &ModelConfig) -> impl Iterator<Item = (WeightName, Expected)> + '_ {
    let global = crate::params::embed_params(cfg)
        .into_iter()
        .chain(crate::params::head_params(cfg).into_iter().rev());
    let layers = (0..cfg.layers).flat_map(move |l| cfg.layer_spec(l).params());
    global.chain(layers).map(|p| (p.name, p.shape))
}

/// Weights a file of `cfg` may hold beyond the table's, read when present: each MoE layer's
/// router bias ([`WeightName::RouterBias`], `[experts]`).
pub fn optional_weights(cfg: &ModelConfig) -> impl Iterator<Item = (WeightName, Expected)> + '_ {
    let count = cfg.experts.map(|e| e.count);
    (0..cfg.layers)
        .filter_map(move |l| count.map(|len| (WeightName::RouterBias(l), Expected::Vector { len })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_in_both_spellings_round_trip() {
        let all = [
            WeightName::Embed,
            WeightName::Output,
            WeightName::OutputNorm,
        ]
        .into_iter()
        .chain(LAYER_NAMES.iter().map(|e| (e.0)(7)));
        for w in all {
            let g = gguf_name(w);
            assert_eq!(parse_gguf_name(&g), Some(w), "{g}");
            let post = matches!(w, WeightName::PostAttnNorm(_) | WeightName::PostFfnNorm(_));
            for arch in [Arch::Llama, Arch::Gemma3] {
                let h = hf_name(arch, w);
                if post && arch == Arch::Llama {
                    assert!(h.ends_with('.'), "{h}: Llama has no post norms");
                    continue;
                }
                assert_eq!(parse_hf_name(arch, &h), Some(w), "{arch:?} {h}");
                assert!(!is_expert_tensor(&g) && !is_expert_tensor(&h));
            }
        }
        assert_eq!(gguf_name(WeightName::Q(3)), "blk.3.attn_q.weight");
        assert_eq!(
            hf_name(Arch::Qwen2, WeightName::Down(0)),
            "model.layers.0.mlp.down_proj.weight"
        );
        // One HF name, two meanings: the norm before the MLP in Llama, after attention in Gemma.
        let pa = "model.layers.2.post_attention_layernorm.weight";
        assert_eq!(parse_hf_name(Arch::Llama, pa), Some(WeightName::FfnNorm(2)));
        assert_eq!(
            parse_hf_name(Arch::Gemma3, pa),
            Some(WeightName::PostAttnNorm(2))
        );
        assert_eq!(parse_hf_name(Arch::Llama, "model.layers.1."), None);
        assert_eq!(
            parse_hf_name(Arch::Llama, "model.layers.x.mlp.up_proj.weight"),
            None
        );
        assert_eq!(
            parse_hf_name(Arch::Llama, "model.layers.1.mlp.up_proj.bias"),
            None
        );
        assert_eq!(parse_gguf_name("blk.1.ffn_gate_exps.weight"), None);
        for moe in [
            "blk.0.ffn_gate_exps.weight",
            "blk.1.ffn_gate_inp.weight",
            "blk.2.ffn_down_shexp.weight",
            "model.layers.0.block_sparse_moe.experts.3.w1.weight",
            "model.layers.0.block_sparse_moe.gate.weight",
            "model.layers.5.mlp.experts.12.gate_proj.weight",
            "model.layers.5.mlp.gate.weight",
            "model.layers.5.mlp.shared_expert.up_proj.weight",
        ] {
            assert!(is_expert_tensor(moe), "{moe}");
        }
        // MoE weights in every spelling: per-expert GGUF names, Mixtral's and Qwen's HF names.
        let moe = EXPERT_NAMES
            .iter()
            .map(|x| x.0(4, 11))
            .chain(MOE_LAYER_NAMES.iter().map(|x| x.0(4)));
        for w in moe {
            let g = gguf_name(w);
            assert_eq!(parse_gguf_name(&g), Some(w), "{g}");
            for arch in [Arch::Llama, Arch::Qwen2] {
                let h = hf_name(arch, w);
                if h.ends_with('.') {
                    continue; // Mixtral has no shared expert.
                }
                assert_eq!(parse_hf_name(arch, &h), Some(w), "{h}");
            }
        }
        assert_eq!(
            gguf_name(WeightName::ExpertDown(3, 5)),
            "blk.3.ffn_down.5.weight"
        );
        assert_eq!(
            gguf_merged_name(WeightName::ExpertUp(3, 5)),
            Some(("blk.3.ffn_up_exps.weight".to_string(), 5))
        );
        assert_eq!(
            hf_name(Arch::Llama, WeightName::ExpertDown(0, 2)),
            "model.layers.0.block_sparse_moe.experts.2.w2.weight"
        );
        assert_eq!(
            hf_name(Arch::Qwen3, WeightName::Router(1)),
            "model.layers.1.mlp.gate.weight"
        );
    }
}
