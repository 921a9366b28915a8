//! Distributed tensors for hypershard.
//!
//! This crate will hold `ProcessMesh` (a device mesh bound to one communicator per mesh
//! dimension), `DTensor` with Shard/Replicate/Partial layouts, and `redistribute` with a pure
//! planner apart from its executor. It is empty until the dtensor issue lands: nothing here
//! pretends to work yet.
