//! [`DeviceBuffer`]: dtype-tagged CUDA device memory, the NCCL backend's [`Buffer::Cuda`]. It
//! sits with the buffers, below the backends, because [`Buffer`] names it.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use crate::buffer::{Buffer, BufferLocation, HostBuffer};
use crate::communicator::Communicator;
use crate::dtype::DType;
use crate::error::{DeviceLibrary, Error, Result};
use crate::op::{BufferRole, OpKind};

/// The name the NCCL communicator reports ([`Communicator::backend`]).
pub(crate) const NCCL_BACKEND: &str = "nccl";

/// `len` elements of `dtype` in the memory of one CUDA device.
///
/// The bytes sit behind an [`Arc`] so that [`Clone`] (which [`Buffer`] requires and which
/// cannot fail) is a cheap share instead of a device copy that could run out of memory. Sharing
/// is copy-on-write as for [`HostBuffer::share`]: an op that writes into a shared device
/// buffer first copies it ([`DeviceBuffer::make_unique`], fallible), so no owner sees
/// another's writes. Two device buffers compare equal when they are the same memory with the
/// same dtype and length; comparing contents would need a device→host copy.
///
/// The memory belongs to the stream it was allocated on ([`CudaSlice::stream`]); cudarc's event
/// tracking makes the NCCL stream wait for earlier writes on it before an op reads or writes.
pub struct DeviceBuffer {
    bytes: Arc<CudaSlice<u8>>,
    dtype: DType,
    len: usize,
}

impl DeviceBuffer {
    /// `len` zero elements of `dtype` on the device of `stream`.
    pub fn zeros(stream: &Arc<CudaStream>, dtype: DType, len: usize) -> Result<Self> {
        let bytes = byte_len(dtype, len)?;
        let slice = stream
            .alloc_zeros::<u8>(bytes)
            .map_err(|e| driver("cuMemAlloc", e))?;
        Ok(DeviceBuffer {
            bytes: Arc::new(slice),
            dtype,
            len,
        })
    }

    /// A device copy of `host` on the device of `stream` (the copy is ordered on `stream`).
    pub fn from_host(stream: &Arc<CudaStream>, host: &HostBuffer) -> Result<Self> {
        let slice = stream
            .clone_htod(host.as_bytes())
            .map_err(|e| driver("cuMemcpyHtoDAsync", e))?;
        Ok(DeviceBuffer {
            bytes: Arc::new(slice),
            dtype: host.dtype(),
            len: host.len(),
        })
    }

    /// A host copy of the elements (waits for the buffer's stream to finish writing them).
    pub fn to_host(&self) -> Result<HostBuffer> {
        let mut host = HostBuffer::zeros(self.dtype, self.len);
        self.download(host.as_bytes_mut(), OpKind::Recv)?;
        Ok(host)
    }

    /// Copies the bytes into `destination` (exactly [`byte_len`](Self::byte_len) bytes, else
    /// [`Error::LengthMismatch`] for `op`) and returns once the copy is done.
    pub(crate) fn download(&self, destination: &mut [u8], op: OpKind) -> Result<()> {
        if destination.len() != self.byte_len() {
            return Err(Error::LengthMismatch {
                op,
                role: BufferRole::Output,
                expected: self.byte_len(),
                got: destination.len(),
            });
        }
        let stream = self.bytes.stream().clone();
        stream
            .memcpy_dtoh(self.bytes.as_ref(), destination)
            .map_err(|e| driver("cuMemcpyDtoHAsync", e))?;
        stream
            .synchronize()
            .map_err(|e| driver("cuStreamSynchronize", e))
    }

    /// Adopts device memory as a buffer of `dtype`, without a copy: `bytes.len()` must be a
    /// whole number of elements ([`Error::MisalignedBytes`] otherwise), so that another
    /// crate's device memory can become a collective's buffer. The memory keeps the stream it was allocated on: cudarc's read and
    /// write events on the slice order an NCCL op after that stream's last write, and that
    /// stream's next use after the op.
    pub fn from_slice(bytes: CudaSlice<u8>, dtype: DType) -> Result<Self> {
        let size = dtype.size_bytes();
        if !bytes.len().is_multiple_of(size) {
            return Err(Error::MisalignedBytes {
                dtype,
                bytes: bytes.len(),
            });
        }
        let len = bytes.len() / size;
        Ok(DeviceBuffer {
            bytes: Arc::new(bytes),
            dtype,
            len,
        })
    }

    /// Gives the memory back as cudarc bytes: the allocation itself when no other handle
    /// shares it (no copy), else a private device copy ordered on its stream (copy-on-write,
    /// as for any write through a shared buffer).
    pub fn into_slice(self) -> Result<CudaSlice<u8>> {
        match Arc::try_unwrap(self.bytes) {
            Ok(bytes) => Ok(bytes),
            Err(shared) => shared
                .try_clone()
                .map_err(|e| driver("cuMemcpyDtoDAsync", e)),
        }
    }

    /// Whether `comm` runs collectives on device buffers in place: only the NCCL backend
    /// does. Other backends (local threads, tcp, shm, MPI) take host buffers only, so a caller
    /// holding device memory stages it through host memory for them.
    pub fn accepted_by(comm: &dyn Communicator) -> bool {
        comm.backend() == NCCL_BACKEND
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The number of payload bytes.
    pub fn byte_len(&self) -> usize {
        self.bytes.len()
    }

    /// The device ordinal.
    pub fn device(&self) -> usize {
        self.bytes.ordinal()
    }

    /// `BufferLocation::Cuda { device }`.
    pub fn location(&self) -> BufferLocation {
        BufferLocation::Cuda {
            device: self.device(),
        }
    }

    /// The stream the memory was allocated on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.bytes.stream()
    }

    /// Another handle to the same memory (copy-on-write, like [`HostBuffer::share`]).
    pub fn share(&self) -> DeviceBuffer {
        DeviceBuffer {
            bytes: Arc::clone(&self.bytes),
            dtype: self.dtype,
            len: self.len,
        }
    }

    /// Whether another handle holds this memory (a write would copy it first).
    pub fn is_shared(&self) -> bool {
        Arc::strong_count(&self.bytes) > 1
    }

    /// The device bytes, for reading.
    pub fn slice(&self) -> &CudaSlice<u8> {
        &self.bytes
    }

    /// The device bytes, for writing: a shared buffer is first copied into private memory
    /// (a device-to-device copy ordered on its stream).
    pub fn make_unique(&mut self) -> Result<&mut CudaSlice<u8>> {
        if Arc::get_mut(&mut self.bytes).is_none() {
            let copy = self
                .bytes
                .try_clone()
                .map_err(|e| driver("cuMemcpyDtoDAsync", e))?;
            self.bytes = Arc::new(copy);
        }
        // invariant: the Arc is unique here (checked above, or just replaced; no Weak handles
        // are ever made), so `make_mut` does not clone (CudaSlice::clone panics on failure).
        Ok(Arc::make_mut(&mut self.bytes))
    }
}

/// The byte length of `len` elements, or an error when it overflows.
pub(crate) fn byte_len(dtype: DType, len: usize) -> Result<usize> {
    len.checked_mul(dtype.size_bytes())
        .ok_or(Error::MisalignedBytes {
            dtype,
            bytes: usize::MAX,
        })
}

/// A failed driver call as an [`Error::DeviceCall`].
pub(crate) fn driver(call: &'static str, error: cudarc::driver::DriverError) -> Error {
    Error::DeviceCall {
        op: None,
        library: DeviceLibrary::Cuda,
        call,
        code: error.0 as i32,
    }
}

impl Clone for DeviceBuffer {
    /// A shared handle (see the type's documentation): device copies happen on write.
    fn clone(&self) -> Self {
        self.share()
    }
}

impl PartialEq for DeviceBuffer {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.bytes, &other.bytes) && self.dtype == other.dtype && self.len == other.len
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("dtype", &self.dtype)
            .field("len", &self.len)
            .field("device", &self.device())
            .finish()
    }
}

impl From<DeviceBuffer> for Buffer {
    fn from(device: DeviceBuffer) -> Self {
        Buffer::Cuda(device)
    }
}

impl Buffer {
    /// The device buffer, or `None` for a host buffer.
    pub fn as_device(&self) -> Option<&DeviceBuffer> {
        match self {
            Buffer::Cuda(device) => Some(device),
            Buffer::Host(_) => None,
        }
    }

    /// The buffer's elements in host memory: the buffer itself for a host buffer, a copy for
    /// device memory (waits for the device).
    pub fn to_host(&self) -> Result<HostBuffer> {
        match self {
            Buffer::Host(host) => Ok(host.clone()),
            Buffer::Cuda(device) => device.to_host(),
        }
    }
}
