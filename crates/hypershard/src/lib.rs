//! hypershard: fully sharded and hybrid sharded data-parallel training for Rust.
//!
//! This is the facade crate. It re-exports the layers below it ([`mesh`], [`collectives`],
//! [`tensor`], [`dtensor`], [`nn`], [`fsdp`]) so that a user who wants full FSDP depends on
//! this crate alone; a user who wants only distributed tensors depends on `hypershard-dtensor`.
//! It also holds what the `hypershard` command line is made of: [`launch`] (a
//! torchrun-compatible launcher), [`data`] (corpora, tokenizers, batch order), [`checkpoint`]
//! (distributed, resharding, crash-safe checkpoints), [`train`] (GPT under `fully_shard`) and
//! [`sample`] (text generation).

pub mod allocator;
pub mod checkpoint;
pub mod data;
mod error;
pub mod launch;
pub mod sample;
pub mod train;

pub use error::{Error, ExitKind, FileAction, Result};

pub use hypershard_collectives as collectives;
pub use hypershard_dtensor as dtensor;
pub use hypershard_fsdp as fsdp;
pub use hypershard_mesh as mesh;
pub use hypershard_nn as nn;
pub use hypershard_tensor as tensor;
