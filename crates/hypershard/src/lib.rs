//! hypershard: fully sharded and hybrid sharded data-parallel training for Rust.
//!
//! This is the facade crate. It re-exports the layers below it so that a user who wants full
//! FSDP depends on this crate alone; a user who wants only distributed tensors depends on
//! `hypershard-dtensor`.
//!
//! The `hypershard` command line (`train`, `launch`) arrives with the main-job issue.

pub use hypershard_mesh as mesh;
pub use hypershard_tensor as tensor;
