//! Causal attention of a step's new tokens over a sequence's cached keys and values: one
//! arithmetic (the portable functions here), run as written or with AVX2 / AVX-512 vectors,
//! with the same bits on every path, at every batch size and at every tp.
//!
//! The arithmetic, per query head `q` and position range `first..seen`:
//! - score `s_p = dot(q, k_p) * scale`, where [`dot`] sums in 8 lanes (`d mod 8`), then the
//!   lanes in order;
//! - `m = max s_p`, `e_p = exp_det(s_p - m)` ([`exp_det`]: only multiplies, adds and bit
//!   operations, so a vector lane computes what the scalar does), summed in 16 lanes by
//!   absolute position (`p mod 16`) and the lanes folded in halves (8, 4, 2, 1);
//! - weights `w_p = e_p * (1 / sum)`, output `o = Σ_p w_p v_p` in position order.
//!
//! Scores are computed key by key from `[positions, head_dim]` keys, or, when many queries
//! share a KV head (prefill), sixteen keys at a time from keys transposed to tiles of
//! `[head_dim, 16]`: one lane per key, the same additions in the same order.

use crate::exp::exp_det;
use crate::kv_cache::LayerKv;
use crate::ops::fold16;

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

/// How the arithmetic is run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Path {
    /// The path of the kernels in use (`tp_kernels::kernel_path`).
    pub fn current() -> Path {
        match tp_kernels::kernel_path() {
            #[cfg(target_arch = "x86_64")]
            "avx512" => Path::Avx512,
            #[cfg(target_arch = "x86_64")]
            "avx2" => Path::Avx2,
            _ => Path::Portable,
        }
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
    let mut scores = vec![0f32; padded]; // by absolute position
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
        for &h in &heads {
            for (i, row) in qkv.chunks_exact(qkv_w).enumerate() {
                let seen = pos0 + i + 1;
                let first = window.map_or(0, |w| seen.saturating_sub(w));
                let q = &row[h * hd..(h + 1) * hd]; // [hd]
                let (base, end) = (first / LANES * LANES, seen.div_ceil(LANES) * LANES);
                let s = &mut scores[base..end];
                let (lo, hi) = (first - base, seen - base);
                if tiled {
                    scores_tiled(path, q, &tiles[base * hd..end * hd], scale, s);
                } else {
                    scores_by_key(path, q, &keys[first * hd..seen * hd], scale, &mut s[lo..hi]);
                }
                softmax(path, s, lo, hi);
                let out = &mut ctx[i * q_w + h * hd..i * q_w + (h + 1) * hd]; // [hd]
                weighted_sum(path, &s[lo..hi], &values[first * hd..seen * hd], out);
            }
        }
    }
}

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

/// `a · b`: eight lanes (`d mod 8`) summed in order of `d`, then the lanes in order, then
/// what is left past a multiple of 8. Multiplies and adds are separate (no FMA).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s = acc[0];
    for &v in &acc[1..] {
        s += v;
    }
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// Scores of positions in order: `s[j] = dot(q, keys[j]) * scale` (`keys [s.len(), hd]`).
fn scores_by_key(path: Path, q: &[f32], keys: &[f32], scale: f32, s: &mut [f32]) {
    match path {
        Path::Portable => scores_by_key_portable(q, keys, scale, s),
        // SAFETY: the avx2 and avx512 kernel paths are chosen only on CPUs with AVX2 and
        // AVX-512F (`tp_kernels`' detection).
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
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scores_by_key_avx2(q: &[f32], keys: &[f32], scale: f32, s: &mut [f32]) {
    scores_by_key_portable(q, keys, scale, s)
}

/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
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
    out.fill(0.0);
    for (&w, v) in w.iter().zip(values.chunks_exact(out.len().max(1))) {
        for (o, &x) in out.iter_mut().zip(v) {
            *o += w * x;
        }
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
                    *a = _mm512_add_ps(*a, _mm512_mul_ps(_mm512_set1_ps(q[d + l]), k));
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
                sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_set1_ps(qd), k));
            }
            sum = _mm512_mul_ps(sum, _mm512_set1_ps(scale));
            // SAFETY: s holds 16 values.
            unsafe { _mm512_storeu_ps(s.as_mut_ptr(), sum) };
        }
    }

    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
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
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(_mm256_set1_ps(q[d + l]), k));
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
                    sum = _mm256_add_ps(sum, _mm256_mul_ps(_mm256_set1_ps(qd), k));
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

    /// `out[d0..d0 + 16 R] = Σ_p w[p] values[p][d0..]`, R vectors held in registers.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `d0 + 16 R <= out.len()`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn wsum512<const R: usize>(w: &[f32], values: &[f32], d0: usize, out: &mut [f32]) {
        let hd = out.len();
        let mut acc = [_mm512_setzero_ps(); R];
        for (p, &wp) in w.iter().enumerate() {
            let wv = _mm512_set1_ps(wp);
            // SAFETY: row p has hd values and d0 + 16 R <= hd.
            let row = unsafe { values.as_ptr().add(p * hd + d0) };
            for (r, a) in acc.iter_mut().enumerate() {
                let v = unsafe { _mm512_loadu_ps(row.add(16 * r)) };
                *a = _mm512_add_ps(*a, _mm512_mul_ps(wv, v));
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // SAFETY: d0 + 16 R <= hd.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(d0 + 16 * r), *a) };
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
        while d0 + 128 <= hd {
            unsafe { wsum512::<8>(w, values, d0, out) };
            d0 += 128;
        }
        if d0 + 64 <= hd {
            unsafe { wsum512::<4>(w, values, d0, out) };
            d0 += 64;
        }
        while d0 + 16 <= hd {
            unsafe { wsum512::<1>(w, values, d0, out) };
            d0 += 16;
        }
        if d0 < hd {
            let mask: u16 = (1u16 << (hd - d0)) - 1;
            let mut acc = _mm512_setzero_ps();
            for (p, &wp) in w.iter().enumerate() {
                // SAFETY: the masked lanes are inside row p.
                let v = unsafe { _mm512_maskz_loadu_ps(mask, values.as_ptr().add(p * hd + d0)) };
                acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(wp), v));
            }
            // SAFETY: the masked lanes are inside out.
            unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr().add(d0), mask, acc) };
        }
    }

    /// `out[d0..d0 + 8 R] = Σ_p w[p] values[p][d0..]`, R vectors held in registers.
    ///
    /// # Safety
    /// The CPU must have AVX; `d0 + 8 R <= out.len()`.
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn wsum256<const R: usize>(w: &[f32], values: &[f32], d0: usize, out: &mut [f32]) {
        let hd = out.len();
        let mut acc = [_mm256_setzero_ps(); R];
        for (p, &wp) in w.iter().enumerate() {
            let wv = _mm256_set1_ps(wp);
            // SAFETY: row p has hd values and d0 + 8 R <= hd.
            let row = unsafe { values.as_ptr().add(p * hd + d0) };
            for (r, a) in acc.iter_mut().enumerate() {
                let v = unsafe { _mm256_loadu_ps(row.add(8 * r)) };
                *a = _mm256_add_ps(*a, _mm256_mul_ps(wv, v));
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // SAFETY: d0 + 8 R <= hd.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(d0 + 8 * r), *a) };
        }
    }

    /// # Safety
    /// The CPU must have AVX2; `values` holds `w.len()` rows of `out.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn weighted_sum_avx2(w: &[f32], values: &[f32], out: &mut [f32]) {
        let hd = out.len();
        assert!(values.len() >= w.len() * hd);
        let mut d0 = 0;
        // SAFETY (all calls): each stays inside `d0 + 8 R <= hd`.
        while d0 + 64 <= hd {
            unsafe { wsum256::<8>(w, values, d0, out) };
            d0 += 64;
        }
        while d0 + 8 <= hd {
            unsafe { wsum256::<1>(w, values, d0, out) };
            d0 += 8;
        }
        if d0 < hd {
            let rest = &mut out[d0..];
            rest.fill(0.0);
            for (p, &wp) in w.iter().enumerate() {
                let v = &values[p * hd + d0..(p + 1) * hd];
                for (o, &x) in rest.iter_mut().zip(v) {
                    *o += wp * x;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
