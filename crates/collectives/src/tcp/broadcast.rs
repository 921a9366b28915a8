//! Broadcast: phase 0, then the binomial [`tree`](super::tree) for small messages or the
//! pipelined chain for large ones (see [`BroadcastAlgorithm`]).
//!
//! The chain (this file): rank `root + i` receives each segment from `root + i - 1` and
//! forwards it to `root + i + 1` before taking the next, so segments stream down the chain
//! instead of the root sending the whole buffer `size - 1` times; once the pipe is full every
//! link carries data at once, which makes it the bandwidth-optimal choice for large buffers.

use super::communicator::Inner;
use super::config::BroadcastAlgorithm;
use super::link::Link;
use crate::args;
use crate::buffer::Buffer;
use crate::engine::JobContext;
use crate::error::Result;
use crate::op::OpKind;

pub(crate) fn broadcast(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    root: usize,
) -> Result<Buffer> {
    let kind = OpKind::Broadcast;
    let link = Link::collective(inner, ctx, kind);
    let (size, rank) = (link.size(), link.rank());
    let args::Single {
        faults,
        desc,
        mut host,
        ..
    } = args::broadcast(link.place(), buffer, root);
    let dtype = host.dtype();
    link.open(desc, faults)?;
    let tree = match inner.broadcast {
        BroadcastAlgorithm::Tree => true,
        BroadcastAlgorithm::Chain => false,
        BroadcastAlgorithm::Auto => host.byte_len() <= inner.tree_broadcast_bytes,
    };
    if tree {
        super::tree::broadcast(&link, dtype, host.as_bytes_mut(), root)?;
        return Ok(Buffer::Host(host));
    }
    // This rank's place in the chain, counted from the root.
    let position = (rank + size - root) % size;
    let next = (position + 1 < size).then(|| link.right(1));
    if position == 0 {
        if let Some(next) = next {
            link.send_data(next, dtype, 0, host.as_bytes())?;
        }
        return Ok(Buffer::Host(host));
    }
    let previous = link.left(1);
    link.recv_copy(
        previous,
        dtype,
        0,
        host.as_bytes_mut(),
        |arrived| match next {
            Some(next) => link.send_data(next, dtype, 0, arrived),
            None => Ok(()),
        },
    )?;
    Ok(Buffer::Host(host))
}
