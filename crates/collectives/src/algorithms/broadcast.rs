//! Broadcast: phase 0, then the binomial [`tree`](super::tree) for small messages or the
//! pipelined chain for large ones (see [`BroadcastAlgorithm`]).
//!
//! The chain (this file): rank `root + i` receives each segment from `root + i - 1` and
//! forwards it to `root + i + 1` before taking the next, so segments stream down the chain
//! instead of the root sending the whole buffer `size - 1` times; once the pipe is full every
//! link carries data at once, which makes it the bandwidth-optimal choice for large buffers.
//!
//! Under either algorithm the root sends the first [`EAGER_BROADCAST_BYTES`] to its first hops
//! over TCP while phase 0 is still in flight (as the small all-reduce does), so the wire is
//! not idle for the descriptor round trip; docs/bench-collectives.md (the 07:06 sitting) has
//! the measurement.

use super::link::Link;
use crate::agree::args;
use crate::algorithms::group::Inner;
use crate::buffer::Buffer;
use crate::engine::JobContext;
use crate::error::Result;
use crate::op::OpKind;
use crate::transport::tcp::config::BroadcastAlgorithm;

/// How many leading bytes the root of a broadcast sends to its first hops before the peers'
/// descriptors are read (over TCP only; at most one segment). They hide the one-way latency
/// of phase 0 (tens of microseconds on loopback, i.e. about 100 KiB at the measured 2.5-3
/// GB/s). A receiver that fails validation never reads them: they stay filed under the failed
/// op's seq in its mailbox, at most this much per failed op.
pub(crate) const EAGER_BROADCAST_BYTES: usize = 128 * 1024;

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
    let tree = match inner.broadcast {
        BroadcastAlgorithm::Tree => true,
        BroadcastAlgorithm::Chain => false,
        BroadcastAlgorithm::Auto => host.byte_len() <= inner.tree_broadcast_bytes,
    };
    // This rank's place in the chain, counted from the root (0 for the root of either
    // algorithm; `root` may be out of range here, and then the op fails in phase 0).
    let position = (rank + size - root % size.max(1)) % size.max(1);
    let next = (position + 1 < size).then(|| link.right(1));
    // The root's first hops: its tree children, or the next rank of the chain.
    let hops = match (position, tree) {
        (0, true) => super::tree::children_of_root(size, root),
        (0, false) => next.into_iter().collect(),
        _ => Vec::new(),
    };
    let eager = eager_len(
        host.byte_len(),
        link.segment_bytes(dtype),
        dtype.size_bytes(),
    );
    // How many leading bytes each first hop already got (a peer reached through shared
    // memory gets nothing eagerly: `send_parts` sends only over TCP).
    let mut sent = vec![0; hops.len()];
    link.open_eager(desc, faults, || {
        if eager == 0 {
            return Ok(());
        }
        let prefix = &host.as_bytes()[..eager];
        for (&hop, sent) in hops.iter().zip(sent.iter_mut()) {
            if link.send_parts(hop, dtype, 0, &[prefix])? {
                *sent = eager;
            }
        }
        Ok(())
    })?;
    if tree {
        super::tree::broadcast(&link, dtype, host.as_bytes_mut(), root, &sent)?;
        return Ok(Buffer::Host(host));
    }
    if position == 0 {
        if let (Some(next), Some(&sent)) = (next, sent.first()) {
            link.send_data(next, dtype, 0, &host.as_bytes()[sent..])?;
        }
        return Ok(Buffer::Host(host));
    }
    let previous = link.left(1);
    match next {
        Some(next) => link.recv_copy(previous, dtype, 0, host.as_bytes_mut(), |arrived| {
            link.send_data(next, dtype, 0, arrived)
        })?,
        // The end of the chain forwards nothing, so it sleeps until the whole buffer is in.
        None => link.recv_into(previous, dtype, 0, host.as_bytes_mut())?,
    }
    Ok(Buffer::Host(host))
}

/// The eager prefix of a `len`-byte broadcast: [`EAGER_BROADCAST_BYTES`], at most one segment
/// (a frame may not be longer) and at most the buffer, in whole elements of `element` bytes.
fn eager_len(len: usize, segment: usize, element: usize) -> usize {
    let cap = EAGER_BROADCAST_BYTES.min(segment).min(len);
    cap / element.max(1) * element.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_eager_prefix_is_whole_elements_within_a_segment_and_the_buffer() {
        assert_eq!(eager_len(1 << 20, 1 << 20, 4), EAGER_BROADCAST_BYTES);
        assert_eq!(eager_len(1000, 1 << 20, 4), 1000);
        assert_eq!(eager_len(1002, 1 << 20, 4), 1000);
        assert_eq!(eager_len(1 << 20, 4096, 8), 4096);
        assert_eq!(eager_len(1 << 20, 4100, 8), 4096);
        assert_eq!(eager_len(3, 1 << 20, 4), 0);
        assert_eq!(eager_len(0, 1 << 20, 4), 0);
    }
}
