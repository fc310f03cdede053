//! One pipeline stage of the Llama-style model (Qwen3's with per-head q/k norms, Gemma-3's
//! with its block and scaled embeddings) on one tp rank, built from tp-nn's layers:
//! vocab-parallel embedding on the first stage, its share of the blocks, and the final
//! RMSNorm, column-parallel LM head and vocab-parallel cross-entropy on the last (Megatron §3;
//! Narayanan et al. 2021 §2.2 for the stages).

use crate::config::{ModelConfig, TrainModel};
use crate::error::{Result, TrainError};
use crate::init::WeightSource;
use crate::layout::{self, block_tensor_name, ParamSpec};
use candle_core::{Tensor, Var};
use std::ops::Range;
use tp_comm::Group;
use tp_nn::{
    vocab_parallel_cross_entropy, BlockWeights, ColumnParallelLinear, ParallelBlock, Partition,
    RmsNorm, VocabParallelEmbedding,
};
use tp_spec::WeightName;

/// A rank's part of the model: the stage's layers, sliced for its tp rank.
#[derive(Debug)]
pub struct StageModel {
    embed: Option<VocabParallelEmbedding>,
    /// What the embeddings are multiplied by (Gemma's `sqrt(hidden)`; 1 otherwise).
    embed_scale: f64,
    blocks: Vec<ParallelBlock>,
    norm: Option<RmsNorm>,
    head: Option<ColumnParallelLinear>,
    vocab: Partition,
    layers: Range<usize>,
    specs: Vec<ParamSpec>,
}

/// What a stage consumes: token ids (first stage) or the previous stage's hidden states.
pub enum StageInput<'a> {
    Tokens(&'a Tensor), // [batch, seq] u32
    Hidden(&'a Tensor), // [batch, seq, hidden]
}

impl StageModel {
    /// Builds stage `pp_rank` of `pp` for `tp_rank` of `tp` from global weights. Each layer's
    /// global tensors are materialized one layer at a time, then sliced.
    pub fn new(
        cfg: &ModelConfig,
        pp_rank: usize,
        pp: usize,
        tp_rank: usize,
        tp: usize,
        weights: &dyn WeightSource,
    ) -> Result<StageModel> {
        let specs = layout::stage_params(cfg, pp_rank, pp, tp_rank, tp)?;
        let layers = layout::stage_layers(cfg.layers, pp, pp_rank)?;
        let (v, h) = (cfg.vocab, cfg.hidden);
        let first = pp_rank == 0;
        let last = pp_rank + 1 == pp;
        let embed = if first {
            let table = weights.global(&layout::global_name(WeightName::Embed), &[v, h])?; // [vocab, hidden]
            Some(VocabParallelEmbedding::from_global(&table, tp_rank, tp)?)
        } else {
            None
        };
        let mut blocks = Vec::with_capacity(layers.len());
        for layer in layers.clone() {
            let shape = |short: &str| -> Vec<usize> {
                let name = block_tensor_name(cfg.arch, layer, short).unwrap_or_default();
                specs
                    .iter()
                    .find(|s| s.name == name)
                    .map(|s| s.shape.clone())
                    .unwrap_or_default()
            };
            let get = |short: &str| -> Result<Tensor> {
                let name = block_tensor_name(cfg.arch, layer, short).unwrap_or_default();
                weights.global(&name, &shape(short))
            };
            let w = BlockWeights {
                attn_norm: get("attn_norm")?,
                wq: get("wq")?,
                wk: get("wk")?,
                wv: get("wv")?,
                wo: get("wo")?,
                mlp_norm: get("mlp_norm")?,
                w_gate: get("w_gate")?,
                w_up: get("w_up")?,
                w_down: get("w_down")?,
                q_norm: None,
                k_norm: None,
                post_attn_norm: None,
                post_mlp_norm: None,
            };
            let w = if cfg.qk_norm {
                BlockWeights {
                    q_norm: Some(get("q_norm")?), // [head_dim]
                    k_norm: Some(get("k_norm")?), // [head_dim]
                    ..w
                }
            } else {
                w
            };
            let w = if cfg.block.post_norms {
                BlockWeights {
                    post_attn_norm: Some(get("post_attn_norm")?), // [hidden]
                    post_mlp_norm: Some(get("post_mlp_norm")?),   // [hidden]
                    ..w
                }
            } else {
                w
            };
            blocks.push(ParallelBlock::from_global(
                &cfg.block(layer),
                &w,
                tp_rank,
                tp,
            )?);
        }
        let (norm, head) = if last {
            let w = weights.global(&layout::global_name(WeightName::OutputNorm), &[h])?; // [hidden]
            let lm = weights.global(&layout::global_name(WeightName::Output), &[v, h])?; // [vocab, hidden]
            (
                Some(RmsNorm::from_global_offset(
                    &w,
                    cfg.rms_eps,
                    cfg.block.hf_norm_minus_one,
                )?),
                Some(ColumnParallelLinear::from_global(&lm, tp_rank, tp)?),
            )
        } else {
            (None, None)
        };
        let model = StageModel {
            embed,
            embed_scale: if cfg.block.embed_scale {
                (h as f64).sqrt()
            } else {
                1.0
            },
            blocks,
            norm,
            head,
            vocab: layout::vocab_partition(cfg, tp)?,
            layers,
            specs,
        };
        model.check_placements()?;
        Ok(model)
    }

    /// The layer range of this stage.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// Every parameter shard with its spec, in model order.
    pub fn params(&self) -> Vec<(&ParamSpec, &Var)> {
        self.specs.iter().zip(self.vars()).collect()
    }

    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    fn vars(&self) -> Vec<&Var> {
        let mut out = Vec::with_capacity(self.specs.len());
        if let Some(e) = &self.embed {
            out.push(e.weight());
        }
        for b in &self.blocks {
            out.extend(b.params().into_iter().map(|(_, v, _)| v));
        }
        if let (Some(n), Some(h)) = (&self.norm, &self.head) {
            out.push(n.weight());
            out.push(h.weight());
        }
        out
    }

    /// The layout module and tp-nn must agree on every shard (one source of truth checked
    /// against the other at every construction).
    fn check_placements(&self) -> Result<()> {
        let vars = self.vars();
        if vars.len() != self.specs.len() {
            return Err(TrainError::Config(format!(
                "internal: stage has {} tensors but the layout lists {}",
                vars.len(),
                self.specs.len()
            )));
        }
        let mut block_places = self
            .blocks
            .iter()
            .flat_map(|b| b.params().into_iter().map(|(n, _, p)| (n, p)));
        for (spec, var) in self.specs.iter().zip(&vars) {
            if var.dims() != spec.local_shape().as_slice() {
                return Err(TrainError::Config(format!(
                    "internal: {} is {:?} on this rank but the layout says {:?}",
                    spec.name,
                    var.dims(),
                    spec.local_shape()
                )));
            }
            if spec.name.starts_with("model.layers.") {
                let (short, p) = block_places.next().unzip();
                if p.as_ref() != Some(&spec.placement)
                    || short.map(tp_nn::tp_partial_grad) != Some(spec.tp_partial_grad)
                {
                    return Err(TrainError::Config(format!(
                        "internal: {} placement {:?} (partial gradient: {}) differs from \
                         tp-nn's {short:?} {p:?}",
                        spec.name, spec.placement, spec.tp_partial_grad
                    )));
                }
            }
        }
        Ok(())
    }

    /// Runs the stage. Returns hidden states `[batch, seq, hidden]`, or on the last stage
    /// (with `targets [batch * seq]`) the mean cross-entropy, a replicated scalar.
    pub fn forward(
        &self,
        input: StageInput<'_>,
        targets: Option<&Tensor>,
        tp: &Group,
    ) -> Result<Tensor> {
        let h = self.hidden(input, tp)?; // [b, s, hidden]
        match (&self.norm, &self.head, targets) {
            (Some(norm), Some(head), Some(t)) => {
                let (b, s, _) = h.dims3()?;
                let n = norm.forward(&h)?; // [b, s, hidden]
                let logits = head.forward(&n, tp)?; // [b, s, vocab_local]
                let v_local = logits.dim(2)?;
                let logits = logits.reshape((b * s, v_local))?; // [b*s, vocab_local]
                Ok(vocab_parallel_cross_entropy(&logits, t, &self.vocab, tp)?)
            }
            (None, None, None) => Ok(h),
            _ => Err(TrainError::Config(
                "internal: targets go to the last stage only".into(),
            )),
        }
    }

    /// The stage's embedding (first stage) and blocks, without the last stage's head: hidden
    /// states `[batch, seq, hidden]`.
    pub fn hidden(&self, input: StageInput<'_>, tp: &Group) -> Result<Tensor> {
        let mut h = match (input, &self.embed) {
            (StageInput::Tokens(ids), Some(e)) if self.embed_scale != 1.0 => {
                (e.forward(ids, tp)? * self.embed_scale)? // [b, s, hidden]
            }
            (StageInput::Tokens(ids), Some(e)) => e.forward(ids, tp)?, // [b, s, hidden]
            (StageInput::Hidden(h), None) => h.clone(),                // [b, s, hidden]
            _ => {
                return Err(TrainError::Config(
                    "internal: the first stage takes tokens, the others hidden states".into(),
                ))
            }
        };
        for b in &self.blocks {
            h = b.forward(&h, tp)?; // [b, s, hidden]
        }
        Ok(h)
    }

    /// Logits of the last stage for a hidden input: `[batch, seq, vocab_local]` (for tests
    /// and evaluation; training uses [`StageModel::forward`]).
    pub fn logits_local(&self, h: &Tensor, tp: &Group) -> Result<Option<Tensor>> {
        match (&self.norm, &self.head) {
            (Some(norm), Some(head)) => Ok(Some(head.forward(&norm.forward(h)?, tp)?)),
            _ => Ok(None),
        }
    }
}
