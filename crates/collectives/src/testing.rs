//! Internals that this crate's integration tests drive directly (cargo feature `testing`):
//! the mesh with an explicit secret, the wire constants and header codec, and the
//! shared-memory transport's segment names and cross-memory counters. Not part of the
//! supported API.

pub use crate::transport::shm::cma::{CmaConfig, cross_memory_reads};
pub use crate::transport::shm::segment::{SEGMENT_DIR, SEGMENT_PREFIX};
pub use crate::transport::tcp::frame::{FRAME_HEADER_BYTES, FRAME_MAGIC, FrameHeader};
pub use crate::transport::tcp::handshake::{MESH_MAGIC, MESH_PROTOCOL_VERSION};
pub use crate::transport::tcp::mesh::Mesh;
