//! The rooted ops, done directly: gather (every rank sends its input to the root), scatter
//! (the root sends each rank its block) and reduce (every rank sends its prepared input to the
//! root, which combines them in rank order so the result matches `local` bit for bit).

use super::link::Link;
use crate::agree::args;
use crate::agree::{copy_into, elements};
use crate::algorithms::group::Inner;
use crate::blocks::copy_segment;
use crate::buffer::BufferPair;
use crate::buffer::{Buffer, HostBuffer};
use crate::engine::JobContext;
use crate::error::{Error, Result};
use crate::op::{OpKind, ReduceOp};

pub(crate) fn gather(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    root: usize,
) -> Result<BufferPair> {
    let kind = OpKind::Gather;
    let link = Link::collective(inner, ctx, kind);
    let (size, rank) = (link.size(), link.rank());
    let args::Pair {
        faults,
        desc,
        input,
        mut output,
        dtype,
        ..
    } = args::gather(link.place(), input, output, root);
    let n = input.len();
    link.open(desc, faults)?;
    if rank != root {
        link.send_data(root, dtype, 0, input.as_bytes())?;
    } else {
        let bytes = n * dtype.size_bytes();
        copy_into(kind, &mut output, rank * n, input.as_bytes())?;
        for peer in (0..size).filter(|&p| p != root) {
            let range = peer * bytes..(peer + 1) * bytes;
            link.recv_data(
                peer,
                dtype,
                0,
                &mut output.as_bytes_mut()[range],
                copy_segment,
            )?;
        }
    }
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
    let link = Link::collective(inner, ctx, kind);
    let (size, rank) = (link.size(), link.rank());
    let args::Pair {
        faults,
        desc,
        input,
        mut output,
        dtype,
        ..
    } = args::scatter(link.place(), input, output, root);
    let n = output.len();
    link.open(desc, faults)?;
    if rank == root {
        for peer in (0..size).filter(|&p| p != root) {
            let block = elements(kind, input.as_bytes(), dtype, peer * n, n)?;
            link.send_data(peer, dtype, 0, block)?;
        }
        let own = elements(kind, input.as_bytes(), dtype, rank * n, n)?;
        copy_into(kind, &mut output, 0, own)?;
    } else {
        link.recv_data(root, dtype, 0, output.as_bytes_mut(), copy_segment)?;
    }
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}

pub(crate) fn reduce(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    root: usize,
    op: ReduceOp,
) -> Result<Buffer> {
    let kind = OpKind::Reduce;
    let link = Link::collective(inner, ctx, kind);
    let (size, rank) = (link.size(), link.rank());
    let args::Single {
        faults,
        desc,
        host,
        plan,
    } = args::reduce(link.place(), buffer, root, op);
    let (dtype, n) = (host.dtype(), host.len());
    link.open(desc, faults)?;
    // invariant: a failed plan is a posted fault, and open returned it above.
    let plan = plan.ok_or(Error::UnsupportedOp { op, dtype })?;
    if rank != root {
        let mut prepared = HostBuffer::from_bytes(dtype, host.as_bytes())?;
        plan.prepare(prepared.as_bytes_mut())?;
        link.send_data(root, dtype, 0, prepared.as_bytes())?;
        return Ok(Buffer::Host(host));
    }
    // Combine in rank order: the accumulator starts as rank 0's prepared contribution.
    let mut own = HostBuffer::from_bytes(dtype, host.as_bytes())?;
    plan.prepare(own.as_bytes_mut())?;
    let mut acc = if root == 0 {
        own.clone()
    } else {
        let mut first = HostBuffer::zeros(dtype, n);
        link.recv_data(0, dtype, 0, first.as_bytes_mut(), copy_segment)?;
        first
    };
    for peer in 1..size {
        if peer == root {
            plan.combine(acc.as_bytes_mut(), own.as_bytes())?;
        } else {
            let mut incoming = HostBuffer::zeros(dtype, n);
            link.recv_data(peer, dtype, 0, incoming.as_bytes_mut(), copy_segment)?;
            plan.combine(acc.as_bytes_mut(), incoming.as_bytes())?;
        }
    }
    plan.finish(acc.as_bytes_mut())?;
    Ok(Buffer::Host(acc))
}
