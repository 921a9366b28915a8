//! [`Mesh`]: one handshaken TCP connection to every other rank.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use super::config::TcpConfig;
use super::handshake::{
    ACCEPTED, ACCEPTOR_LABEL, CHALLENGE, CONNECTOR_LABEL, Expectation, FLAG_FRAME_CHECKSUM, Hello,
    HelloFailure, REFUSED_AUTH, REFUSED_CHECKSUM, REFUSED_RANK, REFUSED_TOKEN, REFUSED_VERSION,
    Transcript, accept_hello,
};
use crate::auth::{self, JobSecret, NONCE_BYTES, PROOF_BYTES};
use crate::error::{Error, IoAction, ProtocolViolation, Result};
use crate::rendezvous::Store;

/// How long one accepted connection may take to send its hello before it is dropped.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// A full mesh: `peer(p)` is the connection to rank `p` (none for this rank itself). Every
/// stream has `TCP_NODELAY` set and no read timeout. Every connection agreed on the frame
/// checksum setting ([`Mesh::frame_checksum`]) in its handshake.
#[derive(Debug)]
pub struct Mesh {
    rank: usize,
    peers: Vec<Option<TcpStream>>,
    frame_checksum: bool,
}

/// The store key under which `rank` publishes its listener's address.
fn address_key(rank: usize) -> String {
    format!("tcp/addr/{rank}")
}

fn io_error(action: IoAction, peer: Option<usize>) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io {
        action,
        peer,
        source,
    }
}

impl Mesh {
    /// Joins the mesh of `world_size` ranks as `rank`: binds a listener, publishes its address
    /// in `store`, connects to every lower rank and accepts every higher one. Collective:
    /// every rank must call it with the same store, world size and job token. Every
    /// connection is authenticated with the job secret of this process's environment
    /// ([`JobSecret::from_env`]: `HYPERSHARD_JOB_SECRET` or `HYPERSHARD_JOB_SECRET_FILE`;
    /// none set: no authentication), and the frame checksum setting is
    /// [`TcpConfig::frame_checksum_from_env`] (`HYPERSHARD_CRC32C` over the config's).
    pub fn establish(
        store: &dyn Store,
        rank: usize,
        world_size: usize,
        config: &TcpConfig,
    ) -> Result<Mesh> {
        let secret = JobSecret::from_env()?;
        let config = config
            .clone()
            .with_frame_checksum(config.frame_checksum_from_env()?);
        Mesh::establish_with_secret(store, rank, world_size, &config, secret.as_ref())
    }

    /// [`Mesh::establish`] with the job secret given (`None`: no authentication) and the
    /// config taken as it is (no environment override). Both ends of every connection prove
    /// they hold the secret (HMAC-SHA256 challenge-response); a connection that cannot is
    /// refused, logged with its remote address, and does not count. Both ends must have the
    /// same [`TcpConfig::frame_checksum`]: a member of the job that differs fails the
    /// rendezvous of both with [`ProtocolViolation::ChecksumSettingMismatch`].
    pub fn establish_with_secret(
        store: &dyn Store,
        rank: usize,
        world_size: usize,
        config: &TcpConfig,
        secret: Option<&JobSecret>,
    ) -> Result<Mesh> {
        if world_size == 0 {
            return Err(Error::InvalidWorldSize { size: world_size });
        }
        if rank >= world_size {
            // Joining a mesh creates a communicator, which is what `Split` names.
            return Err(Error::InvalidRank {
                op: crate::OpKind::Split,
                rank,
                size: world_size,
            });
        }
        let deadline = Instant::now() + config.rendezvous_timeout;
        let listener = TcpListener::bind(SocketAddr::new(config.bind_ip, 0))
            .map_err(io_error(IoAction::Bind, None))?;
        let addr = listener
            .local_addr()
            .map_err(io_error(IoAction::Bind, None))?;
        store.set(&address_key(rank), addr.to_string().as_bytes())?;

        let mut peers: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
        for (peer, slot) in peers.iter_mut().enumerate().take(rank) {
            let target = Target {
                peer,
                rank,
                world_size,
                deadline,
            };
            *slot = Some(connect_to(store, &target, config, secret)?);
        }
        accept_higher(&listener, &mut peers, rank, config, secret, deadline)?;
        for stream in peers.iter().flatten() {
            stream
                .set_nodelay(true)
                .map_err(io_error(IoAction::SocketOption, None))?;
        }
        Ok(Mesh {
            rank,
            peers,
            frame_checksum: config.frame_checksum,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.peers.len()
    }

    /// The connection to `peer`; `None` for this rank itself or an out-of-range rank.
    pub fn peer(&self, peer: usize) -> Option<&TcpStream> {
        self.peers.get(peer).and_then(Option::as_ref)
    }

    /// Whether every frame on this mesh carries CRC32C checksums (agreed with every peer).
    pub fn frame_checksum(&self) -> bool {
        self.frame_checksum
    }

    /// The connections, by peer rank (`None` at this rank's own slot).
    pub(crate) fn into_peers(self) -> Vec<Option<TcpStream>> {
        self.peers
    }
}

/// Which lower rank a connecting rank dials, and by when.
struct Target {
    peer: usize,
    rank: usize,
    world_size: usize,
    deadline: Instant,
}

/// Connects to lower rank `target.peer` and performs the handshake.
fn connect_to(
    store: &dyn Store,
    target: &Target,
    config: &TcpConfig,
    secret: Option<&JobSecret>,
) -> Result<TcpStream> {
    let Target {
        peer,
        rank,
        world_size,
        deadline,
    } = *target;
    let left = deadline.saturating_duration_since(Instant::now());
    let published = store.get(&address_key(peer), left)?;
    let addr: SocketAddr = std::str::from_utf8(&published)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(Error::Protocol {
            peer: Some(peer),
            violation: ProtocolViolation::NotUtf8,
        })?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(10));
    let mut stream =
        TcpStream::connect_timeout(&addr, left).map_err(io_error(IoAction::Connect, Some(peer)))?;
    stream
        .set_read_timeout(Some(left))
        .map_err(io_error(IoAction::SocketOption, Some(peer)))?;
    let hello = Hello {
        job_token: config.job_token,
        rank: rank as u64,
        world_size: world_size as u64,
        frame_checksum: config.frame_checksum,
    };
    let hello_bytes = hello.encode();
    let connector_nonce = auth::fresh_nonce()?;
    let mut opening = [0u8; super::handshake::HELLO_BYTES + NONCE_BYTES];
    opening[..hello_bytes.len()].copy_from_slice(&hello_bytes);
    opening[hello_bytes.len()..].copy_from_slice(&connector_nonce);
    stream
        .write_all(&opening)
        .map_err(io_error(IoAction::Write, Some(peer)))?;
    let mut status = [0u8; 1];
    stream
        .read_exact(&mut status)
        .map_err(io_error(IoAction::Read, Some(peer)))?;
    if status[0] == CHALLENGE {
        let mut challenge = [0u8; NONCE_BYTES + PROOF_BYTES];
        stream
            .read_exact(&mut challenge)
            .map_err(io_error(IoAction::Read, Some(peer)))?;
        let mut acceptor_nonce = [0u8; NONCE_BYTES];
        acceptor_nonce.copy_from_slice(&challenge[..NONCE_BYTES]);
        let mut acceptor_proof = [0u8; PROOF_BYTES];
        acceptor_proof.copy_from_slice(&challenge[NONCE_BYTES..]);
        let transcript = Transcript {
            hello: &hello_bytes,
            connector_nonce: &connector_nonce,
            acceptor_nonce: &acceptor_nonce,
            acceptor_rank: peer as u64,
        };
        if !transcript.verify(secret, ACCEPTOR_LABEL, &acceptor_proof) {
            tracing::warn!(rank, peer, %addr, "tcp mesh: the peer did not prove it holds the job secret");
            return Err(Error::Protocol {
                peer: Some(peer),
                violation: ProtocolViolation::AuthenticationFailed,
            });
        }
        stream
            .write_all(&transcript.prove(secret, CONNECTOR_LABEL))
            .map_err(io_error(IoAction::Write, Some(peer)))?;
        stream
            .read_exact(&mut status)
            .map_err(io_error(IoAction::Read, Some(peer)))?;
    } else if status[0] == ACCEPTED {
        // An acceptor must challenge before it accepts; one that does not is not ours.
        return Err(Error::Protocol {
            peer: Some(peer),
            violation: ProtocolViolation::UnexpectedFrame {
                expected: CHALLENGE,
                got: ACCEPTED,
            },
        });
    }
    let violation = match status[0] {
        ACCEPTED => None,
        REFUSED_AUTH => Some(ProtocolViolation::AuthenticationFailed),
        REFUSED_TOKEN => Some(ProtocolViolation::TokenMismatch),
        REFUSED_VERSION => {
            // The refusing rank follows the code with the version it speaks.
            let mut theirs = [0u8; 4];
            stream
                .read_exact(&mut theirs)
                .map_err(io_error(IoAction::Read, Some(peer)))?;
            Some(ProtocolViolation::VersionMismatch {
                ours: super::handshake::MESH_PROTOCOL_VERSION,
                theirs: u32::from_le_bytes(theirs),
            })
        }
        REFUSED_RANK => Some(ProtocolViolation::BadRank { rank: rank as u64 }),
        REFUSED_CHECKSUM => {
            // The refusing rank follows the code with its flags.
            let mut theirs = [0u8; 8];
            stream
                .read_exact(&mut theirs)
                .map_err(io_error(IoAction::Read, Some(peer)))?;
            Some(ProtocolViolation::ChecksumSettingMismatch {
                rank: rank as u64,
                ours: config.frame_checksum,
                peer: peer as u64,
                theirs: u64::from_le_bytes(theirs) & FLAG_FRAME_CHECKSUM != 0,
            })
        }
        other => Some(ProtocolViolation::UnexpectedFrame {
            expected: ACCEPTED,
            got: other,
        }),
    };
    if let Some(violation) = violation {
        tracing::warn!(rank, peer, %violation, "tcp mesh: our connection was refused");
        return Err(Error::Protocol {
            peer: Some(peer),
            violation,
        });
    }
    let mut their_rank = [0u8; 8];
    stream
        .read_exact(&mut their_rank)
        .map_err(io_error(IoAction::Read, Some(peer)))?;
    let their_rank = u64::from_le_bytes(their_rank);
    if their_rank != peer as u64 {
        return Err(Error::Protocol {
            peer: Some(peer),
            violation: ProtocolViolation::BadRank { rank: their_rank },
        });
    }
    stream
        .set_read_timeout(None)
        .map_err(io_error(IoAction::SocketOption, Some(peer)))?;
    Ok(stream)
}

/// What a hello reader thread reports.
struct HelloOutcome {
    stream: TcpStream,
    from: SocketAddr,
    hello: std::result::Result<Hello, HelloFailure>,
}

/// Accepts one connection from every rank above `rank`. Each accepted connection's hello is
/// read on its own short-lived thread (bounded by [`HELLO_TIMEOUT`]), so a stray client that
/// connects and then sends nothing, or too little, cannot stall the rendezvous of the real
/// ranks. Connections with a bad hello are refused (with a warning) and do not count; the
/// rendezvous goes on until the deadline.
fn accept_higher(
    listener: &TcpListener,
    peers: &mut [Option<TcpStream>],
    rank: usize,
    config: &TcpConfig,
    secret: Option<&JobSecret>,
    deadline: Instant,
) -> Result<()> {
    let world_size = peers.len();
    listener
        .set_nonblocking(true)
        .map_err(io_error(IoAction::SocketOption, None))?;
    let (hellos, outcomes) = std::sync::mpsc::channel::<HelloOutcome>();
    while peers[rank + 1..].iter().any(Option::is_none) {
        if Instant::now() >= deadline {
            return Err(Error::RendezvousTimeout {
                rank,
                missing: (rank + 1..world_size)
                    .filter(|&p| peers[p].is_none())
                    .collect(),
                after: config.rendezvous_timeout,
            });
        }
        match listener.accept() {
            Ok((stream, from)) => {
                let setup = stream
                    .set_nonblocking(false)
                    .and_then(|()| stream.set_read_timeout(Some(HELLO_TIMEOUT)));
                if let Err(e) = setup {
                    tracing::warn!(rank, %from, error = %e, "tcp mesh: cannot configure an accepted socket");
                    continue;
                }
                let hellos = hellos.clone();
                let expect = Expectation {
                    job_token: config.job_token,
                    world_size: world_size as u64,
                    acceptor_rank: rank as u64,
                    secret: secret.cloned(),
                    frame_checksum: config.frame_checksum,
                };
                let spawned = thread::Builder::new()
                    .name(format!("hypershard-tcp-hello-{rank}"))
                    .spawn(move || {
                        let mut stream = stream;
                        let hello = accept_hello(&mut stream, &expect);
                        // The rendezvous may be over already; then nobody wants the outcome.
                        let _ = hellos.send(HelloOutcome {
                            stream,
                            from,
                            hello,
                        });
                    });
                if let Err(e) = spawned {
                    tracing::warn!(rank, %from, error = %e, "tcp mesh: cannot start a hello reader");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(Error::Io {
                    action: IoAction::Accept,
                    peer: None,
                    source: e,
                });
            }
        }
        match outcomes.recv_timeout(Duration::from_millis(5)) {
            Ok(outcome) => admit(outcome, peers, rank)?,
            Err(_) => continue,
        }
    }
    Ok(())
}

/// Files a connection whose hello was read into `peers`, or refuses it (with a warning).
fn admit(outcome: HelloOutcome, peers: &mut [Option<TcpStream>], rank: usize) -> Result<()> {
    let HelloOutcome {
        mut stream,
        from,
        hello,
    } = outcome;
    match hello {
        Ok(hello) => {
            // invariant: accept_hello checked hello.rank < world_size, which is a usize.
            let peer = hello.rank as usize;
            if peer <= rank || peers[peer].is_some() {
                tracing::warn!(rank, %from, claimed = peer, "tcp mesh: refusing a duplicate or lower rank");
                let _ = stream.write_all(&[REFUSED_RANK]);
                return Ok(());
            }
            let mut reply = [0u8; 9];
            reply[0] = ACCEPTED;
            reply[1..].copy_from_slice(&(rank as u64).to_le_bytes());
            stream
                .write_all(&reply)
                .map_err(io_error(IoAction::Write, Some(peer)))?;
            stream
                .set_read_timeout(None)
                .map_err(io_error(IoAction::SocketOption, Some(peer)))?;
            peers[peer] = Some(stream);
        }
        Err(HelloFailure::Violation(violation)) => {
            tracing::warn!(rank, %from, %violation, "tcp mesh: refused a connection");
        }
        Err(HelloFailure::Settings { peer, violation }) => {
            // An authenticated member of this job that cannot share the mesh with us: no
            // later connection can fix that, so the rendezvous fails now instead of at its
            // deadline.
            tracing::warn!(rank, %from, peer, %violation, "tcp mesh: a peer's settings differ");
            return Err(Error::Protocol {
                // invariant: accept_hello checked the rank against the world size.
                peer: Some(usize::try_from(peer).unwrap_or(usize::MAX)),
                violation,
            });
        }
        Err(HelloFailure::Io(e)) => {
            tracing::warn!(rank, %from, error = %e, "tcp mesh: a connection failed during its hello");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::MemoryStore;
    use crate::transport::tcp::handshake::HELLO_BYTES;
    use crate::transport::tcp::handshake::MESH_MAGIC;
    use std::sync::Arc;

    fn establish_world(world: usize, tokens: &[u64], timeout: Duration) -> Vec<Result<Mesh>> {
        let store = Arc::new(MemoryStore::new());
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let store = store.clone();
                let config = TcpConfig::default()
                    .with_job_token(tokens[rank])
                    .with_rendezvous_timeout(timeout);
                thread::spawn(move || Mesh::establish(&*store, rank, world, &config))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_pair_is_connected_to_the_right_rank() {
        for world in [1, 2, 4] {
            let meshes: Vec<Mesh> = establish_world(world, &[7; 4], Duration::from_secs(10))
                .into_iter()
                .map(Result::unwrap)
                .collect();
            // Rank r writes 10 * r + p to peer p; peer p must read 10 * r + p from rank r.
            for mesh in &meshes {
                for p in 0..world {
                    assert_eq!(mesh.peer(p).is_some(), p != mesh.rank());
                    if let Some(mut s) = mesh.peer(p) {
                        s.write_all(&[(10 * mesh.rank() + p) as u8]).unwrap();
                    }
                }
            }
            for mesh in &meshes {
                for r in 0..world {
                    if let Some(mut s) = mesh.peer(r) {
                        let mut b = [0u8; 1];
                        s.read_exact(&mut b).unwrap();
                        assert_eq!(b[0] as usize, 10 * r + mesh.rank());
                    }
                }
            }
        }
    }

    fn secret(text: &str) -> JobSecret {
        JobSecret::from_bytes(text.as_bytes().to_vec()).unwrap()
    }

    #[test]
    fn a_stranger_without_the_secret_is_refused_and_the_mesh_completes() {
        let store = Arc::new(MemoryStore::new());
        let config = TcpConfig::default().with_rendezvous_timeout(Duration::from_secs(10));
        let right = secret("the job's secret");
        let rank0 = {
            let (store, config, right) = (store.clone(), config.clone(), right.clone());
            thread::spawn(move || Mesh::establish_with_secret(&*store, 0, 2, &config, Some(&right)))
        };
        // The stranger speaks the protocol perfectly (right token, free rank) but holds
        // another secret: the acceptor's proof fails its check, and its own proof would fail
        // the acceptor's; either way it is refused and does not take rank 1's place.
        let stranger = {
            let store = store.clone();
            let config = config.clone();
            thread::spawn(move || {
                Mesh::establish_with_secret(&*store, 1, 2, &config, Some(&secret("a guess")))
            })
        };
        assert!(matches!(
            stranger.join().unwrap(),
            Err(Error::Protocol {
                peer: Some(0),
                violation: ProtocolViolation::AuthenticationFailed
            })
        ));
        // A raw client that takes the challenge and answers with a made-up proof is told
        // REFUSED_AUTH.
        let published = store.get(&address_key(0), Duration::from_secs(10)).unwrap();
        let addr: SocketAddr = std::str::from_utf8(&published).unwrap().parse().unwrap();
        let mut raw = TcpStream::connect(addr).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let hello = Hello {
            job_token: 0,
            rank: 1,
            world_size: 2,
            frame_checksum: false,
        };
        raw.write_all(&hello.encode()).unwrap();
        raw.write_all(&[0u8; NONCE_BYTES]).unwrap();
        let mut challenge = [0u8; 1 + NONCE_BYTES + PROOF_BYTES];
        raw.read_exact(&mut challenge).unwrap();
        assert_eq!(challenge[0], CHALLENGE);
        raw.write_all(&[0u8; PROOF_BYTES]).unwrap();
        let mut answer = [0u8; 1];
        raw.read_exact(&mut answer).unwrap();
        assert_eq!(answer[0], REFUSED_AUTH);
        // The real rank 1 still joins, and the mesh carries data both ways.
        let rank1 = Mesh::establish_with_secret(&*store, 1, 2, &config, Some(&right)).unwrap();
        let rank0 = rank0.join().unwrap().unwrap();
        rank1.peer(0).unwrap().write_all(&[41]).unwrap();
        let mut b = [0u8; 1];
        rank0.peer(1).unwrap().read_exact(&mut b).unwrap();
        assert_eq!(b[0], 41);
    }

    #[test]
    fn a_rank_without_a_secret_cannot_join_a_job_that_has_one() {
        let store = Arc::new(MemoryStore::new());
        let config = TcpConfig::default().with_rendezvous_timeout(Duration::from_millis(800));
        let rank0 = {
            let (store, config) = (store.clone(), config.clone());
            thread::spawn(move || {
                Mesh::establish_with_secret(&*store, 0, 2, &config, Some(&secret("s")))
            })
        };
        let rank1 = Mesh::establish_with_secret(&*store, 1, 2, &config, None);
        assert!(matches!(
            rank1,
            Err(Error::Protocol {
                violation: ProtocolViolation::AuthenticationFailed,
                ..
            })
        ));
        assert!(matches!(
            rank0.join().unwrap(),
            Err(Error::RendezvousTimeout { rank: 0, .. })
        ));
    }

    #[test]
    fn wrong_token_is_refused_and_the_acceptor_times_out() {
        let results = establish_world(2, &[1, 2], Duration::from_millis(500));
        assert!(matches!(
            results[1],
            Err(Error::Protocol {
                peer: Some(0),
                violation: ProtocolViolation::TokenMismatch
            })
        ));
        match &results[0] {
            Err(Error::RendezvousTimeout {
                rank: 0, missing, ..
            }) => {
                assert_eq!(missing, &vec![1]);
            }
            other => panic!("expected RendezvousTimeout, got {other:?}"),
        }
    }

    #[test]
    fn stray_garbage_connection_does_not_break_the_rendezvous() {
        let store = Arc::new(MemoryStore::new());
        let config = TcpConfig::default().with_rendezvous_timeout(Duration::from_secs(10));
        let rank0 = {
            let store = store.clone();
            let config = config.clone();
            thread::spawn(move || Mesh::establish(&*store, 0, 2, &config))
        };
        let published = store.get(&address_key(0), Duration::from_secs(10)).unwrap();
        let addr: SocketAddr = std::str::from_utf8(&published).unwrap().parse().unwrap();
        let mut stray = TcpStream::connect(addr).unwrap();
        stray.write_all(&[0xff; HELLO_BYTES]).unwrap();
        let rank1 = Mesh::establish(&*store, 1, 2, &config).unwrap();
        let rank0 = rank0.join().unwrap().unwrap();
        assert!(rank0.peer(1).is_some());
        assert!(rank1.peer(0).is_some());
    }

    #[test]
    fn a_silent_stray_connection_does_not_stall_the_rendezvous() {
        let store = Arc::new(MemoryStore::new());
        let config = TcpConfig::default().with_rendezvous_timeout(Duration::from_secs(10));
        let rank0 = {
            let store = store.clone();
            let config = config.clone();
            thread::spawn(move || Mesh::establish(&*store, 0, 2, &config))
        };
        let published = store.get(&address_key(0), Duration::from_secs(10)).unwrap();
        let addr: SocketAddr = std::str::from_utf8(&published).unwrap().parse().unwrap();
        // Three bytes of a hello, then silence: its reader waits for the rest until
        // HELLO_TIMEOUT, but the real rank 1 must get through long before that.
        let mut silent = TcpStream::connect(addr).unwrap();
        silent.write_all(&MESH_MAGIC.to_le_bytes()[..3]).unwrap();
        thread::sleep(Duration::from_millis(50));
        let started = Instant::now();
        let rank1 = Mesh::establish(&*store, 1, 2, &config).unwrap();
        let rank0 = rank0.join().unwrap().unwrap();
        assert!(
            started.elapsed() < HELLO_TIMEOUT / 2,
            "{:?}",
            started.elapsed()
        );
        assert!(rank0.peer(1).is_some() && rank1.peer(0).is_some());
        drop(silent);
    }

    #[test]
    fn wrong_version_is_refused_with_the_acceptors_version() {
        let store = Arc::new(MemoryStore::new());
        let config = TcpConfig::default().with_rendezvous_timeout(Duration::from_secs(10));
        let rank0 = {
            let store = store.clone();
            let config = config.clone();
            thread::spawn(move || Mesh::establish(&*store, 0, 2, &config))
        };
        let published = store.get(&address_key(0), Duration::from_secs(10)).unwrap();
        let addr: SocketAddr = std::str::from_utf8(&published).unwrap().parse().unwrap();
        let mut old = TcpStream::connect(addr).unwrap();
        let mut hello = Hello {
            job_token: 0,
            rank: 1,
            world_size: 2,
            frame_checksum: false,
        }
        .encode();
        hello[4..8].copy_from_slice(&99u32.to_le_bytes());
        old.write_all(&hello).unwrap();
        let mut refusal = [0u8; 5];
        old.read_exact(&mut refusal).unwrap();
        assert_eq!(refusal[0], REFUSED_VERSION);
        assert_eq!(
            u32::from_le_bytes([refusal[1], refusal[2], refusal[3], refusal[4]]),
            crate::transport::tcp::handshake::MESH_PROTOCOL_VERSION
        );
        // The refused connection does not count: a real rank 1 still completes the mesh.
        let rank1 = Mesh::establish(&*store, 1, 2, &config).unwrap();
        assert!(rank0.join().unwrap().unwrap().peer(1).is_some());
        assert!(rank1.peer(0).is_some());
    }
}
