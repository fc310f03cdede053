//! Per-sequence KV cache holding only this rank's KV heads (docs/design.md "One forward pass").
//!
//! Layout is position-major, `[pos, kv_local * head_dim]` per layer, so appending a token is a
//! plain `extend` and the cache grows up to its capacity without re-layout.

use crate::error::{ModelError, Result};

/// Keys and values of one layer.
#[derive(Clone, Debug, Default)]
struct LayerKv {
    k: Vec<f32>, // [len, kv_width]
    v: Vec<f32>, // [len, kv_width]
}

/// The cache of one sequence on one rank.
#[derive(Clone, Debug)]
pub struct SeqCache {
    layers: Vec<LayerKv>,
    /// Positions written in every layer (all layers advance together).
    len: usize,
    /// Most positions this sequence may hold.
    capacity: usize,
    /// `kv_local * head_dim`.
    kv_width: usize,
}

impl SeqCache {
    /// An empty cache; memory is taken as positions are written, up to `capacity`.
    pub fn new(layers: usize, kv_width: usize, capacity: usize) -> Self {
        SeqCache {
            layers: vec![LayerKv::default(); layers],
            len: 0,
            capacity,
            kv_width,
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

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| (l.k.capacity() + l.v.capacity()) * 4)
            .sum()
    }

    /// Bytes a cache of `positions` takes on a rank with `kv_width` cached floats per position
    /// (saturating at `usize::MAX`; [`SeqCache::checked_bytes_for`] tells overflow apart).
    pub fn bytes_for(layers: usize, kv_width: usize, positions: usize) -> usize {
        Self::checked_bytes_for(layers, kv_width, positions)
            .and_then(|b| usize::try_from(b).ok())
            .unwrap_or(usize::MAX)
    }

    /// [`SeqCache::bytes_for`] in u128 (`None`: more than 2^128).
    pub fn checked_bytes_for(layers: usize, kv_width: usize, positions: usize) -> Option<u128> {
        crate::limits::product(&[layers as u64, 2, kv_width as u64, positions as u64, 4])
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

    /// Appends `k`, `v` (`[n, kv_width]`) to `layer`. The caller advances with [`SeqCache::commit`]
    /// once every layer has appended.
    pub(crate) fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let l = &mut self.layers[layer];
        if l.k.capacity() == 0 {
            // First write: reserve what the first chunk needs plus some room, bounded by capacity.
            let want = (k.len() / self.kv_width.max(1) + 64).min(self.capacity) * self.kv_width;
            l.k.reserve_exact(want);
            l.v.reserve_exact(want);
        }
        l.k.extend_from_slice(k);
        l.v.extend_from_slice(v);
    }

    /// `(keys, values)` of `layer`, `[positions, kv_width]` each (including appended, uncommitted ones).
    pub(crate) fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        let l = &self.layers[layer];
        (&l.k, &l.v)
    }

    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Drops positions `len..` (after a failed step), keeping the first `len`.
    pub fn truncate(&mut self, len: usize) {
        let keep = len.min(self.len);
        for l in &mut self.layers {
            l.k.truncate(keep * self.kv_width);
            l.v.truncate(keep * self.kv_width);
        }
        self.len = keep;
    }

    /// Empties the cache and returns its memory.
    pub fn clear(&mut self) {
        for l in &mut self.layers {
            *l = LayerKv::default();
        }
        self.len = 0;
    }
}
