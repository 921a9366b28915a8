//! FSDP on a CUDA device (feature `cuda`): the reference MLP (a `Sequential` of Linear and
//! ReLU layers, nn's device layers) fully sharded over any [`Communicator`].
//!
//! * Parameter groups of `layers_per_group` consecutive Linear layers. Each rank keeps only
//!   its block of each group's flat buffer on the device: its dim-0 shard of every weight
//!   and bias, padded and aligned exactly as the CPU FSDP packs a unit's fused all-gather
//!   (the same `ShardLayout` and bucket planner).
//! * Unshard: copy-in (the shard, cast to `param_dtype` for mixed precision) → one
//!   all-gather per group into a flat device buffer → one copy-out launch of every rank's
//!   range of every parameter. Reshard frees the gathered parameters.
//! * Backward: the gradients (accumulated in the parameters' dtype, f32 under mixed
//!   precision) are copied into a zero-padded flat buffer, reduce-scattered with `Avg`, and
//!   the shard's gradient is kept on the device; SGD updates the shard. Without gradient sync
//!   the unsharded gradients accumulate and nothing is reduced.
//! * Prefetch: the next group's all-gather is issued before the current group computes, so
//!   NCCL's stream overlaps the compute stream.
//! * Collectives on device buffers when the communicator takes them (NCCL), else through
//!   host copies ([`Staging`]): this is how several ranks run as threads on one GPU with the
//!   local or tcp backend.
//!
//! [`Communicator`]: hypershard_collectives::Communicator
//!
//! Never run on a GPU yet (no device was lent to the session that wrote it); see
//! `docs/fsdp-device.md` for what is checked where.

mod error;
mod model;
mod plan;

pub use error::{DeviceFsdpError, DeviceFsdpResult};
pub use model::{DeviceFsdpConfig, DeviceFsdpMlp, GroupInfo};
pub use plan::Staging;
