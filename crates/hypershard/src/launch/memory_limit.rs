//! `--max-rank-memory`: one memory cgroup per rank, so a rank over its budget is stopped by the
//! kernel, and the launcher can say so.
//!
//! A cgroup's limit counts the memory the kernel charges to the process: resident pages plus
//! the page cache it brings in, reclaiming cache before it kills. That is an honest bound on
//! what a rank costs the machine. `RLIMIT_AS` would not be: it counts reserved address space
//! (thread stacks, allocator arenas, mapped but untouched pages), which for a multi-threaded
//! Rust process is gigabytes more than what it uses.
//!
//! Both cgroup versions work. Version 1 (a `memory` hierarchy) takes `memory.limit_in_bytes`
//! (and `memory.memsw.limit_in_bytes` where swap accounting exists, so a rank cannot swap past
//! its budget); version 2 takes `memory.max` and `memory.swap.max`. The job's cgroups sit
//! under the launcher's own, as `hypershard-<pid>/rank<N>`, and are removed when the ranks
//! have exited.

use std::path::{Path, PathBuf};

use crate::error::{Error, FileAction, Result};

/// Which cgroup interface the machine offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

/// The cgroups of one job.
#[derive(Debug)]
pub struct RankCgroups {
    version: Version,
    job: PathBuf,
    limit: u64,
}

fn io(action: FileAction, path: &Path, source: std::io::Error) -> Error {
    Error::io(action, path, source)
}

/// The directory of this process's memory cgroup, and the interface version.
fn own_memory_cgroup() -> Result<(Version, PathBuf)> {
    let table = Path::new("/proc/self/cgroup");
    let text = std::fs::read_to_string(table).map_err(|e| io(FileAction::Read, table, e))?;
    // v1: "4:memory:/a/b"; v2: "0::/a/b". A v1 memory line wins where both exist (hybrid).
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next(), parts.next());
        if let (Some(controllers), Some(path)) = (controllers, path)
            && controllers.split(',').any(|c| c == "memory")
        {
            let dir = Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'));
            return Ok((Version::V1, dir));
        }
    }
    for line in text.lines() {
        if let Some(path) = line.strip_prefix("0::") {
            let dir = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
            if dir.join("cgroup.controllers").is_file() {
                return Ok((Version::V2, dir));
            }
        }
    }
    Err(Error::InvalidLaunchOption {
        option: "--max-rank-memory",
        reason: "this machine has no memory cgroup this process can use".to_string(),
    })
}

fn write(path: &Path, value: &str) -> Result<()> {
    std::fs::write(path, value).map_err(|e| io(FileAction::Write, path, e))
}

impl RankCgroups {
    /// Creates the job's cgroup under this process's own, with a child per local rank, each
    /// limited to `limit` bytes.
    pub fn create(local_ranks: usize, limit: u64) -> Result<RankCgroups> {
        let (version, own) = own_memory_cgroup()?;
        let job = own.join(format!("hypershard-{}", std::process::id()));
        std::fs::create_dir(&job).map_err(|e| Error::InvalidLaunchOption {
            option: "--max-rank-memory",
            reason: format!(
                "cannot create the memory cgroup {} ({e}); the limit needs a writable cgroup",
                job.display()
            ),
        })?;
        let cgroups = RankCgroups {
            version,
            job,
            limit,
        };
        if version == Version::V2 {
            // Children of the job get the memory controller (v2 delegates it explicitly).
            cgroups.write_job("cgroup.subtree_control", "+memory")?;
        }
        for local_rank in 0..local_ranks {
            let dir = cgroups.rank_dir(local_rank);
            std::fs::create_dir(&dir).map_err(|e| io(FileAction::Write, &dir, e))?;
            match version {
                Version::V1 => {
                    write(&dir.join("memory.limit_in_bytes"), &limit.to_string())?;
                    let swap = dir.join("memory.memsw.limit_in_bytes");
                    if swap.exists() {
                        write(&swap, &limit.to_string())?;
                    }
                }
                Version::V2 => {
                    write(&dir.join("memory.max"), &limit.to_string())?;
                    let swap = dir.join("memory.swap.max");
                    if swap.exists() {
                        write(&swap, "0")?;
                    }
                }
            }
        }
        Ok(cgroups)
    }

    fn write_job(&self, file: &str, value: &str) -> Result<()> {
        write(&self.job.join(file), value)
    }

    fn rank_dir(&self, local_rank: usize) -> PathBuf {
        self.job.join(format!("rank{local_rank}"))
    }

    /// The limit, in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Moves process `pid` (a rank just spawned, before it allocates its model) into the
    /// cgroup of `local_rank`.
    pub fn add(&self, local_rank: usize, pid: u32) -> Result<()> {
        write(
            &self.rank_dir(local_rank).join("cgroup.procs"),
            &pid.to_string(),
        )
    }

    /// The most memory the cgroup of `local_rank` was charged (v1 keeps a high-water mark;
    /// v2 has `memory.peak` on recent kernels); `None` where the kernel does not say.
    pub fn peak_bytes(&self, local_rank: usize) -> Option<u64> {
        let file = match self.version {
            Version::V1 => "memory.max_usage_in_bytes",
            Version::V2 => "memory.peak",
        };
        let text = std::fs::read_to_string(self.rank_dir(local_rank).join(file)).ok()?;
        text.trim().parse().ok()
    }

    /// Whether the kernel refused the cgroup of `local_rank` memory at its limit: a failed
    /// charge (v1 `memory.failcnt`, or `memory.memsw.failcnt` when swap is accounted) or an
    /// OOM kill (`oom_kill` in v1's `memory.oom_control`, v2's `memory.events`).
    pub fn hit_limit(&self, local_rank: usize) -> bool {
        let dir = self.rank_dir(local_rank);
        let read = |file: &str| std::fs::read_to_string(dir.join(file)).unwrap_or_default();
        let positive = |text: &str| text.trim().parse::<u64>().is_ok_and(|n| n > 0);
        let oom_killed = |text: &str| {
            text.lines()
                .any(|line| line.strip_prefix("oom_kill ").is_some_and(positive))
        };
        match self.version {
            Version::V1 => {
                positive(&read("memory.failcnt"))
                    || positive(&read("memory.memsw.failcnt"))
                    || oom_killed(&read("memory.oom_control"))
            }
            Version::V2 => oom_killed(&read("memory.events")),
        }
    }
}

impl Drop for RankCgroups {
    /// Removes the job's cgroups; the ranks have exited by now. Never panics: a cgroup that
    /// cannot be removed (a rank still dying) is left for the system and logged.
    fn drop(&mut self) {
        let dirs = std::fs::read_dir(&self.job)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.is_dir())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        for dir in dirs.iter().chain(std::iter::once(&self.job)) {
            // A cgroup whose last process just exited can be busy for a moment.
            let mut removed = false;
            for _ in 0..50 {
                if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                    removed = true;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            if !removed {
                tracing::warn!(cgroup = %dir.display(), "could not remove a rank's memory cgroup");
            }
        }
    }
}

/// Parses a memory size: a byte count, or a number with a unit `KiB`, `MiB`, `GiB`, `TiB`
/// (powers of 1024) or `KB`, `MB`, `GB`, `TB` (powers of 1000), e.g. `1.25GiB`.
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 1.25GiB, 800MiB, 1000000000)"))?;
    let scale: f64 = match unit.trim() {
        "" | "B" => 1.0,
        "KiB" | "K" => 1024.0,
        "MiB" | "M" => 1024.0 * 1024.0,
        "GiB" | "G" => 1024.0 * 1024.0 * 1024.0,
        "TiB" | "T" => 1024.0f64.powi(4),
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?} (use KiB, MiB, GiB)"
            ));
        }
    };
    let bytes = value * scale;
    // Below 16 MiB no rank can even start; above 2^60 is a typo.
    if !bytes.is_finite() || bytes < (16u64 << 20) as f64 || bytes > (1u64 << 60) as f64 {
        return Err(format!(
            "{text:?} is outside 16 MiB ..= 1 EiB, the range a rank's memory limit can have"
        ));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units_and_bad_ones_say_why() {
        assert_eq!(parse_size("1.25GiB"), Ok(1_342_177_280));
        assert_eq!(parse_size("1280MiB"), Ok(1_342_177_280));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size("100000000"), Ok(100_000_000));
        for bad in [
            "",
            "GiB",
            "1.2.3GiB",
            "5XB",
            "1KiB",
            "nan",
            "inf",
            "99999999TiB",
        ] {
            let error = parse_size(bad).expect_err(bad);
            assert!(error.contains(bad) || bad.is_empty(), "{bad}: {error}");
        }
    }

    #[test]
    fn a_rank_over_its_limit_is_killed_and_the_cgroup_says_so() {
        // Needs a writable memory cgroup; where the machine has none, creating one is the
        // typed error users see, which is checked instead.
        let cgroups = match RankCgroups::create(1, 64 << 20) {
            Ok(cgroups) => cgroups,
            Err(error) => {
                assert!(error.to_string().contains("--max-rank-memory"), "{error}");
                return;
            }
        };
        let job = cgroups.job.clone();
        // A child that fills a 256 MiB buffer (dd reads into one block of `bs` bytes): over
        // the 64 MiB limit.
        let mut child = std::process::Command::new("dd")
            .args(["if=/dev/zero", "of=/dev/null", "bs=256M", "count=1"])
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("dd runs");
        cgroups.add(0, child.id()).expect("join the cgroup");
        let status = child.wait().expect("wait");
        assert!(
            !status.success(),
            "a 256 MiB child under a 64 MiB limit must not succeed"
        );
        assert!(cgroups.hit_limit(0), "the cgroup recorded the refusal");
        assert!(
            cgroups
                .peak_bytes(0)
                .is_none_or(|p| p <= (64 << 20) + (1 << 20))
        );
        drop(cgroups);
        assert!(!job.exists(), "the job's cgroups are removed");
    }
}
