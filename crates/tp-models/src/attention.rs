//! Causal attention of a step's new tokens over a sequence's cached keys and values: one
//! arithmetic (the portable functions here), run as written or with AVX2 / AVX-512 vectors,
//! with the same bits on every path, at every batch size and at every tp.
//!
//! The arithmetic, per query head `q` and position range `first..seen`:
//! - score `s_p = dot(q, k_p) * scale`, where [`dot`] sums in 8 lanes (`d mod 8`, fused
//!   multiply-adds), then the lanes in order;
//! - `m = max s_p`, `e_p = exp_det(s_p - m)` ([`exp_det`]: only multiplies, adds and bit
//!   operations, so a vector lane computes what the scalar does), summed in 16 lanes by
//!   absolute position (`p mod 16`) and the lanes folded in halves (8, 4, 2, 1);
//! - weights `w_p = e_p * (1 / sum)`, output `o = Σ_p w_p v_p` as two fused multiply-add
//!   chains, the even and the odd positions of the range in order, added at the end (two
//!   chains keep a vector unit busy while each waits on its last add).
//!
//! Scores are computed key by key from `[positions, head_dim]` keys, or, when many queries
//! share a KV head (prefill), sixteen keys at a time from keys transposed to tiles of
//! `[head_dim, 16]`: one lane per key, the same additions in the same order.

use crate::exp::exp_det;
use crate::kv_cache::LayerKv;
use crate::ops::fold16;
pub(crate) use crate::path::Path;

/// What one attention call reads: `len` new tokens (rows of `qkv`, queries first) over a
/// layer's cache.
#[derive(Clone, Copy)]
pub(crate) struct AttendInput<'a> {
    /// `[len, qkv_w]`: each token's queries, then its keys and values.
    pub qkv: &'a [f32],
    pub qkv_w: usize,
    /// Positions `0..pos0 + len` of this layer's keys and values.
    pub kv: LayerKv<'a>,
    pub hd: usize,
    /// The KV head of each local query head.
    pub kv_of_q: &'a [usize],
    /// Position of the first new token.
    pub pos0: usize,
    /// What queries are multiplied by before their dot products.
    pub scale: f32,
    /// A sliding-window layer's window: position `p` sees `p + 1 - window ..= p`.
    pub window: Option<usize>,
}

/// Lanes of the softmax's partial sums and keys per score tile.
const LANES: usize = 16;

/// Queries sharing a KV head from which their keys are transposed to tiles (the transpose
/// costs about what two queries' key-by-key scores do).
const TILE_MIN_QUERIES: usize = 8;

impl Path {
    /// Whether this path has kernels for [`GROUP`] queries at once.
    fn groups(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self == Path::Avx512 {
            return true;
        }
        false
    }
}

/// Causal attention of the new tokens over the cache into `ctx` (`[len, q_w]`): token `i`
/// sees positions `0..=pos0 + i` (the last `window` of them in a sliding-window layer). Each
/// KV head's keys and values are widened to f32 once for all the query heads and tokens that
/// use it, so the arithmetic does not depend on the cache's dtype.
pub(crate) fn attend(a: AttendInput<'_>, ctx: &mut [f32]) {
    attend_on(Path::current(), TILE_MIN_QUERIES, a, ctx)
}

/// [`attend`] on `path`, tiling keys from `tile_min` queries per KV head.
pub(crate) fn attend_on(path: Path, tile_min: usize, a: AttendInput<'_>, ctx: &mut [f32]) {
    let AttendInput {
        qkv,
        qkv_w,
        kv,
        hd,
        kv_of_q,
        pos0,
        scale,
        window,
    } = a;
    let q_w = kv_of_q.len() * hd;
    let len = qkv.len() / qkv_w;
    let seen_all = pos0 + len;
    let padded = seen_all.div_ceil(LANES) * LANES;
    let mut keys = vec![0f32; seen_all * hd]; // [seen_all, hd] of one KV head
    let mut values = vec![0f32; seen_all * hd]; // [seen_all, hd]
    let mut tiles = Vec::new(); // [padded / LANES, hd, LANES] when tiled
    let mut scores = vec![0f32; GROUP * padded]; // [GROUP, padded], by absolute position
    let mut outs = vec![0f32; GROUP * hd]; // [GROUP, hd]
    let kv_heads = kv_of_q.iter().copied().max().map_or(0, |m| m + 1);
    for kvh in 0..kv_heads {
        let heads: Vec<usize> = (0..kv_of_q.len()).filter(|&h| kv_of_q[h] == kvh).collect();
        if heads.is_empty() {
            continue;
        }
        kv.keys(kvh, &mut keys);
        kv.values(kvh, &mut values);
        let tiled = heads.len() * len >= tile_min;
        if tiled {
            tiles.resize(padded * hd, 0.0);
            transpose_to_tiles(&keys, hd, &mut tiles);
        }
        for (i, row) in qkv.chunks_exact(qkv_w).enumerate() {
            let seen = pos0 + i + 1;
            let first = window.map_or(0, |w| seen.saturating_sub(w));
            let (base, end) = (first / LANES * LANES, seen.div_ceil(LANES) * LANES);
            let (lo, hi) = (first - base, seen - base);
            let (keys, values) = (&keys[first * hd..seen * hd], &values[first * hd..seen * hd]);
            // Heads sharing this KV head see the same positions: up to GROUP at a time, so
            // a vector path loads each key tile and value row once for all of them.
            for group in heads.chunks(GROUP) {
                let q = |g: usize| &row[group[g] * hd..(group[g] + 1) * hd]; // [hd]
                let mut s: Vec<&mut [f32]> = scores
                    .chunks_exact_mut(padded)
                    .take(group.len())
                    .map(|s| &mut s[base..end])
                    .collect();
                if tiled && group.len() == GROUP && path.groups() {
                    let tiles = &tiles[base * hd..end * hd];
                    scores_tiled_group(path, [q(0), q(1), q(2)], tiles, scale, &mut s);
                } else {
                    for (g, s) in s.iter_mut().enumerate() {
                        if tiled {
                            scores_tiled(path, q(g), &tiles[base * hd..end * hd], scale, s);
                        } else {
                            scores_by_key(path, q(g), keys, scale, &mut s[lo..hi]);
                        }
                    }
                }
                for s in s.iter_mut() {
                    softmax(path, s, lo, hi);
                }
                let w: Vec<&[f32]> = s.iter().map(|s| &s[lo..hi]).collect();
                let outs = &mut outs[..group.len() * hd]; // [group, hd]
                if group.len() == GROUP && hd.is_multiple_of(64) && path.groups() {
                    weighted_sum_group(path, [w[0], w[1], w[2]], values, outs);
                } else {
                    for (w, out) in w.iter().zip(outs.chunks_exact_mut(hd.max(1))) {
                        weighted_sum(path, w, values, out);
                    }
                }
                for (&h, out) in group.iter().zip(outs.chunks_exact(hd.max(1))) {
                    ctx[i * q_w + h * hd..i * q_w + (h + 1) * hd].copy_from_slice(out);
                }
            }
        }
    }
}

/// Query heads handled at once by the grouped kernels (3: their accumulators fill the 32
/// AVX-512 registers).
const GROUP: usize = 3;

/// `keys [positions, hd]` -> `tiles [positions / 16, hd, 16]` (the last tile padded with
/// zeros): key `j` of a tile is lane `j` of each of its `hd` rows.
fn transpose_to_tiles(keys: &[f32], hd: usize, tiles: &mut [f32]) {
    for (t, tile) in tiles.chunks_exact_mut(hd * LANES).enumerate() {
        let rows = keys.len() / hd.max(1);
        let n = LANES.min(rows.saturating_sub(t * LANES));
        if n < LANES {
            tile.fill(0.0);
        }
        for j in 0..n {
            let k = &keys[(t * LANES + j) * hd..(t * LANES + j + 1) * hd];
            for (d, &x) in k.iter().enumerate() {
                tile[d * LANES + j] = x;
            }
        }
    }
}

/// `a · b`: eight lanes (`d mod 8`) of fused multiply-adds in order of `d`, then the lanes
/// added in order, then what is left past a multiple of 8, fused one by one.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] = x[k].mul_add(y[k], acc[k]);
        }
    }
    let mut s = acc[0];
    for &v in &acc[1..] {
        s += v;
    }
    for (x, y) in ra.iter().zip(rb) {
        s = x.mul_add(*y, s);
    }
    s
}

/// Scores of positions in order: `s[j] = dot(q, keys[j]) * scale` (`keys [s.len(), hd]`).
fn scores_by_key(path: Path, q: &[f32], keys: &[f32], scale: f32, s: &mut [f32]) {
    match path {
        Path::Portable => scores_by_key_portable(q, keys, scale, s),
        // SAFETY: the avx2 and avx512 kernel paths are chosen only on CPUs with AVX2 and FMA,
        // and AVX-512F (`tp_kernels`' detection).
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { scores_by_key_avx2(q, keys, scale, s) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { scores_by_key_avx512(q, keys, scale, s) },
    }
}

#[inline(always)]
fn scores_by_key_portable(q: &[f32], keys: &[f32], scale: f32, s: &mut [f32]) {
    for (s, k) in s.iter_mut().zip(keys.chunks_exact(q.len().max(1))) {
        *s = dot(q, k) * scale;
    }
}

/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_by_key_avx2(q: &[f32], keys: &[f32], scale: f32, s: &mut [f32]) {
    scores_by_key_portable(q, keys, scale, s)
}

/// # Safety
/// The CPU must have AVX-512F and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn scores_by_key_avx512(q: &[f32], keys: &[f32], scale: f32, s: &mut [f32]) {
    scores_by_key_portable(q, keys, scale, s)
}

/// Scores of whole tiles: `s[t * 16 + j] = dot(q, key j of tile t) * scale` (`tiles [s.len()
/// / 16, hd, 16]`); the same additions as [`dot`], one lane per key.
fn scores_tiled(path: Path, q: &[f32], tiles: &[f32], scale: f32, s: &mut [f32]) {
    match path {
        Path::Portable => {
            let hd = q.len();
            let mut key = vec![0f32; hd];
            for (tile, s) in tiles
                .chunks_exact(hd * LANES)
                .zip(s.chunks_exact_mut(LANES))
            {
                for (j, s) in s.iter_mut().enumerate() {
                    for (d, k) in key.iter_mut().enumerate() {
                        *k = tile[d * LANES + j];
                    }
                    *s = dot(q, &key) * scale;
                }
            }
        }
        // SAFETY: as in `scores_by_key`.
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { x86::scores_tiled_avx2(q, tiles, scale, s) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { x86::scores_tiled_avx512(q, tiles, scale, s) },
    }
}

/// [`scores_tiled`] for [`GROUP`] queries over the same tiles (a path that [`Path::groups`]).
fn scores_tiled_group(
    path: Path,
    q: [&[f32]; GROUP],
    tiles: &[f32],
    scale: f32,
    s: &mut [&mut [f32]],
) {
    match path {
        // SAFETY: as in `scores_by_key`.
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { x86::scores_tiled_group_avx512(q, tiles, scale, s) },
        _ => unreachable!("no grouped kernels on {path:?}"),
    }
}

/// [`weighted_sum`] for [`GROUP`] queries over the same values into `outs [GROUP, hd]` (a
/// path that [`Path::groups`], `hd` a multiple of 64).
fn weighted_sum_group(path: Path, w: [&[f32]; GROUP], values: &[f32], outs: &mut [f32]) {
    match path {
        // SAFETY: as in `scores_by_key`.
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { x86::weighted_sum_group_avx512(w, values, outs) },
        _ => unreachable!("no grouped kernels on {path:?}"),
    }
}

/// Softmax in place of `s[lo..hi]`, where `s` starts at a multiple of 16 positions (its
/// other entries are scratch): see the module's arithmetic.
fn softmax(path: Path, s: &mut [f32], lo: usize, hi: usize) {
    match path {
        Path::Portable => softmax_portable(s, lo, hi),
        // SAFETY: as in `scores_by_key`.
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { x86::softmax_avx2(s, lo, hi) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { x86::softmax_avx512(s, lo, hi) },
    }
}

fn softmax_portable(s: &mut [f32], lo: usize, hi: usize) {
    let mut m = f32::NEG_INFINITY;
    for &v in &s[lo..hi] {
        if v > m {
            m = v;
        }
    }
    let mut lanes = [0f32; LANES];
    for (p, v) in s.iter_mut().enumerate().take(hi).skip(lo) {
        let e = exp_det(*v - m);
        *v = e;
        lanes[p % LANES] += e;
    }
    let sum = fold16(lanes);
    let inv = 1.0 / sum;
    for v in &mut s[lo..hi] {
        *v *= inv;
    }
}

/// `out = Σ_p w[p] * values[p]` in position order (`values [w.len(), out.len()]`).
fn weighted_sum(path: Path, w: &[f32], values: &[f32], out: &mut [f32]) {
    match path {
        Path::Portable => weighted_sum_portable(w, values, out),
        // SAFETY: as in `scores_by_key`.
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { x86::weighted_sum_avx2(w, values, out) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { x86::weighted_sum_avx512(w, values, out) },
    }
}

fn weighted_sum_portable(w: &[f32], values: &[f32], out: &mut [f32]) {
    let hd = out.len();
    let mut odd = vec![0f32; hd];
    out.fill(0.0);
    for (i, (&w, v)) in w.iter().zip(values.chunks_exact(hd.max(1))).enumerate() {
        let acc = if i % 2 == 0 { &mut *out } else { &mut odd[..] };
        for (o, &x) in acc.iter_mut().zip(v) {
            *o = w.mul_add(x, *o);
        }
    }
    for (o, x) in out.iter_mut().zip(odd) {
        *o += x;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The vector forms of the arithmetic: the same operations lane by lane.

    use super::LANES;
    use crate::exp::x86::{exp16, exp8};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores_tiled_avx512(q: &[f32], tiles: &[f32], scale: f32, s: &mut [f32]) {
        let hd = q.len();
        let full = hd / 8 * 8;
        for (tile, s) in tiles
            .chunks_exact(hd * LANES)
            .zip(s.chunks_exact_mut(LANES))
        {
            let tp = tile.as_ptr();
            let mut acc = [_mm512_setzero_ps(); 8];
            let mut d = 0;
            while d < full {
                for (l, a) in acc.iter_mut().enumerate() {
                    // SAFETY: d + l < hd, so the row is inside the tile.
                    let k = unsafe { _mm512_loadu_ps(tp.add((d + l) * LANES)) };
                    *a = _mm512_fmadd_ps(_mm512_set1_ps(q[d + l]), k, *a);
                }
                d += 8;
            }
            let mut sum = acc[0];
            for &a in &acc[1..] {
                sum = _mm512_add_ps(sum, a);
            }
            for (d, &qd) in q.iter().enumerate().skip(full) {
                // SAFETY: d < hd.
                let k = unsafe { _mm512_loadu_ps(tp.add(d * LANES)) };
                sum = _mm512_fmadd_ps(_mm512_set1_ps(qd), k, sum);
            }
            sum = _mm512_mul_ps(sum, _mm512_set1_ps(scale));
            // SAFETY: s holds 16 values.
            unsafe { _mm512_storeu_ps(s.as_mut_ptr(), sum) };
        }
    }

    /// [`scores_tiled_avx512`] for [`GROUP`](super::GROUP) queries: each key row is loaded
    /// once for all of them (the per-query additions are the same, in the same order).
    ///
    /// # Safety
    /// The CPU must have AVX-512F; every query has the same length, `s` holds GROUP slices.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores_tiled_group_avx512(
        q: [&[f32]; super::GROUP],
        tiles: &[f32],
        scale: f32,
        s: &mut [&mut [f32]],
    ) {
        const G: usize = super::GROUP;
        let hd = q[0].len();
        assert!(q.iter().all(|q| q.len() == hd) && s.len() == G);
        let full = hd / 8 * 8;
        for (t, tile) in tiles.chunks_exact(hd * LANES).enumerate() {
            let tp = tile.as_ptr();
            let mut acc = [[_mm512_setzero_ps(); 8]; G];
            let mut d = 0;
            while d < full {
                for l in 0..8 {
                    // SAFETY: d + l < hd, so the row is inside the tile.
                    let k = unsafe { _mm512_loadu_ps(tp.add((d + l) * LANES)) };
                    for g in 0..G {
                        acc[g][l] = _mm512_fmadd_ps(_mm512_set1_ps(q[g][d + l]), k, acc[g][l]);
                    }
                }
                d += 8;
            }
            for g in 0..G {
                let mut sum = acc[g][0];
                for &a in &acc[g][1..] {
                    sum = _mm512_add_ps(sum, a);
                }
                for (d, &qd) in q[g].iter().enumerate().skip(full) {
                    // SAFETY: d < hd.
                    let k = unsafe { _mm512_loadu_ps(tp.add(d * LANES)) };
                    sum = _mm512_fmadd_ps(_mm512_set1_ps(qd), k, sum);
                }
                sum = _mm512_mul_ps(sum, _mm512_set1_ps(scale));
                let out = &mut s[g][t * LANES..(t + 1) * LANES];
                // SAFETY: 16 values.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr(), sum) };
            }
        }
    }

    /// [`weighted_sum_avx512`] for [`GROUP`](super::GROUP) queries into `outs [GROUP, hd]`:
    /// each value row is loaded once for all of them (per query the same two chains).
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `hd = outs.len() / GROUP` is a multiple of 64, every `w`
    /// has the same length and `values` holds that many rows of `hd`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_sum_group_avx512(
        w: [&[f32]; super::GROUP],
        values: &[f32],
        outs: &mut [f32],
    ) {
        const G: usize = super::GROUP;
        let hd = outs.len() / G;
        let n = w[0].len();
        assert!(hd.is_multiple_of(64) && w.iter().all(|w| w.len() == n) && values.len() >= n * hd);
        for d0 in (0..hd).step_by(64) {
            let (mut even, mut odd) =
                ([[_mm512_setzero_ps(); 4]; G], [[_mm512_setzero_ps(); 4]; G]);
            // Position p into one chain of every query. SAFETY (callers): p < n.
            let step = |acc: &mut [[__m512; 4]; G], p: usize| {
                // SAFETY: row p has hd values and d0 + 64 <= hd.
                let row = unsafe { values.as_ptr().add(p * hd + d0) };
                let v: [__m512; 4] =
                    std::array::from_fn(|r| unsafe { _mm512_loadu_ps(row.add(16 * r)) });
                for g in 0..G {
                    let wv = _mm512_set1_ps(w[g][p]);
                    for r in 0..4 {
                        acc[g][r] = _mm512_fmadd_ps(wv, v[r], acc[g][r]);
                    }
                }
            };
            let mut p = 0;
            while p + 2 <= n {
                step(&mut even, p);
                step(&mut odd, p + 1);
                p += 2;
            }
            if p < n {
                step(&mut even, p);
            }
            for g in 0..G {
                for r in 0..4 {
                    let sum = _mm512_add_ps(even[g][r], odd[g][r]);
                    // SAFETY: g * hd + d0 + 16 r + 16 <= G * hd.
                    unsafe { _mm512_storeu_ps(outs.as_mut_ptr().add(g * hd + d0 + 16 * r), sum) };
                }
            }
        }
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores_tiled_avx2(q: &[f32], tiles: &[f32], scale: f32, s: &mut [f32]) {
        let hd = q.len();
        let full = hd / 8 * 8;
        for (tile, s) in tiles
            .chunks_exact(hd * LANES)
            .zip(s.chunks_exact_mut(LANES))
        {
            for half in 0..2 {
                // SAFETY: half * 8 < 16, the tile's width.
                let tp = unsafe { tile.as_ptr().add(half * 8) };
                let mut acc = [_mm256_setzero_ps(); 8];
                let mut d = 0;
                while d < full {
                    for (l, a) in acc.iter_mut().enumerate() {
                        // SAFETY: d + l < hd, so the row is inside the tile.
                        let k = unsafe { _mm256_loadu_ps(tp.add((d + l) * LANES)) };
                        *a = _mm256_fmadd_ps(_mm256_set1_ps(q[d + l]), k, *a);
                    }
                    d += 8;
                }
                let mut sum = acc[0];
                for &a in &acc[1..] {
                    sum = _mm256_add_ps(sum, a);
                }
                for (d, &qd) in q.iter().enumerate().skip(full) {
                    // SAFETY: d < hd.
                    let k = unsafe { _mm256_loadu_ps(tp.add(d * LANES)) };
                    sum = _mm256_fmadd_ps(_mm256_set1_ps(qd), k, sum);
                }
                sum = _mm256_mul_ps(sum, _mm256_set1_ps(scale));
                // SAFETY: s holds 16 values.
                unsafe { _mm256_storeu_ps(s.as_mut_ptr().add(half * 8), sum) };
            }
        }
    }

    /// Lanes `lo..hi` of a 16-lane tile that starts at position `t0` (as a bit mask).
    fn real_lanes(t0: usize, lo: usize, hi: usize) -> u16 {
        let from = lo.saturating_sub(t0).min(LANES);
        let to = hi.saturating_sub(t0).min(LANES);
        let upto = |n: usize| {
            if n >= LANES {
                u16::MAX
            } else {
                (1u16 << n) - 1
            }
        };
        upto(to) & !upto(from)
    }

    /// # Safety
    /// The CPU must have AVX-512F; `s.len()` is a multiple of 16 and `lo <= hi <= s.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn softmax_avx512(s: &mut [f32], lo: usize, hi: usize) {
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut m = ninf;
        for (t, tile) in s.chunks_exact(LANES).enumerate() {
            let real = real_lanes(t * LANES, lo, hi);
            // SAFETY: the tile holds 16 values.
            let v = unsafe { _mm512_loadu_ps(tile.as_ptr()) };
            // max(v, m) is v where v > m, else m: NaN scores are passed over, as in the
            // scalar form.
            m = _mm512_mask_max_ps(m, real, v, m);
        }
        let m = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        let mut sums = _mm512_setzero_ps();
        for (t, tile) in s.chunks_exact_mut(LANES).enumerate() {
            let real = real_lanes(t * LANES, lo, hi);
            // SAFETY: the tile holds 16 values.
            let v = unsafe { _mm512_loadu_ps(tile.as_ptr()) };
            let e = _mm512_maskz_mov_ps(real, exp16(_mm512_sub_ps(v, m)));
            sums = _mm512_add_ps(sums, e);
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(tile.as_mut_ptr(), e) };
        }
        // Fold 16 -> 8 -> 4 -> 2 -> 1: lane i += lane i + w.
        let s8 = _mm256_add_ps(
            _mm512_castps512_ps256(sums),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(sums))),
        );
        let inv = 1.0 / fold8(s8);
        let inv = _mm512_set1_ps(inv);
        for tile in s.chunks_exact_mut(LANES) {
            // SAFETY: the tile holds 16 values.
            unsafe {
                let v = _mm512_loadu_ps(tile.as_ptr());
                _mm512_storeu_ps(tile.as_mut_ptr(), _mm512_mul_ps(v, inv));
            }
        }
    }

    /// Eight partial sums folded in halves (4, 2, 1).
    #[inline]
    #[target_feature(enable = "avx")]
    fn fold8(s8: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
        _mm_cvtss_f32(s1)
    }

    /// # Safety
    /// The CPU must have AVX2; `s.len()` is a multiple of 16 and `lo <= hi <= s.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn softmax_avx2(s: &mut [f32], lo: usize, hi: usize) {
        let lane_mask = |real: u16, half: usize| {
            let bits = _mm256_set1_epi32(i32::from((real >> (half * 8)) & 0xff));
            let sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
            _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(bits, sel), sel))
        };
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut m = ninf;
        for (t, tile) in s.chunks_exact(LANES).enumerate() {
            let real = real_lanes(t * LANES, lo, hi);
            for half in 0..2 {
                // SAFETY: the tile holds 16 values.
                let v = unsafe { _mm256_loadu_ps(tile.as_ptr().add(half * 8)) };
                let v = _mm256_blendv_ps(ninf, v, lane_mask(real, half));
                // max(v, m): v where v > m, else m (NaN passed over).
                m = _mm256_max_ps(v, m);
            }
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m1 = _mm_max_ss(m2, _mm_movehdup_ps(m2));
        let m = _mm256_set1_ps(_mm_cvtss_f32(m1));
        let mut sums = [_mm256_setzero_ps(); 2];
        for (t, tile) in s.chunks_exact_mut(LANES).enumerate() {
            let real = real_lanes(t * LANES, lo, hi);
            for (half, sum) in sums.iter_mut().enumerate() {
                // SAFETY: the tile holds 16 values.
                let p = unsafe { tile.as_mut_ptr().add(half * 8) };
                let v = unsafe { _mm256_loadu_ps(p) };
                let e = _mm256_and_ps(exp8(_mm256_sub_ps(v, m)), lane_mask(real, half));
                *sum = _mm256_add_ps(*sum, e);
                // SAFETY: as above.
                unsafe { _mm256_storeu_ps(p, e) };
            }
        }
        let inv = _mm256_set1_ps(1.0 / fold8(_mm256_add_ps(sums[0], sums[1])));
        for v in s.chunks_exact_mut(8) {
            // SAFETY: eight values.
            unsafe {
                let x = _mm256_loadu_ps(v.as_ptr());
                _mm256_storeu_ps(v.as_mut_ptr(), _mm256_mul_ps(x, inv));
            }
        }
    }

    /// `out[d0..d0 + 16 R] = Σ_p w[p] values[p][d0..]`: the even and the odd positions'
    /// chains, R vectors each, held in registers.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `d0 + 16 R <= out.len()`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn wsum512<const R: usize>(w: &[f32], values: &[f32], d0: usize, out: &mut [f32]) {
        let hd = out.len();
        let (mut even, mut odd) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
        // One position into one chain. SAFETY (callers): row p has hd values, d0 + 16 R <= hd.
        let step = |acc: &mut [__m512; R], p: usize| {
            let wv = _mm512_set1_ps(w[p]);
            let row = unsafe { values.as_ptr().add(p * hd + d0) };
            for (r, a) in acc.iter_mut().enumerate() {
                let v = unsafe { _mm512_loadu_ps(row.add(16 * r)) };
                *a = _mm512_fmadd_ps(wv, v, *a);
            }
        };
        let mut p = 0;
        while p + 2 <= w.len() {
            step(&mut even, p);
            step(&mut odd, p + 1);
            p += 2;
        }
        if p < w.len() {
            step(&mut even, p);
        }
        for r in 0..R {
            let sum = _mm512_add_ps(even[r], odd[r]);
            // SAFETY: d0 + 16 R <= hd.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(d0 + 16 * r), sum) };
        }
    }

    /// # Safety
    /// The CPU must have AVX-512F; `values` holds `w.len()` rows of `out.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_sum_avx512(w: &[f32], values: &[f32], out: &mut [f32]) {
        let hd = out.len();
        assert!(values.len() >= w.len() * hd);
        let mut d0 = 0;
        // SAFETY (all calls): each stays inside `d0 + 16 R <= hd`.
        while d0 + 64 <= hd {
            unsafe { wsum512::<4>(w, values, d0, out) };
            d0 += 64;
        }
        while d0 + 16 <= hd {
            unsafe { wsum512::<1>(w, values, d0, out) };
            d0 += 16;
        }
        if d0 < hd {
            let mask: u16 = (1u16 << (hd - d0)) - 1;
            let (mut even, mut odd) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            for (p, &wp) in w.iter().enumerate() {
                // SAFETY: the masked lanes are inside row p.
                let v = unsafe { _mm512_maskz_loadu_ps(mask, values.as_ptr().add(p * hd + d0)) };
                let acc = if p % 2 == 0 { &mut even } else { &mut odd };
                *acc = _mm512_fmadd_ps(_mm512_set1_ps(wp), v, *acc);
            }
            let sum = _mm512_add_ps(even, odd);
            // SAFETY: the masked lanes are inside out.
            unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr().add(d0), mask, sum) };
        }
    }

    /// `out[d0..d0 + 8 R] = Σ_p w[p] values[p][d0..]`: the even and the odd positions'
    /// chains, R vectors each, held in registers.
    ///
    /// # Safety
    /// The CPU must have AVX and FMA; `d0 + 8 R <= out.len()`.
    #[inline]
    #[target_feature(enable = "avx,fma")]
    unsafe fn wsum256<const R: usize>(w: &[f32], values: &[f32], d0: usize, out: &mut [f32]) {
        let hd = out.len();
        let (mut even, mut odd) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
        // One position into one chain. SAFETY (callers): row p has hd values, d0 + 8 R <= hd.
        let step = |acc: &mut [__m256; R], p: usize| {
            let wv = _mm256_set1_ps(w[p]);
            let row = unsafe { values.as_ptr().add(p * hd + d0) };
            for (r, a) in acc.iter_mut().enumerate() {
                let v = unsafe { _mm256_loadu_ps(row.add(8 * r)) };
                *a = _mm256_fmadd_ps(wv, v, *a);
            }
        };
        let mut p = 0;
        while p + 2 <= w.len() {
            step(&mut even, p);
            step(&mut odd, p + 1);
            p += 2;
        }
        if p < w.len() {
            step(&mut even, p);
        }
        for r in 0..R {
            let sum = _mm256_add_ps(even[r], odd[r]);
            // SAFETY: d0 + 8 R <= hd.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(d0 + 8 * r), sum) };
        }
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA; `values` holds `w.len()` rows of `out.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_sum_avx2(w: &[f32], values: &[f32], out: &mut [f32]) {
        let hd = out.len();
        assert!(values.len() >= w.len() * hd);
        let mut d0 = 0;
        // SAFETY (all calls): each stays inside `d0 + 8 R <= hd`.
        while d0 + 32 <= hd {
            unsafe { wsum256::<4>(w, values, d0, out) };
            d0 += 32;
        }
        while d0 + 8 <= hd {
            unsafe { wsum256::<1>(w, values, d0, out) };
            d0 += 8;
        }
        if d0 < hd {
            let rows = values.chunks_exact(hd).take(w.len());
            let rest: Vec<f32> = rows.flat_map(|v| v[d0..].iter().copied()).collect();
            super::weighted_sum_portable(w, &rest, &mut out[d0..]);
        }
    }
}

#[cfg(test)]
mod tests;
