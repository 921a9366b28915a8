//! Reading what the benchmark binaries and the PyTorch scripts wrote: the suites' JSON under
//! `target/bench/`, gloo's CSV from `bench_gloo.py --csv`, and, when no gloo run happened in
//! this sitting, the gloo table of the PyTorch peer's `RESULTS.md`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One row of `target/bench/collectives.json` (the layout of issue 3). Fields the report does
/// not need are ignored, so the suite may grow columns without breaking the report.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CollectiveRow {
    /// `all_reduce`, `all_gather`, `reduce_scatter` or `broadcast`.
    pub op: String,
    /// `tcp`, `tcp+shm`, `local`, ...
    pub backend: String,
    /// The number of ranks.
    pub world: usize,
    /// The message size in bytes (NCCL-tests convention).
    pub bytes: usize,
    /// The median time of one op, in microseconds.
    pub median_us: f64,
    /// The bus bandwidth, GB/s (10^9 bytes per second).
    pub busbw_gbps: f64,
}

/// Which measurement a gloo row is: op, world size and message size.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct CellKey {
    /// The op, in our naming (`all_gather`, not `all_gather_into_tensor`).
    pub op: String,
    /// The number of ranks.
    pub world: usize,
    /// The message size in bytes.
    pub bytes: usize,
}

/// gloo's figures for one cell.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GlooCell {
    /// The median time of one op, in microseconds.
    pub median_us: f64,
    /// The bus bandwidth, GB/s.
    pub busbw_gbps: f64,
}

/// Where the gloo figures came from, which the report and the plots must say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GlooSource {
    /// `bench_gloo.py` ran in this sitting, interleaved with our runs.
    SameSitting(PathBuf),
    /// The median of the runs recorded in the peer's `RESULTS.md` (an earlier sitting).
    ResultsMd(PathBuf),
}

impl GlooSource {
    /// The legend label of the gloo curve.
    pub fn label(&self) -> &'static str {
        match self {
            GlooSource::SameSitting(_) => "PyTorch gloo (interleaved runs)",
            GlooSource::ResultsMd(_) => "PyTorch gloo (RESULTS.md, earlier sitting)",
        }
    }

    /// A sentence for the report.
    pub fn describe(&self) -> String {
        match self {
            GlooSource::SameSitting(path) => format!(
                "gloo figures: `bench_gloo.py` run in this sitting, interleaved with ours ({})",
                path.display()
            ),
            GlooSource::ResultsMd(path) => format!(
                "gloo figures: NOT measured in this sitting; the median of the runs recorded in {} \
                 (run `cargo xtask bench --compare-pytorch` for a same-sitting comparison)",
                path.display()
            ),
        }
    }
}

/// gloo's figures with their origin.
#[derive(Clone, Debug)]
pub struct GlooTable {
    /// Where they came from.
    pub source: GlooSource,
    /// One entry per measured cell.
    pub cells: BTreeMap<CellKey, GlooCell>,
}

/// Reads `target/bench/collectives.json`.
pub fn read_collectives(path: &Path) -> Result<Vec<CollectiveRow>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Reads any suite's JSON as a generic value.
pub fn read_json(path: &Path) -> Result<serde_json::Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// gloo's op names in our naming.
fn our_op_name(op: &str) -> &str {
    match op {
        "all_gather_into_tensor" => "all_gather",
        "reduce_scatter_tensor" => "reduce_scatter",
        other => other,
    }
}

/// Parses the CSV that `bench_gloo.py --csv` writes (columns `world_size`, `op`, `bytes`,
/// `median_us`, `busbw_GBps`, in any order). Rows that do not parse are skipped: the script
/// writes empty cells for failed measurements.
pub fn parse_gloo_csv(text: &str) -> Result<BTreeMap<CellKey, GlooCell>, String> {
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    let column = |name: &str| {
        header
            .iter()
            .position(|h| h.trim() == name)
            .ok_or_else(|| format!("gloo CSV has no column `{name}`"))
    };
    let (op, world, bytes, median, busbw) = (
        column("op")?,
        column("world_size")?,
        column("bytes")?,
        column("median_us")?,
        column("busbw_GBps")?,
    );
    let mut cells = BTreeMap::new();
    for line in lines {
        // A repeated header (CSVs of several worlds concatenated) is skipped like any row
        // whose numbers do not parse.
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let field = |i: usize| fields.get(i).copied().unwrap_or_default();
        let (Ok(w), Ok(b), Ok(m), Ok(bw)) = (
            field(world).parse::<usize>(),
            field(bytes).parse::<usize>(),
            field(median).parse::<f64>(),
            field(busbw).parse::<f64>(),
        ) else {
            continue;
        };
        cells.insert(
            CellKey {
                op: our_op_name(field(op)).to_string(),
                world: w,
                bytes: b,
            },
            GlooCell {
                median_us: m,
                busbw_gbps: bw,
            },
        );
    }
    Ok(cells)
}

/// Reads a size as `RESULTS.md` writes it (`4 KiB`, `64 MiB`).
fn parse_human_size(text: &str) -> Option<usize> {
    let mut parts = text.split_whitespace();
    let value: f64 = parts.next()?.parse().ok()?;
    let factor = match parts.next().unwrap_or("B") {
        "B" => 1usize,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    Some((value * factor as f64) as usize)
}

/// The median of the `a / b / c` figures of one `RESULTS.md` cell.
fn median_of_runs(text: &str) -> Option<f64> {
    let mut values: Vec<f64> = text
        .split('/')
        .map(|v| v.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .ok()?;
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    })
}

/// Parses the gloo table of the peer's `RESULTS.md`: rows
/// `| world | op | size | median us (runs) | algbw (runs) | busbw (runs) |`, each figure the
/// median over the recorded runs.
pub fn parse_results_md(text: &str) -> BTreeMap<CellKey, GlooCell> {
    let mut cells = BTreeMap::new();
    for line in text.lines() {
        let columns: Vec<&str> = line.trim().trim_matches('|').split('|').collect();
        if columns.len() != 6 {
            continue;
        }
        let (Ok(world), Some(bytes), Some(median_us), Some(busbw_gbps)) = (
            columns[0].trim().parse::<usize>(),
            parse_human_size(columns[2].trim()),
            median_of_runs(columns[3]),
            median_of_runs(columns[5]),
        ) else {
            continue;
        };
        cells.insert(
            CellKey {
                op: our_op_name(columns[1].trim()).to_string(),
                world,
                bytes,
            },
            GlooCell {
                median_us,
                busbw_gbps,
            },
        );
    }
    cells
}

/// The gloo figures for the report: this sitting's CSV when there is one, else the peer's
/// `RESULTS.md`, else none.
pub fn load_gloo(same_sitting_csv: &Path, results_md: &Path) -> Option<GlooTable> {
    if let Ok(text) = std::fs::read_to_string(same_sitting_csv)
        && let Ok(cells) = parse_gloo_csv(&text)
        && !cells.is_empty()
    {
        return Some(GlooTable {
            source: GlooSource::SameSitting(same_sitting_csv.to_path_buf()),
            cells,
        });
    }
    let text = std::fs::read_to_string(results_md).ok()?;
    let cells = parse_results_md(&text);
    (!cells.is_empty()).then(|| GlooTable {
        source: GlooSource::ResultsMd(results_md.to_path_buf()),
        cells,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collective_rows_survive_a_json_round_trip_and_ignore_extra_fields() {
        let row = CollectiveRow {
            op: "all_gather".into(),
            backend: "tcp+shm".into(),
            world: 2,
            bytes: 1 << 20,
            median_us: 123.4,
            busbw_gbps: 4.25,
        };
        let text = serde_json::to_string(&vec![row.clone()]).expect("serialize");
        let back: Vec<CollectiveRow> = serde_json::from_str(&text).expect("deserialize");
        assert_eq!(back, vec![row]);
        // The suite writes more columns than the report needs.
        let wide = r#"[{"op":"broadcast","backend":"tcp","ranks_as":"processes","world":4,
            "bytes":4096,"iters":9,"median_us":50.0,"min_us":40.0,"algbw_gbps":0.08,
            "busbw_gbps":0.08}]"#;
        let rows: Vec<CollectiveRow> = serde_json::from_str(wide).expect("wide rows");
        assert_eq!(rows[0].world, 4);
        assert_eq!(rows[0].bytes, 4096);
        assert_eq!(rows[0].busbw_gbps, 0.08);
    }

    #[test]
    fn gloo_csv_maps_names_and_skips_bad_rows() {
        let csv = "tag,world_size,op,variant,bytes,size,iters,median_us,min_us,algbw_GBps,busbw_GBps\n\
                   r,2,all_gather,all_gather_into_tensor,4096,4 KiB,7,175.4,100.0,0.0233,0.0117\n\
                   r,2,reduce_scatter,reduce_scatter_tensor,65536,64 KiB,7,,,,\n\
                   tag,world_size,op,variant,bytes,size,iters,median_us,min_us,algbw_GBps,busbw_GBps\n\
                   r,4,broadcast,broadcast,1048576,1 MiB,7,1350.5,1000,0.7764,0.7764\n";
        let cells = parse_gloo_csv(csv).expect("csv");
        assert_eq!(cells.len(), 2);
        let key = CellKey {
            op: "all_gather".into(),
            world: 2,
            bytes: 4096,
        };
        assert_eq!(
            cells[&key],
            GlooCell {
                median_us: 175.4,
                busbw_gbps: 0.0117
            }
        );
        assert!(parse_gloo_csv("a,b\n1,2\n").is_err());
    }

    #[test]
    fn results_md_rows_give_the_median_of_the_runs() {
        let md = "| world | op (gloo call) | size | median us (run1 / run2 / run3) | algbw | busbw |\n\
                  |---|---|---|---|---|---|\n\
                  | 2 | all_reduce | 1 MiB | 734.2 / 2583.3 / 913.0 | 1.4 / 0.4 / 1.1 | 1.4281 / 0.4059 / 1.1485 |\n\
                  | 4 | reduce_scatter_tensor | 64 MiB | 1 / 3 | 0.1 / 0.3 | 0.2 / 0.4 |\n\
                  | mode | world | threads | batch | status | other |\n";
        let cells = parse_results_md(md);
        assert_eq!(cells.len(), 2);
        let all_reduce = cells[&CellKey {
            op: "all_reduce".into(),
            world: 2,
            bytes: 1 << 20,
        }];
        assert_eq!(all_reduce.median_us, 913.0);
        assert_eq!(all_reduce.busbw_gbps, 1.1485);
        let scatter = cells[&CellKey {
            op: "reduce_scatter".into(),
            world: 4,
            bytes: 64 << 20,
        }];
        assert_eq!(scatter.median_us, 2.0);
        assert!((scatter.busbw_gbps - 0.3).abs() < 1e-12);
    }
}
