//! The TCP backend's foundations: [`TcpConfig`] and the full-mesh rendezvous
//! ([`Mesh::establish`]) with its versioned, token-checked handshake, and
//! [`rendezvous_from_env`] for launched jobs.
//!
//! Each rank binds a listener, publishes its address in the [`Store`](crate::Store) under
//! `tcp/addr/{rank}`, connects to every lower rank and accepts a connection from every higher
//! rank. [`Transport`] runs framed messages over the mesh: a reader thread per peer files
//! validated frames into a mailbox keyed by [`MailboxKey`], sends are eager. The collectives
//! on top of it (driven by the [`ProgressEngine`](crate::ProgressEngine)) are not built yet.

mod config;
mod frame;
mod handshake;
mod launch;
mod mesh;
mod transport;

pub use config::TcpConfig;
pub use frame::{FRAME_HEADER_BYTES, FRAME_MAGIC, FrameHeader, FrameKind};
pub use handshake::{MESH_MAGIC, MESH_PROTOCOL_VERSION};
pub use launch::{Rendezvous, rendezvous_from_env};
pub use mesh::Mesh;
pub use transport::{Frame, MailboxKey, Transport, WaitBudget};
