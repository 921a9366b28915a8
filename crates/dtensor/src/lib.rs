//! Distributed tensors for hypershard.
//!
//! A user who only wants distributed tensors depends on this crate alone: the mesh, tensor and
//! collectives crates are re-exported as [`mesh`], [`tensor`] and [`collectives`], and the
//! common types are at the root.
//!
//! - [`ProcessMesh`]: a [`DeviceMesh`] bound to one communicator per mesh dim, split once from
//!   a world communicator ([`ProcessMesh::new`], [`init_process_mesh`]); `select` and
//!   `flatten` carry communicators (a flatten splits once and is cached).
//! - [`DTensor`]: this rank's local block plus the mesh, one [`Placement`] per mesh dim and
//!   the global shape. Built with [`DTensor::from_local`] (or the validating, collective
//!   [`DTensor::from_local_checked`]), [`distribute_tensor`] / [`DTensor::distribute_local`],
//!   or the factories [`DTensor::zeros`], [`ones`](DTensor::ones), [`full`](DTensor::full),
//!   [`rand`](DTensor::rand) (mesh-independent values). Read back with
//!   [`to_local`](DTensor::to_local), [`full_tensor`](DTensor::full_tensor).
//! - Redistribute: [`DTensor::redistribute`] and [`DTensor::redistribute_async`], and the
//!   consuming [`DTensor::into_redistribute`] (sends a local tensor it owns without a copy).
//!   A borrowing redistribute lends a source in collective memory to an all-gather or
//!   reduce-scatter copy-on-write instead of copying it ([`bridge::lend_buffer`]); see
//!   `docs/redistribute.md`, "What is copied".
//!   The [`planner`] is pure (placements × placements → steps, cached per mesh); the executor
//!   is the only code that issues collectives for it. Send and output buffers come from the
//!   mesh's [`BufferPool`] ([`ProcessMesh::buffer_pool`], [`ProcessMesh::release_buffers`]),
//!   the one pool of communication buffers that `fsdp`'s units over the mesh use too.
//! - Sharded ops with sharding propagation: [`DTensor::add`], [`sub`](DTensor::sub),
//!   [`mul`](DTensor::mul) (broadcasting), [`matmul`](DTensor::matmul) (batched),
//!   [`sum`](DTensor::sum), [`mean`](DTensor::mean), [`transpose`](DTensor::transpose),
//!   [`reshape`](DTensor::reshape). Unsupported combinations are typed errors unless
//!   [`OpConfig::auto_redistribute`] asks the op to redistribute its inputs first.
//! - [`bridge`]: tensor ⇄ collective buffer conversion (used by `fsdp` too): the dtype map
//!   (`bool` travels as `u8`) and reduce-op mapping, byte access, copies in and out, zero-copy
//!   adoption of collective buffers as tensor storage and back ([`bridge::staging_tensor`],
//!   [`bridge::reclaim_buffer`]).
//!
//! # Errors
//! Everything returns [`Error`] (`#[non_exhaustive]`): the mesh, tensor and collectives errors
//! wrapped as they are, plus structured variants naming the op, placements, shapes and rank.
//! Collective setup and validation ([`ProcessMesh::new`], [`DTensor::from_local_checked`]) run
//! the same sequence of collectives on every rank and fail on every rank together.
//!
//! Shards follow `torch.chunk`: chunk = ceil(n / shards), trailing shards may be short or
//! empty, and collectives pad to the chunk size and unpad. Nested sharding of one tensor dim
//! over several mesh dims splits in mesh-dim order. See `docs/redistribute.md`.
//!
//! ```
//! use hypershard_dtensor::{collectives, init_process_mesh, DTensor, Placement};
//! use hypershard_dtensor::tensor::{DType, Tensor};
//!
//! let world = collectives::local::spawn_world(2)?;
//! let handles: Vec<_> = world.into_iter().map(|comm| std::thread::spawn(move || {
//!     let mesh = init_process_mesh(comm, &[2], &["dp"])?;
//!     let full = Tensor::arange(5, DType::F32)?;
//!     // 5 elements on 2 ranks: 3 and 2.
//!     let sharded = DTensor::distribute_local(&full, &mesh, &[Placement::Shard(0)])?;
//!     let local = sharded.to_local().to_vec::<f32>()?;
//!     let gathered = sharded.redistribute(&[Placement::Replicate])?;
//!     Ok::<_, hypershard_dtensor::Error>((local, gathered.to_local().to_vec::<f32>()?))
//! })).collect();
//! let mut out = Vec::new();
//! for handle in handles {
//!     out.push(handle.join().map_err(|_| "a rank panicked")??);
//! }
//! assert_eq!(out[0], (vec![0.0, 1.0, 2.0], vec![0.0, 1.0, 2.0, 3.0, 4.0]));
//! assert_eq!(out[1], (vec![3.0, 4.0], vec![0.0, 1.0, 2.0, 3.0, 4.0]));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

// The crate README's example runs as a doctest, so it cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;

pub mod bridge;
mod distribute;
mod dtensor;
mod error;
mod executor;
mod local;
mod ops;
mod pack;
pub mod planner;
mod pool;
mod process_mesh;
mod validate;

pub use hypershard_collectives as collectives;
pub use hypershard_mesh as mesh;
pub use hypershard_tensor as tensor;

pub use hypershard_collectives::Communicator;
pub use hypershard_mesh::{DeviceMesh, DimRef, Placement, ReduceOp};
pub use hypershard_tensor::{DType, Tensor};

pub use distribute::distribute_tensor;
pub use dtensor::DTensor;
pub use error::{Error, Result};
pub use executor::RedistributeWork;
pub use local::run_local;
pub use ops::OpConfig;
pub use planner::{Plan, PlanCache, Step, StepKind};
pub use pool::{BufferPool, PoolStats};
pub use process_mesh::{ProcessMesh, init_process_mesh};
