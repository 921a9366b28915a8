//! Kernel access for the crates above this one: run a kernel written over element slices on a
//! tensor's data wherever it lives, and allocate its output on a chosen device.
//!
//! [`Tensor::with_data`] is a *host read*: on device data it is
//! [`Error::DeviceData`](crate::Error::DeviceData), so that a program cannot read device
//! memory by accident. A layer's kernel is different: it is the op itself, and it should run
//! where the tensor is. [`Tensor::with_kernel_data`] and [`Tensor::with_kernel_data_mut`] hand
//! the kernel the elements in place:
//!
//! * on the host, exactly [`with_data`](Tensor::with_data) /
//!   [`with_data_mut`](Tensor::with_data_mut): the same checks, the same one lock, no copy;
//! * on the emulated device, the device memory itself through its backend, the access ordered
//!   on the device's current stream (an unsynchronised access across streams is
//!   [`Error::StreamOrder`](crate::Error::StreamOrder));
//! * on a CUDA device, [`Error::DeviceUnsupported`](crate::Error::DeviceUnsupported) naming
//!   the op: a host-written kernel cannot run on GPU memory.
//!
//! [`Tensor::from_kernel_on`] allocates a kernel's output on a device and lets the kernel
//! write it there.
//!
//! ```
//! use hypershard_tensor::{DType, Device, Tensor};
//! let device = Device::Emulated { ordinal: 0 };
//! let x = Tensor::arange(4, DType::F32)?.to_device(&device)?;
//! // A kernel written once over slices: squares into a new tensor on x's device.
//! let y = x.with_kernel_data::<f32, _>("square", |xs| {
//!     Tensor::from_kernel_on::<f32>("square", &[4], &x.device(), |out| {
//!         for (o, &v) in out.iter_mut().zip(xs) {
//!             *o = v * v;
//!         }
//!     })
//! })??;
//! assert_eq!(y.device(), device);
//! assert_eq!(y.to_host()?.to_vec::<f32>()?, vec![0.0, 1.0, 4.0, 9.0]);
//! # Ok::<(), hypershard_tensor::Error>(())
//! ```

use crate::{Device, Element, Result, Tensor};

impl Tensor {
    /// Runs the kernel `f` on the elements of a contiguous tensor, wherever they are (see the
    /// [module docs](crate::kernel_access)), holding the storage's read lock. `op` names the
    /// kernel in errors. As with [`with_data`](Tensor::with_data), `f` must not write to the
    /// same storage through another view.
    ///
    /// Errors: [`Error::DTypeMismatch`](crate::Error::DTypeMismatch) unless `T` is the
    /// tensor's element type, [`Error::NotContiguous`](crate::Error::NotContiguous),
    /// [`Error::Deferred`](crate::Error::Deferred) for a shape-only tensor and
    /// [`Error::DeviceUnsupported`](crate::Error::DeviceUnsupported) where the device cannot
    /// run host-written kernels.
    pub fn with_kernel_data<T: Element, R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&[T]) -> R,
    ) -> Result<R> {
        self.check_dtype::<T>(op)?;
        self.check_contiguous(op)?;
        let guard = self.storage.read();
        let data = guard.data(op)?.typed::<T>();
        Ok(f(&data[self.offset..self.offset + self.numel()]))
    }

    /// [`with_kernel_data`](Tensor::with_kernel_data) for a kernel that writes the elements,
    /// holding the storage's write lock: every view of the storage sees the writes afterwards.
    pub fn with_kernel_data_mut<T: Element, R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut [T]) -> R,
    ) -> Result<R> {
        self.check_dtype::<T>(op)?;
        self.check_contiguous(op)?;
        let mut guard = self.storage.write();
        let n = self.numel();
        let data = guard.data_mut(op)?.typed_mut::<T>();
        Ok(f(&mut data[self.offset..self.offset + n]))
    }

    /// A new contiguous tensor of `shape` on `device` whose elements the kernel `fill` writes
    /// where they live (zeroed before it runs). On the host this is an ordinary zeroed
    /// allocation; on a device that cannot run host-written kernels it is
    /// [`Error::DeviceUnsupported`](crate::Error::DeviceUnsupported) naming `op`.
    pub fn from_kernel_on<T: Element>(
        op: &'static str,
        shape: &[usize],
        device: &Device,
        fill: impl FnOnce(&mut [T]),
    ) -> Result<Tensor> {
        Tensor::build_on::<T>(op, *device, shape, fill)
    }

    /// A tensor holding `data` in row-major order on `device`: on the host exactly
    /// [`Tensor::from_vec`]; elsewhere the values are written into device memory through
    /// [`from_kernel_on`](Tensor::from_kernel_on).
    pub fn from_vec_on<T: Element>(
        data: Vec<T>,
        shape: &[usize],
        device: &Device,
    ) -> Result<Tensor> {
        if device.is_cpu() {
            return Tensor::from_vec(data, shape);
        }
        let numel = Tensor::checked_bytes("from_vec_on", shape, 1)?;
        if numel != data.len() {
            return Err(crate::Error::NumelMismatch {
                op: "from_vec_on",
                shape: shape.to_vec(),
                expected: numel,
                actual: data.len(),
            });
        }
        Tensor::from_kernel_on::<T>("from_vec_on", shape, device, |out| {
            out.copy_from_slice(&data)
        })
    }
}
