//! `metadata.json`: what a checkpoint holds and where each saved block lives.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::block::Block;

/// The format tag of `metadata.json`.
pub const FORMAT: &str = "hypershard-checkpoint";
/// The version this build writes and reads.
pub const VERSION: u32 = 1;
/// The metadata file in a checkpoint directory.
pub const METADATA_FILE: &str = "metadata.json";

/// One saved block of a tensor: which rank file holds it, under which key, and where it sits
/// in the global tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedBlock {
    /// The rank that saved it.
    pub rank: usize,
    /// The safetensors file (relative to the checkpoint directory).
    pub file: String,
    /// The tensor key inside that file.
    pub key: String,
    /// Where the block sits in the global tensor.
    #[serde(flatten)]
    pub block: Block,
    /// The CRC32C (Castagnoli) of the block's bytes as stored, which loading verifies.
    /// Absent in checkpoints written before checksums existed (those load unverified).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<u32>,
}

/// A global tensor: dtype, shape, how it was laid out, and its saved blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// The dtype (torch name: `float32`, `bfloat16`, ...).
    pub dtype: String,
    /// The global shape.
    pub shape: Vec<usize>,
    /// How the saver had it laid out (for example `Shard(0) over 2 ranks`), for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<String>,
    /// The saved blocks: disjoint, covering the tensor exactly once.
    pub blocks: Vec<SavedBlock>,
}

/// The contents of `metadata.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMetadata {
    /// Always [`FORMAT`].
    pub format: String,
    /// The format version, [`VERSION`].
    pub version: u32,
    /// The training step the checkpoint was taken after.
    pub step: u64,
    /// Ranks that saved it.
    pub world_size: usize,
    /// The model configuration (compared on load: another model is a typed error).
    pub model_config: Value,
    /// Everything else a resume needs: RNG state, data position, optimizer scalars, flags.
    pub state: Value,
    /// Every tensor (model parameters and optimizer state), by name.
    pub tensors: BTreeMap<String, TensorEntry>,
}
