//! [`CudaTensor`] (dense device storage with a dtype and shape) and [`PinnedBuffer`]
//! (page-locked host memory for offload), with the copies between them and host tensors.

use std::fmt;

use cudarc::driver::{CudaSlice, PinnedHostSlice};

use super::device::CudaDevice;
use super::error::{CudaError, CudaResult, driver};
use crate::{DType, HostBuffer, Tensor};

/// A dense, contiguous, row-major tensor in the memory of one CUDA device.
///
/// It owns its device memory (no views yet): `dtype`, `shape` and the bytes, freed on the
/// device's stream when dropped (cudarc's `Drop` records a failed free in the context instead of
/// panicking). Every operation is ordered on the device's stream; reading the data back
/// ([`to_host`](CudaTensor::to_host), [`copy_to_host_bytes`](CudaTensor::copy_to_host_bytes))
/// waits for the operations before it.
pub struct CudaTensor {
    /// At least one byte (a zero-byte allocation is an error in CUDA); the first `nbytes` hold
    /// the elements.
    pub(crate) data: CudaSlice<u8>,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) numel: usize,
    pub(crate) device: CudaDevice,
}

/// The element count and byte length of `shape` in `dtype`, or [`CudaError::TooLarge`].
pub(crate) fn sizes(op: &'static str, shape: &[usize], dtype: DType) -> CudaResult<(usize, usize)> {
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or(CudaError::TooLarge {
            op,
            what: "element count",
            value: usize::MAX,
            max: usize::MAX,
        })?;
    // Device and pinned allocations are bounded by isize::MAX bytes (cudarc asserts it).
    let max = isize::MAX as usize;
    let nbytes = numel
        .checked_mul(dtype.size_of())
        .filter(|&b| b <= max)
        .ok_or(CudaError::TooLarge {
            op,
            what: "byte length",
            value: numel.saturating_mul(dtype.size_of()),
            max,
        })?;
    Ok((numel, nbytes))
}

impl CudaTensor {
    /// A tensor of `shape` whose memory the caller writes in full before reading it.
    fn uninit(
        op: &'static str,
        device: &CudaDevice,
        shape: &[usize],
        dtype: DType,
    ) -> CudaResult<CudaTensor> {
        let (numel, nbytes) = sizes(op, shape, dtype)?;
        // SAFETY: device memory is never a Rust reference, so uninitialised bytes are not
        // undefined behaviour here; every caller (cast, matmul, from_bytes, try_clone) writes
        // all `nbytes` before the tensor is returned. Tested by the device tests (`cast_*`,
        // `gemm_*`, `round_trip`).
        let data = unsafe { device.stream().alloc::<u8>(nbytes.max(1)) }
            .map_err(driver(op, "cuMemAllocAsync"))?;
        Ok(CudaTensor {
            data,
            dtype,
            shape: shape.to_vec(),
            numel,
            device: device.clone(),
        })
    }

    /// A tensor of zeros.
    pub fn zeros(device: &CudaDevice, shape: &[usize], dtype: DType) -> CudaResult<CudaTensor> {
        let op = "CudaTensor::zeros";
        let (numel, nbytes) = sizes(op, shape, dtype)?;
        let data = device
            .stream()
            .alloc_zeros::<u8>(nbytes.max(1))
            .map_err(driver(op, "cuMemAllocAsync"))?;
        Ok(CudaTensor {
            data,
            dtype,
            shape: shape.to_vec(),
            numel,
            device: device.clone(),
        })
    }

    /// A device copy of little-endian element bytes (`bytes.len()` must be the byte length of
    /// `shape` in `dtype`, else [`CudaError::LengthMismatch`]).
    pub fn from_bytes(
        device: &CudaDevice,
        bytes: &[u8],
        shape: &[usize],
        dtype: DType,
    ) -> CudaResult<CudaTensor> {
        let op = "CudaTensor::from_bytes";
        let mut out = CudaTensor::uninit(op, device, shape, dtype)?;
        out.write_bytes(op, bytes)?;
        Ok(out)
    }

    /// A device copy of a host tensor (any layout; the device copy is contiguous).
    pub fn from_host(device: &CudaDevice, tensor: &Tensor) -> CudaResult<CudaTensor> {
        let bytes = tensor.to_bytes()?;
        CudaTensor::from_bytes(device, &bytes, tensor.shape(), tensor.dtype())
    }

    /// A host copy (waits for the device's earlier work on this tensor).
    pub fn to_host(&self) -> CudaResult<Tensor> {
        let mut host = HostBuffer::zeroed(self.nbytes());
        self.copy_to_host_bytes(host.as_bytes_mut())?;
        Ok(Tensor::from_host_buffer(host, &self.shape, self.dtype)?)
    }

    /// Copies the elements into `destination`, which must hold exactly
    /// [`nbytes`](CudaTensor::nbytes) bytes, and returns once the copy is done.
    pub fn copy_to_host_bytes(&self, destination: &mut [u8]) -> CudaResult<()> {
        let op = "CudaTensor::copy_to_host_bytes";
        self.check_bytes(op, "destination", destination.len())?;
        if self.nbytes() > 0 {
            // `data` holds exactly `nbytes` bytes when `nbytes > 0` (see `uninit`), so the
            // lengths agree and cudarc's length assertion holds.
            self.device
                .stream()
                .memcpy_dtoh(&self.data, destination)
                .map_err(driver(op, "cuMemcpyDtoHAsync"))?;
        }
        self.device.synchronize()
    }

    /// Overwrites the elements with those of a host tensor of the same shape and dtype.
    pub fn copy_from_host(&mut self, source: &Tensor) -> CudaResult<()> {
        let op = "CudaTensor::copy_from_host";
        self.check_like(op, source.shape(), source.dtype())?;
        let bytes = source.to_bytes()?;
        self.write_bytes(op, &bytes)
    }

    /// Overwrites the elements with `bytes` (exactly `nbytes` of them), ordered on the stream.
    fn write_bytes(&mut self, op: &'static str, bytes: &[u8]) -> CudaResult<()> {
        self.check_bytes(op, "source", bytes.len())?;
        if bytes.is_empty() {
            return Ok(());
        }
        // A pageable source is staged by the driver before the call returns, so `bytes` may be
        // reused at once.
        self.device
            .stream()
            .memcpy_htod(bytes, &mut self.data)
            .map_err(driver(op, "cuMemcpyHtoDAsync"))
    }

    /// Starts a copy into a pinned buffer of exactly [`nbytes`](CudaTensor::nbytes) bytes
    /// (offload). It runs on the device's stream; the buffer's readers wait for it.
    pub fn copy_to_pinned(&self, destination: &mut PinnedBuffer) -> CudaResult<()> {
        let op = "CudaTensor::copy_to_pinned";
        self.device.check_same(op, &destination.device)?;
        self.check_bytes(op, "pinned buffer", destination.len())?;
        if self.nbytes() == 0 {
            return Ok(());
        }
        // Both hold exactly `nbytes` bytes here (checked above; see `uninit` and
        // `PinnedBuffer::zeroed`).
        self.device
            .stream()
            .memcpy_dtoh(&self.data, &mut destination.slice)
            .map_err(driver(op, "cuMemcpyDtoHAsync"))
    }

    /// Starts a copy from a pinned buffer of exactly [`nbytes`](CudaTensor::nbytes) bytes
    /// (reload after offload), ordered on the device's stream.
    pub fn copy_from_pinned(&mut self, source: &PinnedBuffer) -> CudaResult<()> {
        let op = "CudaTensor::copy_from_pinned";
        self.device.check_same(op, &source.device)?;
        self.check_bytes(op, "pinned buffer", source.len())?;
        if self.nbytes() == 0 {
            return Ok(());
        }
        self.device
            .stream()
            .memcpy_htod(&source.slice, &mut self.data)
            .map_err(driver(op, "cuMemcpyHtoDAsync"))
    }

    /// Overwrites the elements with those of `source` (same device, shape and dtype).
    pub fn copy_from(&mut self, source: &CudaTensor) -> CudaResult<()> {
        let op = "CudaTensor::copy_from";
        self.device.check_same(op, &source.device)?;
        self.check_like(op, &source.shape, source.dtype)?;
        if self.nbytes() == 0 {
            return Ok(());
        }
        self.device
            .stream()
            .memcpy_dtod(&source.data, &mut self.data)
            .map_err(driver(op, "cuMemcpyDtoDAsync"))
    }

    /// A device copy in new memory.
    pub fn try_clone(&self) -> CudaResult<CudaTensor> {
        let mut out = CudaTensor::uninit(
            "CudaTensor::try_clone",
            &self.device,
            &self.shape,
            self.dtype,
        )?;
        out.copy_from(self)?;
        Ok(out)
    }

    /// Sets every element to zero.
    pub fn zero_(&mut self) -> CudaResult<()> {
        self.device
            .stream()
            .memset_zeros(&mut self.data)
            .map_err(driver("CudaTensor::zero_", "cuMemsetD8Async"))
    }

    /// The same memory under another shape with the same element count.
    pub fn reshape(mut self, shape: &[usize]) -> CudaResult<CudaTensor> {
        let (numel, _) = sizes("CudaTensor::reshape", shape, self.dtype)?;
        if numel != self.numel {
            return Err(CudaError::ShapeMismatch {
                op: "CudaTensor::reshape",
                lhs: self.shape.clone(),
                rhs: shape.to_vec(),
            });
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// The number of bytes of the elements.
    pub fn nbytes(&self) -> usize {
        self.numel * self.dtype.size_of()
    }

    /// The device the memory belongs to.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Errors unless `got` (bytes of `role`) is this tensor's byte length.
    fn check_bytes(&self, op: &'static str, role: &'static str, got: usize) -> CudaResult<()> {
        if got == self.nbytes() {
            Ok(())
        } else {
            Err(CudaError::LengthMismatch {
                op,
                role,
                expected: self.nbytes(),
                got,
                unit: "bytes",
            })
        }
    }

    /// Errors unless `shape` and `dtype` are this tensor's.
    pub(crate) fn check_like(
        &self,
        op: &'static str,
        shape: &[usize],
        dtype: DType,
    ) -> CudaResult<()> {
        if dtype != self.dtype {
            return Err(CudaError::DTypeMismatch {
                op,
                lhs: self.dtype,
                rhs: dtype,
            });
        }
        if shape != self.shape.as_slice() {
            return Err(CudaError::ShapeMismatch {
                op,
                lhs: self.shape.clone(),
                rhs: shape.to_vec(),
            });
        }
        Ok(())
    }

    /// A new tensor on the same device for the output of an operation that writes all of it.
    pub(crate) fn output(
        &self,
        op: &'static str,
        shape: &[usize],
        dtype: DType,
    ) -> CudaResult<CudaTensor> {
        CudaTensor::uninit(op, &self.device, shape, dtype)
    }
}

impl fmt::Debug for CudaTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaTensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("device", &self.device.ordinal())
            .finish()
    }
}

/// Page-locked ("pinned") host memory, the staging area of parameter and optimizer-state
/// offload: copies between it and the device run asynchronously at full bus speed, where a
/// pageable buffer is staged by the driver.
///
/// The memory is allocated without `CU_MEMHOSTALLOC_WRITECOMBINED` (cudarc's default for
/// `alloc_pinned`), because offloaded data is read back on the host, and reads of
/// write-combined memory are uncached. Access from the host ([`as_bytes`](PinnedBuffer::as_bytes),
/// [`as_bytes_mut`](PinnedBuffer::as_bytes_mut)) first waits for every copy in flight to or
/// from the buffer.
pub struct PinnedBuffer {
    /// At least one byte; the first `len` are the buffer.
    slice: PinnedHostSlice<u8>,
    len: usize,
    device: CudaDevice,
}

impl PinnedBuffer {
    /// `len` zero bytes of pinned memory, registered with `device`'s context.
    pub fn zeroed(device: &CudaDevice, len: usize) -> CudaResult<PinnedBuffer> {
        let op = "PinnedBuffer::zeroed";
        let max = isize::MAX as usize;
        if len >= max {
            return Err(CudaError::TooLarge {
                op,
                what: "pinned bytes",
                value: len,
                max: max - 1,
            });
        }
        // SAFETY: the flags (0: no write-combining, not portable, not mapped) are valid for
        // cuMemHostAlloc; `len.max(1)` is below isize::MAX (checked above), so cudarc's size
        // assertions hold; the memory is zeroed below before anyone reads it. Tested by the
        // device test `pinned_offload`.
        let mut slice = unsafe {
            device
                .context()
                .alloc_pinned_with_flags::<u8>(len.max(1), 0)
        }
        .map_err(driver(op, "cuMemHostAlloc"))?;
        slice
            .as_mut_slice()
            .map_err(driver(op, "cuEventSynchronize"))?
            .fill(0);
        Ok(PinnedBuffer {
            slice,
            len,
            device: device.clone(),
        })
    }

    /// Pinned memory holding the bytes of a host tensor (row-major).
    pub fn from_tensor(device: &CudaDevice, tensor: &Tensor) -> CudaResult<PinnedBuffer> {
        let bytes = tensor.to_bytes()?;
        let mut pinned = PinnedBuffer::zeroed(device, bytes.len())?;
        pinned.as_bytes_mut()?.copy_from_slice(&bytes);
        Ok(pinned)
    }

    /// The bytes as a host tensor of `shape` and `dtype` (waits for copies in flight).
    pub fn to_tensor(&self, shape: &[usize], dtype: DType) -> CudaResult<Tensor> {
        Ok(Tensor::from_bytes(self.as_bytes()?, shape, dtype)?)
    }

    /// The bytes, once every copy in flight to or from the buffer has finished.
    pub fn as_bytes(&self) -> CudaResult<&[u8]> {
        let bytes = self
            .slice
            .as_slice()
            .map_err(driver("PinnedBuffer::as_bytes", "cuEventSynchronize"))?;
        Ok(&bytes[..self.len])
    }

    /// The bytes for writing, once every copy in flight has finished.
    pub fn as_bytes_mut(&mut self) -> CudaResult<&mut [u8]> {
        let len = self.len;
        let bytes = self
            .slice
            .as_mut_slice()
            .map_err(driver("PinnedBuffer::as_bytes_mut", "cuEventSynchronize"))?;
        Ok(&mut bytes[..len])
    }

    /// The number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .field("device", &self.device.ordinal())
            .finish()
    }
}
