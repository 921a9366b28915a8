//! nn's layers on a CUDA device (feature `cuda`): what the reference MLP of the FSDP
//! benchmarks needs (Linear, ReLU, MSE loss, plain SGD) and nanoGPT's GPT ([`DeviceGpt`]:
//! forward, cross-entropy, backward, SGD and AdamW, f32), on the tensor crate's device tensors.
//!
//! * [`DeviceLinear`]: `y = x·Wᵀ + b`, `dW += dyᵀ·x`, `db += Σ dy`, `dx = dy·W`, every one a
//!   cuBLAS GEMM (the bias is broadcast and reduced against a column of ones).
//! * ReLU: the tensor crate's `CudaTensor::relu_` and `relu_grad_`, in place.
//! * [`mse_loss`]: the loss (read back) and its gradient on the device.
//! * [`DeviceMlp`]: a CPU `Sequential` of Linear and ReLU layers copied to the device
//!   ([`DeviceMlp::from_cpu`]), trained there ([`DeviceMlp::train_step`]) and copied back
//!   ([`DeviceMlp::to_cpu`]) for comparison with the CPU run.
//! * [`DeviceGpt`]: a CPU [`Gpt`](crate::Gpt) (f32, no dropout) copied to the device
//!   ([`DeviceGpt::from_cpu`]); [`forward`](DeviceGpt::forward) gives the logits,
//!   [`loss`](DeviceGpt::loss) the mean cross-entropy, [`backward`](DeviceGpt::backward)
//!   every parameter's gradient (the tied `wte` gets the embedding's and the lm_head's), then
//!   [`sgd_step`](DeviceGpt::sgd_step) or [`adamw_step`](DeviceGpt::adamw_step);
//!   [`to_cpu`](DeviceGpt::to_cpu) gives back a CPU `Gpt` with the same names.
//!
//! Without CUDA every entry point returns `DeviceError::Cuda(CudaError::Unavailable { .. })`,
//! never a panic. The device results follow the CPU's up to rounding: cuBLAS sums the GEMMs
//! in its own order (f32 accumulation, never TF32), and the loss is summed in f32 where the
//! CPU sums in f64 (see docs/gpu.md for the bounds the tests use).
//!
//! ```no_run
//! use hypershard_nn::cuda::DeviceMlp;
//! use hypershard_nn::{Linear, LinearConfig, Relu, Sequential};
//! use hypershard_tensor::cuda::{CudaDevice, CudaTensor};
//! use hypershard_tensor::{DType, Tensor};
//! let config = LinearConfig { in_features: 4, out_features: 4, bias: true, dtype: DType::F32, seed: 0 };
//! let cpu = Sequential::default().with(Linear::new(config)?).with(Relu::new());
//! let device = CudaDevice::new(0)?;
//! let mut mlp = DeviceMlp::from_cpu(&device, &cpu)?;
//! let x = CudaTensor::from_host(&device, &Tensor::ones(&[2, 4], DType::F32)?)?;
//! let y = CudaTensor::from_host(&device, &Tensor::zeros(&[2, 4], DType::F32)?)?;
//! let loss = mlp.train_step(&x, &y, 0.01)?;
//! let trained = mlp.to_cpu(false)?;
//! # let _ = (loss, trained);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod gpt;
mod linear;
mod loss;
mod mlp;

pub use error::{DeviceError, DeviceResult};
pub use gpt::{DeviceBlock, DeviceGpt, DeviceNorm};
pub use linear::DeviceLinear;
pub use loss::{DeviceLoss, mse_loss};
pub use mlp::{DeviceLayer, DeviceMlp};
