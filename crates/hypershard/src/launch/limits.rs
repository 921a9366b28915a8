//! How much memory a rank may use, and buffers whose size comes from a file or a peer
//! allocated fallibly against it.
//!
//! The limits that can stop a rank: its own cgroup (`--max-rank-memory`), the resource
//! limits it inherits (`RLIMIT_AS`, `ulimit -v`; `RLIMIT_DATA`, `ulimit -d`), the memory
//! cgroup the job runs in (shared by the ranks of a node), and the memory the kernel says is
//! available (`MemAvailable`, also shared). The smallest share is what one rank can count on.
//! They are read from procfs and cgroupfs, so a machine without them simply has fewer limits.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::{Error, FileAction, Result};

/// cgroup v1 writes "no limit" as a huge page-aligned number; anything this large is no limit.
const UNLIMITED: u64 = 1 << 60;

/// Where a limit on a rank's memory comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LimitSource {
    /// `--max-rank-memory`: the rank's own cgroup.
    MaxRankMemory,
    /// `RLIMIT_AS` (`ulimit -v`): address space, per process.
    AddressSpace,
    /// `RLIMIT_DATA` (`ulimit -d`): heap and private mappings, per process.
    DataSize,
    /// A memory cgroup limit on the job's own cgroup (or an ancestor), shared by `ranks`.
    Cgroup { file: PathBuf, ranks: usize },
    /// `MemAvailable` of `/proc/meminfo`, shared by `ranks`.
    MemAvailable { ranks: usize },
}

impl fmt::Display for LimitSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitSource::MaxRankMemory => write!(f, "--max-rank-memory"),
            LimitSource::AddressSpace => {
                write!(f, "RLIMIT_AS, the address-space limit (ulimit -v)")
            }
            LimitSource::DataSize => write!(f, "RLIMIT_DATA, the data-size limit (ulimit -d)"),
            LimitSource::Cgroup { file, ranks } => {
                write!(f, "the memory cgroup limit {}", file.display())?;
                share(f, *ranks)
            }
            LimitSource::MemAvailable { ranks } => {
                write!(f, "MemAvailable in /proc/meminfo")?;
                share(f, *ranks)
            }
        }
    }
}

fn share(f: &mut fmt::Formatter<'_>, ranks: usize) -> fmt::Result {
    if ranks > 1 {
        write!(f, ", shared by the {ranks} ranks of this node")?;
    }
    Ok(())
}

/// One limit on what a rank may use, already divided among the ranks that share it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryLimit {
    /// Bytes one rank may use under this limit.
    pub bytes: u64,
    /// Where it comes from.
    pub source: LimitSource,
    /// Whether it counts reserved address space (thread stacks, allocator arenas) rather than
    /// memory in use, so a process needs more of it than it touches.
    pub address_space: bool,
}

/// The soft limit of one line of `/proc/self/limits` (`None`: unlimited or absent).
fn proc_limit(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|line| line.starts_with(name))?;
    let soft = line[name.len()..].split_whitespace().next()?;
    soft.parse().ok()
}

/// The bytes of one `/proc/meminfo` field given in kB.
fn meminfo_bytes(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
        Some(kib.saturating_mul(1024))
    })
}

fn read_number(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The tightest memory cgroup limit on this process: its own cgroup's and its ancestors'
/// (`memory.max` on v2, `memory.limit_in_bytes` on v1), with the file that sets it.
fn cgroup_limit() -> Option<(u64, PathBuf)> {
    let table = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_limit_under(&table, Path::new("/sys/fs/cgroup"))
}

/// [`cgroup_limit`] for the cgroup table `table` (`/proc/self/cgroup`'s text) with the cgroup
/// file systems mounted at `sys`.
fn cgroup_limit_under(table: &str, sys: &Path) -> Option<(u64, PathBuf)> {
    // v1: "4:memory:/a/b"; v2: "0::/a/b". A v1 memory line wins where both exist (hybrid).
    let v1 = table.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "memory").then_some((
            sys.join("memory"),
            "memory.limit_in_bytes",
            path,
        ))
    });
    let v2 = || {
        table.lines().find_map(|line| {
            let path = line.strip_prefix("0::")?;
            Some((sys.to_path_buf(), "memory.max", path))
        })
    };
    let (root, file, path) = v1.or_else(v2)?;
    let root = root.as_path();
    let mut dir = root.join(path.trim_start_matches('/'));
    let mut tightest: Option<(u64, PathBuf)> = None;
    loop {
        let candidate = dir.join(file);
        // v2 writes "max" for no limit, which does not parse and is skipped.
        if let Some(bytes) = read_number(&candidate).filter(|b| *b < UNLIMITED)
            && tightest.as_ref().is_none_or(|(t, _)| bytes < *t)
        {
            tightest = Some((bytes, candidate));
        }
        if dir == root || !dir.pop() || !dir.starts_with(root) {
            break;
        }
    }
    tightest
}

/// Every limit that applies to one of `local_ranks` ranks of this node, given the
/// `--max-rank-memory` budget if any. Read in this process, whose resource limits the ranks
/// inherit.
pub fn rank_limits(local_ranks: usize, max_rank_memory: Option<u64>) -> Vec<MemoryLimit> {
    let ranks = local_ranks.max(1);
    let per_rank = |bytes: u64| bytes / ranks as u64;
    let mut limits = Vec::new();
    if let Some(bytes) = max_rank_memory {
        limits.push(MemoryLimit {
            bytes,
            source: LimitSource::MaxRankMemory,
            address_space: false,
        });
    }
    if let Ok(text) = std::fs::read_to_string("/proc/self/limits") {
        if let Some(bytes) = proc_limit(&text, "Max address space") {
            limits.push(MemoryLimit {
                bytes,
                source: LimitSource::AddressSpace,
                address_space: true,
            });
        }
        if let Some(bytes) = proc_limit(&text, "Max data size") {
            limits.push(MemoryLimit {
                bytes,
                source: LimitSource::DataSize,
                address_space: true,
            });
        }
    }
    if let Some((bytes, file)) = cgroup_limit() {
        limits.push(MemoryLimit {
            bytes: per_rank(bytes),
            source: LimitSource::Cgroup { file, ranks },
            address_space: false,
        });
    }
    if let Some(bytes) = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| meminfo_bytes(&text, "MemAvailable"))
    {
        limits.push(MemoryLimit {
            bytes: per_rank(bytes),
            source: LimitSource::MemAvailable { ranks },
            address_space: false,
        });
    }
    limits
}

/// `bytes` as a person reads it: `1.5 GiB`, `812.0 KiB`, `17 B`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The limits that apply to this one process (no sharing with other ranks): what a single
/// buffer read from a file or received from a peer is checked against.
fn process_limit() -> Option<MemoryLimit> {
    rank_limits(1, None).into_iter().min_by_key(|l| l.bytes)
}

/// A zeroed buffer of `len` bytes for data whose size came from a file or a peer: refused
/// with [`Error::AllocationRefused`] (naming `what`) when it exceeds what this process may
/// use, or when the allocator cannot provide it, instead of aborting the process.
pub fn zeroed_buffer(len: usize, what: impl FnOnce() -> String) -> Result<Vec<u8>> {
    let mut buffer = Vec::new();
    reserve(&mut buffer, len, what)?;
    buffer.resize(len, 0);
    Ok(buffer)
}

/// Reserves room for `additional` more bytes in `buffer` as [`zeroed_buffer`] does.
pub fn reserve(
    buffer: &mut Vec<u8>,
    additional: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    let over = process_limit().filter(|limit| additional as u64 > limit.bytes);
    if let Some(limit) = over {
        return Err(Error::AllocationRefused {
            what: what(),
            bytes: additional as u64,
            reason: format!(
                "more than this process may use ({} under {})",
                human_bytes(limit.bytes),
                limit.source
            ),
        });
    }
    buffer
        .try_reserve_exact(additional)
        .map_err(|e| Error::AllocationRefused {
            what: what(),
            bytes: additional as u64,
            reason: format!("the allocator refused it ({e})"),
        })
}

/// Reads the whole file at `path` into a buffer allocated as [`zeroed_buffer`] does: a data
/// file, a config or a checkpoint's metadata larger than the process may hold is an
/// [`Error::AllocationRefused`] naming it, not an abort.
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(FileAction::Read, path, e))?;
    let len = file
        .metadata()
        .map_err(|e| Error::io(FileAction::Read, path, e))?
        .len();
    let mut bytes = Vec::new();
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    reserve(&mut bytes, len, || path.display().to_string())?;
    file.read_to_end(&mut bytes)
        .map_err(|e| Error::io(FileAction::Read, path, e))?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_limits_and_meminfo_parse() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max data size             unlimited            unlimited            bytes\n\
                      Max address space         6442450944           unlimited            bytes\n";
        assert_eq!(proc_limit(limits, "Max address space"), Some(6_442_450_944));
        assert_eq!(proc_limit(limits, "Max data size"), None);
        assert_eq!(proc_limit(limits, "Max resident set"), None);
        let meminfo = "MemTotal:       24683520 kB\nMemAvailable:   14626816 kB\n";
        assert_eq!(
            meminfo_bytes(meminfo, "MemAvailable"),
            Some(14_626_816 * 1024)
        );
        assert_eq!(meminfo_bytes(meminfo, "MemFree"), None);
    }

    #[test]
    fn the_tightest_cgroup_limit_up_the_hierarchy_is_found() {
        let sys = std::env::temp_dir().join(format!("hypershard-cgroup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&sys);
        let job = sys.join("job");
        let rank = job.join("rank0");
        std::fs::create_dir_all(&rank).unwrap();
        let v1 = sys.join("memory").join("a").join("b");
        std::fs::create_dir_all(&v1).unwrap();
        // v2: the rank's own "max" is no limit; its parent's 2 GiB is, below the root's 8.
        std::fs::write(rank.join("memory.max"), "max\n").unwrap();
        std::fs::write(job.join("memory.max"), "2147483648\n").unwrap();
        std::fs::write(sys.join("memory.max"), "8589934592\n").unwrap();
        assert_eq!(
            cgroup_limit_under("0::/job/rank0\n", &sys),
            Some((2 << 30, job.join("memory.max")))
        );
        // v1 (a memory line wins over the unified one); its "no limit" is a huge number.
        std::fs::write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        std::fs::write(
            sys.join("memory").join("a").join("memory.limit_in_bytes"),
            "1073741824\n",
        )
        .unwrap();
        let table = "0::/job/rank0\n4:memory:/a/b\n3:cpu:/\n";
        assert_eq!(
            cgroup_limit_under(table, &sys),
            Some((
                1 << 30,
                sys.join("memory").join("a").join("memory.limit_in_bytes")
            ))
        );
        // No memory cgroup at all: no limit.
        assert_eq!(cgroup_limit_under("3:cpu:/\n", &sys), None);
        std::fs::remove_dir_all(&sys).unwrap();
    }

    #[test]
    fn shared_limits_are_divided_among_the_ranks() {
        let one = rank_limits(1, Some(1 << 30));
        let four = rank_limits(4, Some(1 << 30));
        assert_eq!(one[0].source, LimitSource::MaxRankMemory);
        assert_eq!(one[0].bytes, 1 << 30);
        // MemAvailable moves between the two reads, so compare the rank-local ones and
        // check the shared ones are split four ways (within what moved).
        for (a, b) in one.iter().zip(&four) {
            match &b.source {
                LimitSource::MaxRankMemory | LimitSource::AddressSpace | LimitSource::DataSize => {
                    assert_eq!(a.bytes, b.bytes)
                }
                LimitSource::Cgroup { ranks, .. } => {
                    assert_eq!(*ranks, 4);
                    assert_eq!(a.bytes / 4, b.bytes);
                }
                LimitSource::MemAvailable { ranks } => {
                    assert_eq!(*ranks, 4);
                    assert!(b.bytes < a.bytes / 2, "{a:?} {b:?}");
                }
            }
        }
    }

    #[test]
    fn a_buffer_beyond_what_the_process_may_use_is_a_typed_error() {
        // More than any machine's memory: refused by the limit check or by the allocator,
        // either way as an error naming the buffer and its size.
        let len = usize::MAX / 2;
        match zeroed_buffer(len, || "tensor w of /x.safetensors".to_string()) {
            Err(Error::AllocationRefused { what, bytes, .. }) => {
                assert_eq!(what, "tensor w of /x.safetensors");
                assert_eq!(bytes, len as u64);
            }
            other => panic!("{:?}", other.map(|b| b.len())),
        }
        assert_eq!(zeroed_buffer(3, String::new).unwrap(), vec![0u8; 3]);
    }
}
