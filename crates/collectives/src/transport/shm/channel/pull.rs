//! The receiving side's reads out of the ring: slot headers, payloads streamed into a
//! sink in chunks, lent payloads pulled straight from the sender, whole messages.

use super::*;

impl ShmPeer {
    /// Reads and validates the header at the consumer's tail (all its bytes are available)
    /// and releases its slot.
    pub(super) fn read_header(&self, rx: &mut Consumer) -> Result<(FrameHeader, Body)> {
        let mut slot = [0u8; SLOT_HEADER_BYTES];
        if !rx.read(0, &mut slot) {
            return Err(self.corrupt(Corrupt { in_flight: 0 }));
        }
        let decoded = self.decode_slot(&slot);
        let decoded = self.mid_message(decoded)?;
        rx.release(SLOT_HEADER_BYTES);
        Ok(decoded)
    }

    /// The header and body kind of a message slot. A lent body is refused unless the pair
    /// agreed on cross-memory reads.
    pub(super) fn decode_slot(
        &self,
        slot: &[u8; SLOT_HEADER_BYTES],
    ) -> Result<(FrameHeader, Body)> {
        let mut bytes = [0u8; FRAME_HEADER_BYTES];
        bytes.copy_from_slice(&slot[..FRAME_HEADER_BYTES]);
        let header = FrameHeader::decode(&bytes, self.peer, self.max_payload)?;
        let mut mark = [0u8; 4];
        mark.copy_from_slice(&slot[BODY_AT..BODY_AT + 4]);
        let body = match u32::from_le_bytes(mark) {
            BODY_INLINE => Body::Inline,
            BODY_LENT if self.cma.is_some() => Body::Lent,
            _ => {
                return Err(Error::Protocol {
                    peer: Some(self.peer),
                    violation: ProtocolViolation::ReservedNotZero,
                });
            }
        };
        Ok((header, body))
    }

    /// Streams the payload of `header` (whose slot is released) into `sink`, then releases
    /// the padding, and returns `true`; `false` (nothing delivered) for a lend its sender
    /// cancelled, whose payload follows as the next message of its key. A refused message or
    /// a failing sink skips the rest and returns the error.
    pub(super) fn stream(
        &self,
        rx: &mut Consumer,
        header: FrameHeader,
        body: Body,
        watch: &dyn Watch,
        sink: &mut dyn Sink,
    ) -> Result<bool> {
        if body == Body::Lent {
            return self.pull_lent(rx, header, watch, sink);
        }
        // invariant: decode checked payload_bytes <= max_payload, an allocatable size.
        let len = usize::try_from(header.payload_bytes).unwrap_or(usize::MAX);
        let mut failure = sink.accept(&header).err();
        let granule = sink.granule(&header).max(1);
        let goal = chunk_goal(rx.capacity()).max(granule);
        let mut done = 0;
        while done < len {
            let want = (len - done).min(goal).max(granule.min(len - done));
            let waited = self.wait_data(rx, want, watch, None);
            self.mid_message(waited)?;
            let available = rx.available().map_err(|c| self.corrupt(c))?.min(len - done);
            let run = rx.contiguous(0, available);
            let cut = if done + run.len() == len {
                run.len()
            } else {
                run.len() / granule * granule
            };
            if cut == 0 {
                continue;
            }
            if failure.is_none()
                && let Err(error) = sink.take(done, &run[..cut])
            {
                failure = Some(error);
            }
            rx.release(cut);
            done += cut;
        }
        let padding = padded(len) - len;
        if padding > 0 {
            let waited = self.wait_data(rx, padding, watch, None);
            self.mid_message(waited)?;
            rx.release(padding);
        }
        match failure {
            Some(error) => Err(error),
            None => Ok(true),
        }
    }

    /// Receives a lent payload (its header's slot is released): reads the descriptor, claims
    /// it, lets `sink` copy the payload out of the sender ([`Sink::pull`]), checks that the
    /// sender did not revoke its buffer meanwhile, and releases the descriptor, which tells
    /// the sender its buffer is free; returns `true`. A descriptor its sender cancelled is
    /// released unread and gives `false`. A refused message or a failing sink releases it
    /// without (all of) the copy and returns the sink's error; a failed read poisons the
    /// channel.
    pub(super) fn pull_lent(
        &self,
        rx: &mut Consumer,
        header: FrameHeader,
        watch: &dyn Watch,
        sink: &mut dyn Sink,
    ) -> Result<bool> {
        let waited = self.wait_data(rx, LENT_BYTES, watch, None);
        self.mid_message(waited)?;
        let mut word = [0u8; 8];
        if !rx.read(0, &mut word) {
            return Err(self.corrupt(Corrupt { in_flight: 0 }));
        }
        let address = u64::from_le_bytes(word);
        // invariant: the tail is 8-aligned here (16-aligned message start + 48) and the whole
        // descriptor is available, so the claim word exists.
        let claim = rx
            .word(CLAIM_AT - SLOT_HEADER_BYTES)
            .ok_or(Error::Aborted { op: watch.op() });
        let claim = self.mid_message(claim)?;
        match claim.compare_exchange(CLAIM_OPEN, CLAIM_TAKEN, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {}
            Err(CLAIM_CANCELLED) => {
                rx.release(LENT_BYTES);
                return Ok(false);
            }
            Err(_) => {
                self.poisoned.store(true, Ordering::SeqCst);
                return Err(Error::Protocol {
                    peer: Some(self.peer),
                    violation: ProtocolViolation::ReservedNotZero,
                });
            }
        }
        // invariant: only pairs that agreed on cross-memory reads decode a lent body.
        let remote = self.cma.map(|cma| cma.remote);
        let mut failed_read = false;
        let mut outcome = sink.accept(&header);
        if outcome.is_ok() {
            let mut read = |at: usize, dst: &mut [u8]| -> Result<()> {
                let Some(remote) = remote else {
                    return Err(Error::Aborted { op: watch.op() });
                };
                let read = remote.read(address.wrapping_add(at as u64), dst);
                read.map_err(|source| {
                    failed_read = true;
                    self.read_error(watch, source)
                })
            };
            outcome = sink.pull(&header, &mut read);
        }
        if failed_read {
            self.poisoned.store(true, Ordering::SeqCst);
            return outcome.map(|()| true);
        }
        if rx.revoked() {
            self.poisoned.store(true, Ordering::SeqCst);
            return Err(Error::PeerLost {
                op: watch.op(),
                peer: self.peer,
            });
        }
        rx.release(LENT_BYTES);
        crate::transport::shm::cma::count_read();
        outcome.map(|()| true)
    }

    /// A failed cross-memory read as an error: the peer is gone (`ESRCH`), or the read
    /// failed otherwise (a bad address in a descriptor, a denial).
    pub(super) fn read_error(&self, watch: &dyn Watch, source: std::io::Error) -> Error {
        // A peer that is exiting unmaps its memory before its sockets close: what the watch
        // knows about it comes first.
        if let Some(error) = watch.interrupted(self.peer) {
            return error;
        }
        if source.raw_os_error() == Some(libc::ESRCH) {
            return Error::PeerLost {
                op: watch.op(),
                peer: self.peer,
            };
        }
        Error::Io {
            action: IoAction::SharedMemory,
            peer: Some(self.peer),
            source,
        }
    }

    /// Copies a whole message out of the ring (or the sender) for the stash (`None` for a
    /// cancelled lend).
    pub(super) fn take_whole(
        &self,
        rx: &mut Consumer,
        header: FrameHeader,
        body: Body,
        watch: &dyn Watch,
    ) -> Result<Option<Stashed>> {
        let mut sink = CopyOut::new(self.peer);
        if !self.stream(rx, header, body, watch, &mut sink)? {
            return Ok(None);
        }
        Ok(Some(Stashed {
            header,
            payload: sink.bytes,
        }))
    }
}

pub(super) fn deliver_stashed(message: Stashed, sink: &mut dyn Sink) -> Result<FrameHeader> {
    sink.accept(&message.header)?;
    if !message.payload.is_empty() {
        sink.take(0, &message.payload)?;
    }
    Ok(message.header)
}

/// A sink that copies the payload into a vector.
pub(super) struct CopyOut {
    /// The sender's world rank, for the error when its payload cannot be held.
    peer: usize,
    pub(super) bytes: Vec<u8>,
}

impl CopyOut {
    pub(super) fn new(peer: usize) -> CopyOut {
        CopyOut {
            peer,
            bytes: Vec::new(),
        }
    }
}

impl Sink for CopyOut {
    fn accept(&mut self, header: &FrameHeader) -> Result<()> {
        // decode checked payload_bytes <= max_payload; the allocator may still refuse it.
        let len = usize::try_from(header.payload_bytes).unwrap_or(usize::MAX);
        self.bytes
            .try_reserve_exact(len)
            .map_err(|_| payload_alloc_error(self.peer, header.payload_bytes))
    }
    fn take(&mut self, _offset: usize, bytes: &[u8]) -> Result<()> {
        self.bytes.extend_from_slice(bytes);
        Ok(())
    }
    fn granule(&self, _header: &FrameHeader) -> usize {
        1
    }
    fn pull(&mut self, header: &FrameHeader, read: &mut Reader<'_>) -> Result<()> {
        let len = usize::try_from(header.payload_bytes).unwrap_or(usize::MAX);
        self.bytes
            .try_reserve_exact(len.saturating_sub(self.bytes.len()))
            .map_err(|_| payload_alloc_error(self.peer, header.payload_bytes))?;
        self.bytes.resize(len, 0);
        read(0, &mut self.bytes)
    }
}
