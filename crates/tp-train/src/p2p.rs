//! The pipeline's point-to-point messages in a training step: activations to the model's
//! next chunk, gradients to its previous one. A rank receives from each neighbour in the
//! order that neighbour sends (known from its schedule), keeping a message that arrives before
//! it is needed, so messages of two kinds between one pair of ranks never cross (with
//! interleaving at pp 2, activations and gradients both go both ways between ranks 0 and 1;
//! tp-comm's local backend delivers a pair's messages in order).

use crate::error::{Result, TrainError};
use crate::layout::{chunk_rank, rank_chunks};
use crate::schedule::{rank_schedule, Action};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};
use tp_comm::{CommExt, Group};

/// Tag of activations (chunk g -> g+1) and of their gradients (g+1 -> g).
const TAG_ACTIVATION: u32 = 1;
const TAG_GRADIENT: u32 = 2;

/// A message to the model's chunk `chunk` (of `pp * virtual_stages`, held by pipeline rank
/// `chunk % pp`) for micro-batch `micro`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Msg {
    /// The output of chunk `chunk - 1`: `[b, s_local, hidden]`.
    Activation { chunk: usize, micro: usize },
    /// The gradient of chunk `chunk`'s output, from chunk `chunk + 1`: `[b, s_local, hidden]`.
    Gradient { chunk: usize, micro: usize },
}

impl Msg {
    fn tag(self) -> u32 {
        match self {
            Msg::Activation { .. } => TAG_ACTIVATION,
            Msg::Gradient { .. } => TAG_GRADIENT,
        }
    }

    /// The model chunk that sends it (none for an activation to the first chunk).
    fn sender_chunk(self) -> Option<usize> {
        match self {
            Msg::Activation { chunk, .. } => chunk.checked_sub(1),
            Msg::Gradient { chunk, .. } => Some(chunk + 1),
        }
    }

    fn receiver_chunk(self) -> usize {
        match self {
            Msg::Activation { chunk, .. } | Msg::Gradient { chunk, .. } => chunk,
        }
    }
}

/// One rank's pipeline messages of a step of `micro` micro-batches.
pub struct Mailbox<'g> {
    pp: &'g Group,
    /// Elements of every message (`b * s_local * hidden`; the step's micro-batches are alike).
    len: usize,
    /// Per neighbouring rank, what it will send this rank, in its order.
    expected: HashMap<usize, VecDeque<Msg>>,
    /// Messages received before they were needed.
    early: HashMap<Msg, Vec<f32>>,
    /// Time spent in receives: waiting for the neighbours (the pipeline bubble) and copying.
    waited: Duration,
}

impl<'g> Mailbox<'g> {
    /// The mailbox of this rank of `pp` with `virtual_stages` chunks a rank, for `micro`
    /// micro-batches on [`rank_schedule`], messages of `len` elements.
    pub fn new(pp: &'g Group, virtual_stages: usize, micro: usize, len: usize) -> Self {
        let (me, p) = (pp.rank(), pp.size());
        let chunks = p * virtual_stages;
        let mut expected: HashMap<usize, VecDeque<Msg>> = HashMap::new();
        for q in [(me + p - 1) % p, (me + 1) % p] {
            if q == me || expected.contains_key(&q) {
                continue;
            }
            let globals = rank_chunks(q, p, virtual_stages);
            let sends = rank_schedule(q, p, virtual_stages, micro)
                .into_iter()
                .filter_map(|a| {
                    let g = *globals.get(a.chunk)?;
                    let msg = match a.action {
                        Action::Forward(micro) if g + 1 < chunks => Msg::Activation {
                            chunk: g + 1,
                            micro,
                        },
                        Action::Backward(micro) if g > 0 => Msg::Gradient {
                            chunk: g - 1,
                            micro,
                        },
                        _ => return None,
                    };
                    (chunk_rank(msg.receiver_chunk(), p) == me).then_some(msg)
                })
                .collect();
            expected.insert(q, sends);
        }
        Mailbox {
            pp,
            len,
            expected,
            early: HashMap::new(),
            waited: Duration::ZERO,
        }
    }

    /// Sends `data` (`len` elements) to the rank of `msg`'s chunk.
    pub fn send(&self, msg: Msg, data: &[f32]) -> Result<()> {
        Ok(self.pp.send(
            data,
            chunk_rank(msg.receiver_chunk(), self.pp.size()),
            msg.tag(),
        )?)
    }

    /// The time spent in receives so far.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// Receives `msg` (blocking): first the messages its sender sends before it, kept for
    /// later.
    pub fn recv(&mut self, msg: Msg) -> Result<Vec<f32>> {
        let sender = msg
            .sender_chunk()
            .ok_or_else(|| TrainError::Config(format!("internal: {msg:?} has no sender")))?;
        let from = chunk_rank(sender, self.pp.size());
        loop {
            if let Some(data) = self.early.remove(&msg) {
                return Ok(data);
            }
            let next = self
                .expected
                .get_mut(&from)
                .and_then(VecDeque::pop_front)
                .ok_or_else(|| {
                    TrainError::Config(format!(
                        "internal: {msg:?} is not in pipeline rank {from}'s schedule"
                    ))
                })?;
            let mut buf = vec![0f32; self.len];
            let t0 = Instant::now();
            self.pp.recv(&mut buf, from, next.tag())?;
            self.waited += t0.elapsed();
            self.early.insert(next, buf);
        }
    }
}
