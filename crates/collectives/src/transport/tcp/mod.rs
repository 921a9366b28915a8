//! The TCP transport: the full-mesh rendezvous ([`Mesh`](mesh::Mesh), through the
//! [`Store`](crate::Store)) with its versioned, authenticated handshake, the frame format
//! (`frame`), framed messages over the mesh with a reader thread per peer that files
//! validated frames into mailboxes ([`Transport`](transport::Transport)), and receives posted
//! ahead of their frames (`posted`). [`TcpConfig`](config::TcpConfig) holds the options of the
//! whole TCP stack: each layer above reads its own knobs from it.

pub(crate) mod config;
pub(crate) mod frame;
pub(crate) mod handshake;
pub(crate) mod mesh;
pub(crate) mod posted;
pub(crate) mod transport;
