//! [`Transport`]: framed messages over the mesh, with one reader thread per peer that files
//! every incoming frame into a mailbox, and eager sends.
//!
//! The reader thread of peer `p` reads a [`FrameHeader`] (validated by
//! [`FrameHeader::decode`] against the payload cap before anything is allocated), then exactly
//! `payload_bytes` bytes, and files the frame under ([`MailboxKey`], `p`). A waiter blocks on
//! a [`Condvar`] until its frame is there, the peer is lost, the transport is aborted or its
//! deadline passes. Sends write the whole frame under the peer's writer lock and never wait
//! for the receiver to ask for it: the kernel buffers and the remote reader thread drain the
//! socket, so two ranks that both send before receiving cannot deadlock.
//!
//! With frame checksums on (agreed by the mesh handshake, [`Mesh::frame_checksum`]), each
//! frame also carries the CRC32C of its header right after it and the CRC32C of header and
//! payload after the payload (the layout of [`encode_frame`](super::frame::encode_frame)).
//! The reader checks the header's word before decoding the header, and folds the payload into
//! the running CRC as it lands (a staging chunk at a time, while it is still in cache), then
//! checks the trailer before the frame counts as received: a mismatch is delivered to this
//! rank's waiters as [`ProtocolViolation::ChecksumFailed`] and costs the sender its
//! connection, like any other protocol violation. A payload read straight into a posted
//! buffer (or combined into it) is never counted as filled when its trailer fails; the op
//! fails, so what the buffer holds then is unspecified, as after any failed op.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::frame::{
    FRAME_CHECKSUM_BYTES, FRAME_HEADER_BYTES, FrameHeader, check_header, check_trailer,
    header_checksum, payload_alloc_error,
};
use super::mesh::Mesh;
use crate::error::{Error, IoAction, ProtocolViolation, Result};
use crate::frame_key::FrameKey;
use crate::op::OpKind;
use crate::reduce::ReducePlan;

/// Where a frame is filed: the key of its header.
pub(crate) type MailboxKey = FrameKey;

impl FrameKey {
    /// The key a frame with this header is filed under.
    pub(crate) fn of(header: &FrameHeader) -> FrameKey {
        FrameKey {
            group: header.group,
            seq: header.seq,
            tag: header.tag,
            kind: header.kind,
        }
    }
}

/// One received frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// The validated header.
    pub header: FrameHeader,
    /// Exactly `header.payload_bytes` bytes.
    pub payload: Vec<u8>,
}

/// The op a wait belongs to and when it must give up.
#[derive(Clone, Copy, Debug)]
pub struct WaitBudget {
    /// The op, named by the errors.
    pub op: OpKind,
    /// The op's timeout, reported by [`Error::Timeout`].
    pub timeout: Duration,
    /// When the wait gives up.
    pub deadline: Instant,
}

impl WaitBudget {
    /// A budget of `timeout` from now.
    #[cfg(test)]
    pub fn from_now(op: OpKind, timeout: Duration) -> WaitBudget {
        WaitBudget {
            op,
            timeout,
            deadline: Instant::now() + timeout,
        }
    }
}

/// Why a peer can no longer deliver frames.
#[derive(Clone, Debug)]
enum LossCause {
    /// The connection closed or failed.
    Closed,
    /// The peer sent something that is not a valid frame.
    Protocol(ProtocolViolation),
    /// The payload the peer announced could not be allocated.
    OutOfMemory { bytes: u64 },
}

#[derive(Debug, Default)]
pub(crate) struct State {
    pub(super) mailbox: HashMap<(usize, MailboxKey), VecDeque<Frame>>,
    /// Destinations lent to the reader threads by [`PostedRecv`](super::posted::PostedRecv):
    /// frames for these keys are read straight into the waiter's buffer.
    pub(super) posted: HashMap<(usize, MailboxKey), Posted>,
    lost: HashMap<usize, LossCause>,
    aborted: bool,
}

/// The start of a buffer lent by a waiter to a reader thread.
#[derive(Debug, Clone, Copy)]
pub(super) struct Destination(pub(super) *mut u8);

// SAFETY: the pointer is only dereferenced by the reader thread for a range that the posting
// waiter guarantees stays valid and unaliased while it is posted (see `PostedRecv`); moving
// the address between threads is harmless in itself.
unsafe impl Send for Destination {}

/// The start of a contribution lent (shared) by a waiter to a reader thread, which combines
/// each payload with it (`dst = own ⊕ payload`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Source(pub(super) *const u8);

// SAFETY: the pointer is only read by the reader thread, for a range that the posting waiter
// keeps borrowed (shared, so nobody writes it) while it is posted (see `PostedRecv`).
unsafe impl Send for Source {}

/// A posted destination: `len` bytes at `base`, the first `filled` already written.
#[derive(Debug)]
pub(super) struct Posted {
    pub(super) base: Destination,
    pub(super) len: usize,
    pub(super) filled: usize,
    pub(super) dtype: crate::dtype::DType,
    /// `None`: payloads are copied into the destination. `Some(plan)`: each payload is
    /// combined into it (`dst = dst ⊕ payload`) by the reader thread, straight from a small
    /// cache-resident staging buffer, so a reducing step needs no mailbox buffer, no wake-up
    /// of the op thread per segment and no second pass over cold memory.
    pub(super) reduce: Option<ReducePlan>,
    /// With `reduce`: the contribution to combine each payload with (`len` bytes), instead of
    /// the destination's own bytes.
    pub(super) own: Option<Source>,
    /// Set while a reader thread writes into `base[filled..]` outside the lock; the waiter
    /// never gives its buffer back while this is set.
    pub(super) writing: bool,
    /// Whether the reader wakes the waiter after every segment (it hands each range to a
    /// `progress` callback, e.g. to forward it); when clear, only once the post is full or a
    /// read failed.
    pub(super) wake_each: bool,
}

/// The bytes a reducing reader reads from the socket at a time before combining them: small
/// enough that the staging buffer stays in L2 between the kernel's copy and the combine.
pub(super) const STAGING_BYTES: usize = 256 * 1024;

/// A reader thread's staging buffer for reducing posts, 8-byte aligned so that every dtype's
/// elements can be viewed in place.
pub(super) struct Staging(Vec<u64>);

impl Staging {
    pub(super) fn new() -> Staging {
        Staging(Vec::new())
    }

    /// The first `len` bytes (at most [`STAGING_BYTES`]), allocated on first use.
    pub(super) fn bytes(&mut self, len: usize) -> &mut [u8] {
        if self.0.is_empty() {
            self.0 = vec![0u64; STAGING_BYTES / 8];
        }
        &mut bytemuck::cast_slice_mut(&mut self.0)[..len.min(STAGING_BYTES)]
    }
}

/// How many spent payload buffers the transport keeps for reuse: enough for 64 segments in
/// flight (64 MiB at the default segment size), the most a large ring step queues up.
const POOLED_PAYLOADS: usize = 64;

#[derive(Debug, Default)]
pub(crate) struct Shared {
    state: Mutex<State>,
    pub(super) arrived: Condvar,
    /// Spent payload buffers, reused by the reader threads so that a stream of large
    /// segments does not allocate (and fault in) fresh memory for every frame.
    pool: Mutex<Vec<Vec<u8>>>,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a thread panicked while holding it; the maps stay
        // consistent (every update is a single insert), so the state is still usable.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn deliver(&self, peer: usize, frame: Frame) {
        self.lock()
            .mailbox
            .entry((peer, MailboxKey::of(&frame.header)))
            .or_default()
            .push_back(frame);
        self.arrived.notify_all();
    }

    /// A buffer of exactly `len` bytes, reused from the pool when one is there. Its contents
    /// are about to be overwritten by `read_exact`, so stale bytes do not matter. `len` comes
    /// from a peer's header (below the frame cap): an allocator that cannot provide it is a
    /// [`LossCause::OutOfMemory`], not an abort.
    fn payload_buffer(&self, len: usize) -> std::result::Result<Vec<u8>, LossCause> {
        let reused = self
            .pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop();
        let mut buffer = reused.unwrap_or_default();
        buffer
            .try_reserve_exact(len.saturating_sub(buffer.len()))
            .map_err(|_| LossCause::OutOfMemory { bytes: len as u64 })?;
        // Growing writes zeros only past the old length; pooled buffers usually already have
        // the segment size, so this is free in the steady state.
        buffer.resize(len, 0);
        Ok(buffer)
    }

    pub(super) fn recycle(&self, buffer: Vec<u8>) {
        let mut pool = self
            .pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if pool.len() < POOLED_PAYLOADS && buffer.capacity() > 0 {
            pool.push(buffer);
        }
    }

    fn mark_lost(&self, peer: usize, cause: LossCause) {
        self.lock().lost.entry(peer).or_insert(cause);
        self.arrived.notify_all();
    }
}

/// Framed, mailbox-delivered messaging over a [`Mesh`]. Dropping it shuts every socket down
/// (peers then see this rank as lost) and joins the reader threads.
#[derive(Debug)]
pub struct Transport {
    max_payload: u64,
    /// Whether frames to and from peers carry CRC32C checksums.
    checksum: bool,
    writers: Vec<Option<Mutex<TcpStream>>>,
    pub(crate) shared: Arc<Shared>,
    readers: Vec<JoinHandle<()>>,
}

fn io_error(action: IoAction, peer: usize) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io {
        action,
        peer: Some(peer),
        source,
    }
}

impl Transport {
    /// Starts one reader thread per peer of `mesh`. Frames whose payload exceeds
    /// `max_payload` bytes are protocol violations and cost the sender its connection. Frames
    /// carry CRC32C checksums when the mesh agreed on them ([`Mesh::frame_checksum`]).
    pub fn start(mesh: Mesh, max_payload: u64) -> Result<Transport> {
        let rank = mesh.rank();
        let checksum = mesh.frame_checksum();
        Transport::from_streams(rank, mesh.into_peers(), max_payload, checksum)
    }

    /// Starts a transport over already-connected streams (`streams[p]` leads to rank `p`,
    /// `None` for `rank` itself), with frame checksums when `checksum` (both ends of every
    /// stream must agree).
    pub(crate) fn from_streams(
        rank: usize,
        streams: Vec<Option<TcpStream>>,
        max_payload: u64,
        checksum: bool,
    ) -> Result<Transport> {
        let shared = Arc::new(Shared::default());
        let mut writers = Vec::with_capacity(streams.len());
        let mut readers = Vec::new();
        let mut transport_streams = Vec::new();
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                writers.push(None);
                continue;
            };
            let reader = stream
                .try_clone()
                .map_err(io_error(IoAction::SocketOption, peer))?;
            transport_streams.push((peer, reader));
            writers.push(Some(Mutex::new(stream)));
        }
        let mut transport = Transport {
            max_payload,
            checksum,
            writers,
            shared: Arc::clone(&shared),
            readers: Vec::new(),
        };
        for (peer, reader) in transport_streams {
            let shared = Arc::clone(&shared);
            let spawned = thread::Builder::new()
                .name(format!("hypershard-tcp-rx-{rank}-from-{peer}"))
                .spawn(move || {
                    let limits = ReadLimits {
                        peer,
                        max_payload,
                        checksum,
                    };
                    read_frames(reader, limits, &shared)
                });
            match spawned {
                Ok(handle) => readers.push(handle),
                Err(source) => {
                    // The transport's drop shuts the sockets and joins the readers started so far.
                    transport.readers = readers;
                    return Err(Error::SpawnFailed {
                        group: format!("tcp-rx-{rank}-from-{peer}"),
                        source,
                    });
                }
            }
        }
        transport.readers = readers;
        Ok(transport)
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.writers.len()
    }

    /// Whether frames to and from peers carry CRC32C checksums.
    #[cfg(test)]
    pub fn frame_checksum(&self) -> bool {
        self.checksum
    }

    fn check_peer(&self, op: OpKind, peer: usize) -> Result<()> {
        if peer >= self.world_size() {
            return Err(Error::InvalidRank {
                op,
                rank: peer,
                size: self.world_size(),
            });
        }
        Ok(())
    }

    /// Sends one frame to `peer` without waiting for it to be received. A frame to this rank
    /// itself goes straight into the mailbox. `header.payload_bytes` must equal
    /// `payload.len()` and stay within the cap, so the receiver never sees a frame it refuses.
    pub fn send(&self, op: OpKind, peer: usize, header: FrameHeader, payload: &[u8]) -> Result<()> {
        self.send_parts(op, peer, header, &[payload])
    }

    /// [`Transport::send`] of a payload given as consecutive `parts` (their concatenation is
    /// the payload), written together with the header in vectored writes, so a payload that
    /// lies in pieces (rows of a strided block) is never copied together first.
    pub(crate) fn send_parts(
        &self,
        op: OpKind,
        peer: usize,
        header: FrameHeader,
        parts: &[&[u8]],
    ) -> Result<()> {
        self.check_peer(op, peer)?;
        let len = parts.iter().map(|part| part.len() as u64).sum::<u64>();
        if header.payload_bytes != len {
            return Err(Error::Protocol {
                peer: Some(peer),
                violation: ProtocolViolation::PayloadLengthMismatch {
                    declared: header.payload_bytes,
                    actual: len,
                },
            });
        }
        if len > self.max_payload {
            return Err(Error::Protocol {
                peer: Some(peer),
                violation: ProtocolViolation::FrameTooLarge {
                    limit: self.max_payload,
                    got: len,
                },
            });
        }
        if self.shared.lock().aborted {
            return Err(Error::Aborted { op });
        }
        let Some(writer) = &self.writers[peer] else {
            self.shared.deliver(
                peer,
                Frame {
                    header,
                    payload: parts.concat(),
                },
            );
            return Ok(());
        };
        if self.shared.lock().lost.contains_key(&peer) {
            return Err(Error::PeerLost { op, peer });
        }
        // Header and payload leave in one vectored write, so a small frame is one segment on
        // the wire (with TCP_NODELAY a separate header write would be its own packet). The
        // checksums are computed before the writer lock is taken.
        let encoded = header.encode();
        let words = self.checksum.then(|| {
            let head = header_checksum(&encoded);
            let tail = parts
                .iter()
                .fold(head, |crc, part| crc32c::crc32c_append(crc, part));
            (head.to_le_bytes(), tail.to_le_bytes())
        });
        let mut slices: Vec<&[u8]> = Vec::with_capacity(parts.len() + 3);
        slices.push(&encoded);
        if let Some((head, _)) = &words {
            slices.push(head);
        }
        slices.extend_from_slice(parts);
        if let Some((_, tail)) = &words {
            slices.push(tail);
        }
        let mut stream = writer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let written = write_all_vectored(&mut *stream, &slices);
        if written.is_err() {
            // A failed write leaves the stream mid-frame, so the connection is unusable.
            let _ = stream.shutdown(Shutdown::Both);
            self.shared.mark_lost(peer, LossCause::Closed);
            return Err(Error::PeerLost { op, peer });
        }
        Ok(())
    }

    /// Waits for the frame filed under `key` from `peer`. Frames that arrived before the peer
    /// was lost are still delivered; after that the wait fails with [`Error::PeerLost`] (or
    /// [`Error::Protocol`] when the peer broke the protocol), with [`Error::Aborted`] after
    /// [`Transport::abort`], and with [`Error::Timeout`] once `budget.deadline` passes.
    pub fn recv(&self, budget: &WaitBudget, peer: usize, key: MailboxKey) -> Result<Frame> {
        self.check_peer(budget.op, peer)?;
        let mut state = self.shared.lock();
        loop {
            if let Some(queue) = state.mailbox.get_mut(&(peer, key))
                && let Some(frame) = queue.pop_front()
            {
                if queue.is_empty() {
                    state.mailbox.remove(&(peer, key));
                }
                return Ok(frame);
            }
            if let Some(error) = wait_error(&state, budget, peer) {
                return Err(error);
            }
            let left = budget.deadline.saturating_duration_since(Instant::now());
            state = self
                .shared
                .arrived
                .wait_timeout(state, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Shuts the connection to `peer` down, so its reader thread stops (and the peer sees
    /// this rank as lost). Used when a wait gives up while that reader is writing into a
    /// posted buffer that must be handed back.
    pub(crate) fn shutdown_peer(&self, peer: usize) {
        if let Some(Some(writer)) = self.writers.get(peer) {
            let stream = writer
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // An already-closed socket has nothing left to shut.
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// Hands a received frame's payload back for reuse by the reader threads. Optional:
    /// a payload that is simply dropped is freed as usual.
    pub fn recycle(&self, payload: Vec<u8>) {
        self.shared.recycle(payload);
    }

    /// Whether `peer`'s connection is gone.
    #[cfg(test)]
    pub fn is_lost(&self, peer: usize) -> bool {
        self.shared.lock().lost.contains_key(&peer)
    }

    /// Fails every current and later wait and send with [`Error::Aborted`] and shuts the
    /// sockets down, so peers see this rank as lost instead of waiting out their deadline.
    pub fn abort(&self) {
        self.shared.lock().aborted = true;
        self.shared.arrived.notify_all();
        self.shutdown_sockets();
    }

    fn shutdown_sockets(&self) {
        for writer in self.writers.iter().flatten() {
            // Shutting down unblocks this rank's reader thread (its clone shares the socket)
            // and tells the peer's reader that this rank is gone; an already-closed socket
            // has nothing left to shut, so the error is of no interest.
            let stream = writer
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        self.shutdown_sockets();
        for reader in self.readers.drain(..) {
            // A reader that panicked has nothing left to clean up; drop must not panic.
            let _ = reader.join();
        }
    }
}

/// Writes every byte of `parts`, in order, with as few `writev` calls as the kernel allows.
fn write_all_vectored(stream: &mut impl Write, parts: &[&[u8]]) -> io::Result<()> {
    let mut slices: Vec<io::IoSlice<'_>> = parts
        .iter()
        .filter(|part| !part.is_empty())
        .map(|part| io::IoSlice::new(part))
        .collect();
    let mut remaining: &mut [io::IoSlice<'_>] = &mut slices;
    while !remaining.is_empty() {
        match stream.write_vectored(remaining) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(written) => io::IoSlice::advance_slices(&mut remaining, written),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Why a wait for `peer` must end now, if it must: the transport was aborted, the peer is
/// lost (or broke the protocol), or the deadline passed.
pub(crate) fn wait_error(state: &State, budget: &WaitBudget, peer: usize) -> Option<Error> {
    if state.aborted {
        return Some(Error::Aborted { op: budget.op });
    }
    if let Some(cause) = state.lost.get(&peer) {
        return Some(match cause {
            LossCause::Closed => Error::PeerLost {
                op: budget.op,
                peer,
            },
            LossCause::Protocol(violation) => Error::Protocol {
                peer: Some(peer),
                violation: violation.clone(),
            },
            LossCause::OutOfMemory { bytes } => payload_alloc_error(peer, *bytes),
        });
    }
    if Instant::now() >= budget.deadline {
        return Some(Error::Timeout {
            op: budget.op,
            after: budget.timeout,
            peer: Some(peer),
        });
    }
    None
}

/// What a reader thread knows about its connection: the peer, the payload cap, and whether
/// frames carry checksums.
#[derive(Clone, Copy, Debug)]
struct ReadLimits {
    peer: usize,
    max_payload: u64,
    checksum: bool,
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
fn read_frames(mut stream: TcpStream, limits: ReadLimits, shared: &Shared) {
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::FrameKind;
    use crate::dtype::DType;
    use std::net::TcpListener;

    #[test]
    fn a_payload_that_cannot_be_allocated_is_a_typed_error_naming_the_peer() {
        let shared = Shared {
            state: Mutex::default(),
            arrived: Condvar::new(),
            pool: Mutex::default(),
        };
        // A length no allocator provides (past isize::MAX), as a peer's header could claim
        // under a cap set that high: refused, not aborted on.
        let huge = usize::MAX / 2 + 1;
        match shared.payload_buffer(huge) {
            Err(LossCause::OutOfMemory { bytes }) => assert_eq!(bytes, huge as u64),
            other => panic!("{:?}", other.map(|b| b.len()).map_err(|_| "other cause")),
        }
        assert_eq!(shared.payload_buffer(24).unwrap(), vec![0u8; 24]);
        // Waiters on that peer see an I/O error that names it and the size.
        shared.mark_lost(3, LossCause::OutOfMemory { bytes: 1 << 62 });
        let budget = WaitBudget::from_now(OpKind::AllReduce, Duration::from_secs(1));
        match wait_error(&shared.lock(), &budget, 3) {
            Some(Error::Io {
                action: IoAction::Read,
                peer: Some(3),
                source,
            }) => {
                assert_eq!(source.kind(), io::ErrorKind::OutOfMemory);
                let text = source.to_string();
                assert!(text.contains(&(1u64 << 62).to_string()), "{text}");
                assert!(text.contains("rank 3"), "{text}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// Connected streams for a world of `n` ranks: `result[r][p]` leads from `r` to `p`.
    fn stream_mesh(n: usize) -> Vec<Vec<Option<TcpStream>>> {
        let mut mesh: Vec<Vec<Option<TcpStream>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let pairs = (0..n).flat_map(|a| ((a + 1)..n).map(move |b| (a, b)));
        for (a, b) in pairs {
            let outgoing = TcpStream::connect(addr).unwrap();
            let (incoming, _) = listener.accept().unwrap();
            mesh[a][b] = Some(outgoing);
            mesh[b][a] = Some(incoming);
        }
        mesh
    }

    pub(crate) fn transports(n: usize, max_payload: u64) -> Vec<Transport> {
        transports_with(n, max_payload, false)
    }

    /// [`transports`] with frame checksums on or off.
    pub(crate) fn transports_with(n: usize, max_payload: u64, checksum: bool) -> Vec<Transport> {
        stream_mesh(n)
            .into_iter()
            .enumerate()
            .map(|(rank, streams)| {
                Transport::from_streams(rank, streams, max_payload, checksum).unwrap()
            })
            .collect()
    }

    pub(crate) fn header(seq: u64, tag: u32, payload_bytes: u64) -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Data,
            dtype: DType::U8,
            group: 0,
            seq,
            tag,
            root: 0,
            payload_bytes,
        }
    }

    pub(crate) fn budget(ms: u64) -> WaitBudget {
        WaitBudget::from_now(OpKind::AllReduce, Duration::from_millis(ms))
    }

    #[test]
    fn frames_are_filed_by_key_and_delivered_out_of_order() {
        let ranks = transports(3, 1 << 20);
        // Rank 0 sends three frames to rank 2 (eagerly, nobody is receiving yet) and one to
        // itself; rank 1 sends one to rank 2.
        for seq in 0..3u64 {
            let payload: Vec<u8> = (0..100).map(|i| (i as u64 * 7 + seq) as u8).collect();
            ranks[0]
                .send(OpKind::AllReduce, 2, header(seq, 5, 100), &payload)
                .unwrap();
        }
        ranks[0]
            .send(OpKind::AllReduce, 0, header(9, 1, 3), &[1, 2, 3])
            .unwrap();
        ranks[1]
            .send(OpKind::AllReduce, 2, header(0, 5, 4), &[4, 3, 2, 1])
            .unwrap();
        // Received in reverse order of sending, and per source.
        for seq in (0..3u64).rev() {
            let key = MailboxKey::of(&header(seq, 5, 0));
            let frame = ranks[2].recv(&budget(5_000), 0, key).unwrap();
            assert_eq!(frame.header.seq, seq);
            let expected: Vec<u8> = (0..100).map(|i| (i as u64 * 7 + seq) as u8).collect();
            assert_eq!(frame.payload, expected);
        }
        let from_one = ranks[2]
            .recv(&budget(5_000), 1, MailboxKey::of(&header(0, 5, 0)))
            .unwrap();
        assert_eq!(from_one.payload, vec![4, 3, 2, 1]);
        let to_self = ranks[0]
            .recv(&budget(5_000), 0, MailboxKey::of(&header(9, 1, 0)))
            .unwrap();
        assert_eq!(to_self.payload, vec![1, 2, 3]);
    }

    #[test]
    fn recycled_payloads_are_reused_and_carry_only_the_new_bytes() {
        let ranks = transports(2, 1 << 20);
        let long: Vec<u8> = (0..5000).map(|i| (i % 251) as u8).collect();
        ranks[0]
            .send(OpKind::AllGather, 1, header(0, 0, 5000), &long)
            .unwrap();
        let first = ranks[1]
            .recv(&budget(5_000), 0, MailboxKey::of(&header(0, 0, 0)))
            .unwrap();
        assert_eq!(first.payload, long);
        ranks[1].recycle(first.payload);
        // A shorter frame lands in the recycled (longer) buffer: it must hold exactly the new
        // bytes, and a longer one after it must be whole too.
        ranks[0]
            .send(OpKind::AllGather, 1, header(1, 0, 3), &[7, 8, 9])
            .unwrap();
        let second = ranks[1]
            .recv(&budget(5_000), 0, MailboxKey::of(&header(1, 0, 0)))
            .unwrap();
        assert_eq!(second.payload, vec![7, 8, 9]);
        ranks[1].recycle(second.payload);
        let longer: Vec<u8> = (0..9000).map(|i| (i % 13) as u8).collect();
        ranks[0]
            .send(OpKind::AllGather, 1, header(2, 0, 9000), &longer)
            .unwrap();
        let third = ranks[1]
            .recv(&budget(5_000), 0, MailboxKey::of(&header(2, 0, 0)))
            .unwrap();
        assert_eq!(third.payload, longer);
    }

    #[test]
    fn vectored_writes_survive_partial_writes() {
        /// Accepts at most three bytes per call, like a congested socket.
        struct Trickle(Vec<u8>);
        impl Write for Trickle {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                let n = buf.len().min(3);
                self.0.extend_from_slice(&buf[..n]);
                Ok(n)
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut sink = Trickle(Vec::new());
        write_all_vectored(&mut sink, &[&[1, 2, 3, 4, 5], &[], &[6, 7]]).unwrap();
        assert_eq!(sink.0, vec![1, 2, 3, 4, 5, 6, 7]);
    }

    #[test]
    fn a_missing_frame_times_out_within_the_deadline() {
        let ranks = transports(2, 1 << 10);
        let started = Instant::now();
        let error = ranks[0]
            .recv(&budget(150), 1, MailboxKey::of(&header(0, 0, 0)))
            .unwrap_err();
        assert!(
            matches!(
                error,
                Error::Timeout {
                    op: OpKind::AllReduce,
                    peer: Some(1),
                    ..
                }
            ),
            "{error:?}"
        );
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(150) && waited < Duration::from_secs(3));
    }

    #[test]
    fn a_dropped_peer_is_lost_but_its_earlier_frames_still_arrive() {
        let mut ranks = transports(2, 1 << 10);
        ranks[1]
            .send(OpKind::Broadcast, 0, header(0, 0, 2), &[8, 9])
            .unwrap();
        drop(ranks.pop());
        let early = ranks[0]
            .recv(&budget(5_000), 1, MailboxKey::of(&header(0, 0, 0)))
            .unwrap();
        assert_eq!(early.payload, vec![8, 9]);
        let started = Instant::now();
        let error = ranks[0]
            .recv(&budget(5_000), 1, MailboxKey::of(&header(1, 0, 0)))
            .unwrap_err();
        assert!(
            matches!(
                error,
                Error::PeerLost {
                    op: OpKind::AllReduce,
                    peer: 1
                }
            ),
            "{error:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(3));
        assert!(ranks[0].is_lost(1));
    }

    #[test]
    fn an_oversized_or_garbage_frame_is_a_protocol_error() {
        let mut mesh = stream_mesh(2);
        let mut raw = mesh[1][0].take().unwrap();
        let receiver = Transport::from_streams(0, std::mem::take(&mut mesh[0]), 64, false).unwrap();
        raw.write_all(&header(0, 0, 65).encode()).unwrap();
        let error = receiver
            .recv(&budget(5_000), 1, MailboxKey::of(&header(0, 0, 0)))
            .unwrap_err();
        assert!(
            matches!(
                error,
                Error::Protocol {
                    peer: Some(1),
                    violation: ProtocolViolation::FrameTooLarge { limit: 64, got: 65 }
                }
            ),
            "{error:?}"
        );
    }

    #[test]
    fn a_frame_cut_short_is_never_delivered() {
        let mut mesh = stream_mesh(2);
        let mut raw = mesh[1][0].take().unwrap();
        let receiver = Transport::from_streams(0, std::mem::take(&mut mesh[0]), 64, false).unwrap();
        raw.write_all(&header(0, 0, 10).encode()).unwrap();
        raw.write_all(&[1, 2, 3]).unwrap();
        drop(raw);
        let error = receiver
            .recv(&budget(5_000), 1, MailboxKey::of(&header(0, 0, 0)))
            .unwrap_err();
        assert!(
            matches!(error, Error::PeerLost { peer: 1, .. }),
            "{error:?}"
        );
    }

    #[test]
    fn sends_check_the_declared_length_and_the_peer() {
        let ranks = transports(2, 16);
        assert!(matches!(
            ranks[0].send(OpKind::Send, 1, header(0, 0, 3), &[1, 2]),
            Err(Error::Protocol {
                violation: ProtocolViolation::PayloadLengthMismatch {
                    declared: 3,
                    actual: 2
                },
                ..
            })
        ));
        assert!(matches!(
            ranks[0].send(OpKind::Send, 1, header(0, 0, 17), &[0; 17]),
            Err(Error::Protocol {
                violation: ProtocolViolation::FrameTooLarge { limit: 16, got: 17 },
                ..
            })
        ));
        assert!(matches!(
            ranks[0].send(OpKind::Send, 2, header(0, 0, 1), &[0]),
            Err(Error::InvalidRank {
                rank: 2,
                size: 2,
                ..
            })
        ));
    }

    #[test]
    fn abort_wakes_waiters_and_the_peer_sees_the_rank_lost() {
        let ranks = Arc::new(transports(2, 16));
        let waiter = {
            let ranks = Arc::clone(&ranks);
            thread::spawn(move || {
                ranks[0].recv(&budget(10_000), 1, MailboxKey::of(&header(0, 0, 0)))
            })
        };
        thread::sleep(Duration::from_millis(50));
        let started = Instant::now();
        ranks[0].abort();
        let woken = waiter.join().unwrap();
        assert!(matches!(woken, Err(Error::Aborted { .. })), "{woken:?}");
        let peer_view = ranks[1].recv(&budget(10_000), 0, MailboxKey::of(&header(0, 0, 0)));
        assert!(
            matches!(peer_view, Err(Error::PeerLost { peer: 0, .. })),
            "{peer_view:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn checksummed_frames_arrive_whole_through_the_mailbox_and_posts() {
        let ranks = transports_with(2, 1 << 20, true);
        assert!(ranks[0].frame_checksum() && ranks[1].frame_checksum());
        // A frame larger than a staging chunk, so the running checksum spans several chunks.
        let long: Vec<u8> = (0..(STAGING_BYTES + 4097))
            .map(|i| (i % 241) as u8)
            .collect();
        let len = long.len() as u64;
        ranks[0]
            .send(OpKind::AllGather, 1, header(0, 1, len), &long)
            .unwrap();
        let frame = ranks[1]
            .recv(&budget(5_000), 0, MailboxKey::of(&header(0, 1, 0)))
            .unwrap();
        assert_eq!(frame.payload, long);
        // In pieces (vectored), and an empty payload.
        let (a, b) = long.split_at(1000);
        ranks[1]
            .send_parts(OpKind::AllGather, 0, header(1, 2, len), &[a, b])
            .unwrap();
        ranks[1]
            .send(OpKind::Barrier, 0, header(2, 3, 0), &[])
            .unwrap();
        let parts = ranks[0]
            .recv(&budget(5_000), 1, MailboxKey::of(&header(1, 2, 0)))
            .unwrap();
        assert_eq!(parts.payload, long);
        let empty = ranks[0]
            .recv(&budget(5_000), 1, MailboxKey::of(&header(2, 3, 0)))
            .unwrap();
        assert!(empty.payload.is_empty());
    }

    /// Rank 0 of a two-rank world with checksums, and the raw socket of its peer.
    fn checksummed_receiver() -> (Transport, TcpStream) {
        let mut mesh = stream_mesh(2);
        let raw = mesh[1][0].take().unwrap();
        let receiver =
            Transport::from_streams(0, std::mem::take(&mut mesh[0]), 1 << 10, true).unwrap();
        (receiver, raw)
    }

    #[test]
    fn a_corrupted_payload_is_a_checksum_error_naming_the_frame_and_never_delivered() {
        let (receiver, mut raw) = checksummed_receiver();
        let sent = header(5, 9, 8);
        let mut wire =
            crate::transport::tcp::frame::encode_frame(&sent, &[1, 2, 3, 4, 5, 6, 7, 8], true);
        wire[FRAME_HEADER_BYTES + FRAME_CHECKSUM_BYTES + 3] ^= 0x04;
        raw.write_all(&wire).unwrap();
        let started = Instant::now();
        let error = receiver
            .recv(&budget(5_000), 1, MailboxKey::of(&header(5, 9, 0)))
            .unwrap_err();
        let expected = MailboxKey::of(&sent);
        match error {
            Error::Protocol {
                peer: Some(1),
                violation:
                    ProtocolViolation::ChecksumFailed {
                        frame: Some(key),
                        sent,
                        computed,
                    },
            } => {
                assert_eq!(key, expected);
                assert_eq!((key.kind, key.seq, key.tag), (FrameKind::Data, 5, 9));
                assert_ne!(sent, computed);
            }
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(3));
        // The connection is shut, so the sender sees this rank as gone.
        let mut byte = [0u8; 1];
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(raw.read(&mut byte).unwrap(), 0);
    }

    #[test]
    fn a_corrupted_header_is_caught_before_its_length_is_used() {
        let (receiver, mut raw) = checksummed_receiver();
        // The length field says 4 bytes, but one flipped bit makes it 4 + 2^20: without the
        // header's word the reader would wait for a megabyte that never comes (or refuse it
        // as too large); with it, the header is refused at once.
        let mut wire = crate::transport::tcp::frame::encode_frame(&header(0, 0, 4), &[7; 4], true);
        wire[30] ^= 0x10;
        raw.write_all(&wire).unwrap();
        let error = receiver
            .recv(&budget(5_000), 1, MailboxKey::of(&header(0, 0, 0)))
            .unwrap_err();
        assert!(
            matches!(
                error,
                Error::Protocol {
                    peer: Some(1),
                    violation: ProtocolViolation::ChecksumFailed { frame: None, .. }
                }
            ),
            "{error:?}"
        );
    }

    #[test]
    fn a_corrupted_frame_into_a_posted_buffer_is_never_counted_as_filled() {
        use crate::transport::tcp::posted::{PostMode, PostTarget, PostedOutcome, PostedRecv};
        for reduce in [false, true] {
            let (receiver, mut raw) = checksummed_receiver();
            let mut dst = vec![0u8; 16];
            let key = MailboxKey::of(&header(3, 1, 0));
            let mode = if reduce {
                PostMode::Reduce(
                    crate::reduce::ReducePlan::new(crate::ReduceOp::Sum, DType::U8, 2).unwrap(),
                )
            } else {
                PostMode::Copy(DType::U8)
            };
            let target = PostTarget {
                len: dst.len(),
                buffer: &mut dst,
                own: None,
            };
            let posted = PostedRecv::post_prefix(&receiver, (1, key), mode, target);
            // A good first half, then a corrupted second half.
            raw.write_all(&crate::transport::tcp::frame::encode_frame(
                &header(3, 1, 8),
                &[1; 8],
                true,
            ))
            .unwrap();
            let mut bad =
                crate::transport::tcp::frame::encode_frame(&header(3, 1, 8), &[2; 8], true);
            let last = bad.len() - 1;
            bad[last] ^= 0xff;
            raw.write_all(&bad).unwrap();
            let mut seen = 0;
            let outcome = posted.wait(&budget(5_000), |range| {
                seen += range.len();
                Ok(())
            });
            assert!(
                matches!(
                    outcome,
                    Err(Error::Protocol {
                        violation: ProtocolViolation::ChecksumFailed { frame: Some(_), .. },
                        ..
                    })
                ),
                "reduce {reduce}: {outcome:?}"
            );
            assert!(!matches!(outcome, Ok(PostedOutcome::Complete)));
            // Only the frame whose trailer held was handed on.
            assert_eq!(seen, 8, "reduce {reduce}");
        }
    }
}
