//! CUDA tensors as cudarc device memory and back: how a crate with its own device buffers (the
//! NCCL backend's) takes a tensor's bytes without a trip through the host. A tensor that is the
//! only owner of its whole allocation moves it out as it is; anything else is copied device →
//! device, on the device's stream.
//!
//! The memory keeps the stream it was allocated on. cudarc records a read and a write event on
//! every allocation of a context with more than one stream (the tensor crate's stream and the
//! communicator's own make two), so the stream that uses the bytes next waits for the last
//! write, whichever stream made it.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::device::CudaDevice;
use super::storage::CudaMemory;
use crate::device::{Device, DeviceBuffer};
use crate::storage::{SharedStorage, Storage};
use crate::{DType, Error, Result, Tensor};

/// The bytes of `tensor`, a contiguous CUDA tensor, as cudarc memory of exactly
/// `numel × dtype size` bytes (so a collective's buffer built from them has the tensor's
/// length).
///
/// When the tensor starts at its storage's first byte, spans all of it and nothing else holds
/// the storage, the allocation itself moves out: no copy, no new memory. Otherwise the bytes
/// are copied into a new allocation on the device's stream.
///
/// Errors: a tensor that is not on a CUDA device ([`Error::DeviceUnsupported`] naming `op` and
/// its device), one that is not contiguous ([`Error::NotContiguous`]), an empty one
/// ([`Error::EmptyInput`]: CUDA has no allocation of zero bytes), or a driver failure
/// ([`Error::DeviceFailed`]).
pub fn into_cuda_bytes(tensor: Tensor, op: &'static str) -> Result<CudaSlice<u8>> {
    let ordinal = cuda_ordinal(&tensor, op)?;
    if !tensor.is_contiguous() {
        return Err(Error::NotContiguous {
            op,
            shape: tensor.shape().to_vec(),
            strides: tensor.strides().to_vec(),
        });
    }
    let bytes = tensor.numel() * tensor.dtype().size_of();
    if bytes == 0 {
        return Err(Error::EmptyInput { op });
    }
    let start = tensor.offset() * tensor.dtype().size_of();
    if start == 0 && tensor.storage().read().len() == bytes {
        match Arc::try_unwrap(tensor.storage) {
            Ok(shared) => return take_allocation(shared, op),
            Err(storage) => {
                return copy_range(&storage, ordinal, 0, bytes, op);
            }
        }
    }
    copy_range(&tensor.storage, ordinal, start, bytes, op)
}

/// `bytes`, device memory of the tensor crate's CUDA device of the same ordinal, adopted as a
/// contiguous tensor of `shape` and `dtype` (no copy). Its length must be the shape's bytes
/// exactly ([`Error::NumelMismatch`] naming `op` otherwise).
pub fn tensor_from_cuda_bytes(
    bytes: CudaSlice<u8>,
    shape: &[usize],
    dtype: DType,
    op: &'static str,
) -> Result<Tensor> {
    let ordinal = bytes.context().ordinal();
    let label = Device::Cuda { ordinal };
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &s| acc.checked_mul(s))
        .ok_or_else(|| Error::SizeOverflow {
            op,
            shape: shape.to_vec(),
        })?;
    let size = dtype.size_of();
    if numel.checked_mul(size) != Some(bytes.len()) {
        return Err(Error::NumelMismatch {
            op,
            shape: shape.to_vec(),
            expected: numel,
            actual: bytes.len() / size.max(1),
        });
    }
    let device = CudaDevice::new(ordinal).map_err(|e| Error::DeviceFailed {
        op,
        device: label,
        reason: e.to_string(),
    })?;
    let len = bytes.len();
    let memory = CudaMemory::adopt(bytes, len, device);
    Ok(Tensor::from_storage(
        Storage::Device(DeviceBuffer::from_memory(Box::new(memory))),
        dtype,
        shape.to_vec(),
    ))
}

/// The CUDA ordinal of `tensor`'s device, or [`Error::DeviceUnsupported`] for `op`.
fn cuda_ordinal(tensor: &Tensor, op: &'static str) -> Result<usize> {
    match tensor.device() {
        Device::Cuda { ordinal } => Ok(ordinal),
        device => Err(Error::DeviceUnsupported { op, device }),
    }
}

/// The allocation of a storage nothing else holds: moved out when it is CUDA memory of
/// exactly its length.
fn take_allocation(shared: SharedStorage, op: &'static str) -> Result<CudaSlice<u8>> {
    let storage = shared.into_inner();
    let Storage::Device(buffer) = storage else {
        let device = storage.device();
        return Err(Error::DeviceUnsupported { op, device });
    };
    let device = buffer.device();
    let memory: Box<dyn std::any::Any> = buffer.into_memory();
    match memory.downcast::<CudaMemory>() {
        Ok(memory) => memory.into_slice(op),
        Err(_) => Err(Error::DeviceUnsupported { op, device }),
    }
}

/// `len` bytes of `storage` from `start`, copied into a new allocation on the device's stream.
fn copy_range(
    storage: &SharedStorage,
    ordinal: usize,
    start: usize,
    len: usize,
    op: &'static str,
) -> Result<CudaSlice<u8>> {
    let label = Device::Cuda { ordinal };
    let guard = storage.read();
    let Storage::Device(buffer) = &*guard else {
        return Err(Error::DeviceUnsupported {
            op,
            device: guard.device(),
        });
    };
    let Some(memory) = buffer.memory().as_any().downcast_ref::<CudaMemory>() else {
        return Err(Error::DeviceUnsupported { op, device: label });
    };
    memory.copy_out(op, start, len)
}
