//! Channel-level tests: two ranks as threads over anonymous segments.

use std::sync::Arc;
use std::time::Duration;

use super::channel::{ShmPeer, Sink};
use super::links::ShmLinks;
use super::ring::{Consumer, Producer};
use super::segment::Segment;
use super::wait::tests::TestWatch;
use crate::FrameKind;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::transport::tcp::frame::FrameHeader;
use crate::transport::tcp::transport::MailboxKey;

/// The links of ranks 0 and 1 of a world of two, over rings of `capacity` bytes.
fn two_ranks(capacity: usize, max_payload: u64) -> (ShmLinks, ShmLinks) {
    pair(capacity, max_payload, None)
}

/// [`two_ranks`], lending payloads of at least `min_bytes` (the ranks are threads of this
/// process, so each reads "the other process" out of this one).
fn two_lending_ranks(capacity: usize, max_payload: u64, min_bytes: usize) -> (ShmLinks, ShmLinks) {
    pair(capacity, max_payload, Some(min_bytes))
}

fn pair(capacity: usize, max_payload: u64, lend: Option<usize>) -> (ShmLinks, ShmLinks) {
    let lending = |peer: ShmPeer| match lend {
        Some(min_bytes) => peer.with_cma(super::cma::Remote::this_process(), min_bytes),
        None => peer,
    };
    let zero_to_one = Arc::new(Segment::anonymous(capacity).unwrap());
    let one_to_zero = Arc::new(Segment::anonymous(capacity).unwrap());
    let rank0 = ShmPeer::new(
        1,
        Producer::new(Arc::clone(&zero_to_one)),
        Consumer::new(Arc::clone(&one_to_zero)),
        max_payload,
    );
    let rank1 = ShmPeer::new(
        0,
        Producer::new(one_to_zero),
        Consumer::new(zero_to_one),
        max_payload,
    );
    (
        ShmLinks::new(vec![None, Some(lending(rank0))]),
        ShmLinks::new(vec![Some(lending(rank1)), None]),
    )
}

fn header(seq: u64, tag: u32, dtype: DType, len: usize) -> FrameHeader {
    FrameHeader {
        kind: FrameKind::Data,
        dtype,
        group: 0,
        seq,
        tag,
        root: 0,
        payload_bytes: len as u64,
    }
}

fn formula(seq: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(131) ^ seq.wrapping_mul(7)) as u8)
        .collect()
}

/// Collects a payload and checks that every piece is whole elements.
struct Collect {
    bytes: Vec<u8>,
    granule: usize,
}

impl Sink for Collect {
    fn accept(&mut self, _header: &FrameHeader) -> Result<()> {
        Ok(())
    }
    fn take(&mut self, offset: usize, bytes: &[u8]) -> Result<()> {
        assert_eq!(offset, self.bytes.len());
        assert_eq!(offset % self.granule, 0);
        self.bytes.extend_from_slice(bytes);
        Ok(())
    }
    fn granule(&self, header: &FrameHeader) -> usize {
        header.dtype.size_bytes()
    }
}

#[test]
fn messages_larger_than_the_ring_arrive_whole_and_are_delivered_by_key() {
    // A 1 KiB ring holds payloads of up to 976 bytes whole; many messages wrap around it.
    let (rank0, rank1) = two_ranks(1024, 1 << 20);
    assert_eq!(super::channel::max_message_payload(1024), 976);
    let watch = TestWatch::new(Duration::from_secs(20));
    std::thread::scope(|s| {
        s.spawn(|| {
            let watch = TestWatch::new(Duration::from_secs(20));
            let to_one = rank0.peer(1).unwrap();
            // Sizes that are not multiples of the padding, up to the largest whole message.
            for (seq, len) in [
                (0u64, 900usize),
                (1, 3),
                (2, 0),
                (3, 976),
                (4, 977),
                (5, 40),
            ] {
                if len > 976 {
                    // Larger than one ring holds: refused before anything is written.
                    let refused = rank0.send(
                        to_one,
                        header(seq, 9, DType::U8, len),
                        &formula(seq, len),
                        &watch,
                    );
                    assert!(
                        matches!(refused, Err(Error::Protocol { .. })),
                        "{refused:?}"
                    );
                    continue;
                }
                let dtype = if len % 8 == 0 { DType::F64 } else { DType::U8 };
                let payload = formula(seq, len);
                rank0
                    .send(to_one, header(seq, 9, dtype, len), &payload, &watch)
                    .unwrap();
            }
        });
        let from_zero = rank1.peer(0).unwrap();
        // Asked for in another order than sent: the earlier ones go through the stash.
        for seq in [3u64, 1, 5, 0, 2] {
            let key = MailboxKey::of(&header(seq, 9, DType::U8, 0));
            let mut sink = Collect {
                bytes: Vec::new(),
                granule: 1,
            };
            let got = from_zero.recv(key, &watch, &mut sink).unwrap();
            let len = got.payload_bytes as usize;
            sink.granule = got.dtype.size_bytes();
            assert_eq!(sink.bytes, formula(seq, len), "seq {seq}");
        }
    });
}

#[test]
fn two_ranks_that_both_send_more_than_the_ring_first_do_not_deadlock() {
    // Each rank sends 100 kB in 400-byte messages before receiving any: 200 times what a
    // 512-byte ring holds, so both stall and must drain each other's messages.
    let (rank0, rank1) = two_ranks(512, 1 << 20);
    let exchange = |links: &ShmLinks, peer: usize| {
        let watch = TestWatch::new(Duration::from_secs(20));
        let channel = links.peer(peer).unwrap();
        let mine = formula(peer as u64, 100_000);
        for (seq, chunk) in mine.chunks(400).enumerate() {
            let h = header(seq as u64, 0, DType::U8, chunk.len());
            links.send(channel, h, chunk, &watch).unwrap();
        }
        let mut theirs = Vec::new();
        for seq in 0..250u64 {
            let key = MailboxKey::of(&header(seq, 0, DType::U8, 0));
            theirs.extend(links.recv_frame(channel, key, &watch).unwrap().payload);
        }
        // The peer sent formula(my rank).
        assert_eq!(theirs, formula(1 - peer as u64, 100_000));
    };
    std::thread::scope(|s| {
        s.spawn(|| exchange(&rank0, 1));
        s.spawn(|| exchange(&rank1, 0));
    });
}

#[test]
fn a_lost_peer_mid_message_fails_the_wait_and_poisons_the_channel() {
    // The peer's side is a bare producer that writes a header announcing 1000 bytes and only
    // 100 of them, then goes silent, as a killed rank would.
    let to_me = Arc::new(Segment::anonymous(2048).unwrap());
    let from_me = Arc::new(Segment::anonymous(2048).unwrap());
    let mut raw = Producer::new(Arc::clone(&to_me));
    let receiver = ShmPeer::new(0, Producer::new(from_me), Consumer::new(to_me), 1 << 20);
    let mut slot = [0u8; super::channel::SLOT_HEADER_BYTES];
    slot[..crate::transport::tcp::frame::FRAME_HEADER_BYTES]
        .copy_from_slice(&header(0, 0, DType::U8, 1000).encode());
    assert!(raw.write(&slot, 0) && raw.write(&[5u8; 100], 0));
    raw.publish();
    let watch = TestWatch::new(Duration::from_secs(20));
    let started = std::time::Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            watch.lost.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        let result = receiver.recv_frame(MailboxKey::of(&header(0, 0, DType::U8, 0)), &watch);
        assert!(
            matches!(result, Err(Error::PeerLost { peer: 0, .. })),
            "{result:?}"
        );
    });
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(receiver.is_poisoned());
    // Every later use fails at once, even with the watch calm again.
    watch.lost.store(false, std::sync::atomic::Ordering::SeqCst);
    let again = receiver.recv_frame(MailboxKey::of(&header(1, 0, DType::U8, 0)), &watch);
    assert!(
        matches!(again, Err(Error::PeerLost { peer: 0, .. })),
        "{again:?}"
    );
}

#[test]
fn oversized_and_mislabelled_sends_are_refused_before_the_ring() {
    let (rank0, _rank1) = two_ranks(256, 64);
    let watch = TestWatch::new(Duration::from_secs(5));
    let to_one = rank0.peer(1).unwrap();
    assert!(matches!(
        rank0.send(to_one, header(0, 0, DType::U8, 65), &[0; 65], &watch),
        Err(Error::Protocol { .. })
    ));
    assert!(matches!(
        rank0.send(to_one, header(0, 0, DType::U8, 3), &[0; 2], &watch),
        Err(Error::Protocol { .. })
    ));
    assert!(!to_one.is_poisoned());
}

#[test]
fn a_garbled_header_is_a_protocol_error_and_poisons_the_channel() {
    // A peer that writes 48 bytes of garbage where a message header belongs.
    let to_me = Arc::new(Segment::anonymous(1024).unwrap());
    let from_me = Arc::new(Segment::anonymous(1024).unwrap());
    let mut raw = Producer::new(Arc::clone(&to_me));
    let receiver = ShmPeer::new(0, Producer::new(from_me), Consumer::new(to_me), 1 << 20);
    assert!(raw.write(&[0xab; super::channel::SLOT_HEADER_BYTES], 0));
    raw.publish();
    let watch = TestWatch::new(Duration::from_secs(5));
    let key = MailboxKey::of(&header(0, 0, DType::U8, 0));
    let result = receiver.recv_frame(key, &watch);
    assert!(
        matches!(
            result,
            Err(Error::Protocol {
                peer: Some(0),
                violation: crate::error::ProtocolViolation::BadMagic { got: 0xabab_abab }
            })
        ),
        "{result:?}"
    );
    assert!(receiver.is_poisoned());
}

#[test]
fn lent_and_inline_payloads_arrive_whole_by_key_and_through_the_stash() {
    // Payloads of at least 16 bytes are lent; the rest go through the ring. Every lent send
    // waits for its release, so the receiver, asking in reverse order, must stash (read out
    // of the sender) everything before the key it wants.
    let (rank0, rank1) = two_lending_ranks(4096, 1 << 20, 16);
    assert!(rank0.peer(1).unwrap().uses_cma());
    let sizes = [0usize, 15, 16, 17, 1000, 4032];
    let watch = TestWatch::new(Duration::from_secs(20));
    std::thread::scope(|s| {
        s.spawn(|| {
            let watch = TestWatch::new(Duration::from_secs(20));
            let to_one = rank0.peer(1).unwrap();
            for (seq, &len) in sizes.iter().enumerate() {
                let payload = formula(seq as u64, len);
                let h = header(seq as u64, 4, DType::U8, len);
                rank0.send(to_one, h, &payload, &watch).unwrap();
            }
        });
        let from_zero = rank1.peer(0).unwrap();
        for seq in (0..sizes.len() as u64).rev() {
            let key = MailboxKey::of(&header(seq, 4, DType::U8, 0));
            let mut sink = Collect {
                bytes: Vec::new(),
                granule: 1,
            };
            let got = from_zero.recv(key, &watch, &mut sink).unwrap();
            assert_eq!(got.payload_bytes as usize, sizes[seq as usize]);
            assert_eq!(sink.bytes, formula(seq, sizes[seq as usize]), "seq {seq}");
        }
        assert!(!from_zero.is_poisoned());
    });
}

#[test]
fn two_ranks_that_both_lend_more_than_the_ring_first_do_not_deadlock() {
    // As the ring test above, but every 400-byte message is lent: each send waits for the
    // peer to copy it, which the peer only does while draining during its own sends.
    let (rank0, rank1) = two_lending_ranks(512, 1 << 20, 64);
    let exchange = |links: &ShmLinks, peer: usize| {
        let watch = TestWatch::new(Duration::from_secs(20));
        let channel = links.peer(peer).unwrap();
        let mine = formula(peer as u64, 100_000);
        for (seq, chunk) in mine.chunks(400).enumerate() {
            let h = header(seq as u64, 0, DType::U8, chunk.len());
            links.send(channel, h, chunk, &watch).unwrap();
        }
        let mut theirs = Vec::new();
        for seq in 0..250u64 {
            let key = MailboxKey::of(&header(seq, 0, DType::U8, 0));
            theirs.extend(links.recv_frame(channel, key, &watch).unwrap().payload);
        }
        assert_eq!(theirs, formula(1 - peer as u64, 100_000));
    };
    std::thread::scope(|s| {
        s.spawn(|| exchange(&rank0, 1));
        s.spawn(|| exchange(&rank1, 0));
    });
}

fn f32_bytes(values: impl Iterator<Item = f32>) -> Vec<u8> {
    values.flat_map(f32::to_le_bytes).collect()
}

#[test]
fn posts_are_filled_from_lent_payloads_by_copy_and_by_reduction() {
    use super::channel::Apply;
    use crate::reduce::ReducePlan;
    // A 2 MiB ring, so a 600 KiB reduction message is read in three staged pieces. Copy post
    // (key tag 1): three messages, the middle one small enough to go inline. Reduction post
    // out of place (tag 2): dst = own + incoming, 160 000 f32 in two messages.
    let (rank0, rank1) = two_lending_ranks(2 << 20, 1 << 21, 4096);
    let copy_parts = [1000usize, 15, 1985];
    let copy_total: usize = copy_parts.iter().sum();
    let sent_copy = f32_bytes((0..copy_total).map(|i| i as f32 * 0.5));
    let reduce_parts = [150_000usize, 10_000];
    let reduce_total: usize = reduce_parts.iter().sum();
    let incoming = f32_bytes((0..reduce_total).map(|i| (i % 1000) as f32));
    let own = f32_bytes((0..reduce_total).map(|i| (i % 7) as f32));
    std::thread::scope(|s| {
        s.spawn(|| {
            let watch = TestWatch::new(Duration::from_secs(20));
            let to_one = rank0.peer(1).unwrap();
            let mut at = 0;
            for &n in &copy_parts {
                let bytes = &sent_copy[at * 4..(at + n) * 4];
                let h = header(7, 1, DType::F32, bytes.len());
                rank0.send(to_one, h, bytes, &watch).unwrap();
                at += n;
            }
            let mut at = 0;
            for &n in &reduce_parts {
                let bytes = &incoming[at * 4..(at + n) * 4];
                let h = header(7, 2, DType::F32, bytes.len());
                rank0.send(to_one, h, bytes, &watch).unwrap();
                at += n;
            }
        });
        let watch = TestWatch::new(Duration::from_secs(20));
        let from_zero = rank1.peer(0).unwrap();
        let mut copied = vec![0u8; copy_total * 4];
        let mut reduced = vec![0u8; reduce_total * 4];
        let copy_key = MailboxKey::of(&header(7, 1, DType::F32, 0));
        let reduce_key = MailboxKey::of(&header(7, 2, DType::F32, 0));
        let plan = ReducePlan::new(crate::op::ReduceOp::Sum, DType::F32, 2).unwrap();
        // SAFETY: both destinations and `own` outlive the posts, which `wait_post` withdraws
        // before this scope touches them again; nothing else accesses them meanwhile.
        unsafe {
            from_zero.post(
                copy_key,
                copied.as_mut_ptr(),
                None,
                copied.len(),
                Apply::Copy(DType::F32),
            );
            from_zero.post(
                reduce_key,
                reduced.as_mut_ptr(),
                Some(own.as_ptr()),
                reduced.len(),
                Apply::Reduce(plan),
            );
        }
        let judge = |_: &FrameHeader, _: usize| Ok(());
        let mut progressed = 0;
        from_zero
            .wait_post(copy_key, &watch, &judge, &mut |fresh| {
                progressed += fresh.len();
                Ok(())
            })
            .unwrap();
        assert_eq!(progressed, copied.len());
        from_zero
            .wait_post(reduce_key, &watch, &judge, &mut |_| Ok(()))
            .unwrap();
        assert_eq!(copied, sent_copy);
        let expected = f32_bytes((0..reduce_total).map(|i| (i % 1000 + i % 7) as f32));
        assert!(reduced == expected, "dst = own + incoming");
    });
}

#[test]
fn an_unclaimed_lend_is_cancelled_and_its_payload_sent_through_the_ring() {
    // Rank 1 is not reading (as a peer that failed validation, or is busy elsewhere): rank
    // 0's lent send gives up after its patience, cancels the descriptor and sends the bytes
    // inline, without waiting for rank 1. Rank 1 later skips the cancelled descriptor and
    // gets the inline copy, and the channel stays healthy.
    let (rank0, rank1) = two_lending_ranks(1024, 1 << 20, 64);
    let watch = TestWatch::new(Duration::from_secs(20));
    let to_one = rank0.peer(1).unwrap();
    let cancelled_before = super::cma::cancelled_lends();
    let started = std::time::Instant::now();
    let payload = formula(3, 500);
    rank0
        .send(to_one, header(0, 0, DType::U8, 500), &payload, &watch)
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(super::cma::cancelled_lends() > cancelled_before);
    // The sender's buffer may change now: the receiver must get the inline copy.
    drop(payload);
    let from_zero = rank1.peer(0).unwrap();
    let got = from_zero
        .recv_frame(MailboxKey::of(&header(0, 0, DType::U8, 0)), &watch)
        .unwrap();
    assert_eq!(got.payload, formula(3, 500));
    assert!(!from_zero.is_poisoned() && !to_one.is_poisoned());
}

#[test]
fn a_revoked_lend_is_not_delivered_and_a_claimed_lend_holds_the_sender_until_the_peer_is_lost() {
    // The receiver claims the lend, but the sender's lent buffers are revoked before its
    // read finishes (set by hand here, as a sender whose wait failed would): the receiver
    // must fail rather than deliver what it read. The sender, its lend claimed, keeps waiting
    // for the release (no cancelling a claimed lend) until its watch reports the peer lost;
    // then it fails, poisoned, within bounded time.
    let zero_to_one = Arc::new(Segment::anonymous(1024).unwrap());
    let one_to_zero = Arc::new(Segment::anonymous(1024).unwrap());
    let remote = super::cma::Remote::this_process();
    let rank0 = ShmPeer::new(
        1,
        Producer::new(Arc::clone(&zero_to_one)),
        Consumer::new(Arc::clone(&one_to_zero)),
        1 << 20,
    )
    .with_cma(remote, 64);
    let rank1 = ShmPeer::new(
        0,
        Producer::new(one_to_zero),
        Consumer::new(Arc::clone(&zero_to_one)),
        1 << 20,
    )
    .with_cma(remote, 64);
    Producer::new(zero_to_one).revoke();
    let sender_watch = TestWatch::new(Duration::from_secs(20));
    let payload = formula(5, 300);
    let started = std::time::Instant::now();
    std::thread::scope(|s| {
        let sending = s.spawn(|| {
            rank0.send(
                header(0, 0, DType::U8, 300),
                &payload,
                &sender_watch,
                &mut || {},
                &[],
            )
        });
        let watch = TestWatch::new(Duration::from_secs(20));
        let got = rank1.recv_frame(MailboxKey::of(&header(0, 0, DType::U8, 0)), &watch);
        assert!(
            matches!(got, Err(Error::PeerLost { peer: 0, .. })),
            "{got:?}"
        );
        assert!(rank1.is_poisoned());
        // Well past the sender's patience: a claimed lend is not cancelled.
        std::thread::sleep(Duration::from_millis(100));
        assert!(!sending.is_finished(), "the sender waits for the release");
        sender_watch
            .lost
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let sent = sending.join().unwrap();
        assert!(
            matches!(sent, Err(Error::PeerLost { peer: 1, .. })),
            "{sent:?}"
        );
    });
    assert!(rank0.is_poisoned());
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_lent_payload_of_a_process_that_is_gone_fails_the_read_without_hanging() {
    // Rank 1 believes rank 0 is a process that has exited (its pid is gone): the read of the
    // descriptor's payload fails, the channel is poisoned, and rank 0's send, still waiting
    // for the release, ends when its watch learns that rank 1 is lost.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let gone = libc::pid_t::try_from(child.id()).unwrap();
    child.wait().unwrap();
    let zero_to_one = Arc::new(Segment::anonymous(1024).unwrap());
    let one_to_zero = Arc::new(Segment::anonymous(1024).unwrap());
    let remote = super::cma::Remote::this_process();
    let rank0 = ShmPeer::new(
        1,
        Producer::new(Arc::clone(&zero_to_one)),
        Consumer::new(Arc::clone(&one_to_zero)),
        1 << 20,
    )
    .with_cma(remote, 64);
    let rank1 = ShmPeer::new(
        0,
        Producer::new(one_to_zero),
        Consumer::new(zero_to_one),
        1 << 20,
    )
    .with_cma(super::cma::Remote::new(gone), 64);
    let sender_watch = TestWatch::new(Duration::from_secs(20));
    let payload = formula(1, 700);
    let started = std::time::Instant::now();
    std::thread::scope(|s| {
        let sending = s.spawn(|| {
            rank0.send(
                header(0, 0, DType::U8, 700),
                &payload,
                &sender_watch,
                &mut || {},
                &[],
            )
        });
        let watch = TestWatch::new(Duration::from_secs(20));
        let got = rank1.recv_frame(MailboxKey::of(&header(0, 0, DType::U8, 0)), &watch);
        assert!(
            matches!(got, Err(Error::PeerLost { peer: 0, .. })),
            "{got:?}"
        );
        assert!(rank1.is_poisoned());
        // What the TCP side does on poisoning: the peer's connection closes.
        sender_watch
            .lost
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let sent = sending.join().unwrap();
        assert!(
            matches!(sent, Err(Error::PeerLost { peer: 1, .. })),
            "{sent:?}"
        );
    });
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_lent_body_on_a_pair_without_cross_memory_reads_is_a_protocol_error() {
    let to_me = Arc::new(Segment::anonymous(1024).unwrap());
    let from_me = Arc::new(Segment::anonymous(1024).unwrap());
    let mut raw = Producer::new(Arc::clone(&to_me));
    let receiver = ShmPeer::new(0, Producer::new(from_me), Consumer::new(to_me), 1 << 20);
    let mut message = [0u8; super::channel::SLOT_HEADER_BYTES + 16];
    let at = crate::transport::tcp::frame::FRAME_HEADER_BYTES;
    message[..at].copy_from_slice(&header(0, 0, DType::U8, 100).encode());
    message[at..at + 4].copy_from_slice(b"CMA1");
    let address = (message.as_ptr() as u64).to_le_bytes();
    message[super::channel::SLOT_HEADER_BYTES..super::channel::SLOT_HEADER_BYTES + 8]
        .copy_from_slice(&address);
    assert!(raw.write(&message, 0));
    raw.publish();
    let watch = TestWatch::new(Duration::from_secs(5));
    let got = receiver.recv_frame(MailboxKey::of(&header(0, 0, DType::U8, 0)), &watch);
    assert!(
        matches!(
            got,
            Err(Error::Protocol {
                violation: crate::error::ProtocolViolation::ReservedNotZero,
                ..
            })
        ),
        "{got:?}"
    );
    assert!(receiver.is_poisoned());
}
