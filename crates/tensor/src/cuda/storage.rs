//! The CUDA side of tensor storage: [`Device::Cuda`] memory behind the
//! [`DeviceBackend`]/[`DeviceMemory`] traits, so a [`Tensor`](crate::Tensor) can hold GPU
//! memory ([`Storage::Device`](crate::Storage::Device)) and move it with
//! [`to_device`](crate::Tensor::to_device) / [`to_host`](crate::Tensor::to_host).
//!
//! Every operation is ordered on the [`CudaDevice`]'s one stream (stream id 0); the backend
//! makes no other streams yet, so [`Stream::new`](crate::Stream::new) on a CUDA device is
//! [`Error::DeviceUnsupported`]. The crate's host kernels cannot run on GPU memory
//! ([`DeviceMemory::kernel_bytes`] refuses): an op with a CUDA kernel reaches the memory
//! through [`Dev`](super::view::Dev), and an op without one is a typed error there, never a
//! silent host round trip.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::device::CudaDevice;
use super::error::CudaError;
use crate::device::{Device, DeviceBackend, DeviceMemory, Stream};
use crate::storage::HostBuffer;
use crate::{Error, Result};

/// A [`CudaError`] as the tensor crate's [`Error::DeviceFailed`].
fn failed(op: &'static str, device: Device) -> impl FnOnce(CudaError) -> Error {
    move |e| Error::DeviceFailed {
        op,
        device,
        reason: e.to_string(),
    }
}

/// The driver error of one call, as [`Error::DeviceFailed`].
fn driver_failed(
    op: &'static str,
    device: Device,
    call: &'static str,
) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    move |e| Error::DeviceFailed {
        op,
        device,
        reason: format!("{call}: {e:?}"),
    }
}

/// The backend of CUDA device `ordinal` ([`Error::DeviceFailed`] without a GPU or driver).
pub(crate) fn backend(op: &'static str, ordinal: usize) -> Result<Arc<dyn DeviceBackend>> {
    let device = CudaDevice::new(ordinal).map_err(failed(op, Device::Cuda { ordinal }))?;
    Ok(Arc::new(CudaBackend { device }))
}

/// One CUDA device as a storage backend.
#[derive(Debug)]
struct CudaBackend {
    device: CudaDevice,
}

impl CudaBackend {
    fn label(&self) -> Device {
        Device::Cuda {
            ordinal: self.device.ordinal(),
        }
    }

    /// Errors unless `stream` is this device's one stream.
    fn check_stream(&self, op: &'static str, stream: Stream) -> Result<()> {
        if stream.device() != self.label() {
            return Err(Error::DeviceMismatch {
                op,
                lhs: self.label(),
                rhs: stream.device(),
            });
        }
        if stream.id() != 0 {
            return Err(Error::DeviceUnsupported {
                op,
                device: self.label(),
            });
        }
        Ok(())
    }
}

impl DeviceBackend for CudaBackend {
    fn device(&self) -> Device {
        self.label()
    }

    fn allocate(&self, len: usize, stream: Stream) -> Result<Box<dyn DeviceMemory>> {
        const OP: &str = "allocate";
        self.check_stream(OP, stream)?;
        // A zero-byte allocation is an error in CUDA; keep one byte, expose `len`.
        let data = self
            .device
            .stream()
            .alloc_zeros::<u8>(len.max(1))
            .map_err(driver_failed(OP, self.label(), "cuMemAllocAsync"))?;
        Ok(Box::new(CudaMemory {
            data,
            len,
            device: self.device.clone(),
            _tracked: crate::memory::Tracked::on_device(len, self.label()),
        }))
    }

    fn new_stream(&self) -> Result<u64> {
        Err(Error::DeviceUnsupported {
            op: "Stream::new",
            device: self.label(),
        })
    }

    fn synchronize(&self, stream: Stream) -> Result<()> {
        self.check_stream("synchronize", stream)?;
        self.synchronize_all()
    }

    fn synchronize_all(&self) -> Result<()> {
        self.device
            .synchronize()
            .map_err(failed("synchronize", self.label()))
    }

    fn wait(&self, waiter: Stream, on: Stream) -> Result<()> {
        // One stream: its operations are already in order.
        self.check_stream("wait_for", waiter)?;
        self.check_stream("wait_for", on)
    }
}

/// One CUDA allocation.
pub(crate) struct CudaMemory {
    /// At least one byte; the first `len` are the storage.
    data: CudaSlice<u8>,
    len: usize,
    device: CudaDevice,
    _tracked: crate::memory::Tracked,
}

impl std::fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaMemory")
            .field("len", &self.len)
            .field("ordinal", &self.device.ordinal())
            .finish()
    }
}

impl CudaMemory {
    /// The device the allocation belongs to (its stream orders every access).
    pub(crate) fn cuda_device(&self) -> &CudaDevice {
        &self.device
    }

    /// The allocation (at least one byte; the first `len` are the storage).
    pub(crate) fn slice(&self) -> &CudaSlice<u8> {
        &self.data
    }

    fn label(&self) -> Device {
        Device::Cuda {
            ordinal: self.device.ordinal(),
        }
    }

    /// Another crate's device memory of `device` as a storage allocation of `len` bytes (the
    /// whole slice), counted by the memory tracker from now on.
    pub(crate) fn adopt(data: CudaSlice<u8>, len: usize, device: CudaDevice) -> CudaMemory {
        let label = Device::Cuda {
            ordinal: device.ordinal(),
        };
        CudaMemory {
            data,
            len,
            device,
            _tracked: crate::memory::Tracked::on_device(len, label),
        }
    }

    /// The allocation, leaving the storage (and the memory tracker's count): as it is when it
    /// holds exactly `len` bytes, else its first `len` bytes copied into a new one.
    pub(crate) fn into_slice(self, op: &'static str) -> Result<CudaSlice<u8>> {
        if self.data.len() == self.len {
            return Ok(self.data);
        }
        self.copy_out(op, 0, self.len)
    }

    /// `len` bytes from `offset`, copied into a new allocation on the device's stream.
    pub(crate) fn copy_out(
        &self,
        op: &'static str,
        offset: usize,
        len: usize,
    ) -> Result<CudaSlice<u8>> {
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= self.len)
            .ok_or_else(|| self.out_of_range(op, offset, len))?;
        let src = self
            .data
            .try_slice(offset..end)
            .ok_or_else(|| self.out_of_range(op, offset, len))?;
        self.device.stream().clone_dtod(&src).map_err(driver_failed(
            op,
            self.label(),
            "cuMemcpyDtoDAsync",
        ))
    }

    fn check_stream(&self, op: &'static str, stream: Stream) -> Result<()> {
        CudaBackend {
            device: self.device.clone(),
        }
        .check_stream(op, stream)
    }

    /// The range as an error when cudarc would refuse it (it panics on a bad range).
    fn out_of_range(&self, op: &'static str, offset: usize, len: usize) -> Error {
        Error::RangeOutOfBounds {
            op,
            dim: 0,
            start: offset,
            len,
            size: self.len,
        }
    }
}

impl DeviceMemory for CudaMemory {
    fn device(&self) -> Device {
        self.label()
    }

    fn len(&self) -> usize {
        self.len
    }

    fn copy_from_host(
        &mut self,
        op: &'static str,
        offset: usize,
        src: &[u8],
        stream: Stream,
    ) -> Result<()> {
        self.check_stream(op, stream)?;
        if src.is_empty() {
            return Ok(());
        }
        let label = self.label();
        let error = self.out_of_range(op, offset, src.len());
        let cuda_stream = self.device.stream().clone();
        let mut dst = self
            .data
            .try_slice_mut(offset..offset + src.len())
            .ok_or(error)?;
        // A pageable source is staged by the driver before the call returns.
        cuda_stream
            .memcpy_htod(src, &mut dst)
            .map_err(driver_failed(op, label, "cuMemcpyHtoDAsync"))
    }

    fn copy_to_host(
        &self,
        op: &'static str,
        offset: usize,
        dst: &mut [u8],
        stream: Stream,
    ) -> Result<()> {
        self.check_stream(op, stream)?;
        if !dst.is_empty() {
            let src = self
                .data
                .try_slice(offset..offset + dst.len())
                .ok_or_else(|| self.out_of_range(op, offset, dst.len()))?;
            self.device
                .stream()
                .memcpy_dtoh(&src, dst)
                .map_err(driver_failed(op, self.label(), "cuMemcpyDtoHAsync"))?;
        }
        // The host reads `dst` next.
        self.device.synchronize().map_err(failed(op, self.label()))
    }

    fn copy_from_device(
        &mut self,
        op: &'static str,
        dst_offset: usize,
        src: &dyn DeviceMemory,
        src_offset: usize,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        self.check_stream(op, stream)?;
        let Some(src) = src
            .as_any()
            .downcast_ref::<CudaMemory>()
            .filter(|s| s.device.same_device(&self.device))
        else {
            return Err(Error::DeviceMismatch {
                op,
                lhs: self.label(),
                rhs: src.device(),
            });
        };
        if len == 0 {
            return Ok(());
        }
        let label = self.label();
        let from = src
            .data
            .try_slice(src_offset..src_offset + len)
            .ok_or_else(|| src.out_of_range(op, src_offset, len))?;
        let error = self.out_of_range(op, dst_offset, len);
        let cuda_stream = self.device.stream().clone();
        let mut to = self
            .data
            .try_slice_mut(dst_offset..dst_offset + len)
            .ok_or(error)?;
        cuda_stream
            .memcpy_dtod(&from, &mut to)
            .map_err(driver_failed(op, label, "cuMemcpyDtoDAsync"))
    }

    fn fill(
        &mut self,
        op: &'static str,
        offset: usize,
        len: usize,
        byte: u8,
        stream: Stream,
    ) -> Result<()> {
        self.check_stream(op, stream)?;
        if len == 0 {
            return Ok(());
        }
        if byte != 0 {
            // cudarc exposes only the zero memset; a non-zero byte goes up as a copy.
            return self.copy_from_host(op, offset, &vec![byte; len], stream);
        }
        let label = self.label();
        let error = self.out_of_range(op, offset, len);
        let cuda_stream = self.device.stream().clone();
        let mut to = self.data.try_slice_mut(offset..offset + len).ok_or(error)?;
        cuda_stream
            .memset_zeros(&mut to)
            .map_err(driver_failed(op, label, "cuMemsetD8Async"))
    }

    fn kernel_bytes(&self, op: &'static str, _stream: Stream) -> Result<&HostBuffer> {
        Err(Error::DeviceUnsupported {
            op,
            device: self.label(),
        })
    }

    fn kernel_bytes_mut(&mut self, op: &'static str, _stream: Stream) -> Result<&mut HostBuffer> {
        Err(Error::DeviceUnsupported {
            op,
            device: self.label(),
        })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
