//! The parts of `bench-nccl` (the NCCL busbw sweep on device buffers) that need no GPU: the
//! cells and sizes, the buffer lengths and ring depths of the plan, the NCCL-tests
//! bandwidth formulas, the rows that every source (ours, the torch.distributed peer,
//! nccl-tests) writes, the parser of nccl-tests' output, and the comparison. They are here,
//! in the library, so that their unit tests run on every machine; the binary
//! (`src/bin/bench-nccl.rs`, feature `nccl`) only adds the device.
//!
//! Conventions (those of nccl-tests, as `bench-collectives` uses them): `bytes` is the
//! buffer size of all-reduce and broadcast, the OUTPUT size of all-gather (each rank gives
//! `bytes / n`) and the INPUT size of reduce-scatter (each rank gets `bytes / n`).
//! `algbw = bytes / time` (GB/s, 10^9 bytes per second); `busbw = algbw × 2(n−1)/n` for
//! all-reduce, `× (n−1)/n` for all-gather and reduce-scatter, `× 1` for broadcast. At world 1
//! the all-reduce, all-gather and reduce-scatter factors are 0, so busbw is 0 for every
//! source, and the comparison uses the time (equivalently algbw), which is what the busbw
//! ratio reduces to at any world: the bytes and the factor are the same on both sides.

use std::collections::BTreeMap;

/// What went wrong in the sweep, with what was wrong named.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NcclBenchError {
    /// A bad command-line argument.
    #[error("bad arguments: {0}")]
    Usage(String),
    /// The collectives crate refused: `BackendUnavailable` (no libcuda, no libnccl, no
    /// device), or an op that failed.
    #[error("{context}: {source}")]
    Collectives {
        /// What was being done.
        context: String,
        /// The collectives crate's error.
        #[source]
        source: hypershard_collectives::Error,
    },
    /// A CUDA driver call made by the bench itself (device count, stream synchronisation).
    #[error("CUDA driver call {call} failed: {message}")]
    Driver {
        /// The call.
        call: &'static str,
        /// cudarc's message.
        message: String,
    },
    /// An op gave a wrong result in the closed-form check before the timing.
    #[error("correctness check of {op} ({dtype}) failed: {detail}")]
    WrongResult {
        /// The op.
        op: &'static str,
        /// The dtype.
        dtype: &'static str,
        /// The first wrong element.
        detail: String,
    },
    /// The rank processes failed (each failed rank named) or ran past their deadline.
    #[error("rank processes: {0}")]
    Ranks(String),
    /// A peer (torch.distributed or nccl-tests) could not run or gave output we cannot read.
    #[error("peer {peer}: {reason}")]
    Peer {
        /// `torch-nccl` or `nccl-tests`.
        peer: &'static str,
        /// What went wrong.
        reason: String,
    },
    /// Reading or writing a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// The result type of the sweep.
pub type Result<T> = std::result::Result<T, NcclBenchError>;

/// The collectives of the sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SweepOp {
    /// In place, sum.
    AllReduce,
    /// Out of place: `bytes / n` in, `bytes` out.
    AllGather,
    /// Out of place, sum: `bytes` in, `bytes / n` out.
    ReduceScatter,
    /// In place, root 0.
    Broadcast,
}

impl SweepOp {
    /// Every op, in the order of the sweep.
    pub const ALL: [SweepOp; 4] = [
        SweepOp::AllReduce,
        SweepOp::AllGather,
        SweepOp::ReduceScatter,
        SweepOp::Broadcast,
    ];

    /// The name in rows and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            SweepOp::AllReduce => "all_reduce",
            SweepOp::AllGather => "all_gather",
            SweepOp::ReduceScatter => "reduce_scatter",
            SweepOp::Broadcast => "broadcast",
        }
    }

    /// The op named `name`.
    pub fn parse(name: &str) -> Result<SweepOp> {
        SweepOp::ALL
            .into_iter()
            .find(|op| op.name() == name)
            .ok_or_else(|| {
                NcclBenchError::Usage(format!(
                    "unknown op `{name}` (all_reduce, all_gather, reduce_scatter, broadcast)"
                ))
            })
    }

    /// The nccl-tests factor from algbw to busbw at `world` ranks.
    pub fn busbw_factor(self, world: usize) -> f64 {
        let n = world as f64;
        match self {
            SweepOp::AllReduce => 2.0 * (n - 1.0) / n,
            SweepOp::AllGather | SweepOp::ReduceScatter => (n - 1.0) / n,
            SweepOp::Broadcast => 1.0,
        }
    }

    /// Whether the op runs in place (one buffer) in all three sources, which picks the
    /// nccl-tests column to compare with.
    pub fn in_place(self) -> bool {
        matches!(self, SweepOp::AllReduce | SweepOp::Broadcast)
    }

    /// The nccl-tests binary of the op.
    pub fn nccl_tests_binary(self) -> &'static str {
        match self {
            SweepOp::AllReduce => "all_reduce_perf",
            SweepOp::AllGather => "all_gather_perf",
            SweepOp::ReduceScatter => "reduce_scatter_perf",
            SweepOp::Broadcast => "broadcast_perf",
        }
    }
}

/// The element types of the sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SweepDType {
    /// 32-bit float.
    F32,
    /// bfloat16.
    BF16,
}

impl SweepDType {
    /// The name in rows and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            SweepDType::F32 => "f32",
            SweepDType::BF16 => "bf16",
        }
    }

    /// The dtype named `name`.
    pub fn parse(name: &str) -> Result<SweepDType> {
        match name {
            "f32" => Ok(SweepDType::F32),
            "bf16" => Ok(SweepDType::BF16),
            other => Err(NcclBenchError::Usage(format!(
                "unknown dtype `{other}` (f32, bf16)"
            ))),
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            SweepDType::F32 => 4,
            SweepDType::BF16 => 2,
        }
    }

    /// nccl-tests' `-d` value (and the type column of its output).
    pub fn nccl_tests_name(self) -> &'static str {
        match self {
            SweepDType::F32 => "float",
            SweepDType::BF16 => "bfloat16",
        }
    }

    /// The collectives crate's dtype.
    pub fn dtype(self) -> hypershard_collectives::DType {
        match self {
            SweepDType::F32 => hypershard_collectives::DType::F32,
            SweepDType::BF16 => hypershard_collectives::DType::BF16,
        }
    }
}

/// One series of the sweep: an op at a dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Series {
    /// The op.
    pub op: SweepOp,
    /// The element type.
    pub dtype: SweepDType,
}

impl Series {
    /// The default series: all-reduce in f32 and bf16, the other three ops in f32.
    pub fn defaults() -> Vec<Series> {
        let series = |op, dtype| Series { op, dtype };
        vec![
            series(SweepOp::AllReduce, SweepDType::F32),
            series(SweepOp::AllReduce, SweepDType::BF16),
            series(SweepOp::AllGather, SweepDType::F32),
            series(SweepOp::ReduceScatter, SweepDType::F32),
            series(SweepOp::Broadcast, SweepDType::F32),
        ]
    }

    /// `op:dtype`, e.g. `all_reduce:bf16`; a bare op means f32.
    pub fn parse(text: &str) -> Result<Series> {
        let (op, dtype) = text.split_once(':').unwrap_or((text, "f32"));
        Ok(Series {
            op: SweepOp::parse(op)?,
            dtype: SweepDType::parse(dtype)?,
        })
    }
}

/// The sizes from `min` to `max` bytes, doubling: 1 KiB … 256 MiB by default.
pub fn size_sweep(min: usize, max: usize) -> Result<Vec<usize>> {
    if min == 0 || min > max {
        return Err(NcclBenchError::Usage(format!(
            "the sizes must satisfy 0 < min <= max, got {min} and {max}"
        )));
    }
    let mut sizes = Vec::new();
    let mut size = min;
    while size <= max {
        sizes.push(size);
        size = match size.checked_mul(2) {
            Some(next) => next,
            None => break,
        };
    }
    Ok(sizes)
}

/// The largest bytes all the buffers of one cell's ring may take (each rank): 2 GiB.
pub const RING_BUDGET_BYTES: usize = 2 << 30;

/// One cell of the plan: what every source allocates and runs for one (series, size).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PlannedCell {
    /// The op's name.
    pub op: &'static str,
    /// The dtype's name.
    pub dtype: &'static str,
    /// The bytes the bandwidths count (nccl-tests' convention, rounded down to whole
    /// elements per rank).
    pub bytes: usize,
    /// Elements of the input buffer (the only buffer of an in-place op).
    pub input_len: usize,
    /// Elements of the output buffer (0 for an in-place op).
    pub output_len: usize,
    /// How many buffer sets rotate through one repetition (see [`ring_depth`]).
    pub depth: usize,
}

/// How many buffer sets rotate through a repetition of `iters` back-to-back ops of
/// `set_bytes` each: as many as fit in [`RING_BUDGET_BYTES`], at least 1 and at most `iters`.
///
/// Our communicator takes its buffers by value and hands them back when the op completes,
/// so one buffer cannot be queued twice; a ring of `depth` sets keeps `depth` ops queued on
/// the stream while the host waits for the oldest. The torch peer rotates the same sets, so
/// both sides touch the same memory (the L2 holds the whole ring at small sizes on both).
pub fn ring_depth(set_bytes: usize, iters: usize) -> usize {
    (RING_BUDGET_BYTES / set_bytes.max(1)).clamp(1, iters.max(1))
}

/// The plan of one cell: buffer lengths from the nominal size, and the ring depth.
pub fn plan_cell(series: Series, bytes: usize, world: usize, iters: usize) -> Result<PlannedCell> {
    let world = world.max(1);
    let es = series.dtype.size_bytes();
    let elements = bytes / es;
    let per_rank = elements / world;
    let (input_len, output_len, counted) = match series.op {
        SweepOp::AllReduce | SweepOp::Broadcast => (elements, 0, elements),
        SweepOp::AllGather => (per_rank, per_rank * world, per_rank * world),
        SweepOp::ReduceScatter => (per_rank * world, per_rank, per_rank * world),
    };
    if counted == 0 {
        return Err(NcclBenchError::Usage(format!(
            "{bytes} bytes of {} is less than one element per rank at world {world}",
            series.dtype.name()
        )));
    }
    let set_bytes = (input_len + output_len) * es;
    Ok(PlannedCell {
        op: series.op.name(),
        dtype: series.dtype.name(),
        bytes: counted * es,
        input_len,
        output_len,
        depth: ring_depth(set_bytes, iters),
    })
}

/// algbw and busbw in GB/s (10^9) of `bytes` moved by `op` at `world` ranks in `seconds`.
pub fn bandwidths(op: SweepOp, world: usize, bytes: usize, seconds: f64) -> (f64, f64) {
    let algbw = bytes as f64 / seconds / 1e9;
    (algbw, algbw * op.busbw_factor(world))
}

/// One measured cell of one source in one round.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SweepRow {
    /// `hypershard`, `torch-nccl` or `nccl-tests`.
    pub source: String,
    /// The round (1-based) of the interleaving.
    pub round: usize,
    /// The op's name.
    pub op: String,
    /// The dtype's name.
    pub dtype: String,
    /// The number of ranks.
    pub world: usize,
    /// The bytes counted (nccl-tests' convention).
    pub bytes: usize,
    /// Back-to-back ops per repetition.
    pub iters: usize,
    /// Timed repetitions (nccl-tests: 1).
    pub reps: usize,
    /// The median over repetitions of one op's time (a repetition's time over `iters`), µs.
    pub median_us: f64,
    /// The fastest repetition's time per op, µs.
    pub min_us: f64,
    /// algbw at the median, GB/s.
    pub algbw_gbps: f64,
    /// busbw at the median, GB/s.
    pub busbw_gbps: f64,
}

/// The median of `values` (`None` when empty); NaNs sort last.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    Some(if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    })
}

/// The row of one cell from the per-repetition times in seconds (each the slowest rank's
/// time for `iters` ops).
pub fn row_from_reps(
    source: &str,
    round: usize,
    series: Series,
    world: usize,
    cell: &PlannedCell,
    iters: usize,
    rep_seconds: &[f64],
) -> Option<SweepRow> {
    let per_op: Vec<f64> = rep_seconds.iter().map(|s| s / iters as f64).collect();
    let median_s = median(&per_op)?;
    let min_s = per_op.iter().copied().fold(f64::INFINITY, f64::min);
    let (algbw, busbw) = bandwidths(series.op, world, cell.bytes, median_s);
    Some(SweepRow {
        source: source.to_string(),
        round,
        op: series.op.name().to_string(),
        dtype: series.dtype.name().to_string(),
        world,
        bytes: cell.bytes,
        iters,
        reps: rep_seconds.len(),
        median_us: round_to(median_s * 1e6, 2),
        min_us: round_to(min_s * 1e6, 2),
        algbw_gbps: round_to(algbw, 4),
        busbw_gbps: round_to(busbw, 4),
    })
}

/// `value` rounded to `digits` decimals.
pub fn round_to(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// Reads the rows of one nccl-tests run (`all_reduce_perf` and its siblings) of `op` in
/// `dtype` at `world` ranks: every line that is not a comment and ends in the eight
/// columns `time algbw busbw #wrong` out of place, then in place. The in-place columns are
/// taken for all-reduce and broadcast, the out-of-place ones for all-gather and
/// reduce-scatter, as ours and torch's runs are. `#wrong` may be `N/A` (`-c 0`); a count
/// above 0 is an error: nccl-tests found wrong results.
pub fn parse_nccl_tests(
    text: &str,
    op: SweepOp,
    dtype: SweepDType,
    world: usize,
    round: usize,
    iters: usize,
) -> Result<Vec<SweepRow>> {
    let peer = |reason: String| NcclBenchError::Peer {
        peer: "nccl-tests",
        reason,
    };
    let mut rows = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let tokens: Vec<&str> = line.split_whitespace().collect();
        // size count type redop root, then the eight measured columns; older versions have
        // no root column, so the measured columns are found from the end.
        if tokens.len() < 11 {
            continue;
        }
        let Ok(bytes) = tokens[0].parse::<usize>() else {
            continue;
        };
        if tokens[1].parse::<usize>().is_err() || tokens[2] != dtype.nccl_tests_name() {
            continue;
        }
        let tail = &tokens[tokens.len() - 8..];
        let columns = if op.in_place() {
            &tail[4..]
        } else {
            &tail[..4]
        };
        let number = |i: usize| {
            columns[i].parse::<f64>().map_err(|_| {
                peer(format!(
                    "cannot read column {} of the line `{line}`",
                    ["time", "algbw", "busbw", "#wrong"][i]
                ))
            })
        };
        let (time_us, algbw, busbw) = (number(0)?, number(1)?, number(2)?);
        match columns[3] {
            "N/A" | "0" => {}
            wrong => {
                return Err(peer(format!(
                    "nccl-tests counted {wrong} wrong elements at {bytes} bytes"
                )));
            }
        }
        rows.push(SweepRow {
            source: "nccl-tests".to_string(),
            round,
            op: op.name().to_string(),
            dtype: dtype.name().to_string(),
            world,
            bytes,
            iters,
            reps: 1,
            median_us: time_us,
            min_us: time_us,
            algbw_gbps: algbw,
            busbw_gbps: busbw,
        });
    }
    Ok(rows)
}

/// The figures of one source for one cell, over the rounds.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Pooled {
    /// The median over rounds of the rounds' median time per op, µs.
    pub median_us: f64,
    /// busbw at that time, GB/s.
    pub busbw_gbps: f64,
    /// algbw at that time, GB/s.
    pub algbw_gbps: f64,
    /// How many rounds measured the cell.
    pub rounds: usize,
}

/// Which cell a row measures.
type CellKey = (String, String, usize, usize);

/// The figures per cell of one source, pooled over the rounds.
pub fn pool(rows: &[SweepRow], source: &str) -> BTreeMap<CellKey, Pooled> {
    let mut times: BTreeMap<CellKey, Vec<f64>> = BTreeMap::new();
    for row in rows.iter().filter(|r| r.source == source) {
        times
            .entry((row.op.clone(), row.dtype.clone(), row.world, row.bytes))
            .or_default()
            .push(row.median_us);
    }
    times
        .into_iter()
        .filter_map(|(key, us)| {
            let median_us = median(&us)?;
            let op = SweepOp::parse(&key.0).ok()?;
            let (algbw, busbw) = bandwidths(op, key.2, key.3, median_us * 1e-6);
            Some((
                key,
                Pooled {
                    median_us: round_to(median_us, 2),
                    busbw_gbps: round_to(busbw, 4),
                    algbw_gbps: round_to(algbw, 4),
                    rounds: us.len(),
                },
            ))
        })
        .collect()
}

/// Ours against one peer in one cell.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Comparison {
    /// The peer (`torch-nccl` or `nccl-tests`).
    pub peer: String,
    /// The op's name.
    pub op: String,
    /// The dtype's name.
    pub dtype: String,
    /// The number of ranks.
    pub world: usize,
    /// The bytes counted.
    pub bytes: usize,
    /// Our median time per op, µs.
    pub ours_us: f64,
    /// The peer's, µs.
    pub peer_us: f64,
    /// Our busbw, GB/s.
    pub ours_busbw_gbps: f64,
    /// The peer's busbw, GB/s.
    pub peer_busbw_gbps: f64,
    /// Our bandwidth over the peer's (busbw, or algbw where the busbw factor is 0: the same
    /// number, `peer_us / ours_us`, since both count the same bytes); above 1 is faster.
    pub ours_over_peer: f64,
}

/// Every cell both we and `peer` measured.
pub fn compare(rows: &[SweepRow], ours: &str, peer: &str) -> Vec<Comparison> {
    let mine = pool(rows, ours);
    let theirs = pool(rows, peer);
    mine.iter()
        .filter_map(|(key, us)| {
            let them = theirs.get(key)?;
            Some(Comparison {
                peer: peer.to_string(),
                op: key.0.clone(),
                dtype: key.1.clone(),
                world: key.2,
                bytes: key.3,
                ours_us: us.median_us,
                peer_us: them.median_us,
                ours_busbw_gbps: us.busbw_gbps,
                peer_busbw_gbps: them.busbw_gbps,
                ours_over_peer: round_to(them.median_us / us.median_us, 4),
            })
        })
        .collect()
}

/// The project's target: NCCL all-reduce busbw at 256 MiB within 10% of the peer's figure
/// for the same ranks.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Target {
    /// The cell: all-reduce, f32, [`TARGET_BYTES`].
    pub cell: String,
    /// The peer compared with: nccl-tests when it ran, else torch.distributed.
    pub peer: String,
    /// The comparison.
    pub comparison: Comparison,
    /// `ours_over_peer >= 0.9`.
    pub within_10_percent: bool,
    /// At world 1 the busbw factor is 0 and the ratio is of the times.
    pub note: String,
}

/// The size of the target cell: 256 MiB.
pub const TARGET_BYTES: usize = 256 << 20;

/// The target's figures, from nccl-tests when it measured the cell, else from torch.
pub fn target(comparisons: &[Comparison]) -> Option<Target> {
    let find = |peer: &str| {
        comparisons.iter().find(|c| {
            c.peer == peer && c.op == "all_reduce" && c.dtype == "f32" && c.bytes == TARGET_BYTES
        })
    };
    let comparison = find("nccl-tests").or_else(|| find("torch-nccl"))?.clone();
    let note = if comparison.world == 1 {
        "world 1: the all-reduce busbw factor 2(n-1)/n is 0, so the ratio is of the times \
         (algbw)"
            .to_string()
    } else {
        "busbw ratio".to_string()
    };
    Some(Target {
        cell: format!("all_reduce f32 {TARGET_BYTES} bytes"),
        peer: comparison.peer.clone(),
        within_10_percent: comparison.ours_over_peer >= 0.9,
        comparison,
        note,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busbw_factors_are_nccl_tests() {
        assert_eq!(SweepOp::AllReduce.busbw_factor(4), 1.5);
        assert_eq!(SweepOp::AllReduce.busbw_factor(1), 0.0);
        assert_eq!(SweepOp::AllGather.busbw_factor(8), 0.875);
        assert_eq!(SweepOp::ReduceScatter.busbw_factor(2), 0.5);
        assert_eq!(SweepOp::Broadcast.busbw_factor(3), 1.0);
        // 256 MiB in 1 ms at world 8: algbw 268.435456 GB/s, busbw × 1.75.
        let (algbw, busbw) = bandwidths(SweepOp::AllReduce, 8, 256 << 20, 1e-3);
        assert!((algbw - 268.435456).abs() < 1e-9);
        assert!((busbw - 268.435456 * 1.75).abs() < 1e-9);
    }

    #[test]
    fn sizes_double_from_1k_to_256m() {
        let sizes = size_sweep(1 << 10, 256 << 20).unwrap();
        assert_eq!(sizes.len(), 19);
        assert_eq!(sizes[0], 1024);
        assert_eq!(*sizes.last().unwrap(), 256 << 20);
        assert_eq!(size_sweep(3, 13).unwrap(), vec![3, 6, 12]);
        assert!(matches!(size_sweep(0, 4), Err(NcclBenchError::Usage(_))));
        assert!(matches!(size_sweep(8, 4), Err(NcclBenchError::Usage(_))));
    }

    #[test]
    fn names_parse_back_and_bad_names_are_usage_errors() {
        for op in SweepOp::ALL {
            assert_eq!(SweepOp::parse(op.name()).unwrap(), op);
        }
        assert_eq!(
            Series::parse("all_reduce:bf16").unwrap(),
            Series {
                op: SweepOp::AllReduce,
                dtype: SweepDType::BF16
            }
        );
        assert_eq!(Series::parse("broadcast").unwrap().dtype, SweepDType::F32);
        let err = Series::parse("all_reduce:f64").unwrap_err().to_string();
        assert!(err.contains("f64"), "{err}");
        let err = SweepOp::parse("alltoall").unwrap_err().to_string();
        assert!(err.contains("alltoall"), "{err}");
        assert_eq!(Series::defaults().len(), 5);
    }

    #[test]
    fn plans_count_whole_elements_per_rank_at_worlds_that_do_not_divide() {
        let ag = Series {
            op: SweepOp::AllGather,
            dtype: SweepDType::F32,
        };
        // 1 KiB of f32 = 256 elements; at world 3 each rank gives 85, the output is 255.
        let cell = plan_cell(ag, 1024, 3, 20).unwrap();
        assert_eq!(
            (cell.input_len, cell.output_len, cell.bytes),
            (85, 255, 1020)
        );
        let rs = Series {
            op: SweepOp::ReduceScatter,
            dtype: SweepDType::BF16,
        };
        let cell = plan_cell(rs, 1024, 3, 20).unwrap();
        assert_eq!(
            (cell.input_len, cell.output_len, cell.bytes),
            (510, 170, 1020)
        );
        let ar = Series {
            op: SweepOp::AllReduce,
            dtype: SweepDType::BF16,
        };
        let cell = plan_cell(ar, 256 << 20, 8, 20).unwrap();
        assert_eq!((cell.input_len, cell.output_len), (128 << 20, 0));
        // 2 GiB of ring over 256 MiB sets: 8 in flight.
        assert_eq!(cell.depth, 8);
        assert!(matches!(
            plan_cell(ag, 4, 2, 20),
            Err(NcclBenchError::Usage(_))
        ));
    }

    #[test]
    fn ring_depth_fits_the_budget_and_the_iterations() {
        assert_eq!(ring_depth(1024, 20), 20);
        assert_eq!(ring_depth(512 << 20, 20), 4);
        assert_eq!(ring_depth(4 << 30, 20), 1);
        assert_eq!(ring_depth(0, 0), 1);
    }

    #[test]
    fn rows_take_the_median_per_op() {
        let series = Series {
            op: SweepOp::AllReduce,
            dtype: SweepDType::F32,
        };
        let cell = plan_cell(series, 1 << 20, 2, 10).unwrap();
        // Three reps of 10 ops: 1 ms, 3 ms, 2 ms -> median 200 us per op, min 100 us.
        let row =
            row_from_reps("hypershard", 1, series, 2, &cell, 10, &[1e-3, 3e-3, 2e-3]).unwrap();
        assert_eq!(row.median_us, 200.0);
        assert_eq!(row.min_us, 100.0);
        let algbw = (1u64 << 20) as f64 / 200e-6 / 1e9;
        assert_eq!(row.algbw_gbps, round_to(algbw, 4));
        assert_eq!(row.busbw_gbps, round_to(algbw, 4));
        assert!(row_from_reps("x", 1, series, 2, &cell, 10, &[]).is_none());
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }

    const NCCL_TESTS_OUTPUT: &str = "\
# nThread 1 nGpus 2 minBytes 1024 maxBytes 268435456 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 0 graph: 0
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
        1024           256     float     sum      -1    18.53    0.06    0.06    N/A    18.12    0.06    0.06    N/A
   268435456      67108864     float     sum      -1   1180.2  227.45  227.45    N/A   1175.0  228.46  228.46    N/A
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 114.2
";

    #[test]
    fn nccl_tests_output_is_read_in_place_for_all_reduce() {
        let rows = parse_nccl_tests(
            NCCL_TESTS_OUTPUT,
            SweepOp::AllReduce,
            SweepDType::F32,
            2,
            1,
            20,
        )
        .unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].bytes, 268435456);
        assert_eq!(rows[1].median_us, 1175.0);
        assert_eq!(rows[1].busbw_gbps, 228.46);
        assert_eq!(rows[0].source, "nccl-tests");
        // The out-of-place columns for an out-of-place op; another dtype matches nothing.
        let rows = parse_nccl_tests(
            NCCL_TESTS_OUTPUT,
            SweepOp::AllGather,
            SweepDType::F32,
            2,
            1,
            20,
        )
        .unwrap();
        assert_eq!(rows[1].median_us, 1180.2);
        let none = parse_nccl_tests(
            NCCL_TESTS_OUTPUT,
            SweepOp::AllReduce,
            SweepDType::BF16,
            2,
            1,
            20,
        )
        .unwrap();
        assert!(none.is_empty());
        // No root column (older nccl-tests) still reads from the end.
        let old = "  4096  1024  float  sum  5.0  0.8  0.8  0  5.5  0.7  0.7  0\n";
        let rows = parse_nccl_tests(old, SweepOp::AllReduce, SweepDType::F32, 2, 1, 20).unwrap();
        assert_eq!(rows[0].median_us, 5.5);
        // Wrong results and unreadable numbers are errors.
        let wrong = "  4096  1024  float  sum  -1  5.0  0.8  0.8  3  5.5  0.7  0.7  3\n";
        let err = parse_nccl_tests(wrong, SweepOp::AllReduce, SweepDType::F32, 2, 1, 20)
            .unwrap_err()
            .to_string();
        assert!(err.contains("3 wrong"), "{err}");
        let bad = "  4096  1024  float  sum  -1  5.0  0.8  0.8  0  x.5  0.7  0.7  0\n";
        assert!(matches!(
            parse_nccl_tests(bad, SweepOp::AllReduce, SweepDType::F32, 2, 1, 20),
            Err(NcclBenchError::Peer { .. })
        ));
    }

    fn row(source: &str, round: usize, bytes: usize, median_us: f64) -> SweepRow {
        SweepRow {
            source: source.to_string(),
            round,
            op: "all_reduce".to_string(),
            dtype: "f32".to_string(),
            world: 2,
            bytes,
            iters: 20,
            reps: 5,
            median_us,
            min_us: median_us,
            algbw_gbps: 0.0,
            busbw_gbps: 0.0,
        }
    }

    #[test]
    fn comparisons_pool_rounds_and_the_target_prefers_nccl_tests() {
        let rows = vec![
            row("hypershard", 1, TARGET_BYTES, 1000.0),
            row("hypershard", 2, TARGET_BYTES, 1200.0),
            row("hypershard", 3, TARGET_BYTES, 1100.0),
            row("torch-nccl", 1, TARGET_BYTES, 990.0),
            row("torch-nccl", 2, TARGET_BYTES, 1010.0),
            row("hypershard", 1, 1024, 20.0),
            row("nccl-tests", 1, 1024, 10.0),
        ];
        let pooled = pool(&rows, "hypershard");
        let big = pooled[&("all_reduce".to_string(), "f32".to_string(), 2, TARGET_BYTES)];
        assert_eq!((big.median_us, big.rounds), (1100.0, 3));
        // busbw at world 2 = algbw × 1.
        let algbw = TARGET_BYTES as f64 / 1100e-6 / 1e9;
        assert_eq!(big.busbw_gbps, round_to(algbw, 4));
        let torch = compare(&rows, "hypershard", "torch-nccl");
        assert_eq!(torch.len(), 1);
        assert_eq!(torch[0].ours_over_peer, round_to(1000.0 / 1100.0, 4));
        let goal = target(&torch).unwrap();
        assert_eq!(goal.peer, "torch-nccl");
        assert!(goal.within_10_percent, "{goal:?}");
        // nccl-tests measured only 1 KiB, so the target falls back to torch; at 1 KiB we
        // are at half its speed.
        let tests = compare(&rows, "hypershard", "nccl-tests");
        assert_eq!(tests[0].ours_over_peer, 0.5);
        let both: Vec<Comparison> = torch.iter().chain(&tests).cloned().collect();
        assert_eq!(target(&both).unwrap().peer, "torch-nccl");
        // A slow 256 MiB cell misses the target.
        let slow = vec![
            row("hypershard", 1, TARGET_BYTES, 1200.0),
            row("nccl-tests", 1, TARGET_BYTES, 1000.0),
        ];
        let goal = target(&compare(&slow, "hypershard", "nccl-tests")).unwrap();
        assert_eq!(goal.peer, "nccl-tests");
        assert!(!goal.within_10_percent);
        assert!(target(&[]).is_none());
    }
}
