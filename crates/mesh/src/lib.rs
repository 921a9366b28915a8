//! Device-mesh topology, placements and shard math for hypershard.
//!
//! This crate is pure: it does no I/O and keeps no global or thread-local registry.
#![deny(missing_docs)]
