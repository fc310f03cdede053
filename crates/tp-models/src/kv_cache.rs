//! Paged KV cache of this rank's KV heads (docs/design.md "One forward pass"; vLLM's paged
//! attention, on CPU): a [`KvPool`] of blocks of [`BLOCK_POSITIONS`] positions, and per
//! sequence a [`BlockTable`] naming its blocks in position order.
//!
//! A block holds every layer's keys and values for its positions, `[layers, 2, kv_heads,
//! BLOCK_POSITIONS, head_dim]` (one head's positions contiguous), in anonymous memory of its
//! own that is returned to the system the moment the block is freed: memory follows the
//! tokens held, never the context length. Blocks are reference counted: sequences that begin
//! alike share the blocks of their common prefix ([`KvPool::fork`]), and a sequence about to
//! write into a shared block gets its own copy first (copy-on-write, in [`KvPool::grow`]).
//!
//! Values are rounded to the cache's dtype when written and widened to f32 when read:
//! attention does the same arithmetic in the same order whatever the dtype or the block ids,
//! so an f32 cache gives exactly the bits of a contiguous one.

use crate::error::{ModelError, Result};
use half::{bf16, f16, slice::HalfFloatSliceExt};
use memmap2::MmapMut;
use std::collections::BTreeSet;

/// Positions per block.
pub const BLOCK_POSITIONS: usize = 32;

/// A block's index in its pool; the same on every rank (rank 0 chooses them).
pub type BlockId = u32;

/// Block ids a pool accepts (bounds memory on a corrupted command): 2^20.
pub const MAX_BLOCKS: usize = 1 << 20;

/// Values sharing one scale in the q8 cache (or the whole head when `head_dim` is not a
/// multiple of it).
const Q8_GROUP: usize = 32;

/// How cached keys and values are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 4 bytes a value: exactly what the projections produced.
    #[default]
    F32,
    /// 2 bytes a value, 10-bit mantissa: keys and values are O(1..100), well inside its range.
    F16,
    /// 2 bytes a value, f32's range with an 8-bit mantissa.
    Bf16,
    /// q8_0-style: signed bytes with an f16 scale per 32 values of a head (1.0625 bytes a
    /// value for head dims that are multiples of 32).
    Q8,
}

impl KvDtype {
    /// Bytes of `head_dim` cached values (one head at one position), scales included.
    pub fn head_bytes(self, head_dim: usize) -> usize {
        match self {
            KvDtype::F32 => 4 * head_dim,
            KvDtype::F16 | KvDtype::Bf16 => 2 * head_dim,
            KvDtype::Q8 => head_dim + 2 * head_dim / q8_group(head_dim),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Q8 => "q8",
        }
    }

    /// Every dtype, in the order their names are listed to users.
    pub const ALL: [KvDtype; 4] = [KvDtype::F16, KvDtype::Bf16, KvDtype::F32, KvDtype::Q8];
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        KvDtype::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| ModelError::UnknownKvDtype(s.to_string()))
    }
}

/// Values per q8 scale for heads of `head_dim`.
fn q8_group(head_dim: usize) -> usize {
    if head_dim.is_multiple_of(Q8_GROUP) {
        Q8_GROUP
    } else {
        head_dim.max(1)
    }
}

/// Element types a block's bytes are viewed as: plain data, every bit pattern valid.
trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for f16 {}
impl Plain for bf16 {}
impl Plain for i8 {}

/// One block's storage in anonymous memory of its own (page aligned, zeroed).
struct Block {
    map: MmapMut,
}

impl Block {
    fn new(bytes: usize) -> Result<Block> {
        let map =
            MmapMut::map_anon(bytes).map_err(|source| ModelError::KvMemory { bytes, source })?;
        Ok(Block { map })
    }

    /// `n` elements of `T` starting `at` elements of `T` into the block.
    fn view<T: Plain>(&self, at: usize, n: usize) -> &[T] {
        let size = std::mem::size_of::<T>();
        assert!(
            (at + n) * size <= self.map.len(),
            "KV block read out of bounds"
        );
        // SAFETY: the mapping is page aligned (so aligned for T), the range is inside it (just
        // checked), and T is plain data for which every bit pattern is a valid value.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().cast::<T>().add(at), n) }
    }

    fn view_mut<T: Plain>(&mut self, at: usize, n: usize) -> &mut [T] {
        let size = std::mem::size_of::<T>();
        assert!(
            (at + n) * size <= self.map.len(),
            "KV block write out of bounds"
        );
        // SAFETY: as in `view`; the exclusive borrow of the mapping makes the slice unique.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().cast::<T>().add(at), n) }
    }
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Block({} bytes)", self.map.len())
    }
}

/// The blocks of one sequence in position order, the positions written and the most it may
/// hold. Only a [`KvPool`] changes its blocks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
    len: usize,
    capacity: usize,
}

impl BlockTable {
    /// An empty table for at most `capacity` positions.
    pub fn new(capacity: usize) -> Self {
        BlockTable {
            blocks: Vec::new(),
            len: 0,
            capacity,
        }
    }

    /// Positions already cached (the next token's position).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Block ids, position order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Errors unless `n` more positions fit.
    pub fn check_room(&self, n: usize) -> Result<()> {
        if self.len + n > self.capacity {
            return Err(ModelError::ContextFull {
                pos: self.len,
                len: n,
                cap: self.capacity,
            });
        }
        Ok(())
    }

    /// Advances past `n` positions written in every layer (whose blocks
    /// [`KvPool::grow`] gave it).
    pub fn advance(&mut self, n: usize) {
        debug_assert!(self.len + n <= self.blocks.len() * BLOCK_POSITIONS);
        self.len += n;
    }
}

/// Every block of one rank: storage by id, reference counts, the free ids and the most blocks
/// that may be in use at once.
#[derive(Debug)]
pub struct KvPool {
    dtype: KvDtype,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    /// By id: the storage of blocks in use (none for a pool that only counts).
    storage: Vec<Option<Block>>,
    /// By id: tables referring to the block (0: free).
    refs: Vec<u32>,
    /// Free ids below `refs.len()`; ids from `refs.len()` up were never used.
    free: BTreeSet<BlockId>,
    in_use: usize,
    limit: usize,
}

impl KvPool {
    /// An empty pool for `layers` layers of `kv_heads` heads of `head_dim`; no limit but
    /// [`MAX_BLOCKS`] until [`KvPool::set_limit`].
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize, dtype: KvDtype) -> Self {
        KvPool {
            dtype,
            layers,
            kv_heads,
            head_dim,
            storage: Vec::new(),
            refs: Vec::new(),
            free: BTreeSet::new(),
            in_use: 0,
            limit: MAX_BLOCKS,
        }
    }

    /// A pool that keeps the books (ids, references, limit) but stores nothing: for
    /// schedulers tested without a model.
    pub fn accounting_only() -> Self {
        KvPool::new(0, 0, 0, KvDtype::F32)
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Most blocks in use at once (at most [`MAX_BLOCKS`]).
    pub fn set_limit(&mut self, blocks: usize) {
        self.limit = blocks.min(MAX_BLOCKS);
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Blocks referred to by some table.
    pub fn in_use(&self) -> usize {
        self.in_use
    }

    /// Blocks that may still be taken.
    pub fn free_blocks(&self) -> usize {
        self.limit.saturating_sub(self.in_use)
    }

    /// Tables referring to block `id`.
    pub fn refs(&self, id: BlockId) -> u32 {
        self.refs.get(id as usize).copied().unwrap_or(0)
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        Self::bytes_per_block(self.layers, self.kv_heads, self.head_dim, self.dtype)
    }

    /// Bytes of one block of `layers` layers of `kv_heads` heads of `head_dim`.
    pub fn bytes_per_block(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> usize {
        layers * 2 * kv_heads * BLOCK_POSITIONS * dtype.head_bytes(head_dim)
    }

    /// Bytes held now (whole blocks).
    pub fn bytes(&self) -> usize {
        self.in_use * self.block_bytes()
    }

    /// Bytes of the blocks of `positions` positions of one sequence on a rank with
    /// `kv_heads` heads of `head_dim` (whole blocks; `None` past 2^128).
    pub fn checked_bytes_for(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        positions: usize,
        dtype: KvDtype,
    ) -> Option<u128> {
        let blocks = positions.div_ceil(BLOCK_POSITIONS) as u64;
        crate::limits::product(&[
            layers as u64,
            2,
            kv_heads as u64,
            blocks,
            BLOCK_POSITIONS as u64,
            dtype.head_bytes(head_dim) as u64,
        ])
    }

    /// [`KvPool::checked_bytes_for`], saturating at `usize::MAX`.
    pub fn bytes_for(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        positions: usize,
        dtype: KvDtype,
    ) -> usize {
        Self::checked_bytes_for(layers, kv_heads, head_dim, positions, dtype)
            .and_then(|b| usize::try_from(b).ok())
            .unwrap_or(usize::MAX)
    }

    /// Blocks `table` must take before `n` more positions are written: new blocks past its
    /// last, and a copy of its last block when that is shared and partly written.
    pub fn blocks_needed(&self, table: &BlockTable, n: usize) -> usize {
        self.blocks_needed_all(&[(table, n)])[0]
    }

    /// [`KvPool::blocks_needed`] of each `(table, n)` when they grow in this order: a table
    /// that copies a shared block leaves one reference fewer to it, so a later table may not
    /// need a copy of its own.
    pub fn blocks_needed_all(&self, growth: &[(&BlockTable, usize)]) -> Vec<usize> {
        let mut copied: Vec<BlockId> = Vec::new();
        growth
            .iter()
            .map(|&(table, n)| {
                if n == 0 {
                    return 0;
                }
                let new = (table.len + n)
                    .div_ceil(BLOCK_POSITIONS)
                    .saturating_sub(table.blocks.len());
                let copy = self.shared_tail(table).is_some_and(|id| {
                    let left = self.refs(id) as usize - copied.iter().filter(|&&c| c == id).count();
                    let copy = left > 1;
                    if copy {
                        copied.push(id);
                    }
                    copy
                });
                new + usize::from(copy)
            })
            .collect()
    }

    /// The block holding position `len`, when it is partly written (so writing there would
    /// change it) and shared.
    fn shared_tail(&self, table: &BlockTable) -> Option<BlockId> {
        if table.len.is_multiple_of(BLOCK_POSITIONS) {
            return None;
        }
        let id = *table.blocks.get(table.len / BLOCK_POSITIONS)?;
        (self.refs(id) > 1).then_some(id)
    }

    /// The `k` lowest free ids (what rank 0 hands out), within the limit.
    pub fn lowest_free(&self, k: usize) -> Result<Vec<BlockId>> {
        if self.in_use + k > self.limit {
            return Err(ModelError::OutOfBlocks {
                needed: k,
                free: self.free_blocks(),
                limit: self.limit,
            });
        }
        let mut ids: Vec<BlockId> = self.free.iter().take(k).copied().collect();
        let mut next = self.refs.len();
        while ids.len() < k {
            if next >= MAX_BLOCKS {
                return Err(ModelError::OutOfBlocks {
                    needed: k,
                    free: ids.len(),
                    limit: MAX_BLOCKS,
                });
            }
            ids.push(next as BlockId);
            next += 1;
        }
        Ok(ids)
    }

    /// Makes `table` ready for `n` more positions with the blocks `ids` (exactly
    /// [`KvPool::blocks_needed`] free ids: a copy of the shared last block first, when one is
    /// needed, then new blocks in position order). Invalid ids change nothing; when memory
    /// runs out the table keeps its positions and no new block.
    pub fn grow(&mut self, table: &mut BlockTable, n: usize, ids: &[BlockId]) -> Result<()> {
        table.check_room(n)?;
        let needed = self.blocks_needed(table, n);
        if ids.len() != needed {
            return Err(ModelError::BadBlocks(format!(
                "{} block ids given where {needed} are needed",
                ids.len()
            )));
        }
        for (i, &id) in ids.iter().enumerate() {
            if id as usize >= MAX_BLOCKS {
                return Err(ModelError::BadBlocks(format!(
                    "block id {id} is not below {MAX_BLOCKS}"
                )));
            }
            if self.refs(id) > 0 || ids[..i].contains(&id) {
                return Err(ModelError::BadBlocks(format!("block {id} is not free")));
            }
        }
        let mut ids = ids.iter().copied();
        if self.shared_tail(table).is_some() {
            let (Some(to), Some(&from)) = (ids.next(), table.blocks.last()) else {
                return Err(ModelError::BadBlocks("no block to copy".into()));
            };
            self.claim(to)?;
            self.copy_block(from, to);
            self.unref(from);
            if let Some(last) = table.blocks.last_mut() {
                *last = to;
            }
        }
        for id in ids {
            if let Err(e) = self.claim(id) {
                // Out of memory: give back the blocks taken so far (a copy made above keeps
                // the same positions).
                let len = table.len;
                self.truncate(table, len);
                return Err(e);
            }
            table.blocks.push(id);
        }
        Ok(())
    }

    /// [`KvPool::grow`] with the lowest free ids; returns them.
    pub fn reserve(&mut self, table: &mut BlockTable, n: usize) -> Result<Vec<BlockId>> {
        table.check_room(n)?;
        let ids = self.lowest_free(self.blocks_needed(table, n))?;
        self.grow(table, n, &ids)?;
        Ok(ids)
    }

    /// A table of at most `capacity` positions whose first `len` positions are `src`'s,
    /// sharing its blocks (no copy until one of them writes into a shared block).
    pub fn fork(&mut self, src: &BlockTable, len: usize, capacity: usize) -> Result<BlockTable> {
        if len > src.len || len > capacity {
            return Err(ModelError::BadBlocks(format!(
                "cannot share {len} positions of a sequence holding {} into one of capacity {capacity}",
                src.len
            )));
        }
        let blocks = src.blocks[..len.div_ceil(BLOCK_POSITIONS)].to_vec();
        for &id in &blocks {
            if let Some(r) = self.refs.get_mut(id as usize) {
                *r += 1;
            }
        }
        Ok(BlockTable {
            blocks,
            len,
            capacity,
        })
    }

    /// Keeps the first `len` positions of `table`, releasing the blocks past them.
    pub fn truncate(&mut self, table: &mut BlockTable, len: usize) {
        let keep = len.min(table.len);
        let blocks = keep.div_ceil(BLOCK_POSITIONS);
        for id in table.blocks.split_off(blocks.min(table.blocks.len())) {
            self.unref(id);
        }
        table.len = keep;
    }

    /// Empties `table`, releasing its blocks.
    pub fn release(&mut self, table: &mut BlockTable) {
        self.truncate(table, 0);
    }

    fn claim(&mut self, id: BlockId) -> Result<()> {
        let i = id as usize;
        // Memory first: a failed allocation leaves the books as they were.
        let bytes = self.block_bytes();
        let block = if bytes > 0 {
            Some(Block::new(bytes)?)
        } else {
            None
        };
        if i >= self.refs.len() {
            self.free.extend(self.refs.len() as BlockId..id);
            self.refs.resize(i + 1, 0);
            self.storage.resize_with(i + 1, || None);
        }
        self.storage[i] = block;
        self.free.remove(&id);
        self.refs[i] = 1;
        self.in_use += 1;
        Ok(())
    }

    fn unref(&mut self, id: BlockId) {
        let i = id as usize;
        let Some(r) = self.refs.get_mut(i) else {
            return;
        };
        *r = r.saturating_sub(1);
        if *r == 0 {
            self.storage[i] = None;
            self.free.insert(id);
            self.in_use -= 1;
        }
    }

    fn copy_block(&mut self, from: BlockId, to: BlockId) {
        let (f, t) = (from as usize, to as usize);
        if self.block_bytes() == 0 || f == t {
            return;
        }
        // Taken out for the copy, so source and destination are borrowed apart.
        let Some(mut dst) = self.storage.get_mut(t).and_then(Option::take) else {
            return;
        };
        if let Some(Some(src)) = self.storage.get(f) {
            dst.map.copy_from_slice(&src.map);
        }
        self.storage[t] = Some(dst);
    }

    /// Element index of (layer, k/v, head, position in block, 0) inside a block.
    fn at(&self, layer: usize, kv: usize, head: usize, p: usize) -> usize {
        (((layer * 2 + kv) * self.kv_heads + head) * BLOCK_POSITIONS + p) * self.head_dim
    }

    /// Writes `k`, `v` (`[n, kv_heads * head_dim]`) to `layer` at positions `table.len()..
    /// table.len() + n`, which [`KvPool::grow`] made room for. The caller advances the table
    /// once every layer has written.
    pub(crate) fn append(&mut self, table: &BlockTable, layer: usize, k: &[f32], v: &[f32]) {
        let (hd, dtype) = (self.head_dim, self.dtype);
        let scales = self.q8_scales_at();
        let w = self.kv_heads * hd;
        for (kv, rows) in [k, v].into_iter().enumerate() {
            for (i, row) in rows.chunks_exact(w.max(1)).enumerate() {
                let pos = table.len + i;
                let head0 = self.at(layer, kv, 0, pos % BLOCK_POSITIONS);
                let id = table.blocks[pos / BLOCK_POSITIONS] as usize;
                let Some(Some(block)) = self.storage.get_mut(id) else {
                    continue;
                };
                // Head h is BLOCK_POSITIONS * hd elements after head h - 1.
                for (h, src) in row.chunks_exact(hd).enumerate() {
                    let at = head0 + h * BLOCK_POSITIONS * hd;
                    put(block, dtype, hd, scales, at, src);
                }
            }
        }
    }

    /// Element index (of i8) where a q8 block's f16 scales begin, in f16 units.
    fn q8_scales_at(&self) -> usize {
        // The i8 values take layers * 2 * kv_heads * BLOCK_POSITIONS * head_dim bytes, an even
        // number (BLOCK_POSITIONS is), so the scales that follow are 2-byte aligned.
        (self.layers * 2 * self.kv_heads * BLOCK_POSITIONS * self.head_dim) / 2
    }

    /// Keys and values of `layer` of `table` (positions written so far and being written).
    pub fn layer<'a>(&'a self, table: &'a BlockTable, layer: usize) -> LayerKv<'a> {
        LayerKv {
            pool: self,
            table,
            layer,
        }
    }

    /// Head `head`'s vectors (`kv` 0: keys, 1: values) of positions `0..out.len() / head_dim`
    /// into `out [positions, head_dim]` as f32 (one widening per block run).
    fn gather(&self, table: &BlockTable, layer: usize, kv: usize, head: usize, out: &mut [f32]) {
        let hd = self.head_dim;
        let run = BLOCK_POSITIONS * hd;
        for (&id, dst) in table.blocks.iter().zip(out.chunks_mut(run)) {
            let Some(Some(block)) = self.storage.get(id as usize) else {
                continue;
            };
            let at = self.at(layer, kv, head, 0);
            match self.dtype {
                KvDtype::F32 => dst.copy_from_slice(block.view::<f32>(at, dst.len())),
                KvDtype::F16 => widen_f16(block.view::<f16>(at, dst.len()), dst),
                KvDtype::Bf16 => block.view::<bf16>(at, dst.len()).convert_to_f32_slice(dst),
                KvDtype::Q8 => {
                    let g = q8_group(hd);
                    let q = block.view::<i8>(at, dst.len());
                    let s = block.view::<f16>(self.q8_scales_at() + at / g, dst.len() / g);
                    for ((d, q), s) in dst.chunks_mut(g).zip(q.chunks(g)).zip(s) {
                        let s = s.to_f32();
                        for (d, &q) in d.iter_mut().zip(q) {
                            *d = f32::from(q) * s;
                        }
                    }
                }
            }
        }
    }
}

impl KvPool {
    /// See [`LayerKv::prefetch`]: per block, the `[2, kv_heads, BLOCK_POSITIONS, head_dim]`
    /// run of `layer` (keys then values of every head, contiguous; q8's scales are left out),
    /// the positions in use of each head only.
    fn prefetch(&self, table: &BlockTable, layer: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            let elem = match self.dtype {
                KvDtype::F32 => 4,
                KvDtype::F16 | KvDtype::Bf16 => 2,
                KvDtype::Q8 => 1,
            };
            let hd = self.head_dim;
            for (b, &id) in table.blocks.iter().enumerate() {
                let used = table
                    .len
                    .saturating_sub(b * BLOCK_POSITIONS)
                    .min(BLOCK_POSITIONS);
                let Some(Some(block)) = self.storage.get(id as usize) else {
                    continue;
                };
                if used == 0 {
                    break;
                }
                for kv in 0..2 {
                    for head in 0..self.kv_heads {
                        let at = self.at(layer, kv, head, 0) * elem;
                        let bytes = used * hd * elem;
                        for off in (0..bytes).step_by(64) {
                            let p = block.map.as_ptr().wrapping_add(at + off);
                            // SAFETY: a prefetch is only a hint (it never faults); `p` lies
                            // inside the block's mapping (`at + bytes` is within the layer's
                            // run).
                            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) };
                        }
                    }
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (table, layer);
    }
}

/// Writes one head's vector `src [head_dim]` at element `at` of `block`, rounding to `dtype`.
fn put(block: &mut Block, dtype: KvDtype, hd: usize, scales_at: usize, at: usize, src: &[f32]) {
    match dtype {
        KvDtype::F32 => block.view_mut::<f32>(at, hd).copy_from_slice(src),
        KvDtype::F16 => block.view_mut::<f16>(at, hd).convert_from_f32_slice(src),
        KvDtype::Bf16 => block.view_mut::<bf16>(at, hd).convert_from_f32_slice(src),
        KvDtype::Q8 => {
            let g = q8_group(hd);
            let mut scales = Vec::with_capacity(hd / g);
            let q = block.view_mut::<i8>(at, hd);
            for (q, x) in q.chunks_mut(g).zip(src.chunks(g)) {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = f16::from_f32(amax / 127.0);
                let inv = if d.to_f32() > 0.0 {
                    1.0 / d.to_f32()
                } else {
                    0.0
                };
                for (q, &x) in q.iter_mut().zip(x) {
                    *q = (x * inv).round().clamp(-127.0, 127.0) as i8;
                }
                scales.push(d);
            }
            block
                .view_mut::<f16>(scales_at + at / g, hd / g)
                .copy_from_slice(&scales);
        }
    }
}

/// One layer's keys and values of one sequence, `[positions, kv_heads, head_dim]` each, read
/// through its block table.
#[derive(Clone, Copy, Debug)]
pub struct LayerKv<'a> {
    pool: &'a KvPool,
    table: &'a BlockTable,
    layer: usize,
}

impl LayerKv<'_> {
    /// KV head `head`'s keys of positions `0..out.len() / head_dim` into `out [positions,
    /// head_dim]`, as f32 (the positions must have been written).
    pub fn keys(&self, head: usize, out: &mut [f32]) {
        self.pool.gather(self.table, self.layer, 0, head, out)
    }

    /// The same for values.
    pub fn values(&self, head: usize, out: &mut [f32]) {
        self.pool.gather(self.table, self.layer, 1, head, out)
    }

    /// Asks the CPU to bring this layer's keys and values of the positions written so far
    /// into its L2 cache (a hint: nothing is read, nothing can fault), so that a batched
    /// decode step fetches the next sequence's cache from memory while it computes this one's
    /// (L2, not L1: a sequence's layer is tens of KB). `tp bench serve`, c=16, alternated with
    /// the build before: tp 1 +9%, tp 2 +1% (medians of 4 rounds; a noisy VM).
    pub fn prefetch(&self) {
        self.pool.prefetch(self.table, self.layer)
    }
}

/// `src` as f32 into `dst` (the same length): eight at a time with F16C where the CPU has
/// it, else through the `half` crate. Widening is exact, so both give the same bits; the
/// `half` crate converts through a call per eight values, which decode paid for every
/// position of every layer.
fn widen_f16(src: &[f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX and F16C were detected just now.
        unsafe { widen_f16c(src, dst) };
        return;
    }
    src.convert_to_f32_slice(dst)
}

/// [`widen_f16`] on F16C.
///
/// # Safety
/// The CPU must have AVX and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn widen_f16c(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::{_mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n` elements of both slices; unaligned loads and stores.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast()); // 8 x f16
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h)); // 8 x f32
        }
        i += 8;
    }
    for (d, s) in dst[i..n].iter_mut().zip(&src[i..n]) {
        *d = s.to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fills `table` in `pool` (2 layers, 3 heads of `hd`) to `positions` in uneven chunks
    /// from `start`; the key at (position p, column c) is `sin(p * w + c)`, the value
    /// `3 key - 1`.
    fn fill(pool: &mut KvPool, table: &mut BlockTable, positions: usize, hd: usize) {
        let w = 3 * hd;
        for n in [1, 5, 31, 40, 3, 100] {
            let start = table.len();
            let n = n.min(positions - start);
            if n == 0 {
                break;
            }
            let k: Vec<f32> = (0..n * w).map(|i| ((start * w + i) as f32).sin()).collect();
            let v: Vec<f32> = k.iter().map(|x| x * 3.0 - 1.0).collect();
            pool.reserve(table, n).unwrap();
            for l in 0..2 {
                pool.append(table, l, &k, &v);
            }
            table.advance(n);
        }
    }

    #[test]
    fn widening_f16_gives_the_half_crates_bits_for_every_value() {
        // Every f16 bit pattern (NaNs, infinities, subnormals), in runs that leave tails.
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        for len in [all.len(), 13, 8, 7] {
            let src = &all[all.len() - len..];
            let mut got = vec![0f32; len];
            let mut want = vec![0f32; len];
            widen_f16(src, &mut got);
            src.convert_to_f32_slice(&mut want);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{len} values");
        }
    }

    fn tolerance(dtype: KvDtype) -> f32 {
        match dtype {
            KvDtype::F32 => 0.0,
            KvDtype::F16 => 1e-3,
            KvDtype::Bf16 => 8e-3,
            KvDtype::Q8 => 1e-2,
        }
    }

    /// Checks `table`'s first `n` positions against what [`fill`] wrote.
    fn check(pool: &KvPool, table: &BlockTable, n: usize, hd: usize) {
        let tol = tolerance(pool.dtype());
        for head in 0..3 {
            let (mut k, mut v) = (vec![0f32; n * hd], vec![0f32; n * hd]);
            pool.layer(table, 1).keys(head, &mut k);
            pool.layer(table, 0).values(head, &mut v);
            for p in 0..n {
                for d in 0..hd {
                    let want = ((p * 3 * hd + head * hd + d) as f32).sin();
                    let (gk, gv) = (k[p * hd + d], v[p * hd + d]);
                    assert!((gk - want).abs() <= tol, "{} key p {p}", pool.dtype());
                    let want = want * 3.0 - 1.0;
                    assert!(
                        (gv - want).abs() <= tol * 4.0,
                        "{} value p {p}",
                        pool.dtype()
                    );
                }
            }
        }
    }

    #[test]
    fn reads_back_what_was_written_across_blocks() {
        for hd in [4, 64] {
            for dtype in KvDtype::ALL {
                let mut pool = KvPool::new(2, 3, hd, dtype);
                let mut t = BlockTable::new(1000);
                fill(&mut pool, &mut t, 80, hd);
                assert_eq!(t.len(), 80);
                for n in [1, 32, 33, 80] {
                    check(&pool, &t, n, hd);
                }
            }
        }
    }

    #[test]
    fn memory_follows_the_tokens_held() {
        let hd = 8;
        for dtype in KvDtype::ALL {
            let mut pool = KvPool::new(2, 3, hd, dtype);
            let mut t = BlockTable::new(1000);
            fill(&mut pool, &mut t, 70, hd);
            // 70 positions = 3 blocks of 2 layers x (K, V) x 3 heads of 8.
            let block = 2 * 2 * 3 * BLOCK_POSITIONS * dtype.head_bytes(hd);
            assert_eq!((pool.in_use(), pool.bytes()), (3, 3 * block));
            assert_eq!(KvPool::bytes_for(2, 3, hd, 70, dtype), 3 * block);
            pool.truncate(&mut t, 32);
            assert_eq!((pool.bytes(), t.len()), (block, 32));
            pool.release(&mut t);
            assert_eq!((pool.bytes(), t.len(), pool.in_use()), (0, 0, 0));
        }
        assert_eq!(KvPool::bytes_for(30, 3, 64, 0, KvDtype::F16), 0);
        assert!(KvPool::checked_bytes_for(usize::MAX, usize::MAX, 64, 64, KvDtype::F32).is_none());
        // q8: one byte a value plus an f16 scale per 32.
        assert_eq!(KvDtype::Q8.head_bytes(64), 68);
    }

    #[test]
    fn a_truncated_table_is_rewritten_in_place() {
        let hd = 2;
        let mut pool = KvPool::new(2, 3, hd, KvDtype::F32);
        let mut t = BlockTable::new(1000);
        fill(&mut pool, &mut t, 40, hd);
        pool.truncate(&mut t, 33);
        let k = vec![7.0f32; 2 * 3 * hd];
        assert_eq!(pool.reserve(&mut t, 2).unwrap(), Vec::<BlockId>::new());
        for l in 0..2 {
            pool.append(&t, l, &k, &k);
        }
        t.advance(2);
        let mut keys = vec![0f32; 35 * hd];
        pool.layer(&t, 0).keys(1, &mut keys);
        assert_eq!(&keys[33 * hd..], &[7.0; 4]);
        assert_eq!(keys[32 * hd], ((32 * 3 * hd + hd) as f32).sin());
    }

    #[test]
    fn forks_share_blocks_and_copy_before_writing_a_shared_one() {
        let hd = 4;
        let mut pool = KvPool::new(2, 3, hd, KvDtype::F32);
        let mut a = BlockTable::new(1000);
        fill(&mut pool, &mut a, 70, hd);
        assert_eq!(pool.in_use(), 3);
        // b shares a's first 40 positions: blocks 0 and 1 (the second partly).
        let mut b = pool.fork(&a, 40, 100).unwrap();
        assert_eq!((b.len(), b.blocks()), (40, &a.blocks()[..2]));
        assert_eq!((pool.in_use(), pool.refs(a.blocks()[1])), (3, 2));
        check(&pool, &b, 40, hd);
        // Writing position 40 copies block 1 first: one copy, no new block (41 < 64).
        assert_eq!(pool.blocks_needed(&b, 1), 1);
        let ids = pool.reserve(&mut b, 1).unwrap();
        assert_eq!(ids, vec![3]);
        assert_eq!(b.blocks(), &[a.blocks()[0], 3]);
        let k = vec![9.0f32; 3 * hd];
        for l in 0..2 {
            pool.append(&b, l, &k, &k);
        }
        b.advance(1);
        // a is unchanged; b has the shared 40 and its own 41st.
        check(&pool, &a, 70, hd);
        check(&pool, &b, 40, hd);
        let mut keys = vec![0f32; 41 * hd];
        pool.layer(&b, 0).keys(2, &mut keys);
        assert_eq!(&keys[40 * hd..], &[9.0; 4]);
        // Releasing a keeps the block b still shares.
        pool.release(&mut a);
        assert_eq!(pool.in_use(), 2);
        check(&pool, &b, 40, hd);
        pool.release(&mut b);
        assert_eq!(pool.in_use(), 0);
    }

    #[test]
    fn ids_are_checked_and_the_limit_holds() {
        let mut pool = KvPool::new(1, 1, 4, KvDtype::F16);
        pool.set_limit(2);
        let mut t = BlockTable::new(1000);
        // Explicit ids, as a follower receives them: any free ones.
        pool.grow(&mut t, 40, &[7, 2]).unwrap();
        assert_eq!(t.blocks(), &[7, 2]);
        assert_eq!(pool.lowest_free(0).unwrap(), Vec::<BlockId>::new());
        assert!(matches!(
            pool.lowest_free(1),
            Err(ModelError::OutOfBlocks {
                needed: 1,
                free: 0,
                limit: 2
            })
        ));
        let mut u = BlockTable::new(1000);
        // Wrong count, an id in use, a repeated id, an id out of range.
        for ids in [&[0u32][..], &[7, 0], &[0, 0], &[MAX_BLOCKS as u32, 0]] {
            assert!(pool.grow(&mut u, 33, ids).is_err(), "{ids:?}");
            assert_eq!(u, BlockTable::new(1000));
        }
        pool.release(&mut t);
        let e = pool.lowest_free(3).unwrap_err();
        assert!(matches!(
            e,
            ModelError::OutOfBlocks {
                needed: 3,
                free: 2,
                limit: 2
            }
        ));
        assert!(e.to_string().contains("3 more blocks"), "{e}");
        pool.set_limit(10);
        assert_eq!(pool.lowest_free(3).unwrap(), vec![0, 1, 2]);
        // Room in the table is checked first.
        let mut small = BlockTable::new(10);
        assert!(matches!(
            pool.reserve(&mut small, 11),
            Err(ModelError::ContextFull { .. })
        ));
    }

    #[test]
    fn dtype_names_parse() {
        for d in KvDtype::ALL {
            assert_eq!(d.name().parse::<KvDtype>().unwrap(), d);
        }
        assert_eq!("F16".parse::<KvDtype>().unwrap(), KvDtype::F16);
        assert!("q4".parse::<KvDtype>().is_err());
    }
}
