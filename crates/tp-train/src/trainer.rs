//! The training loop of one rank: micro-batches of the global batch on the 1F1B schedule
//! (interleaved over the rank's model chunks with virtual stages),
//! gradient completion over tp, the bucketed dp all-reduce, clipping by the global norm,
//! sharded AdamW, and periodic atomic checkpoints (Megatron-LM's `train_step`, in order).

use crate::checkpoint::{self, Checkpoint, SaveHook, SaveInputs, TrainerState};
use crate::config::ModelConfig;
use crate::data::Corpus;
use crate::error::{Result, TrainError};
use crate::grads::{self, FlatLayout, NormOwnership, SharedRows, TiedCopy};
use crate::init::SeededInit;
use crate::layout::{self, ParamSpec};
use crate::model::StageModel;
use crate::optim::{AdamW, AdamWConfig};
use crate::pipeline::{forward_only, run_micro_batches, MicroBatch};
use crate::pretrained::Pretrained;
use crate::zero::{DistributedOptimizer, OptimizerMemory, ReplicaGroups, Replicas};
use candle_core::{Device, Tensor};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tp_comm::{CommExt, ParallelDims, ProcessGroups, ReduceOp};
use tp_plan::workload::Recompute;

/// The default weight of the MoE load-balancing loss (the Switch Transformer's alpha).
pub const DEFAULT_MOE_AUX_COEF: f64 = 0.01;

/// Everything that defines a run; identical on every rank.
#[derive(Clone, Debug)]
pub struct TrainSpec {
    pub model: ModelConfig,
    pub dims: ParallelDims,
    /// Train until this many steps are done (counting those of a resumed checkpoint).
    pub steps: u64,
    /// Sequences per optimizer step, over all data-parallel replicas.
    pub global_batch: usize,
    /// Micro-batches per step on each data-parallel replica (the pipeline's M).
    pub micro_batches: usize,
    /// Model chunks per pipeline rank (the interleaved 1F1B schedule's V, Narayanan et al.
    /// 2021 §2.2.2): the layers split into `pp * V` chunks, rank s holding chunks s, s + pp,
    /// ...; 1 is plain 1F1B. The same training, with a V times smaller pipeline bubble.
    pub virtual_stages: usize,
    pub seq: usize,
    pub seed: u64,
    pub optim: AdamWConfig,
    /// Elements per data-parallel all-reduce (or reduce-scatter) bucket.
    pub bucket_elems: usize,
    /// Megatron's distributed optimizer (ZeRO-1): AdamW's moments and the master weights
    /// sharded over the data-parallel replicas, gradients reduce-scattered and the updated
    /// weights all-gathered (`crate::zero`); the same training, with dp times less optimizer
    /// state per rank. No effect at dp 1. With experts over replicas, a rank's experts are
    /// sharded over their expert-data-parallel group instead (the replicas holding them).
    pub distributed_optimizer: bool,
    /// Expert-parallel size (`--ep`, docs/moe.md "Expert parallelism in training"): dividing
    /// tp, expert groups inside the tp group (1: expert-TP); tp times a divisor of dp, whole
    /// experts over the replicas of an ep block, tokens dispatched by all-to-all. 1 without
    /// experts.
    pub ep: usize,
    /// Weight of the MoE load-balancing loss in the training objective (Switch Transformer's
    /// alpha; 0 turns it off); unused without experts.
    pub moe_aux_coef: f64,
    /// The MoE layers' capacity factor ([`tp_spec::CapacityFactor`]): each expert takes at
    /// most `ceil(f x tokens x k / E)` of a micro-batch's (token, expert) pairs, the later
    /// ones dropped and counted ([`StepReport::moe_dropped`]); `None`: no pair is dropped.
    pub moe_capacity: Option<tp_spec::CapacityFactor>,
    /// The aux-loss-free router bias's update rate `u` ([`crate::router_bias`]; DeepSeek-V3
    /// used 1e-3): `None` leaves it off; `Some(0)` counts the loads (and reports their
    /// imbalance) without moving the bias.
    pub moe_bias_rate: Option<f64>,
    /// Sequence parallelism (Korthikanti et al. 2022, §4.2.2): outside the tensor-parallel
    /// regions each tp rank holds `seq/tp` positions; `seq` must divide by tp.
    pub sequence_parallel: bool,
    /// What the backward recomputes instead of keeping from the forward (Korthikanti et al.
    /// 2022): nothing, the attention cores, or every block. The results are the same.
    pub recompute: Recompute,
    /// The data's documents are packed several to a sequence ([`Corpus::packed`]): RoPE by
    /// each token's position in its document, attention within documents. The corpus the
    /// trainer is given must be packed exactly when this is set.
    pub pack: bool,
    /// Where checkpoints go (`None`: no checkpoints).
    pub save_dir: Option<PathBuf>,
    /// Save every this many steps (0: only at the end).
    pub save_every: u64,
    /// Step directories to keep (0: all).
    pub keep: usize,
    /// Description of the data, recorded in checkpoints.
    pub data_name: String,
    /// Validation loss on the held-out split every this many steps (0: never; also after
    /// the last step when there is a split).
    pub val_every: u64,
}

impl TrainSpec {
    /// Sequences in one micro-batch.
    pub fn micro_batch_size(&self) -> usize {
        self.global_batch / (self.dims.dp * self.micro_batches).max(1)
    }

    /// Checks everything that can be checked before a rank starts.
    pub fn validate(&self) -> Result<()> {
        layout::validate(&self.model, self.dims)?;
        let bad = |m: String| Err(TrainError::Config(m));
        if self.micro_batches == 0 || self.global_batch == 0 {
            return bad("--batch and --micro-batches must be at least 1".into());
        }
        layout::validate_virtual_stages(
            &self.model,
            self.dims.pp,
            self.virtual_stages,
            self.micro_batches,
        )?;
        let per = self.dims.dp * self.micro_batches;
        if !self.global_batch.is_multiple_of(per) {
            return bad(format!(
                "a global batch of {} sequences cannot be split into dp={} x {} micro-batches; \
                 use a global batch that is a multiple of {per}, or another micro-batch count",
                self.global_batch, self.dims.dp, self.micro_batches
            ));
        }
        if self.seq == 0 || self.seq > self.model.context {
            return bad(format!(
                "--seq {} must be between 1 and the model's max_position_embeddings ({})",
                self.seq, self.model.context
            ));
        }
        if self.sequence_parallel {
            tp_nn::SeqSplit::even(self.seq, self.dims.tp)?;
        }
        if self.bucket_elems == 0 {
            return bad("the all-reduce bucket must hold at least one element".into());
        }
        layout::EpRank::new(&self.model, self.ep, self.dims, 0)?;
        Ok(())
    }
}

/// Where a run's weights come from.
#[derive(Clone, Copy, Debug, Default)]
pub enum Start<'a> {
    /// A fresh model from the run's seed.
    #[default]
    Fresh,
    /// A checkpoint of an earlier run: weights, optimizer state, step and data position.
    Resume(&'a Checkpoint),
    /// A pretrained model to fine-tune (fresh optimizer state, step 0).
    Init(&'a Pretrained),
}

/// Test and drill hooks.
#[derive(Clone, Default)]
pub struct TrainOptions {
    /// Called on the writing rank during each save (fault injection).
    pub save_hook: Option<SaveHook>,
}

/// What one step did (identical on every rank).
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// Steps completed, this one included.
    pub step: u64,
    /// Mean cross-entropy over the global batch, before this step's update.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    /// Tokens in this step's global batch.
    pub tokens: u64,
    /// Wall time of the step on this rank.
    pub seconds: f64,
    /// The load-balancing loss `E * sum_e f_e * P_e` of the batch, the mean over the MoE
    /// layers (1 when routing is balanced); `None` without experts.
    pub aux_loss: Option<f64>,
    /// Mean loss on the held-out split after this step's update, when it was measured.
    pub val_loss: Option<f64>,
    /// With experts over data-parallel replicas: the (token, expert) rows each world rank's
    /// experts computed in this step, over its layers and micro-batches (the expert load).
    pub expert_rows: Option<Vec<u64>>,
    /// (token, expert) pairs the capacity factor dropped in the step, over the MoE layers,
    /// micro-batches and data-parallel replicas; `None` without a capacity factor.
    pub moe_dropped: Option<u64>,
    /// With the router bias on: the step's load imbalance (the mean over MoE layers of the
    /// busiest expert's tokens over the mean, 1 balanced; [`crate::router_bias::update`]).
    pub moe_imbalance: Option<f64>,
}

/// Expert parallelism across replicas: the rank's place, its ep group (the block's ranks of
/// its tp index and stage) and its expert-data-parallel group (the ranks holding the same
/// experts: same tp index and stage, same block position in the other blocks).
struct EpGroups {
    rank: layout::EpRank,
    ep: tp_comm::Group,
    edp: tp_comm::Group,
}

/// The groups the distributed optimizer's parts are sharded over: dp, and with experts
/// across replicas the expert-data-parallel group.
fn replica_groups<'g>(groups: &'g ProcessGroups, ep: &'g Option<EpGroups>) -> ReplicaGroups<'g> {
    ReplicaGroups {
        dp: &groups.dp,
        edp: ep.as_ref().map(|e| &e.edp),
    }
}

impl EpGroups {
    /// Collective over the world (every rank, the same `rank.layout`).
    fn new(groups: &ProcessGroups, rank: layout::EpRank) -> Result<Option<EpGroups>> {
        let Some(r) = rank.layout.across() else {
            return Ok(None);
        };
        let (c, d) = (groups.coords, groups.dims);
        let lane = c.pp_rank * d.tp + c.tp_rank;
        let (block, blocks) = (r.block, d.dp / r.block);
        let split = |color: usize, key: usize| -> Result<tp_comm::Group> {
            groups
                .world
                .split(Some(color as u32), key)?
                .ok_or_else(|| TrainError::Config("split with a color returned no group".into()))
        };
        let ep = split(lane * blocks + c.dp_rank / block, c.dp_rank % block)?;
        let edp = split(lane * block + c.dp_rank % block, c.dp_rank / block)?;
        Ok(Some(EpGroups { rank, ep, edp }))
    }
}

/// One rank's training state.
pub struct Trainer<'a> {
    spec: &'a TrainSpec,
    groups: ProcessGroups,
    corpus: &'a Corpus,
    val: Option<&'a Corpus>,
    tokenizer_json: &'a str,
    tokenizer_config: Option<&'a str>,
    /// The rank's model chunks ([`layout::rank_chunks`]); one: its pipeline stage.
    chunks: Vec<StageModel>,
    specs: Vec<ParamSpec>,
    layout: FlatLayout,
    /// The flat weights AdamW updates (empty with `zero`, whose slice holds them).
    params: Vec<f32>,
    grads: Vec<f32>,
    /// AdamW's moments: of the whole flat buffer, or of this rank's slice with `zero`.
    adam: AdamW,
    /// The distributed optimizer's slice and master weights (dp > 1 and the spec asks).
    zero: Option<DistributedOptimizer>,
    shared: SharedRows,
    tied: Option<TiedCopy>,
    norm: NormOwnership,
    step: u64,
    data_position: u64,
    history: Vec<(u64, f64)>,
    opts: TrainOptions,
    /// The mean over MoE layers of the load-balancing loss of the last batch computed.
    last_aux: Option<f64>,
    /// The last step's dropped (token, expert) pairs ([`StepReport::moe_dropped`]).
    last_dropped: Option<u64>,
    /// The aux-loss-free router bias `[layers][count]` of every layer (replicated on every
    /// rank); empty while off.
    moe_bias: Vec<Vec<f32>>,
    /// Under full recomputation, the block-input bytes one micro-batch kept on this rank in
    /// the last step (counted); 0 otherwise.
    kept_input_bytes: u64,
    /// The last step's (forward and backward seconds, of them waiting in pipeline receives).
    pipeline_s: (f64, f64),
    /// The rank's place in the expert parallelism ([`TrainSpec::ep`]).
    ep_rank: layout::EpRank,
    /// Expert parallelism across replicas (`None` inside the tp group).
    ep: Option<EpGroups>,
    /// The rows this rank's experts had computed before this step.
    expert_rows_before: u64,
}

impl<'a> Trainer<'a> {
    /// Builds this rank's stage: fresh from the seed, from a checkpoint to resume, or from a
    /// pretrained model.
    pub fn new(
        spec: &'a TrainSpec,
        groups: ProcessGroups,
        corpus: &'a Corpus,
        tokenizer_json: &'a str,
        start: Start<'_>,
        opts: TrainOptions,
    ) -> Result<Trainer<'a>> {
        let resume = match start {
            Start::Resume(ck) => Some(ck),
            _ => None,
        };
        spec.validate()?;
        if groups.dims != spec.dims {
            return Err(TrainError::Config(format!(
                "the groups are {:?} but the run is {:?}",
                groups.dims, spec.dims
            )));
        }
        if spec.pack != corpus.is_packed() {
            return Err(TrainError::Config(format!(
                "the run {} packed sequences but its data is {}",
                if spec.pack {
                    "asks for"
                } else {
                    "does not ask for"
                },
                if corpus.is_packed() {
                    "packed"
                } else {
                    "not packed"
                }
            )));
        }
        let max = corpus.max_token() as usize;
        if max >= spec.model.vocab {
            return Err(TrainError::Data(format!(
                "token id {max} is outside the model's vocabulary of {}; use the tokenizer the \
                 model was made for",
                spec.model.vocab
            )));
        }
        let c = groups.coords;
        let (tp, pp) = (spec.dims.tp, spec.dims.pp);
        if let Start::Init(init) = start {
            if init.config != spec.model {
                return Err(TrainError::Config(format!(
                    "the model to train differs from {}'s; fine-tune it as it is",
                    init.path.display()
                )));
            }
        }
        if let Some(ck) = resume {
            if ck.config != spec.model {
                return Err(TrainError::checkpoint(
                    &ck.dir,
                    "its config.json differs from the model to train; resume with the \
                     checkpoint's own config (give no model config)",
                ));
            }
        }
        let seeded = SeededInit::new(&spec.model, spec.seed);
        let weights: &dyn crate::init::WeightSource = match start {
            Start::Resume(ck) => ck,
            Start::Init(init) => init,
            Start::Fresh => &seeded,
        };
        let v = spec.virtual_stages.max(1);
        let ep_rank = layout::EpRank::new(&spec.model, spec.ep, spec.dims, c.dp_rank)?;
        let ep = EpGroups::new(&groups, ep_rank.clone())?;
        let mut chunks = layout::rank_chunks(c.pp_rank, pp, v)
            .into_iter()
            .map(|g| {
                let m =
                    StageModel::new_ep(&spec.model, g, pp * v, c.tp_rank, tp, &ep_rank, weights)?;
                let mut m = match (&ep, ep_rank.layout.across()) {
                    (Some(e), Some(r)) => m.with_expert_dispatch(&e.ep, &r.peers(c.tp_rank))?,
                    _ => m,
                }
                .with_sequence_parallel(spec.sequence_parallel)
                .with_moe_routing(tp_nn::RouteOptions {
                    capacity: spec.moe_capacity,
                    ..Default::default()
                });
                m.set_recompute(spec.recompute);
                Ok(m)
            })
            .collect::<Result<Vec<_>>>()?;
        let specs: Vec<ParamSpec> = chunks.iter().flat_map(|m| m.specs().to_vec()).collect();
        let layout = FlatLayout::new(&specs);
        let dp_size = spec.dims.dp;
        let mut params = Vec::with_capacity(layout.total());
        for (_, var) in chunks.iter().flat_map(|m| m.params()) {
            params.extend(var.flatten_all()?.to_vec1::<f32>()?);
        }
        let all_tp: Vec<Vec<ParamSpec>> = (0..tp)
            .map(|t| {
                let mut specs =
                    layout::rank_params_ep(&spec.model, c.pp_rank, pp, v, t, tp, &ep_rank)?;
                if spec.sequence_parallel {
                    layout::sequence_parallel_grads(&mut specs, tp);
                }
                Ok(specs)
            })
            .collect::<Result<_>>()?;
        let mut zero = if spec.distributed_optimizer && spec.dims.dp > 1 {
            // Dense parameters sharded over dp; with experts across replicas, the rank's
            // experts over their expert-data-parallel group (the only replicas holding them).
            let parts = match &ep {
                None => vec![((0..specs.len()).collect(), Replicas::Dp, dp_size, c.dp_rank)],
                Some(e) => {
                    let (dense, experts) = grads::split_by(&specs, |s| s.weight.expert().is_some());
                    vec![
                        (dense, Replicas::Dp, dp_size, c.dp_rank),
                        (experts, Replicas::Edp, e.edp.size(), e.edp.rank()),
                    ]
                }
            };
            Some(DistributedOptimizer::new(&params, &layout, &specs, parts)?)
        } else {
            None
        };
        // The moments of the elements this rank updates (with `zero`, its parts' own).
        let mut adam = AdamW::new(if zero.is_some() { 0 } else { layout.total() });
        if zero.is_some() {
            // The slices hold this rank's master weights; the model's tensors hold the rest.
            params = Vec::new();
        }
        let (mut step, mut data_position, mut history) = (0, 0, Vec::new());
        if let Some(ck) = resume {
            // Checkpoints hold whole moments (a save gathers the slices): any layout resumes.
            let (m, v) = ck.optimizer_shards(&specs)?;
            let short = |x: &[f32]| {
                TrainError::checkpoint(
                    &ck.dir,
                    format!(
                        "its optimizer state holds {} elements for this rank, which needs {}",
                        x.len(),
                        layout.total()
                    ),
                )
            };
            if m.len() != layout.total() || v.len() != layout.total() {
                return Err(short(if m.len() != layout.total() { &m } else { &v }));
            }
            match &mut zero {
                Some(z) => z.set_moments(&m, &v, &layout, ck.state.step),
                None => {
                    adam.exp_avg = m;
                    adam.exp_avg_sq = v;
                }
            }
            adam.step = ck.state.step;
            step = ck.state.step;
            data_position = ck.state.data_position;
            history = ck.state.loss_history.clone();
        }
        // The router bias: the checkpoint's, else zeros when it is on.
        let moe_bias = match (resume, spec.model.experts) {
            (Some(ck), Some(_)) if !ck.state.moe_bias.is_empty() => ck.state.moe_bias.clone(),
            (_, Some(e)) if spec.moe_bias_rate.is_some() => {
                vec![vec![0.0; e.count]; spec.model.layers]
            }
            _ => Vec::new(),
        };
        if !moe_bias.is_empty() {
            for m in &mut chunks {
                m.set_moe_bias(&moe_bias);
            }
        }
        let embed_len = layout::vocab_partition(&spec.model, tp)?
            .range(c.tp_rank)
            .len()
            * spec.model.hidden;
        let tied = TiedCopy::plan(&specs, layout::has_tied_copy(&spec.model, pp))
            .map(|t| t.with_len(embed_len));
        Ok(Trainer {
            tied,
            spec,
            corpus,
            val: None,
            tokenizer_config: None,
            tokenizer_json,
            grads: vec![0.0; layout.total()],
            shared: SharedRows::plan(&all_tp, c.tp_rank)?,
            norm: NormOwnership::plan(&all_tp, c.tp_rank),
            groups,
            chunks,
            specs,
            layout,
            params,
            adam,
            zero,
            step,
            data_position,
            history,
            opts,
            last_aux: None,
            last_dropped: None,
            moe_bias,
            kept_input_bytes: 0,
            pipeline_s: (0.0, 0.0),
            ep_rank,
            ep,
            expert_rows_before: 0,
        })
    }

    /// Measures the validation loss on `val` (a held-out split) every `spec.val_every` steps
    /// and after the last.
    pub fn with_validation(mut self, val: Option<&'a Corpus>) -> Self {
        self.val = val;
        self
    }

    /// Writes `config` as the checkpoints' `tokenizer_config.json` (the chat template).
    pub fn with_tokenizer_config(mut self, config: Option<&'a str>) -> Self {
        self.tokenizer_config = config;
        self
    }

    pub fn step_count(&self) -> u64 {
        self.step
    }

    pub fn data_position(&self) -> u64 {
        self.data_position
    }

    pub fn history(&self) -> &[(u64, f64)] {
        &self.history
    }

    pub fn groups(&self) -> &ProcessGroups {
        &self.groups
    }

    /// The rank's model chunks, in order ([`layout::rank_chunks`]): its stage without
    /// virtual stages.
    pub fn chunks(&self) -> &[StageModel] {
        &self.chunks
    }

    /// This rank's shard specs and its flat buffers (weights, last step's gradients).
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }
    pub fn flat_layout(&self) -> &FlatLayout {
        &self.layout
    }
    /// The flat weights (empty with the distributed optimizer: see `crate::zero`).
    pub fn params_flat(&self) -> &[f32] {
        &self.params
    }
    pub fn grads_flat(&self) -> &[f32] {
        &self.grads
    }

    /// The optimizer arrays this rank holds (moments and master weights), by their lengths.
    pub fn optimizer_memory(&self) -> OptimizerMemory {
        let experts = match &self.ep {
            Some(_) => {
                let (_, experts) = grads::split_by(&self.specs, |s| s.weight.expert().is_some());
                experts.iter().map(|&i| self.layout.range(i).len()).sum()
            }
            None => 0,
        };
        OptimizerMemory {
            local_params: self.layout.total(),
            expert_params: experts,
            held: self
                .zero
                .as_ref()
                .map_or(self.adam.exp_avg.len(), DistributedOptimizer::held),
            dp: self.spec.dims.dp,
            edp: self.ep.as_ref().map_or(self.spec.dims.dp, |e| e.edp.size()),
            distributed: self.zero.is_some(),
        }
    }

    /// Under full recomputation, the bytes of the block inputs one micro-batch kept on this
    /// rank between its forward and its backward in the last step (counted, the largest
    /// over its micro-batches; with virtual stages, over its chunks' micro-batches, each
    /// chunk's counted alone); 0 without full recomputation.
    pub fn kept_input_bytes(&self) -> u64 {
        self.kept_input_bytes
    }

    /// The pipeline bubble of the last step on this rank, measured: the seconds its
    /// forwards and backwards waited in pipeline receives over the seconds they computed
    /// (the ideal step's; `(p - 1) / (v m)` under the schedule with equal stages).
    pub fn measured_bubble(&self) -> f64 {
        let (all, wait) = self.pipeline_s;
        wait / (all - wait).max(1e-12)
    }

    /// Forward and backward of the next global batch, without the update: afterwards
    /// [`Trainer::grads_flat`] holds this rank's complete, dp-summed gradient shards (with
    /// the distributed optimizer: on this rank's slice, zeros elsewhere).
    /// Returns (loss, global gradient norm).
    pub fn compute_gradients(&mut self) -> Result<(f64, f64)> {
        let s = self.spec;
        let (m, dp) = (s.micro_batches, s.dims.dp);
        let mbs = s.micro_batch_size();
        let first = self.data_position + (self.groups.coords.dp_rank * m * mbs) as u64;
        // The step's loss is the mean over every target in the loss in the global batch
        // (every rank reads the whole batch's masks to count them).
        let (_, _, all) = self.corpus.batch(self.data_position, s.global_batch);
        let count = all.iter().sum::<f32>();
        if count == 0.0 {
            return Err(TrainError::Data(format!(
                "the batch at sequence {} has no token in the loss; every conversation \
                 needs an assistant reply",
                self.data_position
            )));
        }
        let micro = (0..m)
            .map(|i| {
                let at = first + (i * mbs) as u64;
                let (ids, tgt, mask) = self.corpus.batch(at, mbs);
                let weights = mask.iter().map(|w| w / count).collect();
                MicroBatch::new(ids, tgt, weights, mbs, s.seq)?
                    .with_segments(self.corpus.segments(at, mbs))
            })
            .collect::<Result<Vec<_>>>()?;
        self.grads.fill(0.0);
        // The router loads count this step's forwards only.
        for c in &self.chunks {
            c.take_moe_load();
        }
        let sums = run_micro_batches(
            &self.chunks,
            &self.groups,
            &micro,
            s.model.hidden,
            // The load-balancing loss of each micro-batch counts as a mean over the step's.
            s.moe_aux_coef / (m * dp) as f64,
            &mut self.grads,
            &self.layout,
        )?;
        self.kept_input_bytes = sums.kept_input_bytes;
        self.pipeline_s = (sums.pipeline_s, sums.wait_s);
        self.shared
            .complete(&mut self.grads, &self.layout, &self.groups.tp)?;
        if let Some(t) = &self.tied {
            t.complete(&mut self.grads, &self.layout, &self.groups.pp)?;
        }
        let sq = match &self.zero {
            None => match &self.ep {
                None => {
                    grads::all_reduce_buckets(&mut self.grads, &self.groups.dp, s.bucket_elems)?;
                    self.norm.sum_sq(&self.grads, &self.layout, &self.specs)
                }
                Some(e) => {
                    // Dense gradients summed over dp; an expert's (already summed over its
                    // ep block's tokens by the dispatch) over its expert-data-parallel group.
                    let is_expert = |s: &ParamSpec| s.weight.expert().is_some();
                    let (dense, experts) = grads::split_by(&self.specs, is_expert);
                    grads::all_reduce_parts(
                        &mut self.grads,
                        &self.layout,
                        &dense,
                        &self.groups.dp,
                        s.bucket_elems,
                    )?;
                    grads::all_reduce_parts(
                        &mut self.grads,
                        &self.layout,
                        &experts,
                        &e.edp,
                        s.bucket_elems,
                    )?;
                    // Each expert is held by one rank of the block: its squares summed over
                    // the ep group, so the norm counts it once.
                    let mut sq =
                        [self
                            .norm
                            .sum_sq_of(&self.grads, &self.layout, &self.specs, &experts)];
                    e.ep.all_reduce(&mut sq, ReduceOp::Sum)?;
                    self.norm
                        .sum_sq_of(&self.grads, &self.layout, &self.specs, &dense)
                        + sq[0]
                }
            },
            Some(z) => {
                // Each replica holds the sums of its slices only: its squares are summed over
                // dp too, so the norm counts every element once, as with the all-reduce.
                // (With experts across replicas: the expert slices cut each expert over its
                // edp group and the ep block's ranks hold other experts, so over dp =
                // ep block x edp each expert is counted once, as the plain path's ep sum.)
                let groups = replica_groups(&self.groups, &self.ep);
                z.reduce_scatter(&mut self.grads, &self.layout, groups, s.bucket_elems)?;
                let mut v = [self.norm.sum_sq(&self.grads, &self.layout, &self.specs)];
                self.groups.dp.all_reduce(&mut v, ReduceOp::Sum)?;
                v[0]
            }
        };
        let norm = grads::global_norm(sq, &self.groups.tp, &self.groups.pp)?;
        // The loss lives on the last stage: sum over stages (the others add 0) and over the
        // replicas' shares of the weighted sum; the load-balancing losses of each stage's MoE
        // layers are summed over micro-batches, stages and replicas.
        let mut loss = [sums.loss, sums.aux, sums.dropped as f64];
        if s.dims.pp > 1 {
            self.groups.pp.all_reduce(&mut loss, ReduceOp::Sum)?;
        }
        if dp > 1 {
            self.groups.dp.all_reduce(&mut loss, ReduceOp::Sum)?;
        }
        // Every layer of a model with experts is a mixture of experts.
        self.last_aux = s
            .model
            .experts
            .map(|_| loss[1] / (m * dp * s.model.layers.max(1)) as f64);
        // Exact in f64: a count far below 2^53.
        self.last_dropped = s.moe_capacity.map(|_| loss[2] as u64);
        Ok((loss[0], norm))
    }

    /// Collective over the world: the mean loss over every target in the loss of the
    /// held-out split `val` (each replica scores all of it; no update).
    pub fn validation_loss(&self, val: &Corpus) -> Result<f64> {
        let s = self.spec;
        let batches = val.all_batches(s.micro_batch_size());
        let count: f32 = batches.iter().flat_map(|b| b.2.iter()).sum();
        if count == 0.0 {
            return Err(TrainError::Data(
                "the held-out split has no token in the loss".into(),
            ));
        }
        let micro = batches
            .into_iter()
            .zip(val.all_segments(s.micro_batch_size()))
            .map(|((ids, tgt, mask), seg)| {
                let rows = ids.len() / s.seq;
                let weights = mask.iter().map(|w| w / count).collect();
                MicroBatch::new(ids, tgt, weights, rows, s.seq)?.with_segments(seg)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut loss = [forward_only(
            &self.chunks,
            &self.groups,
            &micro,
            s.model.hidden,
        )?];
        if s.dims.pp > 1 {
            self.groups.pp.all_reduce(&mut loss, ReduceOp::Sum)?;
        }
        Ok(loss[0])
    }

    /// One optimizer step on the next global batch.
    pub fn step(&mut self) -> Result<StepReport> {
        let t0 = Instant::now();
        let s = self.spec;
        let (loss, norm) = self.compute_gradients()?;
        let coef = grads::clip_coefficient(norm, s.optim.clip_norm);
        let lr = s.optim.lr_at(self.step, s.steps);
        let vars: Vec<_> = self.chunks.iter().flat_map(|m| m.params()).collect();
        let mut set = |i: usize, data: &[f32]| -> Result<()> {
            let (spec, var) = &vars[i];
            var.set(&Tensor::from_slice(data, spec.local_shape(), &Device::Cpu)?)?;
            Ok(())
        };
        match &mut self.zero {
            None => {
                self.adam.update(
                    &mut self.params,
                    &self.grads,
                    &self.layout,
                    &self.specs,
                    &s.optim,
                    lr,
                    coef,
                );
                for i in 0..self.layout.len() {
                    set(i, &self.params[self.layout.range(i)])?;
                }
            }
            Some(z) => {
                z.update(&self.grads, &self.layout, &s.optim, lr, coef);
                let groups = replica_groups(&self.groups, &self.ep);
                z.all_gather_params(groups, s.bucket_elems, &mut set)?;
            }
        }
        self.step += 1;
        self.data_position += s.global_batch as u64;
        self.history.push((self.step, loss));
        let due = s.val_every > 0 && self.step.is_multiple_of(s.val_every);
        let moe_imbalance = self.update_moe_bias()?;
        let val_loss = match self.val {
            Some(v) if due || self.step == s.steps => Some(self.validation_loss(v)?),
            _ => None,
        };
        let expert_rows = self.expert_load()?;
        Ok(StepReport {
            expert_rows,
            val_loss,
            step: self.step,
            loss,
            grad_norm: norm,
            lr,
            tokens: (s.global_batch * s.seq) as u64,
            seconds: t0.elapsed().as_secs_f64(),
            aux_loss: self.last_aux,
            moe_dropped: self.last_dropped,
            moe_imbalance,
        })
    }

    /// Steps until `spec.steps`, saving every `save_every` steps and at the end.
    pub fn run(&mut self, on_step: &mut dyn FnMut(&StepReport)) -> Result<()> {
        let every = self.spec.save_every;
        while self.step < self.spec.steps {
            let report = self.step()?;
            on_step(&report);
            let due = every > 0 && self.step.is_multiple_of(every);
            if self.spec.save_dir.is_some() && (due || self.step == self.spec.steps) {
                self.save()?;
            }
        }
        Ok(())
    }

    /// Collective (pp and dp): the step's router loads summed over stages and replicas, the
    /// bias moved by them ([`crate::router_bias::update`]) alike on every rank and set in this
    /// rank's layers; returns their imbalance. `None` while the bias is off.
    fn update_moe_bias(&mut self) -> Result<Option<f64>> {
        let s = self.spec;
        let (Some(rate), Some(e)) = (s.moe_bias_rate, s.model.experts) else {
            return Ok(None);
        };
        let count = e.count;
        let mut load = vec![0f64; s.model.layers * count]; // [layers * count]
        for m in &self.chunks {
            for (l, c) in m.take_moe_load() {
                for (a, &n) in load[l * count..(l + 1) * count].iter_mut().zip(&c) {
                    *a += n as f64;
                }
            }
        }
        if s.dims.pp > 1 {
            self.groups.pp.all_reduce(&mut load, ReduceOp::Sum)?;
        }
        if s.dims.dp > 1 {
            self.groups.dp.all_reduce(&mut load, ReduceOp::Sum)?;
        }
        let imbalance = crate::router_bias::update(&mut self.moe_bias, &load, rate);
        for m in &mut self.chunks {
            m.set_moe_bias(&self.moe_bias);
        }
        Ok(Some(imbalance))
    }

    /// The checkpoint state of now.
    pub fn state(&self) -> Result<TrainerState> {
        let s = self.spec;
        Ok(TrainerState {
            format: checkpoint::FORMAT.into(),
            step: self.step,
            data_position: self.data_position,
            seed: s.seed,
            global_batch: s.global_batch,
            seq: s.seq,
            pack: s.pack,
            steps_target: s.steps,
            optim: s.optim.clone(),
            data: s.data_name.clone(),
            loss_history: self.history.clone(),
            moe_bias: self.moe_bias.clone(),
            saved_layout: checkpoint::saved_layout(&s.model, s.dims, s.virtual_stages)?,
        })
    }

    /// Collective: writes a checkpoint of now into `spec.save_dir` (and the loss curve
    /// beside it). Returns the step directory on world rank 0.
    pub fn save(&mut self) -> Result<Option<PathBuf>> {
        let Some(dir) = self.spec.save_dir.as_deref() else {
            return Ok(None);
        };
        self.save_to(dir)
    }

    /// Like [`Trainer::save`], into `dir`.
    pub fn save_to(&mut self, dir: &Path) -> Result<Option<PathBuf>> {
        let state = self.state()?;
        // Checkpoints hold whole weights and moments whatever the optimizer: gather the slices.
        let (params, exp_avg, exp_avg_sq) = match &self.zero {
            None => (
                Cow::Borrowed(&self.params[..]),
                Cow::Borrowed(&self.adam.exp_avg[..]),
                Cow::Borrowed(&self.adam.exp_avg_sq[..]),
            ),
            Some(z) => {
                let groups = replica_groups(&self.groups, &self.ep);
                let [p, m, v] = z.gather(&self.layout, groups)?;
                (p.into(), m.into(), v.into())
            }
        };
        // Across replicas, the experts of each tp index are first gathered over the ep group
        // (the block view), so the save's tp gather finds every expert.
        let block = match &self.ep {
            Some(e) => Some(self.block_view(e, [&params, &exp_avg, &exp_avg_sq])?),
            None => None,
        };
        let (specs, layout, ep_rank, params, exp_avg, exp_avg_sq) = match &block {
            Some((specs, layout, view, [p, m, v])) => {
                (&specs[..], layout, view, &p[..], &m[..], &v[..])
            }
            None => (
                &self.specs[..],
                &self.layout,
                &self.ep_rank,
                &params[..],
                &exp_avg[..],
                &exp_avg_sq[..],
            ),
        };
        let out = checkpoint::save(&SaveInputs {
            dir,
            state: &state,
            config: &self.spec.model,
            tokenizer_json: self.tokenizer_json,
            tokenizer_config: self.tokenizer_config,
            groups: &self.groups,
            virtual_stages: self.spec.virtual_stages,
            ep: ep_rank,
            specs,
            layout,
            params,
            exp_avg,
            exp_avg_sq,
            keep: self.spec.keep,
            hook: self.opts.save_hook.as_ref(),
        })?;
        if out.is_some() {
            let svg = crate::plot::loss_svg(&self.history, &self.spec.data_name);
            checkpoint::replace_file(dir, crate::plot::PLOT_FILE, &svg)?;
        }
        Ok(out)
    }
}

/// A checkpoint's view of a rank's buffers across replicas: the specs and layout of the
/// block view, and the weights and both moments in it.
type BlockView = (Vec<ParamSpec>, FlatLayout, layout::EpRank, [Vec<f32>; 3]);

impl Trainer<'_> {
    /// Collective over the ep group: `bufs` (weights and both moments in this rank's layout)
    /// with every expert of this tp index's block whole ([`layout::EpRank::block_view`]),
    /// gathered from the rank holding it.
    fn block_view(&self, e: &EpGroups, bufs: [&[f32]; 3]) -> Result<BlockView> {
        let (c, s) = (self.groups.coords, self.spec);
        let rep = e.rank.layout.across().ok_or_else(|| {
            TrainError::Config("internal: a block view without experts across replicas".into())
        })?;
        let view = e.rank.block_view();
        let specs = layout::rank_params_ep(
            &s.model,
            c.pp_rank,
            s.dims.pp,
            s.virtual_stages,
            c.tp_rank,
            s.dims.tp,
            &view,
        )?;
        let flat = FlatLayout::new(&specs);
        let mut out: [Vec<f32>; 3] = std::array::from_fn(|_| vec![0f32; flat.total()]);
        for (i, spec) in self.specs.iter().enumerate() {
            let (mine, whole) = (self.layout.range(i), flat.range(i));
            let expert = spec.weight.expert();
            let Some(holder) = expert.and_then(|x| rep.peer_of(x, c.tp_rank)) else {
                // Dense, or held by a rank of another tp index (empty in both views).
                for k in 0..3 {
                    out[k][whole.clone()].copy_from_slice(&bufs[k][mine.clone()]);
                }
                continue;
            };
            let n = whole.len();
            let counts: Vec<usize> = (0..rep.block)
                .map(|p| if p == holder { 3 * n } else { 0 })
                .collect();
            let send: Vec<f32> = bufs
                .iter()
                .flat_map(|b| b[mine.clone()].iter().copied())
                .collect();
            let mut all = vec![0f32; 3 * n];
            e.ep.all_gather_v(&send, &mut all, &counts)?;
            for k in 0..3 {
                out[k][whole.clone()].copy_from_slice(&all[k * n..(k + 1) * n]);
            }
        }
        Ok((specs, flat, view, out))
    }
}

impl Trainer<'_> {
    /// Collective over the world with experts across replicas: the rows each rank's experts
    /// computed since the last call ([`StepReport::expert_rows`]); `None` otherwise.
    fn expert_load(&mut self) -> Result<Option<Vec<u64>>> {
        if self.ep.is_none() {
            return Ok(None);
        }
        let total: u64 = self
            .chunks
            .iter()
            .filter_map(StageModel::dispatched_rows)
            .sum();
        let mine = [total - self.expert_rows_before];
        self.expert_rows_before = total;
        let mut all = vec![0u64; self.groups.world.size()];
        self.groups.world.all_gather(&mine, &mut all)?;
        Ok(Some(all))
    }
}
