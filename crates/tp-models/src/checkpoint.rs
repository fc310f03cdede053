//! Checkpoint access by canonical weight name, handing out only the requested rows or columns
//! (docs/design.md "Loading": each rank materializes only its own byte ranges).

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use std::collections::HashMap;
use std::ops::Range;

pub use tp_spec::{expected_weights, Expected, WeightName, TENSORS_PER_LAYER};

/// A ggml tensor type as a checkpoint stores it: candle's types (the names are candle's) plus
/// IQ4_NL and IQ4_XS, which candle 0.11 cannot hold and only tp-kernels reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum GgmlDType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    /// ggml type 20: 32-element blocks of 18 bytes.
    IQ4_NL,
    /// ggml type 23: 256-element super-blocks of 136 bytes.
    IQ4_XS,
}

impl GgmlDType {
    /// candle's type, for the formats candle holds (`None`: IQ4_NL, IQ4_XS).
    pub fn candle(self) -> Option<candle_core::quantized::GgmlDType> {
        use candle_core::quantized::GgmlDType as C;
        Some(match self {
            GgmlDType::F32 => C::F32,
            GgmlDType::F16 => C::F16,
            GgmlDType::BF16 => C::BF16,
            GgmlDType::Q4_0 => C::Q4_0,
            GgmlDType::Q4_1 => C::Q4_1,
            GgmlDType::Q5_0 => C::Q5_0,
            GgmlDType::Q5_1 => C::Q5_1,
            GgmlDType::Q8_0 => C::Q8_0,
            GgmlDType::Q8_1 => C::Q8_1,
            GgmlDType::Q2K => C::Q2K,
            GgmlDType::Q3K => C::Q3K,
            GgmlDType::Q4K => C::Q4K,
            GgmlDType::Q5K => C::Q5K,
            GgmlDType::Q6K => C::Q6K,
            GgmlDType::Q8K => C::Q8K,
            GgmlDType::IQ4_NL | GgmlDType::IQ4_XS => return None,
        })
    }

    /// The tp-kernels format of the IQ4 types (those candle lacks).
    fn iq4(self) -> Option<tp_kernels::QuantType> {
        match self {
            GgmlDType::IQ4_NL => Some(tp_kernels::QuantType::IQ4_NL),
            GgmlDType::IQ4_XS => Some(tp_kernels::QuantType::IQ4_XS),
            _ => None,
        }
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        match (self.candle(), self.iq4()) {
            (Some(c), _) => c.block_size(),
            (None, Some(q)) => q.block_len(),
            (None, None) => 1,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match (self.candle(), self.iq4()) {
            (Some(c), _) => c.type_size(),
            (None, Some(q)) => q.block_bytes(),
            (None, None) => 1,
        }
    }

    /// The GGUF type id.
    pub fn type_id(self) -> u32 {
        match self {
            GgmlDType::F32 => 0,
            GgmlDType::F16 => 1,
            GgmlDType::Q4_0 => 2,
            GgmlDType::Q4_1 => 3,
            GgmlDType::Q5_0 => 6,
            GgmlDType::Q5_1 => 7,
            GgmlDType::Q8_0 => 8,
            GgmlDType::Q8_1 => 9,
            GgmlDType::Q2K => 10,
            GgmlDType::Q3K => 11,
            GgmlDType::Q4K => 12,
            GgmlDType::Q5K => 13,
            GgmlDType::Q6K => 14,
            GgmlDType::Q8K => 15,
            GgmlDType::IQ4_NL => 20,
            GgmlDType::IQ4_XS => 23,
            GgmlDType::BF16 => 30,
        }
    }
}

impl From<candle_core::quantized::GgmlDType> for GgmlDType {
    fn from(t: candle_core::quantized::GgmlDType) -> Self {
        use candle_core::quantized::GgmlDType as C;
        match t {
            C::F32 => GgmlDType::F32,
            C::F16 => GgmlDType::F16,
            C::BF16 => GgmlDType::BF16,
            C::Q4_0 => GgmlDType::Q4_0,
            C::Q4_1 => GgmlDType::Q4_1,
            C::Q5_0 => GgmlDType::Q5_0,
            C::Q5_1 => GgmlDType::Q5_1,
            C::Q8_0 => GgmlDType::Q8_0,
            C::Q8_1 => GgmlDType::Q8_1,
            C::Q2K => GgmlDType::Q2K,
            C::Q3K => GgmlDType::Q3K,
            C::Q4K => GgmlDType::Q4K,
            C::Q5K => GgmlDType::Q5K,
            C::Q6K => GgmlDType::Q6K,
            C::Q8K => GgmlDType::Q8K,
        }
    }
}

/// How a 2-D weight is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// ggml blocks along each row (`block_size` elements in `type_size` bytes).
    Quant(GgmlDType),
    /// Plain floats of `bytes` each (f32 4, f16/bf16 2).
    Float { bytes: usize },
}

impl Storage {
    /// Elements per storage block along a row (1 for plain floats).
    pub fn block(self) -> usize {
        match self {
            Storage::Quant(t) => t.block_size(),
            Storage::Float { .. } => 1,
        }
    }

    /// The storage as tp-spec's shard arithmetic sees it.
    pub fn layout(self) -> tp_spec::Layout {
        match self {
            Storage::Quant(t) => tp_spec::Layout::Blocks {
                block: t.block_size(),
                block_bytes: t.type_size(),
            },
            Storage::Float { .. } => tp_spec::Layout::Float,
        }
    }

    /// Bytes of `cols` elements of one row (`cols` a multiple of [`Storage::block`]).
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            Storage::Quant(t) => cols / t.block_size() * t.type_size(),
            Storage::Float { bytes } => cols * bytes,
        }
    }
}

/// Shape `[rows, cols]` (`[len, 1]` for vectors) and storage of a weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    pub rows: usize,
    pub cols: usize,
    pub storage: Storage,
}

/// Rows and columns of a weight as read from the file.
#[derive(Clone, Debug)]
pub enum WeightSlice {
    /// ggml blocks, `rows` rows of `cols` elements, row-major.
    Quant {
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        bytes: Vec<u8>,
    },
    /// A K-quant column range that starts or ends inside super-blocks: columns
    /// `[lead, lead + cols)` of `rows` rows of whole super-blocks (`bytes`, row-major,
    /// `ceil((lead + cols) / 256)` super-blocks a row); `lead` and `cols` are multiples of 32.
    QuantSub {
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        lead: usize,
        bytes: Vec<u8>,
    },
    /// `[rows, cols]` row-major f32.
    Dense {
        rows: usize,
        cols: usize,
        values: Vec<f32>,
    },
}

impl WeightSlice {
    pub fn rows(&self) -> usize {
        match self {
            WeightSlice::Quant { rows, .. }
            | WeightSlice::QuantSub { rows, .. }
            | WeightSlice::Dense { rows, .. } => *rows,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            WeightSlice::Quant { cols, .. }
            | WeightSlice::QuantSub { cols, .. }
            | WeightSlice::Dense { cols, .. } => *cols,
        }
    }
    /// Bytes held in memory.
    pub fn bytes(&self) -> usize {
        match self {
            WeightSlice::Quant { bytes, .. } | WeightSlice::QuantSub { bytes, .. } => bytes.len(),
            WeightSlice::Dense { values, .. } => values.len() * 4,
        }
    }

    /// The slice as `[rows, cols]` row-major f32: quantized blocks dequantized (tp-train's
    /// fine-tuning start reads whole weights this way).
    pub fn into_f32(self) -> Result<Vec<f32>> {
        match self {
            WeightSlice::Dense { values, .. } => Ok(values),
            WeightSlice::Quant {
                dtype,
                rows,
                cols,
                bytes,
            } => crate::matrix::dequantize_blocks(dtype, &bytes, rows, cols),
            WeightSlice::QuantSub {
                dtype,
                rows,
                cols,
                lead,
                bytes,
            } => {
                let width = (lead + cols).div_ceil(256) * 256;
                let all = crate::matrix::dequantize_blocks(dtype, &bytes, rows, width)?;
                Ok(all
                    .chunks_exact(width)
                    .flat_map(|r| r[lead..lead + cols].iter().copied())
                    .collect())
            }
        }
    }
}

/// A model file (or directory) that can hand out any weight's row or column range.
pub trait Checkpoint: Send + Sync {
    fn config(&self) -> &ModelConfig;
    /// Where the checkpoint came from, for messages.
    fn source(&self) -> &str;
    /// Shape and storage of `name`, or a MissingTensor error.
    fn meta(&self, name: WeightName) -> Result<TensorMeta>;
    /// Whether the weight exists (e.g. the untied output head).
    fn has(&self, name: WeightName) -> bool {
        self.meta(name).is_ok()
    }
    /// Rows `rows` with all columns, kept in the file's storage.
    fn rows(&self, name: WeightName, rows: Range<usize>) -> Result<WeightSlice>;
    /// All rows, columns `cols`. Quantized blocks are kept when `cols` is block aligned, and
    /// K-quant super-blocks when `cols` starts and ends on 32-wide sub-blocks
    /// ([`WeightSlice::QuantSub`]); otherwise the result is dequantized.
    fn cols(&self, name: WeightName, cols: Range<usize>) -> Result<WeightSlice>;
    /// A 1-D weight (norm scale, bias) or its range, as f32.
    fn vector(&self, name: WeightName, range: Option<Range<usize>>) -> Result<Vec<f32>>;
    /// The weight's tensor name in the file and the file, for messages.
    fn describe(&self, name: WeightName) -> String {
        format!("{name:?} in {}", self.source())
    }
    /// Lets the OS drop this process's resident pages of the file (they stay in the page
    /// cache and are read back if touched again). Call once the shards are loaded: a
    /// mapped file's pages otherwise count in the process's memory for as long as it runs.
    fn release_pages(&self) {}

    /// The stored bytes of rows `rows` of `name` with their ggml type, when they lie in memory
    /// as one row-major run (a mapped GGUF file): a loader can repack them without copying the
    /// slice first ([`crate::matrix::Matrix::from_rows`]). `None` when the checkpoint cannot
    /// lend them; then [`Checkpoint::rows`] copies.
    fn mapped_rows(
        &self,
        _name: WeightName,
        _rows: Range<usize>,
    ) -> Result<Option<(GgmlDType, &[u8])>> {
        Ok(None)
    }

    /// Lets the OS drop this process's resident pages of `bytes`, a part of what
    /// [`Checkpoint::mapped_rows`] lent (the pages at its ends may be shared with neighbours:
    /// they are read back from the file if touched again).
    fn release_bytes(&self, _bytes: &[u8]) {}

    /// Drops the tokenizer's vocabulary arrays from the file's metadata (GGUF's
    /// `tokenizer.ggml.*`: every token and merge as a string, tens of MB for a 151k-token
    /// vocabulary) once the tokenizer is built from them; nothing else reads them.
    fn forget_tokenizer_metadata(&mut self) {}
}

/// Refuses a config that declares more layers than `tensors` (the file's tensor count) can
/// hold, before anything loops over the layers: a config.json claiming 10^12 layers fails at
/// once instead of walking 10^12 missing tensors.
pub fn check_layer_count(cfg: &ModelConfig, tensors: usize, source: &str) -> Result<()> {
    let most = tensors / TENSORS_PER_LAYER;
    if cfg.layers > most {
        return Err(ModelError::Inconsistent {
            path: source.to_string(),
            reason: format!(
                "the config declares {} layers, but the file holds {tensors} tensors, enough for at most {most} ({TENSORS_PER_LAYER} per layer)",
                cfg.layers
            ),
        });
    }
    Ok(())
}

/// The weights of `cfg` by their name in a file format (`name_of`), with their shapes, the
/// optional ones ([`tp_spec::optional_weights`]) included. Call after [`check_layer_count`],
/// which bounds its size by the file's tensor count.
pub fn expected_by_name(
    cfg: &ModelConfig,
    name_of: impl Fn(WeightName) -> String,
) -> HashMap<String, (WeightName, Expected)> {
    expected_weights(cfg)
        .chain(tp_spec::optional_weights(cfg))
        .map(|(w, e)| (name_of(w), (w, e)))
        .collect()
}

/// Why a tensor the config does not call for is refused: a layer beyond the layer count, or
/// a name the architecture does not use (both would be silently ignored).
pub fn unused_tensor_reason(cfg: &ModelConfig, tensor: &str, layer: Option<usize>) -> String {
    match layer {
        _ if tp_spec::is_expert_tensor(tensor) => format!(
            "tensor {tensor} is a mixture-of-experts weight, but the config describes a dense {} model (no expert count); the metadata and the tensors disagree",
            cfg.arch.name()
        ),
        Some(l) if l >= cfg.layers => format!(
            "tensor {tensor} belongs to layer {l}, but the config declares {} layers (the layer count was lowered, or tensors were added)",
            cfg.layers
        ),
        _ => format!(
            "tensor {tensor} is not a weight of a {} model with this config (qkv bias {}, tied embeddings {}); it would be ignored",
            cfg.arch.name(),
            cfg.qkv_bias,
            cfg.tied_embeddings
        ),
    }
}

/// Checks at open that every weight the config calls for is present with its shape, so a
/// file that does not match its config fails with the tensor and file named before any
/// rank allocates (R4). Needs a config that passed [`ModelConfig::validate`] (no overflow).
pub fn validate_weights(ckpt: &dyn Checkpoint) -> Result<()> {
    validate_shapes(ckpt.config(), &|name| ckpt.meta(name), &|name| {
        ckpt.describe(name)
    })
}

/// [`validate_weights`] over a shape lookup `meta` and a namer `describe`; stops at the
/// first missing or misshapen weight.
pub fn validate_shapes(
    cfg: &ModelConfig,
    meta: &dyn Fn(WeightName) -> Result<TensorMeta>,
    describe: &dyn Fn(WeightName) -> String,
) -> Result<()> {
    for (name, want) in expected_weights(cfg) {
        let meta = meta(name)?;
        let ok = match want {
            Expected::Matrix { rows, cols } => meta.rows == rows && meta.cols == cols,
            Expected::Vector { len } => {
                meta.rows.min(meta.cols) == 1 && meta.rows.checked_mul(meta.cols) == Some(len)
            }
        };
        if !ok {
            let expected = match want {
                Expected::Matrix { rows, cols } => vec![rows, cols],
                Expected::Vector { len } => vec![len],
            };
            let found = if meta.cols == 1 {
                vec![meta.rows]
            } else {
                vec![meta.rows, meta.cols]
            };
            return Err(ModelError::TensorShape {
                name: describe(name),
                found,
                expected,
            });
        }
    }
    Ok(())
}

/// Rows from raw row-major bytes: dequantized to f32 when the storage is plain floats.
pub(crate) fn slice_from_bytes(
    storage: Storage,
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
    float_kind: FloatKind,
) -> WeightSlice {
    match storage {
        Storage::Quant(dtype) => WeightSlice::Quant {
            dtype,
            rows,
            cols,
            bytes,
        },
        Storage::Float { .. } => WeightSlice::Dense {
            rows,
            cols,
            values: float_kind.decode(&bytes),
        },
    }
}

/// Plain float encodings found in checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatKind {
    F32,
    F16,
    BF16,
}

impl FloatKind {
    pub fn bytes(self) -> usize {
        match self {
            FloatKind::F32 => 4,
            FloatKind::F16 | FloatKind::BF16 => 2,
        }
    }

    /// Little-endian bytes to f32 values.
    pub fn decode(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            FloatKind::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            FloatKind::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            FloatKind::BF16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    }
}

/// Copies rows `rows` (all columns) or columns `cols` (all rows) out of a row-major region.
pub(crate) fn copy_region(
    data: &[u8],
    meta: &TensorMeta,
    rows: Range<usize>,
    cols: Range<usize>,
) -> Vec<u8> {
    let row_bytes = meta.storage.row_bytes(meta.cols);
    if cols.start == 0 && cols.end == meta.cols {
        return data[rows.start * row_bytes..rows.end * row_bytes].to_vec();
    }
    let c0 = meta.storage.row_bytes(cols.start);
    let c1 = meta.storage.row_bytes(cols.end);
    let mut out = Vec::with_capacity(rows.len() * (c1 - c0));
    for r in rows {
        let base = r * row_bytes;
        out.extend_from_slice(&data[base + c0..base + c1]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// tp-spec's ggml table (read by the planner, without candle) agrees with candle's sizes
    /// for every quantization the kernels run.
    #[test]
    fn tp_spec_layouts_match_candle() {
        use GgmlDType::*;
        // ggml type ids (the GGUF spec's numbering).
        for (id, t) in [
            (2, Q4_0),
            (3, Q4_1),
            (6, Q5_0),
            (7, Q5_1),
            (8, Q8_0),
            (10, Q2K),
            (11, Q3K),
            (12, Q4K),
            (13, Q5K),
            (14, Q6K),
            (20, IQ4_NL),
            (23, IQ4_XS),
        ] {
            let layout = tp_spec::Layout::of_ggml_type(id);
            assert_eq!(layout, Some(Storage::Quant(t).layout()), "{t:?}");
            assert_eq!(t.type_id(), id, "{t:?}");
        }
        for id in [0, 1, 30] {
            assert_eq!(
                tp_spec::Layout::of_ggml_type(id),
                Some(tp_spec::Layout::Float)
            );
        }
        assert_eq!(
            tp_spec::Layout::of_ggml_type(9),
            None,
            "Q8_1 is no weight format"
        );
    }
}
