//! The pre-norm transformer block composed of the parallel layers (Megatron §3, Fig. 4:
//! two all-reduces forward and two backward), with Gemma-3's departures per layer
//! ([`LayerStyle`]): GeGLU, norms after the attention and MLP, `x * (1 + w)` norms, the query
//! scale, a sliding window and linearly scaled RoPE; Qwen3's per-head q/k norms and Qwen2's
//! Q/K/V biases ([`BlockConfig::qk_norm`], [`BlockConfig::qkv_bias`]).

use crate::attention::ParallelAttention;
use crate::error::{Result, TpError};
use crate::linear::check_group;
use crate::mlp::ParallelMlp;
use crate::moe::ParallelMoe;
use crate::norm::RmsNorm;
use crate::packing::Segments;
use crate::rng::{RandomTensor, Rng};
use crate::rope::{Rope, RopeLayout};
use crate::sequence::SeqLayout;
use candle_core::{Device, Tensor, Var};
use tp_comm::Group;
use tp_spec::{
    Activation, AttentionSpec, Experts, LayerSpec, MlpSpec, Param, Placement, RopeStyle, ShardPlan,
    WeightName,
};

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
    /// The MLP is a mixture of these experts, each `ffn` wide (docs/moe.md); `None`: one
    /// gated MLP.
    pub experts: Option<Experts>,
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
        experts: None,
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
    /// Qwen2: biases added to the Q, K and V projections (before RoPE).
    pub qkv_bias: bool,
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
    pub mlp: MlpWeights,
    /// Qwen3's per-head norms, present exactly when [`BlockConfig::qk_norm`] is set.
    pub q_norm: Option<Tensor>, // [head_dim]
    pub k_norm: Option<Tensor>, // [head_dim]
    /// Gemma's norms of the attention and MLP outputs, present exactly when
    /// [`LayerStyle::post_norms`] is set.
    pub post_attn_norm: Option<Tensor>, // [hidden]
    pub post_mlp_norm: Option<Tensor>, // [hidden]
    /// Qwen2's `(bq [heads * head_dim], bk [kv_heads * head_dim], bv [kv_heads * head_dim])`,
    /// present exactly when [`BlockConfig::qkv_bias`] is set.
    pub qkv_bias: Option<(Tensor, Tensor, Tensor)>,
}

/// The global weights of a block's MLP.
#[derive(Clone, Debug)]
pub enum MlpWeights {
    /// One gated MLP.
    Dense {
        gate: Tensor, // [ffn, hidden]
        up: Tensor,   // [ffn, hidden]
        down: Tensor, // [hidden, ffn]
    },
    /// A router and each expert's `(gate [ffn, hidden], up [ffn, hidden], down [hidden, ffn])`.
    Moe {
        router: Tensor, // [experts, hidden]
        experts: Vec<(Tensor, Tensor, Tensor)>,
    },
}

impl MlpWeights {
    /// `(gate, up, down)` of a dense MLP; `None` for a mixture of experts.
    pub fn dense(&self) -> Option<(&Tensor, &Tensor, &Tensor)> {
        match self {
            MlpWeights::Dense { gate, up, down } => Some((gate, up, down)),
            MlpWeights::Moe { .. } => None,
        }
    }
}

impl BlockConfig {
    /// The block of a layer of the parameter table, for sequences of at most `max_seq`
    /// positions (a shared expert, Qwen2-MoE's, is refused).
    pub fn from_spec(spec: &LayerSpec, max_seq: usize) -> Result<Self> {
        let a = &spec.attention;
        if a.qk_norm_whole {
            return Err(TpError::Config(format!(
                "layer {} normalises queries and keys over all heads at once (OLMoE), which the \
                 training layers do not do (they normalise each head)",
                spec.layer
            )));
        }
        let (ffn, activation, experts) = match spec.mlp {
            MlpSpec::Dense { ffn, activation } => (ffn, activation, None),
            MlpSpec::Moe {
                experts:
                    Experts {
                        shared_ffn: Some(_),
                        ..
                    },
                ..
            } => {
                return Err(TpError::Config(format!(
                "layer {} has a shared expert (Qwen2-MoE), which the training layers do not have",
                spec.layer
            )))
            }
            MlpSpec::Moe {
                ffn,
                activation,
                experts,
            } => (ffn, activation, Some(experts)),
        };
        Ok(BlockConfig {
            hidden: spec.hidden,
            heads: a.heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            ffn,
            rope_theta: a.rope_theta,
            rope_layout: match a.rope_style {
                RopeStyle::Interleaved => RopeLayout::Interleaved,
                RopeStyle::RotateHalf => RopeLayout::RotateHalf,
            },
            rms_eps: spec.rms_eps,
            max_seq,
            qk_norm: a.qk_norm,
            qkv_bias: a.bias,
            style: LayerStyle {
                activation,
                post_norms: spec.post_norms,
                unit_offset_norms: spec.hf_norm_minus_one,
                query_scale: Some(a.query_scale),
                window: a.window,
                rope_scale: a.rope_scale,
                experts,
            },
        })
    }

    /// This block as layer `layer` of the parameter table (the inverse of
    /// [`BlockConfig::from_spec`]).
    pub fn layer_spec(&self, layer: usize) -> LayerSpec {
        let st = &self.style;
        LayerSpec {
            layer,
            hidden: self.hidden,
            rms_eps: self.rms_eps,
            attention: AttentionSpec {
                heads: self.heads,
                kv_heads: self.kv_heads,
                head_dim: self.head_dim,
                bias: self.qkv_bias,
                qk_norm: self.qk_norm,
                qk_norm_whole: false,
                window: st.window,
                rope_theta: self.rope_theta,
                rope_scale: st.rope_scale,
                rope_style: match self.rope_layout {
                    RopeLayout::Interleaved => RopeStyle::Interleaved,
                    RopeLayout::RotateHalf => RopeStyle::RotateHalf,
                },
                query_scale: st
                    .query_scale
                    .unwrap_or(1.0 / (self.head_dim as f64).sqrt()),
            },
            mlp: match st.experts {
                Some(experts) => MlpSpec::Moe {
                    ffn: self.ffn,
                    activation: st.activation,
                    experts,
                },
                None => MlpSpec::Dense {
                    ffn: self.ffn,
                    activation: st.activation,
                },
            },
            post_norms: st.post_norms,
            hf_norm_minus_one: st.unit_offset_norms,
        }
    }
}

impl BlockWeights {
    /// A block's global weights from one layer's parameters of the table with their tensors:
    /// the table says which weights a block has, this puts each in its slot.
    pub fn from_params(params: Vec<(Param, Tensor)>) -> Result<Self> {
        let mut slots: [Option<Tensor>; 16] = Default::default();
        let mut router = None;
        let mut experts: Vec<[Option<Tensor>; 3]> = Vec::new();
        for (p, t) in params {
            let expert = match p.name {
                WeightName::ExpertGate(_, e) => Some((e, 0)),
                WeightName::ExpertUp(_, e) => Some((e, 1)),
                WeightName::ExpertDown(_, e) => Some((e, 2)),
                _ => None,
            };
            if let Some((e, k)) = expert {
                if experts.len() <= e {
                    experts.resize_with(e + 1, Default::default);
                }
                experts[e][k] = Some(t);
                continue;
            }
            if let WeightName::Router(_) = p.name {
                router = Some(t);
                continue;
            }
            let slot = match p.name {
                WeightName::AttnNorm(_) => 0,
                WeightName::Q(_) => 1,
                WeightName::K(_) => 2,
                WeightName::V(_) => 3,
                WeightName::O(_) => 4,
                WeightName::FfnNorm(_) => 5,
                WeightName::Gate(_) => 6,
                WeightName::Up(_) => 7,
                WeightName::Down(_) => 8,
                WeightName::QNorm(_) => 9,
                WeightName::KNorm(_) => 10,
                WeightName::PostAttnNorm(_) => 11,
                WeightName::PostFfnNorm(_) => 12,
                WeightName::QBias(_) => 13,
                WeightName::KBias(_) => 14,
                WeightName::VBias(_) => 15,
                other => {
                    return Err(TpError::Config(format!(
                        "{other:?} is not a weight of the training block"
                    )))
                }
            };
            slots[slot] = Some(t);
        }
        let [attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down, q_norm, k_norm, post_attn_norm, post_mlp_norm, bq, bk, bv] =
            slots;
        let need = |t: Option<Tensor>, what: &str| {
            t.ok_or_else(|| TpError::Config(format!("the layer's parameters lack {what}")))
        };
        let mlp = match router {
            Some(router) => MlpWeights::Moe {
                router,
                experts: experts
                    .into_iter()
                    .enumerate()
                    .map(|(e, [g, u, d])| {
                        Ok((
                            need(g, &format!("expert {e}'s gate"))?,
                            need(u, &format!("expert {e}'s up"))?,
                            need(d, &format!("expert {e}'s down"))?,
                        ))
                    })
                    .collect::<Result<_>>()?,
            },
            None if !experts.is_empty() => {
                return Err(TpError::Config(
                    "the layer's parameters have experts but no router".into(),
                ))
            }
            None => MlpWeights::Dense {
                gate: need(w_gate, "the gate")?,
                up: need(w_up, "up")?,
                down: need(w_down, "down")?,
            },
        };
        let qkv_bias = match (bq, bk, bv) {
            (Some(q), Some(k), Some(v)) => Some((q, k, v)),
            (None, None, None) => None,
            _ => {
                return Err(TpError::Config(
                    "the layer's parameters have some of the Q/K/V biases but not all three".into(),
                ))
            }
        };
        Ok(BlockWeights {
            attn_norm: need(attn_norm, "the attention norm")?,
            wq: need(wq, "Q")?,
            wk: need(wk, "K")?,
            wv: need(wv, "V")?,
            wo: need(wo, "O")?,
            mlp_norm: need(mlp_norm, "the MLP norm")?,
            mlp,
            q_norm,
            k_norm,
            post_attn_norm,
            post_mlp_norm,
            qkv_bias,
        })
    }
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
    /// they compute `x * (1 + w)`; the q/k norms, then the post norms, then the Q/K/V
    /// biases (near 0) drawn last, so a block without them has the same other weights).
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
        let (attn_norm, wq, wk, wv, wo, mlp_norm) = (
            rng.tensor(&[h], one, 0.2, device)?,
            rng.tensor(&[q, h], 0.0, s(h), device)?,
            rng.tensor(&[kv, h], 0.0, s(h), device)?,
            rng.tensor(&[kv, h], 0.0, s(h), device)?,
            rng.tensor(&[h, q], 0.0, s(q), device)?,
            rng.tensor(&[h], one, 0.2, device)?,
        );
        let ffn = |rng: &mut Rng| -> Result<(Tensor, Tensor, Tensor)> {
            Ok((
                rng.tensor(&[f, h], 0.0, s(h), device)?,
                rng.tensor(&[f, h], 0.0, s(h), device)?,
                rng.tensor(&[h, f], 0.0, s(f), device)?,
            ))
        };
        let mlp = match self.style.experts {
            None => {
                let (gate, up, down) = ffn(&mut rng)?;
                MlpWeights::Dense { gate, up, down }
            }
            Some(e) => MlpWeights::Moe {
                router: rng.tensor(&[e.count, h], 0.0, s(h), device)?,
                experts: (0..e.count).map(|_| ffn(&mut rng)).collect::<Result<_>>()?,
            },
        };
        let mut w = BlockWeights {
            attn_norm,
            wq,
            wk,
            wv,
            wo,
            mlp_norm,
            mlp,
            q_norm: None,
            k_norm: None,
            post_attn_norm: None,
            post_mlp_norm: None,
            qkv_bias: None,
        };
        if self.qk_norm {
            w.q_norm = Some(rng.tensor(&[self.head_dim], one, 0.2, device)?);
            w.k_norm = Some(rng.tensor(&[self.head_dim], one, 0.2, device)?);
        }
        if self.style.post_norms {
            w.post_attn_norm = Some(rng.tensor(&[h], one, 0.2, device)?);
            w.post_mlp_norm = Some(rng.tensor(&[h], one, 0.2, device)?);
        }
        if self.qkv_bias {
            w.qkv_bias = Some((
                rng.tensor(&[q], 0.0, 0.5, device)?,
                rng.tensor(&[kv], 0.0, 0.5, device)?,
                rng.tensor(&[kv], 0.0, 0.5, device)?,
            ));
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

    /// The Q/K/V biases of `w`, checked against `qkv_bias` (`Some` exactly when it is set)
    /// and against the projections' widths.
    pub(crate) fn qkv_bias_weights<'a>(
        &self,
        w: &'a BlockWeights,
    ) -> Result<Option<[&'a Tensor; 3]>> {
        match (self.qkv_bias, &w.qkv_bias) {
            (true, Some((q, k, v))) => {
                let (qw, kvw) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
                for (name, t, want) in [("bq", q, qw), ("bk", k, kvw), ("bv", v, kvw)] {
                    if t.dims() != [want] {
                        return Err(TpError::Shape(format!(
                            "the bias {name} must be [{want}], got {:?}",
                            t.dims()
                        )));
                    }
                }
                Ok(Some([q, k, v]))
            }
            (false, None) => Ok(None),
            (want, _) => Err(TpError::Config(format!(
                "the block config says qkv_bias = {want}, but the weights {} Q/K/V biases",
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

/// This rank's shard of the global tensor `t` of weight `name`, cut where `plan` places the
/// table's parameter of that name.
fn shard(table: &[Param], plan: &ShardPlan, name: WeightName, t: &Tensor) -> Result<Tensor> {
    let p = table
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| TpError::Config(format!("the layer's table has no {name:?}")))?;
    Ok(match plan.place(p) {
        Placement::Replicated => t.clone(),
        Placement::Sharded { dim, range } => t.narrow(dim, range.start, range.len())?,
    })
}

/// One rank's slice of a block's MLP.
#[derive(Debug)]
enum BlockMlp {
    Dense(ParallelMlp),
    Moe(ParallelMoe),
}

/// A block's output, with the load-balancing loss of a mixture-of-experts MLP.
#[derive(Debug)]
pub struct BlockOutput {
    pub hidden: Tensor, // [b, s, hidden], or [b, s/tp, hidden] with sequence parallelism
    /// The share of the load-balancing loss this rank backpropagates (`aux / tp`, a scalar;
    /// [`crate::MoeOutput`]); `None` for a dense MLP.
    pub aux_share: Option<Tensor>,
    /// The whole load-balancing loss (for reports).
    pub aux: Option<f32>,
    /// (token, expert) pairs the MoE's capacity factor dropped (0 without one).
    pub dropped: u64,
    /// Bytes of the tensors this rank held outside the tensor-parallel regions (the block's
    /// input, the norms' outputs, the regions' reduced outputs and the residual sum): the
    /// activations sequence parallelism divides by tp.
    pub outside_bytes: usize,
}

/// One rank's slice of a transformer block.
#[derive(Debug)]
pub struct ParallelBlock {
    cfg: BlockConfig,
    attn_norm: RmsNorm,
    attn: ParallelAttention,
    mlp_norm: RmsNorm,
    mlp: BlockMlp,
    /// Gemma's `(post_attn_norm, post_mlp_norm)`.
    post_norms: Option<(RmsNorm, RmsNorm)>,
    rope: Rope,
    /// This rank's shard of the layer (heads, FFN columns), by the table's placement.
    plan: ShardPlan,
    /// The layer's index in its model (names its parameters).
    layer: usize,
    tp_rank: usize,
    tp: usize,
}

impl ParallelBlock {
    /// Rank `tp_rank` of `tp`'s slice of a lone block (layer 0, the FFN in single columns).
    pub fn from_global(
        cfg: &BlockConfig,
        w: &BlockWeights,
        tp_rank: usize,
        tp: usize,
    ) -> Result<Self> {
        cfg.validate()?;
        let plan = ShardPlan::for_block(
            cfg.heads,
            cfg.kv_heads,
            cfg.head_dim,
            cfg.ffn,
            1,
            tp_rank,
            tp,
        )?;
        Self::from_plan(cfg, w, 0, &plan)
    }

    /// Layer `layer`'s slice for the rank of `plan` (the model's shard plan: its heads and
    /// its FFN columns in the plan's unit, so the shard is the inference rank's).
    pub fn from_plan(
        cfg: &BlockConfig,
        w: &BlockWeights,
        layer: usize,
        plan: &ShardPlan,
    ) -> Result<Self> {
        cfg.validate()?;
        let (tp_rank, tp) = (plan.tp_rank, plan.tp);
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
        let attn = match cfg.qkv_bias_weights(w)? {
            Some(b) => {
                // Each bias cut where the parameter table places it on this rank.
                let table = cfg.layer_spec(layer).params();
                let names = [
                    WeightName::QBias(layer),
                    WeightName::KBias(layer),
                    WeightName::VBias(layer),
                ];
                let [bq, bk, bv] = [0, 1, 2].map(|i| shard(&table, plan, names[i], b[i]));
                attn.with_qkv_bias(&bq?, &bk?, &bv?)?
            }
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
            mlp: match (&w.mlp, st.experts) {
                (MlpWeights::Dense { gate, up, down }, None) => BlockMlp::Dense(
                    ParallelMlp::from_global_split(
                        gate,
                        up,
                        down,
                        &plan.ffn,
                        plan.ffn_unit,
                        tp_rank,
                    )?
                    .with_activation(st.activation),
                ),
                (MlpWeights::Moe { router, experts }, Some(e)) => {
                    let shard = plan.experts.as_ref().ok_or_else(|| {
                        TpError::Config(format!(
                            "layer {layer} is a mixture of experts but the shard plan places none"
                        ))
                    })?;
                    BlockMlp::Moe(ParallelMoe::from_global(
                        router,
                        e,
                        experts,
                        shard,
                        tp,
                        st.activation,
                    )?)
                }
                (_, want) => {
                    return Err(TpError::Config(format!(
                        "layer {layer}: the block config says {}, the weights are {}",
                        if want.is_some() {
                            "experts"
                        } else {
                            "a dense MLP"
                        },
                        if w.mlp.dense().is_some() {
                            "a dense MLP"
                        } else {
                            "experts"
                        }
                    )))
                }
            },
            post_norms,
            rope,
            plan: plan.clone(),
            layer,
            tp_rank,
            tp,
        })
    }

    pub fn config(&self) -> &BlockConfig {
        &self.cfg
    }

    /// [`ParallelMoe::dispatched_rows`] of the block's mixture of experts.
    pub fn dispatched_rows(&self) -> Option<u64> {
        match &self.mlp {
            BlockMlp::Moe(m) => m.dispatched_rows(),
            BlockMlp::Dense(_) => None,
        }
    }

    /// A mixture-of-experts MLP routes with `routing` (a capacity factor) from now on; a
    /// dense MLP is unchanged.
    pub fn set_moe_routing(&mut self, routing: &crate::RouteOptions) {
        if let BlockMlp::Moe(moe) = &mut self.mlp {
            moe.set_routing(routing.clone());
        }
    }

    /// A mixture-of-experts MLP selects experts with the aux-loss-free `bias` (`[count]`)
    /// from now on ([`crate::RouteOptions::bias`]); a dense MLP is unchanged.
    pub fn set_moe_bias(&mut self, bias: Vec<f32>) {
        if let BlockMlp::Moe(moe) = &mut self.mlp {
            moe.set_selection_bias(bias);
        }
    }

    /// The tokens routed to each expert since the last call (`[count]`,
    /// [`ParallelMoe::take_load`]); `None` for a dense MLP.
    pub fn take_moe_load(&self) -> Option<Vec<u64>> {
        match &self.mlp {
            BlockMlp::Moe(moe) => Some(moe.take_load()),
            BlockMlp::Dense(_) => None,
        }
    }

    /// This block with its mixture of experts' tokens dispatched over `group`
    /// ([`ParallelMoe::with_dispatch`]); a dense block is returned as it is.
    pub fn with_expert_dispatch(
        mut self,
        group: &Group,
        peers: Vec<Option<usize>>,
    ) -> Result<Self> {
        self.mlp = match self.mlp {
            BlockMlp::Moe(m) => BlockMlp::Moe(m.with_dispatch(group.clone(), peers)?),
            dense => dense,
        };
        Ok(self)
    }

    /// Selective activation recomputation of the attention core
    /// ([`ParallelAttention::set_recompute_core`]).
    pub fn set_recompute_core(&mut self, on: bool) {
        self.attn.set_recompute_core(on);
    }

    /// Every parameter shard in the table's order ([`LayerSpec::params`]), with where it sits
    /// in the global tensor ([`ShardPlan::place`]).
    pub fn params(&self) -> Result<Vec<(Param, &Var, Placement)>> {
        self.cfg
            .layer_spec(self.layer)
            .params()
            .into_iter()
            .map(|p| {
                let v = self
                    .var(p.name)
                    .ok_or_else(|| TpError::Config(format!("the block holds no {:?}", p.name)))?;
                Ok((p, v, self.plan.place(&p)))
            })
            .collect()
    }

    /// The shard of weight `name` (`None` for a weight this block does not have).
    pub fn var(&self, name: WeightName) -> Option<&Var> {
        let bias = self.attn.qkv_bias_vars();
        let [wq, wk, wv, wo] = self.attn.vars().map(|(_, v)| v);
        let mlp = match &self.mlp {
            BlockMlp::Dense(m) => Ok(m.vars().map(|(_, v)| v)),
            BlockMlp::Moe(m) => Err(m),
        };
        let dense = |k: usize| mlp.as_ref().ok().map(|v| v[k]);
        let qk = self.attn.qk_norm_vars().map(|[(_, q), (_, k)]| (q, k));
        let post = self
            .post_norms
            .as_ref()
            .map(|(a, m)| (a.weight(), m.weight()));
        match name {
            WeightName::AttnNorm(_) => Some(self.attn_norm.weight()),
            WeightName::Q(_) => Some(wq),
            WeightName::K(_) => Some(wk),
            WeightName::V(_) => Some(wv),
            WeightName::O(_) => Some(wo),
            WeightName::FfnNorm(_) => Some(self.mlp_norm.weight()),
            WeightName::Gate(_) => dense(0),
            WeightName::Up(_) => dense(1),
            WeightName::Down(_) => dense(2),
            WeightName::Router(_) => mlp.as_ref().err().map(|m| m.router()),
            WeightName::ExpertGate(_, e) => mlp.as_ref().err().map(|m| m.expert_var(e, 0)),
            WeightName::ExpertUp(_, e) => mlp.as_ref().err().map(|m| m.expert_var(e, 1)),
            WeightName::ExpertDown(_, e) => mlp.as_ref().err().map(|m| m.expert_var(e, 2)),
            WeightName::QNorm(_) => qk.map(|(q, _)| q),
            WeightName::KNorm(_) => qk.map(|(_, k)| k),
            WeightName::PostAttnNorm(_) => post.map(|(a, _)| a),
            WeightName::PostFfnNorm(_) => post.map(|(_, m)| m),
            WeightName::QBias(_) => bias.map(|b| b[0]),
            WeightName::KBias(_) => bias.map(|b| b[1]),
            WeightName::VBias(_) => bias.map(|b| b[2]),
            _ => None,
        }
    }

    /// Replicated `h [batch, seq, hidden]` -> replicated `[batch, seq, hidden]`.
    /// Two all-reduces forward (the g's), two backward (the f's). A mixture-of-experts
    /// block's load-balancing loss is dropped: training uses [`ParallelBlock::forward_aux`].
    pub fn forward(&self, h: &Tensor, group: &Group) -> Result<Tensor> {
        Ok(self.forward_aux(h, group)?.hidden)
    }

    /// [`ParallelBlock::forward`] with the load-balancing loss of a mixture of experts.
    pub fn forward_aux(&self, h: &Tensor, group: &Group) -> Result<BlockOutput> {
        self.forward_layout(h, group, SeqLayout::Replicated)
    }

    /// The block with its norms and residual adds laid out by `layout`: replicated
    /// `h [b, s, hidden]`, or with sequence parallelism this rank's positions
    /// `h [b, s/tp, hidden]` -> the same layout. Each tensor-parallel region (attention, MLP or
    /// experts) is entered by [`SeqLayout::enter`] and left by [`SeqLayout::exit`]; a mixture
    /// of experts routes the whole gathered sequence, as without sequence parallelism.
    pub fn forward_layout(
        &self,
        h: &Tensor,
        group: &Group,
        layout: SeqLayout<'_>,
    ) -> Result<BlockOutput> {
        self.forward_packed(h, group, layout, None)
    }

    /// [`ParallelBlock::forward_layout`] over packed sequences when `segments` is given (for
    /// the whole `[b, s]`, also with sequence parallelism): RoPE by each token's position in
    /// its document, attention within documents ([`ParallelAttention::forward_packed`]).
    pub fn forward_packed(
        &self,
        h: &Tensor,
        group: &Group,
        layout: SeqLayout<'_>,
        segments: Option<&Segments>,
    ) -> Result<BlockOutput> {
        check_group(group, self.tp_rank, self.tp)?;
        if let SeqLayout::Split(s) = layout {
            if s.sizes().len() != self.tp {
                return Err(TpError::Config(format!(
                    "the sequence is split over {} ranks, the block over tp={}",
                    s.sizes().len(),
                    self.tp
                )));
            }
        }
        // Bytes of the tensors this rank holds outside the tensor-parallel regions.
        let mut held = 0usize;
        let mut hold = |t: &Tensor| held += t.elem_count() * t.dtype().size_in_bytes();
        hold(h);
        let n = self.attn_norm.forward(h)?; // [b, s_local, hidden]
        hold(&n);
        let x_par = layout.enter(&n, group)?; // [b, s, hidden]
        let a = self
            .attn
            .forward_packed(&x_par, &self.rope, 0, segments, group)?;
        let a = layout.exit(a)?; // [b, s_local, hidden]
        hold(&a);
        let a = match &self.post_norms {
            Some((post, _)) => {
                let a = post.forward(&a)?; // [b, s_local, hidden]
                hold(&a);
                a
            }
            None => a,
        };
        let h = (h + a)?; // [b, s_local, hidden]
        hold(&h);
        let n = self.mlp_norm.forward(&h)?; // [b, s_local, hidden]
        hold(&n);
        let x_par = layout.enter(&n, group)?; // [b, s, hidden]
        let (m, aux_share, aux, dropped) = match &self.mlp {
            BlockMlp::Dense(mlp) => (
                layout.exit(mlp.forward_local(&x_par, group)?)?,
                None,
                None,
                0,
            ),
            BlockMlp::Moe(moe) => {
                let dims = x_par.dims().to_vec(); // [b, s, hidden]
                let flat = x_par.flatten_to(dims.len().saturating_sub(2))?; // [b*s, hidden]
                let out = moe.forward_local(&flat, group)?;
                let m = layout.exit(out.partial.reshape(&dims)?)?; // [b, s_local, hidden]
                let dropped = out.dropped.iter().sum();
                (m, Some(out.aux_share), Some(out.aux), dropped)
            }
        }; // m: [b, s_local, hidden]
        hold(&m);
        let m = match &self.post_norms {
            Some((_, post)) => {
                let m = post.forward(&m)?; // [b, s_local, hidden]
                hold(&m);
                m
            }
            None => m,
        };
        Ok(BlockOutput {
            hidden: (h + m)?,
            aux_share,
            aux,
            dropped,
            outside_bytes: held,
        })
    }
}
