//! Loading: open a checkpoint directory and read any block of any tensor, assembled from
//! whichever saved blocks overlap it, so a checkpoint saved on one layout loads on another.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};

use hypershard_tensor::Tensor;
use serde_json::Value;

use super::block::{Block, copy_overlap};
use super::metadata::{CheckpointMetadata, FORMAT, METADATA_FILE, TensorEntry, VERSION};
use super::safetensors_file::SafetensorsIndex;
use super::writer::{CheckpointDir, entry_dtype};
use crate::error::{Error, FileAction, Result};

/// A committed checkpoint, opened for reading.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    metadata: CheckpointMetadata,
    files: Mutex<BTreeMap<String, Arc<SafetensorsIndex>>>,
}

/// Finds the checkpoint that `path` names: a checkpoint directory itself (it holds
/// `metadata.json`), a checkpoint root (its `latest`, or else its newest complete
/// `step-N`), or a training output directory (its `checkpoints/` root).
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join(METADATA_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    for root in [path.to_path_buf(), path.join("checkpoints")] {
        let dir = CheckpointDir::new(&root);
        if let Some(latest) = dir.latest()?
            && latest.join(METADATA_FILE).is_file()
        {
            return Ok(latest);
        }
        if let Some(newest) = newest_complete(&root)? {
            return Ok(newest);
        }
    }
    Err(Error::NoCheckpoint {
        path: path.to_path_buf(),
    })
}

/// The highest `step-N` directory under `root` that holds `metadata.json`.
fn newest_complete(root: &Path) -> Result<Option<PathBuf>> {
    let entries = match std::fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(FileAction::List, root, e)),
    };
    let mut best: Option<(u64, PathBuf)> = None;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(FileAction::List, root, e))?;
        let name = entry.file_name();
        let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        if entry.path().join(METADATA_FILE).is_file()
            && best.as_ref().is_none_or(|(s, _)| step > *s)
        {
            best = Some((step, entry.path()));
        }
    }
    Ok(best.map(|(_, path)| path))
}

impl Checkpoint {
    /// Opens the checkpoint `path` names (see [`resolve`]) and validates its metadata.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let dir = resolve(path)?;
        let meta_path = dir.join(METADATA_FILE);
        let bytes = crate::launch::read_file(&meta_path)?;
        let metadata = parse_metadata(&bytes, &dir)?;
        // Every shard file that exists is checked now, so a FIFO or a symlink out of the
        // directory is refused before anything reads; a missing one is reported when read.
        let files: BTreeSet<&str> = metadata
            .tensors
            .values()
            .flat_map(|entry| entry.blocks.iter().map(|b| b.file.as_str()))
            .collect();
        for file in files {
            if std::fs::symlink_metadata(dir.join(file)).is_ok() {
                confine_on_disk(&dir, file)?;
            }
        }
        Ok(Checkpoint {
            dir,
            metadata,
            files: Mutex::new(BTreeMap::new()),
        })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed `metadata.json`.
    pub fn metadata(&self) -> &CheckpointMetadata {
        &self.metadata
    }

    /// The step it was taken after.
    pub fn step(&self) -> u64 {
        self.metadata.step
    }

    /// A tensor's entry.
    pub fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.metadata
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
            })
    }

    /// Checks the checkpoint was saved for `requested` (the same JSON model configuration):
    /// the first differing field becomes [`Error::ConfigMismatch`].
    pub fn check_model_config(&self, requested: &Value) -> Result<()> {
        match first_difference("", &self.metadata.model_config, requested) {
            None => Ok(()),
            Some((field, saved, requested)) => Err(Error::ConfigMismatch {
                path: self.dir.clone(),
                field,
                saved,
                requested,
            }),
        }
    }

    fn file(&self, name: &str) -> Result<Arc<SafetensorsIndex>> {
        // A poisoned lock only means another reader panicked mid-insert; the map is still valid.
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(index) = files.get(name) {
            return Ok(Arc::clone(index));
        }
        let path = confine_on_disk(&self.dir, name)?;
        let index = Arc::new(SafetensorsIndex::open(&path)?);
        files.insert(name.to_string(), Arc::clone(&index));
        Ok(index)
    }

    /// Reads the block `want` of tensor `name` from every saved block that overlaps it.
    pub fn read_block(&self, name: &str, want: &Block) -> Result<Tensor> {
        let entry = self.entry(name)?;
        want.check_inside(name, &entry.shape)?;
        let dtype = entry_dtype(name, entry)?;
        let element = dtype.size_of();
        let len = want
            .volume()
            .checked_mul(element)
            .ok_or_else(|| Error::AllocationRefused {
                what: format!("tensor {name} of checkpoint {}", self.dir.display()),
                bytes: u64::MAX,
                reason: "its size overflows a machine word".to_string(),
            })?;
        let mut out = crate::launch::zeroed_buffer(len, || {
            format!("tensor {name} of checkpoint {}", self.dir.display())
        })?;
        let mut copied = 0usize;
        for saved in &entry.blocks {
            if want.volume() == 0 || saved.block.intersect(want).is_none() {
                continue;
            }
            let (stored, bytes) = self.file(&saved.file)?.read(&saved.key)?;
            if stored.dtype != dtype || stored.shape != saved.block.shape {
                return Err(Error::InconsistentTensor {
                    name: name.to_string(),
                    reason: format!(
                        "{} holds {} {:?} under {}, metadata says {} {:?}",
                        saved.file,
                        stored.dtype.name(),
                        stored.shape,
                        saved.key,
                        entry.dtype,
                        saved.block.shape
                    ),
                });
            }
            if let Some(expected) = saved.crc32c {
                let actual = crc32c::crc32c(&bytes);
                if actual != expected {
                    return Err(Error::ChecksumMismatch {
                        file: self.dir.join(&saved.file),
                        tensor: name.to_string(),
                        key: saved.key.clone(),
                        expected,
                        actual,
                    });
                }
            }
            copied += copy_overlap(&saved.block, &bytes, want, &mut out, element);
        }
        if copied != want.volume() {
            return Err(Error::BlockCoverage {
                name: name.to_string(),
                covered: copied,
                numel: want.volume(),
            });
        }
        Tensor::from_bytes(&out, &want.shape, dtype).map_err(|source| Error::Tensor {
            name: name.to_string(),
            source,
        })
    }

    /// Reads a whole tensor.
    pub fn read_tensor(&self, name: &str) -> Result<Tensor> {
        let shape = self.entry(name)?.shape.clone();
        self.read_block(name, &Block::whole(&shape))
    }
}

/// Parses and validates the bytes of `dir`'s `metadata.json`: format and version, every
/// tensor's dtype, and that its saved blocks cover it exactly once. Arbitrary bytes give a
/// typed error, never a panic.
pub(crate) fn parse_metadata(bytes: &[u8], dir: &Path) -> Result<CheckpointMetadata> {
    let metadata: CheckpointMetadata =
        serde_json::from_slice(bytes).map_err(|source| Error::Json {
            path: dir.join(METADATA_FILE),
            source,
        })?;
    if metadata.format != FORMAT || metadata.version != VERSION {
        return Err(Error::CheckpointFormat {
            path: dir.to_path_buf(),
            format: metadata.format,
            version: metadata.version,
        });
    }
    for (name, entry) in &metadata.tensors {
        entry_dtype(name, entry)?;
        for saved in &entry.blocks {
            confine_name(dir, METADATA_FILE, &saved.file)?;
        }
        let blocks: Vec<Block> = entry.blocks.iter().map(|b| b.block.clone()).collect();
        super::block::check_exact_cover(name, &entry.shape, &blocks)?;
    }
    Ok(metadata)
}

/// Checks, without touching the file system, that `name` (written in `named_in`) is a
/// relative path that stays below `dir`: not empty, not absolute, no `..`.
pub(crate) fn confine_name(dir: &Path, named_in: &'static str, name: &str) -> Result<()> {
    let refuse = |reason: &str| Error::UnsafeCheckpointPath {
        dir: dir.to_path_buf(),
        named_in,
        file: name.to_string(),
        reason: reason.to_string(),
    };
    let path = Path::new(name);
    if path.components().next().is_none() {
        return Err(refuse("is empty"));
    }
    for component in path.components() {
        match component {
            Component::Normal(_) | Component::CurDir => {}
            Component::ParentDir => return Err(refuse("climbs out of the directory with `..`")),
            Component::RootDir | Component::Prefix(_) => {
                return Err(refuse("is an absolute path, not one inside the checkpoint"));
            }
        }
    }
    Ok(())
}

/// Resolves the shard file `name` of checkpoint `dir` and checks, before it is opened, that
/// it is a regular file inside the directory: a symlink (or symlinked parent) may not lead
/// out of it, and a FIFO, device or directory is refused (opening a FIFO for reading blocks
/// until a writer appears, which would hang `export`). The guard is against a crafted
/// `metadata.json`; the directory itself is trusted not to change between this check and the
/// open.
pub(crate) fn confine_on_disk(dir: &Path, name: &str) -> Result<PathBuf> {
    confine_name(dir, METADATA_FILE, name)?;
    let refuse = |reason: String| Error::UnsafeCheckpointPath {
        dir: dir.to_path_buf(),
        named_in: METADATA_FILE,
        file: name.to_string(),
        reason,
    };
    let path = dir.join(name);
    let base = dir
        .canonicalize()
        .map_err(|e| Error::io(FileAction::Read, dir, e))?;
    let resolved = path
        .canonicalize()
        .map_err(|e| Error::io(FileAction::Read, &path, e))?;
    if !resolved.starts_with(&base) {
        return Err(refuse(format!(
            "resolves through a symlink to {}, outside the checkpoint directory",
            resolved.display()
        )));
    }
    let kind = std::fs::metadata(&resolved)
        .map_err(|e| Error::io(FileAction::Read, &path, e))?
        .file_type();
    if !kind.is_file() {
        return Err(refuse(format!(
            "is not a regular file (it is {})",
            describe_file_type(kind)
        )));
    }
    Ok(resolved)
}

fn describe_file_type(kind: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else {
        "not a file"
    }
}

/// The first field (a dotted path) where two JSON values differ, with both values as text.
fn first_difference(
    path: &str,
    saved: &Value,
    requested: &Value,
) -> Option<(String, String, String)> {
    match (saved, requested) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            keys.into_iter().find_map(|key| {
                let field = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match (a.get(key), b.get(key)) {
                    (Some(x), Some(y)) => first_difference(&field, x, y),
                    (x, y) => Some((field, show(x), show(y))),
                }
            })
        }
        _ if saved == requested => None,
        _ => Some((
            if path.is_empty() {
                "model".to_string()
            } else {
                path.to_string()
            },
            saved.to_string(),
            requested.to_string(),
        )),
    }
}

fn show(value: Option<&Value>) -> String {
    value.map_or_else(|| "absent".to_string(), Value::to_string)
}
