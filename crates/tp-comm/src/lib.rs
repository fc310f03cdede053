//! tp-comm: the collectives layer every parallel layer stands on.
//!
//! A [`Communicator`] is one rank's handle on a group of ranks. Every call returns a
//! [`Result`]: deadlines, lost peers and mismatched calls are errors, never hangs.
//! Backends: [`local`] (rank threads in one process, shared memory; the default) and
//! `mpi` (behind the `mpi` cargo feature; ranks as processes under `mpirun`).
//!
//! ```
//! use tp_comm::{local, CommExt, ParallelDims, ProcessGroups, ReduceOp};
//!
//! let results = local::run(4, local::LocalOptions::default(), |world| {
//!     let groups = ProcessGroups::new(world, ParallelDims { tp: 2, pp: 2, dp: 1 })?;
//!     let mut partial = vec![groups.coords.tp_rank as f32; 1024];
//!     groups.tp.all_reduce(&mut partial, ReduceOp::Sum)?; // g: sum the tp partial results
//!     Ok::<_, tp_comm::CommError>(partial[0])
//! })?;
//! for r in results {
//!     assert_eq!(r.unwrap()?, 1.0); // tp ranks 0 and 1 summed
//! }
//! # Ok::<(), tp_comm::CommError>(())
//! ```

pub mod bench;
pub mod bench_report;
pub mod build;
pub mod communicator;
pub mod conformance;
pub mod dtype;
pub mod error;
pub mod fault;
pub mod flight;
pub mod intercept;
pub mod launch;
pub mod link;
pub mod local;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod reduce;

pub use communicator::{CommExt, Communicator, Group};
pub use dtype::{DType, Elem, ReduceOp};
pub use error::{CommError, Departure, Fingerprint, OpKind, Result};
pub use intercept::Intercept;

pub use mesh::{MeshCoords, ParallelDims, ProcessGroups};
