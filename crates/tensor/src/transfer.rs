//! Tensors on devices: which device a tensor is on, explicit copies between devices, and the
//! output allocation that lets one op body run wherever its inputs are.

use std::sync::Arc;

use crate::dtype::sealed::Repr;
use crate::dtype::with_bits;
use crate::storage::{HostBuffer, SharedStorage, Storage};
use crate::{DType, Device, DeviceBuffer, Result, Tensor};

/// Zeroed storage for a contiguous `shape` of `elem`-byte elements on `device`.
#[inline(never)]
fn zeroed_storage(
    op: &'static str,
    device: Device,
    shape: &[usize],
    elem: usize,
) -> Result<Storage> {
    let bytes = Tensor::checked_bytes(op, shape, elem)?;
    if device.is_cpu() {
        return Ok(Storage::Host(HostBuffer::zeroed(bytes)));
    }
    Ok(Storage::Device(DeviceBuffer::zeroed(op, &device, bytes)?))
}

impl Tensor {
    /// The device the tensor's data is on ([`Device::Cpu`] for host and deferred tensors).
    pub fn device(&self) -> Device {
        self.storage.read().device()
    }

    /// [`Tensor::build_raw`] with the output on `device`: the kernel `fill` writes the
    /// device's memory through its backend (or the op is refused there with a typed error).
    pub(crate) fn build_raw_on<T: bytemuck::Pod>(
        op: &'static str,
        device: Device,
        shape: &[usize],
        dtype: DType,
        fill: impl FnOnce(&mut [T]),
    ) -> Result<Tensor> {
        // Only the kernel call is generic: the allocation and the wrapping are shared by every
        // op, so each kernel is compiled once (not once per device kind) and the crate's
        // build time stays proportional to its kernels.
        let mut storage = zeroed_storage(op, device, shape, size_of::<T>())?;
        fill(storage.data_mut(op)?.typed_mut::<T>());
        Ok(Tensor::from_storage(storage, dtype, shape.to_vec()))
    }

    /// [`Tensor::build`] with the output on `device` (see [`Tensor::build_raw_on`]).
    pub(crate) fn build_on<T: Repr>(
        op: &'static str,
        device: Device,
        shape: &[usize],
        fill: impl FnOnce(&mut [T]),
    ) -> Result<Tensor> {
        Tensor::build_raw_on::<T>(op, device, shape, T::DTYPE, fill)
    }

    /// A tensor of zeros on `device` (on the host, exactly [`Tensor::zeros`], deferred
    /// inside a [`deferred_init`](crate::deferred_init) scope).
    ///
    /// ```
    /// use hypershard_tensor::{DType, Device, Tensor};
    /// let device = Device::Emulated { ordinal: 0 };
    /// let z = Tensor::zeros_on(&[3], DType::I64, &device)?;
    /// assert_eq!(z.device(), device);
    /// assert_eq!(z.to_host()?.to_vec::<i64>()?, vec![0, 0, 0]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn zeros_on(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        if device.is_cpu() {
            return Tensor::zeros(shape, dtype);
        }
        let bytes = Tensor::checked_bytes("zeros_on", shape, dtype.size_of())?;
        // The backend zeroes its allocations, on the current stream.
        let buf = DeviceBuffer::zeroed("zeros_on", device, bytes)?;
        Ok(Tensor::from_storage(
            Storage::Device(buf),
            dtype,
            shape.to_vec(),
        ))
    }

    /// A contiguous copy of the tensor on `device`; the tensor itself (another view, no copy)
    /// when it is already there. Between two devices the copy is staged through the host.
    ///
    /// ```
    /// use hypershard_tensor::{Device, Tensor};
    /// let host = Tensor::from_vec(vec![1u8, 2, 3, 4, 5, 6], &[2, 3])?;
    /// let device = Device::Emulated { ordinal: 0 };
    /// let column = host.narrow(1, 1, 1)?.to_device(&device)?; // a strided view, gathered
    /// assert_eq!(column.device(), device);
    /// assert_eq!(column.to_host()?.to_vec::<u8>()?, vec![2, 5]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        const OP: &str = "to_device";
        let from = self.device();
        if from == *device {
            return Ok(self.clone());
        }
        if !from.is_cpu() {
            return self.to_host()?.to_device(device);
        }
        let buf = {
            let guard = self.storage.read();
            let host = guard.host(OP)?;
            if self.is_contiguous() {
                let start = self.offset * self.dtype.size_of();
                let bytes = &host.as_bytes()[start..start + self.nbytes()];
                DeviceBuffer::from_host(OP, device, bytes)?
            } else {
                let bytes = with_bits!(self.dtype, T => {
                    bytemuck::cast_slice::<T, u8>(&self.gather(host.typed::<T>())).to_vec()
                });
                DeviceBuffer::from_host(OP, device, &bytes)?
            }
        };
        Ok(Tensor::from_storage(
            Storage::Device(buf),
            self.dtype,
            self.shape.clone(),
        ))
    }

    /// A contiguous host copy of a device tensor, on the device's current stream, waiting for
    /// the copy (see [`emulated`](crate::emulated) for the stream rules); a host tensor
    /// itself (another view, no copy).
    ///
    /// A strided view copies the span of storage it covers and gathers it on the host, so
    /// every view (narrow, transpose, expand) comes back in row-major order.
    pub fn to_host(&self) -> Result<Tensor> {
        const OP: &str = "to_host";
        let guard = self.storage.read();
        let buf = match &*guard {
            Storage::Device(buf) => buf,
            _ => return Ok(self.clone()),
        };
        let size = self.dtype.size_of();
        if self.is_contiguous() {
            let mut host = HostBuffer::zeroed(self.nbytes());
            buf.copy_to_host(OP, self.offset * size, host.as_bytes_mut())?;
            return Ok(Tensor::from_host(host, self.dtype, self.shape.clone()));
        }
        if self.numel() == 0 {
            return Tensor::zeros(&self.shape, self.dtype);
        }
        // One past the last element the view reaches, counted from its first.
        let span = 1 + self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(&n, &s)| (n - 1) * s)
            .sum::<usize>();
        let mut host = HostBuffer::zeroed(span * size);
        buf.copy_to_host(OP, self.offset * size, host.as_bytes_mut())?;
        drop(guard);
        let staged = Tensor {
            storage: Arc::new(SharedStorage::new(Storage::Host(host))),
            dtype: self.dtype,
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            offset: 0,
        };
        staged.deep_copy()
    }
}
