//! The mesh handshake, a mutual HMAC-SHA256 challenge-response ([`crate::auth`]):
//!
//! 1. The connecting (higher) rank C sends its hello,
//!    `magic "HSMC" u32, version u32, job token u64, its rank u64, world size u64, flags u64`,
//!    then its nonce `nc` (32 bytes). Flag bit 0 ([`FLAG_FRAME_CHECKSUM`]) says that C puts
//!    CRC32C checksums on its frames; the other bits must be zero.
//! 2. The accepting rank A checks magic, version, token and world size; on a mismatch it
//!    answers one refusal byte (a version refusal is followed by A's version as `u32`).
//!    Otherwise it answers `CHALLENGE`, its nonce `na` and its proof
//!    `HMAC(secret, ACCEPTOR_LABEL, hello, nc, na, A's rank)`.
//! 3. C checks A's proof (so C never talks to a rank without the secret) and sends its own,
//!    `HMAC(secret, CONNECTOR_LABEL, hello, nc, na, A's rank)`.
//! 4. A checks C's proof: a wrong one gets `REFUSED_AUTH`. A right one whose checksum flag
//!    differs from A's gets `REFUSED_CHECKSUM` and A's flags as `u64`, and *both* ranks fail
//!    their rendezvous at once with
//!    [`ProtocolViolation::ChecksumSettingMismatch`] naming both ranks and both settings (the
//!    proof shows C is a member of the job, not a stranger, so A gives up instead of waiting
//!    for another connection). Otherwise C gets `ACCEPTED` and A's rank as `u64` (or
//!    `REFUSED_RANK` for a duplicate rank).
//!
//! All integers are little-endian. The magic and version come first and keep their places,
//! so a peer of another version still learns why it was refused.

use std::io::{self, Read, Write};

use crate::auth::{self, JobSecret, NONCE_BYTES, Nonce, PROOF_BYTES, Proof};
use crate::error::ProtocolViolation;

/// The first four bytes of a mesh hello: ASCII `HSMC`.
pub const MESH_MAGIC: u32 = u32::from_le_bytes(*b"HSMC");
/// The mesh protocol version this build speaks.
pub const MESH_PROTOCOL_VERSION: u32 = 3;

/// The hello flag that says the sender checksums its frames (`TcpConfig::frame_checksum`).
pub const FLAG_FRAME_CHECKSUM: u64 = 1;
/// Every flag this build knows; a hello with another bit set is refused.
const KNOWN_FLAGS: u64 = FLAG_FRAME_CHECKSUM;

pub(crate) const ACCEPTED: u8 = 0;
pub(crate) const REFUSED_VERSION: u8 = 1;
pub(crate) const REFUSED_TOKEN: u8 = 2;
pub(crate) const REFUSED_RANK: u8 = 3;
pub(crate) const CHALLENGE: u8 = 4;
pub(crate) const REFUSED_AUTH: u8 = 5;
pub(crate) const REFUSED_CHECKSUM: u8 = 6;

/// What the accepting rank's proof covers besides the transcript.
pub(crate) const ACCEPTOR_LABEL: &[u8] = b"hypershard mesh v2 acceptor";
/// What the connecting rank's proof covers besides the transcript.
pub(crate) const CONNECTOR_LABEL: &[u8] = b"hypershard mesh v2 connector";

/// What a connecting rank says about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) job_token: u64,
    pub(crate) rank: u64,
    pub(crate) world_size: u64,
    /// Whether the sender checksums its frames ([`FLAG_FRAME_CHECKSUM`]).
    pub(crate) frame_checksum: bool,
}

pub(crate) const HELLO_BYTES: usize = 40;

/// The flags word for a frame-checksum setting.
pub(crate) fn flags(frame_checksum: bool) -> u64 {
    if frame_checksum {
        FLAG_FRAME_CHECKSUM
    } else {
        0
    }
}

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut out = [0u8; HELLO_BYTES];
        out[0..4].copy_from_slice(&MESH_MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&MESH_PROTOCOL_VERSION.to_le_bytes());
        out[8..16].copy_from_slice(&self.job_token.to_le_bytes());
        out[16..24].copy_from_slice(&self.rank.to_le_bytes());
        out[24..32].copy_from_slice(&self.world_size.to_le_bytes());
        out[32..40].copy_from_slice(&flags(self.frame_checksum).to_le_bytes());
        out
    }
}

/// Why a hello was not accepted: the socket, or what the peer said.
pub(crate) enum HelloFailure {
    Io(io::Error),
    Violation(ProtocolViolation),
    /// An authenticated member of the job whose settings differ (it was told why): the
    /// rendezvous cannot complete, so the accepting rank fails it at once.
    Settings {
        peer: u64,
        violation: ProtocolViolation,
    },
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

/// The bytes both proofs of one connection cover: the hello, both nonces, the acceptor's rank.
pub(crate) struct Transcript<'a> {
    pub(crate) hello: &'a [u8; HELLO_BYTES],
    pub(crate) connector_nonce: &'a Nonce,
    pub(crate) acceptor_nonce: &'a Nonce,
    pub(crate) acceptor_rank: u64,
}

impl Transcript<'_> {
    /// The proof the holder of `secret` sends in the role named by `label`.
    pub(crate) fn prove(&self, secret: Option<&JobSecret>, label: &[u8]) -> Proof {
        let rank = self.acceptor_rank.to_le_bytes();
        auth::prove(
            secret,
            label,
            &[self.hello, self.connector_nonce, self.acceptor_nonce, &rank],
        )
    }

    /// Whether `proof` is the right one for the role named by `label` (constant time).
    pub(crate) fn verify(&self, secret: Option<&JobSecret>, label: &[u8], proof: &Proof) -> bool {
        let rank = self.acceptor_rank.to_le_bytes();
        auth::verify(
            secret,
            label,
            &[self.hello, self.connector_nonce, self.acceptor_nonce, &rank],
            proof,
        )
    }
}

/// What the accepting rank expects of a connecting one.
pub(crate) struct Expectation {
    pub(crate) job_token: u64,
    pub(crate) world_size: u64,
    /// The accepting rank itself (covered by both proofs).
    pub(crate) acceptor_rank: u64,
    pub(crate) secret: Option<JobSecret>,
    /// Whether the accepting rank checksums its frames; the connecting rank must agree.
    pub(crate) frame_checksum: bool,
}

/// Parses the fixed part of a hello: magic, version, token, rank, world size, flags. Never
/// panics; a wrong magic or version, or an unknown flag, is a typed violation.
pub(crate) fn decode_hello(bytes: &[u8; HELLO_BYTES]) -> Result<Hello, ProtocolViolation> {
    let magic = word32(bytes, 0);
    if magic != MESH_MAGIC {
        return Err(ProtocolViolation::BadMagic { got: magic });
    }
    let version = word32(bytes, 4);
    if version != MESH_PROTOCOL_VERSION {
        return Err(ProtocolViolation::VersionMismatch {
            ours: MESH_PROTOCOL_VERSION,
            theirs: version,
        });
    }
    let flags = word64(bytes, 32);
    if flags & !KNOWN_FLAGS != 0 {
        return Err(ProtocolViolation::ReservedNotZero);
    }
    Ok(Hello {
        job_token: word64(bytes, 8),
        rank: word64(bytes, 16),
        world_size: word64(bytes, 24),
        frame_checksum: flags & FLAG_FRAME_CHECKSUM != 0,
    })
}

/// Checks a decoded hello against what this rank expects: the job token, the world size and
/// a rank inside it.
pub(crate) fn check_hello(
    hello: &Hello,
    job_token: u64,
    world_size: u64,
) -> Result<(), ProtocolViolation> {
    if hello.job_token != job_token {
        return Err(ProtocolViolation::TokenMismatch);
    }
    if hello.world_size != world_size || hello.rank >= world_size {
        return Err(ProtocolViolation::BadRank { rank: hello.rank });
    }
    Ok(())
}

/// The accepting side of the handshake up to (not including) the final `ACCEPTED`: reads the
/// hello and checks it, challenges the connecting rank and checks its proof. On a refusal the
/// refusal byte has already been written back so the connecting rank learns why.
pub(crate) fn accept_hello(
    stream: &mut (impl Read + Write),
    expect: &Expectation,
) -> Result<Hello, HelloFailure> {
    let mut bytes = [0u8; HELLO_BYTES];
    stream.read_exact(&mut bytes)?;
    let hello = match decode_hello(&bytes) {
        Ok(hello) => hello,
        Err(violation @ ProtocolViolation::VersionMismatch { .. }) => {
            let mut refusal = [REFUSED_VERSION, 0, 0, 0, 0];
            refusal[1..].copy_from_slice(&MESH_PROTOCOL_VERSION.to_le_bytes());
            let _ = stream.write_all(&refusal);
            return Err(HelloFailure::Violation(violation));
        }
        // Not one of ours: answer nothing, the caller drops the connection.
        Err(violation) => return Err(HelloFailure::Violation(violation)),
    };
    if let Err(violation) = check_hello(&hello, expect.job_token, expect.world_size) {
        let code = match violation {
            ProtocolViolation::TokenMismatch => REFUSED_TOKEN,
            _ => REFUSED_RANK,
        };
        let _ = stream.write_all(&[code]);
        return Err(HelloFailure::Violation(violation));
    }
    let mut connector_nonce = [0u8; NONCE_BYTES];
    stream.read_exact(&mut connector_nonce)?;
    let acceptor_nonce = auth::fresh_nonce()
        .map_err(|_| HelloFailure::Io(io::Error::other("no randomness for a handshake nonce")))?;
    let transcript = Transcript {
        hello: &bytes,
        connector_nonce: &connector_nonce,
        acceptor_nonce: &acceptor_nonce,
        acceptor_rank: expect.acceptor_rank,
    };
    let mut challenge = [0u8; 1 + NONCE_BYTES + PROOF_BYTES];
    challenge[0] = CHALLENGE;
    challenge[1..1 + NONCE_BYTES].copy_from_slice(&acceptor_nonce);
    challenge[1 + NONCE_BYTES..]
        .copy_from_slice(&transcript.prove(expect.secret.as_ref(), ACCEPTOR_LABEL));
    stream.write_all(&challenge)?;
    let mut proof = [0u8; PROOF_BYTES];
    stream.read_exact(&mut proof)?;
    if !transcript.verify(expect.secret.as_ref(), CONNECTOR_LABEL, &proof) {
        let _ = stream.write_all(&[REFUSED_AUTH]);
        return Err(HelloFailure::Violation(
            ProtocolViolation::AuthenticationFailed,
        ));
    }
    if hello.frame_checksum != expect.frame_checksum {
        let mut refusal = [0u8; 9];
        refusal[0] = REFUSED_CHECKSUM;
        refusal[1..].copy_from_slice(&flags(expect.frame_checksum).to_le_bytes());
        // The connecting rank learns why from these bytes; if it is gone already, the
        // accepting rank's own error is all that is left to say.
        let _ = stream.write_all(&refusal);
        return Err(HelloFailure::Settings {
            peer: hello.rank,
            violation: ProtocolViolation::ChecksumSettingMismatch {
                rank: expect.acceptor_rank,
                ours: expect.frame_checksum,
                peer: hello.rank,
                theirs: hello.frame_checksum,
            },
        });
    }
    Ok(hello)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hello(rank: u64, world_size: u64) -> Hello {
        Hello {
            job_token: 7,
            rank,
            world_size,
            frame_checksum: false,
        }
    }

    #[test]
    fn a_hello_round_trips_and_each_mismatch_has_its_own_violation() {
        let h = hello(3, 4);
        assert_eq!(decode_hello(&h.encode()), Ok(h));
        assert_eq!(check_hello(&h, 7, 4), Ok(()));
        assert_eq!(check_hello(&h, 8, 4), Err(ProtocolViolation::TokenMismatch));
        // A world-size mismatch and a rank outside the world are both a bad rank claim.
        assert_eq!(
            check_hello(&h, 7, 5),
            Err(ProtocolViolation::BadRank { rank: 3 })
        );
        assert_eq!(
            check_hello(&hello(4, 4), 7, 4),
            Err(ProtocolViolation::BadRank { rank: 4 })
        );
        let mut old = h.encode();
        old[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(
            decode_hello(&old),
            Err(ProtocolViolation::VersionMismatch {
                ours: MESH_PROTOCOL_VERSION,
                theirs: 1
            })
        );
        // The checksum flag round-trips; an unknown flag bit is refused.
        let on = Hello {
            frame_checksum: true,
            ..h
        };
        assert_eq!(decode_hello(&on.encode()), Ok(on));
        assert_eq!(on.encode()[32], 1);
        let mut unknown = on.encode();
        unknown[33] = 0x40;
        assert_eq!(
            decode_hello(&unknown),
            Err(ProtocolViolation::ReservedNotZero)
        );
    }

    /// A connecting rank played over a byte stream: it sends its hello and nonce, and once
    /// the acceptor's challenge has been written to it, proves over the challenge's nonce, as
    /// a real connecting rank does.
    struct Connector {
        hello: Hello,
        secret: JobSecret,
        sent_opening: bool,
        pending: Vec<u8>,
        written: Vec<u8>,
    }

    const CONNECTOR_NONCE: Nonce = [9u8; NONCE_BYTES];

    impl Read for Connector {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if !self.sent_opening {
                self.sent_opening = true;
                self.pending = self.hello.encode().to_vec();
                self.pending.extend_from_slice(&CONNECTOR_NONCE);
            } else if self.pending.is_empty() && self.written.len() > NONCE_BYTES {
                let mut acceptor_nonce = [0u8; NONCE_BYTES];
                acceptor_nonce.copy_from_slice(&self.written[1..1 + NONCE_BYTES]);
                let hello = self.hello.encode();
                let transcript = Transcript {
                    hello: &hello,
                    connector_nonce: &CONNECTOR_NONCE,
                    acceptor_nonce: &acceptor_nonce,
                    acceptor_rank: 0,
                };
                self.pending = transcript
                    .prove(Some(&self.secret), CONNECTOR_LABEL)
                    .to_vec();
                // From here on `written` holds only what follows the challenge.
                self.written.clear();
            }
            let n = buf.len().min(self.pending.len());
            buf[..n].copy_from_slice(&self.pending[..n]);
            self.pending.drain(..n);
            Ok(n)
        }
    }

    impl Write for Connector {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.written.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn an_authenticated_peer_with_another_checksum_setting_is_refused_with_both_settings() {
        let secret = JobSecret::from_bytes(b"k".to_vec()).unwrap();
        for (acceptor, connector) in [(false, true), (true, false), (true, true)] {
            let mut peer = Connector {
                hello: Hello {
                    frame_checksum: connector,
                    ..hello(2, 4)
                },
                secret: secret.clone(),
                sent_opening: false,
                pending: Vec::new(),
                written: Vec::new(),
            };
            let expect = Expectation {
                job_token: 7,
                world_size: 4,
                acceptor_rank: 0,
                secret: Some(secret.clone()),
                frame_checksum: acceptor,
            };
            match accept_hello(&mut peer, &expect) {
                Ok(admitted) => {
                    assert_eq!(acceptor, connector);
                    assert!(admitted.frame_checksum == acceptor);
                    assert!(peer.written.is_empty(), "nothing after the proof yet");
                }
                Err(HelloFailure::Settings {
                    peer: rank,
                    violation,
                }) => {
                    assert_ne!(acceptor, connector);
                    assert_eq!(rank, 2);
                    assert_eq!(
                        violation,
                        ProtocolViolation::ChecksumSettingMismatch {
                            rank: 0,
                            ours: acceptor,
                            peer: 2,
                            theirs: connector,
                        }
                    );
                    // The connecting rank is told, with the acceptor's flags.
                    let mut told = vec![REFUSED_CHECKSUM];
                    told.extend_from_slice(&flags(acceptor).to_le_bytes());
                    assert_eq!(peer.written, told);
                }
                Err(_) => panic!("({acceptor}, {connector}): an unexpected refusal"),
            }
        }
    }

    /// A scripted peer: reads come from `input`, writes are collected.
    struct Scripted {
        input: std::io::Cursor<Vec<u8>>,
        written: Vec<u8>,
    }

    impl Read for Scripted {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.input.read(buf)
        }
    }

    impl Write for Scripted {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.written.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Arbitrary bytes from a connecting peer never panic the acceptor, never get a
        /// peer accepted without a right proof, and never make it write more than one
        /// challenge (so nothing is sized from what the peer claims).
        #[test]
        fn arbitrary_bytes_never_pass_the_acceptor(input in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut peer = Scripted { input: std::io::Cursor::new(input), written: Vec::new() };
            let expect = Expectation {
                job_token: 7,
                world_size: 4,
                acceptor_rank: 0,
                secret: Some(JobSecret::from_bytes(b"k".to_vec()).unwrap()),
                frame_checksum: true,
            };
            let outcome = accept_hello(&mut peer, &expect);
            prop_assert!(outcome.is_err());
            prop_assert!(peer.written.len() <= 1 + NONCE_BYTES + PROOF_BYTES + 1);
        }

        /// Any 40 bytes decode to a hello or a typed violation; a decoded one re-encodes to
        /// the same bytes.
        #[test]
        fn any_hello_bytes_decode_or_are_refused(
            bytes in proptest::collection::vec(any::<u8>(), HELLO_BYTES),
            valid_prefix in any::<bool>(),
        ) {
            let mut hello = [0u8; HELLO_BYTES];
            hello.copy_from_slice(&bytes);
            if valid_prefix {
                // Half the cases get past magic and version, so the flags check is reached.
                hello[0..4].copy_from_slice(&MESH_MAGIC.to_le_bytes());
                hello[4..8].copy_from_slice(&MESH_PROTOCOL_VERSION.to_le_bytes());
            }
            if let Ok(h) = decode_hello(&hello) {
                prop_assert_eq!(h.encode(), hello);
            }
        }
    }
}
