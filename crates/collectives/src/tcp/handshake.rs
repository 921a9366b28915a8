//! The mesh handshake. The connecting (higher) rank sends
//! `magic "HSMC" u32, version u32, job token u64, its rank u64, world size u64`; the accepting
//! rank answers one status byte (`ACCEPTED` or a refusal code) and, when it accepts, its own
//! rank as `u64` (a version refusal is followed by the acceptor's version as `u32`). All integers are little-endian.

use std::io::{self, Read, Write};

use crate::error::ProtocolViolation;

/// The first four bytes of a mesh hello: ASCII `HSMC`.
pub const MESH_MAGIC: u32 = u32::from_le_bytes(*b"HSMC");
/// The mesh protocol version this build speaks.
pub const MESH_PROTOCOL_VERSION: u32 = 1;

pub(crate) const ACCEPTED: u8 = 0;
pub(crate) const REFUSED_VERSION: u8 = 1;
pub(crate) const REFUSED_TOKEN: u8 = 2;
pub(crate) const REFUSED_RANK: u8 = 3;

/// What a connecting rank says about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) job_token: u64,
    pub(crate) rank: u64,
    pub(crate) world_size: u64,
}

pub(crate) const HELLO_BYTES: usize = 32;

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut out = [0u8; HELLO_BYTES];
        out[0..4].copy_from_slice(&MESH_MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&MESH_PROTOCOL_VERSION.to_le_bytes());
        out[8..16].copy_from_slice(&self.job_token.to_le_bytes());
        out[16..24].copy_from_slice(&self.rank.to_le_bytes());
        out[24..32].copy_from_slice(&self.world_size.to_le_bytes());
        out
    }
}

/// Why a hello was not accepted: the socket, or what the peer said.
pub(crate) enum HelloFailure {
    Io(io::Error),
    Violation(ProtocolViolation),
}

impl From<io::Error> for HelloFailure {
    fn from(e: io::Error) -> Self {
        HelloFailure::Io(e)
    }
}

fn word32(bytes: &[u8; HELLO_BYTES], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(w)
}

fn word64(bytes: &[u8; HELLO_BYTES], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Reads a hello and checks magic, version, token and world size. On a refusal the refusal
/// byte has already been written back so the connecting rank learns why.
pub(crate) fn read_hello(
    stream: &mut (impl Read + Write),
    job_token: u64,
    world_size: u64,
) -> Result<Hello, HelloFailure> {
    let mut bytes = [0u8; HELLO_BYTES];
    stream.read_exact(&mut bytes)?;
    let magic = word32(&bytes, 0);
    if magic != MESH_MAGIC {
        // Not one of ours: answer nothing, the caller drops the connection.
        return Err(HelloFailure::Violation(ProtocolViolation::BadMagic {
            got: magic,
        }));
    }
    let version = word32(&bytes, 4);
    if version != MESH_PROTOCOL_VERSION {
        let mut refusal = [REFUSED_VERSION, 0, 0, 0, 0];
        refusal[1..].copy_from_slice(&MESH_PROTOCOL_VERSION.to_le_bytes());
        let _ = stream.write_all(&refusal);
        return Err(HelloFailure::Violation(
            ProtocolViolation::VersionMismatch {
                ours: MESH_PROTOCOL_VERSION,
                theirs: version,
            },
        ));
    }
    let hello = Hello {
        job_token: word64(&bytes, 8),
        rank: word64(&bytes, 16),
        world_size: word64(&bytes, 24),
    };
    if hello.job_token != job_token {
        let _ = stream.write_all(&[REFUSED_TOKEN]);
        return Err(HelloFailure::Violation(ProtocolViolation::TokenMismatch));
    }
    if hello.world_size != world_size || hello.rank >= world_size {
        let _ = stream.write_all(&[REFUSED_RANK]);
        return Err(HelloFailure::Violation(ProtocolViolation::BadRank {
            rank: hello.rank,
        }));
    }
    Ok(hello)
}
