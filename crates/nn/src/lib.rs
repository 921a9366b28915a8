//! The training substrate of hypershard.
//!
//! This crate will hold the `Module` trait with explicit `forward` and `backward`, the
//! transformer layers, losses and optimizers that `fully_shard` wraps. It is empty until the nn
//! issue lands: nothing here pretends to work yet.
