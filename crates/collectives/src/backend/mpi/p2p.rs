//! Point-to-point send and recv by tag. A message is two MPI messages with the same tag: a
//! 16-byte header (dtype code, then the element count as little-endian u64) and the payload.
//! MPI's non-overtaking rule (same source, tag and communicator) keeps each header with its
//! payload, and messages from one peer with one tag in send order.
//!
//! Sends are eager: the payload is copied and handed to MPI (`MPI_Isend`) and the runtime's
//! drain thread completes the request, so a send never waits for its receive to be posted —
//! a rank may send and then receive on one communicator, whose ops run on one thread.

use mpi::ffi;

use super::agree::c_rank;
use super::communicator::Inner;
use super::raw::{self, start_send, write_ptr};
use super::runtime::PendingSend;
use super::types::{movement_type, to_int};
use crate::buffer::{Buffer, HostBuffer};
use crate::dtype::DType;
use crate::engine::JobContext;
use crate::error::{Error, MpiQuantity, ProtocolViolation, Result};
use crate::op::{BufferRole, OpKind};

/// The header's length in bytes.
const HEADER_BYTES: usize = 16;

/// The checks every p2p op makes before touching MPI: the peer is in range and the tag fits.
fn check_peer_and_tag(inner: &Inner, op: OpKind, peer: usize, tag: u32) -> Result<i32> {
    if peer >= inner.size {
        return Err(Error::InvalidRank {
            op,
            rank: peer,
            size: inner.size,
        });
    }
    to_int(op, MpiQuantity::Tag, tag as usize)
}

fn host(op: OpKind, buffer: Buffer) -> Result<HostBuffer> {
    let location = buffer.location();
    buffer.into_host().map_err(|_| Error::UnsupportedBuffer {
        op,
        location,
        backend: super::ops::BACKEND,
    })
}

fn dtype_code(dtype: DType) -> u8 {
    // DType::ALL lists every dtype once; the index is the code.
    DType::ALL.iter().position(|d| *d == dtype).unwrap_or(0) as u8
}

pub(crate) fn send(
    inner: &Inner,
    _ctx: &JobContext,
    buffer: Buffer,
    peer: usize,
    tag: u32,
) -> Result<Buffer> {
    let op = OpKind::Send;
    let tag = check_peer_and_tag(inner, op, peer, tag)?;
    let host = host(op, buffer)?;
    let count = to_int(op, MpiQuantity::Count, host.len())?;
    let mut header = vec![0u8; HEADER_BYTES];
    header[0] = dtype_code(host.dtype());
    header[8..].copy_from_slice(&(host.len() as u64).to_le_bytes());
    let dest = c_rank(peer);
    let byte = movement_type(DType::U8);
    let header_count = HEADER_BYTES as i32;
    let request = start_send(&inner.comm, &header, byte, header_count, dest, tag)?;
    inner.runtime.track_send(PendingSend {
        request,
        bytes: header,
    });
    let payload = host.as_bytes().to_vec();
    let request = start_send(
        &inner.comm,
        &payload,
        movement_type(host.dtype()),
        count,
        dest,
        tag,
    )?;
    inner.runtime.track_send(PendingSend {
        request,
        bytes: payload,
    });
    Ok(Buffer::Host(host))
}

/// Receives the next message from `source` (rank, tag) into `into`, whose dtype and length
/// must be the message's.
fn receive(
    inner: &Inner,
    ctx: &JobContext,
    into: HostBuffer,
    source: (i32, i32),
) -> Result<HostBuffer> {
    let count = to_int(ctx.op, MpiQuantity::Count, into.len())?;
    let datatype = movement_type(into.dtype());
    let (peer, tag) = source;
    raw::run(ctx, &inner.comm, "MPI_Irecv", into, |into, call| {
        // SAFETY: `into` holds exactly `count` elements of `datatype`'s width and lives in
        // `keep` until the receive completes; MPI writes at most that many (else it reports
        // MPI_ERR_TRUNCATE).
        unsafe {
            ffi::MPI_Irecv(
                write_ptr(into.as_bytes_mut()),
                count,
                datatype,
                peer,
                tag,
                call.comm,
                call.request,
            )
        }
    })
}

pub(crate) fn recv(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    peer: usize,
    tag: u32,
) -> Result<Buffer> {
    let op = OpKind::Recv;
    let tag = check_peer_and_tag(inner, op, peer, tag)?;
    let host = host(op, buffer)?;
    let source = (c_rank(peer), tag);
    let header = receive(
        inner,
        ctx,
        HostBuffer::zeros(DType::U8, HEADER_BYTES),
        source,
    )?;
    let header = header.as_bytes();
    let code = header[0];
    let sent_dtype = *DType::ALL.get(usize::from(code)).ok_or(Error::Protocol {
        peer: Some(peer),
        violation: ProtocolViolation::BadDType { code },
    })?;
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&header[8..HEADER_BYTES]);
    let sent_len = usize::try_from(u64::from_le_bytes(len_bytes)).unwrap_or(usize::MAX);
    if sent_dtype == host.dtype() && sent_len == host.len() {
        // The message fits: receive straight into the caller's buffer.
        return Ok(Buffer::Host(receive(inner, ctx, host, source)?));
    }
    // Take the payload anyway, so the next message with this tag starts at its header.
    receive(inner, ctx, HostBuffer::zeros(sent_dtype, sent_len), source)?;
    if sent_dtype != host.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            role: BufferRole::Message,
            expected: host.dtype(),
            got: sent_dtype,
        });
    }
    Err(Error::LengthMismatch {
        op,
        role: BufferRole::Message,
        expected: host.len(),
        got: sent_len,
    })
}
