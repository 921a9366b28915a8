//! The error type of the `cuda` module.

use std::fmt;

use crate::DType;

/// Everything that can go wrong on the device path.
///
/// A machine without CUDA gives [`CudaError::Unavailable`], never a panic; a failed driver,
/// NVRTC or cuBLAS call gives [`CudaError::Call`] with the library's own error code; bad
/// arguments are caught on the host, before any call into CUDA, and name the operation and
/// what was wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// CUDA (or one of its libraries, or the requested device) cannot be used here.
    #[error("CUDA is unavailable: {reason}")]
    Unavailable {
        /// What is missing.
        reason: Unavailable,
    },
    /// A call into the driver, NVRTC or cuBLAS failed.
    #[error("{op}: {library} call {call} failed with code {code}")]
    Call {
        /// The operation that made the call.
        op: &'static str,
        /// The library that failed.
        library: Library,
        /// The function that failed (`"cuMemAllocAsync"`, `"cublasGemmEx"`, ...).
        call: &'static str,
        /// The library's error code (`CUresult`, `nvrtcResult` or `cublasStatus_t`).
        code: i32,
    },
    /// NVRTC rejected the crate's kernel source (a toolkit older than the device, usually).
    #[error("{op}: NVRTC failed to compile the kernels (code {code}, options {options:?}): {log}")]
    Compile {
        /// The operation that needed the kernels.
        op: &'static str,
        /// The `nvrtcResult` code.
        code: i32,
        /// The options that were passed.
        options: Vec<String>,
        /// NVRTC's log.
        log: String,
    },
    /// Two shapes that must agree do not.
    #[error("{op}: shape mismatch, {lhs:?} vs {rhs:?}")]
    ShapeMismatch {
        /// The operation that failed.
        op: &'static str,
        /// The first shape.
        lhs: Vec<usize>,
        /// The second shape.
        rhs: Vec<usize>,
    },
    /// Two dtypes that must be equal are not.
    #[error("{op}: dtype mismatch, {lhs} vs {rhs}")]
    DTypeMismatch {
        /// The operation that failed.
        op: &'static str,
        /// The first (or the tensor's) dtype.
        lhs: DType,
        /// The second (or the requested) dtype.
        rhs: DType,
    },
    /// The operation has no device kernel for this dtype (or pair of dtypes).
    #[error("{op}: no device kernel for {from} -> {to}")]
    UnsupportedDType {
        /// The operation that failed.
        op: &'static str,
        /// The input dtype.
        from: DType,
        /// The output dtype (equal to `from` for operations that keep the dtype).
        to: DType,
    },
    /// A size exceeds what the kernel launch or the library call can express.
    #[error("{op}: {what} = {value} exceeds the limit {max}")]
    TooLarge {
        /// The operation that failed.
        op: &'static str,
        /// Which size.
        what: &'static str,
        /// The size.
        value: usize,
        /// The largest size allowed.
        max: usize,
    },
}

/// The result type of the `cuda` module.
pub type CudaResult<T> = std::result::Result<T, CudaError>;

/// The library behind a failed call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Library {
    /// The CUDA driver (libcuda).
    Driver,
    /// The run-time compiler (libnvrtc).
    Nvrtc,
    /// cuBLAS (libcublas).
    Cublas,
}

impl fmt::Display for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Library::Driver => "CUDA driver",
            Library::Nvrtc => "NVRTC",
            Library::Cublas => "cuBLAS",
        })
    }
}

/// Why CUDA cannot be used ([`CudaError::Unavailable`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unavailable {
    /// No file of the library could be loaded under any of the names that were tried.
    LibraryNotFound {
        /// The library (`"libcuda"`, `"libnvrtc"`, `"libcublas"`).
        library: &'static str,
        /// The file names that were tried.
        tried: Vec<String>,
    },
    /// The driver loaded but there is no device with the requested ordinal.
    NoDevice {
        /// The ordinal asked for.
        requested: usize,
        /// How many devices the driver reported.
        available: usize,
    },
    /// The driver failed to initialise (`cuInit`), with this `CUresult`.
    DriverInit {
        /// The `CUresult` code.
        code: i32,
    },
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unavailable::LibraryNotFound { library, tried } => write!(
                f,
                "{library} could not be loaded (tried {})",
                tried.join(", ")
            ),
            Unavailable::NoDevice {
                requested,
                available,
            } => write!(
                f,
                "no CUDA device {requested} (the driver reports {available})"
            ),
            Unavailable::DriverInit { code } => write!(f, "cuInit failed with code {code}"),
        }
    }
}

/// A failed driver call of `op`.
pub(crate) fn driver(
    op: &'static str,
    call: &'static str,
) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |error| CudaError::Call {
        op,
        library: Library::Driver,
        call,
        code: error.0 as i32,
    }
}

/// A failed cuBLAS call of `op`.
pub(crate) fn cublas(
    op: &'static str,
    call: &'static str,
) -> impl FnOnce(cudarc::cublas::result::CublasError) -> CudaError {
    move |error| CudaError::Call {
        op,
        library: Library::Cublas,
        call,
        code: error.0 as i32,
    }
}

/// A failed NVRTC call of `op`.
pub(crate) fn nvrtc(
    op: &'static str,
    call: &'static str,
) -> impl FnOnce(cudarc::nvrtc::result::NvrtcError) -> CudaError {
    move |error| CudaError::Call {
        op,
        library: Library::Nvrtc,
        call,
        code: error.0 as i32,
    }
}
