//! The rendezvous key-value [`Store`]: how ranks find each other before any communicator
//! exists (and how sub-groups agree on things later).
//!
//! Semantics follow `torch.distributed.Store`: values are bytes; [`Store::add`] keeps a decimal
//! `i64` counter in the value; [`Store::get`] and [`Store::wait`] block until the keys exist or
//! the deadline passes. Implementations: [`MemoryStore`] (threads of one process) and the TCP
//! store (processes; `tcp/`, feature `tcp`, hosted by rank 0 or the launcher): its wire format
//! and handshake (`tcp/wire.rs`), the server and the client.
//!
//! This folder sits right above the crate's root types: every transport and backend finds its
//! peers through a [`Store`], and nothing here knows about them. The public paths are
//! `collectives::store` and the crate root.

mod memory;
mod prefix;
#[cfg(feature = "tcp")]
pub(crate) mod tcp;

use std::time::Duration;

use crate::error::Result;

pub use memory::MemoryStore;
pub use prefix::PrefixStore;
#[cfg(feature = "tcp")]
pub use tcp::{TcpStore, TcpStoreServer};

/// A key-value store shared by the ranks of a job. Every method is safe to call from many
/// threads at once.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any previous value, and wakes waiters on `key`.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value of `key`, waiting up to `timeout` for it to be set
    /// ([`Error::StoreTimeout`](crate::Error::StoreTimeout) otherwise).
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;

    /// Waits up to `timeout` until every key in `keys` is set.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;

    /// Whether every key in `keys` is set, without waiting.
    fn check(&self, keys: &[&str]) -> Result<bool>;

    /// Adds `delta` to the decimal `i64` counter in `key` (a missing key counts as 0) and
    /// returns the new value. Sums wrap. A value that is not a decimal `i64` is
    /// [`Error::StoreNotACounter`](crate::Error::StoreNotACounter).
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Atomically: if `key` holds `expected` (or is missing and `expected` is empty), sets it
    /// to `desired`. Returns the value `key` holds afterwards, so the caller won when the
    /// result equals `desired`. (PyTorch's `compare_set`.)
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;

    /// Deletes `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool>;

    /// The number of keys in the store.
    fn num_keys(&self) -> Result<usize>;
}
