//! [`PostedRecv`]: a receive whose destination is lent to the peer's reader thread, so data
//! frames are read from the socket straight into the caller's buffer instead of into a
//! mailbox buffer and then copied. On a loaded machine every copy of a large message is
//! CPU time taken from the transfer itself, so the copying steps (all-gather, the second half
//! of all-reduce, broadcast) use this path.
//!
//! Protocol with the reader thread (see `read_into_posted` in `transport/reader.rs`): a post
//! `(peer, key) -> Posted{base, len, filled, dtype, writing}` lives in the transport state.
//! The reader, under the lock, claims the next `len` bytes of a fitting frame by setting
//! `writing`, reads them outside the lock, then (under the lock) clears `writing` and adds
//! to `filled`. The waiter never touches bytes at or past `filled`, and never lets go of its
//! buffer (returns or drops) until it has removed the post while `writing` is clear.

use std::marker::PhantomData;
use std::time::{Duration, Instant};

use super::transport::{
    Destination, MailboxKey, Posted, Source, Transport, WaitBudget, wait_error,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce::ReducePlan;

/// How a posted receive ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PostedOutcome {
    /// Every byte arrived.
    Complete,
    /// A frame that does not fit the post (another dtype, a length that is not whole elements
    /// or too long) is queued for the key: the first `filled` bytes arrived, and the caller
    /// must receive the rest through the mailbox, which judges that frame.
    Fallback { filled: usize },
}

/// What a post does with the payloads that arrive for it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PostMode {
    /// Copies them into the destination.
    Copy(DType),
    /// Combines them into the destination (`dst = dst ⊕ payload`) with the plan's combine
    /// step; the destination holds this rank's (prepared) contribution when posted.
    Reduce(ReducePlan),
}

/// What a post lends: the first `len` bytes of `buffer`, and for a reduction optionally the
/// contribution `own` (at least `len` bytes) to combine each payload with.
pub(crate) struct PostTarget<'a> {
    pub(crate) buffer: &'a mut [u8],
    pub(crate) len: usize,
    pub(crate) own: Option<&'a [u8]>,
}

/// A finished post: its outcome, the whole buffer it was lent, and its `own` source.
pub(crate) struct Lent<'a> {
    pub(crate) outcome: PostedOutcome,
    pub(crate) buffer: &'a mut [u8],
    pub(crate) own: Option<&'a [u8]>,
}

/// A destination lent to the reader thread of one peer for one mailbox key.
pub(crate) struct PostedRecv<'a> {
    transport: &'a Transport,
    slot: (usize, MailboxKey),
    base: *mut u8,
    len: usize,
    /// The length of the whole lent buffer (`len` is the posted prefix).
    full: usize,
    /// The contribution combined from, for `dst = own ⊕ payload` posts.
    own: Option<&'a [u8]>,
    /// How many leading bytes the caller has been shown (or that were copied in at post time).
    seen: usize,
    /// Whether the post is still in the transport's state.
    active: bool,
    _buffer: PhantomData<&'a mut [u8]>,
}

impl<'a> PostedRecv<'a> {
    /// Lends `dst` for the data frames `peer` sends under `key`. Frames already queued for
    /// the key are copied in first (in order, as long as they fit); the rest land directly.
    pub(crate) fn post(
        transport: &'a Transport,
        peer: usize,
        key: MailboxKey,
        dtype: DType,
        dst: &'a mut [u8],
    ) -> PostedRecv<'a> {
        let len = dst.len();
        let target = PostTarget {
            buffer: dst,
            len,
            own: None,
        };
        PostedRecv::post_prefix(transport, (peer, key), PostMode::Copy(dtype), target)
    }

    /// [`PostedRecv::post`] for a caller that does nothing with the ranges as they arrive
    /// (a broadcast leaf): the reader thread wakes the waiter only once the destination is
    /// full (and on errors and mailbox deliveries, as always), not after every segment, so
    /// on a machine whose cores are busy moving the bytes the op thread does not take a
    /// core from the copy once per segment just to go back to sleep. The waiter still sees
    /// deadlines within 50 ms ([`PostedRecv::wait`] never sleeps longer).
    pub(crate) fn post_quiet(
        transport: &'a Transport,
        peer: usize,
        key: MailboxKey,
        dtype: DType,
        dst: &'a mut [u8],
    ) -> PostedRecv<'a> {
        let len = dst.len();
        let target = PostTarget {
            buffer: dst,
            len,
            own: None,
        };
        PostedRecv::post_with(transport, (peer, key), PostMode::Copy(dtype), target, false)
    }

    /// Lends the first `target.len` bytes of `target.buffer` (clamped to its length) for the
    /// data frames of `slot = (peer, key)`: copied in ([`PostMode::Copy`]) or combined by the
    /// reader thread ([`PostMode::Reduce`]) into the bytes already there, or, with
    /// `target.own`, combined with `own` (`dst = own ⊕ payload`, so the caller need not copy
    /// its contribution into the destination first). Frames already queued for the key are
    /// applied first (in order, as long as they fit); the rest land directly.
    /// [`PostedRecv::wait_lent`] hands the whole buffer back, so a pipelined algorithm can
    /// post it again for a later step.
    pub(crate) fn post_prefix(
        transport: &'a Transport,
        slot: (usize, MailboxKey),
        mode: PostMode,
        target: PostTarget<'a>,
    ) -> PostedRecv<'a> {
        PostedRecv::post_with(transport, slot, mode, target, true)
    }

    /// [`PostedRecv::post_prefix`], with `wake_each` saying whether the reader thread wakes
    /// the waiter after every segment (false: only once the prefix is full; see
    /// [`PostedRecv::post_quiet`]).
    fn post_with(
        transport: &'a Transport,
        slot: (usize, MailboxKey),
        mode: PostMode,
        target: PostTarget<'a>,
        wake_each: bool,
    ) -> PostedRecv<'a> {
        let PostTarget { buffer, len, own } = target;
        let len = len.min(buffer.len());
        // A source shorter than the prefix cannot be combined from: such a post combines in
        // place instead (no caller does this; the ring hands out equal lengths).
        let own = own.filter(|own| own.len() >= len).map(|own| &own[..len]);
        let (dtype, reduce) = match mode {
            PostMode::Copy(dtype) => (dtype, None),
            PostMode::Reduce(plan) => (plan.dtype(), Some(plan)),
        };
        let mut state = transport.shared.lock();
        let mut filled = 0;
        let mut spent = Vec::new();
        if let Some(queue) = state.mailbox.get_mut(&slot) {
            while let Some(frame) = queue.front() {
                let n = frame.payload.len();
                let fits = frame.header.dtype == dtype
                    && n > 0
                    && n.is_multiple_of(dtype.size_bytes())
                    && n <= len - filled;
                if !fits {
                    break;
                }
                let dst = &mut buffer[filled..filled + n];
                // The lengths agree and are whole elements (checked just above), so a combine
                // cannot fail; a failure would leave the frame for the fallback to report.
                let applied = match (reduce, own) {
                    (None, _) => {
                        dst.copy_from_slice(&frame.payload);
                        Ok(())
                    }
                    (Some(plan), None) => plan.combine(dst, &frame.payload),
                    (Some(plan), Some(own)) => {
                        plan.combine_from(dst, &own[filled..filled + n], &frame.payload)
                    }
                };
                if applied.is_err() {
                    break;
                }
                filled += n;
                if let Some(frame) = queue.pop_front() {
                    spent.push(frame.payload);
                }
            }
            if queue.is_empty() {
                state.mailbox.remove(&slot);
            }
        }
        let base = buffer.as_mut_ptr();
        let full = buffer.len();
        state.posted.insert(
            slot,
            Posted {
                base: Destination(base),
                len,
                filled,
                dtype,
                reduce,
                own: own.map(|own| Source(own.as_ptr())),
                writing: false,
                wake_each,
            },
        );
        drop(state);
        for payload in spent {
            transport.shared.recycle(payload);
        }
        PostedRecv {
            transport,
            slot,
            base,
            len,
            full,
            own,
            seen: 0,
            active: true,
            _buffer: PhantomData,
        }
    }

    /// [`PostedRecv::wait`], then hands the whole lent buffer back (all of it, not only the
    /// posted prefix) together with the outcome.
    pub(crate) fn wait_lent(
        self,
        budget: &WaitBudget,
        progress: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<Lent<'a>> {
        let (base, full, own) = (self.base, self.full, self.own);
        let outcome = self.wait(budget, progress)?;
        // SAFETY: `base..base + full` is the buffer borrowed exclusively for `'a` when it was
        // posted (`_buffer` keeps that borrow alive); `wait` returned, so the post is removed
        // and no reader thread writes there any more (it only ever writes while the post
        // exists and `writing` is set, and `wait` removes the post only with `writing` clear).
        let buffer = unsafe { std::slice::from_raw_parts_mut(base, full) };
        Ok(Lent {
            outcome,
            buffer,
            own,
        })
    }

    /// Waits until the whole destination is filled, handing every newly filled range to
    /// `progress` in order as it arrives (a broadcast forwards it), or until a frame that
    /// does not fit shows up ([`PostedOutcome::Fallback`]), or until the budget's deadline,
    /// a lost peer or an abort ends the wait with the same errors as [`Transport::recv`].
    pub(crate) fn wait(
        mut self,
        budget: &WaitBudget,
        mut progress: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<PostedOutcome> {
        let shared = &self.transport.shared;
        let mut state = shared.lock();
        loop {
            let Some(post) = state.posted.get(&self.slot) else {
                // invariant: only this handle removes its post, and it is still active.
                return Err(Error::Aborted { op: budget.op });
            };
            let (filled, writing) = (post.filled, post.writing);
            if filled > self.seen {
                drop(state);
                // SAFETY: bytes `seen..filled` of the lent buffer are written (by the post
                // itself or by the reader, whose writes happened before it raised `filled`
                // under the lock just taken), and nobody writes below `filled` again.
                let fresh = unsafe {
                    std::slice::from_raw_parts(self.base.add(self.seen), filled - self.seen)
                };
                progress(fresh)?;
                self.seen = filled;
                state = shared.lock();
                continue;
            }
            if filled == self.len && !writing {
                state.posted.remove(&self.slot);
                self.active = false;
                return Ok(PostedOutcome::Complete);
            }
            if !writing && state.mailbox.contains_key(&self.slot) {
                state.posted.remove(&self.slot);
                self.active = false;
                return Ok(PostedOutcome::Fallback { filled });
            }
            if let Some(error) = wait_error(&state, budget, self.slot.0) {
                if !writing {
                    state.posted.remove(&self.slot);
                    self.active = false;
                    return Err(error);
                }
                // The reader is inside a frame and still owns part of the buffer: cut the
                // connection so that its read ends now, then collect the error.
                drop(state);
                self.transport.shutdown_peer(self.slot.0);
                state = shared.lock();
            }
            let left = budget
                .deadline
                .saturating_duration_since(Instant::now())
                .clamp(Duration::from_millis(1), Duration::from_millis(50));
            state = shared
                .arrived
                .wait_timeout(state, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for PostedRecv<'_> {
    /// Takes the post back if [`PostedRecv::wait`] did not (it failed in `progress`, or was
    /// never called): waits for a reader that is inside a frame, first cutting that
    /// connection so the wait is short. The op has failed by then, and its group is out of
    /// step anyway.
    fn drop(&mut self) {
        if !self.active {
            return;
        }
        let shared = &self.transport.shared;
        let mut state = shared.lock();
        let mut cut = false;
        loop {
            match state.posted.get(&self.slot) {
                Some(post) if post.writing => {
                    if !cut {
                        drop(state);
                        self.transport.shutdown_peer(self.slot.0);
                        cut = true;
                        state = shared.lock();
                        continue;
                    }
                    state = shared
                        .arrived
                        .wait_timeout(state, Duration::from_millis(50))
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .0;
                }
                _ => {
                    state.posted.remove(&self.slot);
                    return;
                }
            }
        }
    }
}

// Used by the shared-memory transport (crate::transport::shm), which lends a posted buffer to its
// channel instead of a reader thread.
impl PostedRecv<'_> {
    /// The start of the lent buffer: the pointer every access to it derives from.
    pub(crate) fn base(&self) -> *mut u8 {
        self.base
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::OpKind;
    use crate::transport::tcp::frame::FrameHeader;
    use crate::transport::tcp::transport::tests::{budget, header, transports};
    use std::collections::VecDeque;

    fn data(seq: u64, len: usize, seed: u8) -> (FrameHeader, Vec<u8>) {
        let payload: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect();
        (header(seq, 0, len as u64), payload)
    }

    fn send(transport: &Transport, to: usize, frame: &(FrameHeader, Vec<u8>)) {
        transport
            .send(OpKind::AllGather, to, frame.0, &frame.1)
            .unwrap();
    }

    /// Waits (up to 5 s) until `transport`'s mailbox holds `count` frames from rank 0 under
    /// `key`. A post made earlier could race a frame the reader thread is still reading into
    /// the mailbox, and that frame would then be left to the fallback.
    fn wait_until_queued(transport: &Transport, key: MailboxKey, count: usize) {
        let queued = || {
            transport
                .shared
                .lock()
                .mailbox
                .get(&(0, key))
                .map_or(0, VecDeque::len)
        };
        let mut tries = 0;
        while queued() < count {
            tries += 1;
            assert!(tries < 1000, "frames never arrived");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn queued_frames_are_copied_in_and_later_ones_land_directly_in_order() {
        let ranks = transports(2, 1 << 16);
        let frames: Vec<_> = (0..4).map(|i| data(3, 1000, i)).collect();
        // Two frames arrive before the post (they queue in the mailbox), two after it.
        send(&ranks[0], 1, &frames[0]);
        send(&ranks[0], 1, &frames[1]);
        let key = MailboxKey::of(&frames[0].0);
        // Wait until both are filed, so the post finds them queued.
        wait_until_queued(&ranks[1], key, 2);
        let mut dst = vec![0u8; 4000];
        let posted = PostedRecv::post(&ranks[1], 0, key, DType::U8, &mut dst);
        send(&ranks[0], 1, &frames[2]);
        send(&ranks[0], 1, &frames[3]);
        let mut seen = Vec::new();
        let outcome = posted
            .wait(&budget(5_000), |fresh| {
                seen.extend_from_slice(fresh);
                Ok(())
            })
            .unwrap();
        assert_eq!(outcome, PostedOutcome::Complete);
        let expected: Vec<u8> = frames.iter().flat_map(|f| f.1.clone()).collect();
        assert_eq!(dst, expected);
        assert_eq!(seen, expected);
        assert!(ranks[1].shared.lock().posted.is_empty());
    }

    #[test]
    fn a_quiet_post_fills_in_order_and_shows_every_byte_once() {
        let ranks = transports(2, 1 << 16);
        let frames: Vec<_> = (0..4).map(|i| data(4, 1000, i)).collect();
        let key = MailboxKey::of(&frames[0].0);
        let mut dst = vec![0u8; 4000];
        let posted = PostedRecv::post_quiet(&ranks[1], 0, key, DType::U8, &mut dst);
        assert_eq!(
            ranks[1]
                .shared
                .lock()
                .posted
                .get(&(0, key))
                .map(|post| post.wake_each),
            Some(false)
        );
        for frame in &frames {
            send(&ranks[0], 1, frame);
        }
        let mut seen = Vec::new();
        let outcome = posted
            .wait(&budget(5_000), |fresh| {
                seen.extend_from_slice(fresh);
                Ok(())
            })
            .unwrap();
        assert_eq!(outcome, PostedOutcome::Complete);
        let expected: Vec<u8> = frames.iter().flat_map(|f| f.1.clone()).collect();
        assert_eq!(dst, expected);
        assert_eq!(seen, expected);
        assert!(ranks[1].shared.lock().posted.is_empty());
    }

    #[test]
    fn a_quiet_post_still_wakes_for_a_frame_that_does_not_fit() {
        let ranks = transports(2, 1 << 16);
        let first = data(5, 8, 1);
        let key = MailboxKey::of(&first.0);
        let mut dst = vec![0u8; 12];
        let started = Instant::now();
        let posted = PostedRecv::post_quiet(&ranks[1], 0, key, DType::U8, &mut dst);
        send(&ranks[0], 1, &first);
        // Longer than the 4 bytes still missing: it goes to the mailbox, which wakes the waiter.
        let oversized = data(5, 16, 2);
        send(&ranks[0], 1, &oversized);
        let outcome = posted.wait(&budget(5_000), |_| Ok(())).unwrap();
        assert_eq!(outcome, PostedOutcome::Fallback { filled: 8 });
        assert!(started.elapsed() < Duration::from_secs(3));
        assert_eq!(dst[..8], first.1[..]);
        let queued = ranks[1].recv(&budget(5_000), 0, key).unwrap();
        assert_eq!(queued.payload, oversized.1);
    }

    #[test]
    fn a_frame_that_does_not_fit_falls_back_to_the_mailbox() {
        let ranks = transports(2, 1 << 16);
        let first = data(0, 8, 1);
        send(&ranks[0], 1, &first);
        // Longer than what is still missing: the reader must not write it into the post.
        let oversized = data(0, 16, 2);
        send(&ranks[0], 1, &oversized);
        let key = MailboxKey::of(&first.0);
        // Both must be queued before the post: the first is then copied in from the mailbox.
        wait_until_queued(&ranks[1], key, 2);
        let mut dst = vec![0u8; 12];
        let posted = PostedRecv::post(&ranks[1], 0, key, DType::U8, &mut dst);
        let outcome = posted.wait(&budget(5_000), |_| Ok(())).unwrap();
        assert_eq!(outcome, PostedOutcome::Fallback { filled: 8 });
        assert_eq!(dst[..8], first.1[..]);
        assert_eq!(dst[8..], [0, 0, 0, 0]);
        let queued = ranks[1].recv(&budget(5_000), 0, key).unwrap();
        assert_eq!(queued.payload, oversized.1);
    }

    #[test]
    fn a_post_that_never_fills_times_out_and_hands_the_buffer_back() {
        let ranks = transports(2, 1 << 16);
        let key = MailboxKey::of(&header(9, 0, 0));
        let mut dst = vec![0u8; 64];
        let started = Instant::now();
        let posted = PostedRecv::post(&ranks[1], 0, key, DType::U8, &mut dst);
        let error = posted.wait(&budget(100), |_| Ok(())).unwrap_err();
        assert!(
            matches!(error, Error::Timeout { peer: Some(0), .. }),
            "{error:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(3));
        assert!(ranks[1].shared.lock().posted.is_empty());
        // A frame sent now is no longer written into the buffer: it queues in the mailbox.
        send(&ranks[0], 1, &(header(9, 0, 4), vec![1, 2, 3, 4]));
        let late = ranks[1].recv(&budget(5_000), 0, key).unwrap();
        assert_eq!(late.payload, vec![1, 2, 3, 4]);
        dst[0] = 5;
        assert_eq!(dst[..2], [5, 0]);
    }

    #[test]
    fn dropping_a_post_withdraws_it() {
        let ranks = transports(2, 1 << 16);
        let key = MailboxKey::of(&header(1, 0, 0));
        let mut dst = vec![0u8; 16];
        drop(PostedRecv::post(&ranks[1], 0, key, DType::U8, &mut dst));
        assert!(ranks[1].shared.lock().posted.is_empty());
        send(&ranks[0], 1, &(header(1, 0, 2), vec![8, 9]));
        assert_eq!(
            ranks[1].recv(&budget(5_000), 0, key).unwrap().payload,
            vec![8, 9]
        );
        assert_eq!(dst, vec![0u8; 16]);
    }
}
