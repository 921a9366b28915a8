//! The rendezvous key-value [`Store`] and its implementations: [`MemoryStore`] (threads of
//! one process), [`PrefixStore`] (a namespace inside another store) and, with feature `tcp`,
//! the TCP store (`TcpStore`, `TcpStoreServer`) that processes share.

pub use crate::rendezvous::{MemoryStore, PrefixStore, Store};
#[cfg(feature = "tcp")]
pub use tcp::{TcpStore, TcpStoreServer};

/// The TCP store (feature `tcp`): [`TcpStoreServer`] hosts a [`MemoryStore`] on a socket (rank
/// 0 or the launcher runs it) and [`TcpStore`] is the client every rank uses. Every length a
/// peer announces is checked against the limits here before anything is allocated.
#[cfg(feature = "tcp")]
pub mod tcp {
    pub use crate::rendezvous::tcp::{
        MAX_KEY_BYTES, MAX_KEYS, MAX_PENDING_HANDSHAKES, MAX_VALUE_BYTES, TcpStore, TcpStoreServer,
    };
}
