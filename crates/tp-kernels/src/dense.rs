//! `DenseMatrix`: f32, f16 or bf16 weight matrices and their single-threaded matmul drivers
//! (f32 accumulation, or split-invariant f64 accumulation of 32-column chunks; AVX2+FMA with
//! F16C or shift widening, or portable code). Widening f16 or bf16 to f32 is exact, so a
//! 16-bit matrix gives the bits of the f32 matrix of its values on every path.

use crate::cpu::{self, Simd};
use crate::error::KernelError;
use crate::matrix::check_matmul_args;
use crate::wide;
use half::{bf16, f16};

/// Row-major `[rows, cols]` values of one element type. Built through [`DenseMatrix`].
#[derive(Clone, Debug, PartialEq)]
pub struct DenseData<T> {
    rows: usize,
    cols: usize,
    values: Vec<T>,
}

impl<T> DenseData<T> {
    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The `rows * cols` values, row-major.
    pub fn values(&self) -> &[T] {
        &self.values
    }
}

/// f32, f16 or bf16 weights, `[rows, cols]` row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum DenseMatrix {
    /// f32 weights.
    F32(DenseData<f32>),
    /// f16 weights (half the bytes to stream), widened to f32 in the kernels.
    F16(DenseData<f16>),
    /// bf16 weights (half the bytes, f32's exponent range), widened to f32 in the kernels.
    Bf16(DenseData<bf16>),
}

/// Runs `$body` with `$d` bound to the matrix's `DenseData` of whatever element type.
macro_rules! each_kind {
    ($m:expr, $d:ident => $body:expr) => {
        match $m {
            DenseMatrix::F32($d) => $body,
            DenseMatrix::F16($d) => $body,
            DenseMatrix::Bf16($d) => $body,
        }
    };
}

/// Row-major element count of `[rows, cols]`, checked.
fn element_count(rows: usize, cols: usize) -> Result<usize, KernelError> {
    rows.checked_mul(cols)
        .filter(|c| c.checked_mul(4).is_some())
        .ok_or(KernelError::ShapeOverflow { rows, cols })
}

impl DenseMatrix {
    /// f32 weights; `values.len()` must be `rows * cols`.
    pub fn from_f32(rows: usize, cols: usize, values: Vec<f32>) -> Result<Self, KernelError> {
        check_count(rows, cols, values.len())?;
        Ok(DenseMatrix::F32(DenseData { rows, cols, values }))
    }

    /// Weights given as f32, stored as f16 (round to nearest even).
    pub fn from_f32_as_f16(rows: usize, cols: usize, values: &[f32]) -> Result<Self, KernelError> {
        let values = rounded(rows, cols, values, f16::from_f32)?;
        Ok(DenseMatrix::F16(DenseData { rows, cols, values }))
    }

    /// Weights given as f32, stored as bf16 (round to nearest even).
    pub fn from_f32_as_bf16(rows: usize, cols: usize, values: &[f32]) -> Result<Self, KernelError> {
        let values = rounded(rows, cols, values, bf16::from_f32)?;
        Ok(DenseMatrix::Bf16(DenseData { rows, cols, values }))
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        each_kind!(self, d => d.rows)
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        each_kind!(self, d => d.cols)
    }

    /// The element type's name ("f32", "f16", "bf16").
    pub fn kind(&self) -> &'static str {
        match self {
            DenseMatrix::F32(_) => "f32",
            DenseMatrix::F16(_) => "f16",
            DenseMatrix::Bf16(_) => "bf16",
        }
    }

    /// Bytes of weight storage held.
    pub fn storage_bytes(&self) -> usize {
        each_kind!(self, d => std::mem::size_of_val(d.values.as_slice()))
    }

    /// `y [n, rows] = x [n, cols] · Wᵀ` with f32 accumulation, on the calling thread only.
    pub fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) -> Result<(), KernelError> {
        self.matmul_with(cpu::simd(), x, n, y)
    }

    /// [`DenseMatrix::matmul`] with an explicit kernel family (tests compare them).
    pub(crate) fn matmul_with(
        &self,
        simd: Simd,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let (rows, cols) = (self.rows(), self.cols());
        check_matmul_args(rows, cols, x, n, y.len())?;
        each_kind!(self, d => {
            #[cfg(target_arch = "x86_64")]
            if matches!(simd, Simd::Avx2 | Simd::Avx2Vnni | Simd::Avx512) {
                // SAFETY: the AVX2 paths and `Simd::Avx512` are only chosen after runtime
                // detection of AVX2, FMA and F16C; the lengths of `w`, `x` and `y` were
                // checked above.
                unsafe { crate::dense_avx2::matmul(&d.values, rows, cols, x, n, y) };
                return Ok(());
            }
            scalar_matmul(&d.values, rows, cols, x, y)
        });
        Ok(())
    }

    /// `y [n, rows] += x [n, cols] · Wᵀ` accumulated in f64 across fixed 32-column chunks
    /// counted from column 0 of this matrix: each chunk's dot product is formed in f32 by a
    /// fixed formula of that chunk's weights and activations only (8 lanes of FMA chains, then
    /// a fixed tree of sums; see the crate's `wide` module), then added to the f64 `y`. So
    /// splitting the columns at multiples of 32 and summing the parts' `y` in f64 gives the
    /// same values up to f64 rounding, in practice the same bits. AVX2 and scalar kernels
    /// give the same bits. Callers zero `y` first, or accumulate several matrices into it.
    pub fn matmul_wide_acc(&self, x: &[f32], n: usize, y: &mut [f64]) -> Result<(), KernelError> {
        self.matmul_wide_acc_with(cpu::simd(), x, n, y)
    }

    /// [`DenseMatrix::matmul_wide_acc`] with an explicit kernel family (tests compare them).
    pub(crate) fn matmul_wide_acc_with(
        &self,
        simd: Simd,
        x: &[f32],
        n: usize,
        y: &mut [f64],
    ) -> Result<(), KernelError> {
        let (rows, cols) = (self.rows(), self.cols());
        check_matmul_args(rows, cols, x, n, y.len())?;
        if rows == 0 || cols == 0 || n == 0 {
            return Ok(());
        }
        each_kind!(self, d => {
            #[cfg(target_arch = "x86_64")]
            if matches!(simd, Simd::Avx2 | Simd::Avx2Vnni | Simd::Avx512) {
                // SAFETY: the AVX2 paths and `Simd::Avx512` are only chosen after runtime
                // detection of AVX2, FMA and F16C; the lengths of `w`, `x` and `y` were
                // checked above.
                unsafe { crate::dense_avx2::matmul_wide(&d.values, rows, cols, x, n, y) };
                return Ok(());
            }
            scalar_matmul_wide(&d.values, rows, cols, x, y)
        });
        Ok(())
    }

    /// Row `row` of W as f32 into `out` (`cols` long).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<(), KernelError> {
        let (rows, cols) = (self.rows(), self.cols());
        if row >= rows {
            return Err(KernelError::RowOutOfRange { row, rows });
        }
        if out.len() != cols {
            return Err(KernelError::SliceLength {
                what: "out (cols)",
                expected: cols,
                got: out.len(),
            });
        }
        each_kind!(self, d => {
            for (o, &v) in out.iter_mut().zip(&d.values[row * cols..(row + 1) * cols]) {
                *o = v.to_f32();
            }
        });
        Ok(())
    }

    /// Stacks matrices of the same element type and column count along rows.
    pub fn concat_rows(parts: Vec<DenseMatrix>) -> Result<DenseMatrix, KernelError> {
        let first = parts.first().ok_or(KernelError::EmptyConcat)?;
        let describe = |m: &DenseMatrix| format!("{} with {} cols", m.kind(), m.cols());
        let cols = first.cols();
        let mut rows = 0usize;
        for (index, p) in parts.iter().enumerate() {
            if p.kind() != first.kind() || p.cols() != cols {
                return Err(KernelError::ConcatMismatch {
                    index,
                    expected: describe(first),
                    found: describe(p),
                });
            }
            rows = rows
                .checked_add(p.rows())
                .ok_or(KernelError::ShapeOverflow {
                    rows: usize::MAX,
                    cols,
                })?;
        }
        element_count(rows, cols)?;
        /// The parts' values of the element type `$v` holds, stacked.
        macro_rules! stack {
            ($v:ident) => {
                DenseMatrix::$v(DenseData {
                    rows,
                    cols,
                    values: parts
                        .iter()
                        .flat_map(|p| match p {
                            DenseMatrix::$v(d) => d.values.as_slice(),
                            _ => &[],
                        })
                        .copied()
                        .collect(),
                })
            };
        }
        Ok(match first {
            DenseMatrix::F32(_) => stack!(F32),
            DenseMatrix::F16(_) => stack!(F16),
            DenseMatrix::Bf16(_) => stack!(Bf16),
        })
    }
}

/// That `got` values fill `[rows, cols]`.
fn check_count(rows: usize, cols: usize, got: usize) -> Result<(), KernelError> {
    let expected = element_count(rows, cols)?;
    if got != expected {
        return Err(KernelError::ValueCount {
            rows,
            cols,
            expected,
            got,
        });
    }
    Ok(())
}

/// `values` (`rows * cols` of them, checked) rounded by `round`.
fn rounded<T>(
    rows: usize,
    cols: usize,
    values: &[f32],
    round: impl Fn(f32) -> T,
) -> Result<Vec<T>, KernelError> {
    check_count(rows, cols, values.len())?;
    Ok(values.iter().map(|&v| round(v)).collect())
}

/// A weight element read as f32 (exactly: f32 itself, or a 16-bit float widened).
pub(crate) trait ToF32: Copy {
    fn to_f32(self) -> f32;
}

impl ToF32 for f32 {
    fn to_f32(self) -> f32 {
        self
    }
}

impl ToF32 for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl ToF32 for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// Portable `y = x · Wᵀ`: one f32 dot product per output, the AVX2 kernel's arithmetic
/// (`dense_avx2::tile`): 8 lanes of fused multiply-adds in column order, the lanes summed in
/// halves (4, 2, 1), then the columns past a multiple of 8 one by one; so both give the
/// same bits.
fn scalar_matmul<T: ToF32>(w: &[T], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    if cols == 0 {
        y.fill(0.0);
        return;
    }
    for (xt, yt) in x.chunks_exact(cols).zip(y.chunks_exact_mut(rows.max(1))) {
        for (yr, wr) in yt.iter_mut().zip(w.chunks_exact(cols)) {
            let mut part = [0.0f32; 8];
            let (xc, wc) = (xt.chunks_exact(8), wr.chunks_exact(8));
            let (xtail, wtail) = (xc.remainder(), wc.remainder());
            for (xs, ws) in xc.zip(wc) {
                for i in 0..8 {
                    part[i] = xs[i].mul_add(ws[i].to_f32(), part[i]);
                }
            }
            let half: [f32; 4] = std::array::from_fn(|i| part[i] + part[i + 4]);
            let mut sum = (half[0] + half[2]) + (half[1] + half[3]);
            for (&a, &b) in xtail.iter().zip(wtail) {
                sum += a * b.to_f32();
            }
            *yr = sum;
        }
    }
}

/// Portable `y += x · Wᵀ` by the wide formula (`wide`): per 32-column chunk, lane `k % 8`
/// takes `fma(x_k, w_k, lane)` in column order, the lanes are summed in a fixed tree, and the
/// chunk sums are added in f64. `rows`, `cols` > 0.
fn scalar_matmul_wide<T: ToF32>(w: &[T], rows: usize, cols: usize, x: &[f32], y: &mut [f64]) {
    for (xt, yt) in x.chunks_exact(cols).zip(y.chunks_exact_mut(rows)) {
        for (yr, wr) in yt.iter_mut().zip(w.chunks_exact(cols)) {
            let mut acc = 0.0f64;
            for (xc, wc) in xt.chunks(32).zip(wr.chunks(32)) {
                let mut lanes = [0.0f32; 8];
                for (k, (&a, &b)) in xc.iter().zip(wc).enumerate() {
                    lanes[k % 8] = a.mul_add(b.to_f32(), lanes[k % 8]);
                }
                acc += wide::chunk_sum(&lanes) as f64;
            }
            *yr += acc;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: u32) -> Vec<f32> {
        tp_testkit::Rng::new(u64::from(seed)).uniform_vec(len, -0.5, 0.5)
    }

    #[test]
    fn avx2_and_scalar_dense_paths_agree() {
        if !cpu::supports(Simd::Avx2) {
            eprintln!("skipped: no AVX2+FMA+F16C on this CPU");
            return;
        }
        for (rows, cols) in [(1, 1), (3, 7), (17, 33), (25, 576), (50, 100)] {
            for n in [1usize, 2, 3, 4, 5, 9] {
                let w = values(rows * cols, (rows + cols) as u32);
                let x = values(n * cols, n as u32);
                for m in all_kinds(rows, cols, &w) {
                    let mut ya = vec![0.0; n * rows];
                    let mut ys = vec![0.0; n * rows];
                    m.matmul_with(Simd::Avx2, &x, n, &mut ya).unwrap();
                    m.matmul_with(Simd::Scalar, &x, n, &mut ys).unwrap();
                    for (a, s) in ya.iter().zip(&ys) {
                        assert_eq!(a.to_bits(), s.to_bits(), "{a} vs {s}");
                    }
                }
            }
        }
    }

    fn families() -> Vec<Simd> {
        let mut f = vec![Simd::Scalar];
        f.extend(cpu::available().into_iter().skip(1));
        f
    }

    fn all_kinds(rows: usize, cols: usize, w: &[f32]) -> [DenseMatrix; 3] {
        [
            DenseMatrix::from_f32(rows, cols, w.to_vec()).unwrap(),
            DenseMatrix::from_f32_as_f16(rows, cols, w).unwrap(),
            DenseMatrix::from_f32_as_bf16(rows, cols, w).unwrap(),
        ]
    }

    #[test]
    fn wide_avx2_and_scalar_dense_paths_give_the_same_bits() {
        if !cpu::supports(Simd::Avx2) {
            eprintln!("skipped: no AVX2+FMA+F16C on this CPU");
            return;
        }
        for (rows, cols) in [
            (1, 1),
            (3, 7),
            (17, 33),
            (25, 576),
            (50, 100),
            (9, 64),
            (12, 1536),
        ] {
            for n in [1usize, 2, 3, 4, 5, 9] {
                let w = values(rows * cols, (rows + cols) as u32);
                let x = values(n * cols, n as u32);
                for m in all_kinds(rows, cols, &w) {
                    let y0: Vec<f64> = (0..n * rows).map(|i| i as f64 * 0.5 - 1.0).collect();
                    let (mut ya, mut ys) = (y0.clone(), y0);
                    m.matmul_wide_acc_with(Simd::Avx2, &x, n, &mut ya).unwrap();
                    m.matmul_wide_acc_with(Simd::Scalar, &x, n, &mut ys)
                        .unwrap();
                    for (i, (a, s)) in ya.iter().zip(&ys).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            s.to_bits(),
                            "[{rows},{cols}] n={n} {i}: {a} vs {s}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn wide_dense_results_do_not_depend_on_the_column_split() {
        for simd in families() {
            // 100 and 33 end in a partial chunk, which stays in the last part.
            for (rows, cols) in [(13, 576), (10, 100), (4, 33), (9, 1536)] {
                let w = values(rows * cols, cols as u32);
                let chunks = cols.div_ceil(32);
                for n in [1usize, 2, 5, 128] {
                    let x = values(n * cols, 77 + n as u32);
                    for m in all_kinds(rows, cols, &w) {
                        let mut want = vec![0.0f64; n * rows];
                        m.matmul_wide_acc_with(simd, &x, n, &mut want).unwrap();
                        for cuts in crate::matrix::tests::splits(chunks) {
                            let mut sum = vec![0.0f64; n * rows];
                            for p in cuts.windows(2) {
                                let (c0, c1) = (32 * p[0], (32 * p[1]).min(cols));
                                let wp: Vec<f32> = w
                                    .chunks_exact(cols)
                                    .flat_map(|r| &r[c0..c1])
                                    .copied()
                                    .collect();
                                let part = match m {
                                    DenseMatrix::F32(_) => DenseMatrix::from_f32(rows, c1 - c0, wp),
                                    DenseMatrix::F16(_) => {
                                        DenseMatrix::from_f32_as_f16(rows, c1 - c0, &wp)
                                    }
                                    DenseMatrix::Bf16(_) => {
                                        DenseMatrix::from_f32_as_bf16(rows, c1 - c0, &wp)
                                    }
                                }
                                .unwrap();
                                let xp = crate::matrix::tests::x_columns(&x, cols, c0, c1);
                                let mut yp = vec![0.0f64; n * rows];
                                part.matmul_wide_acc_with(simd, &xp, n, &mut yp).unwrap();
                                for (s, v) in sum.iter_mut().zip(&yp) {
                                    *s += v;
                                }
                            }
                            for (i, (a, b)) in sum.iter().zip(&want).enumerate() {
                                assert_eq!(
                                    (*a as f32).to_bits(),
                                    (*b as f32).to_bits(),
                                    "{simd:?} [{rows},{cols}] n={n} cuts {cuts:?} {i}: {a} vs {b}"
                                );
                                assert_eq!(a.to_bits(), b.to_bits(), "f64 bits");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn wide_dense_stays_close_to_the_f32_product() {
        for simd in families() {
            for (rows, cols, n) in [(17, 33, 3), (25, 576, 5), (8, 2048, 2)] {
                let w = values(rows * cols, 5);
                let x = values(n * cols, 6);
                for m in all_kinds(rows, cols, &w) {
                    let mut y32 = vec![0.0f32; n * rows];
                    let mut y64 = vec![0.0f64; n * rows];
                    m.matmul_with(simd, &x, n, &mut y32).unwrap();
                    m.matmul_wide_acc_with(simd, &x, n, &mut y64).unwrap();
                    for (a, b) in y32.iter().zip(&y64) {
                        assert!((*a as f64 - b).abs() <= 1e-5 * cols as f64, "{a} vs {b}");
                    }
                }
            }
        }
    }
}
