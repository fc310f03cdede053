//! One pipeline stage of the Llama-style model (Qwen3's with per-head q/k norms, Gemma-3's
//! with its block and scaled embeddings) on one tp rank, built from tp-nn's layers:
//! vocab-parallel embedding on the first stage, its share of the blocks, and the final
//! RMSNorm, column-parallel LM head and vocab-parallel cross-entropy on the last (Megatron §3;
//! Narayanan et al. 2021 §2.2 for the stages). With sequence parallelism (Korthikanti et al.
//! 2022, §4.2.2) the embedding's output is reduce-scattered to `seq/tp` positions per rank,
//! the blocks keep that layout outside their tensor-parallel regions, and the final norm runs
//! on the rank's positions before the sequence is all-gathered for the LM head.

use crate::config::{ModelConfig, TrainModel};
use crate::error::{Result, TrainError};
use crate::init::WeightSource;
use crate::layout::{self, ParamSpec};
use candle_core::{Tensor, Var};
use std::ops::Range;
use tp_comm::Group;
use tp_nn::{
    vocab_parallel_cross_entropy_weighted, BlockWeights, ColumnParallelLinear, ParallelBlock,
    Partition, RmsNorm, Segments, SeqLayout, SeqSplit, VocabParallelEmbedding,
};
use tp_plan::workload::Recompute;
use tp_spec::{hf_name, WeightName};

/// A rank's part of the model: the stage's layers, sliced for its tp rank.
#[derive(Debug)]
pub struct StageModel {
    embed: Option<VocabParallelEmbedding>,
    /// What the embeddings are multiplied by (Gemma's `sqrt(hidden)`; 1 otherwise).
    embed_scale: f64,
    blocks: Vec<ParallelBlock>,
    norm: Option<RmsNorm>,
    head: Option<Head>,
    vocab: Partition,
    layers: Range<usize>,
    specs: Vec<ParamSpec>,
    /// The tp group's size.
    tp: usize,
    /// Sequence parallelism ([`StageModel::with_sequence_parallel`]).
    sequence_parallel: bool,
    /// What the backward recomputes instead of keeping from the forward.
    recompute: Recompute,
}

/// A stage's output with its mixture-of-experts layers' load-balancing loss.
#[derive(Debug)]
pub struct StageOutput {
    /// Hidden states `[batch, seq, hidden]`, or on the last stage the mean cross-entropy.
    pub value: Tensor,
    /// The sum over the stage's MoE layers of this rank's share of their load-balancing loss
    /// (a scalar to backpropagate, times the loss's coefficient); `None` without experts.
    pub aux_share: Option<Tensor>,
    /// The sum over the stage's MoE layers of their whole load-balancing loss (for reports).
    pub aux: f64,
    /// (token, expert) pairs the stage's MoE layers dropped under a capacity factor.
    pub dropped: u64,
}

/// The last stage's LM head.
#[derive(Debug)]
enum Head {
    /// Its own column-parallel weight: untied, or (tied embeddings over pipeline stages) the
    /// last stage's copy of the embedding, whose gradient the trainer sums with the first's.
    Linear(ColumnParallelLinear),
    /// The stage's own embedding table (tied embeddings, one stage): `logits = x E_local^T`,
    /// so both uses add into one gradient.
    Tied,
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
        Self::new_ep(
            cfg,
            pp_rank,
            pp,
            tp_rank,
            tp,
            &layout::EpRank::none(),
            weights,
        )
    }

    /// [`StageModel::new`] with the experts placed by `ep` ([`layout::shard_plan_ep`]); across
    /// replicas, give the stage its dispatch with [`StageModel::with_expert_dispatch`].
    pub fn new_ep(
        cfg: &ModelConfig,
        pp_rank: usize,
        pp: usize,
        tp_rank: usize,
        tp: usize,
        ep: &layout::EpRank,
        weights: &dyn WeightSource,
    ) -> Result<StageModel> {
        let specs = layout::stage_params_ep(cfg, pp_rank, pp, tp_rank, tp, ep)?;
        let plan = layout::shard_plan_ep(cfg, tp_rank, tp, ep)?;
        let layers = layout::stage_layers(cfg.layers, pp, pp_rank)?;
        let (v, h) = (cfg.vocab, cfg.hidden);
        let first = pp_rank == 0;
        let last = pp_rank + 1 == pp;
        let embed = if first {
            let table = weights.global(
                WeightName::Embed,
                &layout::global_name(WeightName::Embed),
                &[v, h],
            )?; // [vocab, hidden]
            Some(VocabParallelEmbedding::from_global(&table, tp_rank, tp)?)
        } else {
            None
        };
        let mut blocks = Vec::with_capacity(layers.len());
        for layer in layers.clone() {
            // The layer's global tensors, as the table lists them, one layer at a time.
            let spec = cfg.layer_spec(layer);
            let mut global = Vec::new();
            for p in spec.params() {
                let name = hf_name(cfg.arch, p.name);
                global.push((p, weights.global(p.name, &name, &p.dims())?));
            }
            let w = BlockWeights::from_params(global)?;
            blocks.push(ParallelBlock::from_plan(
                &cfg.block(layer)?,
                &w,
                layer,
                &plan,
            )?);
        }
        let (norm, head) = if last {
            let norm_w = WeightName::OutputNorm;
            let w = weights.global(norm_w, &layout::global_name(norm_w), &[h])?; // [hidden]
            let head = match (cfg.tied_embeddings, first) {
                (true, true) => Head::Tied,
                (tied, _) => {
                    // The untied head, or the last stage's copy of the tied embedding.
                    let lm_w = if tied {
                        WeightName::Embed
                    } else {
                        WeightName::Output
                    };
                    let lm = weights.global(lm_w, &layout::global_name(lm_w), &[v, h])?; // [vocab, hidden]
                    Head::Linear(ColumnParallelLinear::from_global(&lm, tp_rank, tp)?)
                }
            };
            (
                Some(RmsNorm::from_global_offset(
                    &w,
                    cfg.rms_eps,
                    cfg.block.hf_norm_minus_one,
                )?),
                Some(head),
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
            tp,
            sequence_parallel: false,
            recompute: Recompute::None,
        };
        if let Some(s) = model.specs.iter().find(|s| model.var(s).is_none()) {
            return Err(TrainError::Config(format!(
                "internal: stage holds no tensor for {}",
                s.name
            )));
        }
        Ok(model)
    }

    /// Rows the stage's experts computed in trained micro-batches so far, over its layers,
    /// when its tokens are dispatched (`None` otherwise).
    pub fn dispatched_rows(&self) -> Option<u64> {
        self.blocks
            .iter()
            .map(ParallelBlock::dispatched_rows)
            .sum::<Option<u64>>()
    }

    /// The same stage with every mixture of experts' tokens dispatched over `group` (the ep
    /// block's ranks of this tp index; `peers[e]` the one holding expert `e`, docs/moe.md).
    pub fn with_expert_dispatch(mut self, group: &Group, peers: &[Option<usize>]) -> Result<Self> {
        self.blocks = self
            .blocks
            .into_iter()
            .map(|b| b.with_expert_dispatch(group, peers.to_vec()))
            .collect::<tp_nn::Result<_>>()?;
        Ok(self)
    }

    /// The same stage with sequence parallelism (`on`): its hidden states, input and output,
    /// are this rank's `seq/tp` positions `[batch, seq/tp, hidden]`, and its replicated
    /// weights get partial gradients ([`crate::layout::sequence_parallel_grads`]).
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        if on {
            crate::layout::sequence_parallel_grads(&mut self.specs, self.tp);
        }
        self
    }

    /// Positions of a sequence of `seq` that this rank's hidden states hold: `seq`, or with
    /// sequence parallelism `seq/tp` (an error when tp does not divide it).
    pub fn local_seq(&self, seq: usize) -> Result<usize> {
        Ok(match self.split(seq)? {
            Some(s) => s.local(),
            None => seq,
        })
    }

    /// The split of a sequence of `seq` positions with sequence parallelism.
    fn split(&self, seq: usize) -> Result<Option<SeqSplit>> {
        if self.sequence_parallel {
            Ok(Some(SeqSplit::even(seq, self.tp)?))
        } else {
            Ok(None)
        }
    }

    /// The split of the sequence `input` is part of.
    pub(crate) fn input_split(&self, input: &StageInput<'_>) -> Result<Option<SeqSplit>> {
        match input {
            StageInput::Tokens(ids) => self.split(ids.dim(1)?),
            StageInput::Hidden(h) => self.split(h.dim(1)? * self.tp),
        }
    }

    /// The same stage with its mixture-of-experts layers routing by `routing` (a capacity
    /// factor); a dense stage is unchanged.
    pub fn with_moe_routing(mut self, routing: tp_nn::RouteOptions) -> Self {
        for b in &mut self.blocks {
            b.set_moe_routing(&routing);
        }
        self
    }

    /// Sets the aux-loss-free router bias of the stage's MoE layers from `all [layers][count]`
    /// (every layer of the model; [`crate::router_bias`]).
    pub fn set_moe_bias(&mut self, all: &[Vec<f32>]) {
        for (b, l) in self.blocks.iter_mut().zip(self.layers.clone()) {
            if let Some(bias) = all.get(l) {
                b.set_moe_bias(bias.clone());
            }
        }
    }

    /// `(layer, tokens routed to each expert)` of the stage's MoE layers since the last call.
    pub fn take_moe_load(&self) -> Vec<(usize, Vec<u64>)> {
        self.blocks
            .iter()
            .zip(self.layers.clone())
            .filter_map(|(b, l)| Some((l, b.take_moe_load()?)))
            .collect()
    }

    /// Activation recomputation (Korthikanti et al. 2022): `Selective` makes each block's
    /// attention core recompute its `[s, s]` parts in the backward; `Full` is run by
    /// [`crate::recompute`] ([`crate::pipeline::run_micro_batches`] picks it).
    pub fn set_recompute(&mut self, recompute: Recompute) {
        self.recompute = recompute;
        for b in &mut self.blocks {
            b.set_recompute_core(recompute == Recompute::Selective);
        }
    }

    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    /// The stage's blocks, in layer order.
    pub(crate) fn blocks(&self) -> &[ParallelBlock] {
        &self.blocks
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
        self.specs.iter().filter_map(|s| self.var(s)).collect()
    }

    /// The shard of the weight `spec` names (`None`: not on this stage; [`StageModel::new`]
    /// refuses a stage that lacks one of its specs).
    fn var(&self, spec: &ParamSpec) -> Option<&Var> {
        let own_head = match &self.head {
            Some(Head::Linear(l)) => Some(l.weight()),
            _ => None,
        };
        match spec.weight {
            WeightName::Embed if spec.tied_copy => own_head,
            WeightName::Embed => self.embed.as_ref().map(|e| e.weight()),
            WeightName::OutputNorm => self.norm.as_ref().map(|n| n.weight()),
            WeightName::Output => own_head,
            w => {
                let l = w.layer()?.checked_sub(self.layers.start)?;
                self.blocks.get(l)?.var(w)
            }
        }
    }

    /// Runs the stage. Returns hidden states `[batch, seq, hidden]`, or on the last stage
    /// (with `targets [batch * seq]` and their `weights [batch * seq]`) the weighted sum of
    /// the cross-entropies, a replicated scalar.
    pub fn forward(
        &self,
        input: StageInput<'_>,
        targets: Option<(&Tensor, &Tensor)>,
        tp: &Group,
    ) -> Result<Tensor> {
        Ok(self.forward_aux(input, targets, tp)?.value)
    }

    /// [`StageModel::forward`] with the load-balancing loss of the stage's MoE layers.
    pub fn forward_aux(
        &self,
        input: StageInput<'_>,
        targets: Option<(&Tensor, &Tensor)>,
        tp: &Group,
    ) -> Result<StageOutput> {
        self.forward_packed(input, None, targets, tp)
    }

    /// [`StageModel::forward_aux`], over packed sequences when `segments` is given (each
    /// token's document and position, for the whole `[batch, seq]`,
    /// [`ParallelBlock::forward_packed`]).
    pub fn forward_packed(
        &self,
        input: StageInput<'_>,
        segments: Option<&Segments>,
        targets: Option<(&Tensor, &Tensor)>,
        tp: &Group,
    ) -> Result<StageOutput> {
        let split = self.input_split(&input)?;
        let layout = split
            .as_ref()
            .map_or(SeqLayout::Replicated, SeqLayout::Split);
        let (h, aux_share, aux, dropped) = self.hidden_aux(input, segments, tp, layout)?; // h: [b, s_local, hidden]
        let value = self.head_loss(h, targets, tp, layout)?;
        Ok(StageOutput {
            value,
            aux_share,
            aux,
            dropped,
        })
    }

    /// The last stage's weighted cross-entropy of `h [b, s_local, hidden]` against `targets`
    /// (and their weights); `h` itself on the other stages.
    pub(crate) fn head_loss(
        &self,
        h: Tensor,
        targets: Option<(&Tensor, &Tensor)>,
        tp: &Group,
        layout: SeqLayout<'_>,
    ) -> Result<Tensor> {
        match (&self.norm, &self.head, targets) {
            (Some(norm), Some(_), Some((t, w))) => {
                let n = norm.forward(&h)?; // [b, s_local, hidden]
                let logits = self.head_logits(&n, tp, layout)?; // [b, s, vocab_local]
                let (b, s, v_local) = logits.dims3()?;
                let logits = logits.reshape((b * s, v_local))?; // [b*s, vocab_local]
                Ok(vocab_parallel_cross_entropy_weighted(
                    &logits,
                    t,
                    w,
                    &self.vocab,
                    tp,
                )?)
            }
            (None, None, None) => Ok(h),
            _ => Err(TrainError::Config(
                "internal: targets go to the last stage only".into(),
            )),
        }
    }

    /// The stage's embedding (first stage) and blocks, without the last stage's head: hidden
    /// states `[batch, seq, hidden]` (`[batch, seq/tp, hidden]` with sequence parallelism).
    pub fn hidden(&self, input: StageInput<'_>, tp: &Group) -> Result<Tensor> {
        let split = self.input_split(&input)?;
        let layout = split
            .as_ref()
            .map_or(SeqLayout::Replicated, SeqLayout::Split);
        Ok(self.hidden_aux(input, None, tp, layout)?.0)
    }

    /// [`StageModel::hidden`] with the summed load-balancing loss shares and values of the
    /// stage's MoE layers ([`StageOutput`]).
    fn hidden_aux(
        &self,
        input: StageInput<'_>,
        segments: Option<&Segments>,
        tp: &Group,
        layout: SeqLayout<'_>,
    ) -> Result<(Tensor, Option<Tensor>, f64, u64)> {
        let mut h = self.stage_input(input, tp, layout)?; // [b, s_local, hidden]
        let (mut share, mut aux): (Option<Tensor>, f64) = (None, 0.0);
        let mut dropped = 0;
        for b in &self.blocks {
            let out = b.forward_packed(&h, tp, layout, segments)?;
            h = out.hidden; // [b, s_local, hidden]
            dropped += out.dropped;
            if let Some(s) = out.aux_share {
                share = Some(match share {
                    Some(acc) => (acc + s)?,
                    None => s,
                });
                aux += f64::from(out.aux.unwrap_or(0.0));
            }
        }
        Ok((h, share, aux, dropped))
    }

    /// What the stage's first block takes: the (scaled) embedding of the tokens on the first
    /// stage (this rank's positions with sequence parallelism), the received hidden states
    /// on the others; `[batch, s_local, hidden]`.
    pub(crate) fn stage_input(
        &self,
        input: StageInput<'_>,
        tp: &Group,
        layout: SeqLayout<'_>,
    ) -> Result<Tensor> {
        Ok(match (input, &self.embed) {
            (StageInput::Tokens(ids), Some(e)) if self.embed_scale != 1.0 => {
                (e.forward_layout(ids, tp, layout)? * self.embed_scale)? // [b, s_local, hidden]
            }
            (StageInput::Tokens(ids), Some(e)) => e.forward_layout(ids, tp, layout)?, // [b, s_local, hidden]
            (StageInput::Hidden(h), None) => h.clone(), // [b, s_local, hidden]
            _ => {
                return Err(TrainError::Config(
                    "internal: the first stage takes tokens, the others hidden states".into(),
                ))
            }
        })
    }

    /// Logits of the last stage for a replicated hidden input `[batch, seq, hidden]`:
    /// `[batch, seq, vocab_local]` (for tests and evaluation; training uses
    /// [`StageModel::forward`]).
    pub fn logits_local(&self, h: &Tensor, tp: &Group) -> Result<Option<Tensor>> {
        match &self.norm {
            Some(norm) => Ok(Some(self.head_logits(
                &norm.forward(h)?,
                tp,
                SeqLayout::Replicated,
            )?)),
            None => Ok(None),
        }
    }

    /// The LM head on normed hidden states `[batch, s_local, hidden]` (entered by f, or by an
    /// all-gather of the sequence): `[batch, seq, vocab_local]`.
    fn head_logits(&self, n: &Tensor, tp: &Group, layout: SeqLayout<'_>) -> Result<Tensor> {
        let x = layout.enter(n, tp)?; // [b, s, hidden]
        match (&self.head, &self.embed) {
            (Some(Head::Linear(l)), _) => Ok(l.forward_local(&x)?),
            (Some(Head::Tied), Some(e)) => {
                let (b, s, h) = x.dims3()?;
                let x = x.reshape((b * s, h))?; // [b*s, hidden]
                let table = e.weight().as_tensor(); // [vocab_local, hidden]
                let logits = x.matmul(&table.t()?)?; // [b*s, vocab_local]
                Ok(logits.reshape((b, s, table.dim(0)?))?)
            }
            _ => Err(TrainError::Config(
                "internal: the LM head lives on the last stage".into(),
            )),
        }
    }
}
