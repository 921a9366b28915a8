//! The redistribute executor: runs a [`Plan`]'s steps on one rank's local tensor.
//!
//! This is the only module of the crate that issues collectives for a redistribute. Every
//! collective works on a "dim-major" copy of the local tensor: the tensor dim being gathered,
//! scattered or exchanged is moved to the front, so each rank's padded chunk is one
//! contiguous block of the flat buffer. Padding a chunk to the chunk size is then just zeros
//! at the end of the block, and since only trailing shards are short, the real data of all
//! gathered blocks is a prefix of the output: unpadding is a `narrow`, not a copy.

use std::sync::Arc;

use hypershard_collectives::{Buffer, BufferPair, Communicator, StridedBlocks, Work};
use hypershard_mesh::{Placement, ReduceOp, chunk_size, shard_span};
use hypershard_tensor::{DType, Device, Tensor};

use crate::bridge::{
    buffer_to_tensor, lend_buffer, reclaim_buffer, staging_tensor, wire_dtype, wire_op,
};
use crate::dtensor::DTensor;
use crate::error::Result;
use crate::pack::{AllToAllLayout, InputUse, pack_all_to_all, pack_padded, pack_whole};
use crate::planner::{Plan, Step, StepKind};
use crate::pool::BufferPool;
use crate::process_mesh::ProcessMesh;

/// A collective in flight and how to turn its output back into the local tensor.
enum InFlight {
    /// An all-reduce: the buffer comes back in place.
    Reduce {
        work: Work<Buffer>,
        shape: Vec<usize>,
        dtype: DType,
    },
    /// A two-buffer collective: the output is reshaped, unpadded and permuted back; the send
    /// buffer goes back to the pool.
    Pair {
        work: Work<BufferPair>,
        unpack: Unpack,
        pool: Arc<BufferPool>,
    },
}

/// How an output buffer becomes the new local tensor.
struct Unpack {
    /// The shape of the whole (padded, dim-major) output.
    buffer_shape: Vec<usize>,
    /// `(dim, len)`: keep the first `len` entries of `dim` (drop the padding).
    keep: Vec<(usize, usize)>,
    /// The permutation back from dim-major order, if one was applied.
    permute_back: Option<Vec<usize>>,
    dtype: DType,
}

impl InFlight {
    fn complete(self) -> Result<Tensor> {
        match self {
            InFlight::Reduce { work, shape, dtype } => {
                buffer_to_tensor(work.wait()?, &shape, dtype)
            }
            InFlight::Pair { work, unpack, pool } => {
                let BufferPair { input, output } = work.wait()?;
                pool.keep(input);
                let mut tensor = buffer_to_tensor(output, &unpack.buffer_shape, unpack.dtype)?;
                for (dim, len) in unpack.keep {
                    tensor = tensor.narrow(dim, 0, len)?;
                }
                if let Some(perm) = unpack.permute_back {
                    tensor = tensor.permute(&perm)?;
                }
                Ok(tensor.contiguous()?)
            }
        }
    }
}

/// Row counts (along the dim moved to the front) of a dim-major collective.
struct Rows {
    /// Rows of the send buffer (this rank's rows, padded).
    send: usize,
    /// Rows of the output buffer.
    output: usize,
    /// Leading output rows that are real data (the rest is padding).
    keep: usize,
}

/// A packed send buffer and what to do with the collective's output.
struct DimMajorSend {
    input: Buffer,
    /// Elements of the output buffer.
    output_len: usize,
    unpack: Unpack,
}

/// What issuing one step gave.
enum Issued {
    /// A local step: the new local tensor.
    Done(Tensor),
    /// A collective step: the new local tensor once it completes.
    InFlight(InFlight),
}

/// A redistribute in progress: returned by
/// [`DTensor::redistribute_async`](crate::DTensor::redistribute_async).
///
/// When it is returned, every local step before the plan's first collective has run and that
/// collective is issued (it proceeds on the communicator's progress thread while the caller
/// computes). [`wait`](RedistributeWork::wait) completes it and runs the remaining steps;
/// a plan with several collectives issues the later ones inside `wait`, in plan order, so
/// every rank issues the same collectives in the same order.
#[must_use = "a redistribute does nothing useful until it is waited on"]
pub struct RedistributeWork {
    mesh: ProcessMesh,
    global_shape: Vec<usize>,
    plan: Arc<Plan>,
    next: usize,
    placements: Vec<Placement>,
    local: Option<Tensor>,
    in_flight: Option<InFlight>,
    /// Where the source's local tensor lives. The collectives take host buffers, so a local
    /// tensor on a device is redistributed through a host copy and the result moved back.
    device: Device,
}

// The asynchronous redistributes live beside the executor they start, so that the DTensor
// type does not import its executor (and the executor, which builds DTensors, is not imported
// back).
impl DTensor {
    /// Like [`redistribute`](DTensor::redistribute), returning once the first collective is
    /// issued; see [`RedistributeWork`] for what runs when.
    pub fn redistribute_async(&self, placements: &[Placement]) -> Result<RedistributeWork> {
        let plan = self.plan_to(placements)?;
        RedistributeWork::start(self.clone(), plan)
    }

    /// The consuming form of [`redistribute_async`](DTensor::redistribute_async).
    pub fn into_redistribute_async(self, placements: &[Placement]) -> Result<RedistributeWork> {
        let plan = self.plan_to(placements)?;
        RedistributeWork::start(self, plan)
    }
}

impl RedistributeWork {
    /// Starts executing `plan` on `source`.
    /// Starts executing `plan` on `source`, which it consumes: a local tensor nobody else
    /// views can be handed to the first collective without a copy.
    pub(crate) fn start(source: DTensor, plan: Arc<Plan>) -> Result<RedistributeWork> {
        tracing::trace!(steps = ?plan.steps, cost = plan.cost, "redistribute plan");
        let mesh = source.process_mesh().clone();
        let global_shape = source.shape().to_vec();
        let placements = source.placements().to_vec();
        let mut local = source.into_local();
        let device = local.device();
        if !device.is_cpu() && !plan.steps.is_empty() {
            // One device → host copy; the steps and the collectives run on the host.
            local = local.to_host()?;
        }
        let mut work = RedistributeWork {
            mesh,
            global_shape,
            plan,
            next: 0,
            placements,
            local: Some(local),
            in_flight: None,
            device,
        };
        work.advance()?;
        Ok(work)
    }

    /// The plan being executed.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Runs steps until one collective is in flight or the plan is done.
    fn advance(&mut self) -> Result<()> {
        while self.in_flight.is_none() && self.next < self.plan.steps.len() {
            let step = self.plan.steps[self.next];
            let local = self
                .local
                .take()
                .expect("invariant: Some whenever no collective is in flight");
            let issued = self.issue(&step, local)?;
            self.placements[step.mesh_dim] = step.to;
            self.next += 1;
            match issued {
                Issued::Done(tensor) => self.local = Some(tensor),
                Issued::InFlight(in_flight) => self.in_flight = Some(in_flight),
            }
        }
        Ok(())
    }

    /// Waits for the collectives and returns the redistributed tensor.
    pub fn wait(mut self) -> Result<DTensor> {
        loop {
            if let Some(in_flight) = self.in_flight.take() {
                self.local = Some(in_flight.complete()?);
            }
            if self.next == self.plan.steps.len() {
                break;
            }
            self.advance()?;
        }
        // invariant: the loop exits only with no collective in flight, so `local` is Some.
        let mut local = self
            .local
            .take()
            .expect("invariant: local tensor present at the end");
        if local.device() != self.device {
            // Back where the source lived (one host → device copy).
            local = local.to_device(&self.device)?;
        }
        Ok(DTensor::from_parts(
            local,
            self.mesh,
            self.placements,
            self.global_shape,
        ))
    }

    /// The extent of `tensor_dim` that mesh dim `mesh_dim` splits on this rank: the global
    /// extent narrowed by every earlier mesh dim that shards the same tensor dim.
    fn parent_extent(&self, mesh_dim: usize, tensor_dim: usize) -> Result<usize> {
        let mut extent = self.global_shape[tensor_dim];
        let shape = self.mesh.shape();
        let coordinate = self.mesh.coordinate();
        for j in 0..mesh_dim {
            if self.placements[j] == Placement::Shard(tensor_dim) {
                extent = shard_span(extent, shape[j], coordinate[j])?.len;
            }
        }
        Ok(extent)
    }

    fn issue(&self, step: &Step, local: Tensor) -> Result<Issued> {
        let comm = self.mesh.dim_comm(step.mesh_dim)?.clone();
        let n = comm.size();
        let k = self.mesh.coordinate()[step.mesh_dim];
        let dtype = local.dtype();
        match step.kind {
            StepKind::AllGather { tensor_dim } => {
                let extent = self.parent_extent(step.mesh_dim, tensor_dim)?;
                let chunk = chunk_size(extent, n)?;
                let rows = Rows {
                    send: chunk,
                    output: n * chunk,
                    keep: extent,
                };
                let send = self.dim_major_send(local, tensor_dim, rows)?;
                let output = self
                    .mesh
                    .buffer_pool()
                    .output(wire_dtype(dtype), send.output_len);
                Ok(self.pair(comm.all_gather_async(send.input, output), send.unpack))
            }
            StepKind::AllReduce { op } => {
                let shape = local.shape().to_vec();
                let numel = local.numel();
                let input = pack_whole(self.mesh.buffer_pool(), local, numel, InputUse::InPlace)?;
                Ok(Issued::InFlight(InFlight::Reduce {
                    work: comm.all_reduce_async(input, wire_op(op)),
                    shape,
                    dtype,
                }))
            }
            StepKind::ReduceScatter { op, tensor_dim } => {
                let extent = local.shape()[tensor_dim];
                let chunk = chunk_size(extent, n)?;
                let mine = shard_span(extent, n, k)?.len;
                let rows = Rows {
                    send: n * chunk,
                    output: chunk,
                    keep: mine,
                };
                let send = self.dim_major_send(local, tensor_dim, rows)?;
                let output = self
                    .mesh
                    .buffer_pool()
                    .output(wire_dtype(dtype), send.output_len);
                let work = comm.reduce_scatter_async(send.input, output, wire_op(op));
                Ok(self.pair(work, send.unpack))
            }
            StepKind::AllToAll { from_dim, to_dim } => {
                self.issue_all_to_all(&comm, step.mesh_dim, local, from_dim, to_dim)
            }
            StepKind::LocalChunk { tensor_dim } => {
                let span = shard_span(local.shape()[tensor_dim], n, k)?;
                // A copy, so the shard owns its memory instead of pinning the full tensor; in
                // collective memory, so a later collective can take it without another copy.
                let view = local.narrow(tensor_dim, span.offset, span.len)?;
                let chunk = staging_tensor(view.shape(), dtype)?;
                chunk.copy_from(&view)?;
                Ok(Issued::Done(chunk))
            }
            StepKind::LocalPartition { op } => Ok(Issued::Done(partition(&local, op, k)?)),
            StepKind::LocalShardToPartial { tensor_dim } => {
                let extent = self.parent_extent(step.mesh_dim, tensor_dim)?;
                let span = shard_span(extent, n, k)?;
                let mut shape = local.shape().to_vec();
                shape[tensor_dim] = extent;
                // In collective memory, so the collective that follows can move or lend it.
                let full = staging_tensor(&shape, dtype)?;
                full.narrow(tensor_dim, span.offset, span.len)?
                    .copy_from(&local)?;
                Ok(Issued::Done(full))
            }
        }
    }

    /// `S(from_dim) → S(to_dim)`: block `m` of the input is this rank's `from_dim` shard cut
    /// to peer `m`'s `to_dim` chunk, both padded to their chunk sizes.
    fn issue_all_to_all(
        &self,
        comm: &Arc<dyn Communicator>,
        mesh_dim: usize,
        local: Tensor,
        from_dim: usize,
        to_dim: usize,
    ) -> Result<Issued> {
        let n = comm.size();
        let k = self.mesh.coordinate()[mesh_dim];
        let dtype = local.dtype();
        let from_extent = self.parent_extent(mesh_dim, from_dim)?;
        let to_extent = local.shape()[to_dim];
        let from_chunk = chunk_size(from_extent, n)?;
        let to_chunk = chunk_size(to_extent, n)?;
        let (major, permute_back) = to_front(local, &[from_dim, to_dim])?;
        let rest: Vec<usize> = major.shape()[2..].to_vec();
        let spans = (0..n)
            .map(|peer| shard_span(to_extent, n, peer).map(|s| (s.offset, s.len)))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mine = shard_span(to_extent, n, k)?.len;
        let mut buffer_shape = vec![n * from_chunk, to_chunk];
        buffer_shape.extend_from_slice(&rest);
        let unpack = Unpack {
            buffer_shape,
            keep: vec![(0, from_extent), (1, mine)],
            permute_back,
            dtype,
        };
        // Without padding (this rank holds a whole chunk of rows and every peer's span is a
        // whole chunk), each peer's block is a set of equal rows of the dim-major tensor:
        // the collective reads them in place from the tensor's own memory (moved, or lent
        // copy-on-write), so nothing is packed.
        let held = major.shape()[0];
        let even = held == from_chunk && spans.iter().all(|&(_, len)| len == to_chunk);
        let major = if even && major.is_contiguous() {
            let source = match reclaim_buffer(major)? {
                Ok(buffer) => Ok(buffer),
                Err(major) => lend_buffer(&major).ok_or(major),
            };
            match source {
                Ok(input) => {
                    let rest_elems: usize = rest.iter().product();
                    let blocks = StridedBlocks {
                        rows: held,
                        width: to_chunk * rest_elems,
                        stride: to_extent * rest_elems,
                        offsets: spans
                            .iter()
                            .map(|&(offset, _)| offset * rest_elems)
                            .collect(),
                    };
                    let output = self
                        .mesh
                        .buffer_pool()
                        .output(wire_dtype(dtype), n * blocks.block_len());
                    let work = comm.all_to_all_strided_async(input, output, blocks);
                    return Ok(self.pair(work, unpack));
                }
                Err(major) => major,
            }
        } else {
            major
        };
        let layout = AllToAllLayout {
            peers: n,
            from_chunk,
            to_chunk,
            spans: &spans,
        };
        let input = pack_all_to_all(self.mesh.buffer_pool(), &major, &layout)?;
        // A consumed source is used up once packed: keep its memory for the next send buffer
        // rather than freeing it while the collective waits.
        self.mesh.buffer_pool().retire(major)?;
        let output = self
            .mesh
            .buffer_pool()
            .output(wire_dtype(dtype), input.len());
        Ok(self.pair(comm.all_to_all_async(input, output), unpack))
    }

    /// A two-buffer collective in flight, its send buffer going back to this mesh's pool.
    fn pair(&self, work: Work<BufferPair>, unpack: Unpack) -> Issued {
        Issued::InFlight(InFlight::Pair {
            work,
            unpack,
            pool: self.mesh.buffer_pool().clone(),
        })
    }

    /// The send side of a collective over `tensor_dim` (all-gather, reduce-scatter): the
    /// local tensor moved dim-major and packed (moved, lent or copied, padded) to
    /// `rows.send` rows, and how the output of `rows.output` rows becomes the new local
    /// tensor.
    fn dim_major_send(&self, local: Tensor, tensor_dim: usize, rows: Rows) -> Result<DimMajorSend> {
        let dtype = local.dtype();
        let (major, permute_back) = to_front(local, &[tensor_dim])?;
        let rest: Vec<usize> = major.shape()[1..].to_vec();
        let row_elems: usize = rest.iter().product();
        let input = pack_padded(self.mesh.buffer_pool(), major, rows.send)?;
        let mut buffer_shape = vec![rows.output];
        buffer_shape.extend_from_slice(&rest);
        Ok(DimMajorSend {
            input,
            output_len: rows.output * row_elems,
            unpack: Unpack {
                buffer_shape,
                keep: vec![(0, rows.keep)],
                permute_back,
                dtype,
            },
        })
    }
}

/// `R → P(op)` at coordinate `k` of the mesh dim (see [`StepKind::LocalPartition`]).
pub(crate) fn partition(local: &Tensor, op: ReduceOp, k: usize) -> Result<Tensor> {
    let keep = k == 0;
    Ok(match op {
        ReduceOp::Avg | ReduceOp::Max | ReduceOp::Min => local.clone(),
        ReduceOp::Sum if keep => local.clone(),
        ReduceOp::Product if keep => local.clone(),
        ReduceOp::PreMulSum(factor) if keep => local.scale(1.0 / factor)?,
        // In collective memory, like every tensor this crate makes, so that a consuming
        // redistribute can send it without a copy.
        ReduceOp::Product => {
            let ones = staging_tensor(local.shape(), local.dtype())?;
            ones.fill_(1.0)?;
            ones
        }
        ReduceOp::Sum | ReduceOp::PreMulSum(_) => staging_tensor(local.shape(), local.dtype())?,
    })
}

/// A view of `tensor` with `dims` moved to the front (in that order, the rest keeping theirs),
/// and the permutation that moves them back (`None` when nothing moved).
pub(crate) fn to_front(tensor: Tensor, dims: &[usize]) -> Result<(Tensor, Option<Vec<usize>>)> {
    let mut perm: Vec<usize> = dims.to_vec();
    perm.extend((0..tensor.ndim()).filter(|d| !dims.contains(d)));
    if perm.iter().enumerate().all(|(i, &d)| i == d) {
        return Ok((tensor, None));
    }
    let mut back = vec![0; perm.len()];
    for (i, &d) in perm.iter().enumerate() {
        back[d] = i;
    }
    Ok((tensor.permute(&perm)?, Some(back)))
}
