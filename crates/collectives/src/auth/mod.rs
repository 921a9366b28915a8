//! Authenticated connections: the per-job [`JobSecret`] and the HMAC-SHA256 challenge-response
//! that every mesh connection (`tcp::Mesh`) and every Store connection (`store::tcp`) runs
//! before anything else crosses it.
//!
//! Each side sends a fresh 32-byte random nonce; each side then proves it holds the secret by
//! sending `HMAC-SHA256(secret, label ‖ transcript)` where the transcript covers both nonces
//! (and the hello), and the label differs per role, so a proof can neither be replayed on
//! another connection nor reflected back to its sender. Proofs are compared in constant time
//! ([`hmac::Mac::verify_slice`]).
//!
//! The secret comes from [`SECRET_ENV`] (the secret itself) or [`SECRET_FILE_ENV`] (a file
//! holding it, which must not be readable by group or others). `hypershard launch` generates
//! one per job. With neither set, both sides key the HMAC with the empty string: the handshake
//! still runs, but proves nothing, so any process that speaks the protocol can connect (the
//! behaviour of plain library use before authentication existed). A side with a secret refuses
//! a side without one, and the other way round.

use std::fmt;
use std::path::Path;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::error::{Error, Result, SecretProblem};

/// The environment variable that holds the job secret itself (any non-empty string).
pub const SECRET_ENV: &str = "HYPERSHARD_JOB_SECRET";
/// The environment variable that names a file holding the job secret (taken as its bytes
/// with one trailing newline removed). The file must not be accessible to group or others
/// (mode `0600` or stricter). It wins over [`SECRET_ENV`] when both are set.
pub const SECRET_FILE_ENV: &str = "HYPERSHARD_JOB_SECRET_FILE";

/// The bytes of a nonce.
pub(crate) const NONCE_BYTES: usize = 32;
/// The bytes of a proof (an HMAC-SHA256 tag).
pub(crate) const PROOF_BYTES: usize = 32;

/// A nonce: fresh random bytes per connection and side.
pub(crate) type Nonce = [u8; NONCE_BYTES];
/// A proof that its sender holds the job secret.
pub(crate) type Proof = [u8; PROOF_BYTES];

type HmacSha256 = Hmac<Sha256>;

/// The secret every process of one job shares. Its `Debug` output is redacted, and nothing in
/// this crate logs it.
#[derive(Clone, PartialEq, Eq)]
pub struct JobSecret {
    bytes: Vec<u8>,
}

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobSecret(<redacted>)")
    }
}

impl JobSecret {
    /// A secret made of `bytes`; [`SecretProblem::Empty`] when there are none (an empty key
    /// is what "no secret" means on the wire).
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<JobSecret> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(Error::JobSecret {
                variable: SECRET_ENV,
                problem: SecretProblem::Empty,
            });
        }
        Ok(JobSecret { bytes })
    }

    /// A fresh secret: 32 bytes from the operating system's random source, as 64 hex digits
    /// (text, so it can travel in an environment variable).
    pub fn generate() -> Result<JobSecret> {
        let mut raw = [0u8; 32];
        fill_random(&mut raw)?;
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        Ok(JobSecret {
            bytes: hex.into_bytes(),
        })
    }

    /// The secret as text for [`SECRET_ENV`], when it is valid UTF-8 (generated ones are).
    /// Hand it only to the job's own processes, never to a log.
    pub fn expose_text(&self) -> Option<&str> {
        std::str::from_utf8(&self.bytes).ok()
    }

    /// The secret of this process's job: [`SECRET_FILE_ENV`]'s file when that is set, else
    /// [`SECRET_ENV`]'s value, else `None` (no authentication).
    pub fn from_env() -> Result<Option<JobSecret>> {
        if let Some(path) = std::env::var_os(SECRET_FILE_ENV) {
            return JobSecret::from_file(Path::new(&path)).map(Some);
        }
        match std::env::var_os(SECRET_ENV) {
            None => Ok(None),
            Some(value) => {
                use std::os::unix::ffi::OsStrExt;
                JobSecret::from_bytes(value.as_bytes().to_vec()).map(Some)
            }
        }
    }

    /// Reads a secret file: it must be a regular file that group and others cannot access,
    /// and hold at least one byte besides a trailing newline.
    pub fn from_file(path: &Path) -> Result<JobSecret> {
        use std::os::unix::fs::PermissionsExt;
        let problem = |problem| Error::JobSecret {
            variable: SECRET_FILE_ENV,
            problem,
        };
        let unreadable = |e: std::io::Error| {
            problem(SecretProblem::FileUnreadable {
                path: path.to_path_buf(),
                kind: e.kind(),
            })
        };
        let metadata = std::fs::metadata(path).map_err(unreadable)?;
        let mode = metadata.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(problem(SecretProblem::FileTooOpen {
                path: path.to_path_buf(),
                mode,
            }));
        }
        let mut bytes = std::fs::read(path).map_err(unreadable)?;
        if bytes.last() == Some(&b'\n') {
            bytes.pop();
        }
        if bytes.is_empty() {
            return Err(problem(SecretProblem::Empty));
        }
        Ok(JobSecret { bytes })
    }
}

/// Fills `out` from the operating system's random source.
fn fill_random(out: &mut [u8]) -> Result<()> {
    getrandom::fill(out).map_err(|e| Error::JobSecret {
        variable: SECRET_ENV,
        problem: SecretProblem::NoRandomness {
            code: e.raw_os_error().unwrap_or(0),
        },
    })
}

/// A fresh nonce from the operating system's random source.
pub(crate) fn fresh_nonce() -> Result<Nonce> {
    let mut nonce = [0u8; NONCE_BYTES];
    fill_random(&mut nonce)?;
    Ok(nonce)
}

/// The HMAC keyed with `secret` (the empty key without one) over `label` then every part of
/// `transcript`.
fn keyed(secret: Option<&JobSecret>, label: &[u8], transcript: &[&[u8]]) -> HmacSha256 {
    let key = secret.map_or(&[][..], |s| s.bytes.as_slice());
    // invariant: HMAC accepts keys of every length (long ones are hashed first).
    let mut mac =
        <HmacSha256 as KeyInit>::new_from_slice(key).expect("invariant: HMAC takes any key length");
    mac.update(label);
    for part in transcript {
        // Each part is length-prefixed so that moving bytes between parts changes the tag.
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
    mac
}

/// The proof that the holder of `secret` sends in role `label` for `transcript`.
pub(crate) fn prove(secret: Option<&JobSecret>, label: &[u8], transcript: &[&[u8]]) -> Proof {
    let tag = keyed(secret, label, transcript).finalize().into_bytes();
    let mut proof = [0u8; PROOF_BYTES];
    proof.copy_from_slice(&tag);
    proof
}

/// Whether `proof` is what a holder of `secret` sends in role `label` for `transcript`,
/// compared in constant time.
pub(crate) fn verify(
    secret: Option<&JobSecret>,
    label: &[u8],
    transcript: &[&[u8]],
    proof: &Proof,
) -> bool {
    keyed(secret, label, transcript).verify_slice(proof).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(text: &str) -> JobSecret {
        JobSecret::from_bytes(text.as_bytes().to_vec()).unwrap()
    }

    #[test]
    fn a_proof_verifies_only_with_the_same_secret_label_and_transcript() {
        let s = secret("job-42");
        let n1 = [1u8; NONCE_BYTES];
        let n2 = [2u8; NONCE_BYTES];
        let proof = prove(Some(&s), b"client", &[&n1, &n2]);
        assert!(verify(Some(&s), b"client", &[&n1, &n2], &proof));
        assert!(!verify(
            Some(&secret("job-43")),
            b"client",
            &[&n1, &n2],
            &proof
        ));
        assert!(!verify(None, b"client", &[&n1, &n2], &proof));
        assert!(!verify(Some(&s), b"server", &[&n1, &n2], &proof));
        assert!(!verify(Some(&s), b"client", &[&n2, &n1], &proof));
        // Moving a byte from one part to the next changes the tag (the parts are framed).
        assert!(!verify(
            Some(&s),
            b"client",
            &[&n1[..31], &[1u8; 33][..]],
            &proof
        ));
        let mut flipped = proof;
        flipped[7] ^= 1;
        assert!(!verify(Some(&s), b"client", &[&n1, &n2], &flipped));
    }

    #[test]
    fn without_a_secret_both_sides_agree_on_the_empty_key() {
        let n = [9u8; NONCE_BYTES];
        assert!(verify(None, b"x", &[&n], &prove(None, b"x", &[&n])));
    }

    #[test]
    fn generated_secrets_are_64_hex_digits_and_differ() {
        let a = JobSecret::generate().unwrap();
        let b = JobSecret::generate().unwrap();
        let text = a.expose_text().unwrap();
        assert_eq!(text.len(), 64);
        assert!(text.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        assert_ne!(fresh_nonce().unwrap(), fresh_nonce().unwrap());
    }

    #[test]
    fn debug_output_never_shows_the_secret() {
        let s = secret("hunter2-very-secret");
        let shown = format!("{s:?} {:?}", Some(&s));
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("redacted"));
    }

    #[test]
    fn an_empty_secret_is_refused() {
        assert!(matches!(
            JobSecret::from_bytes(Vec::new()),
            Err(Error::JobSecret {
                problem: SecretProblem::Empty,
                ..
            })
        ));
    }

    #[test]
    fn secret_files_must_be_private_and_lose_one_trailing_newline() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("hypershard-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secret");
        std::fs::write(&path, b"abc\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(JobSecret::from_file(&path).unwrap(), secret("abc"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        match JobSecret::from_file(&path) {
            Err(Error::JobSecret {
                variable,
                problem: SecretProblem::FileTooOpen { mode, .. },
            }) => {
                assert_eq!(variable, SECRET_FILE_ENV);
                assert_eq!(mode, 0o644);
            }
            other => panic!("expected FileTooOpen, got {other:?}"),
        }
        std::fs::write(&path, b"\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
        assert!(matches!(
            JobSecret::from_file(&path),
            Err(Error::JobSecret {
                problem: SecretProblem::Empty,
                ..
            })
        ));
        assert!(matches!(
            JobSecret::from_file(&dir.join("missing")),
            Err(Error::JobSecret {
                problem: SecretProblem::FileUnreadable { .. },
                ..
            })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
