//! Moving tensors in and out of collective buffers: the one bridge between the tensor and
//! collectives crates, used by this crate's redistribute and by `fsdp` alike.
//!
//! The collectives crate keeps its own [`DType`](collectives::DType) and
//! [`HostBuffer`](collectives::HostBuffer) so that it depends on neither the tensor nor the mesh
//! crate. This module is the one place that converts between the two worlds.
//!
//! - [`wire_dtype`] maps a tensor dtype to the dtype it travels as. The map is total: `Bool`
//!   travels as `U8` bytes (0 or 1), as `torch.distributed` sends it, so gathering, scattering
//!   and redistributing booleans is exact. [`reducible`] says which dtypes a reduction means
//!   something for (not `Bool`: a sum of bytes is not a boolean).
//! - [`wire_op`] maps a layout [`ReduceOp`] to the collectives one.
//! - Byte access: [`with_bytes`] reads a tensor's elements as row-major bytes (no copy when it
//!   is contiguous), [`write_bytes`] writes bytes into a contiguous tensor, [`fill_zero`]
//!   zeroes one. Every dtype, `Bool` included, is read and written as its stored bytes.
//! - [`tensor_to_buffer`] / [`tensor_to_padded_buffer`] copy a tensor's elements (row-major)
//!   into a new buffer, optionally followed by zeros up to a padded length: one copy.
//! - [`buffer_to_tensor`] turns a buffer into a contiguous tensor of a given shape. It adopts
//!   the buffer's memory as tensor storage without copying when the buffer holds exactly the
//!   tensor's bytes, and copies the prefix otherwise. Adopted memory is held by one
//!   [`ForeignBytes`] adapter, the same one the mesh's
//!   [`BufferPool`](crate::BufferPool) lends its buffers through, so every tensor in collective
//!   memory (a redistribute's output, a factory's, FSDP's gathered parameters and gradients)
//!   can be moved or lent to the next collective by [`reclaim_buffer`] and [`lend_buffer`].
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

use std::sync::Weak;

use hypershard_collectives as collectives;
use hypershard_collectives::{Buffer, HostBuffer as WireBuffer};
use hypershard_mesh::ReduceOp;
use hypershard_tensor::{DType, ForeignBytes, HostBuffer as TensorBuffer, Storage, Tensor};

use crate::error::{Error, Result};

/// The dtype a tensor of `dtype` travels as. `Bool` travels as `U8` (0 or 1), as
/// `torch.distributed` sends it: data movement carries booleans exactly, and
/// [`reducible`] keeps them out of reductions.
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

/// Whether a reduction (sum, average, product...) of `dtype` values through a collective
/// gives a value of that dtype: every dtype but `Bool`, whose bytes would be summed to 2 and
/// more. `fsdp` refuses `Bool` parameters for this reason (their gradients are reduced).
pub fn reducible(dtype: DType) -> bool {
    dtype != DType::Bool
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

/// Calls `f` with the elements of `tensor` as row-major bytes: its storage itself when the
/// tensor is contiguous, a contiguous copy when it is a strided view. Every dtype is read as
/// the bytes it is stored as (`Bool`: one byte, 0 or 1).
///
/// A tensor on a device is [`hypershard_tensor::Error::DeviceData`] naming it (copy it with
/// `to_host` first); one without memory (deferred) is [`Error::NotHostMemory`].
pub fn with_bytes<R>(tensor: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    let owned;
    let tensor = if tensor.is_contiguous() {
        tensor
    } else {
        owned = tensor.contiguous()?;
        &owned
    };
    let start = tensor.offset() * tensor.dtype().size_of();
    let len = tensor.nbytes();
    let guard = tensor.storage().read();
    let host = match &*guard {
        Storage::Host(host) => host,
        Storage::Device(memory) => {
            return Err(hypershard_tensor::Error::DeviceData {
                op: "with_bytes",
                device: memory.device(),
            }
            .into());
        }
        _ => return Err(Error::NotHostMemory { op: "with_bytes" }),
    };
    let bytes = host
        .as_bytes()
        .get(start..start + len)
        .ok_or(Error::BufferMismatch {
            op: "with_bytes",
            expected: start + len,
            actual: host.len(),
            wire_dtype: "u8",
        })?;
    Ok(f(bytes))
}

/// Writes `bytes` into the contiguous `tensor`, starting at its element `elem_offset`; they
/// must end within the tensor (a strided destination is refused: use `copy_from`).
pub fn write_bytes(tensor: &Tensor, elem_offset: usize, bytes: &[u8]) -> Result<()> {
    if !tensor.is_contiguous() {
        return Err(Error::NotHostMemory {
            op: "write_bytes (strided destination)",
        });
    }
    let size = tensor.dtype().size_of();
    let base = tensor.offset() * size;
    let start = base + elem_offset.saturating_mul(size);
    let end = start.saturating_add(bytes.len());
    let limit = base + tensor.nbytes();
    if end > limit {
        return Err(Error::BufferMismatch {
            op: "write_bytes",
            expected: limit - base,
            actual: end - base,
            wire_dtype: "u8",
        });
    }
    let mut guard = tensor.storage().write();
    let Storage::Host(host) = &mut *guard else {
        return Err(Error::NotHostMemory { op: "write_bytes" });
    };
    host.as_bytes_mut()[start..end].copy_from_slice(bytes);
    Ok(())
}

/// Sets every element of the contiguous `tensor` to zero bits (0 in every dtype), whatever
/// its stale contents (`scale_(0.0)` would keep a NaN).
pub fn fill_zero(tensor: &Tensor) -> Result<()> {
    if !tensor.is_contiguous() {
        return Err(Error::NotHostMemory {
            op: "fill_zero (strided destination)",
        });
    }
    let start = tensor.offset() * tensor.dtype().size_of();
    let end = start + tensor.nbytes();
    let mut guard = tensor.storage().write();
    let Storage::Host(host) = &mut *guard else {
        return Err(Error::NotHostMemory { op: "fill_zero" });
    };
    let len = host.len();
    host.as_bytes_mut()
        .get_mut(start..end)
        .ok_or(Error::BufferMismatch {
            op: "fill_zero",
            expected: end,
            actual: len,
            wire_dtype: "u8",
        })?
        .fill(0);
    Ok(())
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
    let out = &mut wire.as_bytes_mut()[..tensor.nbytes()];
    with_bytes(tensor, |bytes| out.copy_from_slice(bytes))?;
    Ok(Buffer::Host(wire))
}

/// Where memory lent to a tensor goes back to when the tensor lets go of it: the mesh's
/// [`BufferPool`](crate::BufferPool). A trait so that this module needs nothing of the pool
/// (the pool is built on this module, not the other way round).
pub(crate) trait Home: Send + Sync {
    /// The last view of a tensor over a loan was dropped: its buffer comes back.
    fn give_back(&self, buffer: WireBuffer);
    /// The buffer of a loan was taken out of its tensor ([`reclaim_buffer`]) and leaves the
    /// pool's accounting; it may come back later as a buffer the pool did not lend.
    fn end_loan(&self, buffer: &WireBuffer);
}

/// Collective memory lent to a tensor as its storage: the one [`ForeignBytes`] adapter
/// between the two crates. With a home (a pool's loan), the buffer goes back there when the
/// tensor's storage is dropped; without one it is simply freed.
pub(crate) struct WireBytes {
    /// `None` only once the buffer has been taken out ([`WireBytes::into_buffer`]).
    buffer: Option<WireBuffer>,
    home: Option<Weak<dyn Home>>,
}

impl WireBytes {
    /// Adopts `buffer` as tensor memory; `home` gets it back when the tensor drops it.
    pub(crate) fn new(buffer: WireBuffer, home: Option<Weak<dyn Home>>) -> Self {
        WireBytes {
            buffer: Some(buffer),
            home,
        }
    }

    /// The buffer (present until [`into_buffer`](WireBytes::into_buffer) consumes `self`).
    fn buffer(&self) -> Option<&WireBuffer> {
        self.buffer.as_ref()
    }

    /// The buffer out of the adapter; a loan ends (its home stops counting it).
    fn into_buffer(mut self) -> Option<WireBuffer> {
        let buffer = self.buffer.take()?;
        if let Some(home) = self.home.take().and_then(|home| home.upgrade()) {
            home.end_loan(&buffer);
        }
        Some(buffer)
    }
}

impl ForeignBytes for WireBytes {
    fn bytes(&self) -> &[u8] {
        self.buffer.as_ref().map_or(&[], WireBuffer::as_bytes)
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.buffer
            .as_mut()
            .map_or(&mut [], WireBuffer::as_bytes_mut)
    }
}

impl Drop for WireBytes {
    fn drop(&mut self) {
        if let (Some(buffer), Some(home)) = (
            self.buffer.take(),
            self.home.take().and_then(|home| home.upgrade()),
        ) {
            home.give_back(buffer);
        }
    }
}

/// A contiguous tensor of `shape` and `dtype` over exactly the elements of `wire` (no copy),
/// its memory going back to `home` when the last view is dropped.
pub(crate) fn adopt(
    wire: WireBuffer,
    shape: &[usize],
    dtype: DType,
    home: Option<Weak<dyn Home>>,
) -> Result<Tensor> {
    match TensorBuffer::from_foreign(Box::new(WireBytes::new(wire, home))) {
        Ok(storage) => Ok(Tensor::from_host_buffer(storage, shape, dtype)?),
        // A collectives buffer is always 64-byte aligned, so this arm only runs if that
        // promise is broken; copying is still correct (and the adapter's drop returns the
        // buffer to its home).
        Err(foreign) => Ok(Tensor::from_bytes(foreign.bytes(), shape, dtype)?),
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
        return adopt(wire, shape, dtype, None);
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
    adopt(
        WireBuffer::zeros(wire_dtype(dtype), numel),
        shape,
        dtype,
        None,
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
/// tensor that came out of a collective (or a factory, or FSDP's buffer pool) straight back to
/// the next one.
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
    let ours = (&*foreign as &dyn std::any::Any)
        .downcast_ref::<WireBytes>()
        .and_then(WireBytes::buffer)
        .is_some_and(|buffer| buffer.dtype() == wire && buffer.len() == numel);
    if !ours {
        // Memory some other crate lent to the tensor (or our own under another element
        // count, which adoption never makes): lend it back to a tensor.
        return Ok(Err(match TensorBuffer::from_foreign(foreign) {
            Ok(storage) => Tensor::from_host_buffer(storage, &shape, dtype)?,
            Err(foreign) => Tensor::from_bytes(foreign.bytes(), &shape, dtype)?,
        }));
    }
    let any: Box<dyn std::any::Any> = foreign;
    match any
        .downcast::<WireBytes>()
        .ok()
        .and_then(|w| w.into_buffer())
    {
        Some(buffer) => Ok(Ok(Buffer::Host(buffer))),
        // The check above just found a `WireBytes` holding its buffer.
        None => Err(not_host_memory(wire, numel)),
    }
}

/// A read-only share of the collective buffer behind `tensor`, without copying; `None` unless
/// `tensor` covers its storage exactly (contiguous, offset 0) and that storage is collective
/// memory (it came out of a collective, [`staging_tensor`], a DTensor factory or the mesh's
/// buffer pool).
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
    let Storage::Host(host) = &*storage else {
        return None;
    };
    if host.len() != tensor.nbytes() {
        return None;
    }
    let lent = (host.foreign()? as &dyn std::any::Any)
        .downcast_ref::<WireBytes>()?
        .buffer()?;
    let matches = lent.dtype() == wire_dtype(tensor.dtype()) && lent.len() == tensor.numel();
    matches.then(|| Buffer::Host(lent.share()))
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
    fn bytes_round_trip_through_views() -> Result<()> {
        let flat = Tensor::zeros(&[6], DType::F32)?;
        let view = flat.narrow(0, 2, 3)?;
        let src = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3])?;
        with_bytes(&src, |b| write_bytes(&view, 0, b))??;
        assert_eq!(flat.to_vec::<f32>()?, vec![0.0, 0.0, 1.0, 2.0, 3.0, 0.0]);
        let got = with_bytes(&view, |b| b.to_vec())?;
        assert_eq!(got.len(), 12);
        assert!(matches!(
            write_bytes(&view, 1, &[0u8; 12]),
            Err(Error::BufferMismatch { .. })
        ));
        // Zeroing a view with a NaN in it clears only the view.
        view.copy_from(&Tensor::from_vec(vec![f32::NAN, 5.0, 6.0], &[3])?)?;
        fill_zero(&view)?;
        assert_eq!(flat.to_vec::<f32>()?, vec![0.0; 6]);
        // A strided (transposed) source is read in row-major order; a strided destination is
        // refused.
        let m = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?.transpose(0, 1)?;
        let bytes = with_bytes(&m, |b| b.to_vec())?;
        let t = Tensor::from_bytes(&bytes, &[2, 2], DType::F32)?;
        assert_eq!(t.to_vec::<f32>()?, vec![1.0, 3.0, 2.0, 4.0]);
        assert!(matches!(
            write_bytes(&m, 0, &bytes),
            Err(Error::NotHostMemory { .. })
        ));
        assert!(matches!(fill_zero(&m), Err(Error::NotHostMemory { .. })));
        // Device memory is not read in place: the error names the device.
        let device = hypershard_tensor::Device::Emulated { ordinal: 0 };
        let on_device = src.to_device(&device)?;
        assert!(matches!(
            with_bytes(&on_device, |b| b.len()),
            Err(Error::Tensor(hypershard_tensor::Error::DeviceData { op: "with_bytes", device: d })) if d == device
        ));
        Ok(())
    }

    #[test]
    fn bool_is_read_and_written_as_its_bytes() -> Result<()> {
        assert_eq!(wire_dtype(DType::Bool), collectives::DType::U8);
        assert!(!reducible(DType::Bool));
        assert!(DType::ALL.iter().all(|&d| d == DType::Bool || reducible(d)));
        let flags = Tensor::from_bytes(&[1, 0, 0, 1, 1, 0], &[2, 3], DType::Bool)?;
        assert_eq!(with_bytes(&flags, |b| b.to_vec())?, vec![1, 0, 0, 1, 1, 0]);
        // Transposed: row-major order of the view.
        let columns = flags.transpose(0, 1)?;
        assert_eq!(
            with_bytes(&columns, |b| b.to_vec())?,
            vec![1, 1, 0, 1, 0, 0]
        );
        let buffer = tensor_to_padded_buffer(&columns, 8)?;
        assert_eq!(buffer.as_slice::<u8>()?, &[1, 1, 0, 1, 0, 0, 0, 0]);
        let back = buffer_to_tensor(buffer, &[3, 2], DType::Bool)?;
        assert_eq!(back.to_bytes()?, vec![1, 1, 0, 1, 0, 0]);
        let target = Tensor::zeros(&[4], DType::Bool)?;
        write_bytes(&target, 1, &[1, 1])?;
        assert_eq!(target.to_bytes()?, vec![0, 1, 1, 0]);
        Ok(())
    }

    #[test]
    fn an_exact_buffer_becomes_a_tensor_without_copying() -> Result<()> {
        let buffer = Buffer::from_vec(vec![1.0f32, 2.0, 3.0]);
        let address = buffer.as_host()?.as_bytes().as_ptr() as usize;
        let t = buffer_to_tensor(buffer, &[3], DType::F32)?;
        assert_eq!(t.to_vec::<f32>()?, vec![1.0, 2.0, 3.0]);
        let adopted = with_bytes(&t, |b| b.as_ptr() as usize)?;
        assert_eq!(adopted, address);
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
