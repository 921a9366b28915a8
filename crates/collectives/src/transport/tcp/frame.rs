//! [`FrameHeader`]: the fixed 36-byte header that will precede every payload on the mesh.
//!
//! Layout (little-endian): `magic "HSFR" u32, kind u8, dtype u8, reserved u16 (zero),
//! group u32, seq u64, tag u32, root u32, payload_bytes u64`. [`FrameHeader::decode`] checks
//! the magic, the kind, the dtype code, the reserved bytes and the payload length against a
//! caller-given cap *before* any payload is read or allocated, so a peer that sends garbage
//! becomes an [`Error::Protocol`] instead of a huge allocation or a misread stream.
//!
//! With per-frame checksums on (`TcpConfig::frame_checksum`, agreed in the handshake), a frame
//! on the wire is `header (36 bytes), header CRC32C u32, payload, frame CRC32C u32`: the first
//! word is the CRC32C of the header's 36 bytes, the trailer the CRC32C of header and payload
//! together. The header word is checked *before* the header is decoded, so a flipped bit in a
//! length, a tag or a sequence number is caught before anything is allocated, routed or read
//! on the strength of it; the trailer is checked once the payload is in, before the frame is
//! delivered. [`encode_frame`] and [`decode_frame`] are the whole-frame codec (the transport
//! streams the same layout piece by piece).

use crate::dtype::DType;
use crate::error::{Error, IoAction, ProtocolViolation, Result};
pub(crate) use crate::frame_key::FrameKind;

/// The first four bytes of every frame: ASCII `HSFR`.
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"HSFR");
/// The size of an encoded [`FrameHeader`].
pub const FRAME_HEADER_BYTES: usize = 36;

/// The size of each CRC32C word of a checksummed frame (one after the header, one after the
/// payload).
pub const FRAME_CHECKSUM_BYTES: usize = 4;

/// The CRC32C of a header's wire bytes: the word that follows the header when checksums are on.
/// Continuing it over the payload ([`crc32c::crc32c_append`]) gives the frame's trailer.
pub fn header_checksum(header: &[u8; FRAME_HEADER_BYTES]) -> u32 {
    crc32c::crc32c(header)
}

/// Checks the header word `sent` of a checksummed frame from `peer` against the header's bytes;
/// a mismatch names no frame (none of the header's fields can be trusted).
pub(crate) fn check_header(
    header: &[u8; FRAME_HEADER_BYTES],
    sent: u32,
    peer: usize,
) -> Result<u32> {
    let computed = header_checksum(header);
    if computed != sent {
        return Err(Error::Protocol {
            peer: Some(peer),
            violation: ProtocolViolation::ChecksumFailed {
                frame: None,
                sent,
                computed,
            },
        });
    }
    Ok(computed)
}

/// The error of a payload from `peer` that this process cannot allocate: the length came
/// from the peer's header (below the frame cap), so it is reported, never aborted on.
pub(crate) fn payload_alloc_error(peer: usize, bytes: u64) -> Error {
    Error::Io {
        action: IoAction::Read,
        peer: Some(peer),
        source: std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!("cannot allocate {bytes} bytes for a frame from rank {peer}"),
        ),
    }
}

/// Checks the trailer `sent` of a checksummed frame from `peer` whose (verified) header is
/// `header`, against `computed`, the CRC32C of header and payload as they arrived.
pub(crate) fn check_trailer(
    header: &FrameHeader,
    sent: u32,
    computed: u32,
    peer: usize,
) -> Result<()> {
    if computed != sent {
        return Err(Error::Protocol {
            peer: Some(peer),
            violation: ProtocolViolation::ChecksumFailed {
                frame: Some(crate::frame_key::FrameKey::of(header)),
                sent,
                computed,
            },
        });
    }
    Ok(())
}

/// The wire bytes of one whole frame: the header, then (with `checksum`) the header's CRC32C,
/// the payload and (with `checksum`) the CRC32C of header and payload. `header.payload_bytes`
/// is written as given; [`decode_frame`] refuses a frame whose payload does not match it.
#[cfg(any(test, feature = "testing"))]
pub fn encode_frame(header: &FrameHeader, payload: &[u8], checksum: bool) -> Vec<u8> {
    let encoded = header.encode();
    let extra = if checksum {
        2 * FRAME_CHECKSUM_BYTES
    } else {
        0
    };
    let mut out = Vec::with_capacity(FRAME_HEADER_BYTES + extra + payload.len());
    out.extend_from_slice(&encoded);
    if checksum {
        let head = header_checksum(&encoded);
        out.extend_from_slice(&head.to_le_bytes());
        out.extend_from_slice(payload);
        out.extend_from_slice(&crc32c::crc32c_append(head, payload).to_le_bytes());
    } else {
        out.extend_from_slice(payload);
    }
    out
}

#[cfg(any(test, feature = "testing"))]
fn read_word(bytes: &[u8], at: usize) -> Option<u32> {
    let word = bytes.get(at..at + FRAME_CHECKSUM_BYTES)?;
    let mut w = [0u8; FRAME_CHECKSUM_BYTES];
    w.copy_from_slice(word);
    Some(u32::from_le_bytes(w))
}

/// Decodes one whole frame from `peer` as [`encode_frame`] wrote it (with `checksum` as the
/// connection agreed), returning its header and payload. The header is validated (and with
/// `checksum` its CRC32C checked first) before its length is trusted; a payload above
/// `max_payload`, bytes missing ([`ProtocolViolation::Truncated`]) or left over
/// ([`ProtocolViolation::PayloadLengthMismatch`]) and a wrong CRC32C
/// ([`ProtocolViolation::ChecksumFailed`]) are typed errors. Nothing is allocated.
#[cfg(any(test, feature = "testing"))]
pub fn decode_frame(
    bytes: &[u8],
    peer: usize,
    max_payload: u64,
    checksum: bool,
) -> Result<(FrameHeader, &[u8])> {
    let violation = |violation| Error::Protocol {
        peer: Some(peer),
        violation,
    };
    let prefix = if checksum {
        FRAME_HEADER_BYTES + FRAME_CHECKSUM_BYTES
    } else {
        FRAME_HEADER_BYTES
    };
    let Some(head) = bytes.get(..FRAME_HEADER_BYTES) else {
        return Err(violation(ProtocolViolation::Truncated {
            expected: prefix,
            got: bytes.len(),
        }));
    };
    let mut header_bytes = [0u8; FRAME_HEADER_BYTES];
    header_bytes.copy_from_slice(head);
    let head_crc = if checksum {
        let sent = read_word(bytes, FRAME_HEADER_BYTES).ok_or(violation(
            ProtocolViolation::Truncated {
                expected: prefix,
                got: bytes.len(),
            },
        ))?;
        Some(check_header(&header_bytes, sent, peer)?)
    } else {
        None
    };
    let header = FrameHeader::decode(&header_bytes, peer, max_payload)?;
    // invariant: decode bounded payload_bytes by max_payload, an allocatable size; a value
    // that does not fit usize cannot be in `bytes` either, which the length check reports.
    let len = usize::try_from(header.payload_bytes).unwrap_or(usize::MAX);
    let trailer = if checksum { FRAME_CHECKSUM_BYTES } else { 0 };
    let expected = prefix.saturating_add(len).saturating_add(trailer);
    if bytes.len() < expected {
        return Err(violation(ProtocolViolation::Truncated {
            expected,
            got: bytes.len(),
        }));
    }
    if bytes.len() > expected {
        return Err(violation(ProtocolViolation::PayloadLengthMismatch {
            declared: header.payload_bytes,
            actual: (bytes.len() - prefix - trailer) as u64,
        }));
    }
    let payload = &bytes[prefix..prefix + len];
    if let Some(head_crc) = head_crc {
        // invariant: the length check above leaves exactly the trailer after the payload.
        let sent = read_word(bytes, prefix + len).unwrap_or(0);
        check_trailer(
            &header,
            sent,
            crc32c::crc32c_append(head_crc, payload),
            peer,
        )?;
    }
    Ok((header, payload))
}

fn dtype_code(dtype: DType) -> u8 {
    // DType::ALL lists every dtype once; its index is the wire code.
    DType::ALL
        .iter()
        .position(|d| *d == dtype)
        .map_or(u8::MAX, |i| i as u8)
}

/// The header of one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame carries.
    pub kind: FrameKind,
    /// The element type of the payload.
    pub dtype: DType,
    /// Which communicator (the world or a split group) the frame belongs to.
    pub group: u32,
    /// The op's sequence number in its group.
    pub seq: u64,
    /// The user tag for send/recv, or the step of a multi-step algorithm.
    pub tag: u32,
    /// The op's root rank, where it has one.
    pub root: u32,
    /// The number of payload bytes that follow the header.
    pub payload_bytes: u64,
}

fn word32(bytes: &[u8; FRAME_HEADER_BYTES], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(w)
}

fn word64(bytes: &[u8; FRAME_HEADER_BYTES], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(w)
}

impl FrameHeader {
    /// The header's wire bytes.
    pub fn encode(&self) -> [u8; FRAME_HEADER_BYTES] {
        let mut out = [0u8; FRAME_HEADER_BYTES];
        out[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        out[4] = self.kind.code();
        out[5] = dtype_code(self.dtype);
        out[8..12].copy_from_slice(&self.group.to_le_bytes());
        out[12..20].copy_from_slice(&self.seq.to_le_bytes());
        out[20..24].copy_from_slice(&self.tag.to_le_bytes());
        out[24..28].copy_from_slice(&self.root.to_le_bytes());
        out[28..36].copy_from_slice(&self.payload_bytes.to_le_bytes());
        out
    }

    /// Parses and validates a header from `peer`, refusing payloads above `max_payload`.
    pub fn decode(
        bytes: &[u8; FRAME_HEADER_BYTES],
        peer: usize,
        max_payload: u64,
    ) -> Result<FrameHeader> {
        let violation = |violation| Error::Protocol {
            peer: Some(peer),
            violation,
        };
        let magic = word32(bytes, 0);
        if magic != FRAME_MAGIC {
            return Err(violation(ProtocolViolation::BadMagic { got: magic }));
        }
        let kind = FrameKind::from_code(bytes[4]).ok_or(violation(
            ProtocolViolation::UnexpectedFrame {
                expected: FrameKind::Data.code(),
                got: bytes[4],
            },
        ))?;
        let dtype = DType::ALL
            .get(usize::from(bytes[5]))
            .copied()
            .ok_or(violation(ProtocolViolation::BadDType { code: bytes[5] }))?;
        if bytes[6] != 0 || bytes[7] != 0 {
            return Err(violation(ProtocolViolation::ReservedNotZero));
        }
        let payload_bytes = word64(bytes, 28);
        if payload_bytes > max_payload {
            return Err(violation(ProtocolViolation::FrameTooLarge {
                limit: max_payload,
                got: payload_bytes,
            }));
        }
        Ok(FrameHeader {
            kind,
            dtype,
            group: word32(bytes, 8),
            seq: word64(bytes, 12),
            tag: word32(bytes, 20),
            root: word32(bytes, 24),
            payload_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(dtype: DType) -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Data,
            dtype,
            group: 3,
            seq: 0x0102_0304_0506_0708,
            tag: 77,
            root: 2,
            payload_bytes: 4096,
        }
    }

    #[test]
    fn every_dtype_round_trips() {
        for dtype in DType::ALL {
            let header = sample(dtype);
            assert_eq!(
                FrameHeader::decode(&header.encode(), 1, 4096).unwrap(),
                header
            );
        }
        for kind in [
            FrameKind::Descriptor,
            FrameKind::Data,
            FrameKind::Failure,
            FrameKind::Message,
        ] {
            let header = FrameHeader {
                kind,
                ..sample(DType::F32)
            };
            assert_eq!(
                FrameHeader::decode(&header.encode(), 1, 4096).unwrap(),
                header
            );
        }
    }

    #[test]
    fn bad_headers_are_typed_errors_naming_the_peer() {
        let good = sample(DType::BF16).encode();
        let mut bad_magic = good;
        bad_magic[0] ^= 0xff;
        assert!(matches!(
            FrameHeader::decode(&bad_magic, 5, 4096),
            Err(Error::Protocol {
                peer: Some(5),
                violation: ProtocolViolation::BadMagic { .. }
            })
        ));
        let mut bad_kind = good;
        bad_kind[4] = 99;
        assert!(matches!(
            FrameHeader::decode(&bad_kind, 5, 4096),
            Err(Error::Protocol {
                violation: ProtocolViolation::UnexpectedFrame { got: 99, .. },
                ..
            })
        ));
        let mut bad_dtype = good;
        bad_dtype[5] = 200;
        assert!(matches!(
            FrameHeader::decode(&bad_dtype, 5, 4096),
            Err(Error::Protocol {
                violation: ProtocolViolation::BadDType { code: 200 },
                ..
            })
        ));
        let mut bad_reserved = good;
        bad_reserved[7] = 1;
        assert!(matches!(
            FrameHeader::decode(&bad_reserved, 5, 4096),
            Err(Error::Protocol {
                violation: ProtocolViolation::ReservedNotZero,
                ..
            })
        ));
        assert!(matches!(
            FrameHeader::decode(&good, 5, 4095),
            Err(Error::Protocol {
                violation: ProtocolViolation::FrameTooLarge {
                    limit: 4095,
                    got: 4096
                },
                ..
            })
        ));
    }

    fn checksummed() -> (FrameHeader, Vec<u8>, Vec<u8>) {
        let payload: Vec<u8> = (0..64u32).map(|i| (i * 37 + 11) as u8).collect();
        let header = FrameHeader {
            payload_bytes: payload.len() as u64,
            ..sample(DType::F32)
        };
        let wire = encode_frame(&header, &payload, true);
        (header, payload, wire)
    }

    #[test]
    fn whole_frames_round_trip_with_and_without_checksums() {
        let (header, payload, wire) = checksummed();
        assert_eq!(
            wire.len(),
            FRAME_HEADER_BYTES + 2 * FRAME_CHECKSUM_BYTES + payload.len()
        );
        let (got, body) = decode_frame(&wire, 2, 4096, true).unwrap();
        assert_eq!((got, body), (header, &payload[..]));
        // The header word is the CRC32C of the header bytes, the trailer that of header and
        // payload together (the standard CRC32C check value pins the polynomial).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let head = u32::from_le_bytes(wire[36..40].try_into().unwrap());
        assert_eq!(head, crc32c::crc32c(&wire[..36]));
        let tail = u32::from_le_bytes(wire[wire.len() - 4..].try_into().unwrap());
        let mut covered = wire[..36].to_vec();
        covered.extend_from_slice(&payload);
        assert_eq!(tail, crc32c::crc32c(&covered));
        let plain = encode_frame(&header, &payload, false);
        assert_eq!(plain.len(), FRAME_HEADER_BYTES + payload.len());
        assert_eq!(
            decode_frame(&plain, 2, 4096, false).unwrap(),
            (header, &payload[..])
        );
    }

    #[test]
    fn every_flipped_bit_of_a_checksummed_frame_is_detected() {
        let (header, payload, wire) = checksummed();
        for at in 0..wire.len() {
            for bit in 0..8 {
                let mut bad = wire.clone();
                bad[at] ^= 1 << bit;
                let error = decode_frame(&bad, 2, 4096, true).unwrap_err();
                let Error::Protocol {
                    peer: Some(2),
                    violation:
                        ProtocolViolation::ChecksumFailed {
                            frame,
                            sent,
                            computed,
                        },
                } = error
                else {
                    panic!("byte {at} bit {bit}: {error:?}");
                };
                assert_ne!(sent, computed);
                if at < FRAME_HEADER_BYTES + FRAME_CHECKSUM_BYTES {
                    // The header (or its word) is caught before the header is trusted.
                    assert_eq!(frame, None, "byte {at}");
                } else {
                    // A payload or trailer byte: named by the verified header's fields.
                    let key = frame.expect("a payload flip names its frame");
                    assert_eq!(
                        key,
                        crate::transport::tcp::transport::MailboxKey::of(&header)
                    );
                    assert_eq!(
                        (key.kind, key.seq, key.tag),
                        (FrameKind::Data, header.seq, 77)
                    );
                }
            }
        }
        // Without checksums the same payload flip goes through unnoticed: the check above
        // is what catches it.
        let mut plain = encode_frame(&header, &payload, false);
        plain[FRAME_HEADER_BYTES + 5] ^= 0x10;
        let (_, body) = decode_frame(&plain, 2, 4096, false).unwrap();
        assert_ne!(body, &payload[..]);
    }

    #[test]
    fn a_flipped_length_is_caught_before_the_length_is_used() {
        let (_, _, wire) = checksummed();
        // Raise the declared length far above the cap: with checksums the header word fails
        // first, so the length is never looked at; without, the cap refuses it.
        let mut bad = wire.clone();
        bad[35] ^= 0x80;
        assert!(matches!(
            decode_frame(&bad, 1, 4096, true),
            Err(Error::Protocol {
                violation: ProtocolViolation::ChecksumFailed { frame: None, .. },
                ..
            })
        ));
        let mut plain = bad[..36].to_vec();
        plain.extend_from_slice(&wire[40..wire.len() - 4]);
        assert!(matches!(
            decode_frame(&plain, 1, 4096, false),
            Err(Error::Protocol {
                violation: ProtocolViolation::FrameTooLarge { .. },
                ..
            })
        ));
    }

    #[test]
    fn a_header_claiming_a_huge_payload_is_refused_naming_the_peer_and_the_size() {
        for claimed in [4097, 1 << 40, u64::MAX] {
            let header = FrameHeader {
                payload_bytes: claimed,
                ..sample(DType::F32)
            };
            match FrameHeader::decode(&header.encode(), 5, 4096) {
                Err(Error::Protocol {
                    peer: Some(5),
                    violation: ProtocolViolation::FrameTooLarge { limit, got },
                }) => {
                    assert_eq!((limit, got), (4096, claimed));
                }
                other => panic!("{claimed}: {other:?}"),
            }
        }
        // At the cap it decodes.
        let header = FrameHeader {
            payload_bytes: 4096,
            ..sample(DType::F32)
        };
        assert_eq!(
            FrameHeader::decode(&header.encode(), 5, 4096).unwrap(),
            header
        );
    }

    #[test]
    fn short_and_long_whole_frames_are_typed_errors() {
        let (_, payload, wire) = checksummed();
        for cut in [0, 10, 36, 39, 40, wire.len() - 1] {
            assert!(
                matches!(
                    decode_frame(&wire[..cut], 4, 4096, true),
                    Err(Error::Protocol {
                        peer: Some(4),
                        violation: ProtocolViolation::Truncated { got, .. }
                    }) if got == cut
                ),
                "cut at {cut}"
            );
        }
        let mut long = wire.clone();
        long.push(0);
        assert!(matches!(
            decode_frame(&long, 4, 4096, true),
            Err(Error::Protocol {
                violation: ProtocolViolation::PayloadLengthMismatch {
                    declared: 64,
                    actual: 65
                },
                ..
            })
        ));
        assert_eq!(payload.len(), 64);
    }
}
