//! Entry points for the fuzz targets in `fuzz/` (cargo-fuzz, libFuzzer) and for property
//! tests: each feeds arbitrary bytes to one wire decoder exactly as a connection would and
//! reports what it made of them. Not part of the supported API.

use std::io::{self, Read, Write};

use crate::transport::tcp::frame::{FrameHeader, decode_frame, encode_frame};

/// The payload cap the frame target decodes under.
pub const FRAME_CAP: u64 = 1 << 20;

/// Decodes `bytes` (its first 36) as a frame header; `true` when accepted. It also runs
/// [`checked_frame`] over the whole input, so the `frame_header` fuzz target covers the
/// checksummed whole-frame decoder as well.
pub fn frame_header(bytes: &[u8]) -> bool {
    checked_frame(bytes);
    let mut header = [0u8; crate::transport::tcp::frame::FRAME_HEADER_BYTES];
    let Some(prefix) = bytes.get(..header.len()) else {
        return false;
    };
    header.copy_from_slice(prefix);
    match FrameHeader::decode(&header, 0, FRAME_CAP) {
        Ok(decoded) => {
            // An accepted header is within the cap and re-encodes to the same bytes.
            assert!(decoded.payload_bytes <= FRAME_CAP, "cap not enforced");
            assert_eq!(decoded.encode(), header, "decode/encode disagree");
            true
        }
        Err(_) => false,
    }
}

/// Decodes `bytes` as one whole frame with CRC32C checksums (`decode_frame`); `true` when
/// accepted. An accepted frame is within the cap and re-encodes to exactly `bytes` (so its
/// checksums were right); anything else is a typed protocol error naming the peer.
pub fn checked_frame(bytes: &[u8]) -> bool {
    match decode_frame(bytes, 0, FRAME_CAP, true) {
        Ok((header, payload)) => {
            assert!(header.payload_bytes <= FRAME_CAP, "cap not enforced");
            assert_eq!(
                encode_frame(&header, payload, true),
                bytes,
                "decode/encode disagree"
            );
            true
        }
        Err(crate::Error::Protocol { peer: Some(0), .. }) => false,
        Err(other) => panic!("an untyped refusal: {other:?}"),
    }
}

/// A connection whose peer sent `input` and then closed; what we write is counted.
struct Scripted<'a> {
    input: io::Cursor<&'a [u8]>,
    written: usize,
}

impl Read for Scripted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Scripted<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.written += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Runs the accepting side of the mesh handshake (rank 0 of 4, job token 7, a job secret)
/// over `input`; `true` when it would admit the peer (which needs a right HMAC proof, so
/// never for fuzzed input).
pub fn mesh_acceptor(input: &[u8]) -> bool {
    let mut peer = Scripted {
        input: io::Cursor::new(input),
        written: 0,
    };
    let expect = crate::transport::tcp::handshake::Expectation {
        job_token: 7,
        world_size: 4,
        acceptor_rank: 0,
        secret: Some(
            crate::auth::JobSecret::from_bytes(b"fuzz".to_vec())
                .expect("invariant: a non-empty secret is always accepted"),
        ),
        frame_checksum: false,
    };
    let admitted = crate::transport::tcp::handshake::accept_hello(&mut peer, &expect).is_ok();
    // The acceptor answers at most one challenge and one status byte (a checksum refusal, the
    // longest, adds its flags word), whatever it is sent.
    assert!(
        peer.written <= 1 + 32 + 32 + 1 + 8,
        "wrote {}",
        peer.written
    );
    admitted
}

/// Serves `input` as the requests of an authenticated Store client; returns how many were
/// served before the bytes ran out or broke the protocol.
pub fn store_requests(input: &[u8]) -> usize {
    crate::rendezvous::tcp::serve_bytes(input)
}

/// Checks `input` as a Store hello (magic and version); `true` when accepted.
pub fn store_hello(input: &[u8]) -> bool {
    crate::rendezvous::tcp::check_hello_bytes(input)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn well_formed_inputs_are_accepted() {
        let mut set = vec![1u8];
        set.extend_from_slice(&1u32.to_le_bytes());
        set.push(b'k');
        set.extend_from_slice(&2u32.to_le_bytes());
        set.extend_from_slice(b"vv");
        let mut get = vec![2u8];
        get.extend_from_slice(&1u32.to_le_bytes());
        get.push(b'k');
        get.extend_from_slice(&0u64.to_le_bytes());
        let both = [set, get].concat();
        assert_eq!(store_requests(&both), 2);
        // A value claimed far above the cap stops the parse at that request.
        let mut liar = vec![1u8];
        liar.extend_from_slice(&1u32.to_le_bytes());
        liar.push(b'k');
        liar.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(store_requests(&liar), 0);
        assert!(store_hello(b"HSTS\x02\x00\x00\x00"));
        assert!(!store_hello(b"HSTS\x01\x00\x00\x00"));
        assert!(!mesh_acceptor(&[0u8; 200]));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        #[test]
        fn arbitrary_store_requests_never_panic(input in proptest::collection::vec(any::<u8>(), 0..300)) {
            let served = store_requests(&input);
            // Every request takes at least its opcode byte.
            prop_assert!(served <= input.len());
        }

        #[test]
        fn arbitrary_mesh_hellos_are_never_admitted(input in proptest::collection::vec(any::<u8>(), 0..200)) {
            prop_assert!(!mesh_acceptor(&input));
        }

        #[test]
        fn arbitrary_frame_headers_never_panic(input in proptest::collection::vec(any::<u8>(), 36)) {
            frame_header(&input);
        }

        /// Arbitrary bytes are never accepted as a checksummed frame (the chance that random
        /// bytes carry a valid magic, header and two CRC32C words is nil), and never panic.
        #[test]
        fn arbitrary_checked_frames_are_refused(input in proptest::collection::vec(any::<u8>(), 0..200)) {
            prop_assert!(!checked_frame(&input));
        }

        /// A valid checksummed frame with one byte changed is always refused; unchanged, it
        /// is accepted.
        #[test]
        fn a_checked_frame_with_one_byte_changed_is_refused(
            payload in proptest::collection::vec(any::<u8>(), 0..300),
            seq in any::<u64>(),
            at in any::<proptest::sample::Index>(),
            flip in 1u8..=255,
        ) {
            let header = crate::transport::tcp::frame::FrameHeader {
                kind: crate::FrameKind::Data,
                dtype: crate::DType::U8,
                group: 1,
                seq,
                tag: 2,
                root: 0,
                payload_bytes: payload.len() as u64,
            };
            let mut wire = encode_frame(&header, &payload, true);
            prop_assert!(checked_frame(&wire));
            let at = at.index(wire.len());
            wire[at] ^= flip;
            prop_assert!(!checked_frame(&wire));
        }
    }
}
