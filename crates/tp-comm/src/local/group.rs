//! Shared state of one local group: the barrier, each rank's slot (fingerprint, published
//! buffer pointer, small-message scratch) and the point-to-point mailboxes.
//!
//! Protocol (see `ops.rs`): a rank writes only its own slot before the barrier and reads the
//! others' after it; the barrier's acquire/release orders those accesses. Slots are double
//! buffered by the parity of the call's sequence number, so small calls need one barrier.

use super::barrier::PoisonBarrier;
use super::world::WorldShared;
use crate::dtype::DType;
use crate::error::{Fingerprint, OpKind};
use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Calls of at most this many bytes per rank go through the scratch buffers (one barrier);
/// larger ones read and write the ranks' own buffers directly (two barriers, no extra copy).
pub(crate) const SMALL_BYTES: usize = 64 * 1024;

pub(crate) struct Slot {
    /// seq + 1 of the newest call this rank has entered (for naming missing ranks).
    pub entered: AtomicU64,
    fp: [[AtomicU64; 4]; 2],
    pub ptr: [AtomicUsize; 2],
    scratch: [UnsafeCell<Box<[u64]>>; 2],
}

// SAFETY: `scratch` is written only by the slot's owner before a barrier and read by others
// only after it (see module docs); everything else is atomic.
unsafe impl Sync for Slot {}

impl Slot {
    fn new() -> Self {
        let words = SMALL_BYTES / 8;
        Slot {
            entered: AtomicU64::new(0),
            fp: Default::default(),
            ptr: Default::default(),
            scratch: [
                UnsafeCell::new(vec![0u64; words].into_boxed_slice()),
                UnsafeCell::new(vec![0u64; words].into_boxed_slice()),
            ],
        }
    }

    pub fn write_fp(&self, parity: usize, fp: &Fingerprint) {
        let w = &self.fp[parity];
        w[0].store(
            u64::from(fp.op.code()) | u64::from(fp.dtype.code()) << 8,
            Ordering::Relaxed,
        );
        w[1].store(fp.seq, Ordering::Relaxed);
        w[2].store(fp.count, Ordering::Relaxed);
        w[3].store(fp.detail, Ordering::Relaxed);
    }

    /// The fingerprint this slot's owner published for `parity`; `None` if garbled.
    pub fn read_fp(&self, parity: usize) -> Option<Fingerprint> {
        let w = &self.fp[parity];
        let w0 = w[0].load(Ordering::Relaxed);
        Some(Fingerprint {
            op: OpKind::from_code((w0 & 0xff) as u8)?,
            dtype: DType::from_code((w0 >> 8 & 0xff) as u8)?,
            seq: w[1].load(Ordering::Relaxed),
            count: w[2].load(Ordering::Relaxed),
            detail: w[3].load(Ordering::Relaxed),
        })
    }

    /// Owner only, before the barrier: copies `data` (at most SMALL_BYTES) into its scratch.
    ///
    /// # Safety
    /// Only the owner calls this, and only between two barriers that other ranks' reads of
    /// the same parity are ordered against.
    pub unsafe fn fill_scratch(&self, parity: usize, data: &[u8]) {
        let dst = (*self.scratch[parity].get()).as_mut_ptr() as *mut u8;
        std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len());
    }

    /// Start of this slot's scratch for `parity`.
    pub fn scratch_ptr(&self, parity: usize) -> *const u8 {
        // SAFETY: reading the box's pointer never races: the box itself is never replaced.
        unsafe { (*self.scratch[parity].get()).as_ptr() as *const u8 }
    }
}

/// A point-to-point message in flight.
pub(crate) struct Message {
    pub tag: u32,
    pub dtype: DType,
    pub seq: u64,
    pub data: Vec<u8>,
}

pub(crate) struct GroupShared {
    pub id: u64,
    pub world: Arc<WorldShared>,
    /// World rank of each group rank.
    pub members: Vec<usize>,
    pub barrier: PoisonBarrier,
    pub slots: Vec<Slot>,
    /// Index `src * n + dst`.
    pub mailboxes: Vec<Mutex<VecDeque<Message>>>,
}

impl GroupShared {
    pub fn new(world: Arc<WorldShared>, members: Vec<usize>) -> Arc<Self> {
        let n = members.len();
        Arc::new(GroupShared {
            id: world.next_group_id.fetch_add(1, Ordering::Relaxed),
            barrier: PoisonBarrier::new(n),
            slots: (0..n).map(|_| Slot::new()).collect(),
            mailboxes: (0..n * n).map(|_| Mutex::new(VecDeque::new())).collect(),
            members,
            world,
        })
    }

    pub fn size(&self) -> usize {
        self.members.len()
    }
}
