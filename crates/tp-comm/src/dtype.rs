//! Element types that travel through collectives, and the reduction operators.

use half::{bf16, f16};

/// The element type of a buffer handed to a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I32,
    I64,
    U8,
    U32,
    U64,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// A small stable code, used in fingerprints and on the wire.
    pub fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F64 => 2,
            DType::F16 => 3,
            DType::BF16 => 4,
            DType::I32 => 5,
            DType::I64 => 6,
            DType::U8 => 7,
            DType::U32 => 8,
            DType::U64 => 9,
        }
    }

    /// Inverse of [`DType::code`].
    pub fn from_code(code: u8) -> Option<DType> {
        Some(match code {
            1 => DType::F32,
            2 => DType::F64,
            3 => DType::F16,
            4 => DType::BF16,
            5 => DType::I32,
            6 => DType::I64,
            7 => DType::U8,
            8 => DType::U32,
            9 => DType::U64,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::U32 => "u32",
            DType::U64 => "u64",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust element type with a [`DType`]: what the typed helpers of [`crate::CommExt`] accept.
pub trait Elem: bytemuck::Pod + Send + Sync + 'static {
    const DTYPE: DType;
}

macro_rules! elem {
    ($t:ty, $d:ident) => {
        impl Elem for $t {
            const DTYPE: DType = DType::$d;
        }
    };
}
elem!(f32, F32);
elem!(f64, F64);
elem!(f16, F16);
elem!(bf16, BF16);
elem!(i32, I32);
elem!(i64, I64);
elem!(u8, U8);
elem!(u32, U32);
elem!(u64, U64);

/// How all_reduce and reduce_scatter combine the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

impl ReduceOp {
    pub fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}
