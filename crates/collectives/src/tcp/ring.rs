//! Ring algorithms: reduce-scatter, all-gather, and all-reduce as reduce-scatter followed by
//! all-gather over the same blocks (small all-reduces go to [`doubling`](super::doubling)
//! instead, see [`AllReduceAlgorithm`]). Every block moves in segments of
//! [`TcpConfig::segment_bytes`](super::TcpConfig::segment_bytes); step `s` of a ring phase is
//! filed under tag `s` (reduce-scatter) or `size + s` (all-gather of an all-reduce), and the
//! segments of one step queue in order in the mailbox.

use std::ops::Range;

use super::communicator::Inner;
use super::config::AllReduceAlgorithm;
use super::link::{Exchange, Link};
use crate::blocks::{byte_blocks, even_block, send_and_recv_views};
use crate::buffer::Buffer;
use crate::dtype::DType;
use crate::engine::JobContext;
use crate::error::{Error, Result};
use crate::local::group::Desc;
use crate::local::ops::Faults;
use crate::op::{BufferPair, BufferRole, OpKind, ReduceOp};
use crate::reduce::ReducePlan;

fn tag(step: usize) -> u32 {
    // Steps are below the group size, which is far below u32::MAX for any real mesh.
    u32::try_from(step).unwrap_or(u32::MAX)
}

/// Ring reduce-scatter in place: `work` holds this rank's prepared contribution; afterwards
/// its own block holds the combined (not yet finished) result.
fn ring_reduce_scatter(
    link: &Link<'_>,
    plan: &ReducePlan,
    work: &mut [u8],
    blocks: &[Range<usize>],
) -> Result<()> {
    let n = link.size();
    let dtype = plan.dtype();
    let (right, left) = (link.right(1), link.left(1));
    for step in 0..n.saturating_sub(1) {
        let send = blocks[link.left(step + 1)].clone();
        let recv = blocks[link.left(step + 2)].clone();
        let (outgoing, incoming) = send_and_recv_views(work, send, recv);
        let step = Exchange {
            to: right,
            from: left,
            dtype,
            tag: tag(step),
            outgoing,
        };
        link.exchange(step, incoming, |acc, segment| plan.combine(acc, segment))?;
    }
    Ok(())
}

/// Ring reduce-scatter that reads this rank's contribution straight from `input`, for reduce
/// ops whose `prepare` does nothing (all but `PreMulSum`): no working copy of the whole input.
/// Step `s` sends the block accumulated in step `s - 1` (step 0: the input's own block) and
/// receives the next block into `input's block ⊕ incoming`; the last step lands in `output`
/// (this rank's block, combined but not yet finished). `scratch` holds two blocks.
fn reduce_scatter_from_input(
    link: &Link<'_>,
    plan: &ReducePlan,
    input: &[u8],
    output: &mut [u8],
    blocks: &[Range<usize>],
    scratch: &mut [u8],
) -> Result<()> {
    let n = link.size();
    let dtype = plan.dtype();
    let (right, left) = (link.right(1), link.left(1));
    if n == 1 {
        output.copy_from_slice(&input[blocks[0].clone()]);
        return Ok(());
    }
    let (mut sending, mut receiving) = scratch.split_at_mut(scratch.len() / 2);
    for step in 0..n - 1 {
        let send_block = blocks[link.left(step + 1)].clone();
        let recv_block = blocks[link.left(step + 2)].clone();
        let outgoing: &[u8] = if step == 0 {
            &input[send_block]
        } else {
            &sending[..send_block.len()]
        };
        let target: &mut [u8] = if step == n - 2 {
            &mut *output
        } else {
            &mut receiving[..recv_block.len()]
        };
        target.copy_from_slice(&input[recv_block]);
        let exchange = Exchange {
            to: right,
            from: left,
            dtype,
            tag: tag(step),
            outgoing,
        };
        link.exchange(exchange, target, |acc, segment| plan.combine(acc, segment))?;
        std::mem::swap(&mut sending, &mut receiving);
    }
    Ok(())
}

/// Ring all-gather in place: this rank's own block of `work` is filled; afterwards every
/// block is.
fn ring_all_gather(
    link: &Link<'_>,
    dtype: DType,
    work: &mut [u8],
    blocks: &[Range<usize>],
    tag_base: usize,
) -> Result<()> {
    let n = link.size();
    let (right, left) = (link.right(1), link.left(1));
    for step in 0..n.saturating_sub(1) {
        let send = blocks[link.left(step)].clone();
        let recv = blocks[link.left(step + 1)].clone();
        let (outgoing, incoming) = send_and_recv_views(work, send, recv);
        let step = Exchange {
            to: right,
            from: left,
            dtype,
            tag: tag(tag_base + step),
            outgoing,
        };
        link.exchange_copy(step, incoming)?;
    }
    Ok(())
}

pub(crate) fn all_reduce(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    op: ReduceOp,
) -> Result<Buffer> {
    let kind = OpKind::AllReduce;
    let link = Link::collective(inner, ctx, kind);
    let size = link.size();
    let mut faults = Faults::new(kind);
    let mut host = faults.host(buffer);
    let (dtype, n) = (host.dtype(), host.len());
    let plan = faults.plan(op, dtype, size);
    let mut desc = Desc::new(kind);
    desc.dtype = Some(dtype);
    desc.len = Some(n);
    desc.reduce = Some(op);
    let bytes = host.byte_len();
    let algorithm = match inner.all_reduce {
        AllReduceAlgorithm::Auto if bytes <= inner.small_all_reduce_bytes => {
            AllReduceAlgorithm::RecursiveDoubling
        }
        AllReduceAlgorithm::Auto if bytes <= inner.halving_doubling_bytes => {
            AllReduceAlgorithm::HalvingDoubling
        }
        AllReduceAlgorithm::Auto => AllReduceAlgorithm::Ring,
        chosen => chosen,
    };
    if algorithm == AllReduceAlgorithm::RecursiveDoubling {
        // The latency path: the first round's data leaves together with the descriptors.
        let mut eager_sent = false;
        link.open_eager(desc, faults, || {
            // invariant: without a local fault the plan exists (a failed plan is a fault).
            let plan = plan.as_ref().ok_or(Error::UnsupportedOp { op, dtype })?;
            plan.prepare(host.as_bytes_mut())?;
            eager_sent = super::doubling::first_send(&link, dtype, host.as_bytes())?;
            Ok(())
        })?;
        // invariant: a failed plan is a posted fault, and open returned it above.
        let plan = plan.ok_or(Error::UnsupportedOp { op, dtype })?;
        super::doubling::all_reduce(&link, &plan, host.as_bytes_mut(), eager_sent)?;
        return Ok(Buffer::Host(host));
    }
    link.open(desc, faults)?;
    // invariant: a failed plan is a posted fault, and open returned it above.
    let plan = plan.ok_or(Error::UnsupportedOp { op, dtype })?;
    let work = host.as_bytes_mut();
    plan.prepare(work)?;
    if algorithm == AllReduceAlgorithm::HalvingDoubling {
        super::halving::all_reduce(&link, &plan, work)?;
        return Ok(Buffer::Host(host));
    }
    let counts: Vec<usize> = (0..size)
        .map(|r| {
            let (start, end) = even_block(n, size, r);
            end - start
        })
        .collect();
    let blocks = byte_blocks(&counts, dtype);
    ring_reduce_scatter(&link, &plan, work, &blocks)?;
    plan.finish(&mut work[blocks[link.rank()].clone()])?;
    ring_all_gather(&link, dtype, work, &blocks, size)?;
    Ok(Buffer::Host(host))
}

pub(crate) fn all_gather(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    counts: Option<Vec<usize>>,
) -> Result<BufferPair> {
    let kind = if counts.is_some() {
        OpKind::AllGatherV
    } else {
        OpKind::AllGather
    };
    let link = Link::collective(inner, ctx, kind);
    let (size, rank) = (link.size(), link.rank());
    let mut faults = Faults::new(kind);
    let input = faults.host(input);
    let mut output = faults.host(output);
    let dtype = input.dtype();
    faults.dtype(BufferRole::Output, dtype, output.dtype());
    let mut desc = Desc::new(kind);
    desc.dtype = Some(dtype);
    let counts = match counts {
        Some(counts) => {
            faults.length(BufferRole::Counts, size, counts.len());
            if counts.len() == size {
                faults.length(BufferRole::Input, counts[rank], input.len());
                faults.length(BufferRole::Output, counts.iter().sum(), output.len());
            }
            desc.counts = Some(counts.clone());
            counts
        }
        None => {
            faults.length(BufferRole::Output, size * input.len(), output.len());
            desc.len = Some(input.len());
            vec![input.len(); size]
        }
    };
    link.open(desc, faults)?;
    let blocks = byte_blocks(&counts, dtype);
    let work = output.as_bytes_mut();
    work[blocks[rank].clone()].copy_from_slice(input.as_bytes());
    ring_all_gather(&link, dtype, work, &blocks, 0)?;
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}

pub(crate) fn reduce_scatter(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    counts: Option<Vec<usize>>,
    op: ReduceOp,
) -> Result<BufferPair> {
    let kind = if counts.is_some() {
        OpKind::ReduceScatterV
    } else {
        OpKind::ReduceScatter
    };
    let link = Link::collective(inner, ctx, kind);
    let (size, rank) = (link.size(), link.rank());
    let mut faults = Faults::new(kind);
    let input = faults.host(input);
    let mut output = faults.host(output);
    let dtype = input.dtype();
    faults.dtype(BufferRole::Output, dtype, output.dtype());
    let plan = faults.plan(op, dtype, size);
    let mut desc = Desc::new(kind);
    desc.dtype = Some(dtype);
    desc.reduce = Some(op);
    let counts = match counts {
        Some(counts) => {
            faults.length(BufferRole::Counts, size, counts.len());
            if counts.len() == size {
                faults.length(BufferRole::Input, counts.iter().sum(), input.len());
                faults.length(BufferRole::Output, counts[rank], output.len());
            }
            desc.counts = Some(counts.clone());
            counts
        }
        None => {
            faults.length(BufferRole::Input, size * output.len(), input.len());
            desc.len = Some(input.len());
            vec![output.len(); size]
        }
    };
    link.open(desc, faults)?;
    // invariant: a failed plan is a posted fault, and open returned it above.
    let plan = plan.ok_or(Error::UnsupportedOp { op, dtype })?;
    let blocks = byte_blocks(&counts, dtype);
    if !matches!(op, ReduceOp::PreMulSum(_)) {
        let widest = blocks.iter().map(Range::len).max().unwrap_or(0);
        inner.with_scratch(2 * widest, |scratch| {
            reduce_scatter_from_input(
                &link,
                &plan,
                input.as_bytes(),
                output.as_bytes_mut(),
                &blocks,
                scratch,
            )
        })?;
        plan.finish(output.as_bytes_mut())?;
        return Ok(BufferPair {
            input: Buffer::Host(input),
            output: Buffer::Host(output),
        });
    }
    // PreMulSum scales every contribution before it travels: work on a scaled copy.
    inner.with_scratch(input.byte_len(), |work| -> Result<()> {
        work.copy_from_slice(input.as_bytes());
        plan.prepare(work)?;
        ring_reduce_scatter(&link, &plan, work, &blocks)?;
        let own = &mut work[blocks[rank].clone()];
        plan.finish(own)?;
        output.as_bytes_mut().copy_from_slice(own);
        Ok(())
    })?;
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}
