//! [`TcpStore`]: the client every rank uses, with a small pool of connections.

use super::wire::*;
use super::*;

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
pub(super) struct ReplyBody {
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
