//! Per-sequence KV cache holding only this rank's KV heads (docs/design.md "One forward pass"),
//! in blocks of [`BLOCK_POSITIONS`] positions stored as f32, f16 or bf16.
//!
//! Each layer's keys and values are a list of blocks, each `[kv_heads, BLOCK_POSITIONS,
//! head_dim]` (one head's positions contiguous); a block is taken when the first position that needs it is written and all
//! are returned when the sequence ends, so memory follows the tokens held (rounded up to one
//! block per layer), never the context length. Values are rounded to the cache's dtype when
//! written and widened to f32 when read: attention does the same arithmetic in the same order
//! whatever the dtype, and an f32 cache gives exactly the bits of a contiguous one.

use crate::error::{ModelError, Result};
use half::{bf16, f16, slice::HalfFloatSliceExt};

/// Positions per block.
pub const BLOCK_POSITIONS: usize = 32;

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
}

impl KvDtype {
    /// Bytes per cached value.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
        }
    }

    /// Every dtype, in the order their names are listed to users.
    pub const ALL: [KvDtype; 3] = [KvDtype::F16, KvDtype::Bf16, KvDtype::F32];
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

/// Blocks of one tensor (keys or values) of one layer, each `[kv_heads, BLOCK_POSITIONS,
/// head_dim]`: head-major inside a block, so one head's positions are contiguous runs.
#[derive(Clone, Debug)]
enum Blocks {
    F32(Vec<Box<[f32]>>),
    F16(Vec<Box<[f16]>>),
    Bf16(Vec<Box<[bf16]>>),
}

impl Blocks {
    fn new(dtype: KvDtype) -> Self {
        match dtype {
            KvDtype::F32 => Blocks::F32(Vec::new()),
            KvDtype::F16 => Blocks::F16(Vec::new()),
            KvDtype::Bf16 => Blocks::Bf16(Vec::new()),
        }
    }

    fn count(&self) -> usize {
        match self {
            Blocks::F32(b) => b.len(),
            Blocks::F16(b) => b.len(),
            Blocks::Bf16(b) => b.len(),
        }
    }

    /// Writes `row [kv_heads * hd]` at position `pos`, taking a new block when `pos` starts one.
    fn put(&mut self, pos: usize, hd: usize, row: &[f32]) {
        fn put<T: Copy + Default>(
            blocks: &mut Vec<Box<[T]>>,
            pos: usize,
            hd: usize,
            row: &[f32],
            conv: impl Fn(f32) -> T,
        ) {
            let heads = row.len() / hd.max(1);
            let (b, p) = (pos / BLOCK_POSITIONS, pos % BLOCK_POSITIONS);
            if b == blocks.len() {
                blocks.push(vec![T::default(); heads * BLOCK_POSITIONS * hd].into_boxed_slice());
            }
            for (h, src) in row.chunks_exact(hd).enumerate() {
                let at = (h * BLOCK_POSITIONS + p) * hd;
                for (d, &s) in blocks[b][at..at + hd].iter_mut().zip(src) {
                    *d = conv(s);
                }
            }
        }
        match self {
            Blocks::F32(b) => put(b, pos, hd, row, |x| x),
            Blocks::F16(b) => put(b, pos, hd, row, f16::from_f32),
            Blocks::Bf16(b) => put(b, pos, hd, row, bf16::from_f32),
        }
    }

    /// Head `head`'s vectors of positions `0..out.len() / hd` into `out [positions, hd]` as f32
    /// (one vectorized conversion per block run).
    fn gather(&self, head: usize, hd: usize, out: &mut [f32]) {
        fn gather<T>(
            blocks: &[Box<[T]>],
            head: usize,
            hd: usize,
            out: &mut [f32],
            conv: impl Fn(&[T], &mut [f32]),
        ) {
            let run = BLOCK_POSITIONS * hd;
            for (block, dst) in blocks.iter().zip(out.chunks_mut(run)) {
                let at = head * run;
                conv(&block[at..at + dst.len()], dst);
            }
        }
        match self {
            Blocks::F32(b) => gather(b, head, hd, out, |s, d| d.copy_from_slice(s)),
            Blocks::F16(b) => gather(b, head, hd, out, |s, d| s.convert_to_f32_slice(d)),
            Blocks::Bf16(b) => gather(b, head, hd, out, |s, d| s.convert_to_f32_slice(d)),
        }
    }

    fn truncate_blocks(&mut self, keep: usize) {
        match self {
            Blocks::F32(b) => b.truncate(keep),
            Blocks::F16(b) => b.truncate(keep),
            Blocks::Bf16(b) => b.truncate(keep),
        }
    }
}

/// Keys and values of one layer, `[positions, kv_heads, head_dim]` each, in blocks.
#[derive(Clone, Debug)]
pub struct LayerKv {
    k: Blocks,
    v: Blocks,
    head_dim: usize,
}

impl LayerKv {
    /// KV head `head`'s keys of positions `0..out.len() / head_dim` into `out [positions,
    /// head_dim]`, as f32 (the positions must have been written).
    pub fn keys(&self, head: usize, out: &mut [f32]) {
        self.k.gather(head, self.head_dim, out)
    }

    /// The same for values.
    pub fn values(&self, head: usize, out: &mut [f32]) {
        self.v.gather(head, self.head_dim, out)
    }
}

/// The cache of one sequence on one rank.
#[derive(Clone, Debug)]
pub struct SeqCache {
    layers: Vec<LayerKv>,
    /// Positions written in every layer (all layers advance together).
    len: usize,
    /// Most positions this sequence may hold.
    capacity: usize,
    /// KV heads held by this rank.
    kv_heads: usize,
    head_dim: usize,
    dtype: KvDtype,
}

impl SeqCache {
    /// An empty cache of `kv_heads` heads of `head_dim` per layer; blocks are taken as
    /// positions are written, up to `capacity` positions.
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        dtype: KvDtype,
    ) -> Self {
        let layer = LayerKv {
            k: Blocks::new(dtype),
            v: Blocks::new(dtype),
            head_dim,
        };
        SeqCache {
            layers: vec![layer; layers],
            len: 0,
            capacity,
            kv_heads,
            head_dim,
            dtype,
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

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Bytes held now (whole blocks).
    pub fn bytes(&self) -> usize {
        let blocks: usize = self.layers.iter().map(|l| l.k.count() + l.v.count()).sum();
        blocks * BLOCK_POSITIONS * self.kv_heads * self.head_dim * self.dtype.size()
    }

    /// Bytes a cache of `positions` takes on a rank with `kv_width` cached values per position
    /// (whole blocks; saturating at `usize::MAX`, [`SeqCache::checked_bytes_for`] tells
    /// overflow apart).
    pub fn bytes_for(layers: usize, kv_width: usize, positions: usize, dtype: KvDtype) -> usize {
        Self::checked_bytes_for(layers, kv_width, positions, dtype)
            .and_then(|b| usize::try_from(b).ok())
            .unwrap_or(usize::MAX)
    }

    /// [`SeqCache::bytes_for`] in u128 (`None`: more than 2^128).
    pub fn checked_bytes_for(
        layers: usize,
        kv_width: usize,
        positions: usize,
        dtype: KvDtype,
    ) -> Option<u128> {
        let blocks = positions.div_ceil(BLOCK_POSITIONS) as u64;
        crate::limits::product(&[
            layers as u64,
            2,
            kv_width as u64,
            blocks,
            BLOCK_POSITIONS as u64,
            dtype.size() as u64,
        ])
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

    /// Appends `k`, `v` (`[n, kv_heads * head_dim]`) to `layer` at positions `len..len + n`.
    /// The caller advances with [`SeqCache::commit`] once every layer has appended.
    pub(crate) fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let (w, hd) = (self.kv_heads * self.head_dim, self.head_dim);
        let l = &mut self.layers[layer];
        for (i, (kr, vr)) in k.chunks_exact(w).zip(v.chunks_exact(w)).enumerate() {
            l.k.put(self.len + i, hd, kr);
            l.v.put(self.len + i, hd, vr);
        }
    }

    /// The keys and values of `layer` (positions `0..len + appended`).
    pub(crate) fn layer(&self, layer: usize) -> &LayerKv {
        &self.layers[layer]
    }

    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Drops positions `len..` (after a failed step), keeping the first `len` and returning
    /// the blocks no longer needed.
    pub fn truncate(&mut self, len: usize) {
        let keep = len.min(self.len);
        let blocks = keep.div_ceil(BLOCK_POSITIONS);
        for l in &mut self.layers {
            l.k.truncate_blocks(blocks);
            l.v.truncate_blocks(blocks);
        }
        self.len = keep;
    }

    /// Empties the cache and returns its memory.
    pub fn clear(&mut self) {
        self.truncate(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache of 2 layers, 3 heads of `hd`, filled to `positions` in uneven chunks; the value
    /// at (position p, column c) of the keys is `sin(p * w + c)`, of the values `3 key - 1`.
    fn filled(dtype: KvDtype, positions: usize, hd: usize) -> SeqCache {
        let w = 3 * hd;
        let mut c = SeqCache::new(2, 3, hd, 1000, dtype);
        let mut start = 0;
        // Uneven chunks cross block boundaries.
        for n in [1, 5, 31, 40, 3, 100] {
            let n = n.min(positions - start);
            if n == 0 {
                break;
            }
            let k: Vec<f32> = (0..n * w).map(|i| ((start * w + i) as f32).sin()).collect();
            let v: Vec<f32> = k.iter().map(|x| x * 3.0 - 1.0).collect();
            for l in 0..2 {
                c.append(l, &k, &v);
            }
            c.commit(n);
            start += n;
        }
        c
    }

    #[test]
    fn reads_back_what_was_written_across_blocks() {
        let hd = 4;
        for dtype in KvDtype::ALL {
            let c = filled(dtype, 80, hd);
            assert_eq!(c.len(), 80);
            let tol = match dtype {
                KvDtype::F32 => 0.0,
                KvDtype::F16 => 1e-3,
                KvDtype::Bf16 => 8e-3,
            };
            for head in 0..3 {
                for n in [1, 32, 33, 80] {
                    let (mut k, mut v) = (vec![0f32; n * hd], vec![0f32; n * hd]);
                    c.layer(1).keys(head, &mut k);
                    c.layer(0).values(head, &mut v);
                    for p in 0..n {
                        for d in 0..hd {
                            let want = ((p * 3 * hd + head * hd + d) as f32).sin();
                            let (gk, gv) = (k[p * hd + d], v[p * hd + d]);
                            assert!((gk - want).abs() <= tol, "{dtype} key p {p} head {head}");
                            let want = want * 3.0 - 1.0;
                            assert!(
                                (gv - want).abs() <= tol * 4.0,
                                "{dtype} value p {p} head {head}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn memory_follows_the_tokens_held() {
        let hd = 8;
        for dtype in KvDtype::ALL {
            let mut c = filled(dtype, 70, hd);
            // 70 positions = 3 blocks per tensor per layer; 3 heads of 8.
            let want = 2 * 2 * 3 * BLOCK_POSITIONS * 3 * hd * dtype.size();
            assert_eq!(c.bytes(), want);
            assert_eq!(SeqCache::bytes_for(2, 3 * hd, 70, dtype), want);
            c.truncate(32);
            assert_eq!(c.bytes(), 2 * 2 * BLOCK_POSITIONS * 3 * hd * dtype.size());
            assert_eq!(c.len(), 32);
            c.clear();
            assert_eq!((c.bytes(), c.len()), (0, 0));
        }
        assert_eq!(SeqCache::bytes_for(30, 192, 0, KvDtype::F16), 0);
        assert!(SeqCache::checked_bytes_for(usize::MAX, usize::MAX, 64, KvDtype::F32).is_none());
    }

    #[test]
    fn a_truncated_cache_is_rewritten_in_place() {
        let hd = 2;
        let mut c = filled(KvDtype::F32, 40, hd);
        c.truncate(33);
        let k = vec![7.0f32; 2 * 3 * hd];
        for l in 0..2 {
            c.append(l, &k, &k);
        }
        c.commit(2);
        let mut keys = vec![0f32; 35 * hd];
        c.layer(0).keys(1, &mut keys);
        assert_eq!(&keys[33 * hd..], &[7.0; 4]);
        assert_eq!(keys[32 * hd], ((32 * 3 * hd + hd) as f32).sin());
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
