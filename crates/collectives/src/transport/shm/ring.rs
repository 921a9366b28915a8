//! The lock-free single-producer / single-consumer byte ring over a [`Segment`].
//!
//! The producer copies bytes into the free part of the data area (`written - tail <
//! capacity`) and then publishes them by storing `head` with Release; the consumer reads
//! `head` with Acquire, reads the bytes between its `tail` and `head`, and releases them by
//! storing `tail` with Release, which the producer reads with Acquire before reusing the
//! space. Positions are monotonic `u64` byte counts, the index is `position % capacity`.
//! Each side keeps its own position locally and only ever stores its own word, so the two
//! processes never write the same cache line.
//!
//! After publishing, a side wakes the other only if that one announced it is parking (its
//! waiter word is 1; see [`super::wait`]): a SeqCst fence between "store my position" and
//! "load the other's waiter word", mirrored by the waiter's "store my waiter word, fence,
//! re-check the position", guarantees that either the waker sees the announcement or the
//! waiter sees the new position (no lost wake-up).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use super::futex;
use super::segment::Segment;

/// The peer left the ring's positions in an impossible state (more bytes in flight than the
/// ring holds): a bug or a corrupted segment, reported as a protocol error by the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Corrupt {
    /// The number of bytes the positions claim are in flight.
    pub(crate) in_flight: u64,
}

/// The 8-byte word at ring position `position` of `segment`'s data area, when that position
/// is 8-aligned (then the word never straddles the wrap: the capacity is a multiple of 64).
fn word_at(segment: &Segment, position: u64) -> Option<&AtomicU64> {
    if !position.is_multiple_of(8) {
        return None;
    }
    let index = (position % segment.capacity() as u64) as usize;
    // SAFETY: `index + 8 <= capacity` (both multiples of 8, index < capacity), so the word is
    // inside the data area, which starts 8-aligned (the mapping is page-aligned and the
    // control block is a multiple of 64 bytes) and lives as long as `segment`; an AtomicU64
    // is valid for any bytes, and both sides touch this word only atomically once it is
    // published (see `Producer::word`).
    Some(unsafe { &*segment.data().add(index).cast::<AtomicU64>() })
}

/// Wakes the other side if it announced it is parking on `word`.
fn wake_if_parked(word: &AtomicU32) {
    fence(Ordering::SeqCst);
    if word.load(Ordering::Relaxed) != 0 && word.swap(0, Ordering::SeqCst) != 0 {
        futex::wake(word);
    }
}

/// The writing end of a ring.
#[derive(Debug)]
pub(crate) struct Producer {
    segment: Arc<Segment>,
    /// Bytes written so far (published or not).
    written: u64,
}

impl Producer {
    /// The writing end of `segment`'s ring, continuing from its published head.
    pub(crate) fn new(segment: Arc<Segment>) -> Producer {
        let written = segment.control().head.0.load(Ordering::Acquire);
        Producer { segment, written }
    }

    /// The data area's size.
    pub(crate) fn capacity(&self) -> usize {
        self.segment.capacity()
    }

    /// Bytes that can be written now without overtaking the consumer.
    pub(crate) fn free(&self) -> Result<usize, Corrupt> {
        let tail = self.segment.control().tail.0.load(Ordering::Acquire);
        let in_flight = self.written.wrapping_sub(tail);
        let capacity = self.capacity() as u64;
        // The consumer can never have released more than was written.
        if tail > self.written || in_flight > capacity {
            return Err(Corrupt { in_flight });
        }
        // invariant: in_flight <= capacity, which is a usize.
        Ok((capacity - in_flight) as usize)
    }

    /// Copies `bytes` (at most [`Producer::free`]) after everything written so far, and
    /// `padding` unwritten bytes after them, without publishing them yet. Returns `false`
    /// (writing nothing) if they do not fit.
    pub(crate) fn write(&mut self, bytes: &[u8], padding: usize) -> bool {
        let fits = self
            .free()
            .is_ok_and(|free| bytes.len().saturating_add(padding) <= free);
        if !fits {
            return false;
        }
        let capacity = self.capacity();
        let start = (self.written % capacity as u64) as usize;
        let first = bytes.len().min(capacity - start);
        let data = self.segment.data();
        // SAFETY: `start + first <= capacity` and `bytes.len() - first < capacity`, so both
        // copies stay inside the data area; the range is free space (checked above against
        // the consumer's released tail, read with Acquire), which the consumer does not read
        // until this producer publishes it, and this producer is the ring's only writer.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), data.add(start), first);
            std::ptr::copy_nonoverlapping(bytes.as_ptr().add(first), data, bytes.len() - first);
        }
        self.written += (bytes.len() + padding) as u64;
        true
    }

    /// Makes everything written so far visible to the consumer, waking it if it parked.
    pub(crate) fn publish(&mut self) {
        let control = self.segment.control();
        control.head.0.store(self.written, Ordering::Release);
        wake_if_parked(&control.data_waiter.0);
    }

    /// The word this producer parks on while waiting for space (or for a release).
    pub(crate) fn park_word(&self) -> &AtomicU32 {
        &self.segment.control().space_waiter.0
    }

    /// The ring position just past everything written so far.
    pub(crate) fn written(&self) -> u64 {
        self.written
    }

    /// The 8-byte word at ring position `position` (8-aligned), which both sides use
    /// atomically once it is published and until the consumer releases it: a lent payload's
    /// claim word. `None` for an unaligned position.
    pub(crate) fn word(&self, position: u64) -> Option<&AtomicU64> {
        word_at(&self.segment, position)
    }

    /// Whether the consumer has released everything up to ring position `position` (it
    /// releases a lent payload's descriptor only after copying the payload).
    pub(crate) fn released(&self, position: u64) -> Result<bool, Corrupt> {
        self.free()?;
        Ok(self.segment.control().tail.0.load(Ordering::Acquire) >= position)
    }

    /// Tells the consumer that the buffers of descriptors it has not released yet may change
    /// from now on (see [`Consumer::revoked`]); never undone.
    pub(crate) fn revoke(&self) {
        self.segment.control().revoked.0.store(1, Ordering::SeqCst);
    }
}

/// The reading end of a ring.
#[derive(Debug)]
pub(crate) struct Consumer {
    segment: Arc<Segment>,
    /// Bytes released so far.
    tail: u64,
}

impl Consumer {
    /// The reading end of `segment`'s ring, continuing from its released tail.
    pub(crate) fn new(segment: Arc<Segment>) -> Consumer {
        let tail = segment.control().tail.0.load(Ordering::Acquire);
        Consumer { segment, tail }
    }

    /// The data area's size.
    pub(crate) fn capacity(&self) -> usize {
        self.segment.capacity()
    }

    /// Published bytes not yet released.
    pub(crate) fn available(&self) -> Result<usize, Corrupt> {
        let head = self.segment.control().head.0.load(Ordering::Acquire);
        let in_flight = head.wrapping_sub(self.tail);
        if in_flight > self.capacity() as u64 {
            return Err(Corrupt { in_flight });
        }
        // invariant: in_flight <= capacity, which is a usize.
        Ok(in_flight as usize)
    }

    /// The longest contiguous run of the `len` available bytes that start `offset` bytes
    /// past the tail (it ends early where the data area wraps). `offset + len` must not
    /// exceed what [`Consumer::available`] returned; otherwise the run is empty.
    pub(crate) fn contiguous(&self, offset: usize, len: usize) -> &[u8] {
        if self
            .available()
            .map_or(true, |a| offset.saturating_add(len) > a)
        {
            return &[];
        }
        let capacity = self.capacity();
        let start = ((self.tail + offset as u64) % capacity as u64) as usize;
        let run = len.min(capacity - start);
        // SAFETY: `start + run <= capacity`, inside the data area; the bytes are published
        // (below head, read with Acquire, checked above) and not yet released, so the
        // producer does not write them until this consumer's `release`, which needs `&mut
        // self` and so outlives the returned borrow.
        unsafe { std::slice::from_raw_parts(self.segment.data().add(start), run) }
    }

    /// Copies the `out.len()` available bytes starting `offset` past the tail into `out`
    /// (across the wrap). Returns `false` (copying nothing) if they are not all available.
    pub(crate) fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        let first = self.contiguous(offset, out.len());
        if first.len() == out.len() {
            out.copy_from_slice(first);
            return true;
        }
        if first.is_empty() && !out.is_empty() {
            return false;
        }
        let split = first.len();
        out[..split].copy_from_slice(first);
        let rest = self.contiguous(offset + split, out.len() - split);
        if rest.len() != out.len() - split {
            return false;
        }
        out[split..].copy_from_slice(rest);
        true
    }

    /// Releases `len` bytes (at most the available ones) to the producer, waking it if it
    /// parked waiting for space.
    pub(crate) fn release(&mut self, len: usize) {
        let len = self.available().map_or(0, |a| len.min(a));
        self.tail += len as u64;
        let control = self.segment.control();
        control.tail.0.store(self.tail, Ordering::Release);
        wake_if_parked(&control.space_waiter.0);
    }

    /// The word this consumer parks on while waiting for data.
    pub(crate) fn park_word(&self) -> &AtomicU32 {
        &self.segment.control().data_waiter.0
    }

    /// The segment this consumer reads.
    pub(crate) fn segment(&self) -> &Arc<Segment> {
        &self.segment
    }

    /// The 8-byte word `offset` bytes past the tail (see [`Producer::word`]), when all of it
    /// is available and 8-aligned.
    pub(crate) fn word(&self, offset: usize) -> Option<&AtomicU64> {
        let available = self.available().ok()?;
        if offset.checked_add(8)? > available {
            return None;
        }
        word_at(&self.segment, self.tail + offset as u64)
    }

    /// Whether the producer revoked its lent buffers ([`Producer::revoke`]). Checked after a
    /// cross-memory read, before the descriptor is released: the fence orders the read before
    /// this load, and the producer changes its buffer only after its own store, so a `false`
    /// here means the bytes read were the ones lent.
    pub(crate) fn revoked(&self) -> bool {
        fence(Ordering::SeqCst);
        self.segment.control().revoked.0.load(Ordering::SeqCst) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn pair(capacity: usize) -> (Producer, Consumer) {
        let segment = Arc::new(Segment::anonymous(capacity).unwrap());
        (Producer::new(Arc::clone(&segment)), Consumer::new(segment))
    }

    #[test]
    fn empty_and_full_rings_refuse_reads_and_writes() {
        let (mut tx, mut rx) = pair(256);
        assert_eq!(rx.available(), Ok(0));
        assert!(!rx.read(0, &mut [0u8; 1]));
        assert_eq!(tx.free(), Ok(256));
        assert!(tx.write(&[7u8; 200], 56));
        // Written but not published: the consumer sees nothing yet.
        assert_eq!(rx.available(), Ok(0));
        tx.publish();
        assert_eq!(rx.available(), Ok(256));
        assert_eq!(tx.free(), Ok(0));
        assert!(!tx.write(&[1], 0), "a full ring takes no byte");
        rx.release(100);
        assert_eq!(tx.free(), Ok(100));
        assert!(!tx.write(&[0u8; 101], 0));
    }

    #[test]
    fn bytes_survive_the_wrap_around() {
        let (mut tx, mut rx) = pair(256);
        // Move both positions to 200, so the next 100 bytes wrap at 256.
        assert!(tx.write(&[0u8; 200], 0));
        tx.publish();
        rx.release(200);
        let bytes: Vec<u8> = (0..100u8).map(|i| i.wrapping_mul(37)).collect();
        assert!(tx.write(&bytes, 0));
        tx.publish();
        assert_eq!(rx.contiguous(0, 100).len(), 56, "the run ends at the wrap");
        let mut out = vec![0u8; 100];
        assert!(rx.read(0, &mut out));
        assert_eq!(out, bytes);
        let mut tail_part = vec![0u8; 50];
        assert!(rx.read(50, &mut tail_part));
        assert_eq!(tail_part, bytes[50..]);
        rx.release(100);
        assert_eq!(rx.available(), Ok(0));
    }

    #[test]
    fn corrupted_positions_are_reported_not_trusted() {
        let (tx, rx) = pair(256);
        tx.segment.control().head.0.store(10_000, Ordering::Release);
        assert_eq!(rx.available(), Err(Corrupt { in_flight: 10_000 }));
        assert!(rx.contiguous(0, 1).is_empty());
        rx.segment
            .control()
            .tail
            .0
            .store(u64::MAX, Ordering::Release);
        assert!(tx.free().is_err());
    }

    #[test]
    fn a_concurrent_producer_and_consumer_move_a_formula_stream_intact() {
        // 3 MB through a 1 KiB ring in writes of varying sizes: byte i is f(i), so any lost,
        // duplicated or reordered byte shows.
        const TOTAL: usize = 3_000_000;
        let f = |i: usize| (i.wrapping_mul(2_654_435_761) >> 13) as u8;
        let (mut tx, mut rx) = pair(1024);
        let deadline = Instant::now() + Duration::from_secs(30);
        let producer = std::thread::spawn(move || {
            let mut sent = 0;
            let mut chunk = Vec::new();
            while sent < TOTAL && Instant::now() < deadline {
                let want = (1 + sent % 700).min(TOTAL - sent);
                let free = tx.free().unwrap();
                let n = want.min(free);
                if n == 0 {
                    std::thread::yield_now();
                    continue;
                }
                chunk.clear();
                chunk.extend((sent..sent + n).map(f));
                assert!(tx.write(&chunk, 0));
                tx.publish();
                sent += n;
            }
            sent
        });
        let mut received = 0;
        let mut out = vec![0u8; 1024];
        while received < TOTAL && Instant::now() < deadline {
            let n = rx.available().unwrap().min(1 + received % 300);
            if n == 0 {
                std::thread::yield_now();
                continue;
            }
            assert!(rx.read(0, &mut out[..n]));
            for (k, &byte) in out[..n].iter().enumerate() {
                assert_eq!(byte, f(received + k), "byte {}", received + k);
            }
            rx.release(n);
            received += n;
        }
        assert_eq!(producer.join().unwrap(), TOTAL);
        assert_eq!(received, TOTAL);
    }
}
