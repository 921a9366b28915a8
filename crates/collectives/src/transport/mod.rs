//! The transports that move bytes between processes: TCP frames over a full mesh of sockets
//! (`tcp`) and, between ranks on the same host, shared-memory rings (`shm`, a transport under
//! TCP: it files its messages under the same frame keys, and a peer's death shows through its
//! TCP connection). Nothing here knows which op or algorithm the bytes belong to.

#[cfg(feature = "tcp")]
pub mod shm;
#[cfg(feature = "tcp")]
pub(crate) mod tcp;
