//! CUDA device tensors (feature `cuda`): device storage, host ↔ device copies, pinned host
//! buffers for offload, the kernels FSDP needs, and matmul through cuBLAS.
//!
//! Everything goes through cudarc 0.19 with dynamic loading, so the feature builds on machines
//! without CUDA; libcuda, libnvrtc and libcublas are opened at run time, and a missing one is
//! [`CudaError::Unavailable`], never a panic (cudarc's loader panics on the first call into a
//! missing library, so each is probed with `is_culib_present` first).
//!
//! A [`Tensor`](crate::Tensor) can hold CUDA memory itself ([`Device::Cuda`](crate::Device),
//! storage kind [`Storage::Device`](crate::Storage::Device), moved with
//! [`to_device`](crate::Tensor::to_device) / [`to_host`](crate::Tensor::to_host)); its views
//! work there, its ops are [`Error::DeviceUnsupported`](crate::Error::DeviceUnsupported) until
//! the kernels below are wired to them. [`CudaTensor`] is the older, separate type (dense,
//! contiguous, owning its memory) that the kernels and cuBLAS take today.
//!
//! * [`CudaDevice::new`] opens a device (one per ordinal per process, shared) with a stream of
//!   its own; every operation of its tensors is ordered on that stream.
//! * [`CudaTensor`]: `zeros`, `from_host`/`from_bytes`, `to_host`/`copy_to_host_bytes`,
//!   `copy_from_host`, `copy_from`, `try_clone`, `reshape`; [`PinnedBuffer`] with
//!   `copy_to_pinned`/`copy_from_pinned` (asynchronous on the stream).
//! * Kernels, compiled from CUDA C kept in the crate (`kernels.cu`) by NVRTC on first use:
//!   [`CudaTensor::to_dtype`]/[`CudaTensor::cast_into`] (f32 ↔ bf16, f32 ↔ f16, bf16 ↔ f16,
//!   f32 ↔ f64), [`CudaTensor::add_`], [`CudaTensor::axpy_`], [`CudaTensor::scale_`],
//!   [`copy_in`] and [`copy_out`] (many tensors into / out of one flat buffer at offsets, one
//!   launch). Results round exactly as the CPU ops do.
//! * [`matmul`] and [`gemm`] through `cublasGemmEx` (f32, bf16, f16; f32 accumulation),
//!   row-major, with optional transposes (see [`blas`]'s docs for the convention), and
//!   [`gemm_strided_batched`] over 3-D tensors (`cublasGemmStridedBatchedEx`).
//! * A GPT's layers, f32, for hypershard-nn's `DeviceGpt`: [`layer_norm`], [`gelu`],
//!   [`causal_softmax_`], [`split_heads`]/[`merge_heads`], [`embedding`] (with [`TokenIndex`]),
//!   [`cross_entropy`] and [`adamw_`], each with its backward; no atomics, so every result is
//!   reproducible.
//!
//! ```no_run
//! use hypershard_tensor::cuda::{CudaDevice, CudaTensor, matmul};
//! use hypershard_tensor::{DType, Tensor};
//! let device = CudaDevice::new(0)?;
//! let a = CudaTensor::from_host(&device, &Tensor::ones(&[2, 3], DType::F32)?)?;
//! let b = CudaTensor::from_host(&device, &Tensor::ones(&[3, 4], DType::F32)?)?;
//! let c = matmul(&a, &b)?.to_host()?;
//! assert_eq!(c.to_vec::<f32>()?, vec![3.0; 8]);
//! # Ok::<(), hypershard_tensor::cuda::CudaError>(())
//! ```

pub mod blas;
mod device;
mod error;
mod interop;
mod kernels;
mod nn_ops;
mod ops;
mod storage;
mod tensor;

pub use blas::{Transpose, gemm, gemm_strided_batched, matmul};
pub use device::{CudaDevice, device_count, probe};
pub use error::{CudaError, CudaResult, Library, Unavailable};
pub use interop::{FlatRange, copy_in_ranges, copy_out_ranges};
pub use kernels::{KERNEL_NAMES, KernelImage, compile_kernels};
pub use nn_ops::{
    AdamWStep, CrossEntropyOutput, LayerNormOutput, TokenIndex, adamw_, causal_softmax_,
    causal_softmax_backward_, cross_entropy, embedding, embedding_backward, gelu, gelu_backward,
    layer_norm, layer_norm_backward, merge_heads, split_heads,
};
pub use ops::{copy_in, copy_out};
pub(crate) use storage::backend;
pub use tensor::{CudaTensor, PinnedBuffer};

/// The CUDA C source of the crate's kernels, as NVRTC compiles it.
pub const KERNEL_SOURCE: &str = kernels::SOURCE;
