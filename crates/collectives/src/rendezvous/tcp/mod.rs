//! The TCP [`Store`]: [`TcpStoreServer`] hosts a [`MemoryStore`] on a socket (rank 0 or the
//! launcher runs it) and [`TcpStore`] is the client every rank uses.
//!
//! # Wire format
//!
//! All integers are little-endian. A connection opens with a mutual HMAC-SHA256
//! challenge-response keyed with the job secret ([`crate::auth`]):
//!
//! 1. client → server: `magic: u32 = "HSTS"`, `version: u32`, nonce `nc` (32 bytes);
//! 2. server → client: magic, version, nonce `ns`, proof `HMAC(secret, SERVER_LABEL, nc, ns)`;
//! 3. client → server: proof `HMAC(secret, CLIENT_LABEL, nc, ns)` (only after the server's
//!    proof checked out, so a client never sends requests to an impostor);
//! 4. server → client: one byte, `AUTH_OK` or `AUTH_REFUSED` (then the server closes).
//!
//! A client that sees another magic or version, a wrong proof or a refusal gets
//! [`Error::Protocol`]; the server drops a client whose hello or proof is wrong and logs a
//! warning naming its address, and no other client notices.
//!
//! A request is `opcode: u8` followed by its fields; a byte string is `len: u32` then `len`
//! bytes, a key list is `count: u32` then `count` strings, a timeout is `millis: u64`.
//! A reply is `status: u8` (0 = ok, 1 = store timeout with the missing keys as a key list,
//! 2 = not a counter with the key) followed by the op's result on success.
//! Every announced length is checked against [`MAX_KEY_BYTES`], [`MAX_VALUE_BYTES`] or
//! [`MAX_KEYS`] before anything is allocated, so a stray client cannot make the server
//! allocate more than one capped value; a client that breaks the protocol is disconnected and
//! no other client notices.
//!
//! The server runs one thread per connection, and at most [`MAX_PENDING_HANDSHAKES`] of them
//! for connections still in their handshake (which must end within `HANDSHAKE_TIMEOUT`):
//! connections over that cap are closed at once and logged (at most once a second), and a
//! client whose connection is closed before the server's hello tries again. Blocking `get`/`wait` requests wait on the
//! server side in short slices so that [`TcpStoreServer`]'s `Drop` can stop every thread
//! promptly. The client keeps a small pool of connections: a thread blocked in `wait` holds
//! one connection, and another thread's `set` through the same [`TcpStore`] opens or reuses
//! another, so the two never deadlock.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::{MemoryStore, Store};
use crate::auth::{self, JobSecret, NONCE_BYTES, Nonce, PROOF_BYTES, Proof};
use crate::error::{Error, IoAction, ProtocolViolation, Result};

mod client;
mod server;
#[cfg(test)]
mod tests;
mod wire;

pub use client::TcpStore;
pub use server::TcpStoreServer;
#[cfg(feature = "testing")]
pub(crate) use server::{check_hello_bytes, serve_bytes};

/// The first four bytes of every hello: ASCII `HSTS`.
pub(crate) const STORE_MAGIC: u32 = u32::from_le_bytes(*b"HSTS");
/// The protocol version this build speaks.
pub(crate) const STORE_PROTOCOL_VERSION: u32 = 2;
/// The longest key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 4096;
/// The largest value accepted, in bytes.
pub const MAX_VALUE_BYTES: usize = 64 << 20;
/// The most keys one `wait` or `check` may name.
pub const MAX_KEYS: usize = 4096;

/// How often server threads look at the stop flag.
const POLL: Duration = Duration::from_millis(50);
/// The most connections that may be in their handshake at once: each costs a thread, and
/// until it proves it holds the job secret it is a stranger. Connections over the cap are
/// closed at once (and logged), so idle or hostile connections cannot pile up threads.
pub const MAX_PENDING_HANDSHAKES: usize = 64;
/// How long a connection may take to complete its handshake before it is dropped.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// At most one warning about refused connections per this interval (a flood must not flood
/// the log or slow the accept loop).
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(1);
/// How long a server connection may stall in the middle of a request before it is dropped.
const MID_REQUEST_STALL: Duration = Duration::from_secs(30);
/// Extra time a client allows beyond a request's own timeout for the reply to arrive.
const REPLY_GRACE: Duration = Duration::from_secs(10);
/// The client's read deadline for requests that never block on the server.
const QUICK_REPLY: Duration = Duration::from_secs(60);

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_WAIT: u8 = 3;
const OP_CHECK: u8 = 4;
const OP_ADD: u8 = 5;
const OP_COMPARE_SET: u8 = 6;
const OP_DELETE: u8 = 7;
const OP_NUM_KEYS: u8 = 8;

/// The server's proof covers this label; the client's covers [`CLIENT_LABEL`].
const SERVER_LABEL: &[u8] = b"hypershard store v2 server";
const CLIENT_LABEL: &[u8] = b"hypershard store v2 client";
const AUTH_OK: u8 = 0;
const AUTH_REFUSED: u8 = 1;

const STATUS_OK: u8 = 0;
const STATUS_TIMEOUT: u8 = 1;
const STATUS_NOT_A_COUNTER: u8 = 2;
