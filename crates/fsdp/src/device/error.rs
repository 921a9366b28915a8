//! The error type of FSDP on device.

use hypershard_tensor::DType;
use hypershard_tensor::cuda::CudaError;

/// Everything that can go wrong while sharding, gathering, reducing or stepping on device.
///
/// A machine without CUDA (or without the requested device) gives
/// `Cuda(CudaError::Unavailable { .. })`, never a panic. Misuse is caught on the host before
/// anything is launched, and names the rank and what was wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceFsdpError {
    /// The device, a copy or a kernel failed (or CUDA is unavailable here).
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// nn's device layers refused the model or failed.
    #[error(transparent)]
    Layers(#[from] hypershard_nn::cuda::DeviceError),
    /// A host tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] hypershard_tensor::Error),
    /// The CPU model could not be read or rebuilt.
    #[error(transparent)]
    Nn(#[from] hypershard_nn::Error),
    /// The shard layout's math failed (shared with the CPU FSDP).
    #[error(transparent)]
    Layout(#[from] crate::FsdpError),
    /// A collective failed.
    #[error("rank {rank}: {op} of group {group} failed: {source}")]
    Comm {
        /// This rank.
        rank: usize,
        /// `"all_gather"` or `"reduce_scatter"`.
        op: &'static str,
        /// The parameter group.
        group: usize,
        /// The communicator's error.
        #[source]
        source: hypershard_collectives::Error,
    },
    /// `Staging::Device` was asked for, but the communicator takes host buffers only.
    #[error(
        "rank {rank}: the {backend} backend takes host buffers only, so Staging::Device cannot be used"
    )]
    DeviceBuffersUnsupported {
        /// This rank.
        rank: usize,
        /// The communicator's backend.
        backend: &'static str,
    },
    /// nn's device model has a layer kind FSDP on device does not drive (only Linear and
    /// ReLU).
    #[error("rank {rank}: layer {index} is neither a Linear nor a ReLU")]
    UnsupportedLayer {
        /// This rank.
        rank: usize,
        /// The layer's index in the `Sequential`.
        index: usize,
    },
    /// `layers_per_group` was 0.
    #[error("rank {rank}: layers_per_group must be at least 1")]
    ZeroGroupSize {
        /// This rank.
        rank: usize,
    },
    /// A parameter group would have no elements to shard.
    #[error("rank {rank}: the parameter group of layers {layers:?} has no elements")]
    EmptyGroup {
        /// This rank.
        rank: usize,
        /// The group's layers.
        layers: Vec<usize>,
    },
    /// The mixed-precision `param_dtype` cannot be used with parameters of this dtype (the
    /// sharded parameters must be f32 for a bf16 or f16 `param_dtype`).
    #[error("rank {rank}: param_dtype {param_dtype} is not supported for {storage} parameters")]
    UnsupportedParamDType {
        /// This rank.
        rank: usize,
        /// The sharded parameters' dtype.
        storage: DType,
        /// The requested compute dtype.
        param_dtype: DType,
    },
    /// An input, target or gradient does not have the shape or dtype the model needs.
    #[error(
        "rank {rank}: {op}: {role} has shape {actual:?} and dtype {dtype}, expected {expected} in {expected_dtype}"
    )]
    BadTensor {
        /// This rank.
        rank: usize,
        /// The operation that failed.
        op: &'static str,
        /// Which argument (`"input"`, `"target"`, `"gradient"`).
        role: &'static str,
        /// Its shape.
        actual: Vec<usize>,
        /// Its dtype.
        dtype: DType,
        /// The shape that was needed, in words.
        expected: String,
        /// The dtype that was needed.
        expected_dtype: DType,
    },
    /// `backward` was called without a `forward` before it.
    #[error("rank {rank}: backward before forward")]
    BackwardBeforeForward {
        /// This rank.
        rank: usize,
    },
    /// `sgd_step` was called for a group with no reduced gradient (no synchronised backward
    /// since the last `zero_grad`).
    #[error(
        "rank {rank}: sgd_step: group {group} has no reduced gradient (no backward with gradient sync since zero_grad)"
    )]
    NoGradient {
        /// This rank.
        rank: usize,
        /// The parameter group.
        group: usize,
    },
    /// A collective returned a buffer of another length or dtype than it was given.
    #[error("rank {rank}: {op} of group {group} returned {actual} elements, expected {expected}")]
    CollectiveLength {
        /// This rank.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// The parameter group.
        group: usize,
        /// The elements expected.
        expected: usize,
        /// The elements returned.
        actual: usize,
    },
    /// A dtype with no collectives dtype (FSDP on device moves f32, bf16 and f16).
    #[error("rank {rank}: {dtype} cannot be moved by collectives")]
    UnsupportedDType {
        /// This rank.
        rank: usize,
        /// The dtype.
        dtype: DType,
    },
}

/// The result of FSDP on device.
pub type DeviceFsdpResult<T> = std::result::Result<T, DeviceFsdpError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_rank_and_what_was_wrong() {
        let error = DeviceFsdpError::BadTensor {
            rank: 2,
            op: "DeviceFsdpMlp::forward",
            role: "input",
            actual: vec![4, 38],
            dtype: DType::F32,
            expected: "[rows, 37]".to_string(),
            expected_dtype: DType::BF16,
        };
        assert_eq!(
            error.to_string(),
            "rank 2: DeviceFsdpMlp::forward: input has shape [4, 38] and dtype float32, expected [rows, 37] in bfloat16"
        );
        let comm = DeviceFsdpError::Comm {
            rank: 1,
            op: "reduce_scatter",
            group: 3,
            source: hypershard_collectives::Error::InvalidWorldSize { size: 0 },
        };
        assert!(
            comm.to_string()
                .starts_with("rank 1: reduce_scatter of group 3 failed: "),
            "{comm}"
        );
        assert!(std::error::Error::source(&comm).is_some());
        assert_eq!(
            DeviceFsdpError::DeviceBuffersUnsupported {
                rank: 0,
                backend: "tcp"
            }
            .to_string(),
            "rank 0: the tcp backend takes host buffers only, so Staging::Device cannot be used"
        );
    }
}
