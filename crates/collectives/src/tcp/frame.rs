//! [`FrameHeader`]: the fixed 36-byte header that will precede every payload on the mesh.
//!
//! Layout (little-endian): `magic "HSFR" u32, kind u8, dtype u8, reserved u16 (zero),
//! group u32, seq u64, tag u32, root u32, payload_bytes u64`. [`FrameHeader::decode`] checks
//! the magic, the kind, the dtype code, the reserved bytes and the payload length against a
//! caller-given cap *before* any payload is read or allocated, so a peer that sends garbage
//! becomes an [`Error::Protocol`] instead of a huge allocation or a misread stream.

use crate::dtype::DType;
use crate::error::{Error, ProtocolViolation, Result};

/// The first four bytes of every frame: ASCII `HSFR`.
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"HSFR");
/// The size of an encoded [`FrameHeader`].
pub const FRAME_HEADER_BYTES: usize = 36;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FrameKind {
    /// A phase-0 descriptor: the sender's view of the op's arguments.
    Descriptor,
    /// A chunk of op data.
    Data,
    /// The sender failed the op; the payload names why.
    Failure,
    /// A point-to-point message (send/recv), filed by its user tag.
    Message,
}

impl FrameKind {
    fn code(self) -> u8 {
        match self {
            FrameKind::Descriptor => 1,
            FrameKind::Data => 2,
            FrameKind::Failure => 3,
            FrameKind::Message => 4,
        }
    }

    fn from_code(code: u8) -> Option<FrameKind> {
        match code {
            1 => Some(FrameKind::Descriptor),
            2 => Some(FrameKind::Data),
            3 => Some(FrameKind::Failure),
            4 => Some(FrameKind::Message),
            _ => None,
        }
    }
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
}
