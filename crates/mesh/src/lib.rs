//! Device-mesh topology, placements and shard math for hypershard.
//!
//! This crate is pure: it does no I/O and keeps no global or thread-local registry.
//!
//! - [`DeviceMesh`]: an n-d grid of global ranks with optional dimension names; rank ↔
//!   coordinate, sub-meshes ([`DeviceMesh::select`]), merged dimensions
//!   ([`DeviceMesh::flatten`]) and the rank groups / split keys a communicator split needs.
//! - [`Placement`] and [`ReduceOp`]: how a tensor is laid out along one mesh dimension.
//! - [`shard_span`], [`chunk_size`], [`padded_len`] and [`local_block`]: `torch.chunk` shard
//!   math, in one dimension and for n-d placements with nested sharding.
//!
//! Every bad input is a [`MeshError`].
//!
//! ```
//! use hypershard_mesh::{local_block, DeviceMesh, Placement};
//!
//! // HSDP: replicate over dim 0, shard rows over dim 1.
//! let mesh = DeviceMesh::new(&[2, 4], &["dp_replicate", "dp_shard"])?;
//! let placements = [Placement::Replicate, Placement::Shard(0)];
//! let shapes: Vec<Vec<usize>> = mesh
//!     .ranks()
//!     .iter()
//!     .map(|&rank| local_block(&[10, 16], &mesh, &placements, rank).map(|block| block.shape))
//!     .collect::<Result<_, _>>()?;
//! assert_eq!(shapes[..4], [vec![3, 16], vec![3, 16], vec![3, 16], vec![1, 16]]);
//! assert_eq!(shapes[4..], shapes[..4]);
//! # Ok::<(), hypershard_mesh::MeshError>(())
//! ```
#![deny(missing_docs)]

mod dim;
mod error;
mod mesh;
mod placement;
mod shard;

pub use dim::DimRef;
pub use error::{MeshError, Result};
pub use mesh::{DeviceMesh, SplitKey};
pub use placement::{Placement, ReduceOp};
pub use shard::{LocalBlock, ShardSpan, chunk_size, local_block, padded_len, shard_span};
