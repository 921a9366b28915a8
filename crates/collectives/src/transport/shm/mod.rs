//! The shared-memory transport: bulk data between ranks on the same host moves through one
//! lock-free single-producer/single-consumer byte ring per ordered pair of ranks, instead of
//! through loopback TCP (NCCL's SHM transport is the model; gloo has none).
//!
//! * `policy`: [`TransportPolicy`] (`tcp` / `auto` / `shm`) and the `HYPERSHARD_TRANSPORT`
//!   override.
//! * `segment`: the shared mapping of one ring (a named file in `/dev/shm`, unlinked as soon
//!   as the peer has mapped it) and its control block of cache-line-padded atomics.
//! * `ring`: the producer and consumer ends (Release/Acquire positions, no locks).
//! * `futex` and `wait`: spin, then yield, then park on a process-shared futex in short
//!   slices that also watch the op's deadline, an abort and the peer's TCP connection.
//! * `channel`: `ShmPeer`, the messages (the TCP frame header, so the same (group, seq,
//!   tag, kind) key) streamed through the rings, with a per-key stash for messages whose
//!   receiver was not the one reading.
//! * `setup`: co-located peers found through the store's host ids, the segment handshake.
//! * `links`: `ShmLinks`, a rank's channels by world rank.
//! * `copy`: streaming (non-temporal) copies out of the ring into large posted blocks.
//! * `cma`: single-copy transfers of large payloads with cross-memory attach
//!   (`process_vm_readv`): the ring carries the payload's address, the receiver copies it
//!   straight out of the sender (`HYPERSHARD_SHM_CMA`, `HYPERSHARD_SHM_CMA_MIN_BYTES`).
//!
//! The TCP backend uses it per peer: `tcp::link` sends and receives the data frames of a pair
//! that has a channel through it, and everything else (phase-0 descriptors, remote peers)
//! through TCP. A peer's death shows through its TCP connection (the transport marks it
//! lost), which every park slice checks. See docs/shm.md.

mod channel;
pub(crate) mod cma;
pub(crate) mod copy;
mod futex;
mod links;
mod policy;
mod ring;
pub(crate) mod segment;
pub(crate) mod setup;
mod wait;

#[cfg(test)]
mod tests;

pub(crate) use channel::{Apply, ShmPeer, Sink};
pub use cma::{CMA_ENV, CMA_MIN_BYTES_ENV};
pub(crate) use links::ShmLinks;
pub use policy::{TRANSPORT_ENV, TransportPolicy};
pub(crate) use segment::SEGMENT_DIR;
pub(crate) use setup::{ShmSetup, establish};
pub(crate) use wait::Watch;

/// The default data capacity of each ring: 4 MiB (four 1 MiB TCP segments in flight per
/// direction; see docs/shm.md for the measurements behind it).
pub(crate) const DEFAULT_RING_BYTES: usize = 4 << 20;
