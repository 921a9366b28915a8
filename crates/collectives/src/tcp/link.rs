//! [`Link`]: what one running op of a TCP group uses to talk to its peers: the phase-0
//! descriptor exchange (validated with the same checks as `local`) and segmented data
//! transfers, all addressed by group rank and filed under the op's (group, seq).

use std::sync::Arc;

use super::communicator::Inner;
use super::descriptor;
use super::frame::{FrameHeader, FrameKind};
use super::posted::{Lent, PostMode, PostTarget, PostedOutcome, PostedRecv};
use super::transport::{MailboxKey, WaitBudget};
use crate::dtype::DType;
use crate::engine::JobContext;
use crate::error::{Error, ProtocolViolation, Result};
use crate::local::group::{Desc, Post};
use crate::local::ops::Faults;
use crate::local::validate::{peer_view, validate};
use crate::op::OpKind;

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
        self.inner
            .transport
            .send(self.op, world, header, payload)
            .map_err(|e| self.group_view(e))
    }

    /// Waits for one frame from group rank `peer`.
    pub(crate) fn recv_frame(
        &self,
        peer: usize,
        kind: FrameKind,
        tag: u32,
    ) -> Result<super::transport::Frame> {
        let world = self.world(peer)?;
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
        mut progress: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let world = self.world(peer)?;
        let key = self.key(FrameKind::Data, tag);
        let posted = PostedRecv::post(&self.inner.transport, world, key, dtype, dst);
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
        let wire = descriptor::encode(&desc);
        for peer in (0..self.size()).filter(|&p| p != me) {
            self.send_frame(peer, FrameKind::Descriptor, DType::U8, 0, &wire)?;
        }
        if faults.first.is_none() {
            eager()?;
        }
        let mut posts = Vec::with_capacity(self.size());
        for peer in 0..self.size() {
            let peer_desc = if peer == me {
                descriptor::decode(&wire, me)?
            } else {
                let frame = self.recv_frame(peer, FrameKind::Descriptor, 0)?;
                descriptor::decode(&frame.payload, peer)?
            };
            posts.push(Arc::new(Post {
                desc: Some(peer_desc),
                data: None,
                group: None,
            }));
        }
        validate(me, self.seq, self.op, &posts, faults.first)?;
        Ok(posts
            .into_iter()
            .map(|post| {
                // invariant: `validate` only borrowed the posts, so each Arc is unique here.
                Arc::try_unwrap(post)
                    .ok()
                    .and_then(|p| p.desc)
                    .unwrap_or_else(|| Desc::new(self.op))
            })
            .collect())
    }
}
