//! Bad input on the wire, as property tests (they run in CI with the rest of the suite):
//! arbitrary bytes decoded as a frame header, and arbitrary bytes sent to a running TCP
//! Store server. Decoders must return typed errors, never panic, never allocate from a
//! claimed size beyond their caps, and a server must keep serving everyone else.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::OnceLock;
use std::time::Duration;

use hypershard_collectives::FrameKind;
use hypershard_collectives::store::{TcpStore, TcpStoreServer};
use hypershard_collectives::testing::{FRAME_HEADER_BYTES, FRAME_MAGIC, FrameHeader};
use hypershard_collectives::{DType, Error, ProtocolViolation, Store};
use proptest::prelude::*;

/// The cap the tests decode under: 1 MiB.
const CAP: u64 = 1 << 20;

fn header_with_length(payload_bytes: u64) -> [u8; FRAME_HEADER_BYTES] {
    FrameHeader {
        kind: FrameKind::Data,
        dtype: DType::F32,
        group: 0,
        seq: 7,
        tag: 0,
        root: 0,
        payload_bytes,
    }
    .encode()
}

#[test]
fn a_length_above_the_cap_is_frame_too_large_and_at_the_cap_is_fine() {
    match FrameHeader::decode(&header_with_length(CAP + 1), 3, CAP) {
        Err(Error::Protocol {
            peer: Some(3),
            violation: ProtocolViolation::FrameTooLarge { limit, got },
        }) => assert_eq!((limit, got), (CAP, CAP + 1)),
        other => panic!("expected FrameTooLarge, got {other:?}"),
    }
    match FrameHeader::decode(&header_with_length(u64::MAX), 3, CAP) {
        Err(Error::Protocol {
            violation: ProtocolViolation::FrameTooLarge { got: u64::MAX, .. },
            ..
        }) => {}
        other => panic!("expected FrameTooLarge, got {other:?}"),
    }
    let at_cap = FrameHeader::decode(&header_with_length(CAP), 3, CAP).unwrap();
    assert_eq!((at_cap.payload_bytes, at_cap.seq), (CAP, 7));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// Any 36 bytes: a typed error or a header that re-encodes to the same bytes and whose
    /// payload length is within the cap.
    #[test]
    fn arbitrary_frame_headers_decode_or_are_refused(
        bytes in proptest::collection::vec(any::<u8>(), FRAME_HEADER_BYTES),
        magic in any::<bool>(),
    ) {
        let mut header = [0u8; FRAME_HEADER_BYTES];
        header.copy_from_slice(&bytes);
        if magic {
            // Half the cases get past the magic so the later checks are exercised.
            header[..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
            header[6] = 0;
            header[7] = 0;
        }
        match FrameHeader::decode(&header, 1, CAP) {
            Ok(decoded) => {
                prop_assert!(decoded.payload_bytes <= CAP);
                prop_assert_eq!(decoded.encode(), header);
            }
            Err(Error::Protocol { peer: Some(1), .. }) => {}
            Err(other) => prop_assert!(false, "untyped refusal {other:?}"),
        }
    }
}

/// One server for all the cases (each case opens its own connection).
fn server() -> &'static TcpStoreServer {
    static SERVER: OnceLock<TcpStoreServer> = OnceLock::new();
    SERVER.get_or_init(|| TcpStoreServer::bind_with_secret("127.0.0.1:0", None).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Arbitrary bytes sent to a Store server (from the first byte, or after a valid hello
    /// prefix) never take it down: a proper client still gets its value back afterwards,
    /// and the stray connection gets at most a short answer before being dropped.
    #[test]
    fn arbitrary_bytes_never_disturb_the_store(
        junk in proptest::collection::vec(any::<u8>(), 0..256),
        with_hello in any::<bool>(),
    ) {
        let server = server();
        let mut stray = TcpStream::connect(server.local_addr()).unwrap();
        stray.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let mut sent = Vec::new();
        if with_hello {
            sent.extend_from_slice(b"HSTS");
            sent.extend_from_slice(&2u32.to_le_bytes());
        }
        sent.extend_from_slice(&junk);
        let _ = stray.write_all(&sent);
        let mut answer = [0u8; 4096];
        // The server answers a hello prefix + nonce with its greeting (8 + 32 + 32 bytes)
        // and a refusal byte; it never answers more than that to a client that did not
        // authenticate.
        let mut total = 0;
        while let Ok(n) = stray.read(&mut answer[total..]) {
            if n == 0 { break; }
            total += n;
            if total >= answer.len() { break; }
        }
        prop_assert!(total <= 8 + 32 + 32 + 1, "{total} bytes");
        drop(stray);
        let client = TcpStore::connect_with_secret(server.local_addr(), Duration::from_secs(5), None).unwrap();
        client.set("still-here", b"yes").unwrap();
        prop_assert_eq!(client.get("still-here", Duration::from_secs(5)).unwrap(), b"yes".to_vec());
    }
}
