//! tp-comm: the collectives layer every parallel layer stands on.
//!
//! A [`Communicator`] is one rank's handle on a group of ranks. Every call returns a
//! [`Result`]: deadlines, lost peers and mismatched calls are errors, never hangs.
//! Backends: [`local`] (rank threads in one process, shared memory; the default) and
//! `mpi` (behind the `mpi` cargo feature; ranks as processes under `mpirun`).

pub mod communicator;
pub mod conformance;
pub mod dtype;
pub mod error;
pub mod fault;
pub mod flight;
pub mod local;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod reduce;

pub use communicator::{CommExt, Communicator, Group};
pub use dtype::{DType, Elem, ReduceOp};
pub use error::{CommError, Departure, Fingerprint, OpKind, Result};

pub use mesh::{MeshCoords, ParallelDims, ProcessGroups};
