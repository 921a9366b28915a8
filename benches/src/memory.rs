//! The memory suite's figures: what `hypershard train` and PyTorch's `bench_gpt_fsdp2.py`
//! report about resident memory, reduced to one row per run (the maximum over ranks), and the
//! ratios the suite's targets are stated in.
//!
//! Every figure is resident memory as the kernel counts it: `VmHWM` (the process's peak
//! resident set) from `hypershard train`'s `summary.json`, `ru_maxrss` (the same quantity) from
//! the PyTorch script. "Idle" is each process's resident set before the model is built: code,
//! libraries and runtime, which differ a lot between a Rust binary and a python with torch, so
//! the comparison with PyTorch subtracts it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What can go wrong reading or running the memory suite.
#[derive(Debug, thiserror::Error)]
pub enum MemoryBenchError {
    /// A bad command line.
    #[error("{0}")]
    Usage(String),
    /// A memory size that does not parse (`1.25GiB`, `1280MiB`, a byte count).
    #[error("bad memory size `{text}`: {reason}")]
    Size {
        /// The text given.
        text: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A file could not be read or written, or a program could not be started.
    #[error("{path}: {source}")]
    Io {
        /// The file or program.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A `summary.json` that does not have the layout `hypershard train` writes.
    #[error("{path}: not a train summary: {source}")]
    Summary {
        /// The file.
        path: PathBuf,
        /// Why it does not parse.
        source: serde_json::Error,
    },
    /// The PyTorch script's JSON output is missing or malformed.
    #[error("{path}: no result line of bench_gpt_fsdp2.py: {reason}")]
    Torch {
        /// The file it was asked to write.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// The result type of this module.
pub type Result<T> = std::result::Result<T, MemoryBenchError>;

/// Wraps an I/O error with the file or program it concerns, for `map_err`.
pub fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> MemoryBenchError + '_ {
    move |source| MemoryBenchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

const MIB: f64 = 1024.0 * 1024.0;

/// Bytes in MiB, rounded to 0.1 MiB (the PyTorch script's resolution).
pub fn mib(bytes: u64) -> f64 {
    (bytes as f64 / MIB * 10.0).round() / 10.0
}

/// Parses a memory size as `hypershard train --max-rank-memory` takes it: a byte count, or a
/// number (decimals allowed) with a binary unit `KiB`, `MiB`, `GiB`, `TiB` (or `B`).
pub fn parse_size(text: &str) -> Result<u64> {
    let bad = |reason: &str| MemoryBenchError::Size {
        text: text.to_string(),
        reason: reason.to_string(),
    };
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let factor: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        _ => return Err(bad("the unit must be B, KiB, MiB, GiB or TiB")),
    };
    if number.is_empty() {
        return Err(bad("no number"));
    }
    let value: f64 = number.parse().map_err(|_| bad("not a number"))?;
    let bytes = (value * factor as f64).round();
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(bad("must be at least one byte"));
    }
    Ok(bytes as u64)
}

/// nanoGPT's model shape, as the `--model` JSON file gives it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptShape {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Context length.
    pub block_size: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Embedding width.
    pub n_embd: usize,
    /// Biases in the linear layers and layer norms.
    pub bias: bool,
    /// Dropout probability.
    pub dropout: f64,
}

impl GptShape {
    /// The parameters of nanoGPT's GPT of this shape, the output head tied to the token
    /// embedding (counted once).
    pub fn params(&self) -> u64 {
        let (v, t, c) = (
            self.vocab_size as u64,
            self.block_size as u64,
            self.n_embd as u64,
        );
        let b = u64::from(self.bias);
        // LayerNorm: weight (+ bias). Attention: c_attn C→3C, c_proj C→C. MLP: C→4C→C.
        let layer_norm = c + b * c;
        let block = 2 * layer_norm
            + (3 * c * c + b * 3 * c)
            + (c * c + b * c)
            + (4 * c * c + b * 4 * c)
            + (4 * c * c + b * c);
        v * c + t * c + self.n_layer as u64 * block + layer_norm
    }

    /// Bytes of the full fp32 training state: weights, gradients and AdamW's two moments.
    pub fn training_state_bytes(&self) -> u64 {
        16 * self.params()
    }
}

/// One rank's memory figures in `summary.json`, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub struct RankMemory {
    /// The rank.
    pub rank: usize,
    /// Parameters, gradients and AdamW moments of the rank's shards.
    pub state_bytes: u64,
    /// Peak bytes in FSDP's communication buffers.
    pub comm_buffer_bytes: u64,
    /// Activations and temporaries (tracker peak less state and buffers).
    pub activation_bytes: u64,
    /// Peak of all tensor storage the allocator tracker counted.
    pub tracker_peak_bytes: u64,
    /// `VmHWM` right after the model was built and sharded, before step 1.
    pub startup_peak_rss_bytes: u64,
    /// `VmHWM` at the end of the run.
    pub peak_rss_bytes: u64,
    /// `VmRSS` before the model was built.
    pub idle_rss_bytes: u64,
}

/// The parts of `hypershard train`'s `OUT/summary.json` the suite reads.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct TrainSummary {
    /// Optimizer steps run.
    pub steps_run: u64,
    /// Loss of the first step (`null` when it was not finite).
    pub first_loss: Option<f64>,
    /// Loss of the last step (`null` when it was not finite).
    pub last_loss: Option<f64>,
    /// Training throughput over the whole run.
    pub tokens_per_second: f64,
    /// Steady-state throughput (after the warm-up steps); absent from older summaries.
    #[serde(default)]
    pub steady_tokens_per_second: Option<f64>,
    /// Warm-up steps left out of the steady state; absent from older summaries.
    #[serde(default)]
    pub warmup_steps: Option<u64>,
    /// Ranks.
    pub world_size: usize,
    /// One entry per rank.
    pub memory: Vec<RankMemory>,
}

/// Reads `summary.json`.
pub fn read_summary(path: &Path) -> Result<TrainSummary> {
    let text = std::fs::read_to_string(path).map_err(|source| MemoryBenchError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| MemoryBenchError::Summary {
        path: path.to_path_buf(),
        source,
    })
}

/// The row `bench_gpt_fsdp2.py --json` appends (rank 0; every figure already the maximum over
/// ranks, in MiB).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct TorchRow {
    /// torch's version.
    pub torch: String,
    /// Processes.
    pub world: usize,
    /// Parameters of the model.
    pub params: u64,
    /// Throughput.
    pub tokens_per_s: f64,
    /// `ru_maxrss` after `import torch`, before the model is built.
    pub idle_rss_mib: f64,
    /// `ru_maxrss` after the model is built, sharded and initialised.
    pub init_peak_rss_mib: f64,
    /// `ru_maxrss` at the end.
    pub peak_rss_mib: f64,
}

/// Reads the last line of the script's `--json` file.
pub fn read_torch_row(path: &Path) -> Result<TorchRow> {
    let text = std::fs::read_to_string(path).map_err(|source| MemoryBenchError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let line = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .ok_or_else(|| MemoryBenchError::Torch {
            path: path.to_path_buf(),
            reason: "the file is empty".into(),
        })?;
    serde_json::from_str(line).map_err(|e| MemoryBenchError::Torch {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// Which library a run measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Library {
    /// `hypershard train`.
    Hypershard,
    /// PyTorch FSDP2 (`bench_gpt_fsdp2.py`).
    TorchFsdp2,
}

/// How the model was built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Init {
    /// Shapes only; each rank materialises its own shard (ours).
    Deferred,
    /// The whole model on every rank, then sharded (ours, `--eager-init`).
    Eager,
    /// Built on torch's meta device, sharded, then `to_empty` + init (PyTorch).
    Meta,
}

/// One run of the suite, reduced to the maximum over its ranks. Sizes in MiB.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryRun {
    /// What ran, for a person (`hypershard deferred +ckpt`, ...).
    pub case: String,
    /// Which library.
    pub library: Library,
    /// Ranks.
    pub world: usize,
    /// How the model was built.
    pub init: Init,
    /// Activation checkpointing on.
    pub activation_checkpointing: bool,
    /// `ok`, or what went wrong.
    pub status: String,
    /// Wall time of the whole run (start-up included).
    pub wall_s: f64,
    /// Resident set before the model was built.
    pub idle_rss_mib: Option<f64>,
    /// Peak resident set once the model was built and sharded, before step 1.
    pub startup_peak_rss_mib: Option<f64>,
    /// Peak resident set over the whole run.
    pub peak_rss_mib: Option<f64>,
    /// `peak_rss_mib - idle_rss_mib` (each the maximum over ranks, as the PyTorch script
    /// reports them).
    pub peak_minus_idle_mib: Option<f64>,
    /// Training state per rank (ours only).
    pub state_mib: Option<f64>,
    /// FSDP communication buffers at their peak (ours only).
    pub comm_buffer_mib: Option<f64>,
    /// Activations and temporaries (ours only).
    pub activation_mib: Option<f64>,
    /// The allocator tracker's peak (ours only).
    pub tracker_peak_mib: Option<f64>,
    /// Each rank's peak resident set, in rank order (ours only).
    pub per_rank_peak_rss_mib: Vec<f64>,
    /// Training throughput.
    pub tokens_per_second: Option<f64>,
}

impl MemoryRun {
    /// A run that produced no figures.
    pub fn failed(
        case: &str,
        library: Library,
        world: usize,
        init: Init,
        activation_checkpointing: bool,
        wall_s: f64,
        why: String,
    ) -> MemoryRun {
        MemoryRun {
            case: case.to_string(),
            library,
            world,
            init,
            activation_checkpointing,
            status: why,
            wall_s,
            idle_rss_mib: None,
            startup_peak_rss_mib: None,
            peak_rss_mib: None,
            peak_minus_idle_mib: None,
            state_mib: None,
            comm_buffer_mib: None,
            activation_mib: None,
            tracker_peak_mib: None,
            per_rank_peak_rss_mib: Vec::new(),
            tokens_per_second: None,
        }
    }

    /// Our run's row from its summary: each figure the maximum over the ranks.
    pub fn from_summary(
        case: &str,
        init: Init,
        activation_checkpointing: bool,
        wall_s: f64,
        summary: &TrainSummary,
    ) -> MemoryRun {
        let max = |f: fn(&RankMemory) -> u64| summary.memory.iter().map(f).max().map(mib);
        let peak = max(|m| m.peak_rss_bytes);
        let idle = max(|m| m.idle_rss_bytes);
        let mut ranks: Vec<&RankMemory> = summary.memory.iter().collect();
        ranks.sort_by_key(|m| m.rank);
        MemoryRun {
            case: case.to_string(),
            library: Library::Hypershard,
            world: summary.world_size,
            init,
            activation_checkpointing,
            status: "ok".into(),
            wall_s,
            idle_rss_mib: idle,
            startup_peak_rss_mib: max(|m| m.startup_peak_rss_bytes),
            peak_rss_mib: peak,
            peak_minus_idle_mib: peak.zip(idle).map(|(p, i)| round1(p - i)),
            state_mib: max(|m| m.state_bytes),
            comm_buffer_mib: max(|m| m.comm_buffer_bytes),
            activation_mib: max(|m| m.activation_bytes),
            tracker_peak_mib: max(|m| m.tracker_peak_bytes),
            per_rank_peak_rss_mib: ranks.iter().map(|m| mib(m.peak_rss_bytes)).collect(),
            tokens_per_second: Some(summary.tokens_per_second),
        }
    }

    /// PyTorch's run's row.
    pub fn from_torch(case: &str, wall_s: f64, row: &TorchRow) -> MemoryRun {
        MemoryRun {
            case: case.to_string(),
            library: Library::TorchFsdp2,
            world: row.world,
            init: Init::Meta,
            activation_checkpointing: false,
            status: "ok".into(),
            wall_s,
            idle_rss_mib: Some(row.idle_rss_mib),
            startup_peak_rss_mib: Some(row.init_peak_rss_mib),
            peak_rss_mib: Some(row.peak_rss_mib),
            peak_minus_idle_mib: Some(round1(row.peak_rss_mib - row.idle_rss_mib)),
            state_mib: None,
            comm_buffer_mib: None,
            activation_mib: None,
            tracker_peak_mib: None,
            per_rank_peak_rss_mib: Vec::new(),
            tokens_per_second: Some(row.tokens_per_s),
        }
    }
}

fn round1(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

/// One ratio a target is stated in.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Target {
    /// Short name (`startup_per_rank`, ...).
    pub name: String,
    /// What the ratio is, for a person.
    pub what: String,
    /// The numerator, MiB.
    pub numerator_mib: Option<f64>,
    /// The denominator, MiB.
    pub denominator_mib: Option<f64>,
    /// numerator / denominator.
    pub ratio: Option<f64>,
    /// The ratio must be at most this.
    pub at_most: f64,
    /// Whether it is; `None` when a run is missing or the runs are not the target's.
    pub met: Option<bool>,
}

fn find(
    runs: &[MemoryRun],
    library: Library,
    world: usize,
    init: Init,
    checkpointing: bool,
) -> Option<&MemoryRun> {
    runs.iter().find(|r| {
        r.library == library
            && r.world == world
            && r.init == init
            && r.activation_checkpointing == checkpointing
            && r.status == "ok"
    })
}

/// The suite's three ratios at `world` ranks against one rank. `judged`: whether the runs
/// are the ones the targets are stated for (the full run, not the quick smoke); otherwise
/// `met` stays `None`.
///
/// - start-up peak per rank, ours deferred: `world` ranks / 1 rank, at most 0.35;
/// - training peak per rank, ours deferred with activation checkpointing: `world` / 1, at
///   most 0.5;
/// - peak minus idle per rank at `world` ranks, ours deferred (no checkpointing, as PyTorch's
///   run) / PyTorch FSDP2 with meta-device init, at most 0.8.
pub fn targets(runs: &[MemoryRun], world: usize, judged: bool) -> Vec<Target> {
    let ours = |w, ckpt| find(runs, Library::Hypershard, w, Init::Deferred, ckpt);
    let torch = find(runs, Library::TorchFsdp2, world, Init::Meta, false);
    let ratio = |name: &str, what: String, num: Option<f64>, den: Option<f64>, at_most| {
        let ratio = num
            .zip(den)
            .filter(|(_, d)| *d > 0.0)
            .map(|(n, d)| (n / d * 1000.0).round() / 1000.0);
        Target {
            name: name.to_string(),
            what,
            numerator_mib: num,
            denominator_mib: den,
            ratio,
            at_most,
            met: ratio.filter(|_| judged).map(|r| r <= at_most),
        }
    };
    vec![
        ratio(
            "startup_per_rank",
            format!("ours deferred: start-up peak RSS per rank, {world} ranks / 1 rank"),
            ours(world, false).and_then(|r| r.startup_peak_rss_mib),
            ours(1, false).and_then(|r| r.startup_peak_rss_mib),
            0.35,
        ),
        ratio(
            "training_per_rank_ckpt",
            format!(
                "ours deferred, activation checkpointing: training peak RSS per rank, \
                 {world} ranks / 1 rank"
            ),
            ours(world, true).and_then(|r| r.peak_rss_mib),
            ours(1, true).and_then(|r| r.peak_rss_mib),
            0.5,
        ),
        ratio(
            "vs_torch_peak_minus_idle",
            format!(
                "peak RSS minus idle RSS per rank at {world} ranks, ours deferred / PyTorch \
                 FSDP2 meta-init"
            ),
            ours(world, false).and_then(|r| r.peak_minus_idle_mib),
            torch.and_then(|r| r.peak_minus_idle_mib),
            0.8,
        ),
    ]
}

/// The rank a launcher's error message names (`rank 3 ...`), if it names one. Prefers a line
/// that also mentions the memory limit or a kill.
pub fn rank_named_in(text: &str) -> Option<usize> {
    let rank_in = |line: &str| -> Option<usize> {
        let lower = line.to_ascii_lowercase();
        let mut rest = lower.as_str();
        while let Some(at) = rest.find("rank") {
            rest = &rest[at + 4..];
            let digits: String = rest
                .trim_start_matches([' ', '=', ':', '#'])
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            if let Ok(rank) = digits.parse() {
                return Some(rank);
            }
        }
        None
    };
    let about_memory = |line: &&str| {
        let lower = line.to_ascii_lowercase();
        ["memory", "killed", "limit", "oom"]
            .iter()
            .any(|w| lower.contains(w))
    };
    text.lines()
        .filter(about_memory)
        .find_map(rank_in)
        .or_else(|| text.lines().find_map(rank_in))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("1.25GiB").expect("size"), 1_342_177_280);
        assert_eq!(parse_size("1280MiB").expect("size"), 1_342_177_280);
        assert_eq!(parse_size("4096").expect("size"), 4096);
        assert_eq!(parse_size("2 KiB").expect("size"), 2048);
        for bad in ["", "GiB", "1.2.3GiB", "5GB", "0", "-1MiB"] {
            let err = parse_size(bad).expect_err(bad).to_string();
            assert!(err.contains(&format!("`{bad}`")), "{err}");
        }
    }

    #[test]
    fn parameter_counts_match_nanogpt() {
        let gpt2 = GptShape {
            vocab_size: 50_304,
            block_size: 1024,
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            bias: true,
            dropout: 0.0,
        };
        // nanoGPT's GPT-2 small: 124.44 M at vocab 50257 (wpe included), + 47 · 768 rows.
        assert_eq!(gpt2.params(), 124_439_808 + 47 * 768);
        let demo = GptShape {
            vocab_size: 50_304,
            block_size: 256,
            n_layer: 24,
            n_head: 16,
            n_embd: 1024,
            ..gpt2
        };
        // 24 · (12 C² + 13 C) + V C + T C + 2 C.
        let c = 1024u64;
        assert_eq!(
            demo.params(),
            24 * (12 * c * c + 13 * c) + 50_304 * c + 256 * c + 2 * c
        );
        assert_eq!(demo.training_state_bytes(), 16 * demo.params());
        let no_bias = GptShape {
            bias: false,
            ..demo
        };
        assert_eq!(no_bias.params(), 24 * (12 * c * c + 2 * c) + 50_560 * c + c);
    }

    fn rank(rank: usize, startup: u64, peak: u64, idle: u64) -> RankMemory {
        RankMemory {
            rank,
            state_bytes: 10 << 20,
            comm_buffer_bytes: 2 << 20,
            activation_bytes: 3 << 20,
            tracker_peak_bytes: 15 << 20,
            startup_peak_rss_bytes: startup << 20,
            peak_rss_bytes: peak << 20,
            idle_rss_bytes: idle << 20,
        }
    }

    fn summary(memory: Vec<RankMemory>) -> TrainSummary {
        TrainSummary {
            steps_run: 1,
            first_loss: Some(10.9),
            last_loss: Some(10.8),
            tokens_per_second: 100.0,
            steady_tokens_per_second: None,
            warmup_steps: None,
            world_size: memory.len(),
            memory,
        }
    }

    #[test]
    fn a_summary_reduces_to_the_maximum_over_ranks() {
        let text = r#"{"steps_run": 1, "first_loss": 10.9, "last_loss": 10.8,
            "tokens_per_second": 100.0, "world_size": 2, "eval_loss": null,
            "memory": [
             {"rank": 1, "state_bytes": 1, "comm_buffer_bytes": 2, "activation_bytes": 3,
              "tracker_peak_bytes": 4, "startup_peak_rss_bytes": 5242880,
              "peak_rss_bytes": 104857600, "idle_rss_bytes": 10485760},
             {"rank": 0, "state_bytes": 1, "comm_buffer_bytes": 2, "activation_bytes": 3,
              "tracker_peak_bytes": 4, "startup_peak_rss_bytes": 6291456,
              "peak_rss_bytes": 94371840, "idle_rss_bytes": 11534336}]}"#;
        let dir = std::env::temp_dir().join(format!("bench-memory-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("summary.json");
        std::fs::write(&path, text).expect("write");
        let parsed = read_summary(&path).expect("summary");
        let run = MemoryRun::from_summary("ours", Init::Deferred, false, 1.5, &parsed);
        assert_eq!(run.world, 2);
        assert_eq!(run.startup_peak_rss_mib, Some(6.0));
        assert_eq!(run.peak_rss_mib, Some(100.0));
        assert_eq!(run.idle_rss_mib, Some(11.0));
        assert_eq!(run.peak_minus_idle_mib, Some(89.0));
        assert_eq!(run.per_rank_peak_rss_mib, vec![90.0, 100.0]);
        // A summary without the per-rank start-up figure is refused, naming the file.
        std::fs::write(&path, text.replace("startup_peak_rss_bytes", "x")).expect("write");
        let err = read_summary(&path).expect_err("missing field").to_string();
        assert!(err.contains("summary.json") && err.contains("startup_peak_rss_bytes"));
        let torch = dir.join("torch.json");
        std::fs::write(&torch, "").expect("write");
        assert!(read_torch_row(&torch).is_err());
        std::fs::write(
            &torch,
            "{\"peer\": \"torch-fsdp2\", \"torch\": \"2.5.1\", \"world\": 4, \"params\": 7,\
             \"tokens_per_s\": 50.0, \"idle_rss_mib\": 400.0, \"init_peak_rss_mib\": 700.0,\
             \"peak_rss_mib\": 1400.5}\n",
        )
        .expect("write");
        let row = read_torch_row(&torch).expect("row");
        let run = MemoryRun::from_torch("torch", 2.0, &row);
        assert_eq!(run.peak_minus_idle_mib, Some(1000.5));
        assert_eq!(run.startup_peak_rss_mib, Some(700.0));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn targets_divide_the_right_runs() {
        let ours = |ckpt, ranks| {
            MemoryRun::from_summary("ours", Init::Deferred, ckpt, 1.0, &summary(ranks))
        };
        let one = vec![rank(0, 1000, 3000, 10)];
        let four = |startup, peak| (0..4).map(|r| rank(r, startup, peak, 10)).collect();
        let torch = MemoryRun::from_torch(
            "torch",
            1.0,
            &TorchRow {
                torch: "2".into(),
                world: 4,
                params: 1,
                tokens_per_s: 1.0,
                idle_rss_mib: 400.0,
                init_peak_rss_mib: 600.0,
                peak_rss_mib: 2410.0,
            },
        );
        let mut runs = vec![
            ours(false, one.clone()),
            ours(true, vec![rank(0, 1000, 2000, 10)]),
            ours(false, four(300, 1610)),
            ours(true, four(300, 1100)),
            torch,
        ];
        // An eager run at 4 ranks must not be taken for the deferred one.
        runs.insert(
            0,
            MemoryRun::from_summary("eager", Init::Eager, false, 1.0, &summary(four(900, 9000))),
        );
        let t = targets(&runs, 4, true);
        assert_eq!(t[0].ratio, Some(0.3));
        assert_eq!(t[0].met, Some(true));
        assert_eq!(t[1].ratio, Some(0.55));
        assert_eq!(t[1].met, Some(false));
        // (1610 - 10) / (2410 - 400).
        assert_eq!(t[2].ratio, Some(0.796));
        assert_eq!(t[2].met, Some(true));
        // Not judged: ratios, no verdicts. A failed run gives no ratio.
        assert!(targets(&runs, 4, false).iter().all(|t| t.met.is_none()));
        runs.retain(|r| r.library != Library::TorchFsdp2);
        runs.push(MemoryRun::failed(
            "torch",
            Library::TorchFsdp2,
            4,
            Init::Meta,
            false,
            1.0,
            "exit 1".into(),
        ));
        let t = targets(&runs, 4, true);
        assert_eq!((t[2].ratio, t[2].met), (None, None));
        assert_eq!(t[2].denominator_mib, None);
    }

    #[test]
    fn the_killed_rank_is_read_from_the_launcher_message() {
        let text = "step 0 ...\nerror: rank 0 lost its peer\nerror: rank 5 was killed: it went \
                    over --max-rank-memory 1.25 GiB\n";
        assert_eq!(rank_named_in(text), Some(5));
        assert_eq!(rank_named_in("error: worker rank=3 exited"), Some(3));
        assert_eq!(rank_named_in("ranks failed"), None);
    }
}
