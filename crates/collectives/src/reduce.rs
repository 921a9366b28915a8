//! Reduction kernels.
//!
//! A [`ReducePlan`] turns a [`ReduceOp`] for one dtype and world size into three steps that
//! every algorithm composes the same way:
//!
//! 1. [`ReducePlan::prepare`] — each rank applies it once to its own contribution
//!    (`PreMulSum(f)`: multiply by `f`; a no-op otherwise);
//! 2. [`ReducePlan::combine`] — fold a prepared contribution into an accumulator
//!    (sum, max, min or product);
//! 3. [`ReducePlan::finish`] — apply once to the fully reduced data (`Avg`: multiply by `1/n`).
//!
//! [`ReducePlan::reduce_many`] does all three over several inputs at once (the local backend has
//! every contribution in memory).
//!
//! # Speed
//! The dtype is dispatched once per call, never per element: each kernel is a plain loop over
//! two typed slices (`zip`), which LLVM auto-vectorises (`vaddps`/`vmaxps`/`vpaddd`... on x86-64
//! — see `docs/collectives.md` for how that was checked). bf16 and f16 are processed in tiles of
//! [`TILE`] elements: the tile is widened to f32, combined in f32, and rounded back once per
//! combine step, so each step is as accurate as f32 arithmetic followed by one rounding.
//! `reduce_many` keeps the f32 tile across *all* inputs and rounds once at the end.
//!
//! # Integers and NaN
//! Integer sums and products wrap (two's complement), like PyTorch's CPU kernels. `Avg` and
//! `PreMulSum` are defined only for floating-point dtypes ([`Error::UnsupportedOp`] otherwise).
//! `Max`/`Min` with a NaN operand return one of the operands (unspecified which), as with
//! `maxps`.

use std::borrow::Cow;

use bytemuck::Pod;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::op::{BufferRole, OpKind, ReduceOp};

/// The number of bf16/f16 elements widened to f32 at a time (two 1 KiB stack tiles).
pub const TILE: usize = 256;

/// How two prepared contributions combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Combine {
    /// `a + b` (wrapping for integers).
    Sum,
    /// `max(a, b)`.
    Max,
    /// `min(a, b)`.
    Min,
    /// `a × b` (wrapping for integers).
    Product,
}

/// A [`ReduceOp`] resolved for one dtype and world size (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReducePlan {
    op: ReduceOp,
    dtype: DType,
    world: usize,
    kind: OpKind,
    combine: Combine,
    pre_factor: Option<f64>,
    post_factor: Option<f64>,
}

impl ReducePlan {
    /// Resolves `op` for `dtype` over `world` ranks. `Avg` and `PreMulSum` on integer dtypes
    /// are [`Error::UnsupportedOp`]. Errors from the plan name [`OpKind::AllReduce`] unless
    /// [`ReducePlan::for_op`] says otherwise.
    pub fn new(op: ReduceOp, dtype: DType, world: usize) -> Result<Self> {
        let (combine, pre_factor, post_factor) = match op {
            ReduceOp::Sum => (Combine::Sum, None, None),
            ReduceOp::Max => (Combine::Max, None, None),
            ReduceOp::Min => (Combine::Min, None, None),
            ReduceOp::Product => (Combine::Product, None, None),
            ReduceOp::Avg if dtype.is_float() => {
                (Combine::Sum, None, Some(1.0 / world.max(1) as f64))
            }
            ReduceOp::PreMulSum(factor) if dtype.is_float() => (Combine::Sum, Some(factor), None),
            ReduceOp::Avg | ReduceOp::PreMulSum(_) => {
                return Err(Error::UnsupportedOp { op, dtype });
            }
        };
        Ok(ReducePlan {
            op,
            dtype,
            world,
            kind: OpKind::AllReduce,
            combine,
            pre_factor,
            post_factor,
        })
    }

    /// The same plan, naming `kind` in its errors.
    pub fn for_op(mut self, kind: OpKind) -> Self {
        self.kind = kind;
        self
    }

    /// The dtype the plan's byte slices hold.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The pairwise combine step (the MPI backend maps it to MPI's predefined op).
    #[cfg(feature = "mpi")]
    pub fn combine_kind(&self) -> Combine {
        self.combine
    }

    /// Step 1: applies the per-contribution factor (`PreMulSum`) to this rank's data.
    pub fn prepare(&self, data: &mut [u8]) -> Result<()> {
        self.check_whole(data.len())?;
        if let Some(factor) = self.pre_factor {
            scale_bytes(self.dtype, data, factor);
        }
        Ok(())
    }

    /// Step 2: `acc = acc ⊕ incoming`, element-wise. Both slices hold whole elements of
    /// [`ReducePlan::dtype`] and have the same length ([`Error::LengthMismatch`] otherwise,
    /// naming the incoming data as [`BufferRole::Message`]).
    pub fn combine(&self, acc: &mut [u8], incoming: &[u8]) -> Result<()> {
        self.check_whole(acc.len())?;
        self.check_same(acc.len(), incoming.len())?;
        combine_bytes(self.dtype, acc, incoming, self.combine);
        Ok(())
    }

    /// Step 2 with a separate accumulator source: `out = own ⊕ incoming`, element-wise, so a
    /// reduction can combine this rank's (prepared) contribution with a peer's without first
    /// copying the contribution into `out`. All three slices hold whole elements and have the
    /// same length ([`Error::LengthMismatch`] otherwise).
    pub fn combine_from(&self, out: &mut [u8], own: &[u8], incoming: &[u8]) -> Result<()> {
        self.check_whole(out.len())?;
        self.check_same(out.len(), own.len())?;
        self.check_same(out.len(), incoming.len())?;
        match self.dtype {
            DType::F32 => from_native::<f32>(out, own, incoming, self.combine),
            DType::F64 => from_native::<f64>(out, own, incoming, self.combine),
            DType::I32 => from_native::<i32>(out, own, incoming, self.combine),
            DType::I64 => from_native::<i64>(out, own, incoming, self.combine),
            DType::U8 => from_native::<u8>(out, own, incoming, self.combine),
            DType::BF16 => from_half::<bf16>(out, own, incoming, self.combine),
            DType::F16 => from_half::<f16>(out, own, incoming, self.combine),
        }
        Ok(())
    }

    /// Step 3: applies the final scale (`Avg`: `1/world`) to fully reduced data.
    pub fn finish(&self, data: &mut [u8]) -> Result<()> {
        self.check_whole(data.len())?;
        if let Some(factor) = self.post_factor {
            scale_bytes(self.dtype, data, factor);
        }
        Ok(())
    }

    /// All three steps at once: `out = finish(prepare(inputs[0]) ⊕ prepare(inputs[1]) ⊕ ...)`.
    /// bf16/f16 accumulate across all inputs in f32 and round once.
    pub fn reduce_many(&self, out: &mut [u8], inputs: &[&[u8]]) -> Result<()> {
        self.check_whole(out.len())?;
        if inputs.is_empty() {
            return Err(Error::LengthMismatch {
                op: self.kind,
                role: BufferRole::Input,
                expected: 1,
                got: 0,
            });
        }
        for input in inputs {
            self.check_same(out.len(), input.len())?;
        }
        let step = KernelStep {
            combine: self.combine,
            pre: self.pre_factor,
            post: self.post_factor,
        };
        match self.dtype {
            DType::F32 => many_native::<f32>(out, inputs, step),
            DType::F64 => many_native::<f64>(out, inputs, step),
            DType::I32 => many_native::<i32>(out, inputs, step),
            DType::I64 => many_native::<i64>(out, inputs, step),
            DType::U8 => many_native::<u8>(out, inputs, step),
            DType::BF16 => many_half::<bf16>(out, inputs, step),
            DType::F16 => many_half::<f16>(out, inputs, step),
        }
        Ok(())
    }

    fn check_whole(&self, bytes: usize) -> Result<()> {
        if bytes.is_multiple_of(self.dtype.size_bytes()) {
            Ok(())
        } else {
            Err(Error::MisalignedBytes {
                dtype: self.dtype,
                bytes,
            })
        }
    }

    fn check_same(&self, acc_bytes: usize, incoming_bytes: usize) -> Result<()> {
        if acc_bytes == incoming_bytes {
            Ok(())
        } else {
            let size = self.dtype.size_bytes();
            Err(Error::LengthMismatch {
                op: self.kind,
                role: BufferRole::Message,
                expected: acc_bytes / size,
                got: incoming_bytes / size,
            })
        }
    }
}

/// The element-wise arithmetic of one native element type. `#[inline(always)]` so that the
/// generic loops below monomorphise into straight-line, vectorisable code.
trait Native: Pod {
    fn add(self, other: Self) -> Self;
    fn mul(self, other: Self) -> Self;
    fn max(self, other: Self) -> Self;
    fn min(self, other: Self) -> Self;
    /// `self × factor`; only reached for float dtypes (integers reject scaled ops up front).
    fn scale(self, factor: f64) -> Self;
}

macro_rules! native_float {
    ($ty:ty) => {
        impl Native for $ty {
            #[inline(always)]
            fn add(self, other: Self) -> Self {
                self + other
            }
            #[inline(always)]
            fn mul(self, other: Self) -> Self {
                self * other
            }
            #[inline(always)]
            fn max(self, other: Self) -> Self {
                if other > self { other } else { self }
            }
            #[inline(always)]
            fn min(self, other: Self) -> Self {
                if other < self { other } else { self }
            }
            #[inline(always)]
            fn scale(self, factor: f64) -> Self {
                self * factor as $ty
            }
        }
    };
}

macro_rules! native_int {
    ($ty:ty) => {
        impl Native for $ty {
            #[inline(always)]
            fn add(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            #[inline(always)]
            fn mul(self, other: Self) -> Self {
                self.wrapping_mul(other)
            }
            #[inline(always)]
            fn max(self, other: Self) -> Self {
                Ord::max(self, other)
            }
            #[inline(always)]
            fn min(self, other: Self) -> Self {
                Ord::min(self, other)
            }
            #[inline(always)]
            fn scale(self, factor: f64) -> Self {
                // Unreachable through ReducePlan (UnsupportedOp); defined as a saturating cast
                // of the float product so the trait stays total.
                (self as f64 * factor) as $ty
            }
        }
    };
}

native_float!(f32);
native_float!(f64);
native_int!(i32);
native_int!(i64);
native_int!(u8);

/// The factors and combine step of one kernel call.
#[derive(Clone, Copy)]
struct KernelStep {
    combine: Combine,
    pre: Option<f64>,
    post: Option<f64>,
}

#[inline(always)]
fn combine_slices<T: Native>(acc: &mut [T], incoming: &[T], combine: Combine) {
    // One loop per combine kind, so each loop body is a single vector instruction.
    match combine {
        Combine::Sum => acc
            .iter_mut()
            .zip(incoming)
            .for_each(|(a, &b)| *a = a.add(b)),
        Combine::Max => acc
            .iter_mut()
            .zip(incoming)
            .for_each(|(a, &b)| *a = a.max(b)),
        Combine::Min => acc
            .iter_mut()
            .zip(incoming)
            .for_each(|(a, &b)| *a = a.min(b)),
        Combine::Product => acc
            .iter_mut()
            .zip(incoming)
            .for_each(|(a, &b)| *a = a.mul(b)),
    }
}

#[inline(always)]
fn scaled_sum_slices<T: Native>(acc: &mut [T], incoming: &[T], factor: f64) {
    acc.iter_mut()
        .zip(incoming)
        .for_each(|(a, &b)| *a = a.add(b.scale(factor)));
}

#[inline(always)]
fn scale_slice<T: Native>(data: &mut [T], factor: f64) {
    data.iter_mut().for_each(|v| *v = v.scale(factor));
}

/// Views bytes as elements without copying when they are aligned (always, for bytes that come
/// from a [`HostBuffer`](crate::HostBuffer)); otherwise copies them into an aligned vector.
fn view<T: Pod>(bytes: &[u8]) -> Cow<'_, [T]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(slice) => Cow::Borrowed(slice),
        Err(_) => Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}

/// Runs `f` on bytes viewed as mutable elements, through an aligned copy when they are not
/// aligned (the copy is written back).
fn with_view_mut<T: Pod>(bytes: &mut [u8], f: impl FnOnce(&mut [T])) {
    match bytemuck::try_cast_slice_mut(bytes) {
        Ok(slice) => f(slice),
        Err(_) => {
            let mut copy: Vec<T> = bytemuck::pod_collect_to_vec(bytes);
            f(&mut copy);
            bytes.copy_from_slice(bytemuck::cast_slice(&copy));
        }
    }
}

fn combine_native<T: Native>(acc: &mut [u8], incoming: &[u8], combine: Combine) {
    let incoming = view::<T>(incoming);
    with_view_mut::<T>(acc, |acc| combine_slices(acc, &incoming, combine));
}

#[inline(always)]
fn combine_from_slices<T: Native>(out: &mut [T], own: &[T], incoming: &[T], combine: Combine) {
    // One loop per combine kind, as in `combine_slices`: three streams, no copy of `own`.
    let triples = out.iter_mut().zip(own.iter().zip(incoming));
    match combine {
        Combine::Sum => triples.for_each(|(o, (&a, &b))| *o = a.add(b)),
        Combine::Max => triples.for_each(|(o, (&a, &b))| *o = a.max(b)),
        Combine::Min => triples.for_each(|(o, (&a, &b))| *o = a.min(b)),
        Combine::Product => triples.for_each(|(o, (&a, &b))| *o = a.mul(b)),
    }
}

fn from_native<T: Native>(out: &mut [u8], own: &[u8], incoming: &[u8], combine: Combine) {
    let own = view::<T>(own);
    let incoming = view::<T>(incoming);
    with_view_mut::<T>(out, |out| {
        combine_from_slices(out, &own, &incoming, combine)
    });
}

fn from_half<H: Half>(out: &mut [u8], own: &[u8], incoming: &[u8], combine: Combine)
where
    [H]: HalfFloatSliceExt,
{
    let own = view::<H>(own);
    let incoming = view::<H>(incoming);
    with_view_mut::<H>(out, |out| {
        let mut wide_own = [0f32; TILE];
        let mut wide_in = [0f32; TILE];
        let tiles = out
            .chunks_mut(TILE)
            .zip(own.chunks(TILE).zip(incoming.chunks(TILE)));
        for (out_tile, (own_tile, in_tile)) in tiles {
            let n = out_tile.len();
            own_tile.convert_to_f32_slice(&mut wide_own[..n]);
            in_tile.convert_to_f32_slice(&mut wide_in[..n]);
            combine_slices(&mut wide_own[..n], &wide_in[..n], combine);
            out_tile.convert_from_f32_slice(&wide_own[..n]);
        }
    });
}

fn scale_native<T: Native>(data: &mut [u8], factor: f64) {
    with_view_mut::<T>(data, |data| scale_slice(data, factor));
}

/// The half types, widened to f32 a tile at a time.
trait Half: Pod {}
impl Half for bf16 {}
impl Half for f16 {}

fn combine_half<H: Half>(acc: &mut [u8], incoming: &[u8], combine: Combine)
where
    [H]: HalfFloatSliceExt,
{
    let incoming = view::<H>(incoming);
    with_view_mut::<H>(acc, |acc| {
        let mut wide_acc = [0f32; TILE];
        let mut wide_in = [0f32; TILE];
        for (acc_tile, in_tile) in acc.chunks_mut(TILE).zip(incoming.chunks(TILE)) {
            let n = acc_tile.len();
            acc_tile.convert_to_f32_slice(&mut wide_acc[..n]);
            in_tile.convert_to_f32_slice(&mut wide_in[..n]);
            combine_slices(&mut wide_acc[..n], &wide_in[..n], combine);
            acc_tile.convert_from_f32_slice(&wide_acc[..n]);
        }
    });
}

fn scale_half<H: Half>(data: &mut [u8], factor: f64)
where
    [H]: HalfFloatSliceExt,
{
    with_view_mut::<H>(data, |data| {
        let mut wide = [0f32; TILE];
        for tile in data.chunks_mut(TILE) {
            let n = tile.len();
            tile.convert_to_f32_slice(&mut wide[..n]);
            scale_slice(&mut wide[..n], factor);
            tile.convert_from_f32_slice(&wide[..n]);
        }
    });
}

fn combine_bytes(dtype: DType, acc: &mut [u8], incoming: &[u8], combine: Combine) {
    match dtype {
        DType::F32 => combine_native::<f32>(acc, incoming, combine),
        DType::F64 => combine_native::<f64>(acc, incoming, combine),
        DType::I32 => combine_native::<i32>(acc, incoming, combine),
        DType::I64 => combine_native::<i64>(acc, incoming, combine),
        DType::U8 => combine_native::<u8>(acc, incoming, combine),
        DType::BF16 => combine_half::<bf16>(acc, incoming, combine),
        DType::F16 => combine_half::<f16>(acc, incoming, combine),
    }
}

fn scale_bytes(dtype: DType, data: &mut [u8], factor: f64) {
    match dtype {
        DType::F32 => scale_native::<f32>(data, factor),
        DType::F64 => scale_native::<f64>(data, factor),
        DType::I32 => scale_native::<i32>(data, factor),
        DType::I64 => scale_native::<i64>(data, factor),
        DType::U8 => scale_native::<u8>(data, factor),
        DType::BF16 => scale_half::<bf16>(data, factor),
        DType::F16 => scale_half::<f16>(data, factor),
    }
}

fn many_native<T: Native>(out: &mut [u8], inputs: &[&[u8]], step: KernelStep) {
    let views: Vec<Cow<'_, [T]>> = inputs.iter().map(|bytes| view::<T>(bytes)).collect();
    with_view_mut::<T>(out, |out| {
        let Some((first, rest)) = views.split_first() else {
            return;
        };
        out.copy_from_slice(first);
        if let Some(factor) = step.pre {
            scale_slice(out, factor);
        }
        for input in rest {
            match step.pre {
                Some(factor) => scaled_sum_slices(out, input, factor),
                None => combine_slices(out, input, step.combine),
            }
        }
        if let Some(factor) = step.post {
            scale_slice(out, factor);
        }
    });
}

fn many_half<H: Half>(out: &mut [u8], inputs: &[&[u8]], step: KernelStep)
where
    [H]: HalfFloatSliceExt,
{
    let views: Vec<Cow<'_, [H]>> = inputs.iter().map(|bytes| view::<H>(bytes)).collect();
    with_view_mut::<H>(out, |out| {
        let Some((first, rest)) = views.split_first() else {
            return;
        };
        let mut wide_acc = [0f32; TILE];
        let mut wide_in = [0f32; TILE];
        for (tile_index, out_tile) in out.chunks_mut(TILE).enumerate() {
            let start = tile_index * TILE;
            let n = out_tile.len();
            first[start..start + n].convert_to_f32_slice(&mut wide_acc[..n]);
            if let Some(factor) = step.pre {
                scale_slice(&mut wide_acc[..n], factor);
            }
            for input in rest {
                input[start..start + n].convert_to_f32_slice(&mut wide_in[..n]);
                match step.pre {
                    Some(factor) => scaled_sum_slices(&mut wide_acc[..n], &wide_in[..n], factor),
                    None => combine_slices(&mut wide_acc[..n], &wide_in[..n], step.combine),
                }
            }
            if let Some(factor) = step.post {
                scale_slice(&mut wide_acc[..n], factor);
            }
            out_tile.convert_from_f32_slice(&wide_acc[..n]);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::HostBuffer;

    /// The reference: reduce in f64, then round into the dtype with wrapping for integers.
    fn reference(op: ReduceOp, dtype: DType, inputs: &[Vec<f64>]) -> Vec<f64> {
        let n = inputs.len();
        (0..inputs[0].len())
            .map(|i| {
                let column = inputs.iter().map(|v| v[i]);
                let value = match op {
                    ReduceOp::Sum => column.sum::<f64>(),
                    ReduceOp::Avg => column.sum::<f64>() / n as f64,
                    ReduceOp::Max => column.fold(f64::MIN, f64::max),
                    ReduceOp::Min => column.fold(f64::MAX, f64::min),
                    ReduceOp::Product => column.product(),
                    ReduceOp::PreMulSum(f) => column.map(|v| v * f).sum(),
                };
                HostBuffer::from_f64(dtype, &[wrap(dtype, value)]).to_f64_vec()[0]
            })
            .collect()
    }

    /// Integer arithmetic wraps; `as` saturates, so wrap explicitly through i64/u8.
    fn wrap(dtype: DType, value: f64) -> f64 {
        match dtype {
            DType::I32 => (value as i64) as i32 as f64,
            DType::U8 => (value as i64) as u8 as f64,
            _ => value,
        }
    }

    fn inputs(world: usize, len: usize) -> Vec<Vec<f64>> {
        (0..world)
            .map(|r| {
                (0..len)
                    .map(|i| ((r * 3 + i * 5) % 7) as f64 + 1.0)
                    .collect()
            })
            .collect()
    }

    #[test]
    fn pairwise_and_many_match_the_reference_for_every_dtype_and_op() {
        // 2 × TILE + 3 elements exercise full and partial half tiles.
        let len = 2 * TILE + 3;
        for world in [1, 2, 3, 5] {
            let data = inputs(world, len);
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    let plan = match ReducePlan::new(op, dtype, world) {
                        Ok(plan) => plan,
                        Err(Error::UnsupportedOp { .. }) => {
                            assert!(!dtype.is_float(), "{op} rejected for {dtype}");
                            continue;
                        }
                        Err(e) => panic!("{e}"),
                    };
                    let expected = reference(op, dtype, &data);
                    let buffers: Vec<HostBuffer> = data
                        .iter()
                        .map(|v| HostBuffer::from_f64(dtype, v))
                        .collect();

                    let mut many = HostBuffer::zeros(dtype, len);
                    let refs: Vec<&[u8]> = buffers.iter().map(|b| b.as_bytes()).collect();
                    plan.reduce_many(many.as_bytes_mut(), &refs).unwrap();

                    let mut prepared = buffers.clone();
                    for b in &mut prepared {
                        plan.prepare(b.as_bytes_mut()).unwrap();
                    }
                    let mut acc = prepared[0].clone();
                    for b in &prepared[1..] {
                        plan.combine(acc.as_bytes_mut(), b.as_bytes()).unwrap();
                    }
                    plan.finish(acc.as_bytes_mut()).unwrap();

                    // Inputs are small integers: sums, halves and products stay exact except
                    // for the single rounding of Avg (≤ 1 ulp of the dtype).
                    let tolerance = match dtype {
                        DType::BF16 => 1e-2,
                        DType::F16 => 1e-3,
                        DType::F32 => 1e-6,
                        _ => 1e-12,
                    };
                    for (name, got) in [("many", many), ("pairwise", acc)] {
                        for (i, (g, e)) in got.to_f64_vec().iter().zip(&expected).enumerate() {
                            assert!(
                                (g - e).abs() <= tolerance * e.abs().max(1.0),
                                "{name} {op} {dtype} world {world} at {i}: {g} vs {e}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn integer_sums_wrap() {
        let plan = ReducePlan::new(ReduceOp::Sum, DType::U8, 2).unwrap();
        let mut acc = HostBuffer::from_slice(&[200u8, 1]);
        plan.combine(
            acc.as_bytes_mut(),
            HostBuffer::from_slice(&[100u8, 2]).as_bytes(),
        )
        .unwrap();
        assert_eq!(acc.as_slice::<u8>().unwrap(), &[44, 3]);
    }

    #[test]
    fn bf16_rounds_once_per_step() {
        // 256 + 1 is a tie in bf16 (spacing 2 above 256) and rounds to even (256) at each
        // pairwise step; accumulating all three in f32 gives 258, which bf16 holds exactly.
        let plan = ReducePlan::new(ReduceOp::Sum, DType::BF16, 3).unwrap();
        let values = [256.0, 1.0, 1.0].map(|v| HostBuffer::from_slice(&[bf16::from_f32(v)]));
        let mut acc = values[0].clone();
        for v in &values[1..] {
            plan.combine(acc.as_bytes_mut(), v.as_bytes()).unwrap();
        }
        assert_eq!(acc.to_f64_vec(), vec![256.0]);
        let mut many = HostBuffer::zeros(DType::BF16, 1);
        let refs: Vec<&[u8]> = values.iter().map(|v| v.as_bytes()).collect();
        plan.reduce_many(many.as_bytes_mut(), &refs).unwrap();
        assert_eq!(many.to_f64_vec(), vec![258.0]);
    }

    #[test]
    fn f16_sums_past_its_range_only_when_the_result_does() {
        // 40000 + 40000 - 30000 overflows f16 as a running sum of f16s only if the partial is
        // rounded; reduce_many keeps it in f32 and the result (50000) fits.
        let plan = ReducePlan::new(ReduceOp::Sum, DType::F16, 3).unwrap();
        let values =
            [40000.0, 40000.0, -30000.0].map(|v| HostBuffer::from_slice(&[f16::from_f32(v)]));
        let mut many = HostBuffer::zeros(DType::F16, 1);
        let refs: Vec<&[u8]> = values.iter().map(|v| v.as_bytes()).collect();
        plan.reduce_many(many.as_bytes_mut(), &refs).unwrap();
        assert_eq!(many.to_f64_vec(), vec![f16::from_f32(50000.0).to_f64()]);
    }

    #[test]
    fn scaled_ops_on_integers_are_rejected() {
        for op in [ReduceOp::Avg, ReduceOp::PreMulSum(2.0)] {
            for dtype in [DType::I32, DType::I64, DType::U8] {
                assert!(matches!(
                    ReducePlan::new(op, dtype, 2),
                    Err(Error::UnsupportedOp { dtype: d, .. }) if d == dtype
                ));
            }
        }
    }

    #[test]
    fn bad_lengths_are_typed_errors() {
        let plan = ReducePlan::new(ReduceOp::Max, DType::F32, 2)
            .unwrap()
            .for_op(OpKind::ReduceScatter);
        let mut acc = vec![0u8; 8];
        assert!(matches!(
            plan.combine(&mut acc, &[0u8; 12]),
            Err(Error::LengthMismatch {
                op: OpKind::ReduceScatter,
                role: BufferRole::Message,
                expected: 2,
                got: 3
            })
        ));
        assert!(matches!(
            plan.prepare(&mut [0u8; 6]),
            Err(Error::MisalignedBytes { bytes: 6, .. })
        ));
        assert!(plan.reduce_many(&mut acc, &[]).is_err());
    }

    #[test]
    fn unaligned_byte_slices_are_handled() {
        // Offsetting by one byte makes the f32 views unaligned: the kernels copy, not panic.
        let plan = ReducePlan::new(ReduceOp::Sum, DType::F32, 2).unwrap();
        let mut acc_storage = [0u8; 9];
        acc_storage[1..].copy_from_slice(bytemuck::cast_slice(&[1.5f32, 2.0]));
        let mut in_storage = [0u8; 9];
        in_storage[1..].copy_from_slice(bytemuck::cast_slice(&[0.5f32, 4.0]));
        plan.combine(&mut acc_storage[1..], &in_storage[1..])
            .unwrap();
        let got: Vec<f32> = bytemuck::pod_collect_to_vec(&acc_storage[1..]);
        assert_eq!(got, vec![2.0, 6.0]);
    }

    #[test]
    fn combine_from_equals_combine_into_a_copy() {
        let len = 2 * TILE + 5;
        let data = inputs(2, len);
        for dtype in DType::ALL {
            for op in [
                ReduceOp::Sum,
                ReduceOp::Max,
                ReduceOp::Min,
                ReduceOp::Product,
            ] {
                let plan = ReducePlan::new(op, dtype, 2).unwrap();
                let own = HostBuffer::from_f64(dtype, &data[0]);
                let incoming = HostBuffer::from_f64(dtype, &data[1]);
                let mut expected = own.clone();
                plan.combine(expected.as_bytes_mut(), incoming.as_bytes())
                    .unwrap();
                let mut out = HostBuffer::zeros(dtype, len);
                plan.combine_from(out.as_bytes_mut(), own.as_bytes(), incoming.as_bytes())
                    .unwrap();
                assert_eq!(out.as_bytes(), expected.as_bytes(), "{op} {dtype}");
                // The reference value of element 0, as a closed form.
                let first = reference(op, dtype, &[vec![data[0][0]], vec![data[1][0]]])[0];
                assert_eq!(out.to_f64_vec()[0], first, "{op} {dtype}");
                let short = HostBuffer::zeros(dtype, len - 1);
                assert!(matches!(
                    plan.combine_from(out.as_bytes_mut(), short.as_bytes(), incoming.as_bytes()),
                    Err(Error::LengthMismatch { .. })
                ));
            }
        }
    }
}
