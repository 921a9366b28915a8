//! The error type of nn's device layers.

use hypershard_tensor::DType;
use hypershard_tensor::cuda::CudaError;

/// Everything that can go wrong in [`DeviceMlp`](super::DeviceMlp), [`DeviceGpt`](super::DeviceGpt)
/// and the device layers.
///
/// A machine without CUDA gives `Cuda(CudaError::Unavailable { .. })`, never a panic. Bad
/// models and inputs are caught on the host, before anything is launched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The device, a copy, a kernel or cuBLAS failed (or CUDA is unavailable here).
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A host tensor operation failed (a reshape or copy on the CPU side).
    #[error(transparent)]
    Tensor(#[from] hypershard_tensor::Error),
    /// The CPU model could not be read or rebuilt.
    #[error(transparent)]
    Nn(#[from] crate::Error),
    /// The CPU model has a layer with no device version.
    #[error("{op}: layer {index} is a {kind}; only Linear and ReLU run on the device")]
    UnsupportedLayer {
        /// The operation that failed.
        op: &'static str,
        /// The layer's index in the `Sequential`.
        index: usize,
        /// The layer's kind (`Module::kind`).
        kind: &'static str,
    },
    /// The model has no Linear layer, so there is nothing to train and no dtype to run in.
    #[error("{op}: the model has no Linear layer")]
    NoParameters {
        /// The operation that failed.
        op: &'static str,
    },
    /// A parameter does not want a gradient; the device path trains every parameter.
    #[error(
        "{op}: parameter {name} has requires_grad = false, which the device path does not support"
    )]
    FrozenParameter {
        /// The operation that failed.
        op: &'static str,
        /// The parameter's dotted name.
        name: String,
    },
    /// The dtype has no device GEMM (f32, bf16 and f16 have one).
    #[error("{op}: {dtype} has no device GEMM (use f32, bf16 or f16)")]
    UnsupportedDType {
        /// The operation that failed.
        op: &'static str,
        /// The dtype that was given.
        dtype: DType,
    },
    /// Two dtypes that must agree do not.
    #[error("{op}: dtype mismatch, {lhs} vs {rhs}")]
    DTypeMismatch {
        /// The operation that failed.
        op: &'static str,
        /// The expected (the model's) dtype.
        lhs: DType,
        /// The given dtype.
        rhs: DType,
    },
    /// A tensor does not have the shape the operation needs.
    #[error("{op}: expected {expected}, got shape {actual:?}")]
    BadShape {
        /// The operation that failed.
        op: &'static str,
        /// What was needed, in words.
        expected: String,
        /// The shape that was given.
        actual: Vec<usize>,
    },
    /// A configuration the device model does not implement (dropout on the device GPT).
    #[error("{op}: {field} = {value} is not supported on the device: {reason}")]
    UnsupportedConfig {
        /// The operation that failed.
        op: &'static str,
        /// The configuration field.
        field: &'static str,
        /// Its value.
        value: f64,
        /// Why, and what to use instead.
        reason: &'static str,
    },
    /// The CPU model's parameters are not the ones its configuration implies (a parameter
    /// missing, extra, out of order or of another shape), so it cannot be read for the device.
    #[error("{op}: parameter {name}: {reason}")]
    ParameterLayout {
        /// The operation that failed.
        op: &'static str,
        /// The parameter's dotted name.
        name: String,
        /// What was wrong.
        reason: String,
    },
    /// `backward` was called without a `forward` before it.
    #[error("{module}: backward before forward")]
    BackwardBeforeForward {
        /// The module.
        module: &'static str,
    },
}

/// The result of the device layers.
pub type DeviceResult<T> = std::result::Result<T, DeviceError>;
