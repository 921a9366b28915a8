//! Moving tensors in and out of collective buffers.
//!
//! The collectives crate keeps its own [`DType`](collectives::DType) and
//! [`HostBuffer`](collectives::HostBuffer) so that it depends on neither the tensor nor the mesh
//! crate. This module is the one place that converts between the two worlds; `fsdp` uses it
//! too.
//!
//! - [`wire_dtype`] maps a tensor dtype to the dtype it travels as (`bool` travels as `u8`).
//! - [`wire_op`] maps a layout [`ReduceOp`] to the collectives one.
//! - [`tensor_to_buffer`] / [`tensor_to_padded_buffer`] copy a tensor's elements (row-major)
//!   into a new buffer, optionally followed by zeros up to a padded length: one copy.
//! - [`buffer_to_tensor`] turns a buffer into a contiguous tensor of a given shape. It adopts
//!   the buffer's memory as tensor storage without copying (through
//!   [`ForeignBytes`]) when the buffer holds exactly the
//!   tensor's bytes, and copies the prefix otherwise.
//! - [`staging_tensor`] and [`staging_into_buffer`]: a zeroed tensor whose storage *is* a
//!   collective buffer, so a caller can write shards into views of it (strided, with casts)
//!   and hand it to a collective without another copy. [`reclaim_buffer`] is the no-copy-or-
//!   nothing form: the buffer back when the tensor is its sole owner, else the tensor.
//!
//! ```
//! use hypershard_dtensor::bridge;
//! use hypershard_dtensor::tensor::{DType, Tensor};
//!
//! let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3])?;
//! let buf = bridge::tensor_to_padded_buffer(&t, 4)?;
//! assert_eq!(buf.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 0.0]);
//! let back = bridge::buffer_to_tensor(buf, &[2, 2], DType::F32)?;
//! assert_eq!(back.to_vec::<f32>()?, vec![1.0, 2.0, 3.0, 0.0]);
//! # Ok::<(), hypershard_dtensor::Error>(())
//! ```

use hypershard_collectives as collectives;
use hypershard_collectives::{Buffer, HostBuffer as WireBuffer};
use hypershard_mesh::ReduceOp;
use hypershard_tensor::{DType, ForeignBytes, HostBuffer as TensorBuffer, Storage, Tensor};

use crate::error::{Error, Result};

/// The dtype a tensor of `dtype` travels as. `Bool` travels as `U8` (0 or 1); collectives
/// never reduce booleans, so only data movement should carry them.
pub fn wire_dtype(dtype: DType) -> collectives::DType {
    match dtype {
        DType::F32 => collectives::DType::F32,
        DType::F64 => collectives::DType::F64,
        DType::BF16 => collectives::DType::BF16,
        DType::F16 => collectives::DType::F16,
        DType::I32 => collectives::DType::I32,
        DType::I64 => collectives::DType::I64,
        DType::U8 | DType::Bool => collectives::DType::U8,
    }
}

/// The collectives reduction for a layout reduction (the two enums mirror each other).
pub fn wire_op(op: ReduceOp) -> collectives::ReduceOp {
    match op {
        ReduceOp::Sum => collectives::ReduceOp::Sum,
        ReduceOp::Avg => collectives::ReduceOp::Avg,
        ReduceOp::Max => collectives::ReduceOp::Max,
        ReduceOp::Min => collectives::ReduceOp::Min,
        ReduceOp::Product => collectives::ReduceOp::Product,
        ReduceOp::PreMulSum(factor) => collectives::ReduceOp::PreMulSum(factor),
    }
}

/// A new buffer holding `tensor`'s elements in row-major order (one copy; a non-contiguous
/// tensor is gathered on the way).
pub fn tensor_to_buffer(tensor: &Tensor) -> Result<Buffer> {
    tensor_to_padded_buffer(tensor, tensor.numel())
}

/// A new buffer of `len` elements: `tensor`'s elements in row-major order, then zeros.
///
/// This is how a short trailing shard is padded to the chunk size before an all-gather or
/// all-to-all. `len` must be at least `tensor.numel()`.
pub fn tensor_to_padded_buffer(tensor: &Tensor, len: usize) -> Result<Buffer> {
    let numel = tensor.numel();
    if len < numel {
        return Err(Error::BufferMismatch {
            op: "tensor_to_padded_buffer",
            expected: numel,
            actual: len,
            wire_dtype: wire_dtype(tensor.dtype()).name(),
        });
    }
    let mut wire = WireBuffer::zeros(wire_dtype(tensor.dtype()), len);
    write_elements(tensor, &mut wire.as_bytes_mut()[..tensor.nbytes()])?;
    Ok(Buffer::Host(wire))
}

/// Copies `tensor`'s elements, row-major, into `out` (exactly `tensor.nbytes()` bytes).
fn write_elements(tensor: &Tensor, out: &mut [u8]) -> Result<()> {
    with_bytes(&tensor.contiguous()?, |bytes| out.copy_from_slice(bytes))
}

/// Runs `f` on the bytes of a contiguous tensor (bool is read through a copy).
pub(crate) fn with_bytes<R>(tensor: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    macro_rules! bytes_as {
        ($t:ty) => {
            tensor.with_data(|xs: &[$t]| f(bytemuck::cast_slice(xs)))?
        };
    }
    Ok(match tensor.dtype() {
        DType::F32 => bytes_as!(f32),
        DType::F64 => bytes_as!(f64),
        DType::BF16 => bytes_as!(half::bf16),
        DType::F16 => bytes_as!(half::f16),
        DType::I32 => bytes_as!(i32),
        DType::I64 => bytes_as!(i64),
        DType::U8 => bytes_as!(u8),
        DType::Bool => f(&tensor.to_bytes()?),
    })
}

/// A collectives buffer lent to a tensor as its storage.
struct WireBytes(WireBuffer);

impl ForeignBytes for WireBytes {
    fn bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.as_bytes_mut()
    }
}

/// A contiguous tensor of `shape` and `dtype` made from the first `numel(shape)` elements of
/// `buffer`.
///
/// When the buffer holds exactly those elements its memory becomes the tensor's storage
/// without a copy; a longer (padded) buffer is copied. The buffer's wire dtype must be
/// [`wire_dtype(dtype)`](wire_dtype) and it must hold at least `numel(shape)` elements.
pub fn buffer_to_tensor(buffer: Buffer, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let numel: usize = shape.iter().product();
    let wire = buffer.into_host()?;
    check_wire(&wire, dtype, numel)?;
    if wire.len() == numel {
        match TensorBuffer::from_foreign(Box::new(WireBytes(wire))) {
            Ok(storage) => return Ok(Tensor::from_host_buffer(storage, shape, dtype)?),
            // A collectives buffer is always 64-byte aligned, so this arm only runs if that
            // promise is broken; copying is still correct.
            Err(foreign) => return Ok(Tensor::from_bytes(foreign.bytes(), shape, dtype)?),
        }
    }
    Ok(Tensor::from_bytes(
        &wire.as_bytes()[..numel * dtype.size_of()],
        shape,
        dtype,
    )?)
}

/// A zeroed, contiguous tensor of `shape` whose storage is a fresh collective buffer of
/// [`wire_dtype(dtype)`](wire_dtype): write into views of it (`narrow(..).copy_from(..)`), then
/// pass it to [`staging_into_buffer`] to get the buffer back without copying.
pub fn staging_tensor(shape: &[usize], dtype: DType) -> Result<Tensor> {
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &s| acc.checked_mul(s))
        .ok_or(hypershard_tensor::Error::SizeOverflow {
            op: "staging_tensor",
            shape: shape.to_vec(),
        })?;
    buffer_to_tensor(
        Buffer::Host(WireBuffer::zeros(wire_dtype(dtype), numel)),
        shape,
        dtype,
    )
}

/// The collective buffer behind a tensor made by [`staging_tensor`] (or by
/// [`buffer_to_tensor`] from an exact-length buffer), without copying when `tensor` is the only
/// view of it; any other tensor is copied into a new buffer.
pub fn staging_into_buffer(tensor: Tensor) -> Result<Buffer> {
    match reclaim_buffer(tensor)? {
        Ok(buffer) => Ok(buffer),
        Err(tensor) => tensor_to_buffer(&tensor),
    }
}

/// The collective buffer behind `tensor` without copying, or the tensor back (`Err`) when it
/// cannot be had for free: another view shares the storage, the tensor does not cover its
/// storage exactly (offset, strides), or the storage is not collective memory.
///
/// This is what lets a consuming redistribute ([`DTensor::into_redistribute`]) hand a local
/// tensor that came out of a collective (or a factory) straight back to the next one.
///
/// [`DTensor::into_redistribute`]: crate::DTensor::into_redistribute
pub fn reclaim_buffer(tensor: Tensor) -> Result<std::result::Result<Buffer, Tensor>> {
    let (shape, dtype) = (tensor.shape().to_vec(), tensor.dtype());
    let wire = wire_dtype(dtype);
    let numel = tensor.numel();
    let storage = match tensor.try_into_host_buffer() {
        Ok(storage) => storage,
        Err(tensor) => return Ok(Err(tensor)),
    };
    let foreign = match storage.into_foreign() {
        Ok(foreign) => foreign,
        Err(owned) => return Ok(Err(Tensor::from_host_buffer(owned, &shape, dtype)?)),
    };
    if !(&*foreign as &dyn std::any::Any).is::<WireBytes>() {
        // Memory some other crate lent to the tensor: lend it back to a tensor.
        return Ok(Err(match TensorBuffer::from_foreign(foreign) {
            Ok(storage) => Tensor::from_host_buffer(storage, &shape, dtype)?,
            Err(foreign) => Tensor::from_bytes(foreign.bytes(), &shape, dtype)?,
        }));
    }
    let any: Box<dyn std::any::Any> = foreign;
    match any.downcast::<WireBytes>() {
        Ok(adopted) if adopted.0.dtype() == wire && adopted.0.len() == numel => {
            Ok(Ok(Buffer::Host(adopted.0)))
        }
        // Our own buffer under another element count cannot happen (adoption needs the
        // exact length); rebuilding the tensor from it is still correct.
        Ok(adopted) => Ok(Err(Tensor::from_bytes(
            adopted.0.as_bytes(),
            &shape,
            dtype,
        )?)),
        // `is` just said it is a `WireBytes`.
        Err(_) => Err(not_host_memory(wire, numel)),
    }
}

/// A read-only share of the collective buffer behind `tensor`, without copying; `None` unless
/// `tensor` covers its storage exactly (contiguous, offset 0) and that storage is collective
/// memory (it came out of a collective, [`staging_tensor`] or a DTensor factory).
///
/// The tensor keeps its memory and other views of it stay valid: the share is copy-on-write
/// ([`HostBuffer::share`](collectives::HostBuffer::share)), so if the tensor is written while
/// the share is still held, the write goes to a private copy and the holder keeps reading the
/// values the tensor had when it was lent. Hand the share to ops that only read their input
/// (all-gather, reduce-scatter, all-to-all send buffers); an op that works in place on its
/// buffer (all-reduce, broadcast) would copy it on its first write, into cold memory.
pub fn lend_buffer(tensor: &Tensor) -> Option<Buffer> {
    if tensor.offset() != 0 || !tensor.is_contiguous() {
        return None;
    }
    let storage = tensor.storage().read();
    let host = match &*storage {
        Storage::Host(host) => host,
        // A future device storage is not host collective memory.
        #[allow(unreachable_patterns)]
        _ => return None,
    };
    if host.len() != tensor.nbytes() {
        return None;
    }
    let lent = (host.foreign()? as &dyn std::any::Any).downcast_ref::<WireBytes>()?;
    let matches = lent.0.dtype() == wire_dtype(tensor.dtype()) && lent.0.len() == tensor.numel();
    matches.then(|| Buffer::Host(lent.0.share()))
}

/// The error for foreign memory of an unknown kind behind a tensor.
fn not_host_memory(wire: collectives::DType, numel: usize) -> Error {
    Error::BufferMismatch {
        op: "staging_into_buffer",
        expected: numel,
        actual: 0,
        wire_dtype: wire.name(),
    }
}

/// Checks that a buffer can hold the first `numel` elements of a `dtype` tensor.
fn check_wire(wire: &WireBuffer, dtype: DType, numel: usize) -> Result<()> {
    let expected = wire_dtype(dtype);
    if wire.dtype() != expected || wire.len() < numel {
        return Err(Error::BufferMismatch {
            op: "buffer_to_tensor",
            expected: numel,
            actual: wire.len(),
            wire_dtype: wire.dtype().name(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_round_trips_through_a_buffer() -> Result<()> {
        for dtype in DType::ALL {
            let t = Tensor::arange(6, DType::F64)?
                .to_dtype(dtype)?
                .view(&[2, 3])?
                .transpose(0, 1)?;
            let buf = tensor_to_padded_buffer(&t, 8)?;
            assert_eq!(buf.len(), 8);
            assert_eq!(buf.dtype(), wire_dtype(dtype));
            let exact = buffer_to_tensor(tensor_to_buffer(&t)?, &[3, 2], dtype)?;
            assert_eq!(exact.to_f64_vec()?, t.to_f64_vec()?, "{dtype:?}");
            let prefix = buffer_to_tensor(buf, &[3, 2], dtype)?;
            assert_eq!(prefix.to_f64_vec()?, t.to_f64_vec()?, "{dtype:?}");
        }
        Ok(())
    }

    #[test]
    fn padding_is_zeros_after_the_elements() -> Result<()> {
        let t = Tensor::from_vec(vec![7i64, 8], &[2])?;
        let buf = tensor_to_padded_buffer(&t, 5)?;
        assert_eq!(buf.as_slice::<i64>()?, &[7, 8, 0, 0, 0]);
        Ok(())
    }

    #[test]
    fn adopted_buffers_are_writable_tensor_storage() -> Result<()> {
        let buf = Buffer::from_vec(vec![1.0f32, 2.0, 3.0, 4.0]);
        let t = buffer_to_tensor(buf, &[2, 2], DType::F32)?;
        t.narrow(0, 1, 1)?.fill_(9.0)?;
        assert_eq!(t.to_vec::<f32>()?, vec![1.0, 2.0, 9.0, 9.0]);
        Ok(())
    }

    #[test]
    fn mismatches_are_typed_errors() -> Result<()> {
        let t = Tensor::zeros(&[4], DType::F32)?;
        assert!(matches!(
            tensor_to_padded_buffer(&t, 3),
            Err(Error::BufferMismatch {
                expected: 4,
                actual: 3,
                ..
            })
        ));
        let short = Buffer::from_vec(vec![1.0f32; 3]);
        assert!(matches!(
            buffer_to_tensor(short, &[4], DType::F32),
            Err(Error::BufferMismatch { .. })
        ));
        let wrong = Buffer::from_vec(vec![1i32; 4]);
        assert!(matches!(
            buffer_to_tensor(wrong, &[4], DType::F32),
            Err(Error::BufferMismatch { .. })
        ));
        Ok(())
    }

    #[test]
    fn staging_tensors_hand_their_buffer_back_without_copying() -> Result<()> {
        let staging = staging_tensor(&[2, 3], DType::BF16)?;
        let src = Tensor::from_vec(vec![1.0f32, 2.0], &[2])?;
        staging.narrow(1, 1, 1)?.view(&[2])?.copy_from(&src)?;
        let address = staging.with_data(|xs: &[half::bf16]| xs.as_ptr() as usize)?;
        let buffer = staging_into_buffer(staging)?;
        assert_eq!(buffer.dtype(), collectives::DType::BF16);
        let bytes = buffer.as_host()?.as_bytes();
        assert_eq!(
            bytes.as_ptr() as usize,
            address,
            "the same memory, not a copy"
        );
        assert_eq!(
            buffer.as_host()?.to_f64_vec(),
            vec![0.0, 1.0, 0.0, 0.0, 2.0, 0.0]
        );
        // A view that is not the whole buffer, or a plain tensor, is copied.
        let plain = Tensor::from_vec(vec![3i32, 4], &[2])?;
        assert_eq!(staging_into_buffer(plain)?.as_slice::<i32>()?, &[3, 4]);
        let shared = staging_tensor(&[4], DType::F32)?;
        let view = shared.narrow(0, 1, 2)?;
        assert_eq!(staging_into_buffer(view)?.len(), 2);
        Ok(())
    }

    #[test]
    fn reduce_ops_map_one_to_one() {
        assert_eq!(wire_op(ReduceOp::Sum), collectives::ReduceOp::Sum);
        assert_eq!(wire_op(ReduceOp::Avg), collectives::ReduceOp::Avg);
        assert_eq!(wire_op(ReduceOp::Max), collectives::ReduceOp::Max);
        assert_eq!(wire_op(ReduceOp::Min), collectives::ReduceOp::Min);
        assert_eq!(wire_op(ReduceOp::Product), collectives::ReduceOp::Product);
        assert_eq!(
            wire_op(ReduceOp::PreMulSum(0.5)),
            collectives::ReduceOp::PreMulSum(0.5)
        );
    }
}
