//! What sets a family's transformer block apart from Llama's: the MLP's nonlinearity, norms
//! after the attention and MLP outputs, scaled embeddings, the query scale, interleaved
//! sliding-window layers with their own RoPE base, linear RoPE scaling (Gemma-3 uses all of
//! them; Llama, Qwen2 and Qwen3 none).

/// The gate's nonlinearity in the gated MLP (`act(gate(x)) * up(x)`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(x)` (SwiGLU: Llama, Qwen).
    #[default]
    Silu,
    /// GELU with the tanh approximation (GeGLU: Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

impl Activation {
    /// The HF `hidden_act` / `hidden_activation` spelling.
    pub fn hf_name(self) -> &'static str {
        match self {
            Activation::Silu => "silu",
            Activation::GeluTanh => "gelu_pytorch_tanh",
        }
    }

    /// From an HF spelling (`None` for one no engine here computes).
    pub fn from_hf(name: &str) -> Option<Activation> {
        match name {
            "silu" | "swish" => Some(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_tanh" => Some(Activation::GeluTanh),
            _ => None,
        }
    }
}

/// Local attention layers interleaved with global ones.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlidingWindow {
    /// Positions a query of a local layer sees, its own included: position `p` attends to
    /// `p + 1 - window ..= p` (HF's and llama.cpp's convention).
    pub window: usize,
    /// Every `period`-th layer is global (layers `period - 1`, `2 * period - 1`, ...), the
    /// others local. Gemma-3: 6.
    pub period: usize,
    /// RoPE base of the local layers (the config's `rope_theta` is the global layers').
    pub rope_theta: f64,
}

impl SlidingWindow {
    /// Whether `layer` attends through the window.
    pub fn is_local(&self, layer: usize) -> bool {
        !(layer + 1).is_multiple_of(self.period.max(1))
    }
}

/// A block's departures from Llama's; [`BlockStyle::LLAMA`] has none.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockStyle {
    pub activation: Activation,
    /// An RMSNorm of the attention output and one of the MLP output before each residual add.
    pub post_norms: bool,
    /// Token embeddings are multiplied by `sqrt(hidden)` (the tied head reads them unscaled).
    pub embed_scale: bool,
    /// What queries are multiplied by before the dot products; `None`: `1 / sqrt(head_dim)`.
    pub query_scale: Option<f64>,
    pub sliding: Option<SlidingWindow>,
    /// Linear RoPE scaling of the global layers: positions divided by this factor (1: none).
    pub rope_scale: f64,
    /// An HF checkpoint stores each RMSNorm weight minus one (Gemma computes `x * (1 + w)`;
    /// GGUF files store the sum).
    pub hf_norm_minus_one: bool,
    /// The q/k norms span the whole query and the whole key projection (all heads at once,
    /// weights `[heads x head_dim]` and `[kv_heads x head_dim]`: OLMoE) rather than each head.
    pub qk_norm_whole: bool,
}

impl BlockStyle {
    /// Llama's block (also Qwen2's and Qwen3's).
    pub const LLAMA: BlockStyle = BlockStyle {
        activation: Activation::Silu,
        post_norms: false,
        embed_scale: false,
        query_scale: None,
        sliding: None,
        rope_scale: 1.0,
        hf_norm_minus_one: false,
        qk_norm_whole: false,
    };

    /// OLMoE's block: Llama's with the q/k norms over the whole projections.
    pub const OLMOE: BlockStyle = BlockStyle {
        qk_norm_whole: true,
        ..BlockStyle::LLAMA
    };

    /// Gemma-3's block, with a window of `window` positions on 5 layers of every 6 and a local
    /// RoPE base of 10 000.
    pub fn gemma3(window: usize) -> BlockStyle {
        BlockStyle {
            activation: Activation::GeluTanh,
            post_norms: true,
            embed_scale: true,
            query_scale: None,
            sliding: Some(SlidingWindow {
                window,
                period: 6,
                rope_theta: 10_000.0,
            }),
            rope_scale: 1.0,
            hf_norm_minus_one: true,
            qk_norm_whole: false,
        }
    }
}

impl BlockStyle {
    /// What departs from Llama's block, in words, for a model of `layers` layers (`None`
    /// for Llama's own block).
    pub fn summary(&self, layers: usize) -> Option<String> {
        if *self == BlockStyle::LLAMA {
            return None;
        }
        let mut parts = Vec::new();
        if self.activation == Activation::GeluTanh {
            parts.push("GeGLU (tanh GELU)".to_string());
        }
        if self.post_norms {
            parts.push("post-attention and post-MLP norms".into());
        }
        if self.embed_scale {
            parts.push("embeddings x sqrt(hidden)".into());
        }
        if let Some(q) = self.query_scale {
            parts.push(format!("query scale {q}"));
        }
        if let Some(w) = self.sliding {
            let local = (0..layers).filter(|&l| w.is_local(l)).count();
            parts.push(format!(
                "sliding window {} on {local} of {layers} layers (rope theta {})",
                w.window, w.rope_theta
            ));
        }
        if self.rope_scale != 1.0 {
            parts.push(format!("linear rope scaling x{}", self.rope_scale));
        }
        if self.qk_norm_whole {
            parts.push("q/k norms over all heads".into());
        }
        Some(parts.join(", "))
    }
}

impl Default for BlockStyle {
    fn default() -> Self {
        BlockStyle::LLAMA
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma3_layers_5_11_17_are_global() {
        let s = BlockStyle::gemma3(512).sliding.unwrap();
        let global: Vec<usize> = (0..18).filter(|&l| !s.is_local(l)).collect();
        assert_eq!(global, [5, 11, 17]);
        for a in [Activation::Silu, Activation::GeluTanh] {
            assert_eq!(Activation::from_hf(a.hf_name()), Some(a));
        }
        assert_eq!(Activation::from_hf("relu"), None);
        assert_eq!(BlockStyle::LLAMA.summary(4), None);
        let g = BlockStyle::gemma3(512).summary(18).unwrap();
        assert!(
            g.contains("GeGLU") && g.contains("sliding window 512 on 15 of 18 layers"),
            "{g}"
        );
    }
}
