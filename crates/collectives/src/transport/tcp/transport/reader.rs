//! The reader thread of one peer: reads each frame header, validates it, and files the
//! payload into the mailbox or straight into a posted buffer.

use super::*;

/// What a reader thread knows about its connection: the peer, the payload cap, and whether
/// frames carry checksums.
#[derive(Clone, Copy, Debug)]
pub(super) struct ReadLimits {
    pub(super) peer: usize,
    pub(super) max_payload: u64,
    pub(super) checksum: bool,
}

/// How reading a frame's payload (and, with checksums, its trailer) ended.
enum PayloadRead {
    /// Every byte arrived and, with checksums, the trailer matched.
    Whole,
    /// The connection failed mid-frame.
    Closed,
    /// The trailer did not match what arrived.
    Corrupt(ProtocolViolation),
}

/// Reads `dst.len()` bytes; with a running checksum (`crc`), a staging chunk at a time, each
/// folded into the checksum right after it lands (while it is still in cache).
fn read_summed(stream: &mut TcpStream, dst: &mut [u8], crc: &mut Option<u32>) -> bool {
    match crc {
        None => stream.read_exact(dst).is_ok(),
        Some(running) => {
            for chunk in dst.chunks_mut(STAGING_BYTES) {
                if stream.read_exact(chunk).is_err() {
                    return false;
                }
                *running = crc32c::crc32c_append(*running, chunk);
            }
            true
        }
    }
}

/// With checksums (`crc` is the running CRC32C of header and payload), reads the frame's
/// trailer and compares; without, there is nothing to read.
fn read_trailer(
    stream: &mut TcpStream,
    header: &FrameHeader,
    crc: Option<u32>,
    peer: usize,
) -> PayloadRead {
    let Some(computed) = crc else {
        return PayloadRead::Whole;
    };
    let mut word = [0u8; FRAME_CHECKSUM_BYTES];
    if stream.read_exact(&mut word).is_err() {
        return PayloadRead::Closed;
    }
    match check_trailer(header, u32::from_le_bytes(word), computed, peer) {
        Ok(()) => PayloadRead::Whole,
        Err(Error::Protocol { violation, .. }) => PayloadRead::Corrupt(violation),
        Err(_) => PayloadRead::Closed,
    }
}

/// What [`read_into_posted`] did with a frame's payload.
enum DirectRead {
    /// Read into a posted destination.
    Done,
    /// The connection failed mid-payload, or the frame failed its checksum.
    Failed(LossCause),
    /// Nobody posted a destination that fits: read it into the mailbox as usual.
    NotPosted,
}

/// Reads the payload of `header` straight into the destination a waiter posted for its key,
/// if there is one that fits it exactly as [`Link::recv_data`](crate::algorithms::link::Link) would accept
/// it (same dtype, whole elements, within what is still missing) and no earlier frame for the
/// key is still queued in the mailbox (frames must land in order). Anything else goes to the
/// mailbox, where the waiter finds and judges it. With checksums (`crc` is the header's
/// CRC32C) the payload only counts as filled once the trailer matched.
fn read_into_posted(
    stream: &mut TcpStream,
    peer: usize,
    header: &FrameHeader,
    len: usize,
    shared: &Shared,
    staging: &mut Staging,
    mut crc: Option<u32>,
) -> DirectRead {
    let slot = (peer, MailboxKey::of(header));
    let target = {
        let mut state = shared.lock();
        let queued = state.mailbox.contains_key(&slot);
        match state.posted.get_mut(&slot) {
            Some(post)
                if !queued
                    && !post.writing
                    && post.dtype == header.dtype
                    && len > 0
                    && len.is_multiple_of(header.dtype.size_bytes())
                    && len <= post.len - post.filled =>
            {
                post.writing = true;
                Some((post.base, post.filled, post.reduce, post.own))
            }
            _ => None,
        }
    };
    let Some((base, offset, reduce, own)) = target else {
        return DirectRead::NotPosted;
    };
    // SAFETY: the waiter posted `len` bytes at `base` and keeps them borrowed exclusively
    // until its post is gone and `writing` is clear (see `PostedRecv`); `offset + len` is
    // within them (checked above under the lock), and only this thread, the one reader of
    // `peer`, touches them while `writing` is set.
    let dst = unsafe { std::slice::from_raw_parts_mut(base.0.add(offset), len) };
    // SAFETY: a post with `own` lends `len` readable bytes there (shared) for as long as it
    // is posted, and nobody writes them meanwhile; `offset + len` is within them, as above.
    let own = own.map(|own| unsafe { std::slice::from_raw_parts(own.0.add(offset), len) });
    let read = match reduce {
        None => read_summed(stream, dst, &mut crc),
        Some(plan) => read_and_combine(stream, &plan, dst, own, staging, &mut crc),
    };
    let outcome = if read {
        read_trailer(stream, header, crc, peer)
    } else {
        PayloadRead::Closed
    };
    let whole = matches!(outcome, PayloadRead::Whole);
    let wake = {
        let mut state = shared.lock();
        match state.posted.get_mut(&slot) {
            Some(post) => {
                post.writing = false;
                if whole {
                    post.filled += len;
                }
                post.wake_each || !whole || post.filled == post.len
            }
            None => true,
        }
    };
    if wake {
        shared.arrived.notify_all();
    }
    match outcome {
        PayloadRead::Whole => DirectRead::Done,
        PayloadRead::Closed => DirectRead::Failed(LossCause::Closed),
        PayloadRead::Corrupt(violation) => DirectRead::Failed(LossCause::Protocol(violation)),
    }
}

/// Reads `dst.len()` bytes from `stream` a staging buffer at a time and combines each piece
/// into `dst` (`dst ⊕= piece`, or `dst = own ⊕ piece` when `own` is given, of `dst`'s
/// length), folding each piece into the running checksum `crc` (when there is one) before it
/// is combined. Returns whether every byte arrived (the combine itself cannot fail: `dst` is
/// whole elements, checked by the caller, and the staging size is a multiple of 8).
fn read_and_combine(
    stream: &mut TcpStream,
    plan: &ReducePlan,
    dst: &mut [u8],
    own: Option<&[u8]>,
    staging: &mut Staging,
    crc: &mut Option<u32>,
) -> bool {
    for (index, acc) in dst.chunks_mut(STAGING_BYTES).enumerate() {
        let incoming = staging.bytes(acc.len());
        if stream.read_exact(incoming).is_err() {
            return false;
        }
        if let Some(running) = crc {
            *running = crc32c::crc32c_append(*running, incoming);
        }
        let combined = match own {
            None => plan.combine(acc, incoming),
            Some(own) => {
                let start = index * STAGING_BYTES;
                let end = start + acc.len();
                match own.get(start..end) {
                    Some(own) => plan.combine_from(acc, own, incoming),
                    None => return false,
                }
            }
        };
        if combined.is_err() {
            return false;
        }
    }
    true
}

/// Reads one frame header from `stream` and, with checksums, its CRC32C word, which is
/// checked before the header is decoded. `Ok(None)`: the connection ended.
fn read_header(
    stream: &mut TcpStream,
    limits: ReadLimits,
) -> std::result::Result<Option<(FrameHeader, Option<u32>)>, Error> {
    // One read for header and word together: the word is part of the header on the wire.
    let mut bytes = [0u8; FRAME_HEADER_BYTES + FRAME_CHECKSUM_BYTES];
    let wire = if limits.checksum {
        &mut bytes[..]
    } else {
        &mut bytes[..FRAME_HEADER_BYTES]
    };
    if stream.read_exact(wire).is_err() {
        return Ok(None);
    }
    let mut header_bytes = [0u8; FRAME_HEADER_BYTES];
    header_bytes.copy_from_slice(&bytes[..FRAME_HEADER_BYTES]);
    let crc = if limits.checksum {
        let mut word = [0u8; FRAME_CHECKSUM_BYTES];
        word.copy_from_slice(&bytes[FRAME_HEADER_BYTES..]);
        Some(check_header(
            &header_bytes,
            u32::from_le_bytes(word),
            limits.peer,
        )?)
    } else {
        None
    };
    let header = FrameHeader::decode(&header_bytes, limits.peer, limits.max_payload)?;
    Ok(Some((header, crc)))
}

/// The body of a reader thread: files frames from `limits.peer` until the connection ends.
pub(super) fn read_frames(mut stream: TcpStream, limits: ReadLimits, shared: &Shared) {
    let peer = limits.peer;
    let mut staging = Staging::new();
    // A frame that breaks the protocol (a bad header, a failed checksum) ends the connection:
    // after it the stream position, or the peer, cannot be trusted. So does a payload that
    // cannot be allocated: it is left unread, mid-stream.
    let fail = |stream: &TcpStream, cause: LossCause| {
        if !matches!(cause, LossCause::Closed) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        shared.mark_lost(peer, cause);
    };
    loop {
        let (header, mut crc) = match read_header(&mut stream, limits) {
            Ok(Some(read)) => read,
            Ok(None) => return fail(&stream, LossCause::Closed),
            Err(error) => {
                let cause = match error {
                    Error::Protocol { violation, .. } => LossCause::Protocol(violation),
                    _ => LossCause::Closed,
                };
                return fail(&stream, cause);
            }
        };
        // invariant: decode checked payload_bytes <= max_payload, which the caller chose as an
        // allocatable size, so it fits in usize on every supported target.
        let len = usize::try_from(header.payload_bytes).unwrap_or(usize::MAX);
        match read_into_posted(&mut stream, peer, &header, len, shared, &mut staging, crc) {
            DirectRead::Done => continue,
            DirectRead::Failed(cause) => return fail(&stream, cause),
            DirectRead::NotPosted => {}
        }
        let mut payload = match shared.payload_buffer(len) {
            Ok(payload) => payload,
            Err(cause) => return fail(&stream, cause),
        };
        let outcome = if read_summed(&mut stream, &mut payload, &mut crc) {
            read_trailer(&mut stream, &header, crc, peer)
        } else {
            PayloadRead::Closed
        };
        match outcome {
            PayloadRead::Whole => shared.deliver(peer, Frame { header, payload }),
            // A frame cut short, or one whose bytes are not what was sent, is never
            // delivered: waiters see the peer as lost (or its violation) instead.
            PayloadRead::Closed => {
                shared.recycle(payload);
                return fail(&stream, LossCause::Closed);
            }
            PayloadRead::Corrupt(violation) => {
                shared.recycle(payload);
                return fail(&stream, LossCause::Protocol(violation));
            }
        }
    }
}
