//! AVX2+FMA dense kernels: register tiles of T tokens x R rows of f32 dot products (f16
//! weights widened with F16C, bf16 by a 16-bit shift), blocked over rows so a block of W
//! stays in L2 across tiles; and the wide variant (per-32-column-chunk f32 dots summed in
//! f64, see `wide`).

use crate::dense::ToF32;
use half::{bf16, f16};
use std::arch::x86_64::*;

/// A weight element the kernel can load 8 of as f32 lanes (exactly what `to_f32` gives).
pub(crate) trait Weight: ToF32 {
    /// # Safety
    /// AVX2/F16C enabled; `p` valid for 8 reads.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl Weight for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable f32 and AVX.
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Weight for f16 {
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable f16 (16 bytes) and F16C; `f16` is a
        // transparent u16.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

impl Weight for bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable bf16 (16 bytes) and AVX2; `bf16` is a
        // transparent u16. A bf16 is the high half of the f32 with its value: zero-extended
        // to 32 bits and shifted up 16, it is that f32 exactly.
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i); // 8 x bf16
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }
}

/// Rows per block of W kept hot in L2 while every token tile passes over it.
fn row_block(cols: usize, elem_bytes: usize) -> usize {
    let rows = (256 * 1024) / (cols * elem_bytes).max(1);
    (rows / 24).max(1) * 24
}

/// `y [n, rows] = x [n, cols] · Wᵀ`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w.len() == rows * cols`,
/// `x.len() == n * cols`, `y.len() == n * rows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn matmul<W: Weight>(
    w: &[W],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    let rb = row_block(cols, std::mem::size_of::<W>());
    let mut r0 = 0;
    while r0 < rows {
        let r_end = rows.min(r0 + rb);
        let mut t0 = 0;
        while t0 < n {
            let t = (n - t0).min(4);
            // SAFETY: rows r0..r_end and tokens t0..t0+t are in range; the caller guarantees
            // the features and slice lengths.
            unsafe { rows_for_tile(w, cols, x, t0, t, r0, r_end, rows, y) };
            t0 += t;
        }
        r0 = r_end;
    }
}

/// All rows `r0..r_end` for tokens `t0..t0 + t`.
///
/// # Safety
/// As for [`matmul`], with `1 <= t <= 4`, `t0 + t <= n`, `r_end <= rows`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_for_tile<W: Weight>(
    w: &[W],
    cols: usize,
    x: &[f32],
    t0: usize,
    t: usize,
    r0: usize,
    r_end: usize,
    rows: usize,
    y: &mut [f32],
) {
    let xp = x.as_ptr().wrapping_add(t0 * cols);
    let yp = y.as_mut_ptr().wrapping_add(t0 * rows);
    let wp = w.as_ptr();
    // SAFETY: each call reads rows r..r+R (< r_end <= rows) of W and tokens t0..t0+t of x,
    // and writes y[(t0 + i) * rows + r + j] for i < t, j < R: all inside the slices.
    unsafe {
        let step = match t {
            1 => 8,
            2 => 6,
            3 => 4,
            _ => 3,
        };
        let mut r = r0;
        while r + step <= r_end {
            let wr = wp.add(r * cols);
            let yr = yp.add(r);
            match t {
                1 => tile::<W, 1, 8>(wr, xp, cols, yr, rows),
                2 => tile::<W, 2, 6>(wr, xp, cols, yr, rows),
                3 => tile::<W, 3, 4>(wr, xp, cols, yr, rows),
                _ => tile::<W, 4, 3>(wr, xp, cols, yr, rows),
            }
            r += step;
        }
        while r < r_end {
            let wr = wp.add(r * cols);
            let yr = yp.add(r);
            match t {
                1 => tile::<W, 1, 1>(wr, xp, cols, yr, rows),
                2 => tile::<W, 2, 1>(wr, xp, cols, yr, rows),
                3 => tile::<W, 3, 1>(wr, xp, cols, yr, rows),
                _ => tile::<W, 4, 1>(wr, xp, cols, yr, rows),
            }
            r += 1;
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// `T` tokens (rows of `x`, stride `cols`) against `R` rows of W (stride `cols`), written to
/// `y[t * y_stride + r]`.
///
/// # Safety
/// Features enabled; `w` valid for `R * cols` reads, `x` for `T * cols`, and `y` for writes
/// at `t * y_stride + r` (t < T, r < R).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<W: Weight, const T: usize, const R: usize>(
    w: *const W,
    x: *const f32,
    cols: usize,
    y: *mut f32,
    y_stride: usize,
) {
    // SAFETY: all offsets stay below `R * cols` for w, `T * cols` for x (k + 8 <= cols in the
    // vector loop, k < cols in the tail), and at the promised y positions.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); R]; T];
        let mut k = 0;
        while k + 8 <= cols {
            let mut wv = [_mm256_setzero_ps(); R];
            for (r, v) in wv.iter_mut().enumerate() {
                *v = W::load8(w.add(r * cols + k));
            }
            for (ti, acc_t) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(x.add(ti * cols + k));
                for (a, &wr) in acc_t.iter_mut().zip(&wv) {
                    *a = _mm256_fmadd_ps(xv, wr, *a);
                }
            }
            k += 8;
        }
        for (ti, acc_t) in acc.iter().enumerate() {
            for (r, &a) in acc_t.iter().enumerate() {
                let mut s = hsum(a);
                for kk in k..cols {
                    s += *x.add(ti * cols + kk) * (*w.add(r * cols + kk)).to_f32();
                }
                *y.add(ti * y_stride + r) = s;
            }
        }
    }
}

/// Widens the 8 f32 lanes of `c` to f64 and adds them to `acc` (lanes 0..4, 4..8).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn add_wide(acc: &mut [__m256d; 2], c: __m256) {
    acc[0] = _mm256_add_pd(acc[0], _mm256_cvtps_pd(_mm256_castps256_ps128(c)));
    acc[1] = _mm256_add_pd(acc[1], _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(c)));
}

/// `y [n, rows] += x [n, cols] · Wᵀ`, each 32-column chunk's dot product formed in f32 by the
/// fixed formula of `wide` (8-lane FMA chains, then a fixed tree of sums) and added in f64.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w.len() == rows * cols`,
/// `x.len() == n * cols`, `y.len() == n * rows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn matmul_wide<W: Weight>(
    w: &[W],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f64],
) {
    let rb = row_block(cols, std::mem::size_of::<W>());
    let mut r0 = 0;
    while r0 < rows {
        let r_end = rows.min(r0 + rb);
        let mut t0 = 0;
        while t0 < n {
            let t = (n - t0).min(2);
            // SAFETY: rows r0..r_end and tokens t0..t0+t are in range; the caller guarantees
            // the features and slice lengths.
            unsafe { wide_rows_for_tile(w, cols, x, t0, t, r0, r_end, rows, y) };
            t0 += t;
        }
        r0 = r_end;
    }
}

/// All rows `r0..r_end` for tokens `t0..t0 + t` (`t` is 1 or 2): 8 rows x 1 token or 4 rows
/// x 2 tokens per register tile, then single rows.
///
/// # Safety
/// As for [`matmul_wide`], with `1 <= t <= 2`, `t0 + t <= n`, `r_end <= rows`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn wide_rows_for_tile<W: Weight>(
    w: &[W],
    cols: usize,
    x: &[f32],
    t0: usize,
    t: usize,
    r0: usize,
    r_end: usize,
    rows: usize,
    y: &mut [f64],
) {
    let xp = x.as_ptr().wrapping_add(t0 * cols);
    let yp = y.as_mut_ptr().wrapping_add(t0 * rows);
    let wp = w.as_ptr();
    // SAFETY: each call reads rows r..r+R (< r_end <= rows) of W and tokens t0..t0+t of x,
    // and updates y[(t0 + i) * rows + r + j] for i < t, j < R: all inside the slices.
    unsafe {
        let step = if t == 1 { 8 } else { 4 };
        let mut r = r0;
        while r + step <= r_end {
            let (wr, yr) = (wp.add(r * cols), yp.add(r));
            match t {
                1 => wide_tile::<W, 1, 8>(wr, xp, cols, yr, rows),
                _ => wide_tile::<W, 2, 4>(wr, xp, cols, yr, rows),
            }
            r += step;
        }
        while r < r_end {
            let (wr, yr) = (wp.add(r * cols), yp.add(r));
            match t {
                1 => wide_tile::<W, 1, 1>(wr, xp, cols, yr, rows),
                _ => wide_tile::<W, 2, 1>(wr, xp, cols, yr, rows),
            }
            r += 1;
        }
    }
}

/// `T` tokens against `R` rows (1, 4 or 8) of W, all chunks; adds each output's f64 sum to
/// `y[t * y_stride + r]`.
///
/// # Safety
/// Features enabled; `w` valid for `R * cols` reads (row stride `cols`), `x` for `T * cols`,
/// and `y` for reads and writes at `t * y_stride + r` (t < T, r < R).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn wide_tile<W: Weight, const T: usize, const R: usize>(
    w: *const W,
    x: *const f32,
    cols: usize,
    y: *mut f64,
    y_stride: usize,
) {
    // SAFETY: whole chunks read columns k..k + 32 <= cols of each row and token; the last,
    // partial chunk is copied into zero-padded buffers first; y as promised.
    unsafe {
        let mut acc = [[_mm256_setzero_pd(); 2]; T];
        let full = cols / 32;
        for c in 0..full {
            let sums = chunk::<W, T, R>(w.add(32 * c), x.add(32 * c), cols);
            for (a, &s) in acc.iter_mut().zip(&sums) {
                add_wide(a, s);
            }
        }
        let (k, tail) = (32 * full, cols - 32 * full);
        if tail > 0 {
            let mut xb = [[0.0f32; 32]; T];
            let mut wb = [[0.0f32; 32]; R];
            for (ti, b) in xb.iter_mut().enumerate() {
                for (i, v) in b[..tail].iter_mut().enumerate() {
                    *v = *x.add(ti * cols + k + i);
                }
            }
            for (r, b) in wb.iter_mut().enumerate() {
                for (i, v) in b[..tail].iter_mut().enumerate() {
                    *v = (*w.add(r * cols + k + i)).to_f32();
                }
            }
            let sums = chunk::<f32, T, R>(wb.as_ptr().cast(), xb.as_ptr().cast(), 32);
            for (a, &s) in acc.iter_mut().zip(&sums) {
                add_wide(a, s);
            }
        }
        for (ti, a) in acc.iter().enumerate() {
            let mut o = [0.0f64; 8];
            _mm256_storeu_pd(o.as_mut_ptr(), a[0]);
            _mm256_storeu_pd(o.as_mut_ptr().add(4), a[1]);
            for (r, &v) in o[..R].iter().enumerate() {
                *y.add(ti * y_stride + r) += v;
            }
        }
    }
}

/// One chunk of 32 columns: for each token, a vector whose lanes `0..R` hold the chunk sums
/// of rows `0..R` (other lanes: don't care, but finite for finite inputs).
///
/// # Safety
/// Features enabled; `w` valid for 32 reads at each row `r < R` (stride `stride`), `x` for
/// 32 reads at each token `t < T` (same stride).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunk<W: Weight, const T: usize, const R: usize>(
    w: *const W,
    x: *const f32,
    stride: usize,
) -> [__m256; T] {
    // SAFETY: offsets `r * stride + 8 * s + 0..8` and `t * stride + 8 * s + 0..8`, s < 4.
    unsafe {
        let mut l = [[_mm256_setzero_ps(); R]; T];
        for s in 0..4 {
            let mut wv = [_mm256_setzero_ps(); R];
            for (r, v) in wv.iter_mut().enumerate() {
                *v = W::load8(w.add(r * stride + 8 * s));
            }
            for (ti, lt) in l.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(x.add(ti * stride + 8 * s));
                for (a, &wr) in lt.iter_mut().zip(&wv) {
                    *a = _mm256_fmadd_ps(xv, wr, *a);
                }
            }
        }
        let mut out = [_mm256_setzero_ps(); T];
        for (o, lt) in out.iter_mut().zip(&l) {
            *o = reduce_rows(lt);
        }
        out
    }
}

/// `hadd(a, b)` = [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]; two levels give
/// lanes `[a, b, c, d]` of `(l0+l1)+(l2+l3)` for rows a..d, then `[a, b, c, d]` of
/// `(l4+l5)+(l6+l7)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quad(a: __m256, b: __m256, c: __m256, d: __m256) -> __m256 {
    _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d))
}

/// Row `r`'s lanes `v[r]` summed as `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`
/// into lane `r` of the result, for 8, 4 or 1 rows (lanes past `v.len()`: don't care).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce_rows(v: &[__m256]) -> __m256 {
    match v.len() {
        8 => {
            let q0 = quad(v[0], v[1], v[2], v[3]);
            let q1 = quad(v[4], v[5], v[6], v[7]);
            let lo = _mm256_permute2f128_ps::<0x20>(q0, q1);
            let hi = _mm256_permute2f128_ps::<0x31>(q0, q1);
            _mm256_add_ps(lo, hi)
        }
        4 => {
            let q = quad(v[0], v[1], v[2], v[3]);
            let s = _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps::<1>(q));
            _mm256_set_m128(s, s)
        }
        _ => {
            let q = quad(v[0], v[0], v[0], v[0]);
            let s = _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps::<1>(q));
            _mm256_set_m128(s, s)
        }
    }
}
