//! The bodies of the MPI backend's collectives. Each runs on the communicator's progress
//! thread: check the local arguments into [`Faults`], agree on the descriptors (phase 0, see
//! `agree`), then make one nonblocking MPI call through `raw::run` and poll it within the op's
//! deadline.

use std::ffi::c_int;

use mpi::ffi;

use super::agree::{agree, c_rank};
use super::communicator::Inner;
use super::raw::{self, read_ptr, write_ptr};
use super::types::{
    int_blocks, movement_type, mpi_op, reduce_type, stage, staged_zeros, staging_dtype, to_int,
    unstage,
};
use crate::agree::args;
use crate::agree::{Desc, Faults};
use crate::buffer::BufferPair;
use crate::buffer::{Buffer, HostBuffer};
use crate::engine::JobContext;
use crate::error::{Error, MpiQuantity, Result};
use crate::op::{AllToAllCounts, OpKind, ReduceOp};
use crate::reduce::ReducePlan;

/// The backend's name in errors and [`Communicator::backend`](crate::Communicator::backend).
pub(crate) const BACKEND: &str = "mpi";

/// Where an op runs, for the argument checks every backend shares (`crate::args`):
/// reductions are planned in the staging dtype (f32 for bf16/f16), which is what MPI reduces.
fn place(inner: &Inner) -> args::Place {
    args::Place {
        size: inner.size,
        rank: inner.rank,
        backend: BACKEND,
        reduce_dtype: staging_dtype,
    }
}

/// Which reducing MPI call to make.
enum ReduceCall {
    AllReduce,
    /// `MPI_Ireduce_scatter_block`: every rank receives the same count.
    ScatterBlock,
    /// `MPI_Ireduce_scatter` with these receive counts.
    Scatter(Vec<c_int>),
    /// `MPI_Ireduce` to this root.
    Reduce(c_int),
}

/// What [`reduce_into`] reduces: the staged, prepared contribution and where the result goes.
struct Reduction<'a> {
    plan: &'a ReducePlan,
    /// This rank's contribution in the staging dtype, with the plan's pre-scaling applied.
    send: HostBuffer,
    /// The buffer (in the caller's dtype) that receives the finished result.
    out: HostBuffer,
    call: ReduceCall,
}

/// Makes the reducing call, applies the plan's post-scaling and rounds back from the staging
/// dtype; returns `out` holding the result.
fn reduce_into(inner: &Inner, ctx: &JobContext, reduction: Reduction<'_>) -> Result<HostBuffer> {
    let Reduction {
        plan,
        send,
        out,
        call,
    } = reduction;
    let op = ctx.op;
    let staged = staging_dtype(out.dtype()) != out.dtype();
    let (mut out, recv) = if staged {
        let recv = staged_zeros(out.dtype(), out.len());
        (Some(out), recv)
    } else {
        (None, out)
    };
    let datatype = reduce_type(plan.dtype());
    let mpi_op = mpi_op(plan.combine_kind());
    let send_count = to_int(op, MpiQuantity::Count, send.len())?;
    let recv_count = to_int(op, MpiQuantity::Count, recv.len())?;
    let (_, mut recv, _) = raw::run(
        ctx,
        &inner.comm,
        "MPI_Ireduce*",
        (send, recv, call),
        |(send, recv, call_kind), call| match call_kind {
            // SAFETY: (all arms) `send` and `recv` are owned by `keep` until the request
            // completes, hold `send_count`/`recv_count` elements of `datatype` (phase 0 made
            // every rank agree on the lengths), and the count array lives in `keep` too.
            ReduceCall::AllReduce => unsafe {
                ffi::MPI_Iallreduce(
                    read_ptr(send.as_bytes()),
                    write_ptr(recv.as_bytes_mut()),
                    send_count,
                    datatype,
                    mpi_op,
                    call.comm,
                    call.request,
                )
            },
            // SAFETY: see above.
            ReduceCall::ScatterBlock => unsafe {
                ffi::MPI_Ireduce_scatter_block(
                    read_ptr(send.as_bytes()),
                    write_ptr(recv.as_bytes_mut()),
                    recv_count,
                    datatype,
                    mpi_op,
                    call.comm,
                    call.request,
                )
            },
            // SAFETY: see above.
            ReduceCall::Scatter(counts) => unsafe {
                ffi::MPI_Ireduce_scatter(
                    read_ptr(send.as_bytes()),
                    write_ptr(recv.as_bytes_mut()),
                    counts.as_ptr(),
                    datatype,
                    mpi_op,
                    call.comm,
                    call.request,
                )
            },
            // SAFETY: see above; `recv` is only written on the root.
            ReduceCall::Reduce(root) => unsafe {
                ffi::MPI_Ireduce(
                    read_ptr(send.as_bytes()),
                    write_ptr(recv.as_bytes_mut()),
                    send_count,
                    datatype,
                    mpi_op,
                    *root,
                    call.comm,
                    call.request,
                )
            },
        },
    )?;
    plan.finish(recv.as_bytes_mut())?;
    match out.as_mut() {
        Some(out) => unstage(&recv, out)?,
        None => return Ok(recv),
    }
    // invariant: `out` is Some in the staged branch just above.
    out.ok_or(Error::EngineStopped { op })
}

/// This rank's contribution, staged and pre-scaled.
fn contribution(plan: &ReducePlan, host: &HostBuffer) -> Result<HostBuffer> {
    let mut send = stage(host)?;
    plan.prepare(send.as_bytes_mut())?;
    Ok(send)
}

pub(crate) fn all_reduce(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    op: ReduceOp,
) -> Result<Buffer> {
    let args::Single {
        faults,
        desc,
        host,
        plan,
    } = args::all_reduce(place(inner), buffer, op);
    agree(inner, ctx, desc, faults)?;
    // invariant: a failed plan is a posted fault, and agree returned it above.
    let plan = plan.ok_or(Error::UnsupportedOp {
        op,
        dtype: host.dtype(),
    })?;
    let send = contribution(&plan, &host)?;
    let out = reduce_into(
        inner,
        ctx,
        Reduction {
            plan: &plan,
            send,
            out: host,
            call: ReduceCall::AllReduce,
        },
    )?;
    Ok(Buffer::Host(out))
}

pub(crate) fn reduce(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    root: usize,
    op: ReduceOp,
) -> Result<Buffer> {
    let args::Single {
        faults,
        desc,
        host,
        plan,
    } = args::reduce(place(inner), buffer, root, op);
    let dtype = host.dtype();
    agree(inner, ctx, desc, faults)?;
    // invariant: a failed plan is a posted fault, and agree returned it above.
    let plan = plan.ok_or(Error::UnsupportedOp { op, dtype })?;
    let send = contribution(&plan, &host)?;
    let is_root = inner.rank == root;
    // Only the root receives; the others keep their buffer and pass an empty one.
    let (out, kept) = if is_root {
        (host, None)
    } else {
        (HostBuffer::zeros(dtype, 0), Some(host))
    };
    let out = reduce_into(
        inner,
        ctx,
        Reduction {
            plan: &plan,
            send,
            out,
            call: ReduceCall::Reduce(c_rank(root)),
        },
    )?;
    Ok(Buffer::Host(kept.unwrap_or(out)))
}

pub(crate) fn reduce_scatter(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    counts: Option<Vec<usize>>,
    op: ReduceOp,
) -> Result<BufferPair> {
    // The uneven form needs MPI_Ireduce_scatter's count array; the even one the block call.
    let uneven = counts.is_some();
    let args::Pair {
        faults,
        desc,
        input,
        output,
        dtype,
        counts,
        plan,
    } = args::reduce_scatter(place(inner), input, output, counts, op);
    let kind = desc.op;
    agree(inner, ctx, desc, faults)?;
    // invariant: a failed plan is a posted fault, and agree returned it above.
    let plan = plan.ok_or(Error::UnsupportedOp { op, dtype })?;
    let call = if uneven {
        ReduceCall::Scatter(int_blocks(kind, &counts)?.counts)
    } else {
        ReduceCall::ScatterBlock
    };
    let send = contribution(&plan, &input)?;
    let output = reduce_into(
        inner,
        ctx,
        Reduction {
            plan: &plan,
            send,
            out: output,
            call,
        },
    )?;
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}

pub(crate) fn all_gather(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    counts: Option<Vec<usize>>,
) -> Result<BufferPair> {
    let args::Pair {
        faults,
        desc,
        input,
        output,
        dtype,
        counts,
        ..
    } = args::all_gather(place(inner), input, output, counts);
    let kind = desc.op;
    agree(inner, ctx, desc, faults)?;
    let blocks = int_blocks(kind, &counts)?;
    let own = blocks.counts[inner.rank];
    let datatype = movement_type(dtype);
    let (input, output, _) = raw::run(
        ctx,
        &inner.comm,
        "MPI_Iallgatherv",
        (input, output, blocks),
        |(input, output, blocks), call| {
            // SAFETY: `input` holds `own` elements and `output` sum(counts) elements laid out by
            // `blocks` (phase 0 checked both on every rank); all live in `keep` until done.
            unsafe {
                ffi::MPI_Iallgatherv(
                    read_ptr(input.as_bytes()),
                    own,
                    datatype,
                    write_ptr(output.as_bytes_mut()),
                    blocks.counts.as_ptr(),
                    blocks.displs.as_ptr(),
                    datatype,
                    call.comm,
                    call.request,
                )
            }
        },
    )?;
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}

pub(crate) fn broadcast(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    root: usize,
) -> Result<Buffer> {
    let kind = OpKind::Broadcast;
    let args::Single {
        faults, desc, host, ..
    } = args::broadcast(place(inner), buffer, root);
    agree(inner, ctx, desc, faults)?;
    let count = to_int(kind, MpiQuantity::Count, host.len())?;
    let datatype = movement_type(host.dtype());
    let root = c_rank(root);
    let host = raw::run(ctx, &inner.comm, "MPI_Ibcast", host, |host, call| {
        // SAFETY: `host` holds `count` elements on every rank (phase 0) and lives in `keep`.
        unsafe {
            ffi::MPI_Ibcast(
                write_ptr(host.as_bytes_mut()),
                count,
                datatype,
                root,
                call.comm,
                call.request,
            )
        }
    })?;
    Ok(Buffer::Host(host))
}

pub(crate) fn gather(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    root: usize,
) -> Result<BufferPair> {
    let kind = OpKind::Gather;
    let args::Pair {
        faults,
        desc,
        input,
        output,
        dtype,
        ..
    } = args::gather(place(inner), input, output, root);
    let n = input.len();
    agree(inner, ctx, desc, faults)?;
    let count = to_int(kind, MpiQuantity::Count, n)?;
    to_int(
        kind,
        MpiQuantity::Displacement,
        n.saturating_mul(inner.size),
    )?;
    let datatype = movement_type(dtype);
    let root = c_rank(root);
    let (input, output) = raw::run(
        ctx,
        &inner.comm,
        "MPI_Igather",
        (input, output),
        |(input, output), call| {
            // SAFETY: `input` holds `count` elements; on the root `output` holds size × count
            // (checked above and agreed in phase 0); elsewhere MPI ignores `output`.
            unsafe {
                ffi::MPI_Igather(
                    read_ptr(input.as_bytes()),
                    count,
                    datatype,
                    write_ptr(output.as_bytes_mut()),
                    count,
                    datatype,
                    root,
                    call.comm,
                    call.request,
                )
            }
        },
    )?;
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}

pub(crate) fn scatter(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    root: usize,
) -> Result<BufferPair> {
    let kind = OpKind::Scatter;
    let args::Pair {
        faults,
        desc,
        input,
        output,
        dtype,
        ..
    } = args::scatter(place(inner), input, output, root);
    let n = output.len();
    agree(inner, ctx, desc, faults)?;
    let count = to_int(kind, MpiQuantity::Count, n)?;
    to_int(
        kind,
        MpiQuantity::Displacement,
        n.saturating_mul(inner.size),
    )?;
    let datatype = movement_type(dtype);
    let root = c_rank(root);
    let (input, output) = raw::run(
        ctx,
        &inner.comm,
        "MPI_Iscatter",
        (input, output),
        |(input, output), call| {
            // SAFETY: `output` holds `count` elements; on the root `input` holds size × count
            // (checked above and agreed in phase 0); elsewhere MPI ignores `input`.
            unsafe {
                ffi::MPI_Iscatter(
                    read_ptr(input.as_bytes()),
                    count,
                    datatype,
                    write_ptr(output.as_bytes_mut()),
                    count,
                    datatype,
                    root,
                    call.comm,
                    call.request,
                )
            }
        },
    )?;
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}

pub(crate) fn all_to_all(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    counts: Option<AllToAllCounts>,
) -> Result<BufferPair> {
    let args::AllToAll {
        pair:
            args::Pair {
                faults,
                desc,
                input,
                output,
                dtype,
                ..
            },
        counts,
    } = args::all_to_all(place(inner), input, output, counts);
    let kind = desc.op;
    agree(inner, ctx, desc, faults)?;
    let send = int_blocks(kind, &counts.send)?;
    let recv = int_blocks(kind, &counts.recv)?;
    let datatype = movement_type(dtype);
    let (input, output, _, _) = raw::run(
        ctx,
        &inner.comm,
        "MPI_Ialltoallv",
        (input, output, send, recv),
        |(input, output, send, recv), call| {
            // SAFETY: `input`/`output` hold sum(send)/sum(recv) elements laid out by the two
            // block lists (checked locally; phase 0 checked that rank i's send[j] equals rank
            // j's recv[i]); everything lives in `keep` until the request completes.
            unsafe {
                ffi::MPI_Ialltoallv(
                    read_ptr(input.as_bytes()),
                    send.counts.as_ptr(),
                    send.displs.as_ptr(),
                    datatype,
                    write_ptr(output.as_bytes_mut()),
                    recv.counts.as_ptr(),
                    recv.displs.as_ptr(),
                    datatype,
                    call.comm,
                    call.request,
                )
            }
        },
    )?;
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}

pub(crate) fn barrier(inner: &Inner, ctx: &JobContext) -> Result<()> {
    let kind = OpKind::Barrier;
    agree(inner, ctx, Desc::new(kind), Faults::new(kind))?;
    raw::run(ctx, &inner.comm, "MPI_Ibarrier", (), |_, call| {
        // SAFETY: a barrier reads and writes no user memory; the request slot is `run`'s.
        unsafe { ffi::MPI_Ibarrier(call.comm, call.request) }
    })
}
