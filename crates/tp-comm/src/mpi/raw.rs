//! Thin, checked wrappers over the raw MPI FFI: the process-wide MPI lock, handle newtypes,
//! dtype/op mapping, return-code checks and owned scratch buffers.

use crate::dtype::{DType, ReduceOp};
use crate::error::{CommError, Result};
use mpi::ffi;
use std::os::raw::c_int;
use std::sync::{Mutex, MutexGuard};

/// Every MPI call of this crate holds this lock: MPI is initialized with
/// `MPI_THREAD_SERIALIZED`, and `Group` handles are `Send + Sync`.
static MPI_LOCK: Mutex<()> = Mutex::new(());

pub(crate) fn lock() -> MutexGuard<'static, ()> {
    MPI_LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Tries the lock for a while (the panic hook must never deadlock on it).
pub(crate) fn try_lock_for(d: std::time::Duration) -> Option<MutexGuard<'static, ()>> {
    let end = std::time::Instant::now() + d;
    loop {
        match MPI_LOCK.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {
                if std::time::Instant::now() >= end {
                    return None;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
}

/// An MPI communicator handle that may cross threads (every use holds [`lock`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Comm(pub ffi::MPI_Comm);
// SAFETY: the handle is an opaque pointer owned by the MPI library; all calls using it are
// serialized by `MPI_LOCK`, as MPI_THREAD_SERIALIZED requires.
unsafe impl Send for Comm {}
// SAFETY: as above.
unsafe impl Sync for Comm {}

pub(crate) fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading an immutable handle constant exported by the MPI shim.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// Turns an MPI return code into a `CommError::Backend`.
pub(crate) fn check(rc: c_int, what: &str) -> Result<()> {
    if rc == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(CommError::Backend(format!(
            "{what} failed with MPI error code {rc}"
        )))
    }
}

pub(crate) fn empty_status() -> ffi::MPI_Status {
    ffi::MPI_Status {
        MPI_SOURCE: 0,
        MPI_TAG: 0,
        MPI_ERROR: 0,
        _cancelled: 0,
        _ucount: 0,
    }
}

/// The MPI datatype carrying `dtype` on the wire (halves travel as f32 when reduced).
pub(crate) fn datatype(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading immutable datatype handle constants exported by the MPI shim.
    unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::U8 => ffi::RSMPI_UINT8_T,
            DType::U32 => ffi::RSMPI_UINT32_T,
            DType::U64 => ffi::RSMPI_UINT64_T,
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
        }
    }
}

pub(crate) fn byte_type() -> ffi::MPI_Datatype {
    // SAFETY: reading an immutable datatype handle constant.
    unsafe { ffi::RSMPI_UINT8_T }
}

/// Posts a non-blocking receive of `len` bytes at `ptr` from group rank `peer` with `tag`.
///
/// # Safety
/// `ptr..ptr + len` must stay valid and untouched by others until `req` completes (or be
/// leaked with it); the caller holds the MPI lock.
pub(crate) unsafe fn irecv_bytes(
    ptr: *mut u8,
    len: c_int,
    peer: usize,
    tag: c_int,
    comm: ffi::MPI_Comm,
    req: &mut ffi::MPI_Request,
) -> Result<()> {
    // SAFETY: the caller's contract above.
    let rc = unsafe { ffi::MPI_Irecv(ptr.cast(), len, byte_type(), peer as c_int, tag, comm, req) };
    check(rc, "MPI_Irecv")
}

/// Posts a non-blocking send of the `len` bytes at `ptr` to group rank `peer` with `tag`.
///
/// # Safety
/// `ptr..ptr + len` must stay valid and unwritten until `req` completes (or be leaked with
/// it); the caller holds the MPI lock.
pub(crate) unsafe fn isend_bytes(
    ptr: *const u8,
    len: c_int,
    peer: usize,
    tag: c_int,
    comm: ffi::MPI_Comm,
    req: &mut ffi::MPI_Request,
) -> Result<()> {
    // SAFETY: the caller's contract above.
    let rc = unsafe { ffi::MPI_Isend(ptr.cast(), len, byte_type(), peer as c_int, tag, comm, req) };
    check(rc, "MPI_Isend")
}

pub(crate) fn op(op: ReduceOp) -> ffi::MPI_Op {
    // SAFETY: reading immutable op handle constants exported by the MPI shim.
    unsafe {
        match op {
            ReduceOp::Sum => ffi::RSMPI_SUM,
            ReduceOp::Max => ffi::RSMPI_MAX,
            ReduceOp::Min => ffi::RSMPI_MIN,
        }
    }
}

/// A count that fits MPI's `int`, or InvalidArgument.
pub(crate) fn int_count(world_rank: usize, n: usize, what: &str) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| CommError::InvalidArgument {
        rank: world_rank,
        message: format!(
            "{what} is {n} elements, above MPI's limit of {} per call; split the call",
            c_int::MAX
        ),
    })
}

/// A byte buffer owned by the communicator, 8-byte aligned so it can be viewed as f32.
#[derive(Debug, Default)]
pub(crate) struct Scratch(Vec<u64>);

impl Scratch {
    /// The first `len` bytes, growing the buffer if needed (contents unspecified).
    pub fn bytes(&mut self, len: usize) -> &mut [u8] {
        let words = len.div_ceil(8);
        if self.0.len() < words {
            self.0.resize(words, 0);
        }
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.0)[..len]
    }

    /// Gives up the buffer without freeing it: MPI may still write into it (after a timeout).
    pub fn leak(&mut self) {
        std::mem::forget(std::mem::take(&mut self.0));
    }
}
