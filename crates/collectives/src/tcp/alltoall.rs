//! All-to-all (and its `_v` form) by pairwise exchange: in step `s` every rank sends its
//! block for rank `+s` and receives the block of rank `-s`, so each step is a permutation
//! and no rank is flooded by all peers at once.

use super::communicator::Inner;
use super::link::Link;
use crate::args;
use crate::buffer::Buffer;
use crate::engine::JobContext;
use crate::error::Result;
use crate::local::ops::{copy_into, elements};
use crate::op::{AllToAllCounts, BufferPair, OpKind, block_offsets};

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
    let (size, rank) = (link.size(), link.rank());
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
    let send_offsets = block_offsets(&counts.send);
    let recv_offsets = block_offsets(&counts.recv);
    let own = elements(
        kind,
        input.as_bytes(),
        dtype,
        send_offsets[rank],
        counts.send[rank],
    )?;
    copy_into(kind, &mut output, recv_offsets[rank], own)?;
    let elem = dtype.size_bytes();
    for step in 1..size {
        let (to, from) = (link.right(step), link.left(step));
        let block = elements(
            kind,
            input.as_bytes(),
            dtype,
            send_offsets[to],
            counts.send[to],
        )?;
        link.send_data(to, dtype, 0, block)?;
        let range = recv_offsets[from] * elem..(recv_offsets[from] + counts.recv[from]) * elem;
        link.recv_data(
            from,
            dtype,
            0,
            &mut output.as_bytes_mut()[range],
            |dst, src| {
                dst.copy_from_slice(src);
                Ok(())
            },
        )?;
    }
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}
