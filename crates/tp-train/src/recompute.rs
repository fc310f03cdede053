//! Full activation recomputation of a stage (Korthikanti et al. 2022 §5; Chen et al. 2016):
//! the forward runs each block on a graph-free input and keeps only that input; the backward
//! re-runs each block's forward with a graph, last block first, backpropagates the gradient of
//! its output through it and chains the input gradient to the block before. The embedding
//! (first stage) and the head with its loss (last stage) keep their graphs as without
//! recomputation. The recomputed forwards issue the blocks' tp collectives again, in the same
//! order on every tp rank of the stage. With sequence parallelism every tensor here holds this
//! rank's `s_local = seq/tp` positions, and the blocks run on that split as without recompute.

use crate::error::{Result, TrainError};
use crate::model::{StageInput, StageModel};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use tp_comm::Group;
use tp_nn::{Segments, SeqLayout, SeqSplit};

/// A micro-batch's forward under full recomputation, waiting for its backward.
pub struct Kept {
    /// The stage input as the first block saw it, with its graph: the embedding's output on
    /// the first stage (`[b, s, hidden]`); `None` on the others.
    embedded: Option<Tensor>,
    /// Each block's input, graph-free: `[b, s, hidden]` per block.
    inputs: Vec<Tensor>,
    /// The last block's output as the leaf of the head's graph, and the loss computed from
    /// it with that graph (last stage).
    head: Option<(Var, Tensor)>, // [b, s, hidden], a scalar
    /// The shape of the stage's output (`[b, s, hidden]`), whose gradient the backward takes.
    out_dims: Vec<usize>,
    /// The sequence's split over tp with sequence parallelism.
    split: Option<SeqSplit>,
    /// Packed sequences' documents and positions, for the recomputed blocks.
    segments: Option<Segments>,
}

impl Kept {
    /// Bytes of the block inputs kept (f32): the activations the micro-batch holds between
    /// its forward and its backward besides the embedding's and the head's graphs.
    pub fn block_input_bytes(&self) -> u64 {
        self.inputs
            .iter()
            .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum()
    }

    /// The shape of the stage's output (`[b, s, hidden]`).
    pub fn out_dims(&self) -> &[usize] {
        &self.out_dims
    }
}

/// What a forward under full recomputation gives.
pub struct FullForward {
    /// Hidden states `[b, s, hidden]` (graph-free; the backward does not need them) or, on
    /// the last stage, the loss.
    pub value: Tensor,
    /// The summed load-balancing loss of the stage's MoE layers (for reports; their shares
    /// are backpropagated in the recompute).
    pub aux: f64,
    /// (token, expert) pairs the stage's MoE layers dropped under a capacity factor.
    pub dropped: u64,
    pub kept: Kept,
}

/// The stage's forward keeping only each block's input (and the embedding's and head's graphs),
/// over packed sequences when `segments` is given.
pub fn forward(
    model: &StageModel,
    input: StageInput<'_>,
    segments: Option<&Segments>,
    targets: Option<(&Tensor, &Tensor)>,
    tp: &Group,
) -> Result<FullForward> {
    let first = matches!(input, StageInput::Tokens(_));
    let split = model.input_split(&input)?;
    let layout = split
        .as_ref()
        .map_or(SeqLayout::Replicated, SeqLayout::Split);
    let embedded = model.stage_input(input, tp, layout)?; // [b, s, hidden]
    let mut x = embedded.detach(); // [b, s, hidden], sharing the storage
    let mut inputs = Vec::with_capacity(model.blocks().len());
    let (mut aux, mut dropped) = (0.0, 0);
    for b in model.blocks() {
        let out = b.forward_packed(&x, tp, layout, segments)?;
        aux += f64::from(out.aux.unwrap_or(0.0));
        dropped += out.dropped;
        inputs.push(x);
        // Detaching drops the block's graph, and with it its intermediates.
        x = out.hidden.detach(); // [b, s, hidden]
    }
    let out_dims = x.dims().to_vec(); // [b, s, hidden]
    let (value, head) = match targets {
        Some(_) => {
            let leaf = Var::from_tensor(&x)?; // [b, s, hidden]
            let loss = model.head_loss(leaf.as_tensor().clone(), targets, tp, layout)?;
            (loss.clone(), Some((leaf, loss)))
        }
        None => (model.head_loss(x, None, tp, layout)?, None),
    };
    Ok(FullForward {
        value,
        aux,
        dropped,
        kept: Kept {
            embedded: first.then_some(embedded),
            inputs,
            head,
            out_dims,
            split,
            segments: segments.cloned(),
        },
    })
}

/// The backward of a micro-batch's [`forward`], from what it kept. `grad_out` is the gradient of the stage's
/// output `[b, s, hidden]` (received from the next stage); `None` on the last stage, whose
/// value is the loss. Each MoE layer's load-balancing share is backpropagated times
/// `aux_scale`. Every part's gradients go to `on_grads`. Returns the gradient of the stage
/// input `[b, s, hidden]` on the stages after the first.
pub fn backward(
    model: &StageModel,
    kept: Kept,
    grad_out: Option<Tensor>,
    aux_scale: f64,
    tp: &Group,
    on_grads: &mut dyn FnMut(&GradStore) -> Result<()>,
) -> Result<Option<Tensor>> {
    let no_grad = |what: &str| {
        TrainError::Config(format!(
            "internal: {what} received no gradient in the recompute"
        ))
    };
    let mut g = match (grad_out, &kept.head) {
        (None, Some((leaf, loss))) => {
            let store = loss.backward()?;
            on_grads(&store)?;
            store
                .get(leaf.as_tensor())
                .cloned()
                .ok_or_else(|| no_grad("the head's input"))?
        }
        (Some(dy), None) => dy,
        _ => {
            return Err(TrainError::Config(
                "internal: the last stage backpropagates its loss, the others a gradient".into(),
            ))
        }
    }; // [b, s, hidden]
    let layout = kept
        .split
        .as_ref()
        .map_or(SeqLayout::Replicated, SeqLayout::Split);
    for (b, x) in model.blocks().iter().zip(kept.inputs).rev() {
        let leaf = Var::from_tensor(&x)?; // [b, s, hidden]
        let out = b.forward_packed(leaf.as_tensor(), tp, layout, kept.segments.as_ref())?;
        // d/dx of sum(y * g) with g constant: the vector-Jacobian product of g through it.
        let mut objective = (out.hidden * &g)?.sum_all()?;
        if let Some(share) = out.aux_share {
            objective = (objective + (share * aux_scale)?)?;
        }
        let store = objective.backward()?;
        on_grads(&store)?;
        g = store
            .get(leaf.as_tensor())
            .cloned()
            .ok_or_else(|| no_grad("a block's input"))?;
    }
    match kept.embedded {
        Some(e) => {
            on_grads(&(e * g)?.sum_all()?.backward()?)?;
            Ok(None)
        }
        None => Ok(Some(g)),
    }
}
