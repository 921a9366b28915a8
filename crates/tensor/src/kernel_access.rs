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
    /// [`Tensor::from_vec`]; on a CUDA device one upload; elsewhere the values are written into
    /// device memory through [`from_kernel_on`](Tensor::from_kernel_on).
    pub fn from_vec_on<T: Element>(
        data: Vec<T>,
        shape: &[usize],
        device: &Device,
    ) -> Result<Tensor> {
        if device.is_cpu() {
            return Tensor::from_vec(data, shape);
        }
        if device.is_cuda() {
            // Host-written kernels cannot fill GPU memory: one upload instead.
            return Tensor::from_vec(data, shape)?.to_device(device);
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

#[cfg(test)]
mod tests {
    use crate::{DType, Device, Error, Result, Stream, Tensor};

    #[test]
    fn kernels_run_in_place_on_the_host_and_on_the_emulated_device() -> Result<()> {
        let device = Device::Emulated { ordinal: 20 };
        for on in [Device::Cpu, device] {
            let t = Tensor::arange(6, DType::F32)?.to_device(&on)?;
            let row = t.view(&[2, 3])?.narrow(0, 1, 1)?;
            // Writes through a view land in the shared storage, wherever it is.
            row.with_kernel_data_mut::<f32, _>("double", |xs| {
                xs.iter_mut().for_each(|x| *x *= 2.0)
            })?;
            let sum = t.with_kernel_data::<f32, _>("sum", |xs| xs.iter().sum::<f32>())?;
            assert_eq!(sum, 0.0 + 1.0 + 2.0 + 6.0 + 8.0 + 10.0);
            let built = Tensor::from_kernel_on::<f32>("fill", &[2], &on, |out| out.fill(1.5))?;
            let from_vec = Tensor::from_vec_on(vec![1.5f32, 1.5], &[2], &on)?;
            assert_eq!((built.device(), from_vec.device()), (on, on));
            assert_eq!(built.to_host()?.to_vec::<f32>()?, vec![1.5, 1.5]);
            assert_eq!(from_vec.to_host()?.to_vec::<f32>()?, vec![1.5, 1.5]);
            // The checks of `with_data`, naming the kernel.
            assert!(matches!(
                t.with_kernel_data::<f64, _>("k", |_| ()),
                Err(Error::DTypeMismatch { op: "k", .. })
            ));
            assert!(matches!(
                t.view(&[2, 3])?
                    .transpose(0, 1)?
                    .with_kernel_data::<f32, _>("k", |_| ()),
                Err(Error::NotContiguous { op: "k", .. })
            ));
            assert!(matches!(
                Tensor::from_vec_on(vec![1.0f32], &[2], &on),
                Err(Error::NumelMismatch { .. })
            ));
        }
        Ok(())
    }

    #[test]
    fn device_kernels_keep_the_stream_order() -> Result<()> {
        let device = Device::Emulated { ordinal: 21 };
        let side = Stream::new(&device)?;
        let t = {
            let _scope = side.enter();
            Tensor::arange(4, DType::F32)?.to_device(&device)?
        };
        // The default stream may not read what `side` may still be writing.
        assert!(matches!(
            t.with_kernel_data::<f32, _>("k", |_| ()),
            Err(Error::StreamOrder { op: "k", .. })
        ));
        side.synchronize()?;
        assert_eq!(t.with_kernel_data::<f32, _>("k", |xs| xs.len())?, 4);
        Ok(())
    }
}
