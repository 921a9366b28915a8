//! The history of `cargo xtask bench train`: one plain row per figure in
//! `benches/results/train.json`, the layout every file there shares, so that the report
//! (`cargo xtask bench --report-only`) reads them all alike.

use std::path::PathBuf;

use crate::memory::{MemoryBenchError, Result, io_error};
use crate::train::{FmaPeak, TrainCell};

/// `benches/results/train.json`: the plain rows every file there holds (`what`, `peer`,
/// `world`, `size`, `value`, `unit`, `command`), this run's appended to the earlier ones.
pub fn append_history(
    fma_peak: Option<&FmaPeak>,
    cells: &[TrainCell],
    command: &str,
) -> Result<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results/train.json");
    let bad = |e: serde_json::Error| MemoryBenchError::Io {
        path: path.clone(),
        source: std::io::Error::other(format!("not a JSON list of result rows: {e}")),
    };
    let mut rows: Vec<serde_json::Value> = match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text).map_err(bad)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(io_error(&path)(e)),
    };
    let row = |what: String,
               peer: Option<&str>,
               world: Option<usize>,
               size: Option<String>,
               value: f64,
               unit: &str| {
        serde_json::json!({"what": what, "peer": peer, "world": world, "size": size,
                           "value": value, "unit": unit, "command": command})
    };
    if let Some(peak) = fma_peak {
        rows.push(row(
            format!(
                "f32 FMA peak per core ({}, 12 chains, all cores at once)",
                crate::train::fma_isa().unwrap_or("no FMA")
            ),
            None,
            None,
            None,
            peak.per_thread_gflops,
            "GFLOP/s",
        ));
    }
    for c in cells {
        let what = format!(
            "train steady-state {} mesh {} batch {}/rank, {} threads/rank",
            c.preset, c.mesh, c.batch_per_rank, c.threads_per_rank
        );
        let size = Some(c.preset.clone());
        let figures = [
            ("hypershard tokens/s", None, c.ours_tokens_per_s, "tokens/s"),
            (
                "PyTorch FSDP2 tokens/s",
                Some("torch"),
                c.torch_tokens_per_s,
                "tokens/s",
            ),
            (
                "ours / torch (median of pairs)",
                Some("torch"),
                c.ratio,
                "x",
            ),
            (
                "hypershard % of FMA peak",
                None,
                c.ours_peak_fraction.map(|f| 100.0 * f),
                "%",
            ),
            (
                "hypershard peak RSS per rank",
                None,
                c.ours_peak_rss_mib,
                "MiB",
            ),
            (
                "PyTorch peak RSS per rank",
                Some("torch"),
                c.torch_peak_rss_mib,
                "MiB",
            ),
        ];
        for (label, peer, value, unit) in figures {
            if let Some(value) = value {
                rows.push(row(
                    format!("{what}: {label}"),
                    peer,
                    Some(c.world),
                    size.clone(),
                    value,
                    unit,
                ));
            }
        }
    }
    let mut text = String::from("[\n");
    for (i, r) in rows.iter().enumerate() {
        text += &serde_json::to_string(r).map_err(bad)?;
        text += if i + 1 < rows.len() { ",\n" } else { "\n" };
    }
    text += "]\n";
    std::fs::write(&path, text).map_err(io_error(&path))?;
    Ok(path)
}
