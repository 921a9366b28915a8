//! Ring algorithms: reduce-scatter, all-gather, and all-reduce as reduce-scatter followed by
//! all-gather over the same blocks (small all-reduces go to [`doubling`](super::doubling)
//! instead, see [`AllReduceAlgorithm`]). Every block moves in segments of
//! [`TcpConfig::segment_bytes`](super::TcpConfig::segment_bytes); step `s` of a ring phase is
//! filed under tag `s` (reduce-scatter) or `size + s` (all-gather of an all-reduce), and the
//! segments of one step queue in order in the mailbox.

use std::ops::Range;

use super::link::Link;
use crate::agree::args;
use crate::algorithms::group::Inner;
use crate::blocks::{byte_blocks, even_block};
use crate::buffer::Buffer;
use crate::buffer::BufferPair;
use crate::dtype::DType;
use crate::engine::JobContext;
use crate::error::{Error, Result};
use crate::op::{OpKind, ReduceOp};
use crate::reduce::ReducePlan;
use crate::transport::shm::copy::{STREAM_MIN_DESTINATION, stream_copy};
use crate::transport::tcp::config::AllReduceAlgorithm;
use crate::transport::tcp::posted::{PostMode, PostTarget as Target};

fn tag(step: usize) -> u32 {
    // Steps are below the group size, which is far below u32::MAX for any real mesh.
    u32::try_from(step).unwrap_or(u32::MAX)
}

/// One ring phase: `steps` steps, step `s` tagged `tag_base + s`, each receiving one block
/// from the left neighbour ([`PostMode::Copy`] or [`PostMode::Reduce`] into it) while the
/// block of the step before travels on to the right.
struct RingPhase<'l, 'a> {
    link: &'l Link<'a>,
    mode: PostMode,
    steps: usize,
    tag_base: usize,
}

/// How many steps of a phase are posted at once: the step being waited for and the next,
/// so data that the left neighbour sends one step early lands directly too.
const POSTED_AHEAD: usize = 2;

impl<'a> RingPhase<'_, 'a> {
    fn dtype(&self) -> DType {
        match self.mode {
            PostMode::Copy(dtype) => dtype,
            PostMode::Reduce(plan) => plan.dtype(),
        }
    }

    /// Runs the phase, pipelined across steps: every step's destination is lent to the
    /// reader thread ([`Link::post`], two steps ahead), `first` (step 0's outgoing block)
    /// is sent, and while step `s` fills, each newly filled range is forwarded to the right
    /// neighbour at once as step `s + 1`'s data, so the block never waits for the whole of
    /// it to arrive before moving on (step `s + 1` sends exactly what step `s` received). The
    /// op thread only sends; the reader threads copy or combine straight from the socket.
    /// `target(s, spare)` hands out step `s`'s destination (filled with this rank's
    /// contribution for a reduction); `spare` is the buffer of step `s - 2`, done by then.
    fn run<'b>(
        &self,
        first: &[u8],
        target: impl FnMut(usize, Option<&'b mut [u8]>) -> Result<Target<'b>>,
    ) -> Result<()>
    where
        'a: 'b,
    {
        self.run_with(first, target, |_| Ok(()))
    }

    /// [`RingPhase::run`], calling `sent(range)` right after each segment of `first` (bytes
    /// `range` of it) is handed to the socket: work done there overlaps the kernel moving
    /// the segments still queued, instead of delaying the first send.
    fn run_with<'b>(
        &self,
        first: &[u8],
        mut target: impl FnMut(usize, Option<&'b mut [u8]>) -> Result<Target<'b>>,
        mut sent: impl FnMut(Range<usize>) -> Result<()>,
    ) -> Result<()>
    where
        'a: 'b,
    {
        let link = self.link;
        let (right, left, dtype) = (link.right(1), link.left(1), self.dtype());
        let mut posted = std::collections::VecDeque::with_capacity(POSTED_AHEAD);
        for s in 0..self.steps.min(POSTED_AHEAD) {
            let step = target(s, None)?;
            let len = step.len;
            posted.push_back((
                link.post(left, tag(self.tag_base + s), self.mode, step)?,
                len,
            ));
        }
        if self.steps > 0 {
            let segment = link.segment_bytes(dtype);
            let mut at = 0;
            while at < first.len() {
                let end = (at + segment).min(first.len());
                link.send_data(right, dtype, tag(self.tag_base), &first[at..end])?;
                sent(at..end)?;
                at = end;
            }
        }
        for s in 0..self.steps {
            // invariant: step s was posted (two ahead, or in the first loop above).
            let (post, len) = posted.pop_front().ok_or(Error::Aborted { op: link.op })?;
            let forward = (s + 1 < self.steps).then(|| tag(self.tag_base + s + 1));
            let spare = link.wait_lent(
                post,
                left,
                tag(self.tag_base + s),
                self.mode,
                len,
                |fresh| match forward {
                    Some(next) => link.send_data(right, dtype, next, fresh),
                    None => Ok(()),
                },
            )?;
            let later = s + POSTED_AHEAD;
            if later < self.steps {
                let step = target(later, Some(spare))?;
                let len = step.len;
                posted.push_back((
                    link.post(left, tag(self.tag_base + later), self.mode, step)?,
                    len,
                ));
            }
        }
        Ok(())
    }
}

/// `work` cut into its blocks (consecutive, in order, as [`byte_blocks`] makes them), so
/// different steps can lend different blocks at once.
fn split_blocks<'b>(work: &'b mut [u8], blocks: &[Range<usize>]) -> Vec<Option<&'b mut [u8]>> {
    let mut rest = work;
    let mut offset = 0;
    let mut parts = Vec::with_capacity(blocks.len());
    for block in blocks {
        let skip = block.start.saturating_sub(offset).min(rest.len());
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(skip);
        let take = block.len().min(tail.len());
        let (part, tail) = tail.split_at_mut(take);
        parts.push(Some(part));
        rest = tail;
        offset = block.start + take;
    }
    parts
}

/// Takes block `index` out of `parts` (each block is handed out once per phase).
fn take_block<'b>(
    parts: &mut [Option<&'b mut [u8]>],
    index: usize,
    op: OpKind,
) -> Result<Target<'b>> {
    // invariant: ring steps visit every block but the first one sent exactly once.
    let buffer = parts
        .get_mut(index)
        .and_then(Option::take)
        .ok_or(Error::Aborted { op })?;
    let len = buffer.len();
    Ok(Target {
        buffer,
        len,
        own: None,
    })
}

/// Ring reduce-scatter in place: `work` holds this rank's prepared contribution; afterwards
/// its own block holds the combined (not yet finished) result. Step `s` sends block
/// `rank - s - 1` and combines the incoming data into block `rank - s - 2`.
fn ring_reduce_scatter(
    link: &Link<'_>,
    plan: &ReducePlan,
    work: &mut [u8],
    blocks: &[Range<usize>],
) -> Result<()> {
    let n = link.size();
    let mut parts = split_blocks(work, blocks);
    let first = take_block(&mut parts, link.left(1), link.op)?;
    let phase = RingPhase {
        link,
        mode: PostMode::Reduce(*plan),
        steps: n.saturating_sub(1),
        tag_base: 0,
    };
    phase.run(first.buffer, |s, _| {
        take_block(&mut parts, link.left(s + 2), link.op)
    })
}

/// Ring reduce-scatter that reads this rank's contribution straight from `input`, for reduce
/// ops whose `prepare` does nothing (all but `PreMulSum`): no working copy of the whole input.
/// Step `s` sends the block accumulated in step `s - 1` (step 0: the input's own block) and
/// receives the next block into `input's block ⊕ incoming` (the reader thread reads the
/// input's block directly, no copy of it is made); the last step lands in `output`
/// (this rank's block, combined but not yet finished). `scratch` holds two blocks, which
/// alternate between the steps before the last.
fn reduce_scatter_from_input(
    link: &Link<'_>,
    plan: &ReducePlan,
    input: &[u8],
    output: &mut [u8],
    blocks: &[Range<usize>],
    scratch: &mut [u8],
) -> Result<()> {
    let n = link.size();
    if n == 1 {
        output.copy_from_slice(&input[blocks[0].clone()]);
        return Ok(());
    }
    let (half_a, half_b) = scratch.split_at_mut(scratch.len() / 2);
    let mut fresh = vec![half_a, half_b];
    let mut output = Some(output);
    let phase = RingPhase {
        link,
        mode: PostMode::Reduce(*plan),
        steps: n - 1,
        tag_base: 0,
    };
    let first = &input[blocks[link.left(1)].clone()];
    phase.run(first, |s, spare| {
        let own = &input[blocks[link.left(s + 2)].clone()];
        let buffer = if s == n - 2 {
            output.take()
        } else {
            spare.or_else(|| fresh.pop())
        };
        // invariant: the last step takes the output once; the others alternate two halves.
        let buffer = buffer.ok_or(Error::Aborted { op: link.op })?;
        Ok(Target {
            buffer,
            len: own.len(),
            own: Some(own),
        })
    })
}

/// Ring all-gather in place: this rank's own block of `work` is filled (`own` is `None`), or
/// is filled from `own` while it is sent; afterwards every block is. Step `s` sends block
/// `rank - s` and receives block `rank - s - 1`.
///
/// With `own`, step 0 sends straight from it and copies each segment into the output right
/// after handing it to the socket, so the copy of this rank's block overlaps the transfer
/// instead of preceding it.
fn ring_all_gather(
    link: &Link<'_>,
    dtype: DType,
    work: &mut [u8],
    blocks: &[Range<usize>],
    tag_base: usize,
    own: Option<&[u8]>,
) -> Result<()> {
    let n = link.size();
    let mut parts = split_blocks(work, blocks);
    let mine = take_block(&mut parts, link.rank(), link.op)?.buffer;
    let phase = RingPhase {
        link,
        mode: PostMode::Copy(dtype),
        steps: n.saturating_sub(1),
        tag_base,
    };
    let next = |s: usize, _| take_block(&mut parts, link.left(s + 1), link.op);
    let Some(own) = own else {
        return phase.run(mine, next);
    };
    if own.len() != mine.len() {
        return Err(Error::LengthMismatch {
            op: link.op,
            role: crate::op::BufferRole::Input,
            expected: mine.len() / dtype.size_bytes(),
            got: own.len() / dtype.size_bytes(),
        });
    }
    if n == 1 {
        mine.copy_from_slice(own);
        return Ok(());
    }
    // A large block is written once and not read again by this op: streaming stores skip
    // the read-for-ownership of every cold output line, as the posts of the other blocks do.
    let streamed = mine.len() >= STREAM_MIN_DESTINATION;
    phase.run_with(own, next, |range| {
        if streamed {
            stream_copy(&mut mine[range.clone()], &own[range]);
        } else {
            mine[range.clone()].copy_from_slice(&own[range]);
        }
        Ok(())
    })
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
    let args::Single {
        faults,
        desc,
        mut host,
        plan,
    } = args::all_reduce(link.place(), buffer, op);
    let (dtype, n) = (host.dtype(), host.len());
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
    ring_all_gather(&link, dtype, work, &blocks, size, None)?;
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
    let args::Pair {
        faults,
        desc,
        input,
        mut output,
        dtype,
        counts,
        ..
    } = args::all_gather(link.place(), input, output, counts);
    link.open(desc, faults)?;
    let blocks = byte_blocks(&counts, dtype);
    let work = output.as_bytes_mut();
    ring_all_gather(&link, dtype, work, &blocks, 0, Some(input.as_bytes()))?;
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
    let rank = link.rank();
    let args::Pair {
        faults,
        desc,
        input,
        mut output,
        dtype,
        counts,
        plan,
    } = args::reduce_scatter(link.place(), input, output, counts, op);
    link.open(desc, faults)?;
    // invariant: a failed plan is a posted fault, and open returned it above.
    let plan = plan.ok_or(Error::UnsupportedOp { op, dtype })?;
    let blocks = byte_blocks(&counts, dtype);
    if !matches!(op, ReduceOp::PreMulSum(_)) {
        // Only the steps before the last use the two scratch blocks, so a world of two
        // (one step, straight into the output) needs none.
        let widest = blocks.iter().map(Range::len).max().unwrap_or(0);
        let scratch_bytes = if link.size() > 2 { 2 * widest } else { 0 };
        inner.with_scratch(scratch_bytes, |scratch| {
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
