//! Saving: every rank writes its blocks with a [`ShardWriter`] into a staging directory, then
//! one rank [`commit`](CheckpointDir::commit)s: merge the ranks' indexes into
//! `metadata.json`, fsync, and rename the staging directory into place, then atomically
//! repoint `latest`. A crash at any moment leaves the previous checkpoint and `latest` intact.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use hypershard_tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::block::{Block, check_exact_cover};
use super::metadata::{
    CheckpointMetadata, FORMAT, METADATA_FILE, SavedBlock, TensorEntry, VERSION,
};
use super::safetensors_file::{TensorHeader, write_streaming};
use crate::error::{Error, FileAction, Result};

/// The pointer file in a checkpoint root that names the newest complete checkpoint.
pub const LATEST_FILE: &str = "latest";

/// Flushes a directory's entries (new files, renames) to stable storage.
pub fn fsync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|dir| dir.sync_all())
        .map_err(|e| Error::io(FileAction::Sync, path, e))
}

/// Writes `bytes` to `path` crash-safely: a temporary sibling, fsync, rename, fsync the parent.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let parent = path.parent().unwrap_or(Path::new("."));
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    let temp = parent.join(name);
    let mut file = File::create(&temp).map_err(|e| Error::io(FileAction::Write, &temp, e))?;
    file.write_all(bytes)
        .map_err(|e| Error::io(FileAction::Write, &temp, e))?;
    file.sync_all()
        .map_err(|e| Error::io(FileAction::Sync, &temp, e))?;
    drop(file);
    std::fs::rename(&temp, path).map_err(|e| Error::io(FileAction::Rename, &temp, e))?;
    fsync_dir(parent)
}

/// One block a rank saved, as its index file lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct IndexedBlock {
    name: String,
    dtype: String,
    global_shape: Vec<usize>,
    placement: Option<String>,
    key: String,
    #[serde(flatten)]
    block: Block,
    /// The CRC32C of the block's bytes, filled in as the shard is written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    crc32c: Option<u32>,
}

fn shard_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

fn index_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.index.json")
}

/// A block waiting to be written.
struct PendingBlock {
    indexed: IndexedBlock,
    tensor: Tensor,
}

/// Collects one rank's blocks and writes them as `rank-NNNNN.safetensors` plus
/// `rank-NNNNN.index.json` (written last: its presence marks the shard complete).
pub struct ShardWriter {
    staging: PathBuf,
    rank: usize,
    blocks: Vec<PendingBlock>,
}

impl std::fmt::Debug for ShardWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardWriter")
            .field("staging", &self.staging)
            .field("rank", &self.rank)
            .field("blocks", &self.blocks.len())
            .finish()
    }
}

/// What [`ShardWriter::add`] records about one block.
#[derive(Clone, Copy, Debug)]
pub struct BlockSpec<'a> {
    /// The global tensor's name.
    pub name: &'a str,
    /// The global tensor's shape.
    pub global_shape: &'a [usize],
    /// Where this block starts in it (its shape is the tensor's).
    pub offset: &'a [usize],
    /// A description of the layout, for people (`Shard(0) over 4`).
    pub placement: Option<&'a str>,
}

impl ShardWriter {
    /// A writer for `rank` into `staging` (made by [`CheckpointDir::prepare_staging`]).
    pub fn new(staging: impl Into<PathBuf>, rank: usize) -> ShardWriter {
        ShardWriter {
            staging: staging.into(),
            rank,
            blocks: Vec::new(),
        }
    }

    /// Adds the block `tensor` of the global tensor `spec.name` at `spec.offset`. An empty
    /// block (a rank with no share of a small tensor) is skipped.
    pub fn add(&mut self, spec: BlockSpec<'_>, tensor: &Tensor) -> Result<()> {
        let block = Block {
            offset: spec.offset.to_vec(),
            shape: tensor.shape().to_vec(),
        };
        block.check_inside(spec.name, spec.global_shape)?;
        if block.volume() == 0 {
            return Ok(());
        }
        if self.blocks.iter().any(|b| b.indexed.name == spec.name) {
            return Err(Error::InconsistentTensor {
                name: spec.name.to_string(),
                reason: format!("rank {} added it twice", self.rank),
            });
        }
        self.blocks.push(PendingBlock {
            indexed: IndexedBlock {
                name: spec.name.to_string(),
                dtype: tensor.dtype().name().to_string(),
                global_shape: spec.global_shape.to_vec(),
                placement: spec.placement.map(str::to_string),
                key: spec.name.to_string(),
                block,
                crc32c: None,
            },
            tensor: tensor.clone(),
        });
        Ok(())
    }

    /// Writes and fsyncs the shard file, then the index (with each block's CRC32C).
    pub fn finish(mut self) -> Result<()> {
        let shard = self.staging.join(shard_file_name(self.rank));
        let headers: Vec<TensorHeader> = self
            .blocks
            .iter()
            .map(|b| TensorHeader {
                name: b.indexed.key.clone(),
                dtype: b.tensor.dtype(),
                shape: b.tensor.shape().to_vec(),
            })
            .collect();
        let mut checksums = vec![0u32; self.blocks.len()];
        write_streaming(&shard, &headers, &BTreeMap::new(), |i| {
            let block = &self.blocks[i];
            let bytes = block.tensor.to_bytes().map_err(|source| Error::Tensor {
                name: block.indexed.name.clone(),
                source,
            })?;
            checksums[i] = crc32c::crc32c(&bytes);
            Ok(bytes)
        })?;
        for (block, checksum) in self.blocks.iter_mut().zip(checksums) {
            block.indexed.crc32c = Some(checksum);
        }
        let index: Vec<&IndexedBlock> = self.blocks.iter().map(|b| &b.indexed).collect();
        let path = self.staging.join(index_file_name(self.rank));
        let bytes = serde_json::to_vec_pretty(&index).map_err(|source| Error::Json {
            path: path.clone(),
            source,
        })?;
        write_atomically(&path, &bytes)
    }
}

/// What [`CheckpointDir::commit`] records besides the tensors.
#[derive(Clone, Debug)]
pub struct CommitInfo {
    /// The step the checkpoint was taken after.
    pub step: u64,
    /// Ranks that wrote shards.
    pub world_size: usize,
    /// The model configuration.
    pub model_config: Value,
    /// RNG, data position and other resume state.
    pub state: Value,
}

/// A checkpoint root: `step-NNNNNNNN/` directories, a `latest` pointer, and staging
/// directories (`.staging-step-NNNNNNNN/`) of saves in progress.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointDir {
    root: PathBuf,
}

impl CheckpointDir {
    /// The root at `root` (created on the first save).
    pub fn new(root: impl Into<PathBuf>) -> CheckpointDir {
        CheckpointDir { root: root.into() }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the checkpoint of `step` lives once committed.
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.root.join(format!("step-{step:08}"))
    }

    /// Where the checkpoint of `step` is written before it is committed.
    pub fn staging_dir(&self, step: u64) -> PathBuf {
        self.root.join(format!(".staging-step-{step:08}"))
    }

    /// Makes an empty staging directory for `step`, removing what a crashed save left there.
    /// Call on one rank, then synchronise before the others write.
    pub fn prepare_staging(&self, step: u64) -> Result<PathBuf> {
        std::fs::create_dir_all(&self.root)
            .map_err(|e| Error::io(FileAction::CreateDir, &self.root, e))?;
        let staging = self.staging_dir(step);
        if staging.exists() {
            std::fs::remove_dir_all(&staging)
                .map_err(|e| Error::io(FileAction::Remove, &staging, e))?;
        }
        std::fs::create_dir(&staging).map_err(|e| Error::io(FileAction::CreateDir, &staging, e))?;
        fsync_dir(&self.root)?;
        Ok(staging)
    }

    /// The newest committed checkpoint, from the `latest` pointer.
    pub fn latest(&self) -> Result<Option<PathBuf>> {
        let pointer = self.root.join(LATEST_FILE);
        match std::fs::read_to_string(&pointer) {
            Ok(text) => {
                // `latest` names a sibling directory; a crafted one must not lead elsewhere.
                super::reader::confine_name(&self.root, LATEST_FILE, text.trim())?;
                Ok(Some(self.root.join(text.trim())))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(FileAction::Read, pointer, e)),
        }
    }

    /// Merges every rank's index into `metadata.json`, checks each tensor is covered exactly
    /// once, and makes the checkpoint visible: rename the staging directory to `step-N`, then
    /// repoint `latest`. Call on one rank after every rank's [`ShardWriter::finish`].
    pub fn commit(&self, info: CommitInfo) -> Result<PathBuf> {
        let staging = self.staging_dir(info.step);
        let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
        for rank in 0..info.world_size {
            let path = staging.join(index_file_name(rank));
            let bytes = match std::fs::read(&path) {
                Ok(bytes) => bytes,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(Error::MissingShard {
                        rank,
                        path: staging.clone(),
                    });
                }
                Err(e) => return Err(Error::io(FileAction::Read, &path, e)),
            };
            let index: Vec<IndexedBlock> =
                serde_json::from_slice(&bytes).map_err(|source| Error::Json {
                    path: path.clone(),
                    source,
                })?;
            for indexed in index {
                let entry = tensors
                    .entry(indexed.name.clone())
                    .or_insert_with(|| TensorEntry {
                        dtype: indexed.dtype.clone(),
                        shape: indexed.global_shape.clone(),
                        placement: indexed.placement.clone(),
                        blocks: Vec::new(),
                    });
                if entry.dtype != indexed.dtype || entry.shape != indexed.global_shape {
                    return Err(Error::InconsistentTensor {
                        name: indexed.name,
                        reason: format!(
                            "rank {rank} saved {} {:?}, another rank {} {:?}",
                            indexed.dtype, indexed.global_shape, entry.dtype, entry.shape
                        ),
                    });
                }
                entry.blocks.push(SavedBlock {
                    rank,
                    file: shard_file_name(rank),
                    key: indexed.key,
                    block: indexed.block,
                    crc32c: indexed.crc32c,
                });
            }
        }
        for (name, entry) in &tensors {
            let blocks: Vec<Block> = entry.blocks.iter().map(|b| b.block.clone()).collect();
            check_exact_cover(name, &entry.shape, &blocks)?;
        }
        let metadata = CheckpointMetadata {
            format: FORMAT.to_string(),
            version: VERSION,
            step: info.step,
            world_size: info.world_size,
            model_config: info.model_config,
            state: info.state,
            tensors,
        };
        let path = staging.join(METADATA_FILE);
        let bytes = serde_json::to_vec_pretty(&metadata).map_err(|source| Error::Json {
            path: path.clone(),
            source,
        })?;
        write_atomically(&path, &bytes)?;
        self.publish(info.step)
    }

    /// Renames the staging directory of `step` into place and repoints `latest` at it.
    fn publish(&self, step: u64) -> Result<PathBuf> {
        let staging = self.staging_dir(step);
        let target = self.step_dir(step);
        // A checkpoint of the same step may exist (a resumed run saving again): move it aside
        // first, so that at every moment `latest` names a complete directory.
        let aside = self
            .root
            .join(format!(".replaced-step-{step:08}-{}", std::process::id()));
        let replaced = target.exists();
        if replaced {
            std::fs::rename(&target, &aside)
                .map_err(|e| Error::io(FileAction::Rename, &target, e))?;
        }
        std::fs::rename(&staging, &target)
            .map_err(|e| Error::io(FileAction::Rename, &staging, e))?;
        fsync_dir(&self.root)?;
        let name = format!("step-{step:08}\n");
        write_atomically(&self.root.join(LATEST_FILE), name.as_bytes())?;
        if replaced {
            std::fs::remove_dir_all(&aside)
                .map_err(|e| Error::io(FileAction::Remove, &aside, e))?;
        }
        Ok(target)
    }
}

/// The dtype named in a checkpoint entry.
pub(super) fn entry_dtype(name: &str, entry: &TensorEntry) -> Result<DType> {
    DType::from_name(&entry.dtype).ok_or_else(|| Error::InconsistentTensor {
        name: name.to_string(),
        reason: format!("unknown dtype {}", entry.dtype),
    })
}
