//! [`TcpStoreServer`]: a [`MemoryStore`] served on a socket, one thread per connection.

use super::wire::*;
use super::*;

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
pub(super) struct Shared {
    store: Arc<MemoryStore>,
    stop: Arc<AtomicBool>,
    secret: Option<JobSecret>,
    /// Connections accepted that have not finished their handshake.
    pending: AtomicUsize,
}

/// Counts a connection as pending until its handshake ends, however it ends.
pub(super) struct PendingGuard<'a>(Option<&'a AtomicUsize>);

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
pub(super) struct RefusalLog {
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

pub(super) fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
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
pub(super) fn wait_readable(listener: &TcpListener, timeout: Duration) {
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
pub(super) struct StopAwareReader<'a> {
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

pub(super) fn serve_connection(stream: TcpStream, shared: &Shared) {
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

pub(super) fn serve_requests(
    stream: &TcpStream,
    shared: &Shared,
) -> std::result::Result<(), ReadFailure> {
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
pub(super) fn wait_sliced(
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
pub(super) fn handle_request(
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
