//! `fully_shard`: FSDP and HSDP for hypershard.
//!
//! This crate will hold `fully_shard`, `FsdpParam`, `ParamGroup`, the fused all-gather and
//! reduce-scatter buckets and the mixed-precision, offload and fusion policies. It is empty until
//! the fsdp issue lands: nothing here pretends to work yet.
