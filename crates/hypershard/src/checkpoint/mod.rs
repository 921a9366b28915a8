//! Distributed checkpoints: a directory of per-rank safetensors shards plus `metadata.json`.
//!
//! ```text
//! OUT/checkpoints/
//!   latest                      "step-00000020": the newest complete checkpoint
//!   step-00000020/
//!     metadata.json             per tensor: global shape, dtype, placement, and for each saved
//!                               block its rank file, key, offset and shape; plus step, model
//!                               config, and the resume state (RNG, data position, ...)
//!     rank-00000.safetensors    the blocks rank 0 saved
//!     rank-00000.index.json     rank 0's list of blocks (merged into metadata.json)
//!   .staging-step-00000030/     a save in progress (ignored by readers)
//! ```
//!
//! The format is generic over "named blocks of global tensors": whatever the sharding (FSDP
//! dim-0 shards, a 2×2 HSDP mesh where one replica saves, or one rank holding everything),
//! each rank adds the blocks it owns with their global offsets, and loading a block reads it
//! from whichever saved blocks overlap it. So a checkpoint saved at 4 ranks loads at 2 or 1.
//!
//! Crash safety: shards and metadata are written into a staging directory and fsynced; the
//! staging directory is renamed into place and `latest` is replaced by an atomic rename. A
//! crash or kill at any point leaves the previous checkpoint and pointer intact.

mod block;
mod export;
mod metadata;
mod reader;
mod safetensors_file;
mod writer;

pub use block::{Block, check_exact_cover, copy_overlap};
pub use export::{ExportAs, ExportSummary, export_consolidated, export_tensors};
pub use metadata::{CheckpointMetadata, FORMAT, METADATA_FILE, SavedBlock, TensorEntry, VERSION};
pub use reader::{Checkpoint, resolve};
pub use safetensors_file::{SafetensorsIndex, StoredTensor, TensorHeader, write_streaming};
pub use writer::{
    BlockSpec, CheckpointDir, CommitInfo, LATEST_FILE, ShardWriter, fsync_dir, write_atomically,
};

#[cfg(test)]
mod tests;
