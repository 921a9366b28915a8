//! `fully_shard`: FSDP and HSDP for hypershard.
//!
//! [`fully_shard`] wraps a module as one unit: its parameters are cut into local shards
//! (`torch.chunk` along dim 0 or a chosen dim, padded for collectives) over the shard group of
//! a [`DataParallelMesh`], gathered before the unit's forward and backward, and freed after;
//! gradients are reduce-scattered back to shards (and all-reduced over the replicate group for
//! HSDP). Wrapping children first and then the parent makes nested units; the outermost unit
//! whose forward runs first becomes the root and links the others into one schedule
//! (prefetch order, pending reductions).
//!
//! ```
//! use hypershard_collectives::local::spawn_world;
//! use hypershard_fsdp::{DataParallelMesh, FullyShardConfig, fully_shard};
//! use hypershard_nn::{Linear, LinearConfig, Module};
//! use hypershard_tensor::{DType, Tensor};
//!
//! let comm = spawn_world(1)?.remove(0);
//! let mesh = DataParallelMesh::fsdp(comm)?;
//! let linear = Linear::new(LinearConfig { in_features: 4, out_features: 3, bias: true, dtype: DType::F32, seed: 0 })?;
//! let mut unit = fully_shard(Box::new(linear), FullyShardConfig::new(mesh))?;
//! let y = unit.forward(&Tensor::ones(&[2, 4], DType::F32)?)?;
//! let _dx = unit.backward(&Tensor::ones(y.shape(), DType::F32)?)?;
//! assert_eq!(unit.params()[0].local_shape, vec![3, 4]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`fully_shard_group`] makes one unit of a list of modules (FSDP2's `fully_shard([m1, m2])`),
//! and [`tp`] puts tensor-parallel layers under FSDP on a `[dp, tp]` mesh.
//!
//! See `docs/fsdp.md` for the lifecycle and the order of collectives.

mod bucket;
mod build;
mod config;
mod error;
mod group;
mod layout;
mod mesh;
mod module;
mod param;
mod reshard_load;
mod schedule;
mod state;
mod state_dict;
pub mod tp;

pub use config::TensorParallelConfig;
pub use config::{
    CommFusionPolicy, CpuOffloadPolicy, FullyShardConfig, GradReduceOp, MixedPrecisionPolicy,
    ReshardAfterForward, ShardPlacementFn,
};
pub use error::{FsdpError, Result};
pub use mesh::{CommBufferStats, DataParallelMesh};
pub use module::{
    FsdpModule, Rejected, RejectedGroup, UnitHandle, fully_shard, fully_shard_children,
    fully_shard_group, has_params,
};
pub use param::FsdpParamInfo;
pub use reshard_load::SavedShard;
pub use state::{ShardedState, TrainingState};
pub use tp::{TpLinear, TpParamLayout, TpStyle};
