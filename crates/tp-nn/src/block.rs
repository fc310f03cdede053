//! The pre-norm transformer block composed of the parallel layers (Megatron §3, Fig. 4:
//! two all-reduces forward and two backward), with Gemma-3's departures per layer
//! ([`LayerStyle`]): GeGLU, norms after the attention and MLP, `x * (1 + w)` norms, the query
//! scale, a sliding window and linearly scaled RoPE.

use crate::attention::ParallelAttention;
use crate::error::{Result, TpError};
use crate::linear::check_group;
use crate::mappings::copy_to_tp;
use crate::mlp::ParallelMlp;
use crate::norm::RmsNorm;
use crate::rng::{RandomTensor, Rng};
use crate::rope::{Rope, RopeLayout};
use candle_core::{Device, Tensor, Var};
use std::ops::Range;
use tp_comm::Group;
use tp_spec::Activation;

/// What one layer departs from Llama's block by; [`LayerStyle::LLAMA`] departs by nothing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerStyle {
    /// The gate's nonlinearity (silu: SwiGLU; tanh GELU: GeGLU).
    pub activation: Activation,
    /// An RMSNorm of the attention output and one of the MLP output before each residual add
    /// (replicated weights `post_attn_norm`, `post_mlp_norm`).
    pub post_norms: bool,
    /// Every norm of the block computes `x * (1 + w)` (Gemma's parametrisation: `w` is what
    /// its checkpoints store).
    pub unit_offset_norms: bool,
    /// What the scores are multiplied by; `None`: `1 / sqrt(head_dim)`.
    pub query_scale: Option<f64>,
    /// This layer attends through a window of this many positions (its own included).
    pub window: Option<usize>,
    /// Linear RoPE scaling: positions divided by this factor (1: none).
    pub rope_scale: f64,
}

impl LayerStyle {
    /// Llama's layer (also Qwen2's and Qwen3's).
    pub const LLAMA: LayerStyle = LayerStyle {
        activation: Activation::Silu,
        post_norms: false,
        unit_offset_norms: false,
        query_scale: None,
        window: None,
        rope_scale: 1.0,
    };
}

impl Default for LayerStyle {
    fn default() -> Self {
        LayerStyle::LLAMA
    }
}

/// Whole-model sizes of one Llama-style block (Qwen3's with `qk_norm`), and this layer's
/// departures from Llama's (`style`; Gemma-3's vary by layer: window and RoPE base).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockConfig {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub rope_theta: f64,
    pub rope_layout: RopeLayout,
    pub rms_eps: f64,
    pub max_seq: usize,
    /// Qwen3: an RMSNorm (eps `rms_eps`) over each query and key head before RoPE.
    pub qk_norm: bool,
    pub style: LayerStyle,
}

/// The GLOBAL weights of a block (candle layout `[out, in]`).
#[derive(Clone, Debug)]
pub struct BlockWeights {
    pub attn_norm: Tensor, // [hidden]
    pub wq: Tensor,        // [heads * head_dim, hidden]
    pub wk: Tensor,        // [kv_heads * head_dim, hidden]
    pub wv: Tensor,        // [kv_heads * head_dim, hidden]
    pub wo: Tensor,        // [hidden, heads * head_dim]
    pub mlp_norm: Tensor,  // [hidden]
    pub w_gate: Tensor,    // [ffn, hidden]
    pub w_up: Tensor,      // [ffn, hidden]
    pub w_down: Tensor,    // [hidden, ffn]
    /// Qwen3's per-head norms, present exactly when [`BlockConfig::qk_norm`] is set.
    pub q_norm: Option<Tensor>, // [head_dim]
    pub k_norm: Option<Tensor>, // [head_dim]
    /// Gemma's norms of the attention and MLP outputs, present exactly when
    /// [`LayerStyle::post_norms`] is set.
    pub post_attn_norm: Option<Tensor>, // [hidden]
    pub post_mlp_norm: Option<Tensor>, // [hidden]
}

/// Whether the parameter `name` of [`ParallelBlock::params`] is replicated but gets, on each
/// rank, only its share of the gradient (the per-head q/k norms see only the rank's heads): the
/// full gradient is the sum over the tp group, which the caller must take (like Megatron's
/// all-reduce of layer-norm gradients under sequence parallelism).
pub fn tp_partial_grad(name: &str) -> bool {
    matches!(name, "q_norm" | "k_norm")
}

impl BlockConfig {
    pub fn validate(&self) -> Result<()> {
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(TpError::Config(format!(
                "{} heads must be a positive multiple of {} KV heads",
                self.heads, self.kv_heads
            )));
        }
        if self.hidden == 0 || self.ffn == 0 || self.head_dim == 0 {
            return Err(TpError::Config(
                "hidden, ffn and head_dim must be positive".into(),
            ));
        }
        Ok(())
    }

    /// Random weights scaled like a fresh init (1/sqrt(fan_in)), norms near 1 (near 0 when
    /// they compute `x * (1 + w)`; the q/k norms, then the post norms drawn last, so a block
    /// without them has the same other weights).
    pub fn random_weights(&self, seed: u64, device: &Device) -> Result<BlockWeights> {
        self.validate()?;
        let mut rng = Rng::xorshift64_star(seed);
        let (h, q, kv, f) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.ffn,
        );
        let s = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
        let one = if self.style.unit_offset_norms {
            0.0
        } else {
            1.0
        };
        let mut w = BlockWeights {
            attn_norm: rng.tensor(&[h], one, 0.2, device)?,
            wq: rng.tensor(&[q, h], 0.0, s(h), device)?,
            wk: rng.tensor(&[kv, h], 0.0, s(h), device)?,
            wv: rng.tensor(&[kv, h], 0.0, s(h), device)?,
            wo: rng.tensor(&[h, q], 0.0, s(q), device)?,
            mlp_norm: rng.tensor(&[h], one, 0.2, device)?,
            w_gate: rng.tensor(&[f, h], 0.0, s(h), device)?,
            w_up: rng.tensor(&[f, h], 0.0, s(h), device)?,
            w_down: rng.tensor(&[h, f], 0.0, s(f), device)?,
            q_norm: None,
            k_norm: None,
            post_attn_norm: None,
            post_mlp_norm: None,
        };
        if self.qk_norm {
            w.q_norm = Some(rng.tensor(&[self.head_dim], one, 0.2, device)?);
            w.k_norm = Some(rng.tensor(&[self.head_dim], one, 0.2, device)?);
        }
        if self.style.post_norms {
            w.post_attn_norm = Some(rng.tensor(&[h], one, 0.2, device)?);
            w.post_mlp_norm = Some(rng.tensor(&[h], one, 0.2, device)?);
        }
        Ok(w)
    }

    /// The q/k norm weights of `w`, checked against `qk_norm`: `Some` exactly when it is set.
    pub(crate) fn qk_norm_weights<'a>(
        &self,
        w: &'a BlockWeights,
    ) -> Result<Option<(&'a Tensor, &'a Tensor)>> {
        match (self.qk_norm, &w.q_norm, &w.k_norm) {
            (true, Some(q), Some(k)) => Ok(Some((q, k))),
            (false, None, None) => Ok(None),
            (want, ..) => Err(TpError::Config(format!(
                "the block config says qk_norm = {want}, but the weights {} q_norm/k_norm",
                if want { "lack" } else { "carry" }
            ))),
        }
    }

    /// The post-norm weights of `w`, checked against `style.post_norms`.
    pub(crate) fn post_norm_weights<'a>(
        &self,
        w: &'a BlockWeights,
    ) -> Result<Option<(&'a Tensor, &'a Tensor)>> {
        match (self.style.post_norms, &w.post_attn_norm, &w.post_mlp_norm) {
            (true, Some(a), Some(m)) => Ok(Some((a, m))),
            (false, None, None) => Ok(None),
            (want, ..) => Err(TpError::Config(format!(
                "the block config says post_norms = {want}, but the weights {} \
                 post_attn_norm/post_mlp_norm",
                if want { "lack" } else { "carry" }
            ))),
        }
    }
}

/// Where a parameter shard sits in its global tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Every rank holds the whole tensor (norm weights).
    Replicated,
    /// The rank holds `range` of `dim` (element indices, not units). Shards of different
    /// ranks may overlap (replicated KV heads): their gradients then add up to the dense one.
    Sharded { dim: usize, range: Range<usize> },
}

/// One rank's slice of a transformer block.
#[derive(Debug)]
pub struct ParallelBlock {
    cfg: BlockConfig,
    attn_norm: RmsNorm,
    attn: ParallelAttention,
    mlp_norm: RmsNorm,
    mlp: ParallelMlp,
    /// Gemma's `(post_attn_norm, post_mlp_norm)`.
    post_norms: Option<(RmsNorm, RmsNorm)>,
    rope: Rope,
    tp_rank: usize,
    tp: usize,
}

impl ParallelBlock {
    pub fn from_global(
        cfg: &BlockConfig,
        w: &BlockWeights,
        tp_rank: usize,
        tp: usize,
    ) -> Result<Self> {
        cfg.validate()?;
        let st = cfg.style;
        let rope = Rope::scaled(
            cfg.head_dim,
            cfg.max_seq,
            cfg.rope_theta,
            st.rope_scale,
            cfg.rope_layout,
            w.wq.device(),
        )?;
        let attn = ParallelAttention::from_global(
            &w.wq,
            &w.wk,
            &w.wv,
            &w.wo,
            cfg.heads,
            cfg.kv_heads,
            cfg.head_dim,
            tp_rank,
            tp,
        )?
        .with_scores(st.query_scale, st.window)?;
        let (eps, unit) = (cfg.rms_eps, st.unit_offset_norms);
        let attn = match cfg.qk_norm_weights(w)? {
            Some((q, k)) => attn.with_qk_norm(q, k, eps, unit)?,
            None => attn,
        };
        let norm = |w: &Tensor| RmsNorm::from_global_offset(w, eps, unit);
        let post_norms = match cfg.post_norm_weights(w)? {
            Some((a, m)) => Some((norm(a)?, norm(m)?)),
            None => None,
        };
        Ok(ParallelBlock {
            cfg: cfg.clone(),
            attn_norm: norm(&w.attn_norm)?,
            attn,
            mlp_norm: norm(&w.mlp_norm)?,
            mlp: ParallelMlp::from_global(&w.w_gate, &w.w_up, &w.w_down, tp_rank, tp)?
                .with_activation(st.activation),
            post_norms,
            rope,
            tp_rank,
            tp,
        })
    }

    pub fn config(&self) -> &BlockConfig {
        &self.cfg
    }

    /// Every parameter shard with its name and where it sits in the global tensor: the nine
    /// Llama tensors, then `q_norm` and `k_norm` when the block has them (replicated, with
    /// partial gradients: [`tp_partial_grad`]), then `post_attn_norm` and `post_mlp_norm`
    /// when it has them (replicated, whole gradients).
    pub fn params(&self) -> Vec<(&'static str, &Var, Placement)> {
        let hd = self.cfg.head_dim;
        let q = self.attn.plan().q_range();
        let kv = self.attn.plan().kv_range();
        let f = self.mlp.partition().range(self.tp_rank);
        let rows = |r: &Range<usize>, k: usize| Placement::Sharded {
            dim: 0,
            range: r.start * k..r.end * k,
        };
        let cols = |r: &Range<usize>, k: usize| Placement::Sharded {
            dim: 1,
            range: r.start * k..r.end * k,
        };
        let [(nq, wq), (nk, wk), (nv, wv), (no, wo)] = self.attn.vars();
        let [(ng, wg), (nu, wu), (nd, wd)] = self.mlp.vars();
        let mut out = vec![
            ("attn_norm", self.attn_norm.weight(), Placement::Replicated),
            (nq, wq, rows(&q, hd)),
            (nk, wk, rows(&kv, hd)),
            (nv, wv, rows(&kv, hd)),
            (no, wo, cols(&q, hd)),
            ("mlp_norm", self.mlp_norm.weight(), Placement::Replicated),
            (ng, wg, rows(&f, 1)),
            (nu, wu, rows(&f, 1)),
            (nd, wd, cols(&f, 1)),
        ];
        if let Some(norms) = self.attn.qk_norm_vars() {
            out.extend(norms.map(|(n, v)| (n, v, Placement::Replicated)));
        }
        if let Some((a, m)) = &self.post_norms {
            out.push(("post_attn_norm", a.weight(), Placement::Replicated));
            out.push(("post_mlp_norm", m.weight(), Placement::Replicated));
        }
        out
    }

    /// Replicated `h [batch, seq, hidden]` -> replicated `[batch, seq, hidden]`.
    /// Two all-reduces forward (the g's), two backward (the f's).
    pub fn forward(&self, h: &Tensor, group: &Group) -> Result<Tensor> {
        check_group(group, self.tp_rank, self.tp)?;
        let n = self.attn_norm.forward(h)?; // [b, s, hidden]
        let x_par = copy_to_tp(&n, group)?; // [b, s, hidden]
        let a = self
            .attn
            .forward_local(&x_par, &self.rope, 0, group)?
            .reduce()?; // [b, s, hidden]
        let a = match &self.post_norms {
            Some((post, _)) => post.forward(&a)?, // [b, s, hidden]
            None => a,
        };
        let h = (h + a)?; // [b, s, hidden]
        let n = self.mlp_norm.forward(&h)?; // [b, s, hidden]
        let x_par = copy_to_tp(&n, group)?; // [b, s, hidden]
        let m = self.mlp.forward_local(&x_par, group)?.reduce()?; // [b, s, hidden]
        let m = match &self.post_norms {
            Some((_, post)) => post.forward(&m)?, // [b, s, hidden]
            None => m,
        };
        Ok((h + m)?)
    }
}
