//! `QuantMatrix`: a quantized weight matrix in the packed layout, and its matmul driver
//! (activation quantization into a reusable per-thread buffer, then 8-row x 4-token tiles),
//! for f32 accumulation (`matmul`) and split-invariant f64 accumulation (`matmul_wide_acc`),
//! and the K-quants' sub-block form (`from_ggml_sub_blocks`: a column range that may start
//! and end inside super-blocks, summed per 32-wide sub-block).

use crate::cpu::{self, Simd};
use crate::error::KernelError;
use crate::expand::{self, Expanded};
use crate::format::{dequantize_ggml_block, QuantType, QK_K};
#[cfg(target_arch = "x86_64")]
use crate::gemm_avx512::{ChunkOut, TokenLanes};
use crate::pack::{self, group_block_bytes, GROUP_ROWS};
use crate::quantize::{self, ActBlock};
use crate::quantize_k::{self, ActBlockK};
use crate::tile::{self, Form, TileOut, MAX_TILE};
use std::cell::RefCell;
use std::fmt;
use std::thread::LocalKey;

thread_local! {
    /// Quantized activations of the current call, kept between calls so the hot path does
    /// not allocate once it has grown to the largest `n * cols / 32` seen on this thread.
    static SCRATCH: RefCell<Vec<ActBlock>> = const { RefCell::new(Vec::new()) };
    /// The same for the K-quants' Q8_K blocks.
    static SCRATCH_K: RefCell<Vec<ActBlockK>> = const { RefCell::new(Vec::new()) };
    /// The AVX-512 kernels' activation vectors (`expand`), built once per call.
    static SCRATCH_X: RefCell<Vec<Expanded>> = const { RefCell::new(Vec::new()) };
    /// One group's weights unpacked for the AVX2 kernels (`Activation::unpack`).
    static SCRATCH_W: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    /// One group's weights unpacked for the AVX-512 many-token kernels (`gemm_avx512`).
    static SCRATCH_U: RefCell<Vec<Expanded>> = const { RefCell::new(Vec::new()) };
}

/// A `[rows, cols]` row-major matrix of ggml blocks (rows = output features, cols = input
/// features), held in an interleaved layout (8 rows per group) built once at load.
#[derive(Clone)]
pub struct QuantMatrix {
    qtype: QuantType,
    rows: usize,
    cols: usize,
    /// `pack::groups(rows) * nb` group blocks (see `pack`, `pack_k`).
    packed: Vec<u8>,
    /// The sub-block form (K-quants only): the matrix's columns start `lead` columns into its
    /// first super-block (the blocks hold `lead + cols` rounded up to 256 columns).
    sub_lead: Option<usize>,
}

impl fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuantMatrix")
            .field("qtype", &self.qtype)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("storage_bytes", &self.packed.len())
            .field("sub_lead", &self.sub_lead)
            .finish()
    }
}

/// Runs `f` on `len` elements of this thread's buffer `key` (grown as needed and kept for
/// the next call), or on a fresh buffer if it is already borrowed (only through
/// re-entrancy, which nothing here does; stay correct anyway).
fn with_scratch<T: Clone + Default + 'static, R>(
    key: &'static LocalKey<RefCell<Vec<T>>>,
    len: usize,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => {
            if scratch.len() < len {
                scratch.resize(len, T::default());
            }
            f(&mut scratch[..len])
        }
        Err(_) => f(&mut vec![T::default(); len]),
    })
}

/// Most bytes of expanded activations (AVX-512 kernels) one pass over the groups uses.
const EXPANDED_BUDGET: usize = 192 << 10;

/// Most bytes of transposed activations (AVX-512 many-token kernels) one pass over the
/// groups uses: they stay in L2 (2 MiB per core on the Intel kind) while every group reads
/// them; each pass unpacks every group once more.
#[cfg(target_arch = "x86_64")]
const GEMM_BUDGET: usize = 512 << 10;

/// Fewest tokens a product runs on the AVX-512 many-token kernels (`gemm_avx512`): at 8 a
/// chunk of 16 runs half empty, which roughly breaks even with the per-group kernels (the
/// full chunks measured about twice their speed at 128 tokens); the crossover itself is not
/// measured yet.
#[cfg(target_arch = "x86_64")]
const GEMM_MIN_TOKENS: usize = 8;

/// [`GEMM_MIN_TOKENS`] for `qtype`: IQ4_XS's many-token kernel (a scale multiply per sub-block
/// per 16 tokens) measured 0.6-0.9x its per-group kernels at 8-12 tokens and 1.1-1.4x at
/// 14-16 (`cargo bench -p tp-kernels --bench gemm`, Intel kind, 1536x1536), so it starts at 14.
#[cfg(target_arch = "x86_64")]
fn gemm_min_tokens(qtype: QuantType) -> usize {
    match qtype {
        QuantType::IQ4_XS => 14,
        _ => GEMM_MIN_TOKENS,
    }
}

/// Fewest tokens for which the AVX2 path unpacks a group's weights once for all its tiles
/// (`dot_avx2`'s Q4_0/Q4_1/Q5_0/Q5_1, `gemm_avx2_k`'s Q2_K, Q3_K, Q5_K, Q6_K) instead of
/// running the per-group kernels on the packed weights tile by tile: two tiles or more. At 5
/// tokens `gemm_avx2_k` measured 1.00x (Q2_K), 1.31x (Q3_K), 1.12x (Q5_K) and 1.08x (Q6_K)
/// the per-group kernels (`cargo bench -p tp-kernels --bench gemm`, AMD EPYC, load 3-4).
const AVX2_MIN_TOKENS: usize = MAX_TILE + 1;

/// `rows * cols / block_len * block_bytes`, checked: the ggml byte size of a matrix.
fn ggml_bytes(qtype: QuantType, rows: usize, cols: usize) -> Result<usize, KernelError> {
    let block_len = qtype.block_len();
    if !cols.is_multiple_of(block_len) {
        return Err(KernelError::ColsNotBlockAligned {
            qtype,
            cols,
            block_len,
        });
    }
    blocks_bytes(qtype, rows, cols / block_len, cols)
}

/// `rows * nb * block_bytes`, checked (`cols` only names the shape in the error).
fn blocks_bytes(
    qtype: QuantType,
    rows: usize,
    nb: usize,
    cols: usize,
) -> Result<usize, KernelError> {
    rows.checked_mul(nb)
        .and_then(|blocks| blocks.checked_mul(qtype.block_bytes()))
        // The packed form pads up to 7 rows more (and K-quants up to 19%); stay addressable.
        .filter(|&b| {
            let packed = pack::groups(rows).checked_mul(nb * group_block_bytes(qtype));
            packed.is_some_and(|p| p.checked_add(b).is_some())
        })
        .ok_or(KernelError::ShapeOverflow { rows, cols })
}

/// Checks that `x` is `[n, cols]` and `y` (`y_len` long) is `[n, rows]`.
pub(crate) fn check_matmul_args(
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y_len: usize,
) -> Result<(), KernelError> {
    let overflow = KernelError::ShapeOverflow { rows: n, cols };
    let want_x = n.checked_mul(cols).ok_or(overflow)?;
    if x.len() != want_x {
        return Err(KernelError::SliceLength {
            what: "x (n * cols)",
            expected: want_x,
            got: x.len(),
        });
    }
    let overflow = KernelError::ShapeOverflow {
        rows: n,
        cols: rows,
    };
    let want_y = n.checked_mul(rows).ok_or(overflow)?;
    if y_len != want_y {
        return Err(KernelError::SliceLength {
            what: "y (n * rows)",
            expected: want_y,
            got: y_len,
        });
    }
    Ok(())
}

/// What the driver produces per output: `f32` outputs written by `matmul`, or `f64` sums
/// added by `matmul_wide_acc`.
pub(crate) trait OutElem: Copy {
    /// Whether the kernels run their wide form.
    const WIDE: bool;
    /// Puts token `t`'s results of a group (`y.len() <= 8` rows) from `tile` into `y`.
    fn put(y: &mut [Self], tile: &TileOut, t: usize);
    /// A finished f64 sum as an output (the sub-block form's `matmul`).
    fn from_f64(v: f64) -> Self;
    /// Puts a many-token chunk's results of a group into `y` (`[tokens, rows]`): token `t0 +
    /// t` (`t < count`), rows `row0..row0 + valid` (`valid <= 8`) from lane `t` of `out`.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/VL and `y` must hold those rows of those tokens.
    #[cfg(target_arch = "x86_64")]
    unsafe fn put_lanes(y: &mut [Self], at: ChunkAt, out: &ChunkOut);
}

/// Asks for the cache line holding `v` (a hint: it never faults).
#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch<T>(v: &T) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    // Newer toolchains treat this intrinsic as safe; older ones may not.
    #[allow(unused_unsafe)]
    // SAFETY: a prefetch is only a hint, of a valid reference's address.
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>((v as *const T).cast::<i8>())
    }
}

/// Where a chunk's results go in a `[tokens, rows]` output.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct ChunkAt {
    /// The output's rows per token (the matrix's rows).
    pub rows: usize,
    /// The group's first row, and how many of its 8 rows exist.
    pub row0: usize,
    pub valid: usize,
    /// The chunk's first token, and its tokens (at most 16).
    pub t0: usize,
    pub count: usize,
}

#[cfg(target_arch = "x86_64")]
impl ChunkAt {
    /// Index of token `t0 + t`'s first row; panics unless the chunk's last row fits `len`.
    fn first(&self, t: usize, len: usize) -> usize {
        let end = (self.t0 + self.count - 1) * self.rows + self.row0 + self.valid;
        assert!(self.valid <= 8 && self.count >= 1 && end <= len);
        (self.t0 + t) * self.rows + self.row0
    }
}

impl OutElem for f32 {
    const WIDE: bool = false;
    fn put(y: &mut [f32], tile: &TileOut, t: usize) {
        for (o, &v) in y.iter_mut().zip(&tile.f32s[t]) {
            *o = v;
        }
    }
    fn from_f64(v: f64) -> f32 {
        v as f32
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl,avx2")]
    unsafe fn put_lanes(y: &mut [f32], at: ChunkAt, out: &ChunkOut) {
        use std::arch::x86_64::*;
        // Lane t of each of the 8 rows: 16 floats apart.
        let idx = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
        let mask = ((1u16 << at.valid) - 1) as __mmask8;
        let base = out.f32s.as_ptr().cast::<f32>();
        for t in 0..at.count {
            let i = at.first(t, y.len());
            // SAFETY: the gather reads out.f32s[0..8][t] (t < 16); the masked store writes
            // `valid` values inside y (checked by `first`).
            unsafe {
                let v = _mm256_i32gather_ps::<4>(base.add(t), idx);
                _mm256_mask_storeu_ps(y.as_mut_ptr().add(i), mask, v);
            }
        }
    }
}

impl OutElem for f64 {
    const WIDE: bool = true;
    fn put(y: &mut [f64], tile: &TileOut, t: usize) {
        for (o, &v) in y.iter_mut().zip(&tile.f64s[t]) {
            *o += v;
        }
    }
    fn from_f64(v: f64) -> f64 {
        v
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl,avx2")]
    unsafe fn put_lanes(y: &mut [f64], at: ChunkAt, out: &ChunkOut) {
        use std::arch::x86_64::*;
        // Lane t of each of the 8 rows: 16 doubles apart.
        let idx = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
        let mask = ((1u16 << at.valid) - 1) as __mmask8;
        let base = out.f64s.as_ptr().cast::<f64>();
        for t in 0..at.count {
            let i = at.first(t, y.len());
            // SAFETY: the gather reads out.f64s[0..8][t] (t < 16); the masked load and store
            // touch `valid` values inside y (checked by `first`).
            unsafe {
                let v = _mm512_i32gather_pd::<8>(idx, base.add(t));
                let p = y.as_mut_ptr().add(i);
                let sum = _mm512_add_pd(_mm512_maskz_loadu_pd(mask, p), v);
                _mm512_mask_storeu_pd(p, mask, sum);
            }
        }
    }
}

impl QuantMatrix {
    /// Takes raw ggml blocks (row-major, `rows * cols / block_len` blocks as stored in a GGUF
    /// file). Validates `cols % block_len == 0` (32, or 256 for K-quants) and
    /// `bytes.len() == rows * cols / block_len * block_bytes`.
    pub fn from_ggml_bytes(
        qtype: QuantType,
        rows: usize,
        cols: usize,
        bytes: Vec<u8>,
    ) -> Result<Self, KernelError> {
        let expected = ggml_bytes(qtype, rows, cols)?;
        Self::build(qtype, rows, cols, None, expected, bytes)
    }

    /// [`QuantMatrix::from_ggml_bytes`] from borrowed bytes (a mapped file's), packed
    /// `part_rows` rows at a time (rounded up to whole 8-row groups); `done` is told the range of
    /// `bytes` each part used once it is packed, so that a caller can let those file pages go:
    /// the matrix is built beside no copy of its ggml bytes. The same packed bytes as
    /// `from_ggml_bytes`.
    pub fn from_ggml_parts(
        qtype: QuantType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        part_rows: usize,
        mut done: impl FnMut(std::ops::Range<usize>),
    ) -> Result<Self, KernelError> {
        let expected = ggml_bytes(qtype, rows, cols)?;
        let mut m = Self::unpacked(qtype, rows, cols, None, expected, bytes.len())?;
        let nb = m.nb();
        let row_bytes = nb * qtype.block_bytes();
        let group_bytes = nb * pack::group_block_bytes(qtype);
        let part = part_rows.div_ceil(GROUP_ROWS).max(1) * GROUP_ROWS;
        let mut packed = vec![0u8; pack::groups(rows) * group_bytes];
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + part).min(rows);
            let src = r0 * row_bytes..r1 * row_bytes;
            let dst = r0 / GROUP_ROWS * group_bytes..pack::groups(r1) * group_bytes;
            pack::pack_into(qtype, r1 - r0, nb, &bytes[src.clone()], &mut packed[dst]);
            done(src);
            r0 = r1;
        }
        m.packed = packed;
        Ok(m)
    }

    /// Packs `bytes` (checked to be `expected` long) into a matrix of `nb()` blocks a row.
    fn build(
        qtype: QuantType,
        rows: usize,
        cols: usize,
        sub_lead: Option<usize>,
        expected: usize,
        bytes: Vec<u8>,
    ) -> Result<Self, KernelError> {
        let mut m = Self::unpacked(qtype, rows, cols, sub_lead, expected, bytes.len())?;
        m.packed = pack::pack(qtype, rows, m.nb(), &bytes);
        Ok(m)
    }

    /// A matrix with nothing packed yet, once its ggml bytes (`got` of them) are checked to be
    /// the `expected` length.
    fn unpacked(
        qtype: QuantType,
        rows: usize,
        cols: usize,
        sub_lead: Option<usize>,
        expected: usize,
        got: usize,
    ) -> Result<Self, KernelError> {
        if got != expected {
            return Err(KernelError::ByteLength {
                qtype,
                rows,
                cols,
                expected,
                got,
            });
        }
        Ok(QuantMatrix {
            qtype,
            rows,
            cols,
            packed: Vec::new(),
            sub_lead,
        })
    }

    /// The sub-block form of a K-quant (or IQ4_XS) matrix: columns `[lead, lead + cols)` of the whole
    /// super-blocks in `bytes` (row-major, `rows * ceil((lead + cols) / 256)` ggml
    /// super-blocks), for a tensor-parallel shard whose column range starts or ends inside a
    /// super-block. `lead` (below 256) and `cols` are multiples of 32. Its products quantize
    /// the activations per 32 columns and sum one contribution per 32-wide sub-block (formulas
    /// in the crate's `wide` module), so the sub-blocks of any split at multiples of 32 sum,
    /// in f64, to the same values as the whole matrix in this form: a model uses this form for
    /// a weight at every tp (`lead = 0` for the whole weight), not only where a shard cuts.
    /// [`QuantMatrix::matmul`] gives [`QuantMatrix::matmul_wide_acc`]'s sums rounded to f32.
    pub fn from_ggml_sub_blocks(
        qtype: QuantType,
        rows: usize,
        lead: usize,
        cols: usize,
        bytes: Vec<u8>,
    ) -> Result<Self, KernelError> {
        const SUB: usize = QK_K / 8;
        if !qtype.is_k_quant()
            || lead >= QK_K
            || !lead.is_multiple_of(SUB)
            || !cols.is_multiple_of(SUB)
        {
            return Err(KernelError::SubBlockRange { qtype, lead, cols });
        }
        let overflow = KernelError::ShapeOverflow { rows, cols };
        let nb = lead.checked_add(cols).ok_or(overflow)?.div_ceil(QK_K);
        let expected = blocks_bytes(qtype, rows, nb, cols)?;
        Self::build(qtype, rows, cols, Some(lead), expected, bytes)
    }

    /// `Some(lead)` for a matrix in the sub-block form ([`QuantMatrix::from_ggml_sub_blocks`]).
    pub fn sub_block_lead(&self) -> Option<usize> {
        self.sub_lead
    }

    /// The weight format.
    pub fn qtype(&self) -> QuantType {
        self.qtype
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of weight storage held: the ggml size, plus zero padding up to a multiple of
    /// 8 rows (and, for the K-quants but Q6_K, the unpacked scales and mins: 4 bytes per row
    /// and super-block for Q4_K and Q5_K, 16 for Q2_K, 4 for Q3_K).
    pub fn storage_bytes(&self) -> usize {
        self.packed.len()
    }

    /// The row-major ggml bytes this matrix was built from (whole super-blocks for the
    /// sub-block form).
    pub fn to_ggml_bytes(&self) -> Vec<u8> {
        pack::unpack(self.qtype, self.rows, self.nb(), &self.packed)
    }

    /// `y [n, rows] = x [n, cols] · Wᵀ` on the calling thread only. Activations are quantized
    /// to 8 bits as llama.cpp does (per 32-block as Q8_1 for Q4_1 and Q5_1 weights, Q8_0 for
    /// Q4_0, Q8_0 and Q5_0; per 256-block as Q8_K for the K-quants Q2_K..Q6_K), then the
    /// products are integer dot products scaled per block.
    pub fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) -> Result<(), KernelError> {
        self.product(self.default_simd(n), x, n, y)
    }

    /// The process's kernel path for a product of `n` tokens: [`cpu::simd`], except that
    /// where the default path is `avx2+vnni` on a CPU that also runs the AVX-512 kernels
    /// ([`cpu::wide_many_tokens`]), products of at least [`gemm_min_tokens`] tokens take the
    /// AVX-512 ones (the same bits): on the fleet's AMD kind they prefill faster while its
    /// one-token products are faster on the AVX2 code.
    fn default_simd(&self, n: usize) -> Simd {
        let simd = cpu::simd();
        #[cfg(target_arch = "x86_64")]
        if simd == Simd::Avx2Vnni && n >= gemm_min_tokens(self.qtype) && cpu::wide_many_tokens() {
            return Simd::Avx512;
        }
        let _ = n;
        simd
    }

    /// `y [n, rows] += x [n, cols] · Wᵀ` accumulated in f64 across blocks: each block's (or,
    /// for K-quants, each super-block's) contribution is formed in f32 exactly as a function
    /// of that block's weights and activations only (never of an accumulator), then added to
    /// the f64 `y`. So splitting the columns at block boundaries and summing the parts' `y` in
    /// f64 gives the same f64 values up to f64 rounding — in practice exactly the same bits,
    /// because sums of a few hundred f32 values whose magnitudes lie within a factor 2^20 of
    /// each other are exact in f64 (details in the crate's `wide` module).
    ///
    /// Activations are quantized per block exactly as in [`QuantMatrix::matmul`], so a
    /// column range's blocks see the same activation blocks. The AVX2 and scalar kernels give
    /// the same bits (formulas in the crate's `wide` module). Callers zero `y` first, or
    /// accumulate several matrices into it.
    pub fn matmul_wide_acc(&self, x: &[f32], n: usize, y: &mut [f64]) -> Result<(), KernelError> {
        self.product(self.default_simd(n), x, n, y)
    }

    /// [`QuantMatrix::matmul`] with an explicit kernel family (tests compare them).
    #[cfg(test)]
    pub(crate) fn matmul_with(
        &self,
        simd: Simd,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        self.product(simd, x, n, y)
    }

    /// [`QuantMatrix::matmul_wide_acc`] with an explicit kernel family (tests compare them).
    #[cfg(test)]
    pub(crate) fn matmul_wide_acc_with(
        &self,
        simd: Simd,
        x: &[f32],
        n: usize,
        y: &mut [f64],
    ) -> Result<(), KernelError> {
        self.product(simd, x, n, y)
    }

    /// The driver of both products: checks, quantizes the activations, runs the tiles.
    fn product<E: OutElem>(
        &self,
        simd: Simd,
        x: &[f32],
        n: usize,
        y: &mut [E],
    ) -> Result<(), KernelError> {
        check_matmul_args(self.rows, self.cols, x, n, y.len())?;
        if n == 0 || self.rows == 0 {
            return Ok(());
        }
        if self.sub_lead.is_some() && !E::WIDE {
            // The sub-block form only has the wide kernels: sum in f64, round once.
            let mut wide = vec![0.0f64; y.len()];
            self.product(simd, x, n, &mut wide)?;
            for (o, w) in y.iter_mut().zip(wide) {
                *o = E::from_f64(w);
            }
            return Ok(());
        }
        // Cannot overflow: n * cols did not, and nb * 256 < cols + 512.
        let blocks = n * self.nb();
        if let Some(lead) = self.sub_lead {
            with_scratch(&SCRATCH_K, blocks, |acts| {
                quantize_k::quantize_sub(x, n, self.cols, lead, acts);
                self.run_tiles(simd, acts, n, y);
            });
        } else if self.qtype.is_k_quant() {
            with_scratch(&SCRATCH_K, blocks, |acts| {
                quantize_k::quantize(simd, x, acts);
                self.run_tiles(simd, acts, n, y);
            });
        } else {
            with_scratch(&SCRATCH, blocks, |acts| {
                quantize::quantize(simd, x, acts);
                self.run_tiles(simd, acts, n, y);
            });
        }
        Ok(())
    }

    /// The packed groups (tests call kernels on them directly).
    #[cfg(test)]
    pub(crate) fn packed_for_tests(&self) -> &[u8] {
        &self.packed
    }

    /// Blocks per row.
    fn nb(&self) -> usize {
        match self.sub_lead {
            Some(lead) => (lead + self.cols).div_ceil(QK_K),
            None => self.cols / self.qtype.block_len(),
        }
    }

    /// What the kernels form for output elements `E`.
    fn form<E: OutElem>(&self) -> Form {
        match (self.sub_lead, E::WIDE) {
            (Some(_), _) => Form::WideSub,
            (None, true) => Form::Wide,
            (None, false) => Form::F32,
        }
    }

    /// Runs all groups against tiles of up to `MAX_TILE` tokens of quantized activations
    /// (`acts.len() == n * nb`); for the AVX-512 kernels, first lays the activation words
    /// out for them (`expand`), once for all groups, in chunks of tokens whose expanded
    /// vectors stay within [`EXPANDED_BUDGET`] so that they stay in L2 while every group
    /// passes over them (the vectors are 8 times the activation bytes).
    fn run_tiles<A: Activation, E: OutElem>(&self, simd: Simd, acts: &[A], n: usize, y: &mut [E]) {
        if A::many_tokens(self, simd, acts, n, y) {
            return;
        }
        if simd != Simd::Avx512 {
            return self.run_tiles_with(simd, acts, &[], n, y);
        }
        let nb = self.nb();
        let per_token = nb * A::PER_BLOCK;
        let fit = EXPANDED_BUDGET / (per_token * std::mem::size_of::<Expanded>()).max(1);
        let chunk = (fit / MAX_TILE * MAX_TILE).clamp(MAX_TILE, n.max(MAX_TILE));
        let len = chunk.min(n) * per_token;
        let run = |ex: &mut [Expanded], y: &mut [E]| {
            let mut t0 = 0;
            while t0 < n {
                let t1 = n.min(t0 + chunk);
                let part = &acts[t0 * nb..t1 * nb];
                let ex = &mut ex[..(t1 - t0) * per_token];
                for (a, e) in part.iter().zip(ex.chunks_exact_mut(A::PER_BLOCK)) {
                    a.expand(self.qtype, e);
                }
                let y = &mut y[t0 * self.rows..t1 * self.rows];
                self.run_tiles_with(simd, part, ex, t1 - t0, y);
                t0 = t1;
            }
        };
        with_scratch(&SCRATCH_X, len, |ex| run(ex, y));
    }

    /// [`Self::run_tiles`] with the expanded activations (`ex`: empty, or `A::PER_BLOCK`
    /// vectors per activation block).
    fn run_tiles_with<A: Activation, E: OutElem>(
        &self,
        simd: Simd,
        acts: &[A],
        ex: &[Expanded],
        n: usize,
        y: &mut [E],
    ) {
        let nb = self.nb();
        let group_len = nb * group_block_bytes(self.qtype);
        let per_token = if ex.is_empty() { 0 } else { nb * A::PER_BLOCK };
        let mut tile_out = TileOut::default();
        // Weights unpacked once per group for all its tiles, where the kernels take that and
        // there are at least two tiles.
        let unpack_len = if n >= AVX2_MIN_TOKENS && !tile::legacy() {
            A::unpacked_len(self.qtype, simd, nb, n)
        } else {
            0
        };
        with_scratch(&SCRATCH_W, unpack_len, |unpacked| {
            for g in 0..pack::groups(self.rows) {
                let group = &self.packed[g * group_len..(g + 1) * group_len];
                if !unpacked.is_empty() {
                    A::unpack(self.qtype, simd, group, nb, unpacked);
                }
                let row0 = g * GROUP_ROWS;
                let valid = GROUP_ROWS.min(self.rows - row0);
                let mut t0 = 0;
                while t0 < n {
                    let tile = MAX_TILE.min(n - t0);
                    let tile = Tile {
                        acts: &acts[t0 * nb..(t0 + tile) * nb],
                        ex: &ex[t0 * per_token..(t0 + tile) * per_token],
                        unpacked,
                        tokens: tile,
                    };
                    let (qtype, form) = (self.qtype, self.form::<E>());
                    A::group_tile(qtype, simd, group, nb, &tile, form, &mut tile_out);
                    for t in 0..tile.tokens {
                        let at = (t0 + t) * self.rows + row0;
                        E::put(&mut y[at..at + valid], &tile_out, t);
                    }
                    t0 += tile.tokens;
                }
            }
        });
    }

    /// Runs the product on the many-token kernels when `simd` is AVX-512, `n` is at least
    /// [`gemm_min_tokens`] and they exist for this format and form; `false`: nothing ran.
    #[cfg(target_arch = "x86_64")]
    fn try_many_tokens<A: TokenLanes, E: OutElem>(
        &self,
        simd: Simd,
        acts: &[A],
        n: usize,
        y: &mut [E],
    ) -> bool {
        let on = simd == Simd::Avx512 && n >= gemm_min_tokens(self.qtype) && !tile::legacy();
        if on && A::supports(self.qtype, self.form::<E>()) {
            self.run_gemm512(acts, n, y);
            return true;
        }
        false
    }

    /// No many-token kernels off x86-64.
    #[cfg(not(target_arch = "x86_64"))]
    fn try_many_tokens<A, E: OutElem>(&self, _: Simd, _: &[A], _: usize, _: &mut [E]) -> bool {
        false
    }

    /// The whole product on the AVX-512 many-token kernels (`gemm_avx512`, `gemm_avx512_k`,
    /// `gemm_avx512_k4`, `gemm_avx512_k23`; the format is one they support): tokens in chunks of 16, as many
    /// chunks per pass over the groups as [`GEMM_BUDGET`] holds, each group unpacked once per
    /// pass.
    #[cfg(target_arch = "x86_64")]
    fn run_gemm512<A: TokenLanes, E: OutElem>(&self, acts: &[A], n: usize, y: &mut [E]) {
        use crate::gemm_avx512::LANES;
        let (qtype, nb) = (self.qtype, self.nb());
        let chunks = n.div_ceil(LANES);
        let per_chunk = nb * A::act_vecs(qtype);
        let fit = GEMM_BUDGET / (per_chunk * std::mem::size_of::<Expanded>()).max(1);
        let pass = fit.clamp(1, chunks);
        let group_len = nb * group_block_bytes(qtype);
        let mut out = ChunkOut::default();
        with_scratch(&SCRATCH_X, pass * per_chunk, |xt| {
            with_scratch(&SCRATCH_U, nb * A::w_vecs(qtype), |u| {
                let mut c0 = 0;
                while c0 < chunks {
                    let c1 = chunks.min(c0 + pass);
                    for (c, x) in (c0..c1).zip(xt.chunks_exact_mut(per_chunk)) {
                        let (t0, t1) = (c * LANES, n.min((c + 1) * LANES));
                        A::transpose(qtype, &acts[t0 * nb..t1 * nb], nb, x);
                    }
                    for g in 0..pack::groups(self.rows) {
                        let group = &self.packed[g * group_len..(g + 1) * group_len];
                        // SAFETY: the caller chose this path after runtime detection of
                        // AVX-512 F/BW/VL + VNNI (and AVX2, FMA, F16C) for a format
                        // `A::supports`; `group` holds `nb` group blocks and `u` is
                        // `nb * w_vecs` vectors long.
                        unsafe { A::unpack(qtype, group, nb, u) };
                        let row0 = g * GROUP_ROWS;
                        let valid = GROUP_ROWS.min(self.rows - row0);
                        for (c, x) in (c0..c1).zip(xt.chunks_exact(per_chunk)) {
                            let t0 = c * LANES;
                            let at = ChunkAt {
                                rows: self.rows,
                                row0,
                                valid,
                                t0,
                                count: LANES.min(n - t0),
                            };
                            // The chunk's output lines, one per token and strided by a
                            // whole row of y, are fetched while the kernel runs.
                            for t in 0..at.count {
                                let i = (t0 + t) * self.rows + row0;
                                if let Some(v) = y.get(i) {
                                    prefetch(v);
                                }
                            }
                            // SAFETY: as above; `x` is one chunk's `nb * act_vecs` vectors;
                            // `put_lanes` checks that the chunk's rows fit `y`.
                            unsafe {
                                A::group_chunk(qtype, u, x, nb, E::WIDE, &mut out);
                                E::put_lanes(y, at, &out);
                            }
                        }
                    }
                    c0 = c1;
                }
            })
        });
    }

    /// Row `row` of W, dequantized to f32 into `out` (`cols` long), bit-identical to ggml's
    /// reference dequantization (used for embedding lookup).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<(), KernelError> {
        if row >= self.rows {
            return Err(KernelError::RowOutOfRange {
                row,
                rows: self.rows,
            });
        }
        if out.len() != self.cols {
            return Err(KernelError::SliceLength {
                what: "out (cols)",
                expected: self.cols,
                got: out.len(),
            });
        }
        let nb = self.nb();
        let mut block = [0u8; 256];
        let block = &mut block[..self.qtype.block_bytes()];
        let bl = self.qtype.block_len();
        let lead = self.sub_lead.unwrap_or(0);
        let mut values = [0.0f32; QK_K];
        for b in 0..nb {
            pack::unpack_block(self.qtype, &self.packed, nb, row, b, block);
            dequantize_ggml_block(self.qtype, block, &mut values[..bl]);
            // This block's columns, as columns of the matrix (the sub-block form drops the
            // lead and the tail).
            let (c0, c1) = ((b * bl).max(lead), ((b + 1) * bl).min(lead + self.cols));
            out[c0 - lead..c1 - lead].copy_from_slice(&values[c0 - b * bl..c1 - b * bl]);
        }
        Ok(())
    }

    /// Stacks matrices of the same format and column count along rows (fused QKV, gate+up).
    pub fn concat_rows(parts: Vec<QuantMatrix>) -> Result<QuantMatrix, KernelError> {
        let first = parts.first().ok_or(KernelError::EmptyConcat)?;
        let (qtype, cols, sub_lead) = (first.qtype, first.cols, first.sub_lead);
        let describe = |m: &QuantMatrix| match m.sub_lead {
            None => format!("{} with {} cols", m.qtype, m.cols),
            Some(l) => format!(
                "{} with {} cols from column {l} (sub-block form)",
                m.qtype, m.cols
            ),
        };
        for (index, p) in parts.iter().enumerate() {
            if p.qtype != qtype || p.cols != cols || p.sub_lead != sub_lead {
                return Err(KernelError::ConcatMismatch {
                    index,
                    expected: describe(first),
                    found: describe(p),
                });
            }
        }
        let rows = parts
            .iter()
            .try_fold(0usize, |acc, p| acc.checked_add(p.rows))
            .ok_or(KernelError::ShapeOverflow {
                rows: usize::MAX,
                cols,
            })?;
        let nb = first.nb();
        blocks_bytes(qtype, rows, nb, cols)?;
        let last = parts.len() - 1;
        if parts[..last]
            .iter()
            .all(|p| p.rows.is_multiple_of(GROUP_ROWS))
        {
            // Whole groups only (but maybe the last): the packed bytes simply follow each other.
            let mut packed = Vec::with_capacity(parts.iter().map(|p| p.packed.len()).sum());
            for p in &parts {
                packed.extend_from_slice(&p.packed);
            }
            return Ok(QuantMatrix {
                qtype,
                rows,
                cols,
                packed,
                sub_lead,
            });
        }
        let mut bytes = Vec::with_capacity(rows * nb * qtype.block_bytes());
        for p in &parts {
            bytes.extend_from_slice(&p.to_ggml_bytes());
        }
        match sub_lead {
            Some(lead) => QuantMatrix::from_ggml_sub_blocks(qtype, rows, lead, cols, bytes),
            None => QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes),
        }
    }
}

/// One tile of tokens for a kernel call: `tokens` (1..=`MAX_TILE`) tokens' activation blocks, and
/// (AVX-512 only, otherwise empty) their expanded vectors.
struct Tile<'a, A> {
    acts: &'a [A],
    ex: &'a [Expanded],
    /// The group's weights unpacked by `Activation::unpack` for the AVX2 kernels, or empty.
    unpacked: &'a [u8],
    tokens: usize,
}

/// Quantized activation blocks with kernels: `ActBlock` (32-wide formats) and `ActBlockK`
/// (K-quants).
trait Activation: Sized {
    /// Expanded vectors per block for the AVX-512 kernels.
    const PER_BLOCK: usize;
    /// Lays this block out for the AVX-512 kernels of `qtype` (`out.len() == PER_BLOCK`).
    fn expand(&self, qtype: QuantType, out: &mut [Expanded]);
    /// Bytes of a group of `nb` blocks unpacked for the kernels of `simd` in a product of `n`
    /// tokens (0: they work on the packed weights).
    fn unpacked_len(_qtype: QuantType, _simd: Simd, _nb: usize, _n: usize) -> usize {
        0
    }
    /// Unpacks `group` into `out` (`unpacked_len` bytes) for the kernels of `simd`.
    fn unpack(_qtype: QuantType, _simd: Simd, _group: &[u8], _nb: usize, _out: &mut [u8]) {}
    /// Runs the whole product of `m` with `n` tokens on many-token kernels where `simd` has
    /// them for `m`'s format and `n` is large enough; `false`: nothing was run.
    fn many_tokens<E: OutElem>(
        _m: &QuantMatrix,
        _simd: Simd,
        _acts: &[Self],
        _n: usize,
        _y: &mut [E],
    ) -> bool {
        false
    }
    /// One group against one tile of tokens (`tile.acts.len() == tile.tokens * nb`), into
    /// `out.f32s`, or with the wide kernels (`form.wide()`) into `out.f64s`.
    fn group_tile(
        qtype: QuantType,
        simd: Simd,
        group: &[u8],
        nb: usize,
        tile: &Tile<'_, Self>,
        form: Form,
        out: &mut TileOut,
    );
}

impl Activation for ActBlock {
    const PER_BLOCK: usize = expand::PER_BLOCK;

    fn many_tokens<E: OutElem>(
        m: &QuantMatrix,
        simd: Simd,
        acts: &[Self],
        n: usize,
        y: &mut [E],
    ) -> bool {
        m.try_many_tokens(simd, acts, n, y)
    }

    fn expand(&self, _: QuantType, out: &mut [Expanded]) {
        expand::expand(self, out);
    }

    fn unpacked_len(qtype: QuantType, simd: Simd, nb: usize, _n: usize) -> usize {
        #[cfg(target_arch = "x86_64")]
        if simd.is_avx2() && crate::dot_avx2::unpacks(qtype) {
            return nb * crate::dot_avx2::UNPACKED_BLOCK;
        }
        let _ = (qtype, simd, nb);
        0
    }

    fn unpack(qtype: QuantType, simd: Simd, group: &[u8], nb: usize, out: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if simd.is_avx2()
            && crate::dot_avx2::unpacks(qtype)
            && group.len() >= nb * group_block_bytes(qtype)
            && out.len() >= nb * crate::dot_avx2::UNPACKED_BLOCK
        {
            // SAFETY: the AVX2 paths are only chosen after runtime detection of AVX2, FMA and
            // F16C; the slice lengths were checked just above.
            unsafe { crate::dot_avx2::unpack_group(qtype, group, nb, out) }
        }
        let _ = (qtype, simd, group, nb, out);
    }

    fn group_tile(
        qtype: QuantType,
        simd: Simd,
        group: &[u8],
        nb: usize,
        tile: &Tile<'_, Self>,
        form: Form,
        out: &mut TileOut,
    ) {
        let (acts, n, wide) = (tile.acts, tile.tokens, form.wide());
        match simd {
            #[cfg(target_arch = "x86_64")]
            s if s.is_avx2()
                && !tile.unpacked.is_empty()
                && tile.unpacked.len() >= nb * crate::dot_avx2::UNPACKED_BLOCK
                && crate::dot_avx2::unpacks(qtype) =>
            {
                let u = tile.unpacked;
                // SAFETY: as below, and `u` holds the group unpacked by `Self::unpack`
                // (`nb * UNPACKED_BLOCK` bytes, checked above) for this format.
                unsafe {
                    crate::dot_avx2::group_dot_unpacked(qtype, group, u, nb, acts, n, wide, out)
                }
            }
            #[cfg(target_arch = "x86_64")]
            s if s.is_avx2() => {
                // SAFETY: the AVX2 paths are only chosen after runtime detection of AVX2, FMA and
                // F16C (and `Simd::Avx2Vnni` of the VNNI encoding `s.vnni()` names); `group`
                // holds `nb` group blocks of this format and `acts` holds `n`
                // (1..=MAX_TILE) tokens of `nb` blocks, as sliced by `run_tiles_with`.
                let v = s.vnni();
                unsafe { crate::dot_avx2::group_dot(qtype, group, nb, acts, n, wide, v, out) }
            }
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 if tile.ex.len() == acts.len() * Self::PER_BLOCK && n <= MAX_TILE => {
                // SAFETY: `Simd::Avx512` is only chosen after runtime detection of AVX2, FMA,
                // F16C, AVX-512 F/BW/VL and VNNI; the slices are as for `Simd::Avx2`, and
                // `tile.ex` holds `PER_BLOCK` vectors per block of `acts` (checked above).
                unsafe {
                    crate::dot_avx512::group_dot(qtype, group, nb, acts, tile.ex, n, wide, out)
                }
            }
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => {
                // Not reachable (`run_tiles` expands for AVX-512 and makes tiles of at most
                // `MAX_TILE` tokens); stay correct anyway.
                // SAFETY: AVX-512 implies the AVX2 features (checked at detection).
                let v = crate::vnni::NONE;
                unsafe { crate::dot_avx2::group_dot(qtype, group, nb, acts, n, wide, v, out) }
            }
            _ => {
                for t in 0..n {
                    let acts = &acts[t * nb..(t + 1) * nb];
                    if wide {
                        out.f64s[t] = crate::dot_scalar::group_dot_wide(qtype, group, acts);
                    } else {
                        out.f32s[t] = crate::dot_scalar::group_dot(qtype, group, acts);
                    }
                }
            }
        }
    }
}

impl Activation for ActBlockK {
    const PER_BLOCK: usize = expand::PER_BLOCK_K;

    fn many_tokens<E: OutElem>(
        m: &QuantMatrix,
        simd: Simd,
        acts: &[Self],
        n: usize,
        y: &mut [E],
    ) -> bool {
        m.try_many_tokens(simd, acts, n, y)
    }

    fn expand(&self, qtype: QuantType, out: &mut [Expanded]) {
        expand::expand_k(qtype, self, out);
    }

    fn unpacked_len(qtype: QuantType, simd: Simd, nb: usize, n: usize) -> usize {
        #[cfg(target_arch = "x86_64")]
        if crate::gemm_avx2_k::supports(qtype, simd) && n >= crate::gemm_avx2_k::min_tokens(qtype) {
            return nb * crate::gemm_avx2_k::UNPACKED;
        }
        let _ = (qtype, simd, nb, n);
        0
    }

    fn unpack(qtype: QuantType, simd: Simd, group: &[u8], nb: usize, out: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if crate::gemm_avx2_k::supports(qtype, simd)
            && group.len() >= nb * group_block_bytes(qtype)
            && out.len() >= nb * crate::gemm_avx2_k::UNPACKED
        {
            // SAFETY: the AVX2 paths are only chosen after runtime detection of AVX2, FMA and
            // F16C; the slice lengths were checked just above.
            unsafe { crate::gemm_avx2_k::unpack(qtype, group, nb, out) }
        }
        let _ = (qtype, simd, group, nb, out);
    }

    fn group_tile(
        qtype: QuantType,
        simd: Simd,
        group: &[u8],
        nb: usize,
        tile: &Tile<'_, Self>,
        form: Form,
        out: &mut TileOut,
    ) {
        let (acts, n) = (tile.acts, tile.tokens);
        match simd {
            #[cfg(target_arch = "x86_64")]
            s if crate::gemm_avx2_k::supports(qtype, s)
                && tile.unpacked.len() >= nb * crate::gemm_avx2_k::UNPACKED =>
            {
                let (u, v) = (tile.unpacked, s.vnni());
                // SAFETY: as below (and `Simd::Avx2Vnni` is only chosen where the CPU runs
                // the VNNI encoding `v`), and `u` holds the group unpacked by `Self::unpack`
                // (`nb * UNPACKED` bytes, checked above) for this format.
                unsafe { crate::gemm_avx2_k::group_dot(qtype, group, u, nb, acts, n, form, v, out) }
            }
            #[cfg(target_arch = "x86_64")]
            s if s.is_avx2() => {
                // SAFETY: as for `ActBlock`, with K-quant group super-blocks.
                unsafe { crate::dot_avx2_k::group_dot(qtype, group, nb, acts, n, form, out) }
            }
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 if tile.ex.len() == acts.len() * Self::PER_BLOCK && n <= MAX_TILE => {
                // SAFETY: as for `ActBlock` under `Simd::Avx512`, with K-quant group
                // super-blocks and `PER_BLOCK` vectors per block.
                unsafe {
                    crate::dot_avx512_k::group_dot(qtype, group, nb, acts, tile.ex, n, form, out)
                }
            }
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => {
                // Not reachable (`run_tiles` expands for AVX-512 and makes tiles of at most
                // `MAX_TILE` tokens); stay correct anyway.
                // SAFETY: AVX-512 implies the AVX2 features (checked at detection).
                unsafe { crate::dot_avx2_k::group_dot(qtype, group, nb, acts, n, form, out) }
            }
            _ => {
                for t in 0..n {
                    let acts = &acts[t * nb..(t + 1) * nb];
                    use crate::dot_scalar_k as k;
                    match form {
                        Form::F32 => out.f32s[t] = k::group_dot(qtype, group, acts),
                        Form::Wide => out.f64s[t] = k::group_dot_wide(qtype, group, acts, false),
                        Form::WideSub => out.f64s[t] = k::group_dot_wide(qtype, group, acts, true),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {

    use super::*;
    use half::f16;

    /// Every format, in the order the tests go through them.
    pub(crate) const ALL: [QuantType; 12] = {
        use QuantType::*;
        [
            Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
        ]
    };

    #[test]
    fn packing_in_parts_from_borrowed_bytes_gives_the_same_matrix() {
        for qtype in ALL {
            let (rows, cols) = (45, 512);
            let bytes = random_ggml(qtype, rows, cols, 7);
            let whole = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes.clone()).unwrap();
            for part in [1, 8, 16, 40, 1000] {
                let mut seen = Vec::new();
                let m =
                    QuantMatrix::from_ggml_parts(qtype, rows, cols, &bytes, part, |r| seen.push(r))
                        .unwrap();
                assert_eq!(m.packed, whole.packed, "{qtype:?}, parts of {part} rows");
                // The parts tile the bytes in order.
                let mut at = 0;
                for r in &seen {
                    assert_eq!(r.start, at);
                    at = r.end;
                }
                assert_eq!(at, bytes.len());
            }
            let short = QuantMatrix::from_ggml_parts(qtype, rows, cols, &bytes[1..], 8, |_| {});
            assert!(matches!(short, Err(KernelError::ByteLength { .. })));
        }
    }

    /// Deterministic pseudo-random ggml bytes with sane f16 scales.
    pub(crate) fn random_ggml(qtype: QuantType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut rng = tp_testkit::Rng::new(seed);
        let mut next = move || rng.next_u64();
        let blocks = rows * cols / qtype.block_len();
        let mut out = Vec::with_capacity(blocks * qtype.block_bytes());
        for _ in 0..blocks {
            if qtype.is_k_quant() {
                let mut b: Vec<u8> = (0..qtype.block_bytes()).map(|_| next() as u8).collect();
                let d = f16::from_f32(((next() % 1000) as f32 + 1.0) * 1e-5).to_le_bytes();
                // Where `d` and (formats with minimums) `dmin` lie in the ggml block.
                let (at, dmin_at) = match qtype {
                    QuantType::Q6_K => (208, None),
                    QuantType::Q3_K => (108, None),
                    QuantType::Q2_K => (80, Some(82)),
                    QuantType::IQ4_XS => (0, None),
                    _ => (0, Some(2)),
                };
                b[at..at + 2].copy_from_slice(&d);
                if let Some(m) = dmin_at {
                    let dmin = f16::from_f32(((next() % 1000) as f32) * 1e-5).to_le_bytes();
                    b[m..m + 2].copy_from_slice(&dmin);
                }
                out.extend_from_slice(&b);
                continue;
            }
            let d = f16::from_f32(((next() % 1000) as f32 + 1.0) * 1e-4);
            out.extend_from_slice(&d.to_le_bytes());
            if qtype.has_min() {
                let m = f16::from_f32(-((next() % 1000) as f32) * 1e-3);
                out.extend_from_slice(&m.to_le_bytes());
            }
            for _ in 0..qtype.quant_bytes() {
                let mut b = next() as u8;
                if qtype == QuantType::Q8_0 && b == 0x80 {
                    b = 0x81; // ggml never writes -128
                }
                out.push(b);
            }
        }
        out
    }

    fn random_x(len: usize, seed: u64) -> Vec<f32> {
        tp_testkit::Rng::new(seed ^ 0xDEAD_BEEF).uniform_vec(len, -2.0, 2.0)
    }

    /// Shapes for the path comparisons: one row to several groups (ragged last group), one
    /// block to many, odd block counts included.
    fn shapes(qtype: QuantType) -> Vec<(usize, usize)> {
        let bl = qtype.block_len();
        [
            (1, 8),
            (3, 16),
            (8, 8),
            (17, 64),
            (24, 48),
            (5, 1),
            (9, 3),
            (16, 25),
            (40, 7),
        ]
        .iter()
        .map(|&(rows, nb)| (rows, nb * bl))
        .collect()
    }

    /// The SIMD paths this CPU supports, with a printed line for each one it does not.
    fn simd_paths() -> Vec<Simd> {
        cpu::available().into_iter().skip(1).collect()
    }

    #[test]
    fn simd_and_scalar_paths_agree() {
        for simd in simd_paths() {
            for qtype in ALL {
                for (rows, cols) in shapes(qtype) {
                    for n in [1usize, 2, 3, 4, 5, 9] {
                        let seed = (rows * 1000 + cols + n) as u64;
                        let bytes = random_ggml(qtype, rows, cols, seed);
                        let m = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes).unwrap();
                        let x = random_x(n * cols, seed);
                        let mut ya = vec![0.0; n * rows];
                        let mut ys = vec![0.0; n * rows];
                        m.matmul_with(simd, &x, n, &mut ya).unwrap();
                        m.matmul_with(Simd::Scalar, &x, n, &mut ys).unwrap();
                        for (i, (a, s)) in ya.iter().zip(&ys).enumerate() {
                            // Same integer sums and the same f32 tail, FMAs included.
                            assert_eq!(
                                a.to_bits(),
                                s.to_bits(),
                                "{simd:?} {qtype} [{rows},{cols}] n={n} out {i}: {a} vs scalar {s}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The process's default entry points (`matmul`, `matmul_wide_acc`), which on an
    /// `avx2+vnni` default with AVX-512 run many-token products on the AVX-512 kernels
    /// ([`cpu::wide_many_tokens`]), give the scalar bits below and above that size.
    #[test]
    fn the_default_path_gives_the_scalar_bits_at_every_size() {
        eprintln!(
            "default path: {} (many-token products on avx512: {})",
            cpu::kernel_report(),
            cpu::wide_many_tokens()
        );
        for qtype in ALL {
            for (rows, cols) in shapes(qtype).into_iter().take(2) {
                for n in [1usize, 7, 8, 16, 40] {
                    let seed = (rows * 9000 + cols + n) as u64;
                    let bytes = random_ggml(qtype, rows, cols, seed);
                    let m = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes).unwrap();
                    let x = random_x(n * cols, seed ^ 3);
                    let (mut yd, mut ys) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
                    m.matmul(&x, n, &mut yd).unwrap();
                    m.matmul_with(Simd::Scalar, &x, n, &mut ys).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|a| a.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&yd), bits(&ys), "{qtype} [{rows},{cols}] n={n}");
                    let (mut wd, mut ws) = (vec![0.0f64; n * rows], vec![0.0f64; n * rows]);
                    m.matmul_wide_acc(&x, n, &mut wd).unwrap();
                    m.matmul_wide_acc_with(Simd::Scalar, &x, n, &mut ws)
                        .unwrap();
                    let wbits = |v: &[f64]| v.iter().map(|a| a.to_bits()).collect::<Vec<_>>();
                    assert_eq!(wbits(&wd), wbits(&ws), "wide {qtype} [{rows},{cols}] n={n}");
                }
            }
        }
    }

    #[test]
    fn avx512_matmul_gives_the_avx2_bits() {
        if !cpu::supports(Simd::Avx512) {
            eprintln!("skipped: this CPU has no AVX-512 F/BW/VL + VNNI");
            return;
        }
        for qtype in ALL {
            for (rows, cols) in shapes(qtype) {
                for n in [1usize, 2, 3, 4, 5, 8, 9, 16, 17, 40, 130] {
                    let seed = (rows * 7000 + cols + n) as u64;
                    let bytes = random_ggml(qtype, rows, cols, seed);
                    let m = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes).unwrap();
                    let x = random_x(n * cols, seed ^ 5);
                    let mut y5 = vec![0.0f32; n * rows];
                    let mut y2 = vec![0.0f32; n * rows];
                    m.matmul_with(Simd::Avx512, &x, n, &mut y5).unwrap();
                    m.matmul_with(Simd::Avx2, &x, n, &mut y2).unwrap();
                    for (i, (a, b)) in y5.iter().zip(&y2).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{qtype} [{rows},{cols}] n={n} out {i}: avx512 {a} avx2 {b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn extreme_quants_match_scalar_bits_on_every_path() {
        // Every weight quant at its extremes (all bits set / all clear) and activations at
        // +-127: the integer sums must be exact on every path (`matmul_wide_acc`: the scalar
        // bits; `matmul`: the plain AVX2 bits).
        use QuantType::*;
        for (simd, qtype) in simd_paths().into_iter().flat_map(|s| ALL.map(|q| (s, q))) {
            let (rows, cols) = (9, 3 * qtype.block_len());
            for fill in [0x00u8, 0xFF, 0x7F, 0x80] {
                let mut bytes = random_ggml(qtype, rows, cols, 3);
                let bb = qtype.block_bytes();
                for blk in bytes.chunks_exact_mut(bb) {
                    let q = match qtype {
                        // Also the packed 6-bit scales and mins (0xFF: all 63), but for 0x00.
                        Q4_K | Q5_K if fill != 0 => 4..bb,
                        Q4_K | Q5_K => 16..bb,
                        Q6_K => 0..208,
                        // `hmask`, `qs` and the 6-bit scales (0x00: all -32, 0xFF: all 31).
                        Q3_K => 0..108,
                        // Also the 4-bit scales and mins (0xFF: all 15), but for 0x00.
                        Q2_K if fill != 0 => 0..80,
                        Q2_K => 16..80,
                        _ => qtype.scale_bytes()..bb,
                    };
                    blk[q].fill(fill);
                }
                let m = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes).unwrap();
                // 3 tokens run on the per-group kernels, 20 and 40 on the many-token ones
                // (a partial chunk; two full chunks and a partial one).
                for (sign, n) in [3, 20, 40]
                    .into_iter()
                    .flat_map(|n| [(1.0f32, n), (-1.0, n)])
                {
                    let x: Vec<f32> = (0..n * cols)
                        .map(|i| if i % 3 == 0 { sign } else { -sign * 0.5 })
                        .collect();
                    let what = format!("{simd:?} {qtype} fill {fill:#x} sign {sign} n={n}");
                    let mut ys = vec![0.0f64; n * rows];
                    let mut y5 = vec![0.0f64; n * rows];
                    m.matmul_wide_acc_with(Simd::Scalar, &x, n, &mut ys)
                        .unwrap();
                    m.matmul_wide_acc_with(simd, &x, n, &mut y5).unwrap();
                    let bits = |v: &[f64]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&y5), bits(&ys), "{what}");
                    // And `matmul`: the plain AVX2 path's bits.
                    let mut f2 = vec![0.0f32; n * rows];
                    let mut f5 = vec![0.0f32; n * rows];
                    m.matmul_with(Simd::Avx2, &x, n, &mut f2).unwrap();
                    m.matmul_with(simd, &x, n, &mut f5).unwrap();
                    let fbits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(fbits(&f5), fbits(&f2), "{what} f32");
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn many_token_kernels_cover_the_formats_the_bit_tests_expect() {
        // The bit tests above run every format at n >= GEMM_MIN_TOKENS; these are the ones
        // that then take the many-token kernels (all but the sub-block form).
        use QuantType::*;
        for qtype in ALL {
            let plain = matches!(qtype, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | IQ4_NL);
            let k = matches!(qtype, Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS);
            for form in [Form::F32, Form::Wide] {
                assert_eq!(ActBlock::supports(qtype, form), plain, "{qtype} {form:?}");
                assert_eq!(ActBlockK::supports(qtype, form), k, "{qtype} {form:?}");
            }
            assert!(!ActBlockK::supports(qtype, Form::WideSub), "{qtype}");
        }
    }

    #[test]
    fn results_do_not_depend_on_the_tile_a_token_lands_in() {
        // Token 5 of a 6-token call lands in a tile of 2; alone it is a tile of 1.
        let kinds = [
            QuantType::Q4_1,
            QuantType::Q5_0,
            QuantType::Q5_1,
            QuantType::Q2_K,
            QuantType::Q3_K,
            QuantType::Q4_K,
            QuantType::Q5_K,
            QuantType::Q6_K,
            QuantType::IQ4_NL,
            QuantType::IQ4_XS,
        ];
        for (simd, qtype) in cpu::available()
            .into_iter()
            .flat_map(|s| kinds.map(|q| (s, q)))
        {
            let (rows, cols, n) = (9, 512, 6);
            let bytes = random_ggml(qtype, rows, cols, 7);
            let m = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes).unwrap();
            let x = random_x(n * cols, 3);
            let mut y = vec![0.0; n * rows];
            m.matmul_with(simd, &x, n, &mut y).unwrap();
            for t in 0..n {
                let mut y1 = vec![0.0; rows];
                m.matmul_with(simd, &x[t * cols..(t + 1) * cols], 1, &mut y1)
                    .unwrap();
                assert_eq!(
                    &y[t * rows..(t + 1) * rows],
                    &y1[..],
                    "token {t} ({simd:?} {qtype})"
                );
            }
        }
    }

    #[test]
    fn every_call_size_gives_each_token_its_alone_bits() {
        // n = 1 ..= 3 * MAX_TILE + 1: one partial tile, whole tiles, tiles plus a remainder,
        // with and without the weights unpacked once per group (n above one tile); odd row
        // counts (a partial last group). Each token's outputs, `matmul` and
        // `matmul_wide_acc`, must be the bits it gets alone (a call of 1 token), and the wide
        // sums the scalar path's bits.
        for simd in cpu::available() {
            for qtype in ALL {
                let bl = qtype.block_len();
                // K-quants also in the sub-block form, from column 32 to 64 before the end.
                let sub = [false, true]
                    .into_iter()
                    .filter(|&s| !s || qtype.is_k_quant());
                for (rows, nb, sub) in [(9usize, 3usize), (17, 2)]
                    .into_iter()
                    .flat_map(|(r, b)| sub.clone().map(move |s| (r, b, s)))
                {
                    let seed = (rows * 31 + nb) as u64;
                    let bytes = random_ggml(qtype, rows, nb * bl, seed);
                    let (m, cols) = if sub {
                        let cols = nb * bl - 64;
                        let m = QuantMatrix::from_ggml_sub_blocks(qtype, rows, 32, cols, bytes);
                        (m.unwrap(), cols)
                    } else {
                        let m = QuantMatrix::from_ggml_bytes(qtype, rows, nb * bl, bytes);
                        (m.unwrap(), nb * bl)
                    };
                    let most = 3 * MAX_TILE + 1;
                    let x = random_x(most * cols, seed ^ 9);
                    let mut alone = vec![0.0f32; most * rows];
                    let mut alone_w = vec![0.0f64; most * rows];
                    for t in 0..most {
                        let (xt, r) = (&x[t * cols..(t + 1) * cols], t * rows..(t + 1) * rows);
                        m.matmul_with(simd, xt, 1, &mut alone[r.clone()]).unwrap();
                        m.matmul_wide_acc_with(simd, xt, 1, &mut alone_w[r])
                            .unwrap();
                    }
                    let mut scalar_w = vec![0.0f64; most * rows];
                    m.matmul_wide_acc_with(Simd::Scalar, &x, most, &mut scalar_w)
                        .unwrap();
                    for n in 1..=most {
                        let mut y = vec![0.0f32; n * rows];
                        let mut yw = vec![0.0f64; n * rows];
                        m.matmul_with(simd, &x[..n * cols], n, &mut y).unwrap();
                        m.matmul_wide_acc_with(simd, &x[..n * cols], n, &mut yw)
                            .unwrap();
                        let f32_bits =
                            |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        let what = format!("{simd:?} {qtype} [{rows},{cols}] sub={sub} n={n}");
                        assert_eq!(f32_bits(&y), f32_bits(&alone[..n * rows]), "{what} f32");
                        assert_eq!(bits(&yw), bits(&alone_w[..n * rows]), "{what} wide");
                        assert_eq!(bits(&yw), bits(&scalar_w[..n * rows]), "{what} vs scalar");
                    }
                }
            }
        }
    }

    #[test]
    fn concat_rows_fast_and_repacking_paths_match_the_ggml_concatenation() {
        for split in [[8usize, 16, 5], [3, 8, 6]] {
            let qtype = QuantType::Q8_0;
            let cols = 64;
            let parts: Vec<Vec<u8>> = split
                .iter()
                .enumerate()
                .map(|(i, &r)| random_ggml(qtype, r, cols, i as u64 + 11))
                .collect();
            let mats = parts
                .iter()
                .zip(split)
                .map(|(b, r)| QuantMatrix::from_ggml_bytes(qtype, r, cols, b.clone()).unwrap())
                .collect();
            let cat = QuantMatrix::concat_rows(mats).unwrap();
            let all: Vec<u8> = parts.concat();
            let direct =
                QuantMatrix::from_ggml_bytes(qtype, split.iter().sum(), cols, all.clone()).unwrap();
            assert_eq!(cat.to_ggml_bytes(), all);
            assert_eq!(cat.packed, direct.packed);
        }
    }

    /// Ways to split `nb` blocks among 1 to 4 ranks: block boundaries `0 = c0 < .. < ck = nb`,
    /// balanced as tensor parallelism splits them, and uneven (one block alone at either end,
    /// pseudo-random cuts). Only splits with non-empty parts.
    pub(crate) fn splits(nb: usize) -> Vec<Vec<usize>> {
        let mut out: Vec<Vec<usize>> = vec![vec![0, nb]];
        for parts in 2..=4usize.min(nb) {
            let balanced: Vec<usize> = (0..=parts).map(|p| p * nb / parts).collect();
            let mut first = vec![0];
            first.extend(1..parts);
            first.push(nb);
            let mut last: Vec<usize> = (0..parts).map(|p| nb + p + 1 - parts).collect();
            last.insert(0, 0);
            last.truncate(parts);
            last.push(nb);
            let mut rng = tp_testkit::Rng::new((nb * 31 + parts * 7) as u64);
            let mut random = vec![0];
            while random.len() < parts {
                random.push(1 + rng.below(nb as u64 - 1) as usize);
                random.sort_unstable();
                random.dedup();
            }
            random.push(nb);
            out.extend([balanced, first, last, random]);
        }
        out.retain(|c| c.windows(2).all(|w| w[0] < w[1]));
        out.sort();
        out.dedup();
        out
    }

    /// The ggml bytes of columns `[b0, b1)` (in blocks) of a row-major `[rows, nb]`-block matrix.
    pub(crate) fn column_range(
        bytes: &[u8],
        bb: usize,
        rows: usize,
        nb: usize,
        b0: usize,
        b1: usize,
    ) -> Vec<u8> {
        (0..rows)
            .flat_map(|r| &bytes[(r * nb + b0) * bb..(r * nb + b1) * bb])
            .copied()
            .collect()
    }

    /// Columns `[c0, c1)` of each of the `n` rows of `x` (`cols` wide).
    pub(crate) fn x_columns(x: &[f32], cols: usize, c0: usize, c1: usize) -> Vec<f32> {
        x.chunks_exact(cols)
            .flat_map(|t| &t[c0..c1])
            .copied()
            .collect()
    }

    fn families() -> Vec<Simd> {
        cpu::available()
    }

    #[test]
    fn wide_simd_and_scalar_give_the_same_bits() {
        for simd in simd_paths() {
            for qtype in ALL {
                for (rows, cols) in shapes(qtype) {
                    for n in [1usize, 2, 3, 4, 5, 8, 9, 16, 17, 40, 130] {
                        let seed = (rows * 1000 + cols + n) as u64;
                        let bytes = random_ggml(qtype, rows, cols, seed);
                        let m = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes).unwrap();
                        let x = random_x(n * cols, seed);
                        // `+=`: start from non-zero values.
                        let y0: Vec<f64> = (0..n * rows).map(|i| i as f64 * 0.25 - 3.0).collect();
                        let (mut ya, mut ys) = (y0.clone(), y0);
                        m.matmul_wide_acc_with(simd, &x, n, &mut ya).unwrap();
                        m.matmul_wide_acc_with(Simd::Scalar, &x, n, &mut ys)
                            .unwrap();
                        for (i, (a, s)) in ya.iter().zip(&ys).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                s.to_bits(),
                                "{simd:?} {qtype} [{rows},{cols}] n={n} out {i}: {a} vs scalar {s}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn wide_results_do_not_depend_on_the_column_split() {
        let mut checked = 0;
        let mut f64_differ = 0;
        for simd in families() {
            for qtype in ALL {
                let (rows, cols) = if qtype.is_k_quant() {
                    (17, 1536)
                } else {
                    (17, 576)
                };
                let nb = cols / qtype.block_len();
                let bytes = random_ggml(qtype, rows, cols, 99);
                let full = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes.clone()).unwrap();
                for n in [1usize, 2, 5, 128] {
                    let x = random_x(n * cols, n as u64 + 5);
                    let mut want = vec![0.0f64; n * rows];
                    full.matmul_wide_acc_with(simd, &x, n, &mut want).unwrap();
                    for cuts in splits(nb) {
                        let mut sum = vec![0.0f64; n * rows];
                        for w in cuts.windows(2) {
                            let (b0, b1) = (w[0], w[1]);
                            let part = column_range(&bytes, qtype.block_bytes(), rows, nb, b0, b1);
                            let pc = (b1 - b0) * qtype.block_len();
                            let m = QuantMatrix::from_ggml_bytes(qtype, rows, pc, part).unwrap();
                            let bl = qtype.block_len();
                            let xp = x_columns(&x, cols, b0 * bl, b1 * bl);
                            let mut yp = vec![0.0f64; n * rows];
                            m.matmul_wide_acc_with(simd, &xp, n, &mut yp).unwrap();
                            for (s, p) in sum.iter_mut().zip(&yp) {
                                *s += p;
                            }
                        }
                        for (i, (s, w)) in sum.iter().zip(&want).enumerate() {
                            assert_eq!(
                                (*s as f32).to_bits(),
                                (*w as f32).to_bits(),
                                "{simd:?} {qtype} n={n} cuts {cuts:?} out {i}: {s} vs {w}"
                            );
                            f64_differ += (s.to_bits() != w.to_bits()) as usize;
                            checked += 1;
                        }
                    }
                }
            }
        }
        eprintln!("{checked} outputs equal as f32; {f64_differ} differ in their f64 bits");
        assert_eq!(f64_differ, 0);
    }

    #[test]
    fn wide_stays_close_to_the_f32_product() {
        for simd in families() {
            for qtype in ALL {
                let (rows, cols, n) = (9, 2048, 5);
                let m = QuantMatrix::from_ggml_bytes(
                    qtype,
                    rows,
                    cols,
                    random_ggml(qtype, rows, cols, 4),
                )
                .unwrap();
                let x = random_x(n * cols, 8);
                let mut y32 = vec![0.0f32; n * rows];
                let mut y64 = vec![0.0f64; n * rows];
                m.matmul_with(simd, &x, n, &mut y32).unwrap();
                m.matmul_wide_acc_with(simd, &x, n, &mut y64).unwrap();
                let mut w = vec![0.0f32; cols];
                for r in 0..rows {
                    m.dequantize_row(r, &mut w).unwrap();
                    for t in 0..n {
                        let xt = &x[t * cols..(t + 1) * cols];
                        let mag: f64 = xt
                            .iter()
                            .zip(&w)
                            .map(|(&a, &b)| (a as f64 * b as f64).abs())
                            .sum();
                        let (a, b) = (y32[t * rows + r] as f64, y64[t * rows + r]);
                        // The f32 accumulation bound of the oracle tests.
                        let tol = 4.0 * cols as f64 * f32::EPSILON as f64 * mag + 1e-6;
                        assert!(
                            (a - b).abs() <= tol,
                            "{simd:?} {qtype} t={t} r={r}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn column_range_copies_build_matrices_that_hold_those_columns() {
        for qtype in ALL {
            let (rows, nb) = (11, 5);
            let (bl, bb) = (qtype.block_len(), qtype.block_bytes());
            let cols = nb * bl;
            let bytes = random_ggml(qtype, rows, cols, 21);
            let full = QuantMatrix::from_ggml_bytes(qtype, rows, cols, bytes.clone()).unwrap();
            let (mut wf, mut wp) = (vec![0.0f32; cols], vec![0.0f32; cols]);
            for (b0, b1) in [(0, 1), (1, 3), (2, 5), (4, 5), (0, 5)] {
                let part = column_range(&bytes, bb, rows, nb, b0, b1);
                let m = QuantMatrix::from_ggml_bytes(qtype, rows, (b1 - b0) * bl, part.clone())
                    .unwrap();
                assert_eq!(m.to_ggml_bytes(), part, "{qtype} blocks {b0}..{b1}");
                for r in 0..rows {
                    full.dequantize_row(r, &mut wf).unwrap();
                    m.dequantize_row(r, &mut wp[..(b1 - b0) * bl]).unwrap();
                    assert_eq!(
                        &wp[..(b1 - b0) * bl],
                        &wf[b0 * bl..b1 * bl],
                        "{qtype} row {r}"
                    );
                }
            }
        }
    }

    /// The K-quants and IQ4_XS (the formats with a sub-block form).
    const K_QUANTS: [QuantType; 6] = {
        use QuantType::*;
        [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS]
    };

    /// Columns `[c0, c1)` (multiples of 32) of a `[rows, cols]` K-quant matrix in the
    /// sub-block form, built from the ggml bytes of the super-blocks they touch.
    fn sub_range(
        qtype: QuantType,
        bytes: &[u8],
        rows: usize,
        cols: usize,
        c0: usize,
        c1: usize,
    ) -> QuantMatrix {
        let (b0, b1) = (c0 / QK_K, c1.div_ceil(QK_K));
        let part = column_range(bytes, qtype.block_bytes(), rows, cols / QK_K, b0, b1);
        QuantMatrix::from_ggml_sub_blocks(qtype, rows, c0 % QK_K, c1 - c0, part).unwrap()
    }

    fn bits(v: &[f64]) -> Vec<u64> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    #[test]
    fn sub_block_ranges_equal_the_whole_rows_restricted_to_their_sub_blocks() {
        // Ranges that start and end inside super-blocks, in one or across several.
        let ranges = [
            (0, 768),
            (32, 64),
            (128, 512),
            (384, 768),
            (224, 288),
            (0, 96),
            (736, 768),
            (96, 704),
        ];
        let (rows, cols) = (17, 768);
        for qtype in K_QUANTS {
            let bytes = random_ggml(qtype, rows, cols, 31);
            let full = sub_range(qtype, &bytes, rows, cols, 0, cols);
            for n in [1usize, 3, 6] {
                let x = random_x(n * cols, n as u64 + 40);
                for (c0, c1) in ranges {
                    let m = sub_range(qtype, &bytes, rows, cols, c0, c1);
                    let xr = x_columns(&x, cols, c0, c1);
                    // The whole rows with the activations outside the range zeroed.
                    let mut masked = x.clone();
                    for (i, v) in masked.iter_mut().enumerate() {
                        if !(c0..c1).contains(&(i % cols)) {
                            *v = 0.0;
                        }
                    }
                    let mut scalar = vec![0.0f64; n * rows];
                    m.matmul_wide_acc_with(Simd::Scalar, &xr, n, &mut scalar)
                        .unwrap();
                    for simd in cpu::available() {
                        let (mut got, mut want) = (vec![0.0f64; n * rows], vec![0.0f64; n * rows]);
                        m.matmul_wide_acc_with(simd, &xr, n, &mut got).unwrap();
                        full.matmul_wide_acc_with(simd, &masked, n, &mut want)
                            .unwrap();
                        let what = format!("{simd:?} {qtype} cols {c0}..{c1} n={n}");
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{what}: range vs masked whole rows"
                        );
                        assert_eq!(bits(&got), bits(&scalar), "{what}: vs scalar");
                        let mut y32 = vec![0.0f32; n * rows];
                        m.matmul_with(simd, &xr, n, &mut y32).unwrap();
                        let rounded: Vec<f32> = got.iter().map(|&v| v as f32).collect();
                        assert_eq!(y32, rounded, "{what}: matmul is the wide sum rounded");
                    }
                }
            }
            // The range's rows are the whole rows' columns.
            let m = sub_range(qtype, &bytes, rows, cols, 96, 704);
            let (mut wf, mut wr) = (vec![0.0f32; cols], vec![0.0f32; 608]);
            for r in 0..rows {
                full.dequantize_row(r, &mut wf).unwrap();
                m.dequantize_row(r, &mut wr).unwrap();
                assert_eq!(&wr[..], &wf[96..704], "{qtype} row {r}");
            }
            assert_eq!(
                m.to_ggml_bytes(),
                column_range(&bytes, qtype.block_bytes(), rows, 3, 0, 3)
            );
        }
    }

    #[test]
    fn sub_block_splits_sum_to_the_whole_bits() {
        let (rows, cols) = (17, 1536);
        let mut checked = 0;
        for simd in families() {
            for qtype in K_QUANTS {
                let bytes = random_ggml(qtype, rows, cols, 77);
                let full = sub_range(qtype, &bytes, rows, cols, 0, cols);
                for n in [1usize, 5] {
                    let x = random_x(n * cols, n as u64 + 9);
                    let mut want = vec![0.0f64; n * rows];
                    full.matmul_wide_acc_with(simd, &x, n, &mut want).unwrap();
                    // Cuts in 32-wide sub-blocks, plus Qwen2.5's head splits (128-wide heads).
                    let mut all = splits(cols / 32);
                    all.extend([
                        vec![0, 12, 24, 36, 48],
                        vec![0, 16, 32, 48],
                        vec![0, 4, 40, 44, 48],
                    ]);
                    for cuts in all {
                        let mut sum = vec![0.0f64; n * rows];
                        for w in cuts.windows(2) {
                            let (c0, c1) = (32 * w[0], 32 * w[1]);
                            let m = sub_range(qtype, &bytes, rows, cols, c0, c1);
                            let mut yp = vec![0.0f64; n * rows];
                            m.matmul_wide_acc_with(simd, &x_columns(&x, cols, c0, c1), n, &mut yp)
                                .unwrap();
                            for (s, p) in sum.iter_mut().zip(&yp) {
                                *s += p;
                            }
                        }
                        assert_eq!(
                            bits(&sum),
                            bits(&want),
                            "{simd:?} {qtype} n={n} cuts {cuts:?}"
                        );
                        checked += sum.len();
                    }
                }
            }
        }
        eprintln!("{checked} split outputs equal the whole product's f64 bits");
    }

    #[test]
    fn sub_block_form_stays_within_its_activation_rounding() {
        // |y - Σ w x| <= Σ_l |w_l| * amax_j(l) / 254 (each activation rounded to a step of
        // amax / 127 of its 32) plus f32 rounding of the contributions.
        let (rows, cols, n) = (9, 512, 3);
        for simd in families() {
            for qtype in K_QUANTS {
                let bytes = random_ggml(qtype, rows, cols, 5);
                let m = sub_range(qtype, &bytes, rows, cols, 64, 480);
                let c = 416;
                let x = random_x(n * c, 12);
                let mut y = vec![0.0f64; n * rows];
                m.matmul_wide_acc_with(simd, &x, n, &mut y).unwrap();
                let mut w = vec![0.0f32; c];
                for r in 0..rows {
                    m.dequantize_row(r, &mut w).unwrap();
                    for t in 0..n {
                        let xt = &x[t * c..(t + 1) * c];
                        let (mut exact, mut bound, mut mag) = (0.0f64, 0.0f64, 0.0f64);
                        for (j, (ws, xs)) in w.chunks(32).zip(xt.chunks(32)).enumerate() {
                            let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64;
                            for (&a, &b) in ws.iter().zip(xs) {
                                exact += a as f64 * b as f64;
                                bound += (a as f64).abs() * amax / 254.0;
                                mag += (a as f64 * b as f64).abs();
                            }
                            let _ = j;
                        }
                        let tol = 1.001 * bound + 1e-5 * mag + 1e-6;
                        let got = y[t * rows + r];
                        assert!(
                            (got - exact).abs() <= tol,
                            "{simd:?} {qtype} r={r} t={t}: {got} vs {exact} (tol {tol})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn sub_block_form_refuses_ranges_it_cannot_hold() {
        let q = QuantType::Q4_K;
        let bytes = |nb: usize| vec![0u8; 8 * nb * q.block_bytes()];
        for (lead, cols) in [(16, 64), (0, 48), (256, 32)] {
            let e = QuantMatrix::from_ggml_sub_blocks(q, 8, lead, cols, bytes(2)).unwrap_err();
            assert!(matches!(e, KernelError::SubBlockRange { .. }), "{e}");
        }
        let e = QuantMatrix::from_ggml_sub_blocks(QuantType::Q8_0, 8, 0, 64, bytes(2)).unwrap_err();
        assert!(matches!(e, KernelError::SubBlockRange { .. }), "{e}");
        // 224 + 64 columns touch 2 super-blocks.
        let e = QuantMatrix::from_ggml_sub_blocks(q, 8, 224, 64, bytes(1)).unwrap_err();
        assert!(matches!(e, KernelError::ByteLength { .. }), "{e}");
        assert!(QuantMatrix::from_ggml_sub_blocks(q, 8, 224, 64, bytes(2)).is_ok());
        // Parts of different forms do not stack.
        let a = QuantMatrix::from_ggml_sub_blocks(q, 8, 0, 256, bytes(1)).unwrap();
        let b = QuantMatrix::from_ggml_bytes(q, 8, 256, bytes(1)).unwrap();
        let e = QuantMatrix::concat_rows(vec![a.clone(), b]).unwrap_err();
        assert!(matches!(e, KernelError::ConcatMismatch { .. }), "{e}");
        let two = QuantMatrix::concat_rows(vec![a.clone(), a]).unwrap();
        assert_eq!((two.rows(), two.sub_block_lead()), (16, Some(0)));
    }
}
