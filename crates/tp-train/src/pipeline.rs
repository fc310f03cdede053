//! Runs one training step's forwards and backwards of a pipeline rank's model chunks on the
//! 1F1B schedule, or with several chunks a rank on the interleaved one ([`crate::schedule`]),
//! with activations sent to the model's next chunk and input gradients sent back over the
//! pipeline group (Narayanan et al. 2021, §2.2; [`crate::p2p`]). One chunk a rank is the
//! rank's stage. Each tp rank of a stage talks to the same tp rank of its neighbours:
//! activations are replicated across tp, or with sequence parallelism each rank sends its own
//! `seq/tp` positions.

use crate::error::{Result, TrainError};
use crate::grads::{accumulate, accumulate_present, all_seen, FlatLayout};
use crate::layout::rank_chunks;
use crate::model::{StageInput, StageModel};
use crate::p2p::{Mailbox, Msg};
use crate::recompute;
use crate::schedule::{rank_schedule, Action, ChunkAction};
use candle_core::{Device, Tensor, Var};
use std::collections::VecDeque;
use std::ops::Range;
use tp_comm::{CommExt, ProcessGroups};
use tp_nn::Segments;
use tp_plan::workload::Recompute;

/// Tag of activations in validation (chunk g -> g+1; training's are [`crate::p2p`]'s).
const TAG_ACTIVATION: u32 = 1;

/// One micro-batch's tokens.
#[derive(Clone, Debug)]
pub struct MicroBatch {
    pub ids: Tensor,     // [batch, seq] u32
    pub targets: Tensor, // [batch * seq] u32
    /// Each target's weight in the loss: its mask over the tokens in the whole step's loss.
    pub weights: Tensor, // [batch * seq] f32
    /// Packed sequences: each input's document and position (every stage reads them, as
    /// the first reads the tokens); `None`: one document per sequence.
    pub segments: Option<Segments>,
}

impl MicroBatch {
    pub fn new(
        ids: Vec<u32>,
        targets: Vec<u32>,
        weights: Vec<f32>,
        batch: usize,
        seq: usize,
    ) -> Result<Self> {
        let dev = Device::Cpu;
        Ok(MicroBatch {
            ids: Tensor::from_vec(ids, (batch, seq), &dev)?,
            targets: Tensor::from_vec(targets, batch * seq, &dev)?,
            weights: Tensor::from_vec(weights, batch * seq, &dev)?,
            segments: None,
        })
    }

    /// The same micro-batch over packed sequences: `segments` is (each input's document,
    /// its position in it), `[batch * seq]` each ([`crate::Corpus::segments`]).
    pub fn with_segments(mut self, segments: Option<(Vec<u32>, Vec<u32>)>) -> Result<Self> {
        if let Some((docs, pos)) = segments {
            let (b, s) = self.ids.dims2()?;
            self.segments = Some(Segments::new(docs, pos, b, s)?);
        }
        Ok(self)
    }
}

/// A forward whose backward has not run yet.
struct InFlight {
    micro: usize,
    input: Option<Var>, // [b, s, hidden] on chunks after the model's first
    kept: Kept,
}

/// What a forward keeps for its backward.
enum Kept {
    /// The whole graph (no recomputation, or selective: the attention cores' own nodes).
    Graph {
        output: Tensor, // [b, s, hidden], or the scalar loss on the last chunk
        /// This rank's share of the chunk's MoE load-balancing loss (a scalar), if any.
        aux_share: Option<Tensor>,
    },
    /// Each block's input only ([`recompute`]).
    Inputs(recompute::Kept),
}

/// What a stage's micro-batches add up to.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageLosses {
    /// The sum of the micro-batch losses on the last stage (0 elsewhere).
    pub loss: f64,
    /// The sum over micro-batches and the stage's MoE layers of their load-balancing loss.
    pub aux: f64,
    /// (token, expert) pairs the stage's MoE layers dropped under a capacity factor, over
    /// micro-batches.
    pub dropped: u64,
    /// Under full recomputation, the bytes of the block inputs one micro-batch keeps between
    /// its forward and its backward (counted, the largest over micro-batches and chunks); 0
    /// otherwise.
    pub kept_input_bytes: u64,
    /// Wall seconds of the step's forwards and backwards on this rank.
    pub pipeline_s: f64,
    /// Of those, the seconds spent in pipeline receives: mostly waiting for the neighbours
    /// (the bubble, with any imbalance between the stages).
    pub wait_s: f64,
}

/// One of the rank's model chunks in a step: the model's chunk `global` of `chunks`, its
/// parameters' range of the rank's flat buffers and their layout within it.
struct Chunk<'m> {
    model: &'m StageModel,
    global: usize,
    range: Range<usize>,
    layout: FlatLayout,
    /// Forwards waiting for their backward, in micro-batch order.
    in_flight: VecDeque<InFlight>,
}

/// Runs the rank's forwards and backwards for all `micro` batches on its `chunks` (the
/// rank's model chunks in order, [`crate::layout::rank_chunks`]; one: its stage), adding the
/// gradients of their losses (each a weighted sum, [`MicroBatch::weights`]) plus `aux_scale`
/// times each micro-batch's MoE load-balancing loss into `grads` (the chunks' parameters in
/// order, as `layout` lays them out).
pub fn run_micro_batches(
    chunks: &[StageModel],
    groups: &ProcessGroups,
    micro: &[MicroBatch],
    hidden: usize,
    aux_scale: f64,
    grads: &mut [f32],
    layout: &FlatLayout,
) -> Result<StageLosses> {
    let t0 = std::time::Instant::now();
    let (pp_rank, pp) = (groups.coords.pp_rank, groups.dims.pp);
    let v = chunks.len();
    let total_chunks = pp * v;
    let mut at = 0;
    let mut parts: Vec<Chunk<'_>> = Vec::with_capacity(v);
    for (c, (model, global)) in chunks.iter().zip(rank_chunks(pp_rank, pp, v)).enumerate() {
        let layout = FlatLayout::new(model.specs());
        parts.push(Chunk {
            model,
            global,
            range: at..at + layout.total(),
            layout,
            in_flight: VecDeque::new(),
        });
        at += parts[c].layout.total();
    }
    if at != layout.total() || at != grads.len() {
        return Err(TrainError::Config(format!(
            "internal: the rank's chunks hold {at} parameter elements, its buffers {}",
            grads.len()
        )));
    }
    let len = match (micro.first(), chunks.first()) {
        (Some(mb), Some(model)) => {
            let (b, s) = mb.ids.dims2()?;
            b * model.local_seq(s)? * hidden // [b, s_local, hidden]
        }
        _ => 0,
    };
    let mut mail = Mailbox::new(&groups.pp, v, micro.len(), len);
    let mut sums = StageLosses::default();
    for ChunkAction { chunk, action } in rank_schedule(pp_rank, pp, v, micro.len()) {
        let part = parts.get_mut(chunk).ok_or_else(|| {
            TrainError::Config(format!("internal: the schedule names chunk {chunk} of {v}"))
        })?;
        let (first, last) = (part.global == 0, part.global + 1 == total_chunks);
        let model = part.model;
        let g = part.global;
        match action {
            Action::Forward(m) => {
                let mb = &micro[m];
                let (b, s) = mb.ids.dims2()?;
                let s = model.local_seq(s)?; // seq, or seq/tp with sequence parallelism
                let input = if first {
                    None
                } else {
                    let buf = mail.recv(Msg::Activation { chunk: g, micro: m })?;
                    let t = Tensor::from_vec(buf, (b, s, hidden), &Device::Cpu)?; // [b, s_local, hidden]
                    Some(Var::from_tensor(&t)?)
                };
                let stage_in = match &input {
                    Some(x) => StageInput::Hidden(x.as_tensor()),
                    None => StageInput::Tokens(&mb.ids),
                };
                let targets = last.then_some((&mb.targets, &mb.weights));
                let seg = mb.segments.as_ref();
                let (output, kept) = if model.recompute() == Recompute::Full {
                    let f = recompute::forward(model, stage_in, seg, targets, &groups.tp)?;
                    sums.aux += f.aux;
                    sums.dropped += f.dropped;
                    sums.kept_input_bytes = sums.kept_input_bytes.max(f.kept.block_input_bytes());
                    (f.value, Kept::Inputs(f.kept))
                } else {
                    let out = model.forward_packed(stage_in, seg, targets, &groups.tp)?;
                    sums.aux += out.aux;
                    sums.dropped += out.dropped;
                    let output = out.value;
                    let kept = Kept::Graph {
                        output: output.clone(),
                        aux_share: out.aux_share,
                    };
                    (output, kept)
                };
                if last {
                    sums.loss += f64::from(output.to_scalar::<f32>()?);
                } else {
                    let acts = output.flatten_all()?.to_vec1::<f32>()?; // [b * s * hidden]
                    mail.send(
                        Msg::Activation {
                            chunk: g + 1,
                            micro: m,
                        },
                        &acts,
                    )?;
                }
                part.in_flight.push_back(InFlight {
                    micro: m,
                    input,
                    kept,
                });
            }
            Action::Backward(m) => {
                let f = part
                    .in_flight
                    .pop_front()
                    .filter(|f| f.micro == m)
                    .ok_or_else(|| {
                        TrainError::Config(format!(
                            "internal: backward of micro-batch {m} out of schedule order"
                        ))
                    })?;
                let params = model.params();
                let (grads, layout) = (&mut grads[part.range.clone()], &part.layout);
                // The gradient of the chunk's output, from the next chunk: [b, s, hidden].
                let mut grad_out = |dims: &[usize]| -> Result<Tensor> {
                    let buf = mail.recv(Msg::Gradient { chunk: g, micro: m })?;
                    Ok(Tensor::from_vec(buf, dims, &Device::Cpu)?)
                };
                let gx = match f.kept {
                    Kept::Graph { output, aux_share } => {
                        let objective = if last {
                            output
                        } else {
                            // d/dx of sum(y * dy) with dy constant is dy^T dy/dx: the
                            // vector-Jacobian product that backpropagates dy through the chunk.
                            let dy = grad_out(output.dims())?; // [b, s, hidden]
                            (output * dy)?.sum_all()?
                        };
                        let store = match aux_share {
                            Some(a) => (objective + (a * aux_scale)?)?.backward()?,
                            None => objective.backward()?,
                        };
                        accumulate(grads, layout, &params, &store)?;
                        match &f.input {
                            Some(input) => {
                                Some(store.get(input.as_tensor()).cloned().ok_or_else(|| {
                                    TrainError::Config(
                                        "internal: the stage input received no gradient".into(),
                                    )
                                })?)
                            }
                            None => None,
                        }
                    }
                    Kept::Inputs(full) => {
                        let dy = if last {
                            None
                        } else {
                            Some(grad_out(full.out_dims())?) // [b, s, hidden]
                        };
                        let mut seen = vec![false; params.len()];
                        let gx = recompute::backward(
                            model,
                            full,
                            dy,
                            aux_scale,
                            &groups.tp,
                            &mut |store| {
                                accumulate_present(grads, layout, &params, store, &mut seen)
                            },
                        )?;
                        all_seen(&params, &seen)?;
                        gx
                    }
                }; // [b, s, hidden] on chunks after the model's first
                if let Some(gx) = gx {
                    let gx = gx.flatten_all()?.to_vec1::<f32>()?; // [b * s * hidden]
                    mail.send(
                        Msg::Gradient {
                            chunk: g - 1,
                            micro: m,
                        },
                        &gx,
                    )?;
                }
            }
        }
    }
    sums.pipeline_s = t0.elapsed().as_secs_f64();
    sums.wait_s = mail.waited().as_secs_f64();
    Ok(sums)
}

/// The losses of `micro` without backward (validation): each micro-batch's forward through
/// the model's chunks in order (the rank's `chunks`, as [`run_micro_batches`] takes them).
/// Returns the sum of the weighted losses on the rank of the last chunk (0 elsewhere).
pub fn forward_only(
    chunks: &[StageModel],
    groups: &ProcessGroups,
    micro: &[MicroBatch],
    hidden: usize,
) -> Result<f64> {
    let (pp_rank, pp) = (groups.coords.pp_rank, groups.dims.pp);
    let total_chunks = pp * chunks.len();
    let mut loss_sum = 0f64;
    let globals = rank_chunks(pp_rank, pp, chunks.len());
    for (mb, (model, &g)) in micro
        .iter()
        .flat_map(|mb| chunks.iter().zip(&globals).map(move |c| (mb, c)))
    {
        let (first, last) = (g == 0, g + 1 == total_chunks);
        let (b, s) = mb.ids.dims2()?;
        let s = model.local_seq(s)?; // seq, or seq/tp with sequence parallelism
        let received;
        let stage_in = if first {
            StageInput::Tokens(&mb.ids)
        } else {
            let mut buf = vec![0f32; b * s * hidden];
            groups
                .pp
                .recv(&mut buf, (pp_rank + pp - 1) % pp, TAG_ACTIVATION)?;
            received = Tensor::from_vec(buf, (b, s, hidden), &Device::Cpu)?; // [b, s, hidden]
            StageInput::Hidden(&received)
        };
        let output = model
            .forward_packed(
                stage_in,
                mb.segments.as_ref(),
                last.then_some((&mb.targets, &mb.weights)),
                &groups.tp,
            )?
            .value;
        if last {
            loss_sum += f64::from(output.to_scalar::<f32>()?);
        } else {
            let out = output.flatten_all()?.to_vec1::<f32>()?; // [b * s * hidden]
            groups.pp.send(&out, (pp_rank + 1) % pp, TAG_ACTIVATION)?;
        }
    }
    Ok(loss_sum)
}
