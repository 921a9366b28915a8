//! [`establish`]: finds the co-located peers through the [`Store`] and sets up one ring per
//! ordered pair between them.
//!
//! 1. Every rank publishes `shm/host/{rank}` = `{policy}|{host id}` (the host id is the
//!    hostname, the kernel boot id and the mount namespace, so two containers on one machine
//!    with separate `/dev/shm` do not match). A rank whose policy is `tcp` publishes and
//!    stops there.
//! 2. For every peer with the same host id whose policy also wants shared memory, the rank
//!    creates the segment of its ring *to* that peer and publishes its path under
//!    `shm/seg/{from}/{to}` (`-` if it could not).
//! 3. It opens and maps every segment *from* such a peer, unlinks it at once (so nothing
//!    stays in `/dev/shm`), and publishes `shm/ack/{from}/{to}` = `ok` or `no`.
//! 4. It reads the acks of its own segments, unlinks them too (in case the peer failed
//!    before it could), and keeps shared memory for a pair exactly when both directions are
//!    `ok`, which both ranks of the pair read alike.
//!
//! Alongside, each rank publishes `shm/cma/{rank}` (its pid and the address of a probe
//! pattern, or `off`; see [`super::cma`]), reads the pattern out of each partner and
//! publishes `shm/cmaok/{reader}/{read}` = `ok` or `no`. A pair lends large payloads instead
//! of copying them through the ring exactly when both of its probes are `ok`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::channel::ShmPeer;
use super::cma::{self, CmaConfig, Remote};
use super::links::ShmLinks;
use super::policy::TransportPolicy;
use super::ring::{Consumer, Producer};
use super::segment::{self, Segment};
use crate::error::{Error, IoAction, Result};
use crate::rendezvous::Store;

/// A segment this rank created for its ring to one peer, and its name.
type Created = (Arc<Segment>, PathBuf);

/// What [`establish`] needs.
#[derive(Clone, Copy)]
pub struct ShmSetup<'a> {
    /// The job's store (the one the TCP rendezvous used).
    pub store: &'a dyn Store,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// This rank's policy (after the `HYPERSHARD_TRANSPORT` override).
    pub policy: TransportPolicy,
    /// The data capacity of each ring (rounded up to a multiple of 64, at least 256, and to
    /// one whole message of `max_payload` bytes).
    pub ring_bytes: usize,
    /// The most payload bytes one message may carry.
    pub max_payload: u64,
    /// How long the store lookups may take in all.
    pub timeout: Duration,
    /// Where segments are created (normally [`segment::SEGMENT_DIR`]).
    pub dir: &'a Path,
}

/// This machine's identity as co-located ranks see it: hostname, boot id, mount namespace.
pub fn host_id() -> String {
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let mount_ns = std::fs::read_link("/proc/self/ns/mnt")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!(
        "{}|{}|{}",
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id"),
        mount_ns
    )
}

fn host_key(rank: usize) -> String {
    format!("shm/host/{rank}")
}

fn segment_key(from: usize, to: usize) -> String {
    format!("shm/seg/{from}/{to}")
}

fn ack_key(from: usize, to: usize) -> String {
    format!("shm/ack/{from}/{to}")
}

fn cma_key(rank: usize) -> String {
    format!("shm/cma/{rank}")
}

/// Whether `reader` could read `read`'s memory.
fn cma_ack_key(reader: usize, read: usize) -> String {
    format!("shm/cmaok/{reader}/{read}")
}

const NO_SEGMENT: &[u8] = b"-";
const ACK_OK: &[u8] = b"ok";
const ACK_NO: &[u8] = b"no";

/// The shared-memory links of this rank, or `None` when no peer uses shared memory.
/// Collective over the world (every rank calls it with the same store), after the TCP mesh
/// is up. Under [`TransportPolicy::Shm`], a pair of co-located ranks whose segments cannot
/// be set up is an error; under [`TransportPolicy::Auto`] that pair falls back to TCP.
pub fn establish(setup: &ShmSetup<'_>) -> Result<Option<ShmLinks>> {
    let me = setup.rank;
    let mine = format!("{}|{}", setup.policy.name(), host_id());
    setup.store.set(&host_key(me), mine.as_bytes())?;
    if !setup.policy.wants_shm() || setup.world_size < 2 {
        return Ok(None);
    }
    let deadline = Instant::now() + setup.timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let mut partners = Vec::new();
    for peer in (0..setup.world_size).filter(|&p| p != me) {
        let theirs = setup.store.get(&host_key(peer), left())?;
        let theirs = String::from_utf8_lossy(&theirs);
        let (policy, host) = theirs.split_once('|').unwrap_or(("tcp", ""));
        let wants = TransportPolicy::parse(policy).is_some_and(TransportPolicy::wants_shm);
        if wants && mine.split_once('|').map(|(_, h)| h) == Some(host) {
            partners.push(peer);
        }
    }
    if partners.is_empty() {
        return Ok(None);
    }
    let cma_config = CmaConfig::from_env()?;
    setup
        .store
        .set(&cma_key(me), cma::advert(&cma_config).as_bytes())?;
    segment::sweep_stale(setup.dir);

    // Step 2: my outgoing segments.
    let mut outgoing: Vec<(usize, Option<Created>)> = Vec::new();
    let mut first_error = None;
    for &peer in &partners {
        let path = segment::segment_path(setup.dir, me, peer);
        let ring_bytes = super::channel::ring_bytes_for(setup.ring_bytes, setup.max_payload);
        match Segment::create(&path, ring_bytes) {
            Ok(created) => {
                setup.store.set(
                    &segment_key(me, peer),
                    path.display().to_string().as_bytes(),
                )?;
                outgoing.push((peer, Some((Arc::new(created), path))));
            }
            Err(source) => {
                tracing::warn!(rank = me, peer, error = %source, "shm: cannot create a segment");
                first_error.get_or_insert(Error::Io {
                    action: IoAction::SharedMemory,
                    peer: Some(peer),
                    source,
                });
                setup.store.set(&segment_key(me, peer), NO_SEGMENT)?;
                outgoing.push((peer, None));
            }
        }
    }
    // Unlink every segment of mine when this function returns, whatever happens: the peers
    // that opened them keep their mappings.
    let _unlink = UnlinkOnDrop(
        outgoing
            .iter()
            .filter_map(|(_, s)| s.as_ref().map(|(_, p)| p.clone()))
            .collect(),
    );

    // Step 3: the peers' segments to me, and whether I can read the peers' memory.
    let mut incoming: Vec<(usize, Option<Arc<Segment>>)> = Vec::new();
    let mut readable: Vec<Option<Remote>> = Vec::new();
    for &peer in &partners {
        let remote = if cma_config.enabled {
            let advert = setup.store.get(&cma_key(peer), left())?;
            cma::probe(&advert)
                .map_err(|why| tracing::debug!(rank = me, peer, why, "shm: no cma"))
                .ok()
        } else {
            None
        };
        let answer = if remote.is_some() { ACK_OK } else { ACK_NO };
        setup.store.set(&cma_ack_key(me, peer), answer)?;
        readable.push(remote);
        let named = setup.store.get(&segment_key(peer, me), left())?;
        let opened = open_peer_segment(setup.dir, &named);
        let ack = match &opened {
            Ok(_) => ACK_OK,
            Err(source) => {
                tracing::warn!(rank = me, peer, error = %source, "shm: cannot open the peer's segment");
                ACK_NO
            }
        };
        setup.store.set(&ack_key(peer, me), ack)?;
        match opened {
            Ok(segment) => incoming.push((peer, Some(Arc::new(segment)))),
            Err(source) => {
                first_error.get_or_insert(Error::Io {
                    action: IoAction::SharedMemory,
                    peer: Some(peer),
                    source,
                });
                incoming.push((peer, None));
            }
        }
    }

    // Step 4: both directions must be up.
    let mut peers: Vec<Option<ShmPeer>> = (0..setup.world_size).map(|_| None).collect();
    for (((peer, out), (_, inc)), remote) in outgoing.into_iter().zip(incoming).zip(readable) {
        let their_ack = setup.store.get(&ack_key(me, peer), left())?;
        let they_read_me = setup.store.get(&cma_ack_key(peer, me), left())? == ACK_OK;
        let (Some((tx, _)), Some(rx)) = (out, inc) else {
            continue;
        };
        if their_ack != ACK_OK {
            first_error.get_or_insert(Error::Io {
                action: IoAction::SharedMemory,
                peer: Some(peer),
                source: std::io::Error::other("the peer could not map this rank's segment"),
            });
            continue;
        }
        let channel = ShmPeer::new(
            peer,
            Producer::new(tx),
            Consumer::new(rx),
            setup.max_payload,
        );
        peers[peer] = Some(match remote {
            Some(remote) if they_read_me => channel.with_cma(remote, cma_config.min_bytes),
            _ => channel,
        });
    }
    let connected = peers.iter().flatten().count();
    if connected < partners.len()
        && setup.policy == TransportPolicy::Shm
        && let Some(error) = first_error
    {
        return Err(error);
    }
    tracing::debug!(rank = me, connected, "shm: links up");
    Ok((connected > 0).then(|| ShmLinks::new(peers)))
}

/// Opens the segment a peer named in the store, refusing names outside `dir`, and unlinks it.
fn open_peer_segment(dir: &Path, named: &[u8]) -> std::io::Result<Segment> {
    if named == NO_SEGMENT {
        return Err(std::io::Error::other(
            "the peer could not create its segment",
        ));
    }
    let path = PathBuf::from(String::from_utf8_lossy(named).into_owned());
    if !segment::is_segment_path(dir, &path) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the store names a file that is not a hypershard segment",
        ));
    }
    let opened = Segment::open(&path);
    // Mapped (or unusable): either way the name has served its purpose.
    let _ = std::fs::remove_file(&path);
    opened
}

/// Removes the listed files when dropped (already-removed ones are fine).
struct UnlinkOnDrop(Vec<PathBuf>);

impl Drop for UnlinkOnDrop {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}
