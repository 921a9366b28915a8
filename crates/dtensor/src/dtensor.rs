//! [`DTensor`]: a local tensor plus the mesh, placements and global shape it is a part of.

use std::fmt;

use hypershard_mesh::{Placement, local_block};
use hypershard_tensor::{DType, Tensor};

use crate::error::{Error, Result};
use crate::planner::{Plan, PlanRequest, validate_placements};
use crate::process_mesh::ProcessMesh;

/// A distributed tensor: this rank's local block of a global tensor laid out on a
/// [`ProcessMesh`] with one [`Placement`] per mesh dim.
///
/// Invariant: the local tensor's shape is exactly the block
/// [`local_block`](hypershard_mesh::local_block) gives this rank for the global shape and the
/// placements (`torch.chunk` shard math; trailing shards may be short or empty), its dtype is
/// the DTensor's dtype, and the placements are valid for the mesh and the tensor.
///
/// `Clone` is cheap: the local tensor is a view (shared storage) and the mesh is an `Arc`.
#[derive(Clone)]
pub struct DTensor {
    local: Tensor,
    mesh: ProcessMesh,
    placements: Vec<Placement>,
    global_shape: Vec<usize>,
}

impl DTensor {
    /// Assembles a DTensor whose invariant the caller has established.
    pub(crate) fn from_parts(
        local: Tensor,
        mesh: ProcessMesh,
        placements: Vec<Placement>,
        global_shape: Vec<usize>,
    ) -> DTensor {
        DTensor {
            local,
            mesh,
            placements,
            global_shape,
        }
    }

    /// Wraps this rank's `local` block (PyTorch's `DTensor.from_local(..., run_check=False)`).
    /// No communication.
    ///
    /// With `global_shape: None` the global shape is inferred as if every shard were full:
    /// each sharded dim is `local size × number of shards`. That is right only for evenly
    /// divided dims; for uneven shards pass the shape, or use
    /// [`from_local_checked`](DTensor::from_local_checked), which derives it from every rank's
    /// local shape. Either way the local shape is checked against the block this rank must
    /// hold ([`Error::LocalShapeMismatch`]).
    pub fn from_local(
        local: Tensor,
        mesh: &ProcessMesh,
        placements: &[Placement],
        global_shape: Option<&[usize]>,
    ) -> Result<DTensor> {
        validate_placements("from_local", mesh.ndim(), local.ndim(), placements)?;
        let global_shape = match global_shape {
            Some(shape) => shape.to_vec(),
            None => infer_even_global_shape(local.shape(), mesh.shape(), placements),
        };
        check_local_shape("from_local", &local, mesh, placements, &global_shape)?;
        Ok(DTensor::from_parts(
            local,
            mesh.clone(),
            placements.to_vec(),
            global_shape,
        ))
    }

    /// Builds a DTensor whose local tensors are full replicas or identically shaped partials
    /// of `full` on every rank, then lays it out as `placements` locally: each rank keeps its
    /// chunk of its own `full` (PyTorch's `distribute_tensor(..., src_data_rank=None)`). No
    /// communication; every rank must pass the same values.
    pub fn distribute_local(
        full: &Tensor,
        mesh: &ProcessMesh,
        placements: &[Placement],
    ) -> Result<DTensor> {
        validate_placements("distribute_tensor", mesh.ndim(), full.ndim(), placements)?;
        let replicated = vec![Placement::Replicate; mesh.ndim()];
        let source = DTensor::from_parts(
            full.clone(),
            mesh.clone(),
            replicated,
            full.shape().to_vec(),
        );
        source.redistribute(placements)
    }

    /// The local tensor of this rank.
    pub fn to_local(&self) -> &Tensor {
        &self.local
    }

    /// The local tensor of this rank, by value.
    pub fn into_local(self) -> Tensor {
        self.local
    }

    /// The placements, one per mesh dim.
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    /// The global shape.
    pub fn shape(&self) -> &[usize] {
        &self.global_shape
    }

    /// The row-major strides of the global tensor, in elements.
    pub fn stride(&self) -> Vec<usize> {
        let mut strides = vec![1; self.global_shape.len()];
        for d in (0..self.global_shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * self.global_shape[d + 1];
        }
        strides
    }

    /// The number of global dims.
    pub fn ndim(&self) -> usize {
        self.global_shape.len()
    }

    /// The number of global elements.
    pub fn numel(&self) -> usize {
        self.global_shape.iter().product()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.local.dtype()
    }

    /// The mesh the tensor lives on.
    pub fn process_mesh(&self) -> &ProcessMesh {
        &self.mesh
    }

    /// The plan [`redistribute`](DTensor::redistribute) would run to reach `placements`
    /// (cached per mesh family).
    pub fn plan_to(&self, placements: &[Placement]) -> Result<std::sync::Arc<Plan>> {
        self.mesh.plan_cache().get(&PlanRequest {
            mesh_shape: self.mesh.shape(),
            global_shape: &self.global_shape,
            src: &self.placements,
            dst: placements,
        })
    }

    /// The same global tensor laid out as `placements`. Collective over the mesh dims whose
    /// placement changes (see `docs/redistribute.md` for which collective each transition
    /// issues). A no-op returns a clone that shares the local tensor.
    ///
    /// The source is left as it is. When its local tensor lives in collective memory (it came
    /// out of a collective or a factory), needs no padding and the collective only reads its
    /// input (all-gather, reduce-scatter), the memory is lent to the collective without a copy;
    /// a write to the source before the collective is done goes to a private copy, so the
    /// collective always sends the values of the call. Otherwise the data is copied once.
    pub fn redistribute(&self, placements: &[Placement]) -> Result<DTensor> {
        let span = tracing::debug_span!(
            "dtensor.redistribute",
            shape = ?self.global_shape,
            from = ?self.placements,
            to = ?placements,
        );
        let _entered = span.enter();
        self.redistribute_async(placements)?.wait()
    }

    /// Like [`redistribute`](DTensor::redistribute), consuming `self`: when no other view
    /// shares the local tensor and it lives in collective memory (it came out of a collective
    /// or a factory) and needs no padding, the first collective sends it without a copy, the
    /// way a bare collective takes its buffer by value.
    pub fn into_redistribute(self, placements: &[Placement]) -> Result<DTensor> {
        self.into_redistribute_async(placements)?.wait()
    }

    /// The full global tensor on every rank (a redistribute to all-`Replicate`).
    pub fn full_tensor(&self) -> Result<Tensor> {
        let replicated = vec![Placement::Replicate; self.mesh.ndim()];
        Ok(self.redistribute(&replicated)?.into_local())
    }
}

impl fmt::Debug for DTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DTensor")
            .field("global_shape", &self.global_shape)
            .field("placements", &self.placements)
            .field("dtype", &self.local.dtype())
            .field("local_shape", &self.local.shape())
            .field("mesh", &self.mesh)
            .finish()
    }
}

/// The global shape if every sharded dim were evenly divided.
fn infer_even_global_shape(
    local: &[usize],
    mesh_shape: &[usize],
    placements: &[Placement],
) -> Vec<usize> {
    let mut shape = local.to_vec();
    for (placement, &n) in placements.iter().zip(mesh_shape) {
        if let Some(d) = placement.shard_dim() {
            shape[d] = shape[d].saturating_mul(n);
        }
    }
    shape
}

/// Errors unless `local` has the shape of this rank's block.
pub(crate) fn check_local_shape(
    op: &'static str,
    local: &Tensor,
    mesh: &ProcessMesh,
    placements: &[Placement],
    global_shape: &[usize],
) -> Result<()> {
    let expected = local_block(global_shape, mesh.mesh(), placements, mesh.rank())?.shape;
    if expected != local.shape() {
        return Err(Error::LocalShapeMismatch {
            op,
            rank: mesh.rank(),
            global_shape: global_shape.to_vec(),
            placements: placements.to_vec(),
            expected,
            actual: local.shape().to_vec(),
        });
    }
    Ok(())
}
