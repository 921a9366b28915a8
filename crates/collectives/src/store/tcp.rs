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

// ---------------------------------------------------------------------------------------------
// Encoding helpers shared by both ends.
// ---------------------------------------------------------------------------------------------

/// Why reading a message failed: the socket, or the bytes that arrived.
enum ReadFailure {
    Io(io::Error),
    Violation(ProtocolViolation),
}

impl From<io::Error> for ReadFailure {
    fn from(e: io::Error) -> Self {
        ReadFailure::Io(e)
    }
}

impl ReadFailure {
    fn into_error(self) -> Error {
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

fn write_error(source: io::Error) -> Error {
    Error::Io {
        action: IoAction::Write,
        peer: None,
        source,
    }
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends a length-prefixed byte string after checking it against `limit`.
fn put_bytes(out: &mut Vec<u8>, bytes: &[u8], limit: usize) -> Result<()> {
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

fn put_keys(out: &mut Vec<u8>, keys: &[&str]) -> Result<()> {
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

fn put_duration(out: &mut Vec<u8>, d: Duration) {
    put_u64(out, u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
}

fn read_array<const N: usize>(r: &mut impl Read) -> std::result::Result<[u8; N], ReadFailure> {
    let mut buf = [0u8; N];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

fn read_u8(r: &mut impl Read) -> std::result::Result<u8, ReadFailure> {
    Ok(read_array::<1>(r)?[0])
}

fn read_u32(r: &mut impl Read) -> std::result::Result<u32, ReadFailure> {
    Ok(u32::from_le_bytes(read_array(r)?))
}

fn read_u64(r: &mut impl Read) -> std::result::Result<u64, ReadFailure> {
    Ok(u64::from_le_bytes(read_array(r)?))
}

/// Reads a length-prefixed byte string, refusing lengths above `limit` before allocating.
fn read_bytes(r: &mut impl Read, limit: usize) -> std::result::Result<Vec<u8>, ReadFailure> {
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

fn read_key(r: &mut impl Read) -> std::result::Result<String, ReadFailure> {
    let bytes = read_bytes(r, MAX_KEY_BYTES)?;
    // Keys are Rust strings on both ends; bytes that are not UTF-8 can only come from a
    // client that does not speak this protocol.
    String::from_utf8(bytes).map_err(|_| ReadFailure::Violation(ProtocolViolation::NotUtf8))
}

fn read_keys(r: &mut impl Read) -> std::result::Result<Vec<String>, ReadFailure> {
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
fn hello_bytes(nonce: &Nonce) -> [u8; 8 + NONCE_BYTES] {
    let mut out = [0u8; 8 + NONCE_BYTES];
    out[..4].copy_from_slice(&STORE_MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&STORE_PROTOCOL_VERSION.to_le_bytes());
    out[8..].copy_from_slice(nonce);
    out
}

/// Checks a hello's magic and version (the 8 bytes before its nonce). Never panics.
fn check_hello_prefix(prefix: &[u8; 8]) -> std::result::Result<(), ProtocolViolation> {
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
fn read_hello(r: &mut impl Read) -> std::result::Result<Nonce, ReadFailure> {
    let prefix = read_array::<8>(r)?;
    check_hello_prefix(&prefix).map_err(ReadFailure::Violation)?;
    read_array::<NONCE_BYTES>(r)
}

/// The proof a holder of `secret` sends in the role `label` on the connection whose nonces
/// are `client` and `server`.
fn store_proof(secret: Option<&JobSecret>, label: &[u8], client: &Nonce, server: &Nonce) -> Proof {
    auth::prove(secret, label, &[client, server])
}

fn proof_is_right(
    secret: Option<&JobSecret>,
    label: &[u8],
    nonces: (&Nonce, &Nonce),
    proof: &Proof,
) -> bool {
    auth::verify(secret, label, &[nonces.0, nonces.1], proof)
}

fn no_randomness(_: Error) -> ReadFailure {
    ReadFailure::Io(io::Error::other("no randomness for a handshake nonce"))
}

/// The server's side of the handshake on a fresh connection.
fn authenticate_client(
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

// ---------------------------------------------------------------------------------------------
// Server.
// ---------------------------------------------------------------------------------------------

/// A running TCP store server. Dropping it stops the accept loop and every connection thread
/// (within about 50 ms); connected clients then see their connection close.
#[derive(Debug)]
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    /// Whether clients must prove they hold a job secret (the secret itself stays private).
    authenticated: bool,
    store: Arc<MemoryStore>,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Binds `addr` (e.g. `"127.0.0.1:0"` for a free port) and starts serving. Clients must
    /// hold the job secret of this process's environment ([`JobSecret::from_env`]; none set:
    /// anyone who speaks the protocol may connect).
    pub fn bind(addr: impl ToSocketAddrs) -> Result<TcpStoreServer> {
        let secret = JobSecret::from_env()?;
        TcpStoreServer::bind_with_secret(addr, secret)
    }

    /// [`TcpStoreServer::bind`] with the job secret given (`None`: no authentication). A
    /// client that cannot prove it holds the secret is refused and logged with its address.
    pub fn bind_with_secret(
        addr: impl ToSocketAddrs,
        secret: Option<JobSecret>,
    ) -> Result<TcpStoreServer> {
        let bind_error = |source| Error::Io {
            action: IoAction::Bind,
            peer: None,
            source,
        };
        let listener = TcpListener::bind(addr).map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        // A non-blocking listener lets the accept loop notice the stop flag.
        listener.set_nonblocking(true).map_err(|source| Error::Io {
            action: IoAction::SocketOption,
            peer: None,
            source,
        })?;
        let store = Arc::new(MemoryStore::new());
        let stop = Arc::new(AtomicBool::new(false));
        let authenticated = secret.is_some();
        let acceptor = {
            let shared = Shared {
                store: store.clone(),
                stop: stop.clone(),
                secret,
                pending: AtomicUsize::new(0),
            };
            thread::Builder::new()
                .name(format!("tcp-store-{}", local_addr.port()))
                .spawn(move || accept_loop(&listener, &Arc::new(shared)))
                .map_err(|source| Error::SpawnFailed {
                    group: format!("tcp store {local_addr}"),
                    source,
                })?
        };
        tracing::debug!(%local_addr, "tcp store server listening");
        Ok(TcpStoreServer {
            local_addr,
            authenticated,
            store,
            stop,
            acceptor: Some(acceptor),
        })
    }

    /// The address the server listens on (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Whether clients must prove they hold a job secret.
    pub fn is_authenticated(&self) -> bool {
        self.authenticated
    }

    /// The store the server serves, for the hosting process to use without a socket.
    pub fn store(&self) -> Arc<MemoryStore> {
        self.store.clone()
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(acceptor) = self.acceptor.take() {
            // A panicked acceptor has nothing left to clean up; ignoring the result keeps
            // Drop from panicking.
            let _ = acceptor.join();
        }
    }
}

/// What every connection thread of one server shares.
struct Shared {
    store: Arc<MemoryStore>,
    stop: Arc<AtomicBool>,
    secret: Option<JobSecret>,
    /// Connections accepted that have not finished their handshake.
    pending: AtomicUsize,
}

/// Counts a connection as pending until its handshake ends, however it ends.
struct PendingGuard<'a>(Option<&'a AtomicUsize>);

impl PendingGuard<'_> {
    fn done(&mut self) {
        if let Some(pending) = self.0.take() {
            pending.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.done();
    }
}

/// Refusals of connections over [`MAX_PENDING_HANDSHAKES`], logged at most once a second.
struct RefusalLog {
    refused: u64,
    last_logged: Option<Instant>,
}

impl RefusalLog {
    fn refused(&mut self, peer_addr: SocketAddr) {
        self.refused += 1;
        if self
            .last_logged
            .is_some_and(|at| at.elapsed() < REFUSAL_LOG_INTERVAL)
        {
            return;
        }
        self.last_logged = Some(Instant::now());
        tracing::warn!(
            %peer_addr,
            refused = self.refused,
            limit = MAX_PENDING_HANDSHAKES,
            "tcp store: too many connections in their handshake; refused this one (refused so far: {})",
            self.refused
        );
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    let mut connections: Vec<JoinHandle<()>> = Vec::new();
    let mut refusals = RefusalLog {
        refused: 0,
        last_logged: None,
    };
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer_addr)) => {
                connections.retain(|h| !h.is_finished());
                if shared.pending.load(Ordering::SeqCst) >= MAX_PENDING_HANDSHAKES {
                    // Closed without a thread: costs the accept and the close.
                    let _ = stream.shutdown(Shutdown::Both);
                    drop(stream);
                    refusals.refused(peer_addr);
                    continue;
                }
                shared.pending.fetch_add(1, Ordering::SeqCst);
                let shared_for_thread = shared.clone();
                let spawned = thread::Builder::new()
                    .name(format!("tcp-store-conn-{peer_addr}"))
                    .spawn(move || serve_connection(stream, &shared_for_thread));
                match spawned {
                    Ok(handle) => connections.push(handle),
                    Err(e) => {
                        // The closure (and its stream) was dropped without running.
                        shared.pending.fetch_sub(1, Ordering::SeqCst);
                        tracing::warn!(%peer_addr, error = %e, "tcp store: cannot start a connection thread; dropping the client")
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait_readable(listener, POLL / 5),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::warn!(error = %e, "tcp store: accept failed");
                thread::sleep(POLL);
            }
        }
    }
    for handle in connections {
        // Connection threads watch the same stop flag, so these joins end within a poll.
        let _ = handle.join();
    }
}

/// Waits until `listener` has a connection to accept, or `timeout` passes. Waking at once
/// (rather than sleeping a fixed slice) keeps the accept queue drained under a flood of
/// connections, so a rank's connection is never stuck behind a full backlog.
fn wait_readable(listener: &TcpListener, timeout: Duration) {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let millis = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: poll(2) reads and writes exactly the one `pollfd` we own and pass with count 1;
    // the descriptor belongs to `listener`, which outlives the call. Exercised by every
    // store test (`every_op_round_trips` among them) and by tests/store_flood.rs.
    unsafe {
        libc::poll(&mut fd, 1, millis);
    }
}

/// A reader that retries read timeouts until the stop flag is set, so a connection thread
/// idles cheaply yet stops promptly. Once a request has started, a stall longer than
/// [`MID_REQUEST_STALL`] drops the client; before `deadline` (the handshake's) passes, the
/// handshake must be done.
struct StopAwareReader<'a> {
    stream: &'a TcpStream,
    stop: &'a AtomicBool,
    stalled_since: Option<Instant>,
    in_request: bool,
    deadline: Option<Instant>,
}

impl Read for StopAwareReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "tcp store server is shutting down",
                ));
            }
            match (&mut &*self.stream).read(buf) {
                Ok(n) => {
                    self.stalled_since = None;
                    return Ok(n);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    if self.deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the handshake took too long",
                        ));
                    }
                    if self.in_request {
                        let since = *self.stalled_since.get_or_insert_with(Instant::now);
                        if since.elapsed() > MID_REQUEST_STALL {
                            return Err(e);
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

fn serve_connection(stream: TcpStream, shared: &Shared) {
    let peer_addr = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    match serve_requests(&stream, shared) {
        Ok(()) => {}
        Err(ReadFailure::Io(e)) => {
            tracing::debug!(peer = %peer_addr, error = %e, "tcp store: client disconnected");
        }
        Err(ReadFailure::Violation(ProtocolViolation::AuthenticationFailed)) => {
            tracing::warn!(peer = %peer_addr, "tcp store: refused a client that does not hold the job secret");
        }
        Err(ReadFailure::Violation(violation)) => {
            tracing::warn!(peer = %peer_addr, %violation, "tcp store: dropping a client that broke the protocol");
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

fn serve_requests(stream: &TcpStream, shared: &Shared) -> std::result::Result<(), ReadFailure> {
    let (store, stop) = (&*shared.store, &*shared.stop);
    // The accepted socket may inherit non-blocking mode from the listener on some platforms.
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(POLL))?;
    stream.set_nodelay(true)?;
    let mut reader = StopAwareReader {
        stream,
        stop,
        stalled_since: None,
        in_request: true,
        deadline: Some(Instant::now() + HANDSHAKE_TIMEOUT),
    };
    let mut pending = PendingGuard(Some(&shared.pending));
    authenticate_client(&mut reader, stream, shared.secret.as_ref())?;
    pending.done();
    reader.deadline = None;
    loop {
        reader.in_request = false;
        let opcode = match read_u8(&mut reader) {
            Ok(op) => op,
            // A clean close between requests is how clients say goodbye.
            Err(ReadFailure::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        reader.in_request = true;
        let reply = handle_request(opcode, &mut reader, store, stop)?;
        (&mut &*stream).write_all(&reply)?;
    }
}

/// Waits for `keys` in slices of [`POLL`] so a stopping server does not linger.
fn wait_sliced(
    store: &MemoryStore,
    keys: &[&str],
    timeout: Duration,
    stop: &AtomicBool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // A stopping server does not wait at all.
        let slice = if stop.load(Ordering::SeqCst) {
            Duration::ZERO
        } else {
            left.min(POLL)
        };
        match store.wait(keys, slice) {
            Err(Error::StoreTimeout { keys, .. }) if !left.is_zero() && left > POLL => {
                if stop.load(Ordering::SeqCst) {
                    return Err(Error::StoreTimeout {
                        keys,
                        after: timeout,
                    });
                }
            }
            Err(Error::StoreTimeout { keys, .. }) => {
                return Err(Error::StoreTimeout {
                    keys,
                    after: timeout,
                });
            }
            other => return other,
        }
    }
}

/// Serves the requests encoded in `input` (what an authenticated client would send) against
/// a fresh in-memory store, as the server does but without a socket and without waiting
/// (blocking requests time out at once); returns how many requests were served before the
/// bytes ran out or broke the protocol. For the fuzz targets and property tests: arbitrary
/// input must end in a typed refusal, never a panic or an allocation beyond the caps.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn serve_bytes(input: &[u8]) -> usize {
    let store = MemoryStore::new();
    let stop = AtomicBool::new(true);
    let mut reader = io::Cursor::new(input);
    let mut served = 0;
    while let Ok(opcode) = read_u8(&mut reader) {
        if handle_request(opcode, &mut reader, &store, &stop).is_err() {
            break;
        }
        served += 1;
    }
    served
}

/// Checks a hello's first eight bytes (magic and version) as the server does; for the fuzz
/// targets.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn check_hello_bytes(input: &[u8]) -> bool {
    let mut prefix = [0u8; 8];
    match input.get(..8) {
        Some(bytes) => prefix.copy_from_slice(bytes),
        None => return false,
    }
    check_hello_prefix(&prefix).is_ok()
}

/// Reads one request's fields, runs it, and encodes the reply.
fn handle_request(
    opcode: u8,
    r: &mut impl Read,
    store: &MemoryStore,
    stop: &AtomicBool,
) -> std::result::Result<Vec<u8>, ReadFailure> {
    let mut reply = vec![STATUS_OK];
    // The in-memory store only fails with timeouts and not-a-counter, both encoded below.
    let outcome: Result<()> = match opcode {
        OP_SET => {
            let key = read_key(r)?;
            let value = read_bytes(r, MAX_VALUE_BYTES)?;
            store.set(&key, &value)
        }
        OP_GET => {
            let key = read_key(r)?;
            let timeout = Duration::from_millis(read_u64(r)?);
            wait_sliced(store, &[&key], timeout, stop).and_then(|()| {
                let value = store.get(&key, Duration::ZERO)?;
                put_u32(&mut reply, value.len() as u32);
                reply.extend_from_slice(&value);
                Ok(())
            })
        }
        OP_WAIT => {
            let keys = read_keys(r)?;
            let timeout = Duration::from_millis(read_u64(r)?);
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            wait_sliced(store, &refs, timeout, stop)
        }
        OP_CHECK => {
            let keys = read_keys(r)?;
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            store
                .check(&refs)
                .map(|present| reply.push(u8::from(present)))
        }
        OP_ADD => {
            let key = read_key(r)?;
            let delta = read_u64(r)? as i64;
            store
                .add(&key, delta)
                .map(|v| put_u64(&mut reply, v as u64))
        }
        OP_COMPARE_SET => {
            let key = read_key(r)?;
            let expected = read_bytes(r, MAX_VALUE_BYTES)?;
            let desired = read_bytes(r, MAX_VALUE_BYTES)?;
            store.compare_set(&key, &expected, &desired).map(|value| {
                put_u32(&mut reply, value.len() as u32);
                reply.extend_from_slice(&value);
            })
        }
        OP_DELETE => {
            let key = read_key(r)?;
            store
                .delete(&key)
                .map(|existed| reply.push(u8::from(existed)))
        }
        OP_NUM_KEYS => store.num_keys().map(|n| put_u64(&mut reply, n as u64)),
        other => {
            return Err(ReadFailure::Violation(ProtocolViolation::UnexpectedFrame {
                expected: OP_SET,
                got: other,
            }));
        }
    };
    match outcome {
        Ok(()) => Ok(reply),
        Err(Error::StoreTimeout { keys, .. }) => {
            let mut reply = vec![STATUS_TIMEOUT];
            // invariant: the missing keys are a subset of the request's keys, which passed the
            // same caps when they were read.
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            if put_keys(&mut reply, &refs).is_err() {
                reply.truncate(1);
                put_u32(&mut reply, 0);
            }
            Ok(reply)
        }
        Err(Error::StoreNotACounter { key }) => {
            let mut reply = vec![STATUS_NOT_A_COUNTER];
            put_u32(&mut reply, key.len() as u32);
            reply.extend_from_slice(key.as_bytes());
            Ok(reply)
        }
        Err(e) => {
            // The memory store has no other failure; should one appear, the client sees its
            // connection close rather than a made-up status.
            tracing::warn!(error = %e, "tcp store: unexpected store error");
            Err(ReadFailure::Io(io::Error::other("store error")))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Client.
// ---------------------------------------------------------------------------------------------

/// A client of a [`TcpStoreServer`], implementing [`Store`]. Cheap to share behind an `Arc`;
/// concurrent calls use separate pooled connections.
#[derive(Debug)]
pub struct TcpStore {
    addr: SocketAddr,
    connect_timeout: Duration,
    secret: Option<JobSecret>,
    idle: Mutex<Vec<TcpStream>>,
}

impl TcpStore {
    /// Connects to the server at `addr`, retrying until `timeout` passes (the server may still
    /// be starting), and runs the handshake with the job secret of this process's environment
    /// ([`JobSecret::from_env`]; none set: no authentication).
    pub fn connect(addr: impl ToSocketAddrs, timeout: Duration) -> Result<TcpStore> {
        let secret = JobSecret::from_env()?;
        TcpStore::connect_with_secret(addr, timeout, secret)
    }

    /// [`TcpStore::connect`] with the job secret given (`None`: no authentication). A server
    /// that does not prove it holds the secret, or refuses ours, is
    /// [`ProtocolViolation::AuthenticationFailed`].
    pub fn connect_with_secret(
        addr: impl ToSocketAddrs,
        timeout: Duration,
        secret: Option<JobSecret>,
    ) -> Result<TcpStore> {
        let addr = addr
            .to_socket_addrs()
            .map_err(|source| Error::Io {
                action: IoAction::Connect,
                peer: None,
                source,
            })?
            .next()
            .ok_or_else(|| Error::Io {
                action: IoAction::Connect,
                peer: None,
                source: io::Error::new(io::ErrorKind::InvalidInput, "address resolved to nothing"),
            })?;
        let client = TcpStore {
            addr,
            connect_timeout: timeout,
            secret,
            idle: Mutex::new(Vec::new()),
        };
        let first = client.open()?;
        client.release(first);
        Ok(client)
    }

    /// The server's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Opens a fresh connection and exchanges hellos. A server that closes the connection
    /// before its hello (it is at its cap of pending handshakes, see
    /// [`MAX_PENDING_HANDSHAKES`]) is tried again until the connect timeout.
    fn open(&self) -> Result<TcpStream> {
        let deadline = Instant::now() + self.connect_timeout;
        loop {
            match self.open_once(deadline) {
                Err(Error::Io {
                    action: IoAction::Read,
                    source,
                    ..
                }) if matches!(
                    source.kind(),
                    io::ErrorKind::UnexpectedEof
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionAborted
                ) && Instant::now() < deadline =>
                {
                    thread::sleep(Duration::from_millis(50));
                }
                other => return other,
            }
        }
    }

    fn open_once(&self, deadline: Instant) -> Result<TcpStream> {
        let stream = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(&self.addr, left.max(Duration::from_millis(10))) {
                Ok(stream) => break stream,
                Err(source) => {
                    if Instant::now() >= deadline {
                        return Err(Error::Io {
                            action: IoAction::Connect,
                            peer: None,
                            source,
                        });
                    }
                    thread::sleep(Duration::from_millis(20).min(left));
                }
            }
        };
        let option_error = |source| Error::Io {
            action: IoAction::SocketOption,
            peer: None,
            source,
        };
        stream.set_nodelay(true).map_err(option_error)?;
        stream
            .set_read_timeout(Some(self.connect_timeout.max(Duration::from_secs(1))))
            .map_err(option_error)?;
        let client_nonce = auth::fresh_nonce()?;
        (&stream)
            .write_all(&hello_bytes(&client_nonce))
            .map_err(write_error)?;
        let server_nonce = read_hello(&mut &stream).map_err(ReadFailure::into_error)?;
        let server_proof =
            read_array::<PROOF_BYTES>(&mut &stream).map_err(ReadFailure::into_error)?;
        let secret = self.secret.as_ref();
        let refused = Error::Protocol {
            peer: None,
            violation: ProtocolViolation::AuthenticationFailed,
        };
        if !proof_is_right(
            secret,
            SERVER_LABEL,
            (&client_nonce, &server_nonce),
            &server_proof,
        ) {
            tracing::warn!(server = %self.addr, "tcp store: the server did not prove it holds the job secret");
            return Err(refused);
        }
        (&stream)
            .write_all(&store_proof(
                secret,
                CLIENT_LABEL,
                &client_nonce,
                &server_nonce,
            ))
            .map_err(write_error)?;
        match read_u8(&mut &stream).map_err(ReadFailure::into_error)? {
            AUTH_OK => Ok(stream),
            AUTH_REFUSED => {
                tracing::warn!(server = %self.addr, "tcp store: the server refused our job secret");
                Err(refused)
            }
            other => Err(Error::Protocol {
                peer: None,
                violation: ProtocolViolation::UnexpectedFrame {
                    expected: AUTH_OK,
                    got: other,
                },
            }),
        }
    }

    fn release(&self, stream: TcpStream) {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(stream);
    }

    /// Sends one request and returns the reply's body after its status. A connection that
    /// failed is dropped; a healthy one goes back to the pool.
    fn call(&self, request: &[u8], server_wait: Duration) -> Result<ReplyBody> {
        let pooled = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let stream = match pooled {
            Some(stream) => stream,
            None => self.open()?,
        };
        let read_deadline = server_wait.saturating_add(REPLY_GRACE).max(QUICK_REPLY);
        stream
            .set_read_timeout(Some(read_deadline))
            .map_err(|source| Error::Io {
                action: IoAction::SocketOption,
                peer: None,
                source,
            })?;
        (&stream).write_all(request).map_err(write_error)?;
        let mut reader = &stream;
        let status = read_u8(&mut reader).map_err(ReadFailure::into_error)?;
        let body = ReplyBody { status, stream };
        Ok(body)
    }
}

/// A reply whose status has been read; the caller reads the rest and then returns the
/// connection to the pool with [`ReplyBody::finish`].
struct ReplyBody {
    status: u8,
    stream: TcpStream,
}

impl ReplyBody {
    /// Turns error statuses into errors (the connection stays usable and is pooled).
    fn check(self, client: &TcpStore, timeout: Duration) -> Result<ReplyBody> {
        match self.status {
            STATUS_OK => Ok(self),
            STATUS_TIMEOUT => {
                let keys = read_keys(&mut &self.stream).map_err(ReadFailure::into_error)?;
                client.release(self.stream);
                Err(Error::StoreTimeout {
                    keys,
                    after: timeout,
                })
            }
            STATUS_NOT_A_COUNTER => {
                let key = read_key(&mut &self.stream).map_err(ReadFailure::into_error)?;
                client.release(self.stream);
                Err(Error::StoreNotACounter { key })
            }
            other => Err(Error::Protocol {
                peer: None,
                violation: ProtocolViolation::UnexpectedFrame {
                    expected: STATUS_OK,
                    got: other,
                },
            }),
        }
    }

    fn read<T>(
        &mut self,
        f: impl FnOnce(&mut TcpStream) -> std::result::Result<T, ReadFailure>,
    ) -> Result<T> {
        f(&mut self.stream).map_err(ReadFailure::into_error)
    }

    fn finish(self, client: &TcpStore) {
        client.release(self.stream);
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut req = vec![OP_SET];
        put_bytes(&mut req, key.as_bytes(), MAX_KEY_BYTES)?;
        put_bytes(&mut req, value, MAX_VALUE_BYTES)?;
        self.call(&req, Duration::ZERO)?
            .check(self, Duration::ZERO)?
            .finish(self);
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut req = vec![OP_GET];
        put_bytes(&mut req, key.as_bytes(), MAX_KEY_BYTES)?;
        put_duration(&mut req, timeout);
        let mut body = self.call(&req, timeout)?.check(self, timeout)?;
        let value = body.read(|r| read_bytes(r, MAX_VALUE_BYTES))?;
        body.finish(self);
        Ok(value)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let mut req = vec![OP_WAIT];
        put_keys(&mut req, keys)?;
        put_duration(&mut req, timeout);
        self.call(&req, timeout)?.check(self, timeout)?.finish(self);
        Ok(())
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let mut req = vec![OP_CHECK];
        put_keys(&mut req, keys)?;
        let mut body = self
            .call(&req, Duration::ZERO)?
            .check(self, Duration::ZERO)?;
        let present = body.read(read_u8)? != 0;
        body.finish(self);
        Ok(present)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut req = vec![OP_ADD];
        put_bytes(&mut req, key.as_bytes(), MAX_KEY_BYTES)?;
        put_u64(&mut req, delta as u64);
        let mut body = self
            .call(&req, Duration::ZERO)?
            .check(self, Duration::ZERO)?;
        let value = body.read(read_u64)? as i64;
        body.finish(self);
        Ok(value)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let mut req = vec![OP_COMPARE_SET];
        put_bytes(&mut req, key.as_bytes(), MAX_KEY_BYTES)?;
        put_bytes(&mut req, expected, MAX_VALUE_BYTES)?;
        put_bytes(&mut req, desired, MAX_VALUE_BYTES)?;
        let mut body = self
            .call(&req, Duration::ZERO)?
            .check(self, Duration::ZERO)?;
        let value = body.read(|r| read_bytes(r, MAX_VALUE_BYTES))?;
        body.finish(self);
        Ok(value)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let mut req = vec![OP_DELETE];
        put_bytes(&mut req, key.as_bytes(), MAX_KEY_BYTES)?;
        let mut body = self
            .call(&req, Duration::ZERO)?
            .check(self, Duration::ZERO)?;
        let existed = body.read(read_u8)? != 0;
        body.finish(self);
        Ok(existed)
    }

    fn num_keys(&self) -> Result<usize> {
        let req = vec![OP_NUM_KEYS];
        let mut body = self
            .call(&req, Duration::ZERO)?
            .check(self, Duration::ZERO)?;
        let n = body.read(read_u64)?;
        body.finish(self);
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(5);

    /// A raw socket that has completed the client side of the handshake with `secret`.
    fn raw_handshake(addr: SocketAddr, secret: Option<&JobSecret>) -> TcpStream {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        let nc = [3u8; NONCE_BYTES];
        s.write_all(&hello_bytes(&nc)).unwrap();
        let mut greeting = [0u8; 8 + NONCE_BYTES + PROOF_BYTES];
        s.read_exact(&mut greeting).unwrap();
        let mut ns = [0u8; NONCE_BYTES];
        ns.copy_from_slice(&greeting[8..8 + NONCE_BYTES]);
        s.write_all(&store_proof(secret, CLIENT_LABEL, &nc, &ns))
            .unwrap();
        let mut ok = [0u8; 1];
        s.read_exact(&mut ok).unwrap();
        assert_eq!(ok[0], AUTH_OK);
        s
    }

    fn secret(text: &str) -> JobSecret {
        JobSecret::from_bytes(text.as_bytes().to_vec()).unwrap()
    }

    #[test]
    fn clients_without_the_secret_are_refused_and_the_job_carries_on() {
        let server =
            TcpStoreServer::bind_with_secret("127.0.0.1:0", Some(secret("right"))).unwrap();
        assert!(server.is_authenticated());
        let good =
            TcpStore::connect_with_secret(server.local_addr(), T, Some(secret("right"))).unwrap();
        good.set("k", b"v").unwrap();
        for wrong in [Some(secret("wrong")), None] {
            let refused = TcpStore::connect_with_secret(server.local_addr(), T, wrong);
            assert!(
                matches!(
                    refused,
                    Err(Error::Protocol {
                        violation: ProtocolViolation::AuthenticationFailed,
                        ..
                    })
                ),
                "{refused:?}"
            );
        }
        // A raw client that answers the challenge with a made-up proof is told AUTH_REFUSED
        // and disconnected, and nothing it sends afterwards reaches the store.
        let mut raw = TcpStream::connect(server.local_addr()).unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        raw.write_all(&hello_bytes(&[1u8; NONCE_BYTES])).unwrap();
        let mut greeting = [0u8; 8 + NONCE_BYTES + PROOF_BYTES];
        raw.read_exact(&mut greeting).unwrap();
        raw.write_all(&[0u8; PROOF_BYTES]).unwrap();
        let mut answer = [0u8; 1];
        raw.read_exact(&mut answer).unwrap();
        assert_eq!(answer[0], AUTH_REFUSED);
        let mut req = vec![OP_SET];
        put_bytes(&mut req, b"intruder", MAX_KEY_BYTES).unwrap();
        put_bytes(&mut req, b"x", MAX_VALUE_BYTES).unwrap();
        let _ = raw.write_all(&req);
        let mut buf = [0u8; 8];
        assert!(matches!(raw.read(&mut buf), Ok(0) | Err(_)));
        // The authenticated client still works and the store holds only its key.
        assert_eq!(good.get("k", T).unwrap(), b"v");
        assert_eq!(server.store().num_keys().unwrap(), 1);
    }

    #[test]
    fn a_client_with_a_secret_refuses_a_server_without_one() {
        let server = TcpStoreServer::bind_with_secret("127.0.0.1:0", None).unwrap();
        assert!(!server.is_authenticated());
        let result = TcpStore::connect_with_secret(server.local_addr(), T, Some(secret("s")));
        assert!(matches!(
            result,
            Err(Error::Protocol {
                violation: ProtocolViolation::AuthenticationFailed,
                ..
            })
        ));
    }

    #[test]
    fn hello_prefixes_never_panic_and_name_what_is_wrong() {
        let mut good = [0u8; 8];
        good.copy_from_slice(&hello_bytes(&[0u8; NONCE_BYTES])[..8]);
        assert_eq!(check_hello_prefix(&good), Ok(()));
        let mut bad_magic = good;
        bad_magic[0] ^= 0xff;
        assert!(matches!(
            check_hello_prefix(&bad_magic),
            Err(ProtocolViolation::BadMagic { .. })
        ));
        let mut old = good;
        old[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(
            check_hello_prefix(&old),
            Err(ProtocolViolation::VersionMismatch {
                ours: STORE_PROTOCOL_VERSION,
                theirs: 1
            })
        );
    }

    fn server_and_client() -> (TcpStoreServer, TcpStore) {
        let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
        let client = TcpStore::connect(server.local_addr(), T).unwrap();
        (server, client)
    }

    #[test]
    fn every_op_round_trips() {
        let (_server, store) = server_and_client();
        store.set("a", b"hello").unwrap();
        assert_eq!(store.get("a", T).unwrap(), b"hello");
        store.set("empty", b"").unwrap();
        assert_eq!(store.get("empty", T).unwrap(), b"");
        assert!(store.check(&["a", "empty"]).unwrap());
        assert!(!store.check(&["a", "missing"]).unwrap());
        store.wait(&["a", "empty"], T).unwrap();
        assert_eq!(store.add("n", 5).unwrap(), 5);
        assert_eq!(store.add("n", -7).unwrap(), -2);
        assert_eq!(store.get("n", T).unwrap(), b"-2");
        assert!(matches!(
            store.add("a", 1),
            Err(Error::StoreNotACounter { key }) if key == "a"
        ));
        // compare_set: a missing key with empty expected is set; a wrong expected is not.
        assert_eq!(store.compare_set("c", b"", b"one").unwrap(), b"one");
        assert_eq!(store.compare_set("c", b"zzz", b"two").unwrap(), b"one");
        assert_eq!(store.compare_set("c", b"one", b"two").unwrap(), b"two");
        assert_eq!(store.num_keys().unwrap(), 4);
        assert!(store.delete("c").unwrap());
        assert!(!store.delete("c").unwrap());
        assert_eq!(store.num_keys().unwrap(), 3);
        let big = vec![0xabu8; 1 << 20];
        store.set("big", &big).unwrap();
        assert_eq!(store.get("big", T).unwrap(), big);
    }

    #[test]
    fn wait_and_get_time_out_with_the_missing_keys() {
        let (_server, store) = server_and_client();
        store.set("here", b"x").unwrap();
        let short = Duration::from_millis(120);
        let started = Instant::now();
        match store.wait(&["here", "absent"], short) {
            Err(Error::StoreTimeout { keys, after }) => {
                assert_eq!(keys, vec!["absent".to_string()]);
                assert_eq!(after, short);
            }
            other => panic!("expected StoreTimeout, got {other:?}"),
        }
        assert!(started.elapsed() >= short);
        assert!(started.elapsed() < Duration::from_secs(3));
        assert!(matches!(
            store.get("absent", short),
            Err(Error::StoreTimeout { .. })
        ));
        // The connection stays usable after a timeout.
        assert_eq!(store.get("here", T).unwrap(), b"x");
    }

    #[test]
    fn get_waits_for_a_writer_on_the_same_client() {
        let (_server, store) = server_and_client();
        let store = Arc::new(store);
        let writer = {
            let store = store.clone();
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(50));
                store.set("late", b"v").unwrap();
            })
        };
        assert_eq!(store.get("late", T).unwrap(), b"v");
        writer.join().unwrap();
    }

    #[test]
    fn concurrent_clients_count_exactly() {
        let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr();
        let threads: Vec<_> = (0..4)
            .map(|t| {
                thread::spawn(move || {
                    let store = TcpStore::connect(addr, T).unwrap();
                    for _ in 0..50 {
                        store.add("counter", t + 1).unwrap();
                    }
                    store.set(&format!("done/{t}"), b"1").unwrap();
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let store = TcpStore::connect(addr, T).unwrap();
        store
            .wait(&["done/0", "done/1", "done/2", "done/3"], T)
            .unwrap();
        // Thread t adds (t + 1) fifty times: 50 * (1 + 2 + 3 + 4).
        assert_eq!(store.add("counter", 0).unwrap(), 500);
        assert_eq!(server.store().num_keys().unwrap(), 5);
    }

    #[test]
    fn garbage_client_is_dropped_and_others_carry_on() {
        let (server, store) = server_and_client();
        store.set("k", b"v").unwrap();

        // A client with the wrong magic is disconnected.
        let mut bad = TcpStream::connect(server.local_addr()).unwrap();
        bad.set_read_timeout(Some(T)).unwrap();
        bad.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut buf = [0u8; 16];
        assert!(matches!(bad.read(&mut buf), Ok(0) | Err(_)));

        // A client with a good handshake that then claims a huge value is disconnected
        // without the server allocating it.
        let mut liar = raw_handshake(server.local_addr(), None);
        let mut req = vec![OP_SET];
        put_bytes(&mut req, b"x", MAX_KEY_BYTES).unwrap();
        put_u32(&mut req, u32::MAX);
        liar.write_all(&req).unwrap();
        assert!(matches!(liar.read(&mut buf), Ok(0) | Err(_)));

        // An unknown opcode is disconnected too.
        let mut odd = raw_handshake(server.local_addr(), None);
        odd.write_all(&[0xee, 1, 2, 3]).unwrap();
        assert!(matches!(odd.read(&mut buf), Ok(0) | Err(_)));

        assert_eq!(store.get("k", T).unwrap(), b"v");
        assert_eq!(server.store().num_keys().unwrap(), 1);
    }

    #[test]
    fn wrong_version_is_a_protocol_error_for_the_client() {
        // A fake server that answers with version 99.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut hello = [0u8; 8 + NONCE_BYTES];
            s.read_exact(&mut hello).unwrap();
            let mut reply = STORE_MAGIC.to_le_bytes().to_vec();
            reply.extend_from_slice(&99u32.to_le_bytes());
            s.write_all(&reply).unwrap();
        });
        let result = TcpStore::connect(addr, T);
        assert!(matches!(
            result,
            Err(Error::Protocol {
                violation: ProtocolViolation::VersionMismatch {
                    ours: STORE_PROTOCOL_VERSION,
                    theirs: 99
                },
                ..
            })
        ));
        fake.join().unwrap();
    }

    #[test]
    fn oversized_key_is_refused_before_sending() {
        let (_server, store) = server_and_client();
        let key = "k".repeat(MAX_KEY_BYTES + 1);
        assert!(matches!(
            store.set(&key, b"v"),
            Err(Error::Protocol {
                violation: ProtocolViolation::FrameTooLarge { .. },
                ..
            })
        ));
        assert_eq!(store.num_keys().unwrap(), 0);
    }

    #[test]
    fn dropping_the_server_closes_clients_promptly() {
        let (server, store) = server_and_client();
        store.set("k", b"v").unwrap();
        let started = Instant::now();
        drop(server);
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(store.get("k", Duration::from_millis(100)).is_err());
    }
}
