//! Typed errors of the collectives layer, and the fingerprint each collective call carries.
//!
//! docs/reliability.md R1-R3: a lost rank, a mismatched call and a missed deadline are each an
//! error that names the op and its sequence number, with the flight record of recent calls.

use crate::dtype::DType;
use std::time::Duration;

pub type Result<T> = std::result::Result<T, CommError>;

/// `e` and its causes joined by ": ", each text once (a cause whose text the line already
/// holds, as a message that quotes its cause, is skipped).
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut line = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !text.is_empty() && !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        next = cause.source();
    }
    line
}

/// Which collective (or point-to-point) operation a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Barrier,
    Send,
    Recv,
    Split,
    /// Appended last: codes of the others stay as they were on the wire.
    AllToAll,
}

impl OpKind {
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Broadcast => "broadcast",
            OpKind::Barrier => "barrier",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Split => "split",
            OpKind::AllToAll => "all_to_all",
        }
    }
    pub fn code(self) -> u8 {
        self as u8 + 1
    }
    pub fn from_code(code: u8) -> Option<OpKind> {
        use OpKind::*;
        [
            AllReduce,
            AllGather,
            ReduceScatter,
            Broadcast,
            Barrier,
            Send,
            Recv,
            Split,
            AllToAll,
        ]
        .get(usize::from(code).checked_sub(1)?)
        .copied()
    }
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a rank says about one collective call; all ranks of a group must agree on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    pub op: OpKind,
    /// The call's sequence number within its group (0-based, counted per group).
    pub seq: u64,
    pub dtype: DType,
    /// Elements this rank contributes (all_gather, reduce_scatter: the whole buffer;
    /// all_to_all: 0, its per-pair counts are checked on their own, see
    /// [`CommError::CountsMismatch`]).
    pub count: u64,
    /// Op-specific detail that must match: reduce op, root, or a hash of the counts.
    pub detail: u64,
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} #{} dtype={} count={} detail={:#x}",
            self.op, self.seq, self.dtype, self.count, self.detail
        )
    }
}

/// Why a rank left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Departure {
    /// The rank's code panicked; the message is the panic payload.
    Panicked(String),
    /// The rank's code returned (normally or with an error) while others still needed it.
    Exited(String),
}

impl std::fmt::Display for Departure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Departure::Panicked(m) => write!(f, "panicked: {m}"),
            Departure::Exited(m) => write!(f, "exited: {m}"),
        }
    }
}

/// An error from a collective. `flight_record` holds each rank's last calls where the backend
/// can see them (all ranks for `local`, this process for `mpi`).
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error(
        "rank {lost_rank} is gone ({why}) while rank {rank} waited in {op} #{seq} of a \
         {group_size}-rank group; the job cannot continue: fix the failing rank and rerun"
    )]
    PeerLost {
        rank: usize,
        lost_rank: usize,
        why: Departure,
        op: OpKind,
        seq: u64,
        group_size: usize,
        flight_record: String,
    },
    #[error(
        "collective mismatch (desync) in a {group_size}-rank group: rank {rank} called [{mine}] \
         but rank {other_rank} called [{theirs}]; every rank of a group must issue the same \
         collectives in the same order with the same dtype and length"
    )]
    Mismatch {
        rank: usize,
        other_rank: usize,
        mine: Fingerprint,
        theirs: Fingerprint,
        group_size: usize,
        flight_record: String,
    },
    #[error(
        "counts disagree (desync) in {op} #{seq} of a {group_size}-rank group: rank {sender} \
         sends {sent} elements to rank {receiver}, which expects {expected} from it (seen on \
         rank {rank}); every rank's send count for rank j must equal rank j's receive count \
         for it"
    )]
    CountsMismatch {
        rank: usize,
        op: OpKind,
        seq: u64,
        /// World ranks of the pair that disagrees.
        sender: usize,
        receiver: usize,
        /// Elements the sender's counts send, and the receiver's counts expect.
        sent: usize,
        expected: usize,
        group_size: usize,
        flight_record: String,
    },
    #[error(
        "rank {rank} timed out after {waited:?} in {op} #{seq} of a {group_size}-rank group, \
         still waiting for ranks {missing:?}; raise the collective deadline if they are just slow"
    )]
    Timeout {
        rank: usize,
        op: OpKind,
        seq: u64,
        waited: Duration,
        missing: Vec<usize>,
        group_size: usize,
        flight_record: String,
    },
    #[error(
        "this group is unusable after an earlier failure ({cause}); rank {rank} refused {op} #{seq}"
    )]
    Poisoned {
        rank: usize,
        op: OpKind,
        seq: u64,
        cause: String,
        flight_record: String,
    },
    #[error("invalid collective call on rank {rank}: {message}")]
    InvalidArgument { rank: usize, message: String },
    #[error("fault injected on rank {rank} at {op} #{seq}: {what}")]
    Injected {
        rank: usize,
        op: OpKind,
        seq: u64,
        what: String,
    },
    #[error(
        "{differing} of {world} ranks run another build than rank 0 ({details}); every host \
         must run the same build of the program: copy rank 0's to the others"
    )]
    BuildMismatch {
        differing: usize,
        world: usize,
        /// Rank 0's and each differing rank's host and fingerprint.
        details: String,
    },
    #[error("MPI error: {0}")]
    Backend(String),
}

impl CommError {
    /// The recent collectives of each rank, printed after a failure (R3's flight record).
    pub fn flight_record(&self) -> Option<&str> {
        match self {
            CommError::PeerLost { flight_record, .. }
            | CommError::Mismatch { flight_record, .. }
            | CommError::CountsMismatch { flight_record, .. }
            | CommError::Timeout { flight_record, .. }
            | CommError::Poisoned { flight_record, .. } => Some(flight_record.as_str()),
            _ => None,
        }
    }
}
