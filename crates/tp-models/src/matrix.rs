//! A rank's local weight matrix `[rows = out_local, cols = in_local]`, kept quantized or dense,
//! with `y [n, rows] = x [n, cols] · Wᵀ` on f32 activations and row lookup for embeddings.

use crate::checkpoint::WeightSlice;
use crate::error::{ModelError, Result};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

/// Element type for weights that are not kept quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseDType {
    F32,
    F16,
    BF16,
}

impl DenseDType {
    pub fn candle(self) -> DType {
        match self {
            DenseDType::F32 => DType::F32,
            DenseDType::F16 => DType::F16,
            DenseDType::BF16 => DType::BF16,
        }
    }
    pub fn bytes(self) -> usize {
        match self {
            DenseDType::F32 => 4,
            DenseDType::F16 | DenseDType::BF16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DenseDType::F32 => "f32",
            DenseDType::F16 => "f16",
            DenseDType::BF16 => "bf16",
        }
    }
}

/// How weights are materialized on a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Keep ggml-quantized shards quantized where block aligned (quantized matmul).
    pub keep_quantized: bool,
    /// Element type of every weight that is not kept quantized.
    pub dense: DenseDType,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            keep_quantized: true,
            dense: DenseDType::F32,
        }
    }
}

#[derive(Debug)]
enum Store {
    /// ggml blocks through candle's quantized matmul.
    Quant {
        q: QMatMul,
        qt: std::sync::Arc<QTensor>,
    },
    /// `[rows, cols]` in the dense dtype.
    Dense(Tensor),
}

/// One rank's weight matrix.
#[derive(Debug)]
pub struct Matrix {
    store: Store,
    rows: usize,
    cols: usize,
    bytes: usize,
    format: String,
}

impl Matrix {
    /// Materializes a slice read from a checkpoint.
    pub fn from_slice(slice: WeightSlice, opts: LoadOptions) -> Result<Self> {
        let (rows, cols) = (slice.rows(), slice.cols());
        let dev = Device::Cpu;
        match slice {
            WeightSlice::Quant { dtype, bytes, .. } if opts.keep_quantized => {
                let qt =
                    std::sync::Arc::new(qtensor_from_ggml(dtype, &bytes, vec![rows, cols], &dev)?);
                let q = QMatMul::from_arc(qt.clone())?;
                Ok(Matrix {
                    store: Store::Quant { q, qt },
                    rows,
                    cols,
                    bytes: bytes.len(),
                    format: format!("{dtype:?}"),
                })
            }
            WeightSlice::Quant { dtype, bytes, .. } => {
                let q = qtensor_from_ggml(dtype, &bytes, vec![rows, cols], &dev)?;
                let t = q.dequantize(&dev)?; // [rows, cols] f32
                Self::dense(t, opts.dense)
            }
            WeightSlice::Dense { values, .. } => {
                let t = Tensor::from_vec(values, (rows, cols), &dev)?; // [rows, cols]
                Self::dense(t, opts.dense)
            }
        }
    }

    fn dense(t: Tensor, dtype: DenseDType) -> Result<Self> {
        let (rows, cols) = t.dims2()?;
        Ok(Matrix {
            store: Store::Dense(t.to_dtype(dtype.candle())?),
            rows,
            cols,
            bytes: rows * cols * dtype.bytes(),
            format: dtype.name().to_string(),
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes this matrix holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Storage format for reports ("Q4_1", "f32", ...).
    pub fn format(&self) -> &str {
        &self.format
    }
    pub fn is_quantized(&self) -> bool {
        matches!(self.store, Store::Quant { .. })
    }

    /// `y [n, rows] = x [n, cols] · Wᵀ`.
    pub fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) -> Result<()> {
        if x.len() != n * self.cols || y.len() != n * self.rows {
            return Err(ModelError::Input(format!(
                "matmul of a [{}, {}] weight got {} inputs and {} outputs for {n} rows",
                self.rows,
                self.cols,
                x.len(),
                y.len()
            )));
        }
        let xt = Tensor::from_slice(x, (n, self.cols), &Device::Cpu)?; // [n, cols]
        let out = match &self.store {
            Store::Quant { q, .. } => q.forward(&xt)?, // [n, rows]
            Store::Dense(w) => xt
                .to_dtype(w.dtype())?
                .matmul(&w.t()?)?
                .to_dtype(DType::F32)?, // [n, rows]
        };
        let values = out.flatten_all()?.to_vec1::<f32>()?;
        y.copy_from_slice(&values);
        Ok(())
    }

    /// Row `row` as f32 into `out [cols]` (embedding lookup).
    pub fn row_into(&self, row: usize, out: &mut [f32]) -> Result<()> {
        if row >= self.rows || out.len() != self.cols {
            return Err(ModelError::Input(format!(
                "row {row} of a [{}, {}] weight into {} values",
                self.rows,
                self.cols,
                out.len()
            )));
        }
        let values = match &self.store {
            Store::Quant { qt, .. } => {
                let idx = Tensor::new(&[row as u32], &Device::Cpu)?;
                qt.embedding(&idx)?.flatten_all()?.to_vec1::<f32>()?
            }
            Store::Dense(w) => w.get(row)?.to_dtype(DType::F32)?.to_vec1::<f32>()?,
        };
        out.copy_from_slice(&values);
        Ok(())
    }
}

/// Several projections of the same input (Q, K, V or gate, up) computed into one
/// `[n, sum(widths)]` output: one fused matrix when the parts share a storage type.
#[derive(Debug)]
pub struct Projection {
    parts: Vec<Matrix>,
    widths: Vec<usize>,
    bias: Option<Vec<f32>>, // [sum(widths)]
}

impl Projection {
    /// `parts` are row slices with optional biases, in output order.
    pub fn new(parts: Vec<(WeightSlice, Option<Vec<f32>>)>, opts: LoadOptions) -> Result<Self> {
        let widths: Vec<usize> = parts.iter().map(|(s, _)| s.rows()).collect();
        let any_bias = parts.iter().any(|(_, b)| b.is_some());
        let mut bias = Vec::new();
        let mut slices = Vec::with_capacity(parts.len());
        for (s, b) in parts {
            match b {
                Some(b) if b.len() != s.rows() => {
                    return Err(ModelError::Config(format!(
                        "bias of {} values for a projection of {} outputs",
                        b.len(),
                        s.rows()
                    )))
                }
                Some(b) => bias.extend(b),
                None => bias.extend(std::iter::repeat_n(0.0, s.rows())),
            }
            slices.push(s);
        }
        let matrices = match concat_rows(&slices) {
            Some(fused) => vec![Matrix::from_slice(fused, opts)?],
            None => slices
                .into_iter()
                .map(|s| Matrix::from_slice(s, opts))
                .collect::<Result<Vec<_>>>()?,
        };
        Ok(Projection {
            parts: matrices,
            widths,
            bias: any_bias.then_some(bias),
        })
    }

    /// Output width `sum(widths)`.
    pub fn width(&self) -> usize {
        self.widths.iter().sum()
    }

    pub fn bytes(&self) -> usize {
        self.parts.iter().map(Matrix::bytes).sum::<usize>()
            + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }

    pub fn matrices(&self) -> &[Matrix] {
        &self.parts
    }

    /// `x [n, in]` -> `y [n, width]`, the parts side by side.
    pub fn forward(&self, x: &[f32], n: usize, y: &mut [f32]) -> Result<()> {
        let width = self.width();
        if let [m] = self.parts.as_slice() {
            m.matmul(x, n, y)?;
        } else {
            let mut start = 0;
            for m in &self.parts {
                let w = m.rows();
                let mut part = vec![0f32; n * w]; // [n, w]
                m.matmul(x, n, &mut part)?;
                for t in 0..n {
                    y[t * width + start..t * width + start + w]
                        .copy_from_slice(&part[t * w..(t + 1) * w]);
                }
                start += w;
            }
        }
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(width) {
                for (v, bb) in row.iter_mut().zip(b) {
                    *v += bb;
                }
            }
        }
        Ok(())
    }
}

/// Row slices with equal columns and storage concatenated into one, or `None` when their
/// storages differ (then each part keeps its own matrix).
fn concat_rows(parts: &[WeightSlice]) -> Option<WeightSlice> {
    let first = parts.first()?;
    let cols = first.cols();
    let rows: usize = parts.iter().map(WeightSlice::rows).sum();
    match first {
        WeightSlice::Quant { dtype, .. } => {
            let mut bytes = Vec::new();
            for p in parts {
                match p {
                    WeightSlice::Quant {
                        dtype: d,
                        bytes: b,
                        cols: c,
                        ..
                    } if d == dtype && *c == cols => bytes.extend_from_slice(b),
                    _ => return None,
                }
            }
            Some(WeightSlice::Quant {
                dtype: *dtype,
                rows,
                cols,
                bytes,
            })
        }
        WeightSlice::Dense { .. } => {
            let mut values = Vec::new();
            for p in parts {
                match p {
                    WeightSlice::Dense {
                        values: v, cols: c, ..
                    } if *c == cols => values.extend_from_slice(v),
                    _ => return None,
                }
            }
            Some(WeightSlice::Dense { rows, cols, values })
        }
    }
}

/// Whether ggml type `t` keeps whole blocks for a column range starting at `start` of `len`.
pub fn block_aligned(t: GgmlDType, start: usize, len: usize) -> bool {
    let b = t.block_size();
    start.is_multiple_of(b) && len.is_multiple_of(b)
}
