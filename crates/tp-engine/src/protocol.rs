//! The step protocol: rank 0 (the leader) broadcasts each command to the other ranks (the
//! followers), then every rank executes it. Commands are a fixed header of four u32 words
//! plus an optional u32 payload; followers validate everything they receive. The leader
//! chooses the KV blocks a forward step takes and names them in the command, so every rank's
//! block tables stay identical.

use crate::candidates::{RowNeed, MAX_CANDIDATES};
use crate::error::{EngineError, Result};
use crate::swap::ModelCommand;
use tp_comm::{CommExt, Group};

/// Longest payload a follower accepts (words): bounds memory on a corrupted header.
const MAX_PAYLOAD: usize = 1 << 24;

/// One sequence's part of a forward step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkSpec {
    pub slot: u32,
    pub tokens: Vec<u32>,
    /// Return logits for every token (perplexity), not only the last.
    pub all_logits: bool,
    /// What the chunk's rows are returned as: whole, or the most likely ids (every row of
    /// the chunk alike).
    pub need: RowNeed,
    /// KV blocks the slot takes before this chunk is written (a copy of its shared last
    /// block first, when one is needed; then new blocks in position order). Leave empty when
    /// submitting: rank 0 fills them in.
    pub blocks: Vec<u32>,
}

impl ChunkSpec {
    /// A chunk of `tokens` for `slot` returning the last token's logits.
    pub fn new(slot: u32, tokens: Vec<u32>) -> Self {
        ChunkSpec {
            slot,
            tokens,
            all_logits: false,
            need: RowNeed::Full,
            blocks: Vec::new(),
        }
    }

    /// The same chunk returning its rows as `need` says.
    pub fn with_need(self, need: RowNeed) -> Self {
        ChunkSpec { need, ..self }
    }
}

/// What every rank does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Create an empty KV cache for `slot` holding at most `capacity` positions.
    Open { slot: u32, capacity: u32 },
    /// Free `slot`'s cache.
    Close { slot: u32 },
    /// Keep only the first `len` positions of `slot`'s cache (reuse a shared prefix).
    Truncate { slot: u32, len: u32 },
    /// Open `dst` (at most `capacity` positions) holding the first `len` positions of `src`,
    /// sharing its blocks (prefix sharing; copy-on-write when either writes into a shared one).
    Fork {
        dst: u32,
        src: u32,
        len: u32,
        capacity: u32,
    },
    /// One batched forward pass over the chunks; whole rows are gathered on every rank, the
    /// others merged from every rank's candidates ([`crate::candidates`]).
    Forward(Vec<ChunkSpec>),
    /// Pipelining (micro-batches in flight): the forward pass of [`Command::Forward`], begun.
    /// Every stage but the last runs its part now (activations go on to the next stage); the
    /// last stage takes the KV blocks and queues it for a [`Command::Land`]. Several may be
    /// in flight, on disjoint slots, so that every stage computes at once.
    Launch(Vec<ChunkSpec>),
    /// The last stage runs the oldest launched forward and returns its rows; a no-op on the
    /// other stages.
    Land,
    /// Nothing to do: keeps followers' waits bounded while the leader waits for input.
    Idle,
    /// Reset every rank's time profile; `barriers` separates waiting from reducing.
    ProfileStart { barriers: bool },
    /// Every rank's profile, gathered on every rank.
    ProfileReport,
    /// Load, adopt, select or drop a model held beside the live one (see [`crate::swap`]).
    Model(ModelCommand),
    /// Followers return.
    Exit,
}

const OP_OPEN: u32 = 1;
const OP_CLOSE: u32 = 2;
const OP_TRUNCATE: u32 = 3;
const OP_FORWARD: u32 = 4;
const OP_IDLE: u32 = 5;
const OP_EXIT: u32 = 6;
const OP_PROFILE_START: u32 = 7;
const OP_PROFILE_REPORT: u32 = 8;
const OP_FORK: u32 = 9;
const OP_MODEL: u32 = 10;
const OP_LAUNCH: u32 = 11;
const OP_LAND: u32 = 12;

/// The tag of commands sent point to point (pipelined workers; see [`send`]).
const COMMAND_TAG: u32 = 7;

/// A chunk's flags word: bit 0 `all_logits`, bit 1 the normalizer of candidates, the bits
/// above the candidates asked for (0 for whole rows).
fn flags(c: &ChunkSpec) -> u32 {
    let (k, lse) = match c.need {
        RowNeed::Full => (0, false),
        RowNeed::Candidates { k, lse } => (k, lse),
    };
    u32::from(c.all_logits) | u32::from(lse) << 1 | k << 2
}

impl Command {
    /// `(header, payload)`.
    fn encode(&self) -> ([u32; 4], Vec<u32>) {
        match self {
            Command::Open { slot, capacity } => ([OP_OPEN, *slot, *capacity, 0], Vec::new()),
            Command::Close { slot } => ([OP_CLOSE, *slot, 0, 0], Vec::new()),
            Command::Truncate { slot, len } => ([OP_TRUNCATE, *slot, *len, 0], Vec::new()),
            Command::Fork {
                dst,
                src,
                len,
                capacity,
            } => ([OP_FORK, *dst, *src, 2], vec![*len, *capacity]),
            Command::Forward(chunks) | Command::Launch(chunks) => {
                let op = if matches!(self, Command::Forward(_)) {
                    OP_FORWARD
                } else {
                    OP_LAUNCH
                };
                let mut payload = Vec::new();
                for c in chunks {
                    payload.extend([
                        c.slot,
                        c.tokens.len() as u32,
                        flags(c),
                        c.blocks.len() as u32,
                    ]);
                }
                for c in chunks {
                    payload.extend_from_slice(&c.tokens);
                }
                for c in chunks {
                    payload.extend_from_slice(&c.blocks);
                }
                ([op, chunks.len() as u32, 0, payload.len() as u32], payload)
            }
            Command::Land => ([OP_LAND, 0, 0, 0], Vec::new()),
            Command::Idle => ([OP_IDLE, 0, 0, 0], Vec::new()),
            Command::ProfileStart { barriers } => {
                ([OP_PROFILE_START, u32::from(*barriers), 0, 0], Vec::new())
            }
            Command::ProfileReport => ([OP_PROFILE_REPORT, 0, 0, 0], Vec::new()),
            Command::Model(m) => {
                let (op, id, payload) = m.encode();
                ([OP_MODEL, op, id, payload.len() as u32], payload)
            }
            Command::Exit => ([OP_EXIT, 0, 0, 0], Vec::new()),
        }
    }

    fn decode(header: [u32; 4], payload: &[u32], rank: usize) -> Result<Command> {
        let bad = |message: String| EngineError::Protocol { rank, message };
        Ok(match header[0] {
            OP_OPEN => Command::Open {
                slot: header[1],
                capacity: header[2],
            },
            OP_CLOSE => Command::Close { slot: header[1] },
            OP_TRUNCATE => Command::Truncate {
                slot: header[1],
                len: header[2],
            },
            OP_FORK => match payload {
                &[len, capacity] => Command::Fork {
                    dst: header[1],
                    src: header[2],
                    len,
                    capacity,
                },
                _ => return Err(bad(format!("fork with {} payload words", payload.len()))),
            },
            OP_FORWARD => Command::Forward(decode_chunks(header[1] as usize, payload, &bad)?),
            OP_LAUNCH => Command::Launch(decode_chunks(header[1] as usize, payload, &bad)?),
            OP_LAND => Command::Land,
            OP_IDLE => Command::Idle,
            OP_PROFILE_START => Command::ProfileStart {
                barriers: header[1] == 1,
            },
            OP_PROFILE_REPORT => Command::ProfileReport,
            OP_MODEL => Command::Model(ModelCommand::decode(header[1], header[2], payload, bad)?),
            OP_EXIT => Command::Exit,
            op => return Err(bad(format!("unknown op {op}"))),
        })
    }
}

/// The chunks of a forward's payload (`n` of them).
fn decode_chunks(
    n: usize,
    payload: &[u32],
    bad: &dyn Fn(String) -> EngineError,
) -> Result<Vec<ChunkSpec>> {
    if n == 0 || payload.len() < 4 * n {
        return Err(bad(format!(
            "forward with {n} chunks and a payload of {} words",
            payload.len()
        )));
    }
    let (specs, mut rest) = payload.split_at(4 * n);
    let mut chunks = Vec::with_capacity(n);
    for s in specs.chunks_exact(4) {
        let len = s[1] as usize;
        let (k, lse) = (s[2] >> 2, s[2] & 2 != 0);
        if len == 0 || len > rest.len() || k as usize > MAX_CANDIDATES || (k == 0 && lse) {
            return Err(bad(format!("forward chunk {s:?} does not fit the payload")));
        }
        let (mine, tail) = rest.split_at(len);
        chunks.push(ChunkSpec {
            slot: s[0],
            tokens: mine.to_vec(),
            all_logits: s[2] & 1 == 1,
            need: if k == 0 {
                RowNeed::Full
            } else {
                RowNeed::Candidates { k, lse }
            },
            blocks: Vec::new(),
        });
        rest = tail;
    }
    for (c, s) in chunks.iter_mut().zip(specs.chunks_exact(4)) {
        let k = s[3] as usize;
        if k > rest.len() {
            return Err(bad(format!("forward chunk {s:?} does not fit the payload")));
        }
        let (mine, tail) = rest.split_at(k);
        c.blocks = mine.to_vec();
        rest = tail;
    }
    if !rest.is_empty() {
        return Err(bad(format!("{} payload words left over", rest.len())));
    }
    Ok(chunks)
}

/// How commands travel from the leader to the followers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// One broadcast over the world: every rank takes each command at once.
    Broadcast,
    /// A send from rank 0 to each follower: the leader never waits for a follower to take a
    /// command, so a follower busy with a launched forward (an earlier pipeline stage) may
    /// lag behind while the leader goes on (the sends are buffered).
    PointToPoint,
}

/// Leader: sends `cmd` to every follower.
pub fn send(group: &Group, cmd: &Command, transport: Transport) -> Result<()> {
    if group.size() == 1 {
        return Ok(());
    }
    let (mut header, mut payload) = cmd.encode();
    match transport {
        Transport::Broadcast => {
            group.broadcast(&mut header, 0)?;
            if !payload.is_empty() {
                group.broadcast(&mut payload, 0)?;
            }
        }
        Transport::PointToPoint => {
            for rank in 1..group.size() {
                group.send(&header, rank, COMMAND_TAG)?;
                if !payload.is_empty() {
                    group.send(&payload, rank, COMMAND_TAG)?;
                }
            }
        }
    }
    Ok(())
}

/// Follower: the next command from the leader.
pub fn receive(group: &Group, transport: Transport) -> Result<Command> {
    let mut header = [0u32; 4];
    match transport {
        Transport::Broadcast => group.broadcast(&mut header, 0)?,
        Transport::PointToPoint => group.recv(&mut header, 0, COMMAND_TAG)?,
    }
    let len = header[3] as usize;
    if len > MAX_PAYLOAD {
        return Err(EngineError::Protocol {
            rank: group.rank(),
            message: format!("payload of {len} words exceeds {MAX_PAYLOAD}"),
        });
    }
    let mut payload = vec![0u32; len];
    if len > 0 {
        match transport {
            Transport::Broadcast => group.broadcast(&mut payload, 0)?,
            Transport::PointToPoint => group.recv(&mut payload, 0, COMMAND_TAG)?,
        }
    }
    Command::decode(header, &payload, group.rank())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_round_trip() {
        let cmds = [
            Command::Open {
                slot: 3,
                capacity: 100,
            },
            Command::Close { slot: 3 },
            Command::Truncate { slot: 1, len: 7 },
            Command::Fork {
                dst: 4,
                src: 1,
                len: 40,
                capacity: 90,
            },
            Command::Forward(vec![
                ChunkSpec {
                    slot: 0,
                    tokens: vec![5, 6, 7],
                    all_logits: false,
                    need: RowNeed::Candidates { k: 40, lse: true },
                    blocks: vec![3, 8],
                },
                ChunkSpec {
                    slot: 9,
                    tokens: vec![1],
                    all_logits: true,
                    need: RowNeed::Full,
                    blocks: vec![],
                },
            ]),
            Command::Launch(vec![ChunkSpec::new(2, vec![4, 5])]),
            Command::Land,
            Command::Idle,
            Command::ProfileStart { barriers: true },
            Command::ProfileReport,
            Command::Model(ModelCommand::Load {
                id: 2,
                path: "ckpt/step-00000300".into(),
            }),
            Command::Model(ModelCommand::Select { id: 2 }),
            Command::Exit,
        ];
        for c in cmds {
            let (h, p) = c.encode();
            assert_eq!(Command::decode(h, &p, 1).unwrap(), c);
        }
    }

    #[test]
    fn malformed_commands_are_errors() {
        assert!(Command::decode([99, 0, 0, 0], &[], 1).is_err());
        assert!(Command::decode([OP_FORWARD, 0, 0, 0], &[], 1).is_err());
        // A chunk claiming more tokens, or more blocks, than the payload has.
        assert!(Command::decode([OP_FORWARD, 1, 0, 5], &[0, 5, 0, 0, 1], 1).is_err());
        assert!(Command::decode([OP_FORWARD, 1, 0, 5], &[0, 1, 0, 2, 1], 1).is_err());
        // Leftover words.
        assert!(Command::decode([OP_FORWARD, 1, 0, 6], &[0, 1, 0, 0, 1, 2], 1).is_err());
        // Zero-length chunk and more candidates than allowed.
        assert!(Command::decode([OP_FORWARD, 1, 0, 5], &[0, 0, 0, 0, 1], 1).is_err());
        let many = (MAX_CANDIDATES as u32 + 1) << 2;
        assert!(Command::decode([OP_FORWARD, 1, 0, 5], &[0, 1, many, 0, 1], 1).is_err());
        assert!(Command::decode([OP_FORWARD, 1, 0, 5], &[0, 1, many - 4, 0, 1], 1).is_ok());
        // A normalizer without candidates.
        assert!(Command::decode([OP_FORWARD, 1, 0, 5], &[0, 1, 2, 0, 1], 1).is_err());
        // A fork without its two payload words.
        assert!(Command::decode([OP_FORK, 1, 0, 1], &[3], 1).is_err());
    }
}
