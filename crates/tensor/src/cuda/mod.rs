//! CUDA devices (feature `cuda`): a [`Tensor`](crate::Tensor) whose storage is GPU memory,
//! the kernels that run on it and matmul through cuBLAS.
//!
//! Everything goes through cudarc 0.19 with dynamic loading, so the feature builds on machines
//! without CUDA; libcuda, libnvrtc and libcublas are opened at run time, and a missing one is
//! [`CudaError::Unavailable`] (or, through a tensor, [`Error::DeviceFailed`](crate::Error)),
//! never a panic (cudarc's loader panics on the first call into a missing library, so each is
//! probed with `is_culib_present` first).
//!
//! A tensor moves to a GPU with [`to_device`](crate::Tensor::to_device)`(&Device::Cuda { .. })`
//! and back with [`to_host`](crate::Tensor::to_host); its views work there. Ops dispatch on the
//! storage: those with a CUDA kernel run it ([`Tensor::to_dtype`](crate::Tensor::to_dtype)
//! between the float dtypes, [`add_`](crate::Tensor::add_), [`axpy`](crate::Tensor::axpy),
//! [`scale_`](crate::Tensor::scale_), [`deep_copy`](crate::Tensor::deep_copy)), the others are
//! [`Error::DeviceUnsupported`](crate::Error::DeviceUnsupported) naming the op.
//!
//! * [`CudaDevice::new`] opens a device (one per ordinal per process, shared) with a stream of
//!   its own; every operation on its memory is ordered on that stream.
//! * Kernels, compiled from CUDA C kept in the crate (`kernels.cu`) by NVRTC on first use:
//!   casts, `add`/`axpy`/`scale`, ReLU, and the layers hypershard-nn runs on a GPU
//!   ([`layer_norm`] and RMS [`norm`], the GELUs and SiLU ([`activation`]), [`dropout`],
//!   [`causal_softmax_`], [`split_heads`]/[`merge_heads`], [`embedding`] (with
//!   [`TokenIndex`]), [`cross_entropy`] and [`adamw_`], each with its backward; no atomics, so
//!   every result is reproducible).
//! * [`matmul`], [`gemm`] and [`gemm_strided_batched`] through cuBLAS (f32, bf16, f16; f32
//!   accumulation), row-major, with optional transposes (see [`blas`]'s docs).
//!
//! ```no_run
//! use hypershard_tensor::{DType, Device, Tensor};
//! let gpu = Device::Cuda { ordinal: 0 };
//! let a = Tensor::ones(&[2, 3], DType::F32)?.to_device(&gpu)?;
//! let b = Tensor::ones(&[3, 4], DType::F32)?.to_device(&gpu)?;
//! let c = hypershard_tensor::cuda::matmul(&a, &b)?.to_host()?;
//! assert_eq!(c.to_vec::<f32>()?, vec![3.0; 8]);
//! # Ok::<(), hypershard_tensor::Error>(())
//! ```

mod attention;
pub mod blas;
mod device;
mod error;
mod exchange;
mod kernels;
mod nn_ops;
mod ops;
mod optim;
mod pointwise;
mod storage;
pub(crate) mod view;

pub use attention::{
    FLASH_MAX_HEAD_DIM, FlashDropout, FlashForward, flash_attention, flash_attention_backward,
};
pub use blas::{Transpose, gemm, gemm_strided_batched, matmul};
pub use device::{CudaDevice, device_count, probe};
pub use error::{CudaError, CudaResult, Library, Unavailable};
pub use exchange::{into_cuda_bytes, tensor_from_cuda_bytes};
pub use kernels::{KERNEL_NAMES, KernelImage, compile_kernels};
pub use nn_ops::{
    CrossEntropyOutput, LayerNormOutput, Norm, TokenIndex, causal_softmax_,
    causal_softmax_backward_, cross_entropy, embedding, embedding_backward, layer_norm,
    layer_norm_backward, merge_heads, norm, norm_backward, split_heads,
};
pub(crate) use ops::{cast, elementwise_};
pub use ops::{relu_, relu_grad_};
pub use optim::{AdamWStep, SgdMomentum, SgdStep, adamw_, sgd_};
pub use pointwise::{Activation, activation, activation_backward, dropout};
pub(crate) use storage::backend;

/// The CUDA C source of the crate's kernels, as NVRTC compiles it.
pub const KERNEL_SOURCE: &str = kernels::SOURCE;
