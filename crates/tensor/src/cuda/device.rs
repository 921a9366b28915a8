//! [`CudaDevice`]: one CUDA device, its stream, and its lazily built kernels and cuBLAS handle.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use cudarc::driver::{CudaContext, CudaStream};

use super::blas::BlasHandle;
use super::error::{CudaError, CudaResult, Unavailable, driver};
use super::kernels::Kernels;

/// Every live device, so that two `CudaDevice::new(0)` share one stream, one compiled kernel
/// module and one cuBLAS handle ("compiled once per context").
static DEVICES: Mutex<Vec<(usize, Weak<Inner>)>> = Mutex::new(Vec::new());

/// A CUDA device: the primary context of one GPU and the stream all of this crate's work on it
/// is ordered on.
///
/// Cloning is cheap (a shared handle). [`CudaDevice::new`] for an ordinal that is already open
/// returns the same device, so its kernels are compiled at most once per process while any
/// handle lives. All tensors of a device use its one stream, so their operations run in the
/// order they were issued, and a host read ([`Tensor::to_host`](crate::Tensor::to_host))
/// waits for everything before it.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

/// The fields drop in order: the cuBLAS handle and the module before the stream and the
/// context they use.
struct Inner {
    /// Built by the first kernel launch; `None` until then, or after a failed build (which
    /// the next launch retries).
    kernels: Mutex<Option<Arc<Kernels>>>,
    /// Made by the first matmul, like `kernels`.
    blas: Mutex<Option<Arc<BlasHandle>>>,
    stream: Arc<CudaStream>,
    context: Arc<CudaContext>,
    ordinal: usize,
}

/// Checks that libcuda can be loaded, without touching CUDA state. cudarc's loader panics on
/// the first call into a missing library, so every entry point of this module calls this first
/// and returns [`CudaError::Unavailable`] instead.
pub fn probe() -> CudaResult<()> {
    // SAFETY: `is_culib_present` only tries `dlopen` on a list of library names and drops each
    // handle it opened; it reads and writes no CUDA state. Tested by `tests/cuda.rs`
    // (`creation_reports_unavailability`), on machines with and without libcuda.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    if present {
        Ok(())
    } else {
        Err(CudaError::Unavailable {
            reason: Unavailable::LibraryNotFound {
                library: "libcuda",
                tried: cudarc::get_lib_name_candidates("cuda"),
            },
        })
    }
}

/// The number of CUDA devices, or why there are none: [`CudaError::Unavailable`] with
/// `LibraryNotFound` (no libcuda) or `DriverInit` (`cuInit` failed, as it does in a container
/// without the device files).
pub fn device_count() -> CudaResult<usize> {
    probe()?;
    let count = CudaContext::device_count().map_err(|e| CudaError::Unavailable {
        reason: Unavailable::DriverInit { code: e.0 as i32 },
    })?;
    Ok(usize::try_from(count).unwrap_or(0))
}

impl CudaDevice {
    /// Opens device `ordinal` (or returns the open one), with a stream of its own.
    ///
    /// Fails with [`CudaError::Unavailable`] when libcuda is missing, the driver does not
    /// initialise, or there is no such device; never panics.
    pub fn new(ordinal: usize) -> CudaResult<CudaDevice> {
        let mut devices = DEVICES.lock().unwrap_or_else(PoisonError::into_inner);
        devices.retain(|(_, weak)| weak.strong_count() > 0);
        if let Some(inner) = devices
            .iter()
            .filter(|(o, _)| *o == ordinal)
            .find_map(|(_, weak)| weak.upgrade())
        {
            return Ok(CudaDevice { inner });
        }
        let available = device_count()?;
        if ordinal >= available {
            return Err(CudaError::Unavailable {
                reason: Unavailable::NoDevice {
                    requested: ordinal,
                    available,
                },
            });
        }
        let context = CudaContext::new(ordinal)
            .map_err(driver("CudaDevice::new", "cuDevicePrimaryCtxRetain"))?;
        let stream = context
            .new_stream()
            .map_err(driver("CudaDevice::new", "cuStreamCreate"))?;
        let inner = Arc::new(Inner {
            ordinal,
            context,
            stream,
            kernels: Mutex::new(None),
            blas: Mutex::new(None),
        });
        devices.push((ordinal, Arc::downgrade(&inner)));
        Ok(CudaDevice { inner })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The device's name, as the driver reports it.
    pub fn name(&self) -> CudaResult<String> {
        self.inner
            .context
            .name()
            .map_err(driver("CudaDevice::name", "cuDeviceGetName"))
    }

    /// The compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> CudaResult<(i32, i32)> {
        self.inner.context.compute_capability().map_err(driver(
            "CudaDevice::compute_capability",
            "cuDeviceGetAttribute",
        ))
    }

    /// Waits until every operation issued on the device's stream has finished, and reports
    /// any error the driver recorded on the way (cudarc defers some, such as failed event
    /// waits, to this point).
    pub fn synchronize(&self) -> CudaResult<()> {
        self.inner
            .stream
            .synchronize()
            .map_err(driver("CudaDevice::synchronize", "cuStreamSynchronize"))?;
        self.inner
            .context
            .check_err()
            .map_err(driver("CudaDevice::synchronize", "deferred driver call"))
    }

    /// The cudarc context (for interop with other crates' device code).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.context
    }

    /// The stream this crate orders its work on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// Whether two handles are the same device.
    pub fn same_device(&self, other: &CudaDevice) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The compiled kernels, built on first use (NVRTC, then a module load).
    pub(crate) fn kernels(&self, op: &'static str) -> CudaResult<Arc<Kernels>> {
        let mut slot = self
            .inner
            .kernels
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(kernels) = slot.as_ref() {
            return Ok(Arc::clone(kernels));
        }
        let kernels = Arc::new(Kernels::build(op, self)?);
        *slot = Some(Arc::clone(&kernels));
        Ok(kernels)
    }

    /// The cuBLAS handle, made on first use and bound to the device's stream.
    pub(crate) fn blas(&self, op: &'static str) -> CudaResult<Arc<BlasHandle>> {
        let mut slot = self
            .inner
            .blas
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(blas) = slot.as_ref() {
            return Ok(Arc::clone(blas));
        }
        let blas = Arc::new(BlasHandle::new(op, self)?);
        *slot = Some(Arc::clone(&blas));
        Ok(blas)
    }
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.inner.ordinal)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn device_types_cross_threads() {
        // Tensors cross threads (ranks, communication threads); this fails to compile if the
        // device handle stops being Send + Sync.
        send_sync::<CudaDevice>();
    }

    #[test]
    fn errors_name_what_is_missing() {
        let error = CudaError::Unavailable {
            reason: Unavailable::NoDevice {
                requested: 3,
                available: 1,
            },
        };
        assert_eq!(
            error.to_string(),
            "CUDA is unavailable: no CUDA device 3 (the driver reports 1)"
        );
        let call = driver("op", "cuMemAllocAsync")(cudarc::driver::DriverError(
            cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        ));
        assert!(matches!(
            call,
            CudaError::Call {
                op: "op",
                call: "cuMemAllocAsync",
                code: 2,
                ..
            }
        ));
        assert_eq!(
            call.to_string(),
            "op: CUDA driver call cuMemAllocAsync failed with code 2"
        );
    }
}
