//! [`Link`]: what one running op of a TCP group uses to talk to its peers: the phase-0
//! descriptor exchange (validated with the same checks as `local`) and segmented data
//! transfers, all addressed by group rank and filed under the op's (group, seq).

use crate::agree::{Desc, Faults, descriptor, peer_view, validate};
use crate::algorithms::group::Inner;
use crate::dtype::DType;
use crate::engine::JobContext;
use crate::error::{Error, ProtocolViolation, Result};
use crate::op::OpKind;
use crate::transport::shm::{Apply, ShmLinks, ShmPeer, Sink, Watch};
use crate::transport::tcp::frame::{FrameHeader, FrameKind};
use crate::transport::tcp::posted::{Lent, PostMode, PostTarget, PostedOutcome, PostedRecv};
use crate::transport::tcp::transport::{MailboxKey, Transport, WaitBudget, wait_error};

/// What one [`Link::exchange`] step sends, and where it receives from.
pub(crate) struct Exchange<'b> {
    /// The group rank the outgoing bytes go to.
    pub(crate) to: usize,
    /// The group rank the incoming bytes come from.
    pub(crate) from: usize,
    pub(crate) dtype: DType,
    pub(crate) tag: u32,
    pub(crate) outgoing: &'b [u8],
}

/// What a shared-memory wait watches: the op's budget and the TCP transport's view of the
/// peer (a killed rank's sockets close, so its loss shows here), plus aborts.
struct LinkWatch<'t> {
    transport: &'t Transport,
    budget: &'t WaitBudget,
}

impl Watch for LinkWatch<'_> {
    fn op(&self) -> OpKind {
        self.budget.op
    }

    fn interrupted(&self, peer: usize) -> Option<Error> {
        wait_error(&self.transport.shared.lock(), self.budget, peer)
    }

    fn refuses_send(&self, peer: usize) -> Option<Error> {
        // A send is refused for an abort or a lost peer, never for the deadline (as on TCP).
        let no_deadline = WaitBudget {
            deadline: std::time::Instant::now() + std::time::Duration::from_secs(3600),
            ..*self.budget
        };
        wait_error(&self.transport.shared.lock(), &no_deadline, peer)
    }
}

/// Judges a shared-memory data message for a receive of `room` more bytes of `dtype` from
/// group rank `peer` (world rank `world`) with the checks [`Link::recv_data`] makes on TCP.
fn judge_segment(
    op: OpKind,
    peer: usize,
    world: usize,
    dtype: DType,
    header: &FrameHeader,
    room: usize,
) -> Result<()> {
    if header.dtype != dtype {
        return Err(Error::DTypeMismatch {
            op,
            role: crate::op::BufferRole::Peer { rank: peer },
            expected: dtype,
            got: header.dtype,
        });
    }
    let len = header.payload_bytes;
    if len == 0 || len > room as u64 || !len.is_multiple_of(dtype.size_bytes() as u64) {
        // The world rank: the caller maps transport-level errors back to group ranks.
        return Err(Error::Protocol {
            peer: Some(world),
            violation: ProtocolViolation::PayloadLengthMismatch {
                declared: room as u64,
                actual: len,
            },
        });
    }
    Ok(())
}

/// Receives one shared-memory data message into the front of `missing` through `apply`.
struct SegmentSink<'m, F> {
    op: OpKind,
    peer: usize,
    world: usize,
    dtype: DType,
    missing: &'m mut [u8],
    apply: &'m mut F,
}

impl<F: FnMut(&mut [u8], &[u8]) -> Result<()>> Sink for SegmentSink<'_, F> {
    fn accept(&mut self, header: &FrameHeader) -> Result<()> {
        judge_segment(
            self.op,
            self.peer,
            self.world,
            self.dtype,
            header,
            self.missing.len(),
        )
    }

    fn take(&mut self, offset: usize, bytes: &[u8]) -> Result<()> {
        let room = self.missing.len() as u64;
        let Some(dst) = self.missing.get_mut(offset..offset + bytes.len()) else {
            return Err(Error::Protocol {
                peer: Some(self.world),
                violation: ProtocolViolation::PayloadLengthMismatch {
                    declared: room,
                    actual: (offset + bytes.len()) as u64,
                },
            });
        };
        (self.apply)(dst, bytes)
    }

    fn granule(&self, _header: &FrameHeader) -> usize {
        self.dtype.size_bytes()
    }
}

/// One op's view of its group: who it is, which seq it runs under, and its deadline.
pub(crate) struct Link<'a> {
    pub(crate) inner: &'a Inner,
    pub(crate) op: OpKind,
    pub(crate) seq: u64,
    budget: WaitBudget,
}

impl<'a> Link<'a> {
    /// A link for a collective: it takes the group's next sequence number.
    pub(crate) fn collective(inner: &'a Inner, ctx: &JobContext, op: OpKind) -> Link<'a> {
        Link {
            inner,
            op,
            seq: inner.next_seq(),
            budget: WaitBudget {
                op,
                timeout: ctx.timeout,
                deadline: ctx.deadline,
            },
        }
    }

    /// A link for a point-to-point op, which takes no sequence number.
    pub(crate) fn p2p(inner: &'a Inner, ctx: &JobContext, op: OpKind) -> Link<'a> {
        Link {
            inner,
            op,
            seq: 0,
            budget: WaitBudget {
                op,
                timeout: ctx.timeout,
                deadline: ctx.deadline,
            },
        }
    }

    /// The group's size and this rank in it, for the shared argument checks.
    pub(crate) fn place(&self) -> crate::agree::args::Place {
        crate::agree::args::Place::new(self.size(), self.rank(), crate::algorithms::group::BACKEND)
    }

    /// This rank in the group.
    pub(crate) fn rank(&self) -> usize {
        self.inner.rank
    }

    /// The group's size.
    pub(crate) fn size(&self) -> usize {
        self.inner.members.len()
    }

    /// The group rank `r` steps to the right of this rank.
    pub(crate) fn right(&self, steps: usize) -> usize {
        (self.rank() + steps) % self.size()
    }

    /// The group rank `r` steps to the left of this rank.
    pub(crate) fn left(&self, steps: usize) -> usize {
        let n = self.size();
        (self.rank() + n - steps % n) % n
    }

    fn world(&self, peer: usize) -> Result<usize> {
        self.inner
            .members
            .get(peer)
            .copied()
            .ok_or(Error::InvalidRank {
                op: self.op,
                rank: peer,
                size: self.size(),
            })
    }

    /// Maps a transport error about a world rank back to the group rank the caller knows.
    fn group_view(&self, error: Error) -> Error {
        let to_group = |world: usize| {
            self.inner
                .members
                .iter()
                .position(|&w| w == world)
                .unwrap_or(world)
        };
        match error {
            Error::PeerLost { op, peer } => Error::PeerLost {
                op,
                peer: to_group(peer),
            },
            Error::Timeout { op, after, peer } => Error::Timeout {
                op,
                after,
                peer: peer.map(to_group),
            },
            Error::Protocol { peer, violation } => Error::Protocol {
                peer: peer.map(to_group),
                violation,
            },
            other => other,
        }
    }

    /// The shared-memory channel to world rank `world` for frames of `kind`, when this pair
    /// moves its data and messages through one (descriptors always go through TCP).
    fn shm(&self, world: usize, kind: FrameKind) -> Option<(&'a ShmLinks, &'a ShmPeer)> {
        if !matches!(kind, FrameKind::Data | FrameKind::Message) {
            return None;
        }
        let inner: &'a Inner = self.inner;
        let links = inner.shm.as_deref()?;
        Some((links, links.peer(world)?))
    }

    fn shm_watch(&self) -> LinkWatch<'_> {
        LinkWatch {
            transport: &self.inner.transport,
            budget: &self.budget,
        }
    }

    /// A shared-memory error in the group's view. A channel left mid-message is unusable,
    /// so its TCP connection is shut too: the peer then sees this rank as lost.
    fn shm_error(&self, channel: &ShmPeer, error: Error) -> Error {
        if channel.is_poisoned() {
            self.inner.transport.shutdown_peer(channel.peer());
        }
        self.group_view(error)
    }

    /// [`Link::recv_segment`] from a shared-memory peer, into `sink`.
    fn shm_recv_segment<F: FnMut(&mut [u8], &[u8]) -> Result<()>>(
        &self,
        channel: &ShmPeer,
        key: MailboxKey,
        sink: &mut SegmentSink<'_, F>,
    ) -> Result<usize> {
        let header = channel
            .recv(key, &self.shm_watch(), sink)
            .map_err(|e| self.shm_error(channel, e))?;
        // invariant: the sink's judge bounded payload_bytes by the missing length.
        Ok(header.payload_bytes as usize)
    }

    fn header(&self, kind: FrameKind, dtype: DType, tag: u32, bytes: usize) -> FrameHeader {
        FrameHeader {
            kind,
            dtype,
            group: self.inner.group_id,
            seq: self.seq,
            tag,
            root: 0,
            payload_bytes: bytes as u64,
        }
    }

    fn key(&self, kind: FrameKind, tag: u32) -> MailboxKey {
        MailboxKey {
            group: self.inner.group_id,
            seq: self.seq,
            tag,
            kind,
        }
    }

    /// Sends one frame to group rank `peer`.
    pub(crate) fn send_frame(
        &self,
        peer: usize,
        kind: FrameKind,
        dtype: DType,
        tag: u32,
        payload: &[u8],
    ) -> Result<()> {
        let world = self.world(peer)?;
        let header = self.header(kind, dtype, tag, payload.len());
        if let Some((links, channel)) = self.shm(world, kind) {
            return links
                .send(channel, header, payload, &self.shm_watch())
                .map_err(|e| self.shm_error(channel, e));
        }
        self.inner
            .transport
            .send(self.op, world, header, payload)
            .map_err(|e| self.group_view(e))
    }

    /// Sends one data frame whose payload is the concatenation of `parts` to group rank
    /// `peer` in vectored writes (the pieces are never copied together), and returns
    /// `Ok(true)`; returns `Ok(false)` without sending for a peer reached through shared
    /// memory, whose channel takes one contiguous payload (the caller packs it instead).
    pub(crate) fn send_parts(
        &self,
        peer: usize,
        dtype: DType,
        tag: u32,
        parts: &[&[u8]],
    ) -> Result<bool> {
        let world = self.world(peer)?;
        if self.shm(world, FrameKind::Data).is_some() {
            return Ok(false);
        }
        let bytes = parts.iter().map(|part| part.len()).sum();
        let header = self.header(FrameKind::Data, dtype, tag, bytes);
        self.inner
            .transport
            .send_parts(self.op, world, header, parts)
            .map_err(|e| self.group_view(e))?;
        Ok(true)
    }

    /// Waits for one frame from group rank `peer`.
    pub(crate) fn recv_frame(
        &self,
        peer: usize,
        kind: FrameKind,
        tag: u32,
    ) -> Result<crate::transport::tcp::transport::Frame> {
        let world = self.world(peer)?;
        if let Some((links, channel)) = self.shm(world, kind) {
            return links
                .recv_frame(channel, self.key(kind, tag), &self.shm_watch())
                .map_err(|e| self.shm_error(channel, e));
        }
        self.inner
            .transport
            .recv(&self.budget, world, self.key(kind, tag))
            .map_err(|e| self.group_view(e))
    }

    /// The bytes of one segment for `dtype`: `segment_bytes` rounded down to whole elements,
    /// at least one element.
    pub(crate) fn segment_bytes(&self, dtype: DType) -> usize {
        let size = dtype.size_bytes();
        (self.inner.segment_bytes / size).max(1) * size
    }

    /// Sends `bytes` to `peer` as consecutive data frames of at most one segment each (an
    /// empty block sends nothing). The receiver knows the length from the validated
    /// descriptors, so it knows how many frames to expect.
    pub(crate) fn send_data(
        &self,
        peer: usize,
        dtype: DType,
        tag: u32,
        bytes: &[u8],
    ) -> Result<()> {
        for segment in bytes.chunks(self.segment_bytes(dtype)) {
            self.send_frame(peer, FrameKind::Data, dtype, tag, segment)?;
        }
        Ok(())
    }

    /// Receives `dst.len()` bytes from `peer` as [`Link::send_data`] sent them, handing each
    /// segment and its destination to `apply` (a copy, or a reduction). Every frame's dtype is
    /// checked, and its length must be whole elements that fit in what is still missing, so
    /// the sender's segment size need not match this rank's.
    pub(crate) fn recv_data(
        &self,
        peer: usize,
        dtype: DType,
        tag: u32,
        dst: &mut [u8],
        mut apply: impl FnMut(&mut [u8], &[u8]) -> Result<()>,
    ) -> Result<()> {
        let mut filled = 0;
        while filled < dst.len() {
            filled += self.recv_segment(peer, dtype, tag, &mut dst[filled..], &mut apply)?;
        }
        Ok(())
    }

    /// Receives `dst.len()` bytes from `peer` as [`Link::recv_data`] with a plain copy would,
    /// but lends `dst` to the reader thread ([`PostedRecv`]) so the payloads land in it
    /// directly; `progress` sees every newly filled range in order (a broadcast forwards it).
    pub(crate) fn recv_copy(
        &self,
        peer: usize,
        dtype: DType,
        tag: u32,
        dst: &mut [u8],
        progress: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        self.recv_copy_with(peer, dtype, tag, dst, true, progress)
    }

    /// [`Link::recv_copy`] for a receiver that forwards nothing (a broadcast leaf): over TCP
    /// the post is quiet ([`PostedRecv::post_quiet`]), so the op thread sleeps until the whole
    /// buffer is in instead of waking once per segment.
    pub(crate) fn recv_into(
        &self,
        peer: usize,
        dtype: DType,
        tag: u32,
        dst: &mut [u8],
    ) -> Result<()> {
        self.recv_copy_with(peer, dtype, tag, dst, false, |_| Ok(()))
    }

    /// [`Link::recv_copy`], with `wake_each` false when `progress` need not see each
    /// segment as it lands (TCP only; the shared-memory path copies segment by segment on
    /// this thread anyway).
    fn recv_copy_with(
        &self,
        peer: usize,
        dtype: DType,
        tag: u32,
        dst: &mut [u8],
        wake_each: bool,
        mut progress: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let world = self.world(peer)?;
        if self.shm(world, FrameKind::Data).is_some() {
            // Segment by segment, `progress` outside the ring's lock (it may forward).
            let mut filled = 0;
            while filled < dst.len() {
                let mut copy = |to: &mut [u8], from: &[u8]| {
                    to.copy_from_slice(from);
                    Ok(())
                };
                let n = self.recv_segment(peer, dtype, tag, &mut dst[filled..], &mut copy)?;
                progress(&dst[filled..filled + n])?;
                filled += n;
            }
            return Ok(());
        }
        let key = self.key(FrameKind::Data, tag);
        let transport = &self.inner.transport;
        let posted = if wake_each {
            PostedRecv::post(transport, world, key, dtype, dst)
        } else {
            PostedRecv::post_quiet(transport, world, key, dtype, dst)
        };
        let outcome = posted
            .wait(&self.budget, &mut progress)
            .map_err(|e| self.group_view(e))?;
        self.finish_fallback(peer, dtype, tag, dst, outcome, progress)
    }

    /// Lends `target` to the reader thread of group rank `peer` for this op's data frames
    /// under `tag` ([`PostedRecv::post_prefix`]); [`Link::wait_lent`] finishes it.
    pub(crate) fn post<'b>(
        &self,
        peer: usize,
        tag: u32,
        mode: PostMode,
        target: PostTarget<'b>,
    ) -> Result<PostedRecv<'b>>
    where
        'a: 'b,
    {
        let world = self.world(peer)?;
        let inner: &'a Inner = self.inner;
        let slot = (world, self.key(FrameKind::Data, tag));
        if let Some((_, channel)) = self.shm(world, FrameKind::Data) {
            // A zero-byte TCP post only carries the buffer's borrow; the shared-memory
            // channel gets the destination itself (see `ShmPeer::post`).
            let PostTarget { buffer, len, own } = target;
            let len = len.min(buffer.len());
            let own = own.filter(|own| own.len() >= len);
            let own_base = own.map(<[u8]>::as_ptr);
            let empty = PostTarget {
                buffer,
                len: 0,
                own,
            };
            let posted = PostedRecv::post_prefix(&inner.transport, slot, mode, empty);
            let apply = match mode {
                PostMode::Copy(dtype) => Apply::Copy(dtype),
                PostMode::Reduce(plan) => Apply::Reduce(plan),
            };
            // SAFETY: `posted` holds the exclusive borrow of the whole buffer (at least
            // `len` bytes, clamped above) and the shared borrow of `own` (at least `len`
            // bytes, filtered above) until `wait_lent` consumes it; `wait_lent` waits for the
            // channel's post (which withdraws it) before handing the buffer back, and a post
            // that is never waited for is withdrawn when this link drops (`Drop for Link`),
            // before this op's buffers can be used again. The destination pointer is the
            // post's own base, from which every access to the lent buffer derives.
            unsafe { channel.post(slot.1, posted.base(), own_base, len, apply) };
            return Ok(posted);
        }
        Ok(PostedRecv::post_prefix(
            &inner.transport,
            slot,
            mode,
            target,
        ))
    }

    /// Waits for a post of [`Link::post`] to fill, handing each newly filled range to
    /// `progress` (see [`PostedRecv::wait`]); a frame that did not fit is received through the
    /// mailbox like [`Link::recv_data`] (reported as its typed error there), so the post is
    /// complete when this returns `Ok`. Gives the whole lent buffer back.
    pub(crate) fn wait_lent<'b>(
        &self,
        posted: PostedRecv<'b>,
        peer: usize,
        tag: u32,
        mode: PostMode,
        len: usize,
        mut progress: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<&'b mut [u8]> {
        let world = self.world(peer)?;
        if let Some((_, channel)) = self.shm(world, FrameKind::Data) {
            let key = self.key(FrameKind::Data, tag);
            let dtype = match mode {
                PostMode::Copy(dtype) => dtype,
                PostMode::Reduce(plan) => plan.dtype(),
            };
            let op = self.op;
            let judge = |header: &FrameHeader, room: usize| {
                judge_segment(op, peer, world, dtype, header, room)
            };
            let waited = channel.wait_post(key, &self.shm_watch(), &judge, &mut progress);
            // The TCP post is zero bytes long, so this hands the buffer back at once.
            let Lent { buffer, .. } = posted
                .wait_lent(&self.budget, |_| Ok(()))
                .map_err(|e| self.group_view(e))?;
            waited.map_err(|e| self.shm_error(channel, e))?;
            return Ok(buffer);
        }
        let Lent {
            outcome,
            buffer,
            own,
        } = posted
            .wait_lent(&self.budget, &mut progress)
            .map_err(|e| self.group_view(e))?;
        if let PostedOutcome::Fallback { filled } = outcome {
            let dtype = match mode {
                PostMode::Copy(dtype) => dtype,
                PostMode::Reduce(plan) => plan.dtype(),
            };
            let end = len.min(buffer.len());
            let rest = &mut buffer[filled..end];
            let mut at = filled;
            self.recv_data(peer, dtype, tag, rest, |to, from| {
                match (mode, own) {
                    (PostMode::Copy(_), _) => to.copy_from_slice(from),
                    (PostMode::Reduce(plan), None) => plan.combine(to, from)?,
                    (PostMode::Reduce(plan), Some(own)) => {
                        let end = at + to.len();
                        let own = own.get(at..end).ok_or(Error::LengthMismatch {
                            op: self.op,
                            role: crate::op::BufferRole::Input,
                            expected: end,
                            got: own.len(),
                        })?;
                        plan.combine_from(to, own, from)?;
                    }
                }
                at += to.len();
                progress(to)
            })?;
        }
        Ok(buffer)
    }

    /// After a [`PostedOutcome::Fallback`], receives the rest through the mailbox, which
    /// reports the frame that did not fit as the typed error [`Link::recv_data`] gives.
    fn finish_fallback(
        &self,
        peer: usize,
        dtype: DType,
        tag: u32,
        dst: &mut [u8],
        outcome: PostedOutcome,
        mut progress: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        match outcome {
            PostedOutcome::Complete => Ok(()),
            PostedOutcome::Fallback { filled } => {
                self.recv_data(peer, dtype, tag, &mut dst[filled..], |to, from| {
                    to.copy_from_slice(from);
                    progress(from)
                })
            }
        }
    }

    /// One copying step of a pairwise algorithm (an all-gather step): posts `incoming` for
    /// direct delivery ([`PostedRecv`]), sends `outgoing` while the reader thread fills it,
    /// then waits for the rest.
    pub(crate) fn exchange_copy(&self, step: Exchange<'_>, incoming: &mut [u8]) -> Result<()> {
        let world = self.world(step.from)?;
        if self.shm(world, FrameKind::Data).is_some() {
            // No reader thread to fill a post: interleave segments out and in instead.
            return self.exchange(step, incoming, |to, from| {
                to.copy_from_slice(from);
                Ok(())
            });
        }
        let key = self.key(FrameKind::Data, step.tag);
        let posted = PostedRecv::post(&self.inner.transport, world, key, step.dtype, incoming);
        self.send_data(step.to, step.dtype, step.tag, step.outgoing)?;
        let outcome = posted
            .wait(&self.budget, |_| Ok(()))
            .map_err(|e| self.group_view(e))?;
        self.finish_fallback(step.from, step.dtype, step.tag, incoming, outcome, |_| {
            Ok(())
        })
    }

    /// Receives one data frame from `peer` into the front of `missing` (see
    /// [`Link::recv_data`]) and returns how many bytes it filled.
    fn recv_segment(
        &self,
        peer: usize,
        dtype: DType,
        tag: u32,
        missing: &mut [u8],
        apply: &mut impl FnMut(&mut [u8], &[u8]) -> Result<()>,
    ) -> Result<usize> {
        let world = self.world(peer)?;
        if let Some((_, channel)) = self.shm(world, FrameKind::Data) {
            let key = self.key(FrameKind::Data, tag);
            let mut sink = SegmentSink {
                op: self.op,
                peer,
                world,
                dtype,
                missing,
                apply,
            };
            return self.shm_recv_segment(channel, key, &mut sink);
        }
        let frame = self.recv_frame(peer, FrameKind::Data, tag)?;
        if frame.header.dtype != dtype {
            return Err(Error::DTypeMismatch {
                op: self.op,
                role: crate::op::BufferRole::Peer { rank: peer },
                expected: dtype,
                got: frame.header.dtype,
            });
        }
        let len = frame.payload.len();
        if len == 0 || len > missing.len() || len % dtype.size_bytes() != 0 {
            return Err(Error::Protocol {
                peer: Some(peer),
                violation: ProtocolViolation::PayloadLengthMismatch {
                    declared: missing.len() as u64,
                    actual: len as u64,
                },
            });
        }
        apply(&mut missing[..len], &frame.payload)?;
        self.inner.transport.recycle(frame.payload);
        Ok(len)
    }

    /// One step of a pairwise algorithm: sends `outgoing` to `to` while receiving
    /// `incoming.len()` bytes from `from` (as [`Link::recv_data`]), alternating one segment
    /// out and one in, so the reduction or copy of segment `i` overlaps the kernel moving
    /// segment `i + 1` instead of waiting for the whole block to be sent first. Sends never
    /// wait for the receiver, so two ranks exchanging with each other cannot deadlock.
    pub(crate) fn exchange(
        &self,
        step: Exchange<'_>,
        incoming: &mut [u8],
        mut apply: impl FnMut(&mut [u8], &[u8]) -> Result<()>,
    ) -> Result<()> {
        let mut segments = step.outgoing.chunks(self.segment_bytes(step.dtype));
        let mut filled = 0;
        loop {
            let sent = match segments.next() {
                Some(segment) => {
                    self.send_frame(step.to, FrameKind::Data, step.dtype, step.tag, segment)?;
                    true
                }
                None => false,
            };
            let received = filled < incoming.len();
            if received {
                filled += self.recv_segment(
                    step.from,
                    step.dtype,
                    step.tag,
                    &mut incoming[filled..],
                    &mut apply,
                )?;
            }
            if !sent && !received {
                return Ok(());
            }
        }
    }

    /// Phase 0: sends this rank's descriptor (with its local fault, in the peers' view) to
    /// every peer, receives theirs, and runs the same checks as `local` on every rank, so an
    /// argument error anywhere fails the op everywhere before data moves. Returns every
    /// rank's descriptor, by group rank.
    pub(crate) fn open(&self, desc: Desc, faults: Faults) -> Result<Vec<Desc>> {
        self.open_eager(desc, faults, || Ok(()))
    }

    /// [`Link::open`], but once this rank's descriptors are out and it has no fault of its
    /// own, `eager` runs before the peers' descriptors are read: the latency path of small
    /// all-reduces sends its first data frames there, overlapping phase 0 with the first
    /// round instead of paying one more round trip. Those frames are filed under this op's
    /// seq, so a peer that fails validation never reads them (they stay in its mailbox: at
    /// most one small message per failed op).
    pub(crate) fn open_eager(
        &self,
        mut desc: Desc,
        faults: Faults,
        eager: impl FnOnce() -> Result<()>,
    ) -> Result<Vec<Desc>> {
        let me = self.rank();
        desc.fault = faults.first.as_ref().map(|e| peer_view(e, self.op, me));
        desc.knobs = Some(self.inner.algorithm_knobs());
        let wire = descriptor::encode(&desc);
        for peer in (0..self.size()).filter(|&p| p != me) {
            self.send_frame(peer, FrameKind::Descriptor, DType::U8, 0, &wire)?;
        }
        if faults.first.is_none() {
            eager()?;
        }
        let mut descs = Vec::with_capacity(self.size());
        for peer in 0..self.size() {
            let peer_desc = if peer == me {
                descriptor::decode(&wire, me)?
            } else {
                let frame = self.recv_frame(peer, FrameKind::Descriptor, 0)?;
                descriptor::decode(&frame.payload, peer)?
            };
            descs.push(peer_desc);
        }
        let views: Vec<Option<&Desc>> = descs.iter().map(Some).collect();
        validate(me, self.seq, self.op, &views, faults.first)?;
        Ok(descs)
    }
}

// Posts an algorithm did not wait for (it returned early with an error) are withdrawn from
// the shared-memory channels when the op's link goes, so no channel keeps a pointer into a
// buffer that the op is about to give back.
impl Drop for Link<'_> {
    fn drop(&mut self) {
        if let Some(links) = self.inner.shm.as_deref() {
            links.withdraw_op(self.inner.group_id, self.seq);
        }
    }
}
