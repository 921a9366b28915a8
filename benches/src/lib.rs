//! Shared pieces of the hypershard benchmarks.
//!
//! Criterion micro-benchmarks live in `benches/benches/`; the comparison suites that
//! `cargo xtask bench <suite>` runs are the binaries in `src/bin/bench-<suite>.rs`. They share
//! the timing statistics and the JSON output location defined here, so every suite reports the
//! same way: a median over repetitions (these machines are noisy, and the median is robust to
//! a stray slow run) written under `target/bench/<suite>.json`.

use std::path::PathBuf;
use std::time::Duration;

pub mod memory;
pub mod nccl_sweep;
pub mod train;
pub mod train_history;
pub mod train_profile;
pub mod world;

/// Summary statistics of repeated timings.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TimingStats {
    /// Number of timed repetitions.
    pub reps: usize,
    /// Median, in seconds.
    pub median_s: f64,
    /// Fastest repetition, in seconds.
    pub min_s: f64,
    /// Slowest repetition, in seconds.
    pub max_s: f64,
}

impl TimingStats {
    /// Statistics of `samples`, or `None` when there are none.
    pub fn from_samples(samples: &[Duration]) -> Option<TimingStats> {
        if samples.is_empty() {
            return None;
        }
        let mut secs: Vec<f64> = samples.iter().map(Duration::as_secs_f64).collect();
        secs.sort_by(f64::total_cmp);
        let mid = secs.len() / 2;
        let median_s = if secs.len() % 2 == 1 {
            secs[mid]
        } else {
            (secs[mid - 1] + secs[mid]) / 2.0
        };
        Some(TimingStats {
            reps: secs.len(),
            median_s,
            min_s: secs[0],
            max_s: secs[secs.len() - 1],
        })
    }
}

/// Statistics of `f` over `reps` timed runs after 2 untimed ones (which fault in buffers and
/// fill caches), stopping at the first error.
pub fn time_runs(
    reps: usize,
    mut f: impl FnMut() -> Result<(), String>,
) -> Result<TimingStats, String> {
    for _ in 0..2 {
        f()?;
    }
    let mut samples: Vec<Duration> = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = std::time::Instant::now();
        f()?;
        samples.push(t0.elapsed());
    }
    TimingStats::from_samples(&samples).ok_or_else(|| "no samples".to_string())
}

/// The directory benchmark results go to: `$CARGO_TARGET_DIR/bench` or `target/bench` at the
/// workspace root, created if missing.
pub fn bench_output_dir() -> std::io::Result<PathBuf> {
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"),
    };
    let dir = target.join("bench");
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Writes `value` as pretty JSON to `target/bench/<suite>.json` and returns the path.
pub fn write_json<T: serde::Serialize>(suite: &str, value: &T) -> std::io::Result<PathBuf> {
    let path = bench_output_dir()?.join(format!("{suite}.json"));
    let text = serde_json::to_string_pretty(value).map_err(std::io::Error::other)?;
    std::fs::write(&path, text + "\n")?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        let ms = |v: &[u64]| {
            v.iter()
                .map(|&m| Duration::from_millis(m))
                .collect::<Vec<_>>()
        };
        let odd = TimingStats::from_samples(&ms(&[5, 1, 3])).expect("samples");
        assert_eq!(odd.reps, 3);
        assert!((odd.median_s - 0.003).abs() < 1e-12);
        assert!((odd.min_s - 0.001).abs() < 1e-12);
        assert!((odd.max_s - 0.005).abs() < 1e-12);
        let even = TimingStats::from_samples(&ms(&[4, 1, 3, 2])).expect("samples");
        assert!((even.median_s - 0.0025).abs() < 1e-12);
        assert!(TimingStats::from_samples(&[]).is_none());
    }
}
