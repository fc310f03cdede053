//! The pipeline's point-to-point messages in a training step: activations to the model's
//! next chunk, gradients to its previous one. Under 1F1B and its interleaved form a rank needs
//! each neighbour's messages in the order that neighbour sends them (tested below for every
//! P, V up to 4 and M up to 8), although with interleaving at pp 2 activations and gradients
//! go both ways between ranks 0 and 1 and tp-comm's local backend delivers a pair's messages
//! strictly in order: the [`Mailbox`] knows each neighbour's sends from its schedule and
//! names a message that comes out of that order instead of receiving the wrong one.

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

/// The messages pipeline rank `from` sends rank `to` in a step of `micro` micro-batches on
/// [`rank_schedule`] with `virtual_stages` chunks a rank, in its order.
pub fn sends(from: usize, to: usize, pp: usize, virtual_stages: usize, micro: usize) -> Vec<Msg> {
    let chunks = pp * virtual_stages;
    let globals = rank_chunks(from, pp, virtual_stages);
    rank_schedule(from, pp, virtual_stages, micro)
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
            (chunk_rank(msg.receiver_chunk(), pp) == to).then_some(msg)
        })
        .collect()
}

/// One rank's pipeline messages of a step.
pub struct Mailbox<'g> {
    pp: &'g Group,
    /// Elements of every message (`b * s_local * hidden`; the step's micro-batches are alike).
    len: usize,
    /// Per neighbouring rank, what it will send this rank, in its order.
    expected: HashMap<usize, VecDeque<Msg>>,
    /// Time spent in receives: waiting for the neighbours (the pipeline bubble) and copying.
    waited: Duration,
}

impl<'g> Mailbox<'g> {
    /// The mailbox of this rank of `pp` with `virtual_stages` chunks a rank, for `micro`
    /// micro-batches on [`rank_schedule`], messages of `len` elements.
    pub fn new(pp: &'g Group, virtual_stages: usize, micro: usize, len: usize) -> Self {
        let (me, p) = (pp.rank(), pp.size());
        let expected = [(me + p - 1) % p, (me + 1) % p]
            .into_iter()
            .filter(|&q| q != me)
            .map(|q| (q, sends(q, me, p, virtual_stages, micro).into()))
            .collect();
        Mailbox {
            pp,
            len,
            expected,
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

    /// Receives `msg` (blocking): the next message its sender sends this rank, or an
    /// internal error naming the one it sends first.
    pub fn recv(&mut self, msg: Msg) -> Result<Vec<f32>> {
        let sender = msg
            .sender_chunk()
            .ok_or_else(|| TrainError::Config(format!("internal: {msg:?} has no sender")))?;
        let from = chunk_rank(sender, self.pp.size());
        let next = self.expected.get_mut(&from).and_then(VecDeque::pop_front);
        if next != Some(msg) {
            return Err(TrainError::Config(format!(
                "internal: this rank needs {msg:?} while pipeline rank {from} sends {next:?} \
                 first"
            )));
        }
        let mut buf = vec![0f32; self.len];
        let t0 = Instant::now();
        self.pp.recv(&mut buf, from, msg.tag())?;
        self.waited += t0.elapsed();
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::ChunkAction;

    /// The messages rank `to` receives from rank `from`, in the order its schedule needs them.
    fn needs(to: usize, from: usize, pp: usize, v: usize, micro: usize) -> Vec<Msg> {
        let chunks = pp * v;
        let globals = rank_chunks(to, pp, v);
        rank_schedule(to, pp, v, micro)
            .into_iter()
            .filter_map(|ChunkAction { chunk, action }| {
                let g = globals[chunk];
                let msg = match action {
                    Action::Forward(micro) if g > 0 => Msg::Activation { chunk: g, micro },
                    Action::Backward(micro) if g + 1 < chunks => Msg::Gradient { chunk: g, micro },
                    _ => return None,
                };
                (chunk_rank(msg.sender_chunk()?, pp) == from).then_some(msg)
            })
            .collect()
    }

    #[test]
    fn every_rank_needs_its_neighbours_messages_in_their_send_order() {
        for pp in 2..=4 {
            for v in 1..=4 {
                for m in (1..=8).filter(|m| v == 1 || m % pp == 0) {
                    for to in 0..pp {
                        for from in [(to + pp - 1) % pp, (to + 1) % pp] {
                            let sent = sends(from, to, pp, v, m);
                            assert_eq!(
                                sent,
                                needs(to, from, pp, v, m),
                                "P={pp} V={v} M={m}: rank {from} -> {to}"
                            );
                            // 3 chunk boundaries at pp 2 x 2, each crossed by every
                            // micro-batch forward and backward: 3 M messages each way.
                            if (pp, v) == (2, 2) {
                                assert_eq!(sent.len(), 3 * m);
                            }
                        }
                    }
                }
            }
        }
    }
}
