//! Element types: the [`DType`] tag, the public [`Element`] trait and the crate-private
//! conversion and arithmetic traits the kernels are generic over.

use std::fmt;

use half::{bf16, f16};

/// The element type of a tensor.
///
/// `Bool` is stored as one byte per element holding 0 or 1; it has no [`Element`] type (Rust's
/// `bool` is not `Pod`), so it is built with [`Tensor::from_bools`](crate::Tensor::from_bools)
/// and read with [`Tensor::to_bools`](crate::Tensor::to_bools).
///
/// ```
/// use hypershard_tensor::DType;
/// assert_eq!(DType::BF16.size_of(), 2);
/// assert!(DType::F16.is_float());
/// assert_eq!(DType::I64.name(), "int64");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary64.
    F64,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    BF16,
    /// IEEE 754 binary16.
    F16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// 8-bit unsigned integer.
    U8,
    /// Boolean, one byte per element (0 or 1).
    Bool,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 8] = [
        DType::F32,
        DType::F64,
        DType::BF16,
        DType::F16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::Bool,
    ];

    /// Bytes per element.
    pub const fn size_of(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 | DType::Bool => 1,
        }
    }

    /// Whether this is a floating-point dtype.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }

    /// The PyTorch name of the dtype (`float32`, `bfloat16`, `bool`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::Bool => "bool",
        }
    }
}

impl DType {
    /// The dtype named `name`: torch names (`float32`, `bfloat16`, `int64`, `bool`...), their
    /// short forms (`f32`, `bf16`, `fp16`, `i64`, `u8`...) or the torch aliases `float`,
    /// `double`, `half`, `int`, `long`.
    ///
    /// ```
    /// use hypershard_tensor::DType;
    /// assert_eq!(DType::from_name("bf16"), Some(DType::BF16));
    /// assert_eq!(DType::from_name("float32"), Some(DType::F32));
    /// assert_eq!(DType::from_name("complex64"), None);
    /// ```
    pub fn from_name(name: &str) -> Option<DType> {
        Some(match name.to_ascii_lowercase().as_str() {
            "float32" | "f32" | "fp32" | "float" => DType::F32,
            "float64" | "f64" | "fp64" | "double" => DType::F64,
            "bfloat16" | "bf16" => DType::BF16,
            "float16" | "f16" | "fp16" | "half" => DType::F16,
            "int32" | "i32" | "int" => DType::I32,
            "int64" | "i64" | "long" => DType::I64,
            "uint8" | "u8" => DType::U8,
            "bool" => DType::Bool,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

pub(crate) mod sealed {
    use super::DType;

    /// The storage representation of one element, with lossless-as-possible conversions.
    ///
    /// Casting goes through `i64` when both sides are integers (so `i64` values survive) and
    /// through `f64` otherwise; `f64` holds every `f32`, `bf16` and `f16` exactly, so a float
    /// cast rounds once.
    pub trait Repr: bytemuck::Pod + Send + Sync + 'static {
        /// The dtype this representation stores.
        const DTYPE: DType;
        /// Whether the type is an integer (or bool).
        const IS_INT: bool;
        /// The value as `f64` (exact for every type but large `i64`).
        fn to_f64(self) -> f64;
        /// The nearest value to `v` (saturating for integers, NaN to 0).
        fn from_f64(v: f64) -> Self;
        /// The value as `i64` (floats truncate toward zero, saturating).
        fn to_i64(self) -> i64;
        /// `v` converted with Rust's `as` semantics (wrapping for narrower integers).
        fn from_i64(v: i64) -> Self;
    }
}

use sealed::Repr;

/// A Rust type that can be the element of a tensor: `f32`, `f64`, [`half::bf16`],
/// [`half::f16`], `i32`, `i64`, `u8`.
///
/// The trait is sealed; [`DType::Bool`] has no element type (see [`DType`]).
pub trait Element: Repr + bytemuck::Pod + PartialEq + fmt::Debug {
    /// The dtype of this element type.
    ///
    /// ```
    /// use hypershard_tensor::{DType, Element};
    /// assert_eq!(<half::bf16 as Element>::dtype(), DType::BF16);
    /// ```
    fn dtype() -> DType {
        <Self as Repr>::DTYPE
    }
}

/// A `bool` element as stored: one byte, 0 or 1. Crate-private so 0/1 is an invariant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub(crate) struct BoolByte(pub(crate) u8);

impl Repr for BoolByte {
    const DTYPE: DType = DType::Bool;
    const IS_INT: bool = true;
    fn to_f64(self) -> f64 {
        f64::from(self.0)
    }
    fn from_f64(v: f64) -> Self {
        // NaN is truthy in torch (`bool(nan)` is True), and `nan != 0.0` holds.
        BoolByte(u8::from(v != 0.0))
    }
    fn to_i64(self) -> i64 {
        i64::from(self.0)
    }
    fn from_i64(v: i64) -> Self {
        BoolByte(u8::from(v != 0))
    }
}

macro_rules! float_repr {
    ($t:ty, $dtype:expr, $to:expr, $from:expr) => {
        impl Repr for $t {
            const DTYPE: DType = $dtype;
            const IS_INT: bool = false;
            fn to_f64(self) -> f64 {
                $to(self)
            }
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            fn to_i64(self) -> i64 {
                // `as` saturates and maps NaN to 0: defined behaviour, never a panic.
                self.to_f64() as i64
            }
            fn from_i64(v: i64) -> Self {
                Self::from_f64(v as f64)
            }
        }
        impl Element for $t {}
    };
}

float_repr!(f32, DType::F32, f64::from, |v: f64| v as f32);
float_repr!(f64, DType::F64, |v: f64| v, |v: f64| v);
float_repr!(bf16, DType::BF16, bf16::to_f64, bf16::from_f64);
float_repr!(f16, DType::F16, f16::to_f64, f16::from_f64);

macro_rules! int_repr {
    ($t:ty, $dtype:expr) => {
        impl Repr for $t {
            const DTYPE: DType = $dtype;
            const IS_INT: bool = true;
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(v: f64) -> Self {
                // `as` saturates and maps NaN to 0.
                v as $t
            }
            fn to_i64(self) -> i64 {
                self as i64
            }
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
        impl Element for $t {}
    };
}

int_repr!(i32, DType::I32);
int_repr!(i64, DType::I64);
int_repr!(u8, DType::U8);

/// Converts one element between representations (see [`Repr`] for the rounding rules): the
/// reference the tests hold [`cast_bytes`]'s paths to.
#[cfg(test)]
pub(crate) fn cast_elem<S: Repr, D: Repr>(s: S) -> D {
    if S::IS_INT && D::IS_INT {
        D::from_i64(s.to_i64())
    } else {
        D::from_f64(s.to_f64())
    }
}

/// Arithmetic on numeric element types (every dtype but bool).
///
/// Half-precision types compute in `f32` and round once per result; integers wrap.
pub(crate) trait Arith: Element {
    /// The accumulator of sums: `f32` for f32/bf16/f16, `f64` for f64, the type itself for ints.
    type Acc: Copy + Send;
    fn add(a: Self, b: Self) -> Self;
    fn sub(a: Self, b: Self) -> Self;
    fn mul(a: Self, b: Self) -> Self;
    /// Division; integer division by zero yields 0 (callers reject zero divisors first).
    fn div(a: Self, b: Self) -> Self;
    fn is_zero(self) -> bool;
    /// The larger of two values, propagating NaN like torch.
    fn max_nan(a: Self, b: Self) -> Self;
    fn acc_zero() -> Self::Acc;
    fn acc_add(acc: Self::Acc, x: Self) -> Self::Acc;
    fn acc_merge(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn from_acc(acc: Self::Acc) -> Self;
    /// `acc / n` rounded to `Self` (only used for float means).
    fn acc_mean(acc: Self::Acc, n: usize) -> Self;
    /// `a * alpha` computed in the type's compute precision.
    fn scale(a: Self, alpha: f64) -> Self;
    /// `a + alpha * x` computed in the type's compute precision.
    fn axpy(a: Self, alpha: f64, x: Self) -> Self;
    /// The next representable value below `self` (floats only; identity for ints).
    fn next_down(self) -> Self;
}

macro_rules! native_float_arith {
    ($t:ty) => {
        impl Arith for $t {
            type Acc = $t;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a + b
            }
            #[inline(always)]
            fn sub(a: Self, b: Self) -> Self {
                a - b
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a * b
            }
            #[inline(always)]
            fn div(a: Self, b: Self) -> Self {
                a / b
            }
            fn is_zero(self) -> bool {
                self == 0.0
            }
            #[inline(always)]
            fn max_nan(a: Self, b: Self) -> Self {
                if a.is_nan() || a >= b { a } else { b }
            }
            fn acc_zero() -> Self {
                0.0
            }
            #[inline(always)]
            fn acc_add(acc: Self, x: Self) -> Self {
                acc + x
            }
            fn acc_merge(a: Self, b: Self) -> Self {
                a + b
            }
            fn from_acc(acc: Self) -> Self {
                acc
            }
            fn acc_mean(acc: Self, n: usize) -> Self {
                acc / n as $t
            }
            #[inline(always)]
            fn scale(a: Self, alpha: f64) -> Self {
                a * alpha as $t
            }
            #[inline(always)]
            fn axpy(a: Self, alpha: f64, x: Self) -> Self {
                a + alpha as $t * x
            }
            fn next_down(self) -> Self {
                self.next_down()
            }
        }
    };
}

native_float_arith!(f32);
native_float_arith!(f64);

/// The next value below a half-precision float, from its bits (same IEEE layout for both).
fn half_next_down_bits(bits: u16) -> u16 {
    const SIGN: u16 = 0x8000;
    let magnitude = bits & !SIGN;
    if magnitude == 0 {
        // Below ±0 is the smallest negative subnormal.
        SIGN | 1
    } else if bits & SIGN == 0 {
        bits - 1
    } else {
        bits + 1
    }
}

macro_rules! half_float_arith {
    ($t:ty) => {
        impl Arith for $t {
            type Acc = f32;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() + b.to_f32())
            }
            #[inline(always)]
            fn sub(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() - b.to_f32())
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() * b.to_f32())
            }
            #[inline(always)]
            fn div(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() / b.to_f32())
            }
            fn is_zero(self) -> bool {
                self.to_f32() == 0.0
            }
            #[inline(always)]
            fn max_nan(a: Self, b: Self) -> Self {
                if a.is_nan() || a >= b { a } else { b }
            }
            fn acc_zero() -> f32 {
                0.0
            }
            #[inline(always)]
            fn acc_add(acc: f32, x: Self) -> f32 {
                acc + x.to_f32()
            }
            fn acc_merge(a: f32, b: f32) -> f32 {
                a + b
            }
            fn from_acc(acc: f32) -> Self {
                <$t>::from_f32(acc)
            }
            fn acc_mean(acc: f32, n: usize) -> Self {
                <$t>::from_f32(acc / n as f32)
            }
            #[inline(always)]
            fn scale(a: Self, alpha: f64) -> Self {
                <$t>::from_f32(a.to_f32() * alpha as f32)
            }
            #[inline(always)]
            fn axpy(a: Self, alpha: f64, x: Self) -> Self {
                <$t>::from_f32(a.to_f32() + alpha as f32 * x.to_f32())
            }
            fn next_down(self) -> Self {
                if self.is_nan() || self == <$t>::NEG_INFINITY {
                    self
                } else {
                    <$t>::from_bits(half_next_down_bits(self.to_bits()))
                }
            }
        }
    };
}

half_float_arith!(bf16);
half_float_arith!(f16);

macro_rules! int_arith {
    ($t:ty) => {
        impl Arith for $t {
            type Acc = $t;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn sub(a: Self, b: Self) -> Self {
                a.wrapping_sub(b)
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn div(a: Self, b: Self) -> Self {
                if b == 0 { 0 } else { a.wrapping_div(b) }
            }
            fn is_zero(self) -> bool {
                self == 0
            }
            #[inline(always)]
            fn max_nan(a: Self, b: Self) -> Self {
                a.max(b)
            }
            fn acc_zero() -> Self {
                0
            }
            #[inline(always)]
            fn acc_add(acc: Self, x: Self) -> Self {
                acc.wrapping_add(x)
            }
            fn acc_merge(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            fn from_acc(acc: Self) -> Self {
                acc
            }
            fn acc_mean(acc: Self, n: usize) -> Self {
                if n == 0 { 0 } else { acc / (n as $t) }
            }
            fn scale(a: Self, alpha: f64) -> Self {
                (a as f64 * alpha) as $t
            }
            fn axpy(a: Self, alpha: f64, x: Self) -> Self {
                (a as f64 + alpha * x as f64) as $t
            }
            fn next_down(self) -> Self {
                self
            }
        }
    };
}

int_arith!(i32);
int_arith!(i64);
int_arith!(u8);

/// Runs `$body` with `$T` bound to the storage representation of `$dtype` (all 8 dtypes).
macro_rules! with_repr {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::BF16 => {
                type $T = ::half::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $T = ::half::f16;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
            $crate::DType::Bool => {
                type $T = $crate::dtype::BoolByte;
                $body
            }
        }
    };
}

/// Runs `$body` with `$T` bound to the [`Arith`] type of `$dtype`; bool yields
/// [`Error::UnsupportedDType`](crate::Error::UnsupportedDType) for `$op`.
macro_rules! with_arith {
    ($dtype:expr, $op:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::BF16 => {
                type $T = ::half::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $T = ::half::f16;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
            $crate::DType::Bool => {
                return Err($crate::Error::UnsupportedDType {
                    op: $op,
                    dtype: $crate::DType::Bool,
                })
            }
        }
    };
}

/// Runs `$body` with `$T` bound to an unsigned integer of the same width as `$dtype`, for
/// kernels that only move bits.
macro_rules! with_bits {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype.size_of() {
            1 => {
                type $T = u8;
                $body
            }
            2 => {
                type $T = u16;
                $body
            }
            4 => {
                type $T = u32;
                $body
            }
            _ => {
                type $T = u64;
                $body
            }
        }
    };
}

pub(crate) use {with_arith, with_bits, with_repr};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_names() {
        for dtype in DType::ALL {
            assert_eq!(dtype.to_string(), dtype.name());
            assert_eq!(DType::from_name(dtype.name()), Some(dtype));
        }
        assert_eq!(DType::F32.size_of(), 4);
        assert_eq!(DType::F64.size_of(), 8);
        assert_eq!(DType::BF16.size_of(), 2);
        assert_eq!(DType::F16.size_of(), 2);
        assert_eq!(DType::I32.size_of(), 4);
        assert_eq!(DType::I64.size_of(), 8);
        assert_eq!(DType::U8.size_of(), 1);
        assert_eq!(DType::Bool.size_of(), 1);
        assert_eq!(DType::from_name("FP16"), Some(DType::F16));
        assert_eq!(DType::from_name("long"), Some(DType::I64));
        let floats: Vec<DType> = DType::ALL.into_iter().filter(|d| d.is_float()).collect();
        assert_eq!(
            floats,
            vec![DType::F32, DType::F64, DType::BF16, DType::F16]
        );
    }

    #[test]
    fn element_dtypes_match_sizes() {
        fn check<T: Element>() {
            assert_eq!(std::mem::size_of::<T>(), <T as Repr>::DTYPE.size_of());
            assert_eq!(T::dtype(), <T as Repr>::DTYPE);
        }
        check::<f32>();
        check::<f64>();
        check::<bf16>();
        check::<f16>();
        check::<i32>();
        check::<i64>();
        check::<u8>();
        assert_eq!(std::mem::size_of::<BoolByte>(), DType::Bool.size_of());
    }

    #[test]
    fn casts_follow_rounding_rules() {
        assert_eq!(cast_elem::<i64, i32>(1 << 33), 0);
        assert_eq!(cast_elem::<f32, i32>(-2.7), -2);
        assert_eq!(cast_elem::<f32, u8>(300.0), 255);
        assert_eq!(cast_elem::<f32, i64>(f32::NAN), 0);
        assert_eq!(cast_elem::<i64, i64>(i64::MAX), i64::MAX);
        assert_eq!(cast_elem::<f64, BoolByte>(0.5), BoolByte(1));
        assert_eq!(cast_elem::<i32, BoolByte>(0), BoolByte(0));
        assert_eq!(
            cast_elem::<f32, bf16>(1.0 + 1.0 / 256.0),
            bf16::from_f32(1.0)
        );
        assert_eq!(
            cast_elem::<bf16, f16>(bf16::from_f32(0.5)),
            f16::from_f32(0.5)
        );
    }

    #[test]
    fn arithmetic_edge_cases() {
        assert_eq!(<i32 as Arith>::div(i32::MIN, -1), i32::MIN);
        assert_eq!(<u8 as Arith>::add(250, 10), 4);
        assert!(<f32 as Arith>::max_nan(f32::NAN, 1.0).is_nan());
        assert!(<f32 as Arith>::max_nan(1.0, f32::NAN).is_nan());
        assert!(<bf16 as Arith>::max_nan(bf16::from_f32(1.0), bf16::NAN).is_nan());
        assert_eq!(<f32 as Arith>::max_nan(-1.0, 2.0), 2.0);
    }

    #[test]
    fn half_next_down() {
        let one = bf16::from_f32(1.0);
        let below = Arith::next_down(one);
        assert!(below < one);
        assert_eq!(below.to_bits(), one.to_bits() - 1);
        let neg = Arith::next_down(f16::from_f32(-1.0));
        assert!(neg < f16::from_f32(-1.0));
        let below_zero = Arith::next_down(f16::ZERO);
        assert!(below_zero < f16::ZERO && below_zero > f16::from_f32(-1e-6));
        assert_eq!(
            Arith::next_down(2.0f32),
            f32::from_bits(2.0f32.to_bits() - 1)
        );
    }
}

/// Converts a contiguous run of elements, with fast paths for the casts mixed precision does on
/// every step (f32 ↔ bf16, f32 ↔ f16, f32 ↔ f64).
///
/// A thin typed front to [`cast_bytes`], which does the work.
#[cfg(test)]
pub(crate) fn cast_run<S: Repr, D: Repr>(src: &[S], dst: &mut [D]) {
    let n = src.len().min(dst.len());
    cast_bytes(
        S::DTYPE,
        bytemuck::cast_slice(&src[..n]),
        D::DTYPE,
        bytemuck::cast_slice_mut(&mut dst[..n]),
    );
}

/// Converts the elements of `src` (of `src_dtype`) into `dst` (of `dst_dtype`), as many as
/// both hold.
///
/// The fast paths are written so the compiler vectorises them (bf16) or use `half`'s slice
/// conversions (f16, which use the F16C instructions when the CPU has them). Every other pair
/// goes through `f64` (`i64` between integer types) in stack-sized chunks: one widening and one
/// narrowing loop per dtype instead of one loop per pair of dtypes keeps the crate's compile
/// time down, and these pairs are not on any training step's path. Every path rounds to
/// nearest-even exactly like [`cast_elem`], which the tests check bit for bit.
pub(crate) fn cast_bytes(src_dtype: DType, src: &[u8], dst_dtype: DType, dst: &mut [u8]) {
    let n = (src.len() / src_dtype.size_of()).min(dst.len() / dst_dtype.size_of());
    let src = &src[..n * src_dtype.size_of()];
    let dst = &mut dst[..n * dst_dtype.size_of()];
    if cast_fast(src_dtype, src, dst_dtype, dst) {
        return;
    }
    const CHUNK: usize = 256;
    let (ss, ds) = (src_dtype.size_of(), dst_dtype.size_of());
    let both_int = !src_dtype.is_float() && !dst_dtype.is_float();
    let mut wide_f = [0f64; CHUNK];
    let mut wide_i = [0i64; CHUNK];
    for (s, d) in src.chunks(CHUNK * ss).zip(dst.chunks_mut(CHUNK * ds)) {
        let len = s.len() / ss;
        if both_int {
            with_repr!(src_dtype, S => widen(s, &mut wide_i[..len], S::to_i64));
            with_repr!(dst_dtype, D => narrow(&wide_i[..len], d, D::from_i64));
        } else {
            with_repr!(src_dtype, S => widen(s, &mut wide_f[..len], S::to_f64));
            with_repr!(dst_dtype, D => narrow(&wide_f[..len], d, D::from_f64));
        }
    }
}

/// Reads `S` elements from unaligned bytes into `out`, each through `f`.
fn widen<S: Repr, W: Copy>(src: &[u8], out: &mut [W], f: impl Fn(S) -> W) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(size_of::<S>())) {
        *o = f(bytemuck::pod_read_unaligned::<S>(b));
    }
}

/// Writes `wide` as `D` elements into unaligned bytes, each through `f`.
fn narrow<D: Repr, W: Copy>(wide: &[W], dst: &mut [u8], f: impl Fn(W) -> D) {
    for (&w, b) in wide.iter().zip(dst.chunks_exact_mut(size_of::<D>())) {
        b.copy_from_slice(bytemuck::bytes_of(&f(w)));
    }
}

/// The fast paths of [`cast_bytes`]; false when the pair has none (or a buffer is not aligned
/// for its type, which the crate's buffers always are).
fn cast_fast(src_dtype: DType, src: &[u8], dst_dtype: DType, dst: &mut [u8]) -> bool {
    use half::slice::HalfFloatSliceExt;
    fn typed<T: bytemuck::Pod>(b: &[u8]) -> Option<&[T]> {
        bytemuck::try_cast_slice(b).ok()
    }
    fn typed_mut<T: bytemuck::Pod>(b: &mut [u8]) -> Option<&mut [T]> {
        bytemuck::try_cast_slice_mut(b).ok()
    }
    match (src_dtype, dst_dtype) {
        (DType::F32, DType::BF16) => {
            if let (Some(s), Some(d)) = (typed::<f32>(src), typed_mut::<u16>(dst)) {
                for (o, &x) in d.iter_mut().zip(s) {
                    *o = f32_to_bf16_bits(x);
                }
                return true;
            }
        }
        (DType::BF16, DType::F32) => {
            if let (Some(s), Some(d)) = (typed::<u16>(src), typed_mut::<f32>(dst)) {
                for (o, &x) in d.iter_mut().zip(s) {
                    *o = f32::from_bits(u32::from(x) << 16);
                }
                return true;
            }
        }
        (DType::F32, DType::F16) => {
            if let (Some(s), Some(d)) = (typed::<f32>(src), typed_mut::<f16>(dst)) {
                d.convert_from_f32_slice(s);
                return true;
            }
        }
        (DType::F16, DType::F32) => {
            if let (Some(s), Some(d)) = (typed::<f16>(src), typed_mut::<f32>(dst)) {
                s.convert_to_f32_slice(d);
                return true;
            }
        }
        (DType::F32, DType::F64) => {
            if let (Some(s), Some(d)) = (typed::<f32>(src), typed_mut::<f64>(dst)) {
                for (o, &x) in d.iter_mut().zip(s) {
                    *o = f64::from(x);
                }
                return true;
            }
        }
        (DType::F64, DType::F32) => {
            if let (Some(s), Some(d)) = (typed::<f64>(src), typed_mut::<f32>(dst)) {
                for (o, &x) in d.iter_mut().zip(s) {
                    *o = x as f32;
                }
                return true;
            }
        }
        _ => {}
    }
    false
}

/// f32 → bf16 bits, rounding to nearest-even; NaN stays NaN (quieted), as `half` does.
///
/// Branch-free apart from the NaN select, so a loop over it vectorises.
#[inline(always)]
fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let is_nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    let round_bias = 0x7fff + ((bits >> 16) & 1);
    let rounded = (bits.wrapping_add(round_bias) >> 16) as u16;
    let quiet_nan = ((bits >> 16) as u16) | 0x0040;
    if is_nan { quiet_nan } else { rounded }
}

#[cfg(test)]
mod cast_tests {
    use super::*;

    /// Inputs that reach every rounding case: ties to even and odd, subnormals, infinities,
    /// NaNs with payloads, the largest finite values (which round up to infinity in bf16).
    fn tricky_f32() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            1.0,
            -1.5,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-45,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7fa0_0001),
            f32::from_bits(0xffc0_1234),
        ];
        // Exact ties: the low 16 bits are 0x8000, with even and odd kept halves.
        v.extend([0x3f80_8000u32, 0x3f81_8000, 0x3f80_7fff, 0x3f80_8001].map(f32::from_bits));
        // A deterministic sweep over many exponents and mantissas.
        let mut state = 0x9e37_79b9u32;
        for _ in 0..4096 {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            v.push(f32::from_bits(state));
        }
        v
    }

    #[test]
    fn fast_bf16_cast_matches_the_reference_bit_for_bit() {
        let src = tricky_f32();
        let mut fast = vec![bf16::ZERO; src.len()];
        cast_run::<f32, bf16>(&src, &mut fast);
        for (x, got) in src.iter().zip(&fast) {
            let want = bf16::from_f32(*x);
            if x.is_nan() {
                assert!(got.is_nan(), "{x:?} -> {got:?}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{x:e} ({:#x})", x.to_bits());
            }
        }
        let mut back = vec![0f32; src.len()];
        cast_run::<bf16, f32>(&fast, &mut back);
        for (b, f) in fast.iter().zip(&back) {
            assert!(b.is_nan() && f.is_nan() || b.to_f32().to_bits() == f.to_bits());
        }
    }

    #[test]
    fn fast_f16_and_f64_casts_match_the_generic_path() {
        let src = tricky_f32();
        let mut fast = vec![f16::ZERO; src.len()];
        cast_run::<f32, f16>(&src, &mut fast);
        let mut back = vec![0f32; src.len()];
        cast_run::<f16, f32>(&fast, &mut back);
        let mut wide = vec![0f64; src.len()];
        cast_run::<f32, f64>(&src, &mut wide);
        let mut narrow = vec![0f32; src.len()];
        cast_run::<f64, f32>(&wide, &mut narrow);
        for i in 0..src.len() {
            let generic: f16 = cast_elem::<f32, f16>(src[i]);
            assert!(
                generic.is_nan() && fast[i].is_nan() || generic.to_bits() == fast[i].to_bits(),
                "f16 {:e}",
                src[i]
            );
            assert!(fast[i].is_nan() || back[i].to_bits() == fast[i].to_f32().to_bits());
            assert!(src[i].is_nan() || narrow[i].to_bits() == src[i].to_bits());
            assert!(src[i].is_nan() || wide[i] == f64::from(src[i]));
        }
        // Other pairs take the generic path and still convert.
        let ints = [1i32, -7, 300];
        let mut out = [0u8; 3];
        cast_run::<i32, u8>(&ints, &mut out);
        assert_eq!(out, [1, 249, 44]);
    }

    /// `cast_bytes` against the per-element reference for every pair of dtypes, over more
    /// than one chunk and at a length that is no multiple of it.
    #[test]
    fn every_pair_matches_the_per_element_reference() {
        let n = 600;
        let values: Vec<f64> = (0..n)
            .map(|i| {
                let x = (i as f64 - 300.0) * 1.37e3_f64.powi(i % 5 - 1);
                match i % 97 {
                    0 => f64::NAN,
                    1 => f64::INFINITY,
                    2 => -0.0,
                    3 => 2.0f64.powi(40) + 1.0,
                    _ => x,
                }
            })
            .collect();
        fn make<S: Repr>(values: &[f64]) -> Vec<S> {
            values.iter().map(|&v| S::from_f64(v)).collect()
        }
        fn check<S: Repr, D: Repr>(src: &[S]) {
            let mut got = vec![D::from_f64(0.0); src.len()];
            cast_run::<S, D>(src, &mut got);
            for (i, (&x, &y)) in src.iter().zip(&got).enumerate() {
                let want = cast_elem::<S, D>(x);
                let same = bytemuck::bytes_of(&want) == bytemuck::bytes_of(&y)
                    || (want.to_f64().is_nan() && y.to_f64().is_nan());
                assert!(same, "{:?} -> {:?} at {i}", S::DTYPE, D::DTYPE);
            }
        }
        for from in DType::ALL {
            with_repr!(from, S => {
                let src = make::<S>(&values);
                for to in DType::ALL {
                    with_repr!(to, D => check::<S, D>(&src));
                }
            });
        }
    }
}
