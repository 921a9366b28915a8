//! All-to-all (and its `_v` and strided forms) by pairwise exchange: in step `s` every rank
//! sends its block for rank `+s` while it receives the block of rank `-s`, so each step is a
//! permutation and no rank is flooded by all peers at once.
//!
//! Every incoming block is posted before the first send ([`Link::post`]): the reader threads
//! (or the shared-memory channels) write each peer's block straight into its place in the
//! output, with no mailbox buffer and no second copy, whichever step its data arrives in.
//! The strided form reads each outgoing block's rows in place, one segment at a time through
//! a small staging buffer that stays in cache, so the caller never packs a send buffer.

use std::ops::Range;

use super::link::Link;
use crate::agree::args;
use crate::algorithms::group::Inner;
use crate::buffer::Buffer;
use crate::buffer::BufferPair;
use crate::dtype::DType;
use crate::engine::JobContext;
use crate::error::{Error, Result};
use crate::op::{AllToAllCounts, OpKind, StridedBlocks, block_offsets};
use crate::transport::tcp::frame::FrameKind;
use crate::transport::tcp::posted::{PostMode, PostTarget, PostedRecv};

/// The tag of every data frame of an all-to-all: each peer sends one block, so the sending
/// rank alone tells the blocks apart.
const TAG: u32 = 0;

/// The narrowest row a strided send hands to the socket in place: below it, the per-slice
/// cost of a vectored write outweighs one copy into the staging buffer.
const DIRECT_ROW_BYTES: usize = 2048;

/// Where this rank's outgoing blocks are.
enum Outgoing<'b> {
    /// Consecutive blocks of the input: block `j` is `counts[j]` elements at `offsets[j]`.
    Packed {
        bytes: &'b [u8],
        offsets: Vec<usize>,
        counts: &'b [usize],
    },
    /// Rows of the input read in place ([`StridedBlocks`]).
    Strided {
        bytes: &'b [u8],
        blocks: &'b StridedBlocks,
    },
}

impl Outgoing<'_> {
    /// Copies block `peer` (this rank's own, in practice) into `dst`, which has its length.
    fn copy_block(&self, op: OpKind, dtype: DType, peer: usize, dst: &mut [u8]) -> Result<()> {
        let element = dtype.size_bytes();
        match self {
            Outgoing::Packed {
                bytes,
                offsets,
                counts,
            } => {
                let range = offsets[peer] * element..(offsets[peer] + counts[peer]) * element;
                let src = bytes.get(range).ok_or(Error::LengthMismatch {
                    op,
                    role: crate::op::BufferRole::Input,
                    expected: offsets[peer] + counts[peer],
                    got: bytes.len() / element,
                })?;
                dst.copy_from_slice(src);
            }
            Outgoing::Strided { bytes, blocks } => {
                blocks.copy_packed(bytes, element, peer, 0, dst);
            }
        }
        Ok(())
    }

    /// Sends block `peer` to it, in segments. A strided block is packed one segment at a
    /// time into `staging` (at least one segment long) right before that segment is sent.
    fn send_block(
        &self,
        link: &Link<'_>,
        dtype: DType,
        peer: usize,
        staging: &mut [u8],
    ) -> Result<()> {
        match self {
            Outgoing::Packed { bytes, offsets, .. } => {
                // A packed block is sent straight from the input: no staging.
                let start = offsets[peer] * dtype.size_bytes();
                let end = start + self.block_bytes(dtype, peer);
                let src = bytes.get(start..end).ok_or(Error::LengthMismatch {
                    op: link.op,
                    role: crate::op::BufferRole::Input,
                    expected: end / dtype.size_bytes(),
                    got: bytes.len() / dtype.size_bytes(),
                })?;
                link.send_data(peer, dtype, TAG, src)
            }
            Outgoing::Strided { bytes, blocks } => {
                let element = dtype.size_bytes();
                let total = blocks.block_len() * element;
                let segment = link.segment_bytes(dtype);
                // Rows of at least DIRECT_ROW_BYTES go to the socket as they lie (one vectored
                // write per frame, no copy); narrower rows, or a shared-memory peer, are
                // packed a segment at a time into the cache-resident staging buffer.
                let direct = blocks.width * element >= DIRECT_ROW_BYTES;
                let mut at = 0;
                while at < total {
                    let take = segment.min(total - at);
                    if direct {
                        let pieces: Vec<&[u8]> = blocks
                            .packed_pieces(bytes, element, peer, at, take)
                            .collect();
                        if link.send_parts(peer, dtype, TAG, &pieces)? {
                            at += take;
                            continue;
                        }
                    }
                    let take = take.min(staging.len());
                    let piece = &mut staging[..take];
                    blocks.copy_packed(bytes, element, peer, at, piece);
                    link.send_frame(peer, FrameKind::Data, dtype, TAG, piece)?;
                    at += take;
                }
                Ok(())
            }
        }
    }

    /// The bytes of block `peer`.
    fn block_bytes(&self, dtype: DType, peer: usize) -> usize {
        match self {
            Outgoing::Packed { counts, .. } => counts[peer] * dtype.size_bytes(),
            Outgoing::Strided { blocks, .. } => blocks.block_len() * dtype.size_bytes(),
        }
    }
}

/// The output cut into the blocks that come from each rank (consecutive, in rank order).
fn receive_blocks<'b>(output: &'b mut [u8], ranges: &[Range<usize>]) -> Vec<&'b mut [u8]> {
    let mut rest = output;
    let mut parts = Vec::with_capacity(ranges.len());
    for range in ranges {
        let (part, tail) = std::mem::take(&mut rest).split_at_mut(range.len());
        parts.push(part);
        rest = tail;
    }
    parts
}

/// The exchange itself, after phase 0: posts every peer's incoming block, sends this rank's
/// blocks pairwise, copies its own block, then waits for the posts in step order.
fn exchange(
    link: &Link<'_>,
    dtype: DType,
    outgoing: &Outgoing<'_>,
    output: &mut [u8],
    recv_counts: &[usize],
    staging: &mut [u8],
) -> Result<()> {
    let (size, rank) = (link.size(), link.rank());
    let element = dtype.size_bytes();
    let ranges: Vec<Range<usize>> = block_offsets(recv_counts)
        .iter()
        .zip(recv_counts)
        .map(|(&offset, &count)| offset * element..(offset + count) * element)
        .collect();
    if ranges.last().map_or(0, |r| r.end) > output.len() {
        return Err(Error::LengthMismatch {
            op: link.op,
            role: crate::op::BufferRole::Output,
            expected: recv_counts.iter().sum(),
            got: output.len() / element,
        });
    }
    let mut parts: Vec<Option<&mut [u8]>> = receive_blocks(output, &ranges)
        .into_iter()
        .map(Some)
        .collect();
    let own = parts[rank].take();
    let mut posts: Vec<Option<(PostedRecv<'_>, usize)>> = Vec::with_capacity(size);
    for step in 0..size {
        let from = link.left(step);
        let buffer = match parts[from].take() {
            Some(buffer) if step > 0 && !buffer.is_empty() => buffer,
            _ => {
                posts.push(None);
                continue;
            }
        };
        let len = buffer.len();
        let target = PostTarget {
            buffer,
            len,
            own: None,
        };
        posts.push(Some((
            link.post(from, TAG, PostMode::Copy(dtype), target)?,
            len,
        )));
    }
    for step in 1..size {
        let to = link.right(step);
        if outgoing.block_bytes(dtype, to) > 0 {
            outgoing.send_block(link, dtype, to, staging)?;
        }
    }
    if let Some(own) = own {
        outgoing.copy_block(link.op, dtype, rank, own)?;
    }
    for (step, post) in posts.into_iter().enumerate() {
        if let Some((posted, len)) = post {
            let from = link.left(step);
            link.wait_lent(posted, from, TAG, PostMode::Copy(dtype), len, |_| Ok(()))?;
        }
    }
    Ok(())
}

pub(crate) fn all_to_all(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    counts: Option<AllToAllCounts>,
) -> Result<BufferPair> {
    let kind = if counts.is_some() {
        OpKind::AllToAllV
    } else {
        OpKind::AllToAll
    };
    let link = Link::collective(inner, ctx, kind);
    let args::AllToAll {
        pair:
            args::Pair {
                faults,
                desc,
                input,
                mut output,
                dtype,
                ..
            },
        counts,
    } = args::all_to_all(link.place(), input, output, counts);
    link.open(desc, faults)?;
    let outgoing = Outgoing::Packed {
        bytes: input.as_bytes(),
        offsets: block_offsets(&counts.send),
        counts: &counts.send,
    };
    exchange(
        &link,
        dtype,
        &outgoing,
        output.as_bytes_mut(),
        &counts.recv,
        &mut [],
    )?;
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}

/// The strided all-to-all ([`StridedBlocks`]): the plain all-to-all on the wire, the rows
/// read in place.
pub(crate) fn all_to_all_strided(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    blocks: StridedBlocks,
) -> Result<BufferPair> {
    let link = Link::collective(inner, ctx, OpKind::AllToAll);
    let args::AllToAll {
        pair:
            args::Pair {
                faults,
                desc,
                input,
                mut output,
                dtype,
                ..
            },
        counts,
    } = args::all_to_all_strided(link.place(), input, output, &blocks);
    link.open(desc, faults)?;
    let outgoing = Outgoing::Strided {
        bytes: input.as_bytes(),
        blocks: &blocks,
    };
    let segment = link.segment_bytes(dtype);
    inner.with_scratch(segment, |staging| {
        exchange(
            &link,
            dtype,
            &outgoing,
            output.as_bytes_mut(),
            &counts.recv,
            staging,
        )
    })?;
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}
