//! A [`Tensor`] whose storage is CUDA memory, seen by a kernel launch: the device address of
//! its first element, its element count, dtype and shape, and the [`CudaDevice`] whose stream
//! orders the launch.
//!
//! Every CUDA op of the crate takes `Tensor`s and reads them through [`Dev::of`], which checks
//! that the tensor is contiguous and on a CUDA device and takes the storage's read lock only
//! long enough to read the address. The address stays valid for the whole op: the caller holds
//! the `&Tensor` (so its storage is alive), device memory is freed on the device's one stream
//! (so after every launch ordered before the free), and every launch and copy of the crate is
//! ordered on that same stream, which is what serialises a kernel's writes against later reads.

use cudarc::driver::DevicePtr;

use super::device::CudaDevice;
use super::error::CudaError;
use super::storage::CudaMemory;
use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Tensor};

/// A contiguous tensor on a CUDA device, as a kernel argument.
#[derive(Debug)]
pub(crate) struct Dev {
    /// The device address of the first element.
    pub(crate) ptr: u64,
    pub(crate) numel: usize,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) device: CudaDevice,
}

impl Dev {
    /// The CUDA memory behind `t`: [`Error::NotContiguous`] for a strided view,
    /// [`Error::DeviceUnsupported`] naming `op` for a tensor that is not on a CUDA device.
    pub(crate) fn of(op: &'static str, t: &Tensor) -> Result<Dev> {
        t.check_contiguous(op)?;
        let guard = t.storage.read();
        let memory = match &*guard {
            Storage::Device(buf) => buf.memory().as_any().downcast_ref::<CudaMemory>(),
            _ => None,
        };
        let Some(memory) = memory else {
            return Err(Error::DeviceUnsupported {
                op,
                device: guard.device(),
            });
        };
        let device = memory.cuda_device().clone();
        // The sync guard only records cudarc's read event; with one stream per device the
        // stream's order is the synchronisation, so it is dropped at once.
        let base = {
            let (base, _sync) = memory.slice().device_ptr(device.stream());
            base
        };
        Ok(Dev {
            ptr: base + (t.offset * t.dtype.size_of()) as u64,
            numel: t.numel(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            device,
        })
    }

    /// The tensor crate's name of the device.
    pub(crate) fn label(&self) -> Device {
        Device::Cuda {
            ordinal: self.device.ordinal(),
        }
    }

    /// Errors unless `other` is on this tensor's device.
    pub(crate) fn same_device(&self, op: &'static str, other: &Dev) -> Result<()> {
        if self.device.same_device(&other.device) {
            Ok(())
        } else {
            Err(Error::DeviceMismatch {
                op,
                lhs: self.label(),
                rhs: other.label(),
            })
        }
    }

    /// Errors unless this tensor has `dtype`.
    pub(crate) fn dtype_is(&self, op: &'static str, dtype: DType) -> Result<()> {
        if self.dtype == dtype {
            Ok(())
        } else {
            Err(Error::DTypeMismatch {
                op,
                lhs: dtype,
                rhs: self.dtype,
            })
        }
    }

    /// Errors unless this tensor has exactly `shape`.
    pub(crate) fn shape_is(&self, op: &'static str, shape: &[usize]) -> Result<()> {
        if self.shape == shape {
            Ok(())
        } else {
            Err(Error::ShapeMismatch {
                op,
                lhs: shape.to_vec(),
                rhs: self.shape.clone(),
            })
        }
    }

    /// [`dtype_is`](Dev::dtype_is) f32, the one dtype of the layer kernels.
    pub(crate) fn f32(&self, op: &'static str) -> Result<()> {
        if self.dtype == DType::F32 {
            Ok(())
        } else {
            Err(Error::UnsupportedDType {
                op,
                dtype: self.dtype,
            })
        }
    }

    /// A new zeroed tensor of `shape` and `dtype` on this tensor's device, and its view.
    pub(crate) fn output(
        &self,
        op: &'static str,
        shape: &[usize],
        dtype: DType,
    ) -> Result<(Tensor, Dev)> {
        let t = Tensor::zeros_on(shape, dtype, &self.label())?;
        let view = Dev::of(op, &t)?;
        Ok((t, view))
    }

    /// A [`CudaError`] of an op on this device as the crate's error.
    pub(crate) fn error(&self, op: &'static str) -> impl FnOnce(CudaError) -> Error {
        cuda_error(op, self.label())
    }
}

/// A [`CudaError`] as the crate's [`Error`]: argument errors keep their kind, everything the
/// driver, NVRTC or cuBLAS reports is [`Error::DeviceFailed`] with the library's message.
pub(crate) fn cuda_error(op: &'static str, device: Device) -> impl FnOnce(CudaError) -> Error {
    move |e| match e {
        CudaError::ShapeMismatch { lhs, rhs, .. } => Error::ShapeMismatch { op, lhs, rhs },
        CudaError::DTypeMismatch { lhs, rhs, .. } => Error::DTypeMismatch { op, lhs, rhs },
        CudaError::UnsupportedDType { from, .. } => Error::UnsupportedDType { op, dtype: from },
        other => Error::DeviceFailed {
            op,
            device,
            reason: other.to_string(),
        },
    }
}

/// Launches kernel `$name` on `$dev`'s device with `$config`, after `$push` has pushed its
/// arguments onto the launch builder `$l`; evaluates to `crate::Result<()>`. (A macro rather
/// than a function: the builder borrows the kernel table, which must live in the caller's
/// frame.)
macro_rules! launch {
    ($op:expr, $dev:expr, $name:expr, $config:expr, |$l:ident| $push:block) => {{
        let dev: &$crate::cuda::view::Dev = $dev;
        let kernels = dev.device.kernels($op).map_err(dev.error($op))?;
        let function = kernels.function($op, $name).map_err(dev.error($op))?;
        let stream = dev.device.stream();
        let mut $l = stream.launch_builder(function);
        $push
        // SAFETY: every caller pushes exactly the arguments its kernel declares in kernels.cu,
        // in order and with the declared types (device addresses as `u64` from `Dev::of`,
        // `u64` counts, `u32` flags, `f32`/`f64` scalars), after checking on the host that
        // each tensor holds the elements the kernel reads or writes for those counts (stated
        // at each call). The tensors are borrowed by the caller until the launch is ordered on
        // the device's stream, and device memory is freed on that stream, so none is freed
        // while the kernel runs (see the module docs). Tested by the device tests of
        // crates/tensor/tests/cuda.rs and crates/nn/tests/cuda_devices.rs (each kernel
        // against the host op).
        unsafe { $l.launch($config) }.map(|_| ()).map_err(|e| {
            $crate::Error::DeviceFailed {
                op: $op,
                device: dev.label(),
                reason: format!("cuLaunchKernel: {e:?}"),
            }
        })
    }};
}
pub(crate) use launch;
