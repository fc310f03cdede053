//! The one parameter table (docs/design.md "One parameter table, two executors"): per layer a
//! [`LayerSpec`] (attention, MLP and norm conventions) and the parameters it holds, each with
//! its global shape and how it is split; [`ShardPlan::place`] gives every rank its slice.
//! Expected weights, bytes per rank, the inference loader, the synthetic models, the training
//! stage parameters and the checkpoints' shard metadata all derive from [`model_params`].
//! An MoE block is one more [`MlpSpec`] variant with its own params, not a new copy.

use crate::arch::RopeStyle;
use crate::block::Activation;
use crate::config::{Experts, ModelConfig};
use crate::shard::ShardPlan;
use crate::weights::{Expected, WeightName};
use std::ops::Range;

/// The units a split parameter is cut in (Megatron §3: attention by heads, the MLP by FFN
/// columns, the embedding and LM head by vocabulary rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Units {
    /// The rank's query heads, `head_dim` rows or columns each.
    QHeads,
    /// The KV heads the rank's query heads need (shared with a neighbour when replicated).
    KvHeads,
    /// The rank's FFN columns (in the plan's FFN unit).
    Ffn,
    /// The rank's vocabulary rows.
    Vocab,
    /// The rank's columns of one expert (none for an expert of another expert group).
    ExpertFfn,
    /// The rank's columns of the shared expert.
    SharedFfn,
}

/// How a parameter is split over the tp ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds it whole (norm weights).
    Replicated,
    /// Rows (dim 0) by `Units`: column-parallel matrices, their biases, vocabulary tables.
    Rows(Units),
    /// Columns (dim 1) by `Units`: row-parallel matrices (their products are summed over tp).
    Cols(Units),
}

/// Where a parameter shard sits in its global tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Every rank holds the whole tensor (norm weights).
    Replicated,
    /// The rank holds `range` of `dim` (element indices, not units). Shards of different
    /// ranks may overlap (replicated KV heads): their gradients then add up to the dense one.
    /// An empty range: the rank holds none of it (an expert of another expert group).
    Sharded { dim: usize, range: Range<usize> },
}

/// One parameter of the model: its name, global shape and split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Param {
    pub name: WeightName,
    pub shape: Expected,
    pub split: Split,
    /// Replicated, but each tp rank's backward gives only its heads' share of the gradient
    /// (the per-head q/k norms see only the rank's heads): the full gradient is the sum over
    /// the tp group.
    pub partial_grad: bool,
}

impl Param {
    /// The global shape as dimensions (`[rows, cols]` or `[len]`).
    pub fn dims(&self) -> Vec<usize> {
        match self.shape {
            Expected::Matrix { rows, cols } => vec![rows, cols],
            Expected::Vector { len } => vec![len],
        }
    }

    /// Whether weight decay applies (matrices yes; norm weights and biases no).
    pub fn decay(&self) -> bool {
        matches!(self.shape, Expected::Matrix { .. })
    }
}

/// A layer's attention.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Q, K and V carry biases (Qwen2).
    pub bias: bool,
    /// Each query and key head is RMS-normalised before RoPE (Qwen3, Gemma-3).
    pub qk_norm: bool,
    /// The q/k norms span the whole projections (all heads; OLMoE): their weights are
    /// `[heads x head_dim]` and `[kv_heads x head_dim]`, split by heads like the biases.
    pub qk_norm_whole: bool,
    /// Positions a query sees, its own included (`None`: every earlier one).
    pub window: Option<usize>,
    /// RoPE base and linear position scale of this layer.
    pub rope_theta: f64,
    pub rope_scale: f64,
    /// How the checkpoint's Q/K rows pair RoPE's dimensions.
    pub rope_style: RopeStyle,
    /// What queries are multiplied by before the dot products.
    pub query_scale: f64,
}

/// A layer's MLP.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MlpSpec {
    /// The gated MLP `down(act(gate(x)) * up(x))`: gate and up column-parallel, down
    /// row-parallel over FFN columns.
    Dense { ffn: usize, activation: Activation },
    /// A mixture of experts: a replicated router picks `experts.per_token` of
    /// `experts.count` gated MLPs of width `ffn` per token ([`crate::ExpertShard`] splits
    /// them), plus an optional shared expert.
    Moe {
        ffn: usize,
        activation: Activation,
        experts: Experts,
    },
}

/// One transformer layer: what both executors read to build it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerSpec {
    pub layer: usize,
    pub hidden: usize,
    pub rms_eps: f64,
    pub attention: AttentionSpec,
    pub mlp: MlpSpec,
    /// Norms of the attention and MLP outputs before each residual add (Gemma).
    pub post_norms: bool,
    /// Every norm computes `x * (1 + w)` with `w` as an HF checkpoint stores it (Gemma; GGUF
    /// files store the sum).
    pub hf_norm_minus_one: bool,
}

impl ModelConfig {
    /// Layer `layer`'s spec (Gemma-3's local and global layers differ in window and RoPE).
    pub fn layer_spec(&self, layer: usize) -> LayerSpec {
        let (rope_theta, rope_scale) = self.rope(layer);
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
                qk_norm_whole: self.qk_norm && self.block.qk_norm_whole,
                window: self.window(layer),
                rope_theta,
                rope_scale,
                rope_style: self.rope_style,
                query_scale: self.query_scale(),
            },
            mlp: match self.experts {
                None => MlpSpec::Dense {
                    ffn: self.ffn,
                    activation: self.block.activation,
                },
                Some(experts) => MlpSpec::Moe {
                    ffn: self.ffn,
                    activation: self.block.activation,
                    experts,
                },
            },
            post_norms: self.block.post_norms,
            hf_norm_minus_one: self.block.hf_norm_minus_one,
        }
    }
}

fn matrix(name: WeightName, rows: usize, cols: usize, split: Split) -> Param {
    Param {
        name,
        shape: Expected::Matrix { rows, cols },
        split,
        partial_grad: false,
    }
}

fn vector(name: WeightName, len: usize, split: Split) -> Param {
    Param {
        name,
        shape: Expected::Vector { len },
        split,
        partial_grad: false,
    }
}

impl LayerSpec {
    /// The layer's parameters in block order: the attention norm, Q, K, V (their biases, the
    /// q/k norms), O, the post-attention norm, the MLP norm, the post-MLP norm, then the MLP.
    pub fn params(&self) -> Vec<Param> {
        use Split::{Cols, Replicated, Rows};
        use Units::{Ffn, KvHeads, QHeads};
        let l = self.layer;
        let h = self.hidden;
        let a = &self.attention;
        let (q, kv) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
        let mut out = vec![
            vector(WeightName::AttnNorm(l), h, Replicated),
            matrix(WeightName::Q(l), q, h, Rows(QHeads)),
            matrix(WeightName::K(l), kv, h, Rows(KvHeads)),
            matrix(WeightName::V(l), kv, h, Rows(KvHeads)),
        ];
        if a.bias {
            out.push(vector(WeightName::QBias(l), q, Rows(QHeads)));
            out.push(vector(WeightName::KBias(l), kv, Rows(KvHeads)));
            out.push(vector(WeightName::VBias(l), kv, Rows(KvHeads)));
        }
        if a.qk_norm_whole {
            out.push(vector(WeightName::QNorm(l), q, Rows(QHeads)));
            out.push(vector(WeightName::KNorm(l), kv, Rows(KvHeads)));
        } else if a.qk_norm {
            for name in [WeightName::QNorm(l), WeightName::KNorm(l)] {
                out.push(Param {
                    partial_grad: true,
                    ..vector(name, a.head_dim, Replicated)
                });
            }
        }
        out.push(matrix(WeightName::O(l), h, q, Cols(QHeads)));
        if self.post_norms {
            out.push(vector(WeightName::PostAttnNorm(l), h, Replicated));
        }
        out.push(vector(WeightName::FfnNorm(l), h, Replicated));
        if self.post_norms {
            out.push(vector(WeightName::PostFfnNorm(l), h, Replicated));
        }
        match self.mlp {
            MlpSpec::Dense { ffn, .. } => {
                out.push(matrix(WeightName::Gate(l), ffn, h, Rows(Ffn)));
                out.push(matrix(WeightName::Up(l), ffn, h, Rows(Ffn)));
                out.push(matrix(WeightName::Down(l), h, ffn, Cols(Ffn)));
            }
            MlpSpec::Moe { ffn, experts, .. } => {
                use Units::{ExpertFfn, SharedFfn};
                // Replicated, but each rank's backward sees only its experts' share.
                out.push(Param {
                    partial_grad: true,
                    ..matrix(WeightName::Router(l), experts.count, h, Replicated)
                });
                for e in 0..experts.count {
                    out.push(matrix(
                        WeightName::ExpertGate(l, e),
                        ffn,
                        h,
                        Rows(ExpertFfn),
                    ));
                    out.push(matrix(WeightName::ExpertUp(l, e), ffn, h, Rows(ExpertFfn)));
                    out.push(matrix(
                        WeightName::ExpertDown(l, e),
                        h,
                        ffn,
                        Cols(ExpertFfn),
                    ));
                }
                if let Some(s) = experts.shared_ffn {
                    out.push(vector(WeightName::SharedExpertGate(l), h, Replicated));
                    out.push(matrix(WeightName::SharedGate(l), s, h, Rows(SharedFfn)));
                    out.push(matrix(WeightName::SharedUp(l), s, h, Rows(SharedFfn)));
                    out.push(matrix(WeightName::SharedDown(l), h, s, Cols(SharedFfn)));
                }
            }
        }
        out
    }
}

/// The parameters before the layers: the token embedding (vocabulary rows).
pub fn embed_params(cfg: &ModelConfig) -> Vec<Param> {
    vec![matrix(
        WeightName::Embed,
        cfg.vocab,
        cfg.hidden,
        Split::Rows(Units::Vocab),
    )]
}

/// The parameters after the layers: the final norm, and the LM head when it is not tied to
/// the embedding.
pub fn head_params(cfg: &ModelConfig) -> Vec<Param> {
    let mut out = vec![vector(
        WeightName::OutputNorm,
        cfg.hidden,
        Split::Replicated,
    )];
    if !cfg.tied_embeddings {
        out.push(matrix(
            WeightName::Output,
            cfg.vocab,
            cfg.hidden,
            Split::Rows(Units::Vocab),
        ));
    }
    out
}

/// The parameters of `layers` (a pipeline stage's range), with the embedding when the range
/// starts the model (`first`) and the final norm and head when it ends it (`last`).
pub fn stage_params(
    cfg: &ModelConfig,
    layers: Range<usize>,
    first: bool,
    last: bool,
) -> Vec<Param> {
    let mut out = if first { embed_params(cfg) } else { Vec::new() };
    for l in layers {
        out.extend(cfg.layer_spec(l).params());
    }
    if last {
        out.extend(head_params(cfg));
    }
    out
}

/// Every parameter of the model in order: embedding, each layer's, final norm and head.
pub fn model_params(cfg: &ModelConfig) -> Vec<Param> {
    stage_params(cfg, 0..cfg.layers, true, true)
}

impl ShardPlan {
    /// The element range of `units` this rank holds along the split dimension.
    pub fn units_range(&self, units: Units) -> Range<usize> {
        let hd = self.head_dim;
        let scale = |r: Range<usize>, k: usize| r.start * k..r.end * k;
        match units {
            Units::QHeads => scale(self.q_heads(), hd),
            Units::KvHeads => scale(self.kv_heads(), hd),
            Units::Ffn => self.ffn_cols(),
            Units::Vocab => self.vocab_rows(),
            Units::ExpertFfn => self.experts.as_ref().map_or(0..0, |x| {
                let r = x.ffn.range(x.rank_in_group);
                r.start * x.ffn_unit..r.end * x.ffn_unit
            }),
            Units::SharedFfn => self
                .experts
                .as_ref()
                .map_or(0..0, |x| x.shared_cols(self.tp_rank)),
        }
    }

    /// The element range of `param` this rank holds along its split dimension: its units,
    /// or nothing for an expert of another expert group.
    fn param_range(&self, param: &Param, units: Units) -> Range<usize> {
        match (param.name.expert(), &self.experts) {
            (Some(e), Some(x)) => x.expert_cols(e),
            _ => self.units_range(units),
        }
    }

    /// Where this rank's shard of `param` sits in the global tensor: the one placement
    /// function every loader, executor and checkpoint uses.
    pub fn place(&self, param: &Param) -> Placement {
        match param.split {
            Split::Replicated => Placement::Replicated,
            Split::Rows(u) => Placement::Sharded {
                dim: 0,
                range: self.param_range(param, u),
            },
            Split::Cols(u) => Placement::Sharded {
                dim: 1,
                range: self.param_range(param, u),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::Arch;
    use crate::block::BlockStyle;

    fn cfg(arch: Arch) -> ModelConfig {
        let gemma = arch == Arch::Gemma3;
        ModelConfig {
            arch,
            layers: 3,
            hidden: 64,
            ffn: 192,
            heads: 6,
            kv_heads: 2,
            head_dim: 16,
            vocab: 100,
            rms_eps: 1e-6,
            rope_theta: 1e4,
            rope_style: RopeStyle::RotateHalf,
            context: 64,
            qkv_bias: arch == Arch::Qwen2,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3),
            tied_embeddings: arch != Arch::Llama,
            block: if gemma {
                BlockStyle::gemma3(8)
            } else {
                BlockStyle::LLAMA
            },
            experts: None,
        }
    }

    #[test]
    fn the_table_counts_every_parameter_of_the_config() {
        for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Gemma3] {
            let c = cfg(arch);
            let all = model_params(&c);
            let n: usize = all.iter().map(|p| p.dims().iter().product::<usize>()).sum();
            assert_eq!(n, c.parameter_count(), "{arch:?}");
            let names: std::collections::HashSet<_> = all.iter().map(|p| p.name).collect();
            assert_eq!(names.len(), all.len(), "{arch:?}: a name listed twice");
            // Stages partition the table.
            let staged: Vec<Param> = [(0..1, true, false), (1..3, false, true)]
                .into_iter()
                .flat_map(|(r, f, l)| stage_params(&c, r, f, l))
                .collect();
            assert_eq!(staged, all);
        }
    }

    #[test]
    fn placements_tile_every_split_parameter_and_follow_the_plan() {
        let c = cfg(Arch::Qwen2);
        for tp in 1..=6 {
            let plans: Vec<ShardPlan> = (0..tp)
                .map(|r| ShardPlan::new(&c, 32, r, tp).unwrap())
                .collect();
            for p in model_params(&c) {
                let places: Vec<Placement> = plans.iter().map(|s| s.place(&p)).collect();
                match p.split {
                    Split::Replicated => {
                        assert!(places.iter().all(|x| *x == Placement::Replicated))
                    }
                    Split::Rows(u) | Split::Cols(u) => {
                        let dim = usize::from(matches!(p.split, Split::Cols(_)));
                        let extent = p.dims()[dim];
                        let mut covered = vec![0usize; extent];
                        for x in &places {
                            let Placement::Sharded { dim: d, range } = x else {
                                panic!("{p:?} replicated")
                            };
                            assert_eq!(*d, dim);
                            covered[range.clone()].iter_mut().for_each(|c| *c += 1);
                        }
                        // Every element held; only KV heads may be held twice.
                        assert!(covered.iter().all(|&c| c >= 1), "{p:?} tp {tp}");
                        if u != Units::KvHeads {
                            assert!(covered.iter().all(|&c| c == 1), "{p:?} tp {tp}");
                        }
                    }
                }
            }
            // FFN in the plan's units: tp 4 of 192 columns in 32-column units is 64|64|32|32.
            if tp == 4 {
                let down = c.layer_spec(0).params().into_iter().last().unwrap();
                let r: Vec<_> = plans.iter().map(|s| s.place(&down)).collect();
                assert_eq!(
                    r[2],
                    Placement::Sharded {
                        dim: 1,
                        range: 128..160
                    }
                );
            }
        }
    }

    #[test]
    fn expert_placements_tile_every_expert_at_every_ep() {
        // 8 experts of 128 columns (4 units of 32), a shared expert of 96; Qwen2-MoE style.
        let mut e = Experts::new(8, 2);
        e.shared_ffn = Some(96);
        e.normalize = false;
        let c = ModelConfig {
            ffn: 128,
            experts: Some(e),
            ..cfg(Arch::Qwen2)
        };
        let all = model_params(&c);
        let n: usize = all.iter().map(|p| p.dims().iter().product::<usize>()).sum();
        assert_eq!(n, c.parameter_count());
        for (tp, ep) in [
            (1, 1),
            (2, 1),
            (2, 2),
            (3, 3),
            (4, 2),
            (4, 4),
            (3, 1),
            (6, 3),
        ] {
            let plans: Vec<ShardPlan> = (0..tp)
                .map(|r| {
                    ShardPlan::new(&c, 32, r, tp)
                        .and_then(|p| p.with_expert_groups(&c, ep))
                        .unwrap()
                })
                .collect();
            for p in all.iter().filter(|p| {
                matches!(
                    p.split,
                    Split::Rows(Units::ExpertFfn | Units::SharedFfn)
                        | Split::Cols(Units::ExpertFfn | Units::SharedFfn)
                )
            }) {
                let dim = usize::from(matches!(p.split, Split::Cols(_)));
                let mut covered = vec![0usize; p.dims()[dim]];
                for s in &plans {
                    let Placement::Sharded { range, .. } = s.place(p) else {
                        panic!("{p:?}")
                    };
                    covered[range].iter_mut().for_each(|c| *c += 1);
                }
                assert!(covered.iter().all(|&c| c == 1), "{p:?} tp {tp} ep {ep}");
            }
            // Whole experts per group: 8 experts over 3 groups are 3|3|2.
            if ep == 3 {
                let local: Vec<_> = plans
                    .iter()
                    .map(|p| p.experts.as_ref().unwrap().local.clone())
                    .collect();
                assert_eq!(local[0], 0..3);
                assert_eq!(local[tp - 1], 6..8);
            }
        }
        let e = ShardPlan::new(&c, 32, 0, 4)
            .unwrap()
            .with_expert_groups(&c, 3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("must divide tp") && e.contains("1, 2, 4"), "{e}");
    }

    #[test]
    fn layer_specs_carry_the_families_conventions() {
        let g = cfg(Arch::Gemma3);
        let local = g.layer_spec(0);
        let global = g.layer_spec(5); // every 6th layer attends globally
        assert_eq!(local.attention.window, Some(8));
        assert_eq!(local.attention.rope_theta, 10_000.0);
        assert_eq!(global.attention.window, None);
        assert_eq!(global.attention.rope_theta, g.rope_theta);
        assert!(local.post_norms && local.hf_norm_minus_one);
        assert_eq!(global.mlp, local.mlp);
        let q = cfg(Arch::Qwen3).layer_spec(1);
        let norms: Vec<_> = q.params().into_iter().filter(|p| p.partial_grad).collect();
        assert_eq!(
            norms.iter().map(|p| p.name).collect::<Vec<_>>(),
            [WeightName::QNorm(1), WeightName::KNorm(1)]
        );
        assert!(norms.iter().all(|p| !p.decay()));
    }
}
