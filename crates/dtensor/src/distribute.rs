//! Making DTensors: [`distribute_tensor`] from a full tensor and the factories
//! (`zeros`, `ones`, `full`, `rand`) whose values do not depend on the mesh.

use hypershard_collectives::Buffer;
use hypershard_mesh::{Placement, chunk_size, local_block, shard_span};
use hypershard_tensor::{Block, DType, RandomInit, Tensor};

use crate::bridge::{buffer_to_tensor, staging_tensor, tensor_to_buffer, wire_dtype};
use crate::dtensor::DTensor;
use crate::error::Result;
use crate::executor::{partition, to_front};
use crate::pack::pack_padded;
use crate::planner::validate_placements;
use crate::process_mesh::ProcessMesh;

/// Lays `full` out on `mesh` as `placements`, taking the values of the rank at mesh
/// coordinate 0 (PyTorch's `distribute_tensor` with its default `src_data_rank=0`), except
/// for `Partial`: coordinate 0 keeps the value and the others get the op's identity (0 for
/// sum, 1 for product; avg, max and min keep the value everywhere), where PyTorch gives every
/// rank `v / n`. The reduced tensor is the value either way, exactly in every dtype.
///
/// Every rank passes a tensor of the same shape and dtype; only the values of coordinate 0
/// matter. Collective: mesh dims are processed in order, and on each one the rank at
/// coordinate 0 scatters the padded chunks (`Shard`) or broadcasts its block (`Replicate`,
/// `Partial`, then rewritten as partials as in a local `R → P`). For data that every rank
/// already holds identically, [`DTensor::distribute_local`] does the same without
/// communicating.
pub fn distribute_tensor(
    full: &Tensor,
    mesh: &ProcessMesh,
    placements: &[Placement],
) -> Result<DTensor> {
    validate_placements("distribute_tensor", mesh.ndim(), full.ndim(), placements)?;
    let dtype = full.dtype();
    let mut current = full.clone();
    for (mesh_dim, &placement) in placements.iter().enumerate() {
        let comm = mesh.dim_comm(mesh_dim)?;
        let n = comm.size();
        let k = mesh.coordinate()[mesh_dim];
        current = match placement {
            Placement::Shard(d) => {
                let extent = current.shape()[d];
                let chunk = chunk_size(extent, n)?;
                let (major, permute_back) = to_front(current.clone(), &[d])?;
                let rest: Vec<usize> = major.shape()[1..].to_vec();
                let block = chunk * rest.iter().product::<usize>();
                // Only the root's input is read; the others send an empty buffer.
                let input = if k == 0 {
                    pack_padded(mesh.buffer_pool(), major, n * chunk)?
                } else {
                    Buffer::zeros(wire_dtype(dtype), 0)
                };
                let output = Buffer::zeros(wire_dtype(dtype), block);
                let output = comm.scatter(input, output, 0)?.output;
                let mut shape = vec![chunk];
                shape.extend_from_slice(&rest);
                let mine = shard_span(extent, n, k)?.len;
                let mut local = buffer_to_tensor(output, &shape, dtype)?.narrow(0, 0, mine)?;
                if let Some(perm) = permute_back {
                    local = local.permute(&perm)?;
                }
                local.contiguous()?
            }
            Placement::Replicate | Placement::Partial(_) => {
                let received = comm.broadcast(tensor_to_buffer(&current)?, 0)?;
                let local = buffer_to_tensor(received, current.shape(), dtype)?;
                match placement.partial_op() {
                    Some(op) => partition(&local, op, k)?,
                    None => local,
                }
            }
        };
    }
    Ok(DTensor::from_parts(
        current,
        mesh.clone(),
        placements.to_vec(),
        full.shape().to_vec(),
    ))
}

impl DTensor {
    /// Shorthand for [`distribute_tensor`].
    pub fn distribute(
        full: &Tensor,
        mesh: &ProcessMesh,
        placements: &[Placement],
    ) -> Result<DTensor> {
        distribute_tensor(full, mesh, placements)
    }

    /// A DTensor of zeros of global `shape`. No communication.
    pub fn zeros(
        mesh: &ProcessMesh,
        shape: &[usize],
        dtype: DType,
        placements: &[Placement],
    ) -> Result<DTensor> {
        DTensor::full(mesh, shape, 0.0, dtype, placements)
    }

    /// A DTensor of ones of global `shape`. No communication.
    pub fn ones(
        mesh: &ProcessMesh,
        shape: &[usize],
        dtype: DType,
        placements: &[Placement],
    ) -> Result<DTensor> {
        DTensor::full(mesh, shape, 1.0, dtype, placements)
    }

    /// A DTensor of global `shape` whose every element is `value`. With `Partial` placements
    /// the local values are the partials of that value (see
    /// [`StepKind::LocalPartition`](crate::planner::StepKind::LocalPartition)). No
    /// communication.
    pub fn full(
        mesh: &ProcessMesh,
        shape: &[usize],
        value: f64,
        dtype: DType,
        placements: &[Placement],
    ) -> Result<DTensor> {
        factory(mesh, shape, placements, |block| {
            // In collective memory, so a consuming redistribute sends it without a copy.
            let local = staging_tensor(&block.shape, dtype)?;
            if value != 0.0 {
                local.fill_(value)?;
            }
            Ok(local)
        })
    }

    /// A random DTensor: the same global tensor as `Tensor::random(shape, dtype, init)`,
    /// whatever the mesh and placements, because each rank draws its block of the
    /// counter-based generator by global index. No communication.
    pub fn rand(
        mesh: &ProcessMesh,
        shape: &[usize],
        dtype: DType,
        init: RandomInit,
        placements: &[Placement],
    ) -> Result<DTensor> {
        factory(mesh, shape, placements, |block| {
            Ok(Tensor::random_block(
                Block {
                    global_shape: shape,
                    offset: &block.offset,
                    shape: &block.shape,
                },
                dtype,
                init,
            )?)
        })
    }
}

/// Makes this rank's block with `make`, then rewrites it as partials where asked.
fn factory(
    mesh: &ProcessMesh,
    shape: &[usize],
    placements: &[Placement],
    make: impl FnOnce(&hypershard_mesh::LocalBlock) -> Result<Tensor>,
) -> Result<DTensor> {
    validate_placements("factory", mesh.ndim(), shape.len(), placements)?;
    let block = local_block(shape, mesh.mesh(), placements, mesh.rank())?;
    let mut local = make(&block)?;
    for (mesh_dim, placement) in placements.iter().enumerate() {
        if let Some(op) = placement.partial_op() {
            local = partition(&local, op, mesh.coordinate()[mesh_dim])?;
        }
    }
    Ok(DTensor::from_parts(
        local,
        mesh.clone(),
        placements.to_vec(),
        shape.to_vec(),
    ))
}
