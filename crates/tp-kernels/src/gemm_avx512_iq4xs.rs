//! IQ4_XS for the AVX-512 VNNI many-token kernels: its super-blocks unpacked into Q6_K's
//! layout, which `gemm_avx512_k`'s scaled-sub-block kernel then runs with 8 sub-blocks of 32
//! columns (one scale multiply each) and an offset of 128.
//!
//! IQ4_XS's values are signed (`KVALUES_IQ4`, -127..=113) and so are the Q8_K activations,
//! but `vpdpbusd` wants one unsigned operand: the unpacked bytes are `value + 128` (1..=241,
//! looked up 64 at a time by a byte shuffle in a table already offset), so a
//! 32-wide sub-block's sum `raw` is `Σ value · x + 128 Σ x`. With its signed 6-bit scale `sc`
//! (`vpmulld`) and the pairs `(sc, sc)` against the activations' two 16-wide sums of the
//! sub-block (`vpdpwssd`), `Σ sc · raw - 128 · Σ sc · bsum16` is exactly the scalar `Σ sc ·
//! (value · x)`. Its f32 tail (`fma(isum as f32, d_w * d_x, acc)`, or the wide form's `isum as
//! f32 * (d_w * d_x)` in f64) is Q6_K's.
//!
//! No i32 can overflow: a sub-block's sum is at most 32 * 241 * 128 < 2^20, times a scale of
//! at most 32 and summed over 8 sub-blocks < 2^28; the offset term is at most 128 * 32 * 8 *
//! 4096 < 2^28.
//!
//! Weights, per group super-block, `gemm_avx512_k::W_VECS` vectors (Q6_K's offsets): the
//! bytes `value + 128` of word `K` of row `r` at 32-bit index `8K + r`; the scales as i32 at
//! `SC + 8s + r` (`s < 8`); the pairs `(sc, sc)` as two i16 at `SC_PAIRS + 8s + r`; the rows'
//! `d` as f32 at `D + r`.

use crate::expand::Expanded;
use crate::format::{f16_at, QuantType, KVALUES_IQ4};
use crate::gemm_avx512_k::{D, SC, SC_PAIRS, W_VECS};
use crate::pack::{group_block_bytes, GROUP_ROWS};
use crate::pack_k::iq4xs;
use std::arch::x86_64::*;

/// Unpacks `nb` IQ4_XS group super-blocks (see the module comment).
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `group.len() >= nb *
/// group_block_bytes(IQ4_XS)`, `out.len() >= nb * W_VECS`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn unpack(group: &[u8], nb: usize, out: &mut [Expanded]) {
    let gb = group_block_bytes(QuantType::IQ4_XS);
    let low4 = _mm512_set1_epi8(0x0F);
    // The table's entries plus 128, as unsigned bytes, in each 128-bit lane.
    let shifted: [u8; 16] = std::array::from_fn(|i| (KVALUES_IQ4[i] as u8) ^ 0x80);
    // SAFETY: `shifted` is 16 bytes.
    let table = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(shifted.as_ptr().cast()) });
    for b in 0..nb {
        let blk = &group[b * gb..(b + 1) * gb];
        let dst = &mut out[b * W_VECS..(b + 1) * W_VECS];
        let words = dst.as_mut_ptr() as *mut u8;
        // SAFETY: packed words `4j + w`, `4j + w + 1` of the 8 rows (64 bytes at `QS + 32 (4j
        // + w)`, at most `QS + 1024 = iq4xs::BYTES`) lie inside `blk`; each 64-byte store at
        // word `K = 8j + w` or `8j + 4 + w` (`K + 1 < 64`) lies inside the first 32 vectors
        // of `dst`.
        unsafe {
            for j in 0..8 {
                for w in [0, 2] {
                    let v =
                        _mm512_loadu_si512(blk.as_ptr().add(iq4xs::QS + 32 * (4 * j + w)).cast());
                    // Byte `i` of packed word `4j + w` holds position `32j + 4w + i` (low
                    // nibble, activation word `8j + w`) and `+ 16` (high, word `8j + 4 + w`).
                    let lo = _mm512_and_si512(v, low4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4);
                    for (k, q) in [(8 * j + w, lo), (8 * j + 4 + w, hi)] {
                        let q = _mm512_shuffle_epi8(table, q);
                        _mm512_storeu_si512(words.add(32 * k).cast(), q);
                    }
                }
            }
        }
        let ints = |v: &mut [Expanded], at: usize, value: i32| v[at / 16].0[at % 16] = value;
        for r in 0..GROUP_ROWS {
            let sc = |j: usize| blk[iq4xs::SC + GROUP_ROWS * j + r] as i8;
            for s in 0..8 {
                ints(dst, SC + 8 * s + r, sc(s) as i32);
                let half = sc(s) as i16 as u16 as u32;
                ints(dst, SC_PAIRS + 8 * s + r, (half | half << 16) as i32);
            }
            ints(dst, D + r, f16_at(blk, iq4xs::D + 2 * r).to_bits() as i32);
        }
        for at in D + GROUP_ROWS..D + 16 {
            ints(dst, at, 0);
        }
    }
}
