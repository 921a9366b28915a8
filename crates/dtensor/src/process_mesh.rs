//! [`ProcessMesh`]: a device mesh bound to one communicator per mesh dimension.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use hypershard_collectives::Communicator;
use hypershard_mesh::{DeviceMesh, DimRef};

use crate::error::{Error, Result};
use crate::planner::PlanCache;
use crate::pool::BufferPool;

/// A [`DeviceMesh`] seen from one rank, with the communicator of every mesh dimension.
///
/// The analogue of PyTorch's `DeviceMesh` object (which owns its process groups). `Clone` is
/// cheap: everything lives behind one `Arc`, so a mesh can be handed to every `DTensor`.
///
/// Building one is collective: [`ProcessMesh::new`] splits the world communicator once per
/// mesh dimension (every world rank must call it with the same mesh). A 1-d mesh that is the
/// whole world in rank order uses the world communicator itself instead of a split.
///
/// ```
/// use hypershard_dtensor::{collectives, init_process_mesh};
/// use std::sync::Arc;
///
/// let world = collectives::local::spawn_world(4)?;
/// let handles: Vec<_> = world
///     .into_iter()
///     .map(|comm| {
///         std::thread::spawn(move || -> hypershard_dtensor::Result<(usize, usize)> {
///             let mesh = init_process_mesh(comm, &[2, 2], &["dp", "tp"])?;
///             Ok((mesh.local_rank("dp")?, mesh.dim_comm("tp")?.size()))
///         })
///     })
///     .collect();
/// let mut coords = Vec::new();
/// for handle in handles {
///     coords.push(handle.join().map_err(|_| "a rank panicked")??);
/// }
/// assert_eq!(coords, [(0, 2), (0, 2), (1, 2), (1, 2)]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct ProcessMesh {
    inner: Arc<Inner>,
}

struct Inner {
    mesh: DeviceMesh,
    /// The calling rank (a global rank, as in the mesh).
    rank: usize,
    /// The calling rank's coordinate in `mesh`.
    coordinate: Vec<usize>,
    /// A communicator over exactly the ranks of the root mesh this one was derived from
    /// (`select` keeps it): `flatten` splits it.
    root: Arc<dyn Communicator>,
    /// One communicator per mesh dimension; its rank is `coordinate[dim]`.
    dim_comms: Vec<Arc<dyn Communicator>>,
    /// Meshes made by `flatten`, so that the split runs once per (dims, name).
    flattened: Mutex<Vec<FlattenEntry>>,
    /// Redistribute plans; shared by every mesh derived from one root.
    plans: Arc<PlanCache>,
    /// The communication buffers of the mesh family (redistribute and FSDP); shared like the
    /// plans.
    pool: Arc<BufferPool>,
}

struct FlattenEntry {
    dims: Vec<usize>,
    name: String,
    mesh: ProcessMesh,
}

impl ProcessMesh {
    /// Binds `mesh` to communicators split from `world`. Collective over `world`: every world
    /// rank calls it with the same mesh.
    ///
    /// Global rank `r` of the mesh is rank `r` of `world`. A world rank that is not in the mesh
    /// takes part in the splits and then gets [`Error::RankNotInMesh`].
    pub fn new(mesh: DeviceMesh, world: Arc<dyn Communicator>) -> Result<ProcessMesh> {
        let world_size = world.size();
        let max_rank = mesh.ranks().iter().copied().max().unwrap_or(0);
        if max_rank >= world_size {
            return Err(Error::MeshExceedsWorld {
                max_rank,
                world_size,
            });
        }
        let rank = world.rank();
        let in_mesh = mesh.contains(rank);
        // The root spans exactly the mesh's ranks; the world itself when they are all of it.
        let covers_world = mesh.num_ranks() == world_size;
        let root = if covers_world {
            Some(world.clone())
        } else {
            let key = position_key(&mesh, rank)?;
            world.split(in_mesh.then_some(0), key)?
        };
        let identity_1d = covers_world && mesh.ndim() == 1 && is_identity(mesh.ranks());
        let mut dim_comms = Vec::with_capacity(mesh.ndim());
        for dim in 0..mesh.ndim() {
            if identity_1d {
                dim_comms.push(world.clone());
                continue;
            }
            let split = if in_mesh {
                let key = mesh.split_key(rank, dim)?;
                let color = to_u32("ProcessMesh::new", key.color)?;
                world.split(Some(color), to_i64("ProcessMesh::new", key.key)?)?
            } else {
                world.split(None, 0)?
            };
            if in_mesh {
                dim_comms.push(split.ok_or(Error::SplitGaveNoGroup {
                    op: "ProcessMesh::new",
                    rank,
                    mesh_dim: dim,
                })?);
            }
        }
        let (Some(root), true) = (root, in_mesh) else {
            return Err(Error::RankNotInMesh { rank });
        };
        let coordinate = mesh.coordinate_of(rank)?;
        Ok(ProcessMesh {
            inner: Arc::new(Inner {
                mesh,
                rank,
                coordinate,
                root,
                dim_comms,
                flattened: Mutex::new(Vec::new()),
                plans: Arc::new(PlanCache::default()),
                pool: Arc::new(BufferPool::new()),
            }),
        })
    }

    /// The mesh topology.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.inner.mesh
    }

    /// The calling rank (global).
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// The number of mesh dimensions.
    pub fn ndim(&self) -> usize {
        self.inner.mesh.ndim()
    }

    /// The size of every mesh dimension.
    pub fn shape(&self) -> &[usize] {
        self.inner.mesh.shape()
    }

    /// The calling rank's coordinate in the mesh.
    pub fn coordinate(&self) -> &[usize] {
        &self.inner.coordinate
    }

    /// The communicator of one mesh dimension (by index or name): the ranks that differ from
    /// this one only along `dim`, ordered by their coordinate there.
    pub fn dim_comm<'a>(&self, dim: impl Into<DimRef<'a>>) -> Result<&Arc<dyn Communicator>> {
        let index = self.inner.mesh.dim_index(dim)?;
        Ok(&self.inner.dim_comms[index])
    }

    /// The same as [`dim_comm`](ProcessMesh::dim_comm), under PyTorch's name
    /// (`mesh.get_group("dp_shard")`).
    pub fn group<'a>(&self, dim: impl Into<DimRef<'a>>) -> Result<&Arc<dyn Communicator>> {
        self.dim_comm(dim)
    }

    /// The calling rank's coordinate along one mesh dimension (its rank in
    /// [`dim_comm`](ProcessMesh::dim_comm)).
    pub fn local_rank<'a>(&self, dim: impl Into<DimRef<'a>>) -> Result<usize> {
        let index = self.inner.mesh.dim_index(dim)?;
        Ok(self.inner.coordinate[index])
    }

    /// A communicator over every rank of the mesh this one was derived from.
    pub fn root_comm(&self) -> &Arc<dyn Communicator> {
        &self.inner.root
    }

    /// The sub-mesh over `dims` that contains the calling rank, with the communicators of
    /// those dims (PyTorch's `mesh["dp", "tp"]`). Local: no communication.
    pub fn select<'a, D>(&self, dims: &[D]) -> Result<ProcessMesh>
    where
        D: Into<DimRef<'a>> + Copy,
    {
        let mesh = self.inner.mesh.select(self.inner.rank, dims)?;
        let mut dim_comms = Vec::with_capacity(dims.len());
        for &dim in dims {
            dim_comms.push(self.dim_comm(dim)?.clone());
        }
        self.derived(mesh, dim_comms)
    }

    /// A mesh derived from this one (`select`, `flatten`): the same rank, root communicator,
    /// plan cache and send-buffer pool, over `mesh` with one communicator per dim of it.
    fn derived(
        &self,
        mesh: DeviceMesh,
        dim_comms: Vec<Arc<dyn Communicator>>,
    ) -> Result<ProcessMesh> {
        let coordinate = mesh.coordinate_of(self.inner.rank)?;
        Ok(ProcessMesh {
            inner: Arc::new(Inner {
                mesh,
                rank: self.inner.rank,
                coordinate,
                root: self.inner.root.clone(),
                dim_comms,
                flattened: Mutex::new(Vec::new()),
                plans: self.inner.plans.clone(),
                pool: self.inner.pool.clone(),
            }),
        })
    }

    /// Merges `dims` into one mesh dimension called `name` (see [`DeviceMesh::flatten`]), with
    /// a communicator over the merged groups.
    ///
    /// Collective over [`root_comm`](ProcessMesh::root_comm) the first time a given
    /// `(dims, name)` is flattened: every rank of the root mesh calls it, with the same
    /// arguments (on the same `select`ed sub-mesh shape). Later calls return the cached mesh
    /// without communicating. Merging a single dim reuses its communicator.
    pub fn flatten<'a, D>(&self, dims: &[D], name: &str) -> Result<ProcessMesh>
    where
        D: Into<DimRef<'a>> + Copy,
    {
        let mut resolved = Vec::with_capacity(dims.len());
        for &dim in dims {
            resolved.push(self.inner.mesh.dim_index(dim)?);
        }
        {
            let cache = self
                .inner
                .flattened
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if let Some(entry) = cache
                .iter()
                .find(|entry| entry.dims == resolved && entry.name == name)
            {
                return Ok(entry.mesh.clone());
            }
        }
        let flat = self.inner.mesh.flatten(&resolved, name)?;
        // invariant: DeviceMesh::flatten accepted `resolved`, so it is not empty.
        let merged_at = *resolved
            .iter()
            .min()
            .expect("invariant: flatten checked the dims");
        let mut dim_comms = Vec::with_capacity(flat.ndim());
        for (dim, comm) in self.inner.dim_comms.iter().enumerate() {
            if dim == merged_at {
                dim_comms.push(self.merged_comm(&flat, &resolved, merged_at)?);
            } else if !resolved.contains(&dim) {
                dim_comms.push(comm.clone());
            }
        }
        let mesh = self.derived(flat, dim_comms)?;
        self.inner
            .flattened
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(FlattenEntry {
                dims: resolved,
                name: name.to_string(),
                mesh: mesh.clone(),
            });
        Ok(mesh)
    }

    /// The communicator of the merged dimension of `flat`.
    fn merged_comm(
        &self,
        flat: &DeviceMesh,
        resolved: &[usize],
        merged_at: usize,
    ) -> Result<Arc<dyn Communicator>> {
        if let [single] = resolved {
            return Ok(self.inner.dim_comms[*single].clone());
        }
        let rank = self.inner.rank;
        let group = flat.select(rank, &[merged_at])?;
        let root = &self.inner.root;
        // Ranks of one merged group share a color: the smallest global rank in the group,
        // which no other group contains. The key orders them by their merged coordinate.
        let color = group.ranks().iter().copied().min().unwrap_or(rank);
        let key = flat.local_rank(rank, merged_at)?;
        let comm = root.split(Some(to_u32("flatten", color)?), to_i64("flatten", key)?)?;
        comm.ok_or(Error::SplitGaveNoGroup {
            op: "flatten",
            rank,
            mesh_dim: merged_at,
        })
    }

    /// The redistribute plan cache, shared by every mesh derived (`select`, `flatten`) from
    /// one [`ProcessMesh::new`].
    pub fn plan_cache(&self) -> &PlanCache {
        &self.inner.plans
    }

    /// The pool of communication buffers of this mesh family, shared by every mesh derived
    /// (`select`, `flatten`) from one [`ProcessMesh::new`]: redistributes take their send and
    /// output buffers from it, and FSDP units over the mesh their gather and reduce buffers.
    pub fn buffer_pool(&self) -> &Arc<BufferPool> {
        &self.inner.pool
    }

    /// Frees the idle buffers the mesh family keeps for reuse (see [`BufferPool`] for what it
    /// keeps: a bounded cache, shared by `select`ed and `flatten`ed meshes); returns the bytes
    /// freed. Local: no communication.
    pub fn release_buffers(&self) -> usize {
        self.inner.pool.release_cached()
    }

    /// Whether two handles are the same mesh object, or equal meshes seen from one rank.
    pub fn same_mesh(&self, other: &ProcessMesh) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
            || (self.inner.rank == other.inner.rank && self.inner.mesh == other.inner.mesh)
    }
}

/// Builds the mesh `shape` (with optional dimension `names`) over the ranks of `world` in
/// order and binds it (PyTorch's `init_device_mesh`). Collective over `world`.
pub fn init_process_mesh(
    world: Arc<dyn Communicator>,
    shape: &[usize],
    names: &[&str],
) -> Result<ProcessMesh> {
    let mesh = DeviceMesh::new(shape, names)?;
    ProcessMesh::new(mesh, world)
}

impl fmt::Debug for ProcessMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessMesh")
            .field("mesh", &self.inner.mesh)
            .field("rank", &self.inner.rank)
            .field("coordinate", &self.inner.coordinate)
            .finish_non_exhaustive()
    }
}

impl fmt::Display for ProcessMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.inner.mesh)
    }
}

/// Whether `ranks` is `0, 1, 2, ...`.
fn is_identity(ranks: &[usize]) -> bool {
    ranks.iter().enumerate().all(|(index, &rank)| index == rank)
}

/// The split key that orders the root communicator by mesh position.
fn position_key(mesh: &DeviceMesh, rank: usize) -> Result<i64> {
    let position = mesh
        .ranks()
        .iter()
        .position(|&candidate| candidate == rank)
        .unwrap_or(0);
    to_i64("ProcessMesh::new", position)
}

fn to_u32(op: &'static str, value: usize) -> Result<u32> {
    u32::try_from(value).map_err(|_| Error::ValueTooLarge {
        op,
        value,
        target: "u32",
    })
}

fn to_i64(op: &'static str, value: usize) -> Result<i64> {
    i64::try_from(value).map_err(|_| Error::ValueTooLarge {
        op,
        value,
        target: "i64",
    })
}
