//! Element-wise reduction kernels over raw bytes, dispatched on [`DType`].
//!
//! Every backend reduces in rank order 0..n, so all ranks get bitwise identical results
//! and a run is deterministic (docs/reliability.md R10). Half types accumulate in f32 and round once.

use crate::dtype::{DType, ReduceOp};
use half::{bf16, f16};

/// `dst = reduce(srcs[0], srcs[1], ...)` element-wise, in that order.
/// All slices hold the same number of bytes, a multiple of `dtype.size()`.
pub fn reduce_into(dst: &mut [u8], srcs: &[&[u8]], dtype: DType, op: ReduceOp) {
    debug_assert!(srcs.iter().all(|s| s.len() == dst.len()));
    match dtype {
        DType::F32 => typed::<f32>(dst, srcs, op),
        DType::F64 => typed::<f64>(dst, srcs, op),
        DType::I32 => typed::<i32>(dst, srcs, op),
        DType::I64 => typed::<i64>(dst, srcs, op),
        DType::U8 => typed::<u8>(dst, srcs, op),
        DType::U32 => typed::<u32>(dst, srcs, op),
        DType::U64 => typed::<u64>(dst, srcs, op),
        DType::F16 => half_typed(dst, srcs, op, f16::to_f32, f16::from_f32),
        DType::BF16 => half_typed(dst, srcs, op, bf16::to_f32, bf16::from_f32),
    }
}

trait Combine: Copy {
    fn combine(self, other: Self, op: ReduceOp) -> Self;
}

macro_rules! combine_int {
    ($($t:ty),*) => {$(
        impl Combine for $t {
            #[inline(always)]
            fn combine(self, o: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum => self.wrapping_add(o),
                    ReduceOp::Max => self.max(o),
                    ReduceOp::Min => self.min(o),
                }
            }
        }
    )*};
}
combine_int!(i32, i64, u8, u32, u64);

macro_rules! combine_float {
    ($($t:ty),*) => {$(
        impl Combine for $t {
            #[inline(always)]
            fn combine(self, o: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum => self + o,
                    ReduceOp::Max => self.max(o),
                    ReduceOp::Min => self.min(o),
                }
            }
        }
    )*};
}
combine_float!(f32, f64);

/// Reads element `i` of a byte slice without requiring alignment.
#[inline(always)]
fn load<T: bytemuck::Pod>(bytes: &[u8], i: usize) -> T {
    let n = std::mem::size_of::<T>();
    bytemuck::pod_read_unaligned(&bytes[i * n..(i + 1) * n])
}

/// `d[i] = f(d[i], s[i])`: one monomorphized loop per op, so the compiler vectorizes it.
#[inline(always)]
fn zip_apply<T: Copy>(d: &mut [T], s: &[T], f: impl Fn(T, T) -> T) {
    for (a, b) in d.iter_mut().zip(s) {
        *a = f(*a, *b);
    }
}

fn combine_slices<T: Combine>(d: &mut [T], s: &[T], op: ReduceOp) {
    match op {
        ReduceOp::Sum => zip_apply(d, s, |a, b| a.combine(b, ReduceOp::Sum)),
        ReduceOp::Max => zip_apply(d, s, |a, b| a.combine(b, ReduceOp::Max)),
        ReduceOp::Min => zip_apply(d, s, |a, b| a.combine(b, ReduceOp::Min)),
    }
}

fn typed<T: bytemuck::Pod + Combine>(dst: &mut [u8], srcs: &[&[u8]], op: ReduceOp) {
    let n = std::mem::size_of::<T>();
    let count = dst.len() / n;
    let Some((first, rest)) = srcs.split_first() else {
        return;
    };
    // Fast path: aligned slices reinterpret in place (the common case: Vec<f32> buffers).
    if let Ok(d) = bytemuck::try_cast_slice_mut::<u8, T>(dst) {
        let all_aligned = srcs
            .iter()
            .all(|s| bytemuck::try_cast_slice::<u8, T>(s).is_ok());
        if all_aligned {
            d.copy_from_slice(bytemuck::cast_slice(first));
            for s in rest {
                combine_slices(d, bytemuck::cast_slice(s), op);
            }
            return;
        }
    }
    for i in 0..count {
        let mut acc: T = load(first, i);
        for s in rest {
            acc = acc.combine(load(s, i), op);
        }
        dst[i * n..(i + 1) * n].copy_from_slice(bytemuck::bytes_of(&acc));
    }
}

fn half_typed<H: bytemuck::Pod>(
    dst: &mut [u8],
    srcs: &[&[u8]],
    op: ReduceOp,
    to: fn(H) -> f32,
    from: fn(f32) -> H,
) {
    let count = dst.len() / 2;
    let Some((first, rest)) = srcs.split_first() else {
        return;
    };
    for i in 0..count {
        let mut acc = to(load::<H>(first, i));
        for s in rest {
            acc = acc.combine(to(load::<H>(s, i)), op);
        }
        dst[i * 2..(i + 1) * 2].copy_from_slice(bytemuck::bytes_of(&from(acc)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_in_rank_order_and_handles_every_op() {
        let a = [1.0f32, -2.0, 3.5];
        let b = [0.5f32, 4.0, -3.5];
        let mut out = [0f32; 3];
        let srcs = [bytemuck::cast_slice(&a), bytemuck::cast_slice(&b)];
        reduce_into(
            bytemuck::cast_slice_mut(&mut out),
            &srcs,
            DType::F32,
            ReduceOp::Sum,
        );
        assert_eq!(out, [1.5, 2.0, 0.0]);
        reduce_into(
            bytemuck::cast_slice_mut(&mut out),
            &srcs,
            DType::F32,
            ReduceOp::Max,
        );
        assert_eq!(out, [1.0, 4.0, 3.5]);
        reduce_into(
            bytemuck::cast_slice_mut(&mut out),
            &srcs,
            DType::F32,
            ReduceOp::Min,
        );
        assert_eq!(out, [0.5, -2.0, -3.5]);
    }

    #[test]
    fn half_types_accumulate_in_f32() {
        let a = [f16::from_f32(1.0), f16::from_f32(2.0)];
        let b = [f16::from_f32(3.0), f16::from_f32(-5.0)];
        let mut out = [f16::ZERO; 2];
        let srcs = [bytemuck::cast_slice(&a), bytemuck::cast_slice(&b)];
        reduce_into(
            bytemuck::cast_slice_mut(&mut out),
            &srcs,
            DType::F16,
            ReduceOp::Sum,
        );
        assert_eq!(out, [f16::from_f32(4.0), f16::from_f32(-3.0)]);
    }
}
