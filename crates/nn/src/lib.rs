//! The training substrate of hypershard: modules with explicit backward, losses, optimizers.
//!
//! Every [`Module`] caches what its backward needs in `forward`, and `backward` accumulates
//! parameter gradients and returns the input gradient, so a wrapper (FSDP) can run its
//! unshard / reshard / reduce-scatter hooks exactly at module boundaries. Parameter names and
//! shapes follow PyTorch (`0.weight`, Linear weight `[out, in]`) so state dicts interoperate.
//!
//! ```
//! use hypershard_nn::{Linear, LinearConfig, Module, Relu, Sequential, mse_loss};
//! use hypershard_tensor::{DType, Tensor};
//!
//! let config = |i, o, seed| LinearConfig { in_features: i, out_features: o, bias: true, dtype: DType::F64, seed };
//! let mut mlp = Sequential::default()
//!     .with(Linear::new(config(3, 8, 0))?)
//!     .with(Relu::new())
//!     .with(Linear::new(config(8, 1, 2))?);
//! let x = Tensor::ones(&[4, 3], DType::F64)?;
//! let y = mlp.forward(&x)?;
//! let loss = mse_loss(&y, &Tensor::zeros(&[4, 1], DType::F64)?)?;
//! let grad_x = mlp.backward(&loss.grad)?;
//! assert_eq!(grad_x.shape(), &[4, 3]);
//! assert_eq!(hypershard_nn::parameter_names(&mlp)?, ["0.weight", "0.bias", "2.weight", "2.bias"]);
//! # Ok::<(), hypershard_nn::Error>(())
//! ```

mod activation;
mod attention;
pub mod checkpoint;
mod dropout;
mod elementwise;
mod embedding;
mod error;
mod fused_loss;
mod gpt;
mod kernels;
pub mod linalg;
mod linear;
mod loss;
mod module;
mod module_list;
mod norm;
pub mod optim;
mod param;
mod recompute;
mod sequential;
pub mod special;
mod threads;
mod transformer;

pub use activation::{Gelu, GeluApproximation, Relu, Silu};
pub use attention::{CausalSelfAttention, CausalSelfAttentionConfig};
pub use dropout::Dropout;
pub use embedding::{Embedding, EmbeddingConfig};
pub use error::{Error, Result};
pub use fused_loss::LossTargets;
pub use gpt::{Gpt, GptConfig};
pub use kernels::recycle::{
    cached_bytes as cached_kernel_buffer_bytes, release_cached as release_cached_kernel_buffers,
};
pub use linear::{Linear, LinearConfig};
pub use loss::{DEFAULT_IGNORE_INDEX, LossOutput, cross_entropy, mse_loss};
pub use module::{
    ChildVisitorMut, Identity, Module, ParamVisitor, ParamVisitorMut, join_name, parameter_names,
    qualify_parameter_names, replace_module, to_device, zero_grad,
};
pub use module_list::ModuleList;
pub use norm::{LayerNorm, LayerNormConfig, RmsNorm, RmsNormConfig};
pub use param::{InitFn, InitRequest, Parameter, materialize_module};
pub use recompute::Checkpointed;
pub use sequential::Sequential;
pub use threads::{keep_warm, with_num_threads};
pub use transformer::{Block, BlockConfig, Mlp};
