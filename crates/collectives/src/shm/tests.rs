//! Channel-level tests: two ranks as threads over anonymous segments.

use std::sync::Arc;
use std::time::Duration;

use super::channel::{ShmPeer, Sink};
use super::links::ShmLinks;
use super::ring::{Consumer, Producer};
use super::segment::Segment;
use super::wait::tests::TestWatch;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tcp::{FrameHeader, FrameKind, MailboxKey};

/// The links of ranks 0 and 1 of a world of two, over rings of `capacity` bytes.
fn two_ranks(capacity: usize, max_payload: u64) -> (ShmLinks, ShmLinks) {
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
        ShmLinks::new(vec![None, Some(rank0)]),
        ShmLinks::new(vec![Some(rank1), None]),
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
    let mut slot = [0u8; super::SLOT_HEADER_BYTES];
    slot[..crate::tcp::FRAME_HEADER_BYTES].copy_from_slice(&header(0, 0, DType::U8, 1000).encode());
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
    assert!(raw.write(&[0xab; super::SLOT_HEADER_BYTES], 0));
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
