//! Just enough of the safetensors format to stream it: a writer that emits one tensor's bytes
//! at a time (so an export never holds the whole model), and a reader that parses the header
//! and then reads only the byte range of the tensor asked for.
//!
//! Layout: an 8-byte little-endian header length, a JSON header mapping names to
//! `{dtype, shape, data_offsets: [begin, end]}` (offsets relative to the data section), padded
//! with spaces to a multiple of 8 bytes, then the data.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hypershard_tensor::DType;
use serde_json::{Map, Value, json};

use crate::error::{Error, FileAction, Result};

/// The safetensors name of a dtype.
pub fn dtype_code(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "F32",
        DType::F64 => "F64",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        DType::I32 => "I32",
        DType::I64 => "I64",
        DType::U8 => "U8",
        DType::Bool => "BOOL",
    }
}

/// The dtype of a safetensors name.
pub fn dtype_from_code(code: &str) -> Option<DType> {
    Some(match code {
        "F32" => DType::F32,
        "F64" => DType::F64,
        "BF16" => DType::BF16,
        "F16" => DType::F16,
        "I32" => DType::I32,
        "I64" => DType::I64,
        "U8" => DType::U8,
        "BOOL" => DType::Bool,
        _ => return None,
    })
}

/// One tensor of a file to write: name, dtype, shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorHeader {
    /// The tensor's name.
    pub name: String,
    /// Its dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
}

impl TensorHeader {
    /// Bytes of the tensor's data.
    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size_of()
    }
}

fn safetensors_error(path: &Path, reason: impl Into<String>) -> Error {
    Error::Safetensors {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Writes a safetensors file at `path`: the header for `tensors`, then, for each tensor in
/// order, the bytes `data(index)` returns (checked against its dtype and shape). The file is
/// flushed and fsynced before this returns.
pub fn write_streaming(
    path: &Path,
    tensors: &[TensorHeader],
    metadata: &BTreeMap<String, String>,
    mut data: impl FnMut(usize) -> Result<Vec<u8>>,
) -> Result<()> {
    let mut header = Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".to_string(), json!(metadata));
    }
    let mut at = 0usize;
    for tensor in tensors {
        let end = at + tensor.nbytes();
        header.insert(
            tensor.name.clone(),
            json!({"dtype": dtype_code(tensor.dtype), "shape": tensor.shape, "data_offsets": [at, end]}),
        );
        at = end;
    }
    let mut header_bytes =
        serde_json::to_vec(&Value::Object(header)).map_err(|source| Error::Json {
            path: path.to_path_buf(),
            source,
        })?;
    while header_bytes.len() % 8 != 0 {
        header_bytes.push(b' ');
    }
    let file = File::create(path).map_err(|e| Error::io(FileAction::Write, path, e))?;
    let mut out = BufWriter::new(file);
    let write_err = |e| Error::io(FileAction::Write, path, e);
    out.write_all(&(header_bytes.len() as u64).to_le_bytes())
        .map_err(write_err)?;
    out.write_all(&header_bytes).map_err(write_err)?;
    for (index, tensor) in tensors.iter().enumerate() {
        let bytes = data(index)?;
        if bytes.len() != tensor.nbytes() {
            return Err(safetensors_error(
                path,
                format!(
                    "tensor {} has {} bytes, its dtype and shape need {}",
                    tensor.name,
                    bytes.len(),
                    tensor.nbytes()
                ),
            ));
        }
        out.write_all(&bytes).map_err(write_err)?;
    }
    let file = out
        .into_inner()
        .map_err(|e| Error::io(FileAction::Write, path, e.into_error()))?;
    file.sync_all()
        .map_err(|e| Error::io(FileAction::Sync, path, e))
}

/// Where one tensor's bytes are in a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredTensor {
    /// Its dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Byte range in the file.
    pub begin: u64,
    /// End of the byte range in the file.
    pub end: u64,
}

/// A parsed safetensors header, for reading single tensors.
#[derive(Clone, Debug)]
pub struct SafetensorsIndex {
    path: PathBuf,
    tensors: BTreeMap<String, StoredTensor>,
    /// Data bytes read through this index and its clones (headers not counted): what the
    /// sharded-loading tests assert, so a rank is seen to read only its own rows.
    bytes_read: Arc<AtomicU64>,
}

/// Headers above this size are refused (a corrupt length must not allocate gigabytes).
const MAX_HEADER_BYTES: u64 = 100 << 20;

impl SafetensorsIndex {
    /// Reads and validates the header of the file at `path`.
    pub fn open(path: &Path) -> Result<SafetensorsIndex> {
        let mut file = File::open(path).map_err(|e| Error::io(FileAction::Read, path, e))?;
        let file_len = file
            .metadata()
            .map_err(|e| Error::io(FileAction::Read, path, e))?
            .len();
        let mut len_bytes = [0u8; 8];
        file.read_exact(&mut len_bytes)
            .map_err(|_| safetensors_error(path, "file shorter than its 8-byte header length"))?;
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > MAX_HEADER_BYTES || header_len + 8 > file_len {
            return Err(safetensors_error(
                path,
                format!("header length {header_len} does not fit a {file_len}-byte file"),
            ));
        }
        // invariant: header_len ≤ MAX_HEADER_BYTES, which fits in usize.
        let mut header = vec![0u8; header_len as usize];
        file.read_exact(&mut header)
            .map_err(|e| Error::io(FileAction::Read, path, e))?;
        let header: Map<String, Value> =
            serde_json::from_slice(&header).map_err(|source| Error::Json {
                path: path.to_path_buf(),
                source,
            })?;
        let data_start = 8 + header_len;
        let mut tensors = BTreeMap::new();
        for (name, entry) in header {
            if name == "__metadata__" {
                continue;
            }
            let parsed = parse_entry(&entry).ok_or_else(|| {
                safetensors_error(path, format!("malformed header entry for {name}"))
            })?;
            let (dtype, shape, begin, end) = parsed;
            // Checked: a crafted shape or offset must not wrap around to a size that matches.
            let expected = shape
                .iter()
                .try_fold(dtype.size_of(), |acc, d| acc.checked_mul(*d));
            let in_file = data_start.checked_add(end).is_some_and(|e| e <= file_len);
            if end < begin || expected != usize::try_from(end - begin).ok() || !in_file {
                return Err(safetensors_error(
                    path,
                    format!(
                        "tensor {name}: data offsets [{begin}, {end}) do not match its shape or the file"
                    ),
                ));
            }
            tensors.insert(
                name,
                StoredTensor {
                    dtype,
                    shape,
                    begin: data_start + begin,
                    end: data_start + end,
                },
            );
        }
        Ok(SafetensorsIndex {
            path: path.to_path_buf(),
            tensors,
            bytes_read: Arc::new(AtomicU64::new(0)),
        })
    }

    /// The tensors in the file.
    pub fn tensors(&self) -> &BTreeMap<String, StoredTensor> {
        &self.tensors
    }

    /// The path of the file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Data bytes read so far through this index and its clones.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// Reads rows `start..start + len` of dim 0 of one tensor: one contiguous byte range of
    /// the file (row-major), so a rank loading its `Shard(0)` block never reads the rest.
    pub fn read_rows(
        &self,
        name: &str,
        start: usize,
        len: usize,
    ) -> Result<(StoredTensor, Vec<u8>)> {
        let stored = self.stored(name)?;
        let rows = stored.shape.first().copied().unwrap_or(1);
        let in_range = start.checked_add(len).is_some_and(|end| end <= rows);
        if !in_range {
            return Err(safetensors_error(
                &self.path,
                format!("tensor {name}: rows {start}..{start}+{len} outside its {rows} rows"),
            ));
        }
        let row_bytes = stored.shape.iter().skip(1).product::<usize>() * stored.dtype.size_of();
        // invariant: the whole range was checked against the file length at open (without
        // overflow), and these rows lie inside it, so neither product overflows.
        let begin = stored.begin + (start * row_bytes) as u64;
        let bytes = self.read_range(name, begin, len * row_bytes)?;
        Ok((stored, bytes))
    }

    /// Reads the block `rows × cols` of a 2-d tensor, row-major: one read of `cols.1`
    /// elements per row. For a tensor stored transposed (Hugging Face's `Conv1D` weights,
    /// `[in, out]`), a rank's `Shard(0)` rows of the model's `[out, in]` weight are columns of
    /// the file, so this reads them without reading the other ranks' columns.
    pub fn read_submatrix(
        &self,
        name: &str,
        rows: (usize, usize),
        cols: (usize, usize),
    ) -> Result<(StoredTensor, Vec<u8>)> {
        use std::os::unix::fs::FileExt;
        let stored = self.stored(name)?;
        let [n_rows, n_cols] = stored.shape[..] else {
            return Err(safetensors_error(
                &self.path,
                format!("tensor {name} has shape {:?}, not 2-d", stored.shape),
            ));
        };
        let fits = |(start, len): (usize, usize), n: usize| {
            start.checked_add(len).is_some_and(|end| end <= n)
        };
        if !fits(rows, n_rows) || !fits(cols, n_cols) {
            return Err(safetensors_error(
                &self.path,
                format!(
                    "tensor {name}: block rows {}+{} cols {}+{} outside its {n_rows}x{n_cols}",
                    rows.0, rows.1, cols.0, cols.1
                ),
            ));
        }
        let size = stored.dtype.size_of();
        let path = &self.path;
        let file = File::open(path).map_err(|e| Error::io(FileAction::Read, path, e))?;
        let row_len = cols.1 * size;
        // invariant: the block lies inside the tensor, whose size was checked at open.
        let mut bytes = crate::launch::zeroed_buffer(rows.1 * row_len, || {
            format!("tensor {name} of {}", path.display())
        })?;
        for (i, chunk) in bytes.chunks_exact_mut(row_len.max(1)).enumerate() {
            // invariant: the block lies inside the tensor (checked above), whose byte range
            // was checked against the file length at open.
            let at = stored.begin + (((rows.0 + i) * n_cols + cols.0) * size) as u64;
            file.read_exact_at(chunk, at)
                .map_err(|e| Error::io(FileAction::Read, path, e))?;
        }
        self.bytes_read
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok((stored, bytes))
    }

    fn stored(&self, name: &str) -> Result<StoredTensor> {
        Ok(self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
            })?
            .clone())
    }

    fn read_range(&self, name: &str, begin: u64, len: usize) -> Result<Vec<u8>> {
        let path = &self.path;
        // The size comes from the file's header: a tensor larger than this process may hold
        // is an error naming it, not an abort in the allocator.
        let mut bytes =
            crate::launch::zeroed_buffer(len, || format!("tensor {name} of {}", path.display()))?;
        let mut file = File::open(path).map_err(|e| Error::io(FileAction::Read, path, e))?;
        file.seek(SeekFrom::Start(begin))
            .map_err(|e| Error::io(FileAction::Read, path, e))?;
        file.read_exact(&mut bytes)
            .map_err(|e| Error::io(FileAction::Read, path, e))?;
        self.bytes_read.fetch_add(len as u64, Ordering::Relaxed);
        Ok(bytes)
    }

    /// Reads the bytes of one tensor.
    pub fn read(&self, name: &str) -> Result<(StoredTensor, Vec<u8>)> {
        let stored = self.stored(name)?;
        // invariant: the range was checked against the file length, which fits in memory
        // addressing on the platforms we build for.
        let bytes = self.read_range(name, stored.begin, (stored.end - stored.begin) as usize)?;
        Ok((stored, bytes))
    }
}

fn parse_entry(entry: &Value) -> Option<(DType, Vec<usize>, u64, u64)> {
    let dtype = dtype_from_code(entry.get("dtype")?.as_str()?)?;
    let shape = entry
        .get("shape")?
        .as_array()?
        .iter()
        .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect::<Option<Vec<usize>>>()?;
    let offsets = entry.get("data_offsets")?.as_array()?;
    if offsets.len() != 2 {
        return None;
    }
    Some((dtype, shape, offsets[0].as_u64()?, offsets[1].as_u64()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hypershard_tensor::Tensor;

    /// A safetensors file whose header is `header` and whose data is `data_len` bytes of
    /// holes (a sparse file: nothing is written).
    fn crafted(name: &str, header: &str, data_len: u64) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("hypershard-st-huge-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(bytes.len() as u64 + data_len).unwrap();
        path
    }

    #[test]
    fn a_header_claiming_a_huge_tensor_is_a_typed_error_not_an_abort() {
        // 4 TiB of f32, and a file (sparse) that really is that long: the header is
        // consistent, so only the read can refuse it, by the size this process may hold.
        let huge: u64 = 1 << 40;
        let header = format!(
            r#"{{"w":{{"dtype":"F32","shape":[{huge}],"data_offsets":[0,{}]}}}}"#,
            huge * 4
        );
        let path = crafted("huge.safetensors", &header, huge * 4);
        let index = SafetensorsIndex::open(&path).unwrap();
        match index.read("w") {
            Err(Error::AllocationRefused { what, bytes, .. }) => {
                assert_eq!(bytes, huge * 4);
                assert!(what.contains("tensor w"), "{what}");
                assert!(what.contains("huge.safetensors"), "{what}");
            }
            other => panic!("{:?}", other.map(|(_, b)| b.len())),
        }
        // A few rows of it are an ordinary read.
        let (_, rows) = index.read_rows("w", 10, 4).unwrap();
        assert_eq!(rows, vec![0u8; 16]);
        assert_eq!(index.bytes_read(), 16);
        // A shape whose byte count overflows must not wrap around to the offsets given.
        let wrapped =
            r#"{"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}}"#;
        let path = crafted("wrapped.safetensors", wrapped, 0);
        match SafetensorsIndex::open(&path) {
            Err(Error::Safetensors { reason, .. }) => {
                assert!(reason.contains("tensor w"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        // An end offset at u64::MAX must not wrap around past the file-length check.
        let past = format!(
            r#"{{"w":{{"dtype":"U8","shape":[{}],"data_offsets":[{},{}]}}}}"#,
            u64::MAX - 100,
            100,
            u64::MAX
        );
        let path = crafted("past.safetensors", &past, 0);
        assert!(matches!(
            SafetensorsIndex::open(&path),
            Err(Error::Safetensors { .. })
        ));
        // The 4 TiB file is all holes, but need not outlive the test.
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn streamed_files_read_back_here_and_in_the_safetensors_crate() {
        let dir = std::env::temp_dir().join(format!("hypershard-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let a = Tensor::arange(6, DType::F32)
            .unwrap()
            .view(&[2, 3])
            .unwrap();
        let b = Tensor::arange(3, DType::BF16).unwrap();
        let tensors = [(&"a", &a), (&"b", &b)];
        let headers: Vec<TensorHeader> = tensors
            .iter()
            .map(|(n, t)| TensorHeader {
                name: n.to_string(),
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
            })
            .collect();
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        write_streaming(&path, &headers, &meta, |i| {
            Ok(tensors[i].1.to_bytes().unwrap())
        })
        .unwrap();
        let index = SafetensorsIndex::open(&path).unwrap();
        let (stored, bytes) = index.read("a").unwrap();
        assert_eq!(stored.shape, vec![2, 3]);
        assert_eq!(bytes, a.to_bytes().unwrap());
        let loaded = hypershard_tensor::load_safetensors_file(&path).unwrap();
        assert_eq!(loaded["b"].to_f64_vec().unwrap(), vec![0.0, 1.0, 2.0]);
        assert!(matches!(index.read("c"), Err(Error::MissingTensor { .. })));
        // A wrong byte count from the producer is refused.
        let bad = write_streaming(&path, &headers, &meta, |_| Ok(vec![0u8; 3]));
        assert!(matches!(bad, Err(Error::Safetensors { .. })));
        // A truncated file is refused at open.
        std::fs::write(&path, [200u8, 0, 0, 0, 0, 0, 0, 0, b'{']).unwrap();
        assert!(matches!(
            SafetensorsIndex::open(&path),
            Err(Error::Safetensors { .. })
        ));
    }
}
