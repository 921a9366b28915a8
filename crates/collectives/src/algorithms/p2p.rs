//! Point-to-point send and recv by tag. A message is filed under (group, tag) as
//! [`FrameKind::Message`] frames: first an 8-byte frame with the element count, then the
//! data in segments. Messages from one peer with one tag are received in the order they were
//! sent (the mailbox queues frames in arrival order). Sends are eager: they complete once the
//! kernel has the bytes, whether or not the receiver has posted its recv.

use super::link::Link;
use crate::algorithms::group::Inner;
use crate::buffer::Buffer;
use crate::engine::JobContext;
use crate::error::{Error, Result};
use crate::op::{BufferRole, OpKind};
use crate::transport::tcp::frame::FrameKind;

fn check_peer(op: OpKind, peer: usize, size: usize) -> Result<()> {
    if peer >= size {
        return Err(Error::InvalidRank {
            op,
            rank: peer,
            size,
        });
    }
    Ok(())
}

pub(crate) fn send(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    peer: usize,
    tag: u32,
) -> Result<Buffer> {
    let op = OpKind::Send;
    let link = Link::p2p(inner, ctx, op);
    check_peer(op, peer, link.size())?;
    ctx.check(Some(peer))?;
    let location = buffer.location();
    let host = buffer.into_host().map_err(|_| Error::UnsupportedBuffer {
        op,
        location,
        backend: crate::algorithms::group::BACKEND,
    })?;
    let dtype = host.dtype();
    let count = (host.len() as u64).to_le_bytes();
    link.send_frame(peer, FrameKind::Message, dtype, tag, &count)?;
    for segment in host.as_bytes().chunks(link.segment_bytes(dtype)) {
        link.send_frame(peer, FrameKind::Message, dtype, tag, segment)?;
    }
    Ok(Buffer::Host(host))
}

pub(crate) fn recv(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    peer: usize,
    tag: u32,
) -> Result<Buffer> {
    let op = OpKind::Recv;
    let link = Link::p2p(inner, ctx, op);
    check_peer(op, peer, link.size())?;
    let location = buffer.location();
    let mut host = buffer.into_host().map_err(|_| Error::UnsupportedBuffer {
        op,
        location,
        backend: crate::algorithms::group::BACKEND,
    })?;
    let first = link.recv_frame(peer, FrameKind::Message, tag)?;
    let mut count = [0u8; 8];
    if first.payload.len() != count.len() {
        return Err(Error::Protocol {
            peer: Some(peer),
            violation: crate::error::ProtocolViolation::PayloadLengthMismatch {
                declared: count.len() as u64,
                actual: first.payload.len() as u64,
            },
        });
    }
    count.copy_from_slice(&first.payload);
    let sent_dtype = first.header.dtype;
    let sent_len = usize::try_from(u64::from_le_bytes(count)).unwrap_or(usize::MAX);
    // Take every segment of the message, even one that does not fit, so the next message
    // with this tag starts at its own first frame.
    let sent_bytes = sent_len.saturating_mul(sent_dtype.size_bytes());
    let fits = sent_dtype == host.dtype() && sent_len == host.len();
    let mut at = 0;
    while at < sent_bytes {
        let frame = link.recv_frame(peer, FrameKind::Message, tag)?;
        let len = frame.payload.len();
        let missing = sent_bytes - at;
        if len == 0 || len > missing {
            return Err(Error::Protocol {
                peer: Some(peer),
                violation: crate::error::ProtocolViolation::PayloadLengthMismatch {
                    declared: missing as u64,
                    actual: len as u64,
                },
            });
        }
        if fits {
            host.as_bytes_mut()[at..at + len].copy_from_slice(&frame.payload);
        }
        at += len;
    }
    if sent_dtype != host.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            role: BufferRole::Message,
            expected: host.dtype(),
            got: sent_dtype,
        });
    }
    if sent_len != host.len() {
        return Err(Error::LengthMismatch {
            op,
            role: BufferRole::Message,
            expected: host.len(),
            got: sent_len,
        });
    }
    Ok(Buffer::Host(host))
}
