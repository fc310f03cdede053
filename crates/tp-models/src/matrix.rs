//! A rank's local weight matrix `[rows = out_local, cols = in_local]`, kept quantized or dense,
//! with `y [n, rows] = x [n, cols] · Wᵀ` on f32 activations and row lookup for embeddings.

use crate::checkpoint::GgmlDType;
use crate::checkpoint::{Checkpoint, WeightName, WeightSlice};
use crate::error::{ModelError, Result};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use tp_kernels::{DenseMatrix, QuantMatrix, QuantType};

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
    /// How the KV cache stores keys and values.
    pub kv_dtype: crate::KvDtype,
    /// Expert-parallel groups of a mixture of experts ([`tp_spec::ExpertShard`]): 1 slices
    /// every expert over all ranks, tp gives each rank whole experts. Must divide tp.
    pub expert_groups: usize,
    /// Mixture of experts: each expert takes at most `ceil(f x tokens x k / E)` of a step's
    /// (token, expert) pairs ([`crate::CapacityFactor`]), the later ones in the step's token
    /// order dropped and counted; `None` (the default): no pair is dropped. Refused on a
    /// dense model ([`tp_spec::check_capacity`]).
    pub expert_capacity: Option<crate::CapacityFactor>,
    /// Pipeline stages (`tp_spec::Stage`): the ranks form `pipeline_stages` groups of tp
    /// ranks, each holding a contiguous range of layers. 1 without pipelining.
    pub pipeline_stages: usize,
    /// How the layers are divided among the stages ([`tp_spec::StageSplit`]): balanced by
    /// the cost model (the default) or as given.
    pub stage_split: tp_spec::StageSplit,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            keep_quantized: true,
            dense: DenseDType::F32,
            kv_dtype: crate::KvDtype::F32,
            expert_groups: 1,
            expert_capacity: None,
            pipeline_stages: 1,
            stage_split: tp_spec::StageSplit::default(),
        }
    }
}

#[derive(Debug)]
enum Store {
    /// ggml blocks through our kernels (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K,
    /// Q6_K).
    Quant(QuantMatrix),
    /// Other ggml types through candle's quantized matmul.
    CandleQuant {
        q: QMatMul,
        qt: std::sync::Arc<QTensor>,
    },
    /// f32, f16 or bf16 through our kernels.
    Dense(DenseMatrix),
}

/// Our kernel's type for a ggml type, where there is one.
fn kernel_type(t: GgmlDType) -> Option<QuantType> {
    Some(match t {
        GgmlDType::Q4_0 => QuantType::Q4_0,
        GgmlDType::Q4_1 => QuantType::Q4_1,
        GgmlDType::Q8_0 => QuantType::Q8_0,
        GgmlDType::Q5_0 => QuantType::Q5_0,
        GgmlDType::Q5_1 => QuantType::Q5_1,
        GgmlDType::Q2K => QuantType::Q2_K,
        GgmlDType::Q3K => QuantType::Q3_K,
        GgmlDType::Q4K => QuantType::Q4_K,
        GgmlDType::Q5K => QuantType::Q5_K,
        GgmlDType::Q6K => QuantType::Q6_K,
        GgmlDType::IQ4_NL => QuantType::IQ4_NL,
        GgmlDType::IQ4_XS => QuantType::IQ4_XS,
        _ => return None,
    })
}

/// candle's type for `t`, or a typed error for the types only our kernels read.
fn candle_type(t: GgmlDType) -> Result<candle_core::quantized::GgmlDType> {
    t.candle().ok_or_else(|| ModelError::UnsupportedDType {
        name: "(candle path)".to_string(),
        dtype: format!("{t:?}"),
    })
}

/// `rows` rows of `cols` elements of ggml blocks of type `t` (`bytes`, row-major) dequantized
/// to f32, row-major: by tp-kernels for the types candle cannot hold (IQ4_NL, IQ4_XS; the
/// same arithmetic as ggml's reference), otherwise by candle. A byte count that does not
/// match the shape is a typed error.
pub(crate) fn dequantize_blocks(
    t: GgmlDType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>> {
    if t.candle().is_none() {
        if let Some(k) = kernel_type(t) {
            let m = QuantMatrix::from_ggml_bytes(k, rows, cols, bytes.to_vec())?;
            let mut out = vec![0.0f32; rows * cols];
            for (r, row) in out.chunks_exact_mut(cols.max(1)).enumerate().take(rows) {
                m.dequantize_row(r, row)?;
            }
            return Ok(out);
        }
    }
    let dev = Device::Cpu;
    let shape = if rows == 1 {
        vec![cols]
    } else {
        vec![rows, cols]
    };
    let q = qtensor_from_ggml(candle_type(t)?, bytes, shape, &dev)?;
    Ok(q.dequantize(&dev)?.flatten_all()?.to_vec1::<f32>()?)
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

/// Rows a mapped matrix is repacked by at a time before its file pages go
/// ([`Matrix::from_rows`]): a few MB of the file resident at once.
const PART_ROWS: usize = 4096;

impl Matrix {
    /// Rows `rows` of `name`: repacked straight from the checkpoint's mapped bytes when it
    /// lends them and our kernels run the type (kept quantized), `PART_ROWS` rows at a time,
    /// letting each part's file pages go once packed, so the matrix is built beside neither a
    /// copy of its slice nor its resident file (Qwen2.5's 151936-row embedding: 145 MB each);
    /// otherwise from the slice [`Checkpoint::rows`] copies. The same matrix either way.
    pub fn from_rows(
        ckpt: &dyn Checkpoint,
        name: WeightName,
        rows: std::ops::Range<usize>,
        opts: LoadOptions,
    ) -> Result<Self> {
        if opts.keep_quantized {
            if let Some((dtype, bytes)) = ckpt.mapped_rows(name, rows.clone())? {
                if let Some(t) = kernel_type(dtype) {
                    let cols = ckpt.meta(name)?.cols;
                    let m = QuantMatrix::from_ggml_parts(
                        t,
                        rows.len(),
                        cols,
                        bytes,
                        PART_ROWS,
                        |done| ckpt.release_bytes(&bytes[done]),
                    )?;
                    return Ok(Matrix {
                        bytes: m.storage_bytes(),
                        store: Store::Quant(m),
                        rows: rows.len(),
                        cols,
                        format: format!("{dtype:?}"),
                    });
                }
            }
        }
        Self::from_slice(ckpt.rows(name, rows)?, opts)
    }

    /// Materializes a slice read from a checkpoint.
    pub fn from_slice(slice: WeightSlice, opts: LoadOptions) -> Result<Self> {
        let (rows, cols) = (slice.rows(), slice.cols());
        let dev = Device::Cpu;
        match slice {
            WeightSlice::Quant { dtype, bytes, .. } if opts.keep_quantized => {
                let format = format!("{dtype:?}");
                if let Some(t) = kernel_type(dtype) {
                    let m = QuantMatrix::from_ggml_bytes(t, rows, cols, bytes)?;
                    return Ok(Matrix {
                        bytes: m.storage_bytes(),
                        store: Store::Quant(m),
                        rows,
                        cols,
                        format,
                    });
                }
                let qt = std::sync::Arc::new(qtensor_from_ggml(
                    candle_type(dtype)?,
                    &bytes,
                    vec![rows, cols],
                    &dev,
                )?);
                Ok(Matrix {
                    store: Store::CandleQuant {
                        q: QMatMul::from_arc(qt.clone())?,
                        qt,
                    },
                    rows,
                    cols,
                    bytes: bytes.len(),
                    format,
                })
            }
            WeightSlice::Quant { dtype, bytes, .. } => {
                let values = dequantize_blocks(dtype, &bytes, rows, cols)?; // [rows * cols]
                Self::dense(rows, cols, values, opts.dense)
            }
            WeightSlice::QuantSub {
                dtype, lead, bytes, ..
            } => match kernel_type(dtype) {
                Some(t) if opts.keep_quantized => {
                    let m = QuantMatrix::from_ggml_sub_blocks(t, rows, lead, cols, bytes)?;
                    Ok(Matrix {
                        bytes: m.storage_bytes(),
                        store: Store::Quant(m),
                        rows,
                        cols,
                        format: format!("{dtype:?} sub-blocks"),
                    })
                }
                _ => {
                    let covered = (lead + cols).div_ceil(dtype.block_size()) * dtype.block_size();
                    let all = dequantize_blocks(dtype, &bytes, rows, covered)?; // [rows, covered]
                    let part = all
                        .chunks_exact(covered.max(1))
                        .flat_map(|row| &row[lead..lead + cols])
                        .copied()
                        .collect(); // [rows, cols]
                    Self::dense(rows, cols, part, opts.dense)
                }
            },
            WeightSlice::Dense { values, .. } => Self::dense(rows, cols, values, opts.dense),
        }
    }

    /// A row-parallel weight's shard, split across ranks in units of `unit` columns: a K-quant
    /// whose super-block `unit` does not divide takes the sub-block form at every tp (the
    /// whole weight at tp 1 included), so that the shards' f64 partial sums add up to the
    /// same bits at every split. Other slices load as [`Matrix::from_slice`].
    pub fn from_row_parallel_slice(
        slice: WeightSlice,
        unit: usize,
        opts: LoadOptions,
    ) -> Result<Self> {
        let k_quant = |t: GgmlDType| kernel_type(t).is_some_and(|k| k.block_len() == 256);
        let slice = match slice {
            WeightSlice::Quant {
                dtype,
                rows,
                cols,
                bytes,
            } if opts.keep_quantized && k_quant(dtype) && !unit.is_multiple_of(256) => {
                WeightSlice::QuantSub {
                    dtype,
                    rows,
                    cols,
                    lead: 0,
                    bytes,
                }
            }
            other => other,
        };
        Self::from_slice(slice, opts)
    }

    fn dense(rows: usize, cols: usize, values: Vec<f32>, dtype: DenseDType) -> Result<Self> {
        let store = match dtype {
            DenseDType::F32 => Store::Dense(DenseMatrix::from_f32(rows, cols, values)?),
            DenseDType::F16 => Store::Dense(DenseMatrix::from_f32_as_f16(rows, cols, &values)?),
            DenseDType::BF16 => Store::Dense(DenseMatrix::from_f32_as_bf16(rows, cols, &values)?),
        };
        Ok(Matrix {
            store,
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
        matches!(self.store, Store::Quant(_) | Store::CandleQuant { .. })
    }

    /// `y [n, rows] = x [n, cols] · Wᵀ`, on the calling thread for our kernels.
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
        match &self.store {
            Store::Quant(m) => Ok(m.matmul(x, n, y)?),
            Store::Dense(m) => Ok(m.matmul(x, n, y)?),
            Store::CandleQuant { q, .. } => {
                let xt = Tensor::from_slice(x, (n, self.cols), &Device::Cpu)?; // [n, cols]
                copy_out(&q.forward(&xt)?, y)
            }
        }
    }

    /// `y [n, rows] += x [n, cols] · Wᵀ` with each block's contribution formed in f32 and the
    /// blocks summed in f64, so that splitting the columns at block boundaries over ranks and
    /// adding the parts in f64 gives the same bits as the whole (row-parallel layers).
    /// Formats without our kernels compute in f32 and widen (not split-invariant).
    pub fn matmul_wide_acc(&self, x: &[f32], n: usize, y: &mut [f64]) -> Result<()> {
        match &self.store {
            Store::Quant(m) => Ok(m.matmul_wide_acc(x, n, y)?),
            Store::Dense(m) => Ok(m.matmul_wide_acc(x, n, y)?),
            Store::CandleQuant { .. } => {
                let mut narrow = vec![0f32; y.len()]; // [n, rows]
                self.matmul(x, n, &mut narrow)?;
                for (w, v) in y.iter_mut().zip(narrow) {
                    *w += f64::from(v);
                }
                Ok(())
            }
        }
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
        match &self.store {
            Store::Quant(m) => Ok(m.dequantize_row(row, out)?),
            Store::Dense(m) => Ok(m.dequantize_row(row, out)?),
            Store::CandleQuant { qt, .. } => {
                let idx = Tensor::new(&[row as u32], &Device::Cpu)?;
                copy_out(&qt.embedding(&idx)?, out)
            }
        }
    }
}

/// Copies a candle tensor's f32 values into `out` (same element count).
fn copy_out(t: &Tensor, out: &mut [f32]) -> Result<()> {
    let values = t.flatten_all()?.to_vec1::<f32>()?;
    if values.len() != out.len() {
        return Err(ModelError::Input(format!(
            "a product gave {} values for {} outputs",
            values.len(),
            out.len()
        )));
    }
    out.copy_from_slice(&values);
    Ok(())
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
        WeightSlice::QuantSub { .. } => None,
    }
}

/// Whether ggml type `t` keeps whole blocks for a column range starting at `start` of `len`.
pub fn block_aligned(t: GgmlDType, start: usize, len: usize) -> bool {
    let b = t.block_size();
    start.is_multiple_of(b) && len.is_multiple_of(b)
}
