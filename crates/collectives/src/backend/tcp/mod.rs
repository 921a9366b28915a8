//! The TCP backend's foundations: [`TcpConfig`] and the full-mesh rendezvous
//! (`Mesh::establish`) with its versioned, token-checked handshake, and
//! `rendezvous_from_env` for launched jobs.
//!
//! Each rank binds a listener, publishes its address in the [`Store`](crate::Store) under
//! `tcp/addr/{rank}`, connects to every lower rank and accepts a connection from every higher
//! rank. `Transport` runs framed messages over the mesh: a reader thread per peer files
//! validated frames into a mailbox keyed by `MailboxKey`, sends are eager.
//! [`TcpCommunicator`] implements every op of the [`Communicator`](crate::Communicator) on it,
//! driven by the [`ProgressEngine`](crate::ProgressEngine): a phase-0 descriptor exchange
//! (so argument errors and cross-rank disagreements fail the op on every rank), then ring
//! reduce-scatter / all-gather / all-reduce (recursive doubling for small all-reduces, see
//! [`AllReduceAlgorithm`]), a chain broadcast, a dissemination barrier,
//! pairwise all-to-all, direct gather / scatter / reduce and tagged send / recv, all cut into
//! frames of at most [`TcpConfig::segment_bytes`]. Split groups reuse the world's sockets.

mod communicator;
mod launch;
mod split;
mod world;

pub use crate::transport::tcp::config::{
    AllReduceAlgorithm, BroadcastAlgorithm, CRC32C_VAR, TcpConfig,
};
pub use communicator::{BACKEND, TcpCommunicator};
pub use launch::{AGENT_STORE_VAR, JobStore, store_from_env};
pub use world::{TcpWorld, init_from_env};
