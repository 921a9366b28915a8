//! [`ShmPeer`]: the two rings between this rank and one co-located peer, carrying messages
//! under the same keys as the TCP frames ((group, seq, tag, kind), [`MailboxKey`]), so the
//! [`Link`](crate::backend::tcp) semantics hold: a receiver asks for a key and gets that key's
//! messages in the order they were sent, whatever else is in between.
//!
//! A message in a ring is a [`FrameHeader`] padded to [`SLOT_HEADER_BYTES`], then the payload
//! padded to a multiple of [`PAYLOAD_ALIGN`]; messages start 16-byte aligned and the ring's
//! capacity is a multiple of 64, so a payload wraps at an element boundary. The payload is
//! streamed: the producer publishes it as space frees up and the consumer hands it out as it
//! arrives, so a message may be far larger than the ring.
//!
//! Several threads may use one peer at once (split groups run their ops on their own
//! threads): sends take the producer lock for a whole message; a receiver that finds the head
//! message is not its key moves it into the *stash* (a per-key queue on the heap) and goes
//! on. Stashing only happens under the consumer lock, and a receiver checks the stash again
//! after taking that lock, so messages of one key are never reordered. A sender waiting for
//! space drains its incoming rings into the stash, so two ranks that both send a block larger
//! than the ring before receiving cannot deadlock.
//!
//! A *post* ([`ShmPeer::post`]) lends a destination for one key, as the TCP backend's posted
//! receives do: whenever the thread that posted it meets that key's next message (while it
//! drains during a stalled send, or while it waits for another key), the payload is copied or
//! combined straight from the ring into the destination, with no stash copy. Only the posting
//! thread ever writes into its posts, and only inside calls of this module, so a post needs
//! no more synchronisation than its registry's lock.
//!
//! A wait that fails in the middle of a message leaves the ring at an unknown position, so
//! the peer is then *poisoned*: every later use fails with [`Error::PeerLost`] (and the TCP
//! side shuts the peer's connection so it sees this rank as lost too).

mod pull;
mod send;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, TryLockError};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use super::cma::Remote;
use super::ring::{Consumer, Corrupt, Producer};
use super::segment::Segment;
use super::wait::{WaitFor, Waited, Watch, wait_until};
use crate::dtype::DType;
use crate::error::{Error, IoAction, ProtocolViolation, Result};
use crate::reduce::ReducePlan;
use crate::transport::tcp::frame::{FRAME_HEADER_BYTES, FrameHeader, payload_alloc_error};
use crate::transport::tcp::transport::{Frame, MailboxKey};
use pull::{CopyOut, deliver_stashed};

/// The ring bytes of one message header (the frame header and zero padding).
pub const SLOT_HEADER_BYTES: usize = 48;

/// Payloads are padded to a multiple of this many bytes.
pub const PAYLOAD_ALIGN: usize = 16;

/// Where in a message's slot (after the frame header, in its zero padding) the body's kind
/// is: [`BODY_INLINE`] (the payload follows in the ring) or [`BODY_LENT`].
const BODY_AT: usize = FRAME_HEADER_BYTES;

const _: () = assert!(BODY_AT + 4 <= SLOT_HEADER_BYTES);

/// The payload follows in the ring.
const BODY_INLINE: u32 = 0;

/// A descriptor follows instead of the payload: the payload's address in the sender, as a
/// little-endian `u64`, and a zero `u64` ([`LENT_BYTES`] in all). The receiver copies the
/// payload out of the sender with a cross-memory read ([`super::cma`]) and releases the
/// descriptor only afterwards, which is the sender's signal that its buffer is free again.
const BODY_LENT: u32 = u32::from_le_bytes(*b"CMA1");

/// The ring bytes of a lent payload's descriptor: the address, then the claim word.
const LENT_BYTES: usize = 16;

/// Where the claim word of a lent message is, from the message's start (8-aligned, since
/// messages start 16-aligned). Both sides change it only atomically, with compare-exchange:
/// the receiver from [`CLAIM_OPEN`] to [`CLAIM_TAKEN`] before it reads the payload, the
/// sender from [`CLAIM_OPEN`] to [`CLAIM_CANCELLED`] when it gives up waiting; exactly one
/// of them wins.
const CLAIM_AT: usize = SLOT_HEADER_BYTES + 8;
const CLAIM_OPEN: u64 = 0;
const CLAIM_TAKEN: u64 = 1;
const CLAIM_CANCELLED: u64 = 2;

/// How long a sender waits for the receiver to claim a lent payload before it cancels the
/// descriptor and sends the payload through the ring instead. Long enough that a receiver
/// inside the op (but descheduled for a time slice or two) claims it; short enough that a
/// receiver that is not reading (an op that failed validation, a peer still busy elsewhere)
/// costs a sender no more than this per message.
const LEND_PATIENCE: Duration = Duration::from_millis(20);

/// The staging piece for a cross-memory read that a sink does not take in place (a
/// reduction, a closure): small enough to stay in L2 between the read and the combine.
const PULL_STAGE: usize = 256 << 10;

/// How a message's payload travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Body {
    /// In the ring, after the header.
    Inline,
    /// In the sender's memory, named by a descriptor in the ring.
    Lent,
}

/// The bytes a side waits for before it copies (free space for the producer, published
/// data for the consumer, or the rest of the message if less): large enough that the
/// wake-ups and position updates cost nothing next to the copy, small enough that the two
/// sides overlap (the consumer copies one chunk out while the producer fills the next).
fn chunk_goal(capacity: usize) -> usize {
    capacity / 4
}

/// How long a receiver holds the consumer lock waiting for a header before letting other
/// receivers of the same peer at the ring.
const HOLD_SLICE: Duration = Duration::from_millis(5);

/// How long a receiver waits on the stash while another thread holds the consumer lock.
const STASH_SLICE: Duration = Duration::from_millis(1);

fn padded(len: usize) -> usize {
    len.div_ceil(PAYLOAD_ALIGN) * PAYLOAD_ALIGN
}

/// The largest payload a ring of `capacity` bytes holds as one whole message. Every message
/// fits its ring whole, so a draining sender (which never waits for the rest of a message,
/// or two ranks that both drain would wait for each other) can always make room.
pub fn max_message_payload(capacity: usize) -> usize {
    capacity.saturating_sub(SLOT_HEADER_BYTES) / PAYLOAD_ALIGN * PAYLOAD_ALIGN
}

/// The ring capacity that holds a whole message of `max_payload` bytes, or `wanted` if that
/// is more.
pub fn ring_bytes_for(wanted: usize, max_payload: u64) -> usize {
    let payload = usize::try_from(max_payload).unwrap_or(usize::MAX / 2);
    wanted.max(SLOT_HEADER_BYTES.saturating_add(padded(payload)))
}

/// A message moved out of the ring because its receiver was not the one reading.
#[derive(Debug)]
struct Stashed {
    header: FrameHeader,
    payload: Vec<u8>,
}

/// What a receiver does with a message: checks its header, then takes its payload in
/// element-aligned pieces (at `offset` bytes into the payload).
pub(crate) trait Sink {
    /// Accepts or refuses the message (a refused message is skipped and the error returned).
    fn accept(&mut self, header: &FrameHeader) -> Result<()>;
    /// Takes `bytes`, the payload from `offset` on.
    fn take(&mut self, offset: usize, bytes: &[u8]) -> Result<()>;
    /// The granule pieces are cut to (the element size; 1 for raw bytes).
    fn granule(&self, header: &FrameHeader) -> usize;
    /// Takes the whole payload of an accepted message that is lent ([`Body::Lent`]): `read(at,
    /// dst)` copies payload bytes `at..at + dst.len()` into `dst`. The default reads pieces
    /// into a staging buffer and hands them to [`Sink::take`]; a sink that can name its
    /// destination reads into it directly.
    fn pull(&mut self, header: &FrameHeader, read: &mut Reader<'_>) -> Result<()> {
        staged_pull(self, header, read)
    }
}

/// What [`Sink::pull`] reads a lent payload with.
pub(crate) type Reader<'r> = dyn FnMut(usize, &mut [u8]) -> Result<()> + 'r;

thread_local! {
    /// The staging buffer of [`staged_pull`], kept per thread so a stream of lent messages
    /// does not allocate.
    static STAGE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Reads a lent payload in pieces of at most [`PULL_STAGE`] bytes (whole granules) into a
/// staging buffer and hands each to `sink.take`.
fn staged_pull<S: Sink + ?Sized>(
    sink: &mut S,
    header: &FrameHeader,
    read: &mut Reader<'_>,
) -> Result<()> {
    // invariant: decode checked payload_bytes <= max_payload, an allocatable size.
    let len = usize::try_from(header.payload_bytes).unwrap_or(usize::MAX);
    let granule = sink.granule(header).max(1);
    let piece = (PULL_STAGE / granule).max(1) * granule;
    STAGE.with(|stage| {
        let mut stage = stage.borrow_mut();
        if stage.len() < piece.min(len) {
            stage.resize(piece.min(len), 0);
        }
        let mut at = 0;
        while at < len {
            let n = piece.min(len - at);
            read(at, &mut stage[..n])?;
            sink.take(at, &stage[..n])?;
            at += n;
        }
        Ok(())
    })
}

/// What a post does with the payload bytes that arrive for it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Apply {
    /// Copies them into the destination.
    Copy(DType),
    /// Combines them into the destination with the plan's combine step.
    Reduce(ReducePlan),
}

impl Apply {
    fn dtype(&self) -> DType {
        match self {
            Apply::Copy(dtype) => *dtype,
            Apply::Reduce(plan) => plan.dtype(),
        }
    }

    fn apply(&self, dst: &mut [u8], src: &[u8]) -> Result<()> {
        match self {
            Apply::Copy(_) => {
                dst.copy_from_slice(src);
                Ok(())
            }
            Apply::Reduce(plan) => plan.combine(dst, src),
        }
    }
}

/// A destination lent for one key: `len` bytes at `base`, the first `filled` done; for a
/// reduction out of place, `own` (at least `len` bytes) is the contribution each payload is
/// combined with (`dst = own ⊕ payload`).
#[derive(Debug)]
struct Post {
    key: MailboxKey,
    base: Destination,
    own: Option<Source>,
    len: usize,
    filled: usize,
    apply: Apply,
    owner: ThreadId,
}

/// The start of a lent contribution (read only).
#[derive(Clone, Copy, Debug)]
struct Source(*const u8);

// SAFETY: as for `Destination`: only the posting thread reads through it, within the lent
// range, while the post exists.
unsafe impl Send for Source {}

/// The start of a lent destination.
#[derive(Clone, Copy, Debug)]
struct Destination(*mut u8);

// SAFETY: a destination is only dereferenced by the thread that posted it (checked against
// `Post::owner` before every use), for the range its poster lent; moving the address through
// the registry's lock is harmless in itself.
unsafe impl Send for Destination {}

/// Checks a message against a post the way the TCP reader checks one against a posted
/// destination: same dtype, whole elements, at least one, within what is still missing.
fn fits(post: &Post, header: &FrameHeader) -> bool {
    let len = header.payload_bytes;
    let dtype = post.apply.dtype();
    header.dtype == dtype
        && len > 0
        && len.is_multiple_of(dtype.size_bytes() as u64)
        && len <= (post.len - post.filled) as u64
}

/// Writes a message's payload into a post (at `at` bytes into the destination).
struct PostSink<'j> {
    base: Destination,
    /// Whether copies and out-of-place reductions stream past the cache (the whole
    /// destination is large). In-place reductions read each line before writing it, so
    /// they gain nothing from it and keep normal stores.
    streamed: bool,
    own: Option<Source>,
    at: usize,
    room: usize,
    apply: Apply,
    /// The caller's judgement of the header (a refusal is its typed error).
    judge: &'j dyn Fn(&FrameHeader, usize) -> Result<()>,
}

impl Sink for PostSink<'_> {
    fn accept(&mut self, header: &FrameHeader) -> Result<()> {
        (self.judge)(header, self.room)
    }
    fn take(&mut self, offset: usize, bytes: &[u8]) -> Result<()> {
        if offset + bytes.len() > self.room {
            return Err(Error::Protocol {
                peer: None,
                violation: ProtocolViolation::PayloadLengthMismatch {
                    declared: self.room as u64,
                    actual: (offset + bytes.len()) as u64,
                },
            });
        }
        // SAFETY: the post's owner (this thread: every caller checks `owner` or is the
        // poster) lent `len` bytes at `base` until it withdraws the post, and nothing else
        // writes them meanwhile; `at + offset + bytes.len() <= at + room = len` (checked
        // above, with `room = len - filled` when the sink was made).
        let dst = unsafe {
            std::slice::from_raw_parts_mut(self.base.0.add(self.at + offset), bytes.len())
        };
        match (self.own, self.apply) {
            (Some(own), Apply::Reduce(plan)) => {
                // SAFETY: the poster lent `len` readable bytes at `own` for as long as the
                // post exists (nobody writes them meanwhile); same range as `dst` above.
                let own =
                    unsafe { std::slice::from_raw_parts(own.0.add(self.at + offset), bytes.len()) };
                if self.streamed {
                    // A large out-of-place destination (a reduce-scatter's output) is cold:
                    // streaming it out skips the read-for-ownership of every line.
                    super::copy::stream_combine_from(&plan, dst, own, bytes)
                } else {
                    plan.combine_from(dst, own, bytes)
                }
            }
            (_, Apply::Copy(_)) if self.streamed => {
                super::copy::stream_copy(dst, bytes);
                Ok(())
            }
            _ => self.apply.apply(dst, bytes),
        }
    }
    fn granule(&self, _header: &FrameHeader) -> usize {
        self.apply.dtype().size_bytes()
    }
    fn pull(&mut self, header: &FrameHeader, read: &mut Reader<'_>) -> Result<()> {
        let Apply::Copy(_) = self.apply else {
            return staged_pull(self, header, read);
        };
        let len = usize::try_from(header.payload_bytes).unwrap_or(usize::MAX);
        if len > self.room {
            return Err(Error::Protocol {
                peer: None,
                violation: ProtocolViolation::PayloadLengthMismatch {
                    declared: self.room as u64,
                    actual: header.payload_bytes,
                },
            });
        }
        // SAFETY: as in `take`: this thread owns the post, which lent `len` bytes at `base`
        // that nothing else touches meanwhile, and `at + len <= at + room` (checked above).
        let dst = unsafe { std::slice::from_raw_parts_mut(self.base.0.add(self.at), len) };
        read(0, dst)
    }
}

/// The cross-memory side of a pair: the peer process, and the smallest payload this rank
/// lends instead of copying into the ring.
#[derive(Clone, Copy, Debug)]
struct Cma {
    remote: Remote,
    min_bytes: usize,
}

/// The shared-memory channel to one peer: this rank's producer into the peer's ring, its
/// consumer of the peer's ring into this rank, and the stash.
#[derive(Debug)]
pub struct ShmPeer {
    /// The peer's world rank.
    peer: usize,
    max_payload: u64,
    tx: Mutex<Producer>,
    rx: Mutex<Consumer>,
    stash: Mutex<HashMap<MailboxKey, VecDeque<Stashed>>>,
    stashed: Condvar,
    posts: Mutex<Vec<Post>>,
    poisoned: AtomicBool,
    /// Set when both ranks of the pair can read each other ([`super::cma`]).
    cma: Option<Cma>,
    /// The incoming ring's segment, for its consumer park word (a doorbell of this rank's
    /// waiting senders) without the consumer lock.
    incoming: Arc<Segment>,
}

fn relock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a thread panicked while holding it; the ring positions are
    // plain integers updated after each copy, so the state is still consistent.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl ShmPeer {
    /// The channel to world rank `peer` over a producer (this rank to the peer) and a
    /// consumer (the peer to this rank). Payloads above `max_payload`, or above what one
    /// ring holds as a whole message ([`max_message_payload`]), are refused both ways.
    pub(crate) fn new(peer: usize, tx: Producer, rx: Consumer, max_payload: u64) -> ShmPeer {
        let ring = tx.capacity().min(rx.capacity());
        let incoming = Arc::clone(rx.segment());
        let max_payload = max_payload.min(max_message_payload(ring) as u64);
        ShmPeer {
            peer,
            max_payload,
            tx: Mutex::new(tx),
            rx: Mutex::new(rx),
            stash: Mutex::new(HashMap::new()),
            stashed: Condvar::new(),
            posts: Mutex::new(Vec::new()),
            poisoned: AtomicBool::new(false),
            cma: None,
            incoming,
        }
    }

    /// The word this rank's receivers of the peer's ring park on; the peer wakes it when it
    /// publishes, so a sender that drains this ring while it waits parks on it too.
    pub(crate) fn doorbell(&self) -> &AtomicU32 {
        &self.incoming.control().data_waiter.0
    }

    /// The channel, lending payloads of at least `min_bytes` (sending their address instead
    /// of copying them into the ring) and accepting lent payloads from `remote`, the peer's
    /// process. Both ranks of a pair must agree (the setup's probe makes sure).
    pub(crate) fn with_cma(mut self, remote: Remote, min_bytes: usize) -> ShmPeer {
        self.cma = Some(Cma {
            remote,
            min_bytes: min_bytes.max(1),
        });
        self
    }

    /// Whether this pair moves large payloads with single cross-memory copies.
    pub fn uses_cma(&self) -> bool {
        self.cma.is_some()
    }

    /// The peer's world rank.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// Whether a failed wait left a ring mid-message (every later use fails).
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::SeqCst)
    }

    fn healthy(&self, watch: &dyn Watch) -> Result<()> {
        if self.is_poisoned() {
            return Err(Error::PeerLost {
                op: watch.op(),
                peer: self.peer,
            });
        }
        Ok(())
    }

    fn corrupt(&self, corrupt: Corrupt) -> Error {
        self.poisoned.store(true, Ordering::SeqCst);
        Error::Protocol {
            peer: Some(self.peer),
            violation: ProtocolViolation::FrameTooLarge {
                limit: self.max_payload,
                got: corrupt.in_flight,
            },
        }
    }

    /// Runs `step` as a part of a message: an error poisons the peer.
    fn mid_message<T>(&self, step: Result<T>) -> Result<T> {
        if step.is_err() {
            self.poisoned.store(true, Ordering::SeqCst);
        }
        step
    }

    fn wait_data(
        &self,
        rx: &Consumer,
        want: usize,
        watch: &dyn Watch,
        until: Option<Instant>,
    ) -> Result<Waited> {
        let what = WaitFor {
            word: rx.park_word(),
            peer: self.peer,
            watch,
            until,
            doorbells: &[],
        };
        let ready = || {
            rx.available()
                .map(|a| a >= want)
                .map_err(|c| self.corrupt(c))
        };
        wait_until(&what, ready, &mut || {})
    }

    fn pop_stash(&self, key: MailboxKey) -> Option<Stashed> {
        let mut stash = relock(&self.stash);
        let queue = stash.get_mut(&key)?;
        let message = queue.pop_front();
        if queue.is_empty() {
            stash.remove(&key);
        }
        message
    }

    fn push_stash(&self, message: Stashed) {
        relock(&self.stash)
            .entry(MailboxKey::of(&message.header))
            .or_default()
            .push_back(message);
        self.stashed.notify_all();
    }

    /// Receives the next message filed under `key` into `sink` and returns its header.
    pub(crate) fn recv(
        &self,
        key: MailboxKey,
        watch: &dyn Watch,
        sink: &mut dyn Sink,
    ) -> Result<FrameHeader> {
        loop {
            self.healthy(watch)?;
            if let Some(message) = self.pop_stash(key) {
                return deliver_stashed(message, sink);
            }
            let mut rx = match self.rx.try_lock() {
                Ok(rx) => rx,
                Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    self.wait_stash(key, watch)?;
                    continue;
                }
            };
            // Another receiver may have stashed this key's next message before we got the
            // lock; it comes before anything still in the ring.
            if let Some(message) = self.pop_stash(key) {
                return deliver_stashed(message, sink);
            }
            let until = Some(Instant::now() + HOLD_SLICE);
            if self.wait_data(&rx, SLOT_HEADER_BYTES, watch, until)? == Waited::SliceOver {
                continue;
            }
            let (header, body) = self.read_header(&mut rx)?;
            if MailboxKey::of(&header) == key {
                if self.stream(&mut rx, header, body, watch, sink)? {
                    return Ok(header);
                }
                // A cancelled lend: the payload follows inline under the same key.
                continue;
            }
            self.divert(&mut rx, header, body, watch)?;
        }
    }

    /// Files a message that is not the reader's: straight into a post of this thread that
    /// it fits (when nothing of its key is stashed, which would have to come first), else
    /// into the stash.
    fn divert(
        &self,
        rx: &mut Consumer,
        header: FrameHeader,
        body: Body,
        watch: &dyn Watch,
    ) -> Result<()> {
        let key = MailboxKey::of(&header);
        let me = std::thread::current().id();
        let target = {
            let posts = relock(&self.posts);
            let stashed = relock(&self.stash).contains_key(&key);
            posts
                .iter()
                .find(|p| p.key == key && p.owner == me && !stashed && fits(p, &header))
                .map(|p| (p.base, p.own, p.filled, p.len, p.apply))
        };
        if let Some((base, own, at, len, apply)) = target {
            let accept_all = |_: &FrameHeader, _: usize| Ok(());
            let mut sink = PostSink {
                base,
                streamed: len >= super::copy::STREAM_MIN_DESTINATION,
                own,
                at,
                room: len - at,
                apply,
                judge: &accept_all,
            };
            if !self.stream(rx, header, body, watch, &mut sink)? {
                return Ok(());
            }
            if let Some(post) = relock(&self.posts)
                .iter_mut()
                .find(|p| p.key == key && p.owner == me)
            {
                // invariant: fits() checked payload_bytes <= len - filled, a usize.
                post.filled += header.payload_bytes as usize;
            }
            return Ok(());
        }
        if let Some(stashed) = self.take_whole(rx, header, body, watch)? {
            self.push_stash(stashed);
        }
        Ok(())
    }

    /// Lends `len` bytes at `base` for the messages filed under `key` (see the module docs),
    /// combined with the `len` bytes at `own` when given (a reduction out of place);
    /// [`ShmPeer::wait_post`] completes it, [`ShmPeer::withdraw`] takes it back.
    ///
    /// # Safety
    ///
    /// `base..base + len` must be valid for writes and not accessed by anything else, and
    /// `own..own + len` (if given) valid for reads and not written, until the post is gone
    /// (after `wait_post` returns, or `withdraw` for the key, or `withdraw_op` for its op has
    /// run on the posting thread).
    pub(crate) unsafe fn post(
        &self,
        key: MailboxKey,
        base: *mut u8,
        own: Option<*const u8>,
        len: usize,
        apply: Apply,
    ) {
        let mut posts = relock(&self.posts);
        posts.retain(|p| p.key != key);
        posts.push(Post {
            key,
            base: Destination(base),
            own: own.map(Source),
            len,
            filled: 0,
            apply,
            owner: std::thread::current().id(),
        });
    }

    /// Takes the post for `key` back (if any).
    pub(crate) fn withdraw(&self, key: MailboxKey) {
        relock(&self.posts).retain(|p| p.key != key);
    }

    /// Takes back every post of op (`group`, `seq`) made by this thread.
    pub(crate) fn withdraw_op(&self, group: u32, seq: u64) {
        let me = std::thread::current().id();
        relock(&self.posts)
            .retain(|p| !(p.key.group == group && p.key.seq == seq && p.owner == me));
    }

    /// Completes the post for `key`: receives its messages (each judged by `judge`, which
    /// gets the header and the room left, as the caller's typed errors) until it is full,
    /// handing every newly filled range to `progress` in order, outside the ring's lock (so
    /// `progress` may send). The post is gone when this returns, with or without an error.
    pub(crate) fn wait_post(
        &self,
        key: MailboxKey,
        watch: &dyn Watch,
        judge: &dyn Fn(&FrameHeader, usize) -> Result<()>,
        progress: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let outcome = self.fill_post(key, watch, judge, progress);
        self.withdraw(key);
        outcome
    }

    fn fill_post(
        &self,
        key: MailboxKey,
        watch: &dyn Watch,
        judge: &dyn Fn(&FrameHeader, usize) -> Result<()>,
        progress: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let mut seen = 0;
        loop {
            let snapshot = relock(&self.posts)
                .iter()
                .find(|p| p.key == key)
                .map(|p| (p.base, p.own, p.filled, p.len, p.apply));
            // invariant: only this thread withdraws its post, and it has not yet.
            let Some((base, own, filled, len, apply)) = snapshot else {
                return Err(Error::Aborted { op: watch.op() });
            };
            if seen < filled {
                // SAFETY: bytes `seen..filled` of the lent destination are written (by this
                // thread, inside this module) and nothing writes below `filled` again; the
                // poster lent them until the post is withdrawn, which happens after this.
                let fresh = unsafe { std::slice::from_raw_parts(base.0.add(seen), filled - seen) };
                progress(fresh)?;
                seen = filled;
                continue;
            }
            if filled == len {
                return Ok(());
            }
            let mut sink = PostSink {
                base,
                streamed: len >= super::copy::STREAM_MIN_DESTINATION,
                own,
                at: filled,
                room: len - filled,
                apply,
                judge,
            };
            let header = self.recv(key, watch, &mut sink)?;
            if let Some(post) = relock(&self.posts).iter_mut().find(|p| p.key == key) {
                // invariant: the judge and the sink bound payload_bytes by len - filled.
                post.filled += header.payload_bytes as usize;
            }
        }
    }

    /// Waits briefly for another receiver to stash something, then checks the watch.
    fn wait_stash(&self, key: MailboxKey, watch: &dyn Watch) -> Result<()> {
        let stash = relock(&self.stash);
        if !stash.contains_key(&key) {
            let _ = self
                .stashed
                .wait_timeout(stash, STASH_SLICE)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        match watch.interrupted(self.peer) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Receives the next message under `key` as a whole [`Frame`].
    pub(crate) fn recv_frame(&self, key: MailboxKey, watch: &dyn Watch) -> Result<Frame> {
        let mut sink = CopyOut::new(self.peer);
        let header = self.recv(key, watch, &mut sink)?;
        Ok(Frame {
            header,
            payload: sink.bytes,
        })
    }

    /// Moves the messages that are wholly in the incoming ring into this thread's posts or
    /// the stash, if no other thread is reading it, without ever waiting (see
    /// [`max_message_payload`]). Called by senders whose outgoing ring is full.
    pub(crate) fn drain(&self, watch: &dyn Watch) {
        let Ok(mut rx) = self.rx.try_lock() else {
            return;
        };
        if self.is_poisoned() {
            return;
        }
        while self.whole_message_waiting(&rx) {
            let moved = self
                .read_header(&mut rx)
                .and_then(|(header, body)| self.divert(&mut rx, header, body, watch));
            if moved.is_err() {
                // Poisoned by now; the next wait on this peer reports it.
                return;
            }
        }
    }
}

impl ShmPeer {
    /// Whether a whole message (header, payload and padding) is published at the tail.
    fn whole_message_waiting(&self, rx: &Consumer) -> bool {
        let Ok(available) = rx.available() else {
            return false;
        };
        let mut slot = [0u8; SLOT_HEADER_BYTES];
        if available < SLOT_HEADER_BYTES || !rx.read(0, &mut slot) {
            return false;
        }
        // A bad header is left for `read_header`, which reports it.
        let Ok((header, body)) = self.decode_slot(&slot) else {
            return true;
        };
        let payload = usize::try_from(header.payload_bytes).unwrap_or(usize::MAX / 2);
        let rest = match body {
            Body::Inline => padded(payload),
            Body::Lent => LENT_BYTES,
        };
        available >= SLOT_HEADER_BYTES + rest
    }
}
