//! Element types the collectives move and reduce.
//!
//! This crate keeps its own [`DType`] so that it depends on neither the tensor nor the mesh
//! crate; `hypershard-dtensor` maps between the two.

use std::fmt;

use half::{bf16, f16};

/// The element type of a [`Buffer`](crate::Buffer).
///
/// Tensors of `bool` travel as [`DType::U8`]: collectives never reduce booleans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 double precision.
    F64,
    /// bfloat16: the top half of an f32. Reduced in f32 (see `crate::reduce`).
    BF16,
    /// IEEE 754 half precision. Reduced in f32 (see `crate::reduce`).
    F16,
    /// 32-bit signed integer; sums and products wrap.
    I32,
    /// 64-bit signed integer; sums and products wrap.
    I64,
    /// 8-bit unsigned integer; sums and products wrap.
    U8,
}

impl DType {
    /// Every dtype, in declaration order (handy for exhaustive tests).
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::BF16,
        DType::F16,
        DType::I32,
        DType::I64,
        DType::U8,
    ];

    /// The size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }

    /// Whether the dtype is a floating-point type (the ones `Avg` and `PreMulSum` accept).
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }

    /// The lower-case name PyTorch uses (`float32`, `bfloat16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    /// Keeps [`super::Element`] closed: the reduction kernels cover exactly these types.
    pub trait Sealed {}
}

/// A Rust element type with a [`DType`] tag: `f32`, `f64`, `bf16`, `f16`, `i32`, `i64`, `u8`.
///
/// The trait is sealed because every kernel in `crate::reduce` must cover every element type.
pub trait Element: bytemuck::Pod + Send + Sync + sealed::Sealed + 'static {
    /// The dtype tag of this element type.
    const DTYPE: DType;
}

macro_rules! element {
    ($($ty:ty => $dtype:ident),* $(,)?) => {$(
        impl sealed::Sealed for $ty {}
        impl Element for $ty {
            const DTYPE: DType = DType::$dtype;
        }
    )*};
}

element! {
    f32 => F32,
    f64 => F64,
    bf16 => BF16,
    f16 => F16,
    i32 => I32,
    i64 => I64,
    u8 => U8,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_the_rust_types() {
        assert_eq!(DType::F32.size_bytes(), size_of::<f32>());
        assert_eq!(DType::F64.size_bytes(), size_of::<f64>());
        assert_eq!(DType::BF16.size_bytes(), size_of::<bf16>());
        assert_eq!(DType::F16.size_bytes(), size_of::<f16>());
        assert_eq!(DType::I32.size_bytes(), size_of::<i32>());
        assert_eq!(DType::I64.size_bytes(), size_of::<i64>());
        assert_eq!(DType::U8.size_bytes(), size_of::<u8>());
    }

    #[test]
    fn element_tags_and_float_flags() {
        assert_eq!(<bf16 as Element>::DTYPE, DType::BF16);
        assert_eq!(<i64 as Element>::DTYPE, DType::I64);
        let floats: Vec<_> = DType::ALL.into_iter().filter(|d| d.is_float()).collect();
        assert_eq!(
            floats,
            vec![DType::F32, DType::F64, DType::BF16, DType::F16]
        );
        assert_eq!(DType::BF16.to_string(), "bfloat16");
    }
}
