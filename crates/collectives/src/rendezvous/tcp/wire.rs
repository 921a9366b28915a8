//! The store's wire encoding and its authenticated handshake, shared by both ends.

use super::*;

/// Why reading a message failed: the socket, or the bytes that arrived.
pub(super) enum ReadFailure {
    Io(io::Error),
    Violation(ProtocolViolation),
}

impl From<io::Error> for ReadFailure {
    fn from(e: io::Error) -> Self {
        ReadFailure::Io(e)
    }
}

impl ReadFailure {
    pub(super) fn into_error(self) -> Error {
        match self {
            ReadFailure::Io(source) => Error::Io {
                action: IoAction::Read,
                peer: None,
                source,
            },
            ReadFailure::Violation(violation) => Error::Protocol {
                peer: None,
                violation,
            },
        }
    }
}

pub(super) fn write_error(source: io::Error) -> Error {
    Error::Io {
        action: IoAction::Write,
        peer: None,
        source,
    }
}

pub(super) fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub(super) fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends a length-prefixed byte string after checking it against `limit`.
pub(super) fn put_bytes(out: &mut Vec<u8>, bytes: &[u8], limit: usize) -> Result<()> {
    let len = u32::try_from(bytes.len())
        .ok()
        .filter(|&n| n as usize <= limit)
        .ok_or(Error::Protocol {
            peer: None,
            violation: ProtocolViolation::FrameTooLarge {
                limit: limit as u64,
                got: bytes.len() as u64,
            },
        })?;
    put_u32(out, len);
    out.extend_from_slice(bytes);
    Ok(())
}

pub(super) fn put_keys(out: &mut Vec<u8>, keys: &[&str]) -> Result<()> {
    if keys.len() > MAX_KEYS {
        return Err(Error::Protocol {
            peer: None,
            violation: ProtocolViolation::FrameTooLarge {
                limit: MAX_KEYS as u64,
                got: keys.len() as u64,
            },
        });
    }
    // invariant: keys.len() <= MAX_KEYS, which fits in u32.
    put_u32(out, keys.len() as u32);
    for key in keys {
        put_bytes(out, key.as_bytes(), MAX_KEY_BYTES)?;
    }
    Ok(())
}

pub(super) fn put_duration(out: &mut Vec<u8>, d: Duration) {
    put_u64(out, u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
}

pub(super) fn read_array<const N: usize>(
    r: &mut impl Read,
) -> std::result::Result<[u8; N], ReadFailure> {
    let mut buf = [0u8; N];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

pub(super) fn read_u8(r: &mut impl Read) -> std::result::Result<u8, ReadFailure> {
    Ok(read_array::<1>(r)?[0])
}

pub(super) fn read_u32(r: &mut impl Read) -> std::result::Result<u32, ReadFailure> {
    Ok(u32::from_le_bytes(read_array(r)?))
}

pub(super) fn read_u64(r: &mut impl Read) -> std::result::Result<u64, ReadFailure> {
    Ok(u64::from_le_bytes(read_array(r)?))
}

/// Reads a length-prefixed byte string, refusing lengths above `limit` before allocating.
pub(super) fn read_bytes(
    r: &mut impl Read,
    limit: usize,
) -> std::result::Result<Vec<u8>, ReadFailure> {
    let len = read_u32(r)? as usize;
    if len > limit {
        return Err(ReadFailure::Violation(ProtocolViolation::FrameTooLarge {
            limit: limit as u64,
            got: len as u64,
        }));
    }
    // Grow with the bytes that actually arrive rather than trusting the claim: a client
    // that announces a capped-but-large value and sends nothing costs nothing.
    let mut buf = Vec::with_capacity(len.min(64 << 10));
    let got = r.by_ref().take(len as u64).read_to_end(&mut buf)?;
    if got != len {
        return Err(ReadFailure::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("connection closed after {got} of {len} announced bytes"),
        )));
    }
    Ok(buf)
}

pub(super) fn read_key(r: &mut impl Read) -> std::result::Result<String, ReadFailure> {
    let bytes = read_bytes(r, MAX_KEY_BYTES)?;
    // Keys are Rust strings on both ends; bytes that are not UTF-8 can only come from a
    // client that does not speak this protocol.
    String::from_utf8(bytes).map_err(|_| ReadFailure::Violation(ProtocolViolation::NotUtf8))
}

pub(super) fn read_keys(r: &mut impl Read) -> std::result::Result<Vec<String>, ReadFailure> {
    let count = read_u32(r)? as usize;
    if count > MAX_KEYS {
        return Err(ReadFailure::Violation(ProtocolViolation::FrameTooLarge {
            limit: MAX_KEYS as u64,
            got: count as u64,
        }));
    }
    (0..count).map(|_| read_key(r)).collect()
}

/// A hello: magic, version, then the sender's nonce.
pub(super) fn hello_bytes(nonce: &Nonce) -> [u8; 8 + NONCE_BYTES] {
    let mut out = [0u8; 8 + NONCE_BYTES];
    out[..4].copy_from_slice(&STORE_MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&STORE_PROTOCOL_VERSION.to_le_bytes());
    out[8..].copy_from_slice(nonce);
    out
}

/// Checks a hello's magic and version (the 8 bytes before its nonce). Never panics.
pub(super) fn check_hello_prefix(prefix: &[u8; 8]) -> std::result::Result<(), ProtocolViolation> {
    let magic = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]);
    if magic != STORE_MAGIC {
        return Err(ProtocolViolation::BadMagic { got: magic });
    }
    let version = u32::from_le_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]);
    if version != STORE_PROTOCOL_VERSION {
        return Err(ProtocolViolation::VersionMismatch {
            ours: STORE_PROTOCOL_VERSION,
            theirs: version,
        });
    }
    Ok(())
}

/// Reads and checks the other side's hello; returns its nonce.
pub(super) fn read_hello(r: &mut impl Read) -> std::result::Result<Nonce, ReadFailure> {
    let prefix = read_array::<8>(r)?;
    check_hello_prefix(&prefix).map_err(ReadFailure::Violation)?;
    read_array::<NONCE_BYTES>(r)
}

/// The proof a holder of `secret` sends in the role `label` on the connection whose nonces
/// are `client` and `server`.
pub(super) fn store_proof(
    secret: Option<&JobSecret>,
    label: &[u8],
    client: &Nonce,
    server: &Nonce,
) -> Proof {
    auth::prove(secret, label, &[client, server])
}

pub(super) fn proof_is_right(
    secret: Option<&JobSecret>,
    label: &[u8],
    nonces: (&Nonce, &Nonce),
    proof: &Proof,
) -> bool {
    auth::verify(secret, label, &[nonces.0, nonces.1], proof)
}

pub(super) fn no_randomness(_: Error) -> ReadFailure {
    ReadFailure::Io(io::Error::other("no randomness for a handshake nonce"))
}

/// The server's side of the handshake on a fresh connection.
pub(super) fn authenticate_client(
    reader: &mut impl Read,
    mut writer: impl Write,
    secret: Option<&JobSecret>,
) -> std::result::Result<(), ReadFailure> {
    let client_nonce = read_hello(reader)?;
    let server_nonce = auth::fresh_nonce().map_err(no_randomness)?;
    let mut greeting = hello_bytes(&server_nonce).to_vec();
    greeting.extend_from_slice(&store_proof(
        secret,
        SERVER_LABEL,
        &client_nonce,
        &server_nonce,
    ));
    writer.write_all(&greeting)?;
    // A client that hangs up instead of proving anything could not verify our proof: it has
    // another secret or none. That is a refusal too, and is logged as one.
    let proof = match read_array::<PROOF_BYTES>(reader) {
        Err(ReadFailure::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(ReadFailure::Violation(
                ProtocolViolation::AuthenticationFailed,
            ));
        }
        other => other?,
    };
    if !proof_is_right(secret, CLIENT_LABEL, (&client_nonce, &server_nonce), &proof) {
        let _ = writer.write_all(&[AUTH_REFUSED]);
        return Err(ReadFailure::Violation(
            ProtocolViolation::AuthenticationFailed,
        ));
    }
    writer.write_all(&[AUTH_OK])?;
    Ok(())
}
