//! The typed error every fallible kernel entry point returns.

use crate::format::QuantType;

/// What went wrong when building a matrix or calling a kernel. Messages name the offending
/// sizes so that a caller can tell which tensor or buffer was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A quantized matrix must have whole blocks along each row.
    #[error("{qtype} matrix needs cols to be a multiple of {block_len}, got cols = {cols}")]
    ColsNotBlockAligned {
        qtype: QuantType,
        cols: usize,
        block_len: usize,
    },
    /// The raw ggml bytes do not hold exactly `rows * cols / block_len` blocks.
    #[error("{qtype} matrix [{rows}, {cols}] needs {expected} bytes of ggml blocks, got {got}")]
    ByteLength {
        qtype: QuantType,
        rows: usize,
        cols: usize,
        expected: usize,
        got: usize,
    },
    /// The IQ4 quantizer takes IQ4_NL or IQ4_XS and whole blocks.
    #[error(
        "{values} values cannot be quantized as {qtype} blocks (IQ4_NL or IQ4_XS, whole blocks)"
    )]
    NotIq4Blocks { qtype: QuantType, values: usize },
    /// A dense matrix got a value vector of the wrong length.
    #[error("dense matrix [{rows}, {cols}] needs {expected} values, got {got}")]
    ValueCount {
        rows: usize,
        cols: usize,
        expected: usize,
        got: usize,
    },
    /// `rows * cols` (or a byte count derived from it) does not fit in `usize`.
    #[error("matrix shape [{rows}, {cols}] is too large to address")]
    ShapeOverflow { rows: usize, cols: usize },
    /// An input or output slice has the wrong length for the call.
    #[error("{what} has length {got}, expected {expected}")]
    SliceLength {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// A row index past the end of the matrix.
    #[error("row {row} is out of range for a matrix with {rows} rows")]
    RowOutOfRange { row: usize, rows: usize },
    /// `concat_rows` was given no matrices.
    #[error("concat_rows needs at least one matrix")]
    EmptyConcat,
    /// `concat_rows` parts disagree on format or column count.
    #[error("concat_rows part {index} is {found}, but part 0 is {expected}")]
    ConcatMismatch {
        index: usize,
        expected: String,
        found: String,
    },
    /// The sub-block form needs a K-quant and a column range starting below 256 with start
    /// and length multiples of 32.
    #[error("{qtype} sub-block matrix of {cols} cols from column {lead}: needs a K-quant, lead < 256, and lead and cols multiples of 32")]
    SubBlockRange {
        qtype: QuantType,
        lead: usize,
        cols: usize,
    },
    /// A kernel path name that is unknown or that this CPU cannot run.
    #[error("kernel path {path:?}: {reason}")]
    KernelPath { path: String, reason: String },
}
