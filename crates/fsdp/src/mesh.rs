//! The data-parallel mesh: a [`DeviceMesh`] of 1 or 2 dims plus one communicator per role.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use hypershard_collectives::Communicator;
use hypershard_dtensor::{BufferPool, ProcessMesh};
use hypershard_mesh::DeviceMesh;

use crate::error::{FsdpError, Result};

/// A 1-d (FSDP: shard over dim 0) or 2-d (HSDP: replicate over dim 0, shard over dim 1) mesh
/// with the communicators `fully_shard` needs.
///
/// Building one is collective (it splits the world communicator), so every rank builds it once
/// and shares it among all units through an `Arc`. The communicators are those of a
/// [`ProcessMesh`] (dim 0 first), so sharded state dicts are DTensors over the same mesh.
pub struct DataParallelMesh {
    process_mesh: ProcessMesh,
    rank: usize,
    world: Arc<dyn Communicator>,
    shard: Arc<dyn Communicator>,
    replicate: Option<Arc<dyn Communicator>>,
    /// Sub-groups of the shard group for `reshard_after_forward = int`, made on first use.
    post_forward: Mutex<BTreeMap<usize, Arc<dyn Communicator>>>,
}

impl DataParallelMesh {
    /// Binds `mesh` to communicators split from `world` (whose rank `r` is mesh rank `r`):
    /// one [`ProcessMesh`] with a communicator per mesh dim. Collective over `world`.
    pub fn new(mesh: DeviceMesh, world: Arc<dyn Communicator>) -> Result<Arc<Self>> {
        let rank = world.rank();
        if mesh.num_ranks() != world.size() || !mesh.contains(rank) {
            return Err(FsdpError::WorldSizeMismatch {
                mesh_ranks: mesh.num_ranks(),
                comm_size: world.size(),
                rank,
            });
        }
        if !(1..=2).contains(&mesh.ndim()) {
            return Err(FsdpError::MeshDims { ndim: mesh.ndim() });
        }
        let process_mesh = ProcessMesh::new(mesh, world.clone())?;
        Self::from_parts(process_mesh, world)
    }

    /// Uses an existing [`ProcessMesh`] of 1 or 2 dims, e.g. the `dp` dim selected from a
    /// `[dp, tp]` world mesh for TP + FSDP.
    ///
    /// The data-parallel world is the mesh's own group: the root communicator when the mesh
    /// covers it, the dim's communicator for a selected 1-d mesh (no new communicator), and a
    /// flattened communicator over both dims for a selected 2-d mesh (collective over the
    /// root communicator on first use).
    pub fn from_process_mesh(process_mesh: ProcessMesh) -> Result<Arc<Self>> {
        if !(1..=2).contains(&process_mesh.ndim()) {
            return Err(FsdpError::MeshDims {
                ndim: process_mesh.ndim(),
            });
        }
        let root = process_mesh.root_comm().clone();
        let world = if process_mesh.mesh().num_ranks() == root.size() {
            root
        } else if process_mesh.ndim() == 1 {
            process_mesh.dim_comm(0usize)?.clone()
        } else {
            process_mesh
                .flatten(&[0usize, 1], "dp")?
                .dim_comm(0usize)?
                .clone()
        };
        Self::from_parts(process_mesh, world)
    }

    fn from_parts(process_mesh: ProcessMesh, world: Arc<dyn Communicator>) -> Result<Arc<Self>> {
        let ndim = process_mesh.ndim();
        let shard = process_mesh.dim_comm(ndim - 1)?.clone();
        let replicate = if ndim == 2 {
            Some(process_mesh.dim_comm(0)?.clone())
        } else {
            None
        };
        Ok(Arc::new(DataParallelMesh {
            rank: world.rank(),
            process_mesh,
            world,
            shard,
            replicate,
            post_forward: Mutex::new(BTreeMap::new()),
        }))
    }

    /// The process mesh (for DTensors over the data-parallel dims).
    pub fn process_mesh(&self) -> &ProcessMesh {
        &self.process_mesh
    }

    /// A 1-d mesh over every rank of `world` (plain FSDP).
    pub fn fsdp(world: Arc<dyn Communicator>) -> Result<Arc<Self>> {
        let mesh = DeviceMesh::new(&[world.size()], &["dp_shard"])?;
        Self::new(mesh, world)
    }

    /// A `replicas × world/replicas` mesh (HSDP).
    pub fn hsdp(world: Arc<dyn Communicator>, replicas: usize) -> Result<Arc<Self>> {
        let shards = world.size().checked_div(replicas).unwrap_or(0);
        let mesh = DeviceMesh::new(&[replicas, shards], &["dp_replicate", "dp_shard"])?;
        Self::new(mesh, world)
    }

    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        self.process_mesh.mesh()
    }

    /// This rank in the world communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The communicator over every data-parallel rank.
    pub fn world(&self) -> &Arc<dyn Communicator> {
        &self.world
    }

    /// The communicator parameters are sharded over.
    pub fn shard(&self) -> &Arc<dyn Communicator> {
        &self.shard
    }

    /// The communicator gradients are all-reduced over after the reduce-scatter (HSDP only).
    pub fn replicate(&self) -> Option<&Arc<dyn Communicator>> {
        self.replicate.as_ref()
    }

    /// The number of ranks a parameter is sharded over.
    pub fn shard_world(&self) -> usize {
        self.shard.size()
    }

    /// This rank's index in the shard group.
    pub fn shard_rank(&self) -> usize {
        self.shard.rank()
    }

    /// What FSDP's communication buffers on this rank cost: the most bytes in use at once
    /// (all-gather outputs, which hold the unsharded parameters while a unit computes, and
    /// reduce-scatter inputs) and what the pool keeps cached for reuse.
    pub fn comm_buffer_stats(&self) -> CommBufferStats {
        let stats = self.pool().stats();
        CommBufferStats {
            peak_in_use_bytes: stats.peak_in_use_bytes,
            cached_bytes: stats.cached_bytes,
        }
    }

    /// The pool of communication buffers every unit over this mesh recycles: the process
    /// mesh's [`BufferPool`], which its redistributes (sharded state dicts, tensor
    /// parallelism) share.
    pub(crate) fn pool(&self) -> &Arc<BufferPool> {
        self.process_mesh.buffer_pool()
    }

    /// The group of `size` consecutive shard ranks this rank belongs to, for resharding to a
    /// smaller group after forward. Collective over the shard group on first use of a size.
    pub fn post_forward_group(&self, size: usize) -> Result<Arc<dyn Communicator>> {
        let shard_world = self.shard_world();
        if size == 0 || !shard_world.is_multiple_of(size) {
            return Err(FsdpError::ReshardSize {
                value: size,
                shard_world,
            });
        }
        let mut groups = self
            .post_forward
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(group) = groups.get(&size) {
            return Ok(group.clone());
        }
        let shard_rank = self.shard_rank();
        let color = u32::try_from(shard_rank / size).map_err(|_| FsdpError::ReshardSize {
            value: size,
            shard_world,
        })?;
        let group = self
            .shard
            .split(Some(color), (shard_rank % size) as i64)?
            .ok_or(FsdpError::ReshardSize {
                value: size,
                shard_world,
            })?;
        groups.insert(size, group.clone());
        Ok(group)
    }
}

impl std::fmt::Debug for DataParallelMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallelMesh")
            .field("shape", &self.mesh().shape())
            .field("rank", &self.rank)
            .field("shard_world", &self.shard.size())
            .field(
                "replicate_world",
                &self.replicate.as_ref().map(|c| c.size()),
            )
            .finish()
    }
}

/// The memory of FSDP's communication buffers on one rank (see
/// [`DataParallelMesh::comm_buffer_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CommBufferStats {
    /// The most bytes handed out at once.
    pub peak_in_use_bytes: usize,
    /// Bytes kept for reuse now.
    pub cached_bytes: usize,
}
