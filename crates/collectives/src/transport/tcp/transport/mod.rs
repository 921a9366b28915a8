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

mod reader;

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
use reader::{ReadLimits, read_frames};

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

#[cfg(test)]
pub(crate) mod tests;
