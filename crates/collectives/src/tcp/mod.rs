//! The TCP backend's foundations: [`TcpConfig`] and the full-mesh rendezvous
//! ([`Mesh::establish`]) with its versioned, token-checked handshake, and
//! [`rendezvous_from_env`] for launched jobs.
//!
//! Each rank binds a listener, publishes its address in the [`Store`](crate::Store) under
//! `tcp/addr/{rank}`, connects to every lower rank and accepts a connection from every higher
//! rank. [`Transport`] runs framed messages over the mesh: a reader thread per peer files
//! validated frames into a mailbox keyed by [`MailboxKey`], sends are eager.
//! [`TcpCommunicator`] implements every op of the [`Communicator`](crate::Communicator) on it,
//! driven by the [`ProgressEngine`](crate::ProgressEngine): a phase-0 descriptor exchange
//! (so argument errors and cross-rank disagreements fail the op on every rank), then ring
//! reduce-scatter / all-gather / all-reduce (recursive doubling for small all-reduces, see
//! [`AllReduceAlgorithm`]), a chain broadcast, a dissemination barrier,
//! pairwise all-to-all, direct gather / scatter / reduce and tagged send / recv, all cut into
//! frames of at most [`TcpConfig::segment_bytes`]. Split groups reuse the world's sockets.

mod alltoall;
mod barrier;
mod broadcast;
mod communicator;
mod config;
pub(crate) mod descriptor;
mod doubling;
mod frame;
mod halving;
pub(crate) mod handshake;
mod launch;
mod link;
mod mesh;
mod p2p;
mod posted;
mod ring;
mod rooted;
mod split;
mod transport;
mod tree;
mod world;

pub use communicator::{BACKEND, TcpCommunicator};
pub use config::{
    AllReduceAlgorithm, BroadcastAlgorithm, CRC32C_VAR, DEFAULT_HALVING_DOUBLING_BYTES,
    DEFAULT_SEGMENT_BYTES, DEFAULT_SMALL_ALL_REDUCE_BYTES, DEFAULT_TREE_BROADCAST_BYTES, TcpConfig,
};
pub(crate) use frame::payload_alloc_error;
pub use frame::{
    FRAME_CHECKSUM_BYTES, FRAME_HEADER_BYTES, FRAME_MAGIC, FrameHeader, FrameKind, decode_frame,
    encode_frame, header_checksum,
};
pub use handshake::{FLAG_FRAME_CHECKSUM, MESH_MAGIC, MESH_PROTOCOL_VERSION};
pub use launch::{AGENT_STORE_VAR, Rendezvous, agent_hosts_store, rendezvous_from_env};
pub use mesh::Mesh;
pub use transport::{Frame, MailboxKey, Transport, WaitBudget};
pub use world::{TcpWorld, init_from_env};
