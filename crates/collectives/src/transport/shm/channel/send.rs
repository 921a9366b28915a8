//! The sending side of a channel: messages written inline into the ring, or lent for a
//! single-copy pull (cross-memory attach), waiting for space as the reader drains.

use super::*;

impl ShmPeer {
    /// Sends one message: the header, then the payload as space frees up. `stall` runs while
    /// the ring is full (see the module docs).
    pub(crate) fn send(
        &self,
        header: FrameHeader,
        payload: &[u8],
        watch: &dyn Watch,
        stall: &mut dyn FnMut(),
        doorbells: &[&AtomicU32],
    ) -> Result<()> {
        let len = payload.len() as u64;
        if header.payload_bytes != len {
            return Err(Error::Protocol {
                peer: Some(self.peer),
                violation: ProtocolViolation::PayloadLengthMismatch {
                    declared: header.payload_bytes,
                    actual: len,
                },
            });
        }
        if len > self.max_payload {
            return Err(Error::Protocol {
                peer: Some(self.peer),
                violation: ProtocolViolation::FrameTooLarge {
                    limit: self.max_payload,
                    got: len,
                },
            });
        }
        self.healthy(watch)?;
        if let Some(error) = watch.refuses_send(self.peer) {
            return Err(error);
        }
        let mut tx = relock(&self.tx);
        let encoded = header.encode();
        let mut slot = [0u8; SLOT_HEADER_BYTES];
        slot[..FRAME_HEADER_BYTES].copy_from_slice(&encoded);
        if self.cma.is_some_and(|cma| payload.len() >= cma.min_bytes) {
            return self.send_lent(&mut tx, slot, payload, watch, stall, doorbells);
        }
        self.send_inline(&mut tx, &slot, payload, watch, stall)
    }

    /// Sends a message with its payload in the ring: the header, then the payload as space
    /// frees up.
    pub(super) fn send_inline(
        &self,
        tx: &mut Producer,
        slot: &[u8; SLOT_HEADER_BYTES],
        payload: &[u8],
        watch: &dyn Watch,
        stall: &mut dyn FnMut(),
    ) -> Result<()> {
        // Nothing of this message is in the ring yet, so a failure here leaves it clean.
        self.wait_space(tx, SLOT_HEADER_BYTES, watch, stall)?;
        if !tx.write(slot, 0) {
            return Err(self.corrupt(Corrupt { in_flight: 0 }));
        }
        tx.publish();
        let total = padded(payload.len());
        let goal = chunk_goal(tx.capacity()).max(PAYLOAD_ALIGN);
        let mut done = 0;
        while done < total {
            let step = self.wait_space(tx, (total - done).min(goal), watch, stall);
            self.mid_message(step)?;
            let free = tx.free().map_err(|c| self.corrupt(c))?;
            let chunk = free.min(total - done);
            let real_end = (done + chunk).min(payload.len());
            let bytes = &payload[done.min(real_end)..real_end];
            if !tx.write(bytes, chunk - bytes.len()) {
                return Err(self.corrupt(Corrupt { in_flight: 0 }));
            }
            tx.publish();
            done += chunk;
        }
        Ok(())
    }

    /// Sends a message whose payload stays in `payload`: the header and the descriptor go
    /// into the ring in one piece, then this waits (draining the incoming rings, like a full
    /// ring) until the receiver has released the descriptor, which it does only after copying
    /// the payload.
    ///
    /// A receiver that is not reading must not hold the sender up (sends of messages that
    /// fit the ring never wait for the receiver, and an op may send before its peers have
    /// validated it): if the receiver has not claimed the descriptor within
    /// [`LEND_PATIENCE`], the sender cancels it (the receiver then skips it) and sends the
    /// payload inline right behind it. Once claimed, the sender waits for the release; if
    /// that wait fails (deadline, abort, peer lost), it revokes its lent buffers and poisons
    /// the channel, since the caller's buffer may change once this returns (the receiver
    /// checks the revocation after every read and fails instead of using what it read).
    pub(super) fn send_lent(
        &self,
        tx: &mut Producer,
        mut slot: [u8; SLOT_HEADER_BYTES],
        payload: &[u8],
        watch: &dyn Watch,
        stall: &mut dyn FnMut(),
        doorbells: &[&AtomicU32],
    ) -> Result<()> {
        let inline = slot;
        slot[BODY_AT..BODY_AT + 4].copy_from_slice(&BODY_LENT.to_le_bytes());
        let mut message = [0u8; SLOT_HEADER_BYTES + LENT_BYTES];
        message[..SLOT_HEADER_BYTES].copy_from_slice(&slot);
        let address = payload.as_ptr() as u64;
        message[SLOT_HEADER_BYTES..SLOT_HEADER_BYTES + 8].copy_from_slice(&address.to_le_bytes());
        message[CLAIM_AT..CLAIM_AT + 8].copy_from_slice(&CLAIM_OPEN.to_le_bytes());
        // Nothing of this message is in the ring yet, so a failure here leaves it clean.
        self.wait_space(tx, message.len(), watch, stall)?;
        let claim_at = tx.written() + CLAIM_AT as u64;
        if !tx.write(&message, 0) {
            return Err(self.corrupt(Corrupt { in_flight: 0 }));
        }
        tx.publish();
        let end = tx.written();
        let released = || tx.released(end).map_err(|c| self.corrupt(c));
        let patient = WaitFor {
            word: tx.park_word(),
            peer: self.peer,
            watch,
            until: Some(Instant::now() + LEND_PATIENCE),
            doorbells,
        };
        let first = wait_until(&patient, released, stall);
        if matches!(first, Ok(Waited::Ready)) {
            return Ok(());
        }
        // invariant: messages start 16-aligned, so the claim word is 8-aligned.
        let claim = tx.word(claim_at).ok_or(Error::Aborted { op: watch.op() })?;
        let cancelled = claim
            .compare_exchange(
                CLAIM_OPEN,
                CLAIM_CANCELLED,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        if cancelled {
            crate::transport::shm::cma::count_cancel();
            // The receiver will skip the descriptor and never read the buffer.
            return match first {
                Err(error) => Err(error),
                Ok(_) => self.send_inline(tx, &inline, payload, watch, stall),
            };
        }
        let claimed = match first {
            Err(error) => Err(error),
            Ok(_) => {
                let what = WaitFor {
                    until: None,
                    ..patient
                };
                wait_until(&what, released, stall).map(|_| ())
            }
        };
        if claimed.is_err() {
            tx.revoke();
            self.poisoned.store(true, Ordering::SeqCst);
        }
        claimed
    }

    pub(super) fn wait_space(
        &self,
        tx: &Producer,
        want: usize,
        watch: &dyn Watch,
        stall: &mut dyn FnMut(),
    ) -> Result<()> {
        // Parks on the ring's own word only: with the ring's slack, also waking for every
        // incoming message (as a lent send does) measured slower at world 4 (docs/shm.md).
        let what = WaitFor {
            word: tx.park_word(),
            peer: self.peer,
            watch,
            until: None,
            doorbells: &[],
        };
        let ready = || tx.free().map(|f| f >= want).map_err(|c| self.corrupt(c));
        wait_until(&what, ready, stall).map(|_| ())
    }
}
