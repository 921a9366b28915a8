use super::*;
use crate::FrameKind;
use crate::dtype::DType;
use std::net::TcpListener;

#[test]
fn a_payload_that_cannot_be_allocated_is_a_typed_error_naming_the_peer() {
    let shared = Shared {
        state: Mutex::default(),
        arrived: Condvar::new(),
        pool: Mutex::default(),
    };
    // A length no allocator provides (past isize::MAX), as a peer's header could claim
    // under a cap set that high: refused, not aborted on.
    let huge = usize::MAX / 2 + 1;
    match shared.payload_buffer(huge) {
        Err(LossCause::OutOfMemory { bytes }) => assert_eq!(bytes, huge as u64),
        other => panic!("{:?}", other.map(|b| b.len()).map_err(|_| "other cause")),
    }
    assert_eq!(shared.payload_buffer(24).unwrap(), vec![0u8; 24]);
    // Waiters on that peer see an I/O error that names it and the size.
    shared.mark_lost(3, LossCause::OutOfMemory { bytes: 1 << 62 });
    let budget = WaitBudget::from_now(OpKind::AllReduce, Duration::from_secs(1));
    match wait_error(&shared.lock(), &budget, 3) {
        Some(Error::Io {
            action: IoAction::Read,
            peer: Some(3),
            source,
        }) => {
            assert_eq!(source.kind(), io::ErrorKind::OutOfMemory);
            let text = source.to_string();
            assert!(text.contains(&(1u64 << 62).to_string()), "{text}");
            assert!(text.contains("rank 3"), "{text}");
        }
        other => panic!("{other:?}"),
    }
}

/// Connected streams for a world of `n` ranks: `result[r][p]` leads from `r` to `p`.
fn stream_mesh(n: usize) -> Vec<Vec<Option<TcpStream>>> {
    let mut mesh: Vec<Vec<Option<TcpStream>>> =
        (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let pairs = (0..n).flat_map(|a| ((a + 1)..n).map(move |b| (a, b)));
    for (a, b) in pairs {
        let outgoing = TcpStream::connect(addr).unwrap();
        let (incoming, _) = listener.accept().unwrap();
        mesh[a][b] = Some(outgoing);
        mesh[b][a] = Some(incoming);
    }
    mesh
}

pub(crate) fn transports(n: usize, max_payload: u64) -> Vec<Transport> {
    transports_with(n, max_payload, false)
}

/// [`transports`] with frame checksums on or off.
pub(crate) fn transports_with(n: usize, max_payload: u64, checksum: bool) -> Vec<Transport> {
    stream_mesh(n)
        .into_iter()
        .enumerate()
        .map(|(rank, streams)| {
            Transport::from_streams(rank, streams, max_payload, checksum).unwrap()
        })
        .collect()
}

pub(crate) fn header(seq: u64, tag: u32, payload_bytes: u64) -> FrameHeader {
    FrameHeader {
        kind: FrameKind::Data,
        dtype: DType::U8,
        group: 0,
        seq,
        tag,
        root: 0,
        payload_bytes,
    }
}

pub(crate) fn budget(ms: u64) -> WaitBudget {
    WaitBudget::from_now(OpKind::AllReduce, Duration::from_millis(ms))
}

#[test]
fn frames_are_filed_by_key_and_delivered_out_of_order() {
    let ranks = transports(3, 1 << 20);
    // Rank 0 sends three frames to rank 2 (eagerly, nobody is receiving yet) and one to
    // itself; rank 1 sends one to rank 2.
    for seq in 0..3u64 {
        let payload: Vec<u8> = (0..100).map(|i| (i as u64 * 7 + seq) as u8).collect();
        ranks[0]
            .send(OpKind::AllReduce, 2, header(seq, 5, 100), &payload)
            .unwrap();
    }
    ranks[0]
        .send(OpKind::AllReduce, 0, header(9, 1, 3), &[1, 2, 3])
        .unwrap();
    ranks[1]
        .send(OpKind::AllReduce, 2, header(0, 5, 4), &[4, 3, 2, 1])
        .unwrap();
    // Received in reverse order of sending, and per source.
    for seq in (0..3u64).rev() {
        let key = MailboxKey::of(&header(seq, 5, 0));
        let frame = ranks[2].recv(&budget(5_000), 0, key).unwrap();
        assert_eq!(frame.header.seq, seq);
        let expected: Vec<u8> = (0..100).map(|i| (i as u64 * 7 + seq) as u8).collect();
        assert_eq!(frame.payload, expected);
    }
    let from_one = ranks[2]
        .recv(&budget(5_000), 1, MailboxKey::of(&header(0, 5, 0)))
        .unwrap();
    assert_eq!(from_one.payload, vec![4, 3, 2, 1]);
    let to_self = ranks[0]
        .recv(&budget(5_000), 0, MailboxKey::of(&header(9, 1, 0)))
        .unwrap();
    assert_eq!(to_self.payload, vec![1, 2, 3]);
}

#[test]
fn recycled_payloads_are_reused_and_carry_only_the_new_bytes() {
    let ranks = transports(2, 1 << 20);
    let long: Vec<u8> = (0..5000).map(|i| (i % 251) as u8).collect();
    ranks[0]
        .send(OpKind::AllGather, 1, header(0, 0, 5000), &long)
        .unwrap();
    let first = ranks[1]
        .recv(&budget(5_000), 0, MailboxKey::of(&header(0, 0, 0)))
        .unwrap();
    assert_eq!(first.payload, long);
    ranks[1].recycle(first.payload);
    // A shorter frame lands in the recycled (longer) buffer: it must hold exactly the new
    // bytes, and a longer one after it must be whole too.
    ranks[0]
        .send(OpKind::AllGather, 1, header(1, 0, 3), &[7, 8, 9])
        .unwrap();
    let second = ranks[1]
        .recv(&budget(5_000), 0, MailboxKey::of(&header(1, 0, 0)))
        .unwrap();
    assert_eq!(second.payload, vec![7, 8, 9]);
    ranks[1].recycle(second.payload);
    let longer: Vec<u8> = (0..9000).map(|i| (i % 13) as u8).collect();
    ranks[0]
        .send(OpKind::AllGather, 1, header(2, 0, 9000), &longer)
        .unwrap();
    let third = ranks[1]
        .recv(&budget(5_000), 0, MailboxKey::of(&header(2, 0, 0)))
        .unwrap();
    assert_eq!(third.payload, longer);
}

#[test]
fn vectored_writes_survive_partial_writes() {
    /// Accepts at most three bytes per call, like a congested socket.
    struct Trickle(Vec<u8>);
    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let n = buf.len().min(3);
            self.0.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let mut sink = Trickle(Vec::new());
    write_all_vectored(&mut sink, &[&[1, 2, 3, 4, 5], &[], &[6, 7]]).unwrap();
    assert_eq!(sink.0, vec![1, 2, 3, 4, 5, 6, 7]);
}

#[test]
fn a_missing_frame_times_out_within_the_deadline() {
    let ranks = transports(2, 1 << 10);
    let started = Instant::now();
    let error = ranks[0]
        .recv(&budget(150), 1, MailboxKey::of(&header(0, 0, 0)))
        .unwrap_err();
    assert!(
        matches!(
            error,
            Error::Timeout {
                op: OpKind::AllReduce,
                peer: Some(1),
                ..
            }
        ),
        "{error:?}"
    );
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(150) && waited < Duration::from_secs(3));
}

#[test]
fn a_dropped_peer_is_lost_but_its_earlier_frames_still_arrive() {
    let mut ranks = transports(2, 1 << 10);
    ranks[1]
        .send(OpKind::Broadcast, 0, header(0, 0, 2), &[8, 9])
        .unwrap();
    drop(ranks.pop());
    let early = ranks[0]
        .recv(&budget(5_000), 1, MailboxKey::of(&header(0, 0, 0)))
        .unwrap();
    assert_eq!(early.payload, vec![8, 9]);
    let started = Instant::now();
    let error = ranks[0]
        .recv(&budget(5_000), 1, MailboxKey::of(&header(1, 0, 0)))
        .unwrap_err();
    assert!(
        matches!(
            error,
            Error::PeerLost {
                op: OpKind::AllReduce,
                peer: 1
            }
        ),
        "{error:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(ranks[0].is_lost(1));
}

#[test]
fn an_oversized_or_garbage_frame_is_a_protocol_error() {
    let mut mesh = stream_mesh(2);
    let mut raw = mesh[1][0].take().unwrap();
    let receiver = Transport::from_streams(0, std::mem::take(&mut mesh[0]), 64, false).unwrap();
    raw.write_all(&header(0, 0, 65).encode()).unwrap();
    let error = receiver
        .recv(&budget(5_000), 1, MailboxKey::of(&header(0, 0, 0)))
        .unwrap_err();
    assert!(
        matches!(
            error,
            Error::Protocol {
                peer: Some(1),
                violation: ProtocolViolation::FrameTooLarge { limit: 64, got: 65 }
            }
        ),
        "{error:?}"
    );
}

#[test]
fn a_frame_cut_short_is_never_delivered() {
    let mut mesh = stream_mesh(2);
    let mut raw = mesh[1][0].take().unwrap();
    let receiver = Transport::from_streams(0, std::mem::take(&mut mesh[0]), 64, false).unwrap();
    raw.write_all(&header(0, 0, 10).encode()).unwrap();
    raw.write_all(&[1, 2, 3]).unwrap();
    drop(raw);
    let error = receiver
        .recv(&budget(5_000), 1, MailboxKey::of(&header(0, 0, 0)))
        .unwrap_err();
    assert!(
        matches!(error, Error::PeerLost { peer: 1, .. }),
        "{error:?}"
    );
}

#[test]
fn sends_check_the_declared_length_and_the_peer() {
    let ranks = transports(2, 16);
    assert!(matches!(
        ranks[0].send(OpKind::Send, 1, header(0, 0, 3), &[1, 2]),
        Err(Error::Protocol {
            violation: ProtocolViolation::PayloadLengthMismatch {
                declared: 3,
                actual: 2
            },
            ..
        })
    ));
    assert!(matches!(
        ranks[0].send(OpKind::Send, 1, header(0, 0, 17), &[0; 17]),
        Err(Error::Protocol {
            violation: ProtocolViolation::FrameTooLarge { limit: 16, got: 17 },
            ..
        })
    ));
    assert!(matches!(
        ranks[0].send(OpKind::Send, 2, header(0, 0, 1), &[0]),
        Err(Error::InvalidRank {
            rank: 2,
            size: 2,
            ..
        })
    ));
}

#[test]
fn abort_wakes_waiters_and_the_peer_sees_the_rank_lost() {
    let ranks = Arc::new(transports(2, 16));
    let waiter = {
        let ranks = Arc::clone(&ranks);
        thread::spawn(move || ranks[0].recv(&budget(10_000), 1, MailboxKey::of(&header(0, 0, 0))))
    };
    thread::sleep(Duration::from_millis(50));
    let started = Instant::now();
    ranks[0].abort();
    let woken = waiter.join().unwrap();
    assert!(matches!(woken, Err(Error::Aborted { .. })), "{woken:?}");
    let peer_view = ranks[1].recv(&budget(10_000), 0, MailboxKey::of(&header(0, 0, 0)));
    assert!(
        matches!(peer_view, Err(Error::PeerLost { peer: 0, .. })),
        "{peer_view:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[test]
fn checksummed_frames_arrive_whole_through_the_mailbox_and_posts() {
    let ranks = transports_with(2, 1 << 20, true);
    assert!(ranks[0].frame_checksum() && ranks[1].frame_checksum());
    // A frame larger than a staging chunk, so the running checksum spans several chunks.
    let long: Vec<u8> = (0..(STAGING_BYTES + 4097))
        .map(|i| (i % 241) as u8)
        .collect();
    let len = long.len() as u64;
    ranks[0]
        .send(OpKind::AllGather, 1, header(0, 1, len), &long)
        .unwrap();
    let frame = ranks[1]
        .recv(&budget(5_000), 0, MailboxKey::of(&header(0, 1, 0)))
        .unwrap();
    assert_eq!(frame.payload, long);
    // In pieces (vectored), and an empty payload.
    let (a, b) = long.split_at(1000);
    ranks[1]
        .send_parts(OpKind::AllGather, 0, header(1, 2, len), &[a, b])
        .unwrap();
    ranks[1]
        .send(OpKind::Barrier, 0, header(2, 3, 0), &[])
        .unwrap();
    let parts = ranks[0]
        .recv(&budget(5_000), 1, MailboxKey::of(&header(1, 2, 0)))
        .unwrap();
    assert_eq!(parts.payload, long);
    let empty = ranks[0]
        .recv(&budget(5_000), 1, MailboxKey::of(&header(2, 3, 0)))
        .unwrap();
    assert!(empty.payload.is_empty());
}

/// Rank 0 of a two-rank world with checksums, and the raw socket of its peer.
fn checksummed_receiver() -> (Transport, TcpStream) {
    let mut mesh = stream_mesh(2);
    let raw = mesh[1][0].take().unwrap();
    let receiver = Transport::from_streams(0, std::mem::take(&mut mesh[0]), 1 << 10, true).unwrap();
    (receiver, raw)
}

#[test]
fn a_corrupted_payload_is_a_checksum_error_naming_the_frame_and_never_delivered() {
    let (receiver, mut raw) = checksummed_receiver();
    let sent = header(5, 9, 8);
    let mut wire =
        crate::transport::tcp::frame::encode_frame(&sent, &[1, 2, 3, 4, 5, 6, 7, 8], true);
    wire[FRAME_HEADER_BYTES + FRAME_CHECKSUM_BYTES + 3] ^= 0x04;
    raw.write_all(&wire).unwrap();
    let started = Instant::now();
    let error = receiver
        .recv(&budget(5_000), 1, MailboxKey::of(&header(5, 9, 0)))
        .unwrap_err();
    let expected = MailboxKey::of(&sent);
    match error {
        Error::Protocol {
            peer: Some(1),
            violation:
                ProtocolViolation::ChecksumFailed {
                    frame: Some(key),
                    sent,
                    computed,
                },
        } => {
            assert_eq!(key, expected);
            assert_eq!((key.kind, key.seq, key.tag), (FrameKind::Data, 5, 9));
            assert_ne!(sent, computed);
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(3));
    // The connection is shut, so the sender sees this rank as gone.
    let mut byte = [0u8; 1];
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(raw.read(&mut byte).unwrap(), 0);
}

#[test]
fn a_corrupted_header_is_caught_before_its_length_is_used() {
    let (receiver, mut raw) = checksummed_receiver();
    // The length field says 4 bytes, but one flipped bit makes it 4 + 2^20: without the
    // header's word the reader would wait for a megabyte that never comes (or refuse it
    // as too large); with it, the header is refused at once.
    let mut wire = crate::transport::tcp::frame::encode_frame(&header(0, 0, 4), &[7; 4], true);
    wire[30] ^= 0x10;
    raw.write_all(&wire).unwrap();
    let error = receiver
        .recv(&budget(5_000), 1, MailboxKey::of(&header(0, 0, 0)))
        .unwrap_err();
    assert!(
        matches!(
            error,
            Error::Protocol {
                peer: Some(1),
                violation: ProtocolViolation::ChecksumFailed { frame: None, .. }
            }
        ),
        "{error:?}"
    );
}

#[test]
fn a_corrupted_frame_into_a_posted_buffer_is_never_counted_as_filled() {
    use crate::transport::tcp::posted::{PostMode, PostTarget, PostedOutcome, PostedRecv};
    for reduce in [false, true] {
        let (receiver, mut raw) = checksummed_receiver();
        let mut dst = vec![0u8; 16];
        let key = MailboxKey::of(&header(3, 1, 0));
        let mode = if reduce {
            PostMode::Reduce(
                crate::reduce::ReducePlan::new(crate::ReduceOp::Sum, DType::U8, 2).unwrap(),
            )
        } else {
            PostMode::Copy(DType::U8)
        };
        let target = PostTarget {
            len: dst.len(),
            buffer: &mut dst,
            own: None,
        };
        let posted = PostedRecv::post_prefix(&receiver, (1, key), mode, target);
        // A good first half, then a corrupted second half.
        raw.write_all(&crate::transport::tcp::frame::encode_frame(
            &header(3, 1, 8),
            &[1; 8],
            true,
        ))
        .unwrap();
        let mut bad = crate::transport::tcp::frame::encode_frame(&header(3, 1, 8), &[2; 8], true);
        let last = bad.len() - 1;
        bad[last] ^= 0xff;
        raw.write_all(&bad).unwrap();
        let mut seen = 0;
        let outcome = posted.wait(&budget(5_000), |range| {
            seen += range.len();
            Ok(())
        });
        assert!(
            matches!(
                outcome,
                Err(Error::Protocol {
                    violation: ProtocolViolation::ChecksumFailed { frame: Some(_), .. },
                    ..
                })
            ),
            "reduce {reduce}: {outcome:?}"
        );
        assert!(!matches!(outcome, Ok(PostedOutcome::Complete)));
        // Only the frame whose trailer held was handed on.
        assert_eq!(seen, 8, "reduce {reduce}");
    }
}
