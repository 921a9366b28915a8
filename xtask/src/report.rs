//! `target/bench/report.md`: one markdown section per suite, a table made from the suite's
//! JSON (whatever columns it writes, so the suites may evolve without touching the report),
//! plus the comparisons with PyTorch: busbw ratios against gloo for the collectives, and the
//! ratios the nn and fsdp suites measured against torch in the same run, interleaved.

use std::fmt::Write as _;
use std::path::PathBuf;

use serde_json::Value;

use crate::results::{CellKey, CollectiveRow, GlooTable};

/// How one suite's run ended.
#[derive(Clone, Debug, PartialEq)]
pub enum SuiteStatus {
    /// The binary exited successfully after `seconds` of wall time.
    Ran {
        /// Wall time of the run, build excluded.
        seconds: f64,
    },
    /// The binary failed (or could not start); the reason is shown in the report.
    Failed {
        /// What went wrong.
        reason: String,
    },
    /// Not run in this invocation; the report shows the JSON of an earlier run if any.
    NotRun,
}

/// One suite's section of the report.
#[derive(Clone, Debug)]
pub struct SuiteSection {
    /// The suite name (`collectives`, `fusion`, ...).
    pub suite: String,
    /// How its run ended.
    pub status: SuiteStatus,
    /// Its JSON, when the file exists and parses.
    pub json: Option<Value>,
}

/// Everything the report is made from.
#[derive(Clone, Debug)]
pub struct ReportInput {
    /// A title line describing the invocation (`cargo xtask bench --quick`, ...).
    pub invocation: String,
    /// One section per suite, in order.
    pub sections: Vec<SuiteSection>,
    /// gloo's figures for the collectives comparison, if any.
    pub gloo: Option<GlooTable>,
    /// The SVG plots written, relative to the report's directory.
    pub plots: Vec<PathBuf>,
}

/// Formats a number the way a results table wants it: integers exactly, others with four
/// significant digits (at least one decimal).
pub fn format_number(value: f64) -> String {
    if !value.is_finite() {
        return "–".to_string();
    }
    if value == value.trunc() && value.abs() < 1e15 {
        return format!("{}", value as i64);
    }
    let magnitude = value.abs();
    let digits = (3 - magnitude.log10().floor() as i32).clamp(1, 12) as usize;
    format!("{value:.digits$}")
}

fn cell_text(value: &Value) -> String {
    match value {
        Value::Null => "–".to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.as_f64().map_or_else(|| n.to_string(), format_number),
        Value::String(s) => s.replace('|', "\\|"),
        Value::Array(items) => format!("[{} items]", items.len()),
        Value::Object(_) => "{…}".to_string(),
    }
}

/// Columns that identify a row, shown first in this order; the rest follow alphabetically.
const LEADING_COLUMNS: [&str; 13] = [
    "case",
    "mode",
    "transition",
    "op",
    "backend",
    "path",
    "threads",
    "world",
    "bytes",
    "params",
    "bucket_bytes",
    "zero_copy",
    "iters",
];

/// The columns and cells of a list of objects, nested objects flattened one level
/// (`gemm.median_s`).
fn flatten(rows: &[Value]) -> (Vec<String>, Vec<Vec<(String, String)>>) {
    let mut columns: Vec<String> = Vec::new();
    let mut flat_rows = Vec::new();
    for row in rows {
        let Value::Object(fields) = row else {
            continue;
        };
        let mut flat = Vec::new();
        for (key, value) in fields {
            match value {
                // Nested timing statistics keep their median and minimum: the maximum and
                // the repetition count would double the table's width for little.
                Value::Object(inner) => {
                    for (inner_key, inner_value) in inner {
                        if inner_key != "max_s" && inner_key != "reps" {
                            flat.push((format!("{key}.{inner_key}"), cell_text(inner_value)));
                        }
                    }
                }
                // A row's `label` (what a plot's bar says) repeats its other columns.
                _ if key == "label" => {}
                other => flat.push((key.clone(), cell_text(other))),
            }
        }
        for (key, _) in &flat {
            if !columns.contains(key) {
                columns.push(key.clone());
            }
        }
        flat_rows.push(flat);
    }
    // serde_json's maps are sorted by key; the columns that say what a row measures go first.
    columns.sort_by_key(|c| {
        LEADING_COLUMNS
            .iter()
            .position(|l| l == c)
            .unwrap_or(LEADING_COLUMNS.len())
    });
    (columns, flat_rows)
}

/// A markdown table of a list of JSON objects (the union of their fields as columns).
pub fn markdown_table(rows: &[Value]) -> String {
    let (columns, flat_rows) = flatten(rows);
    if columns.is_empty() {
        return String::new();
    }
    let mut out = format!("| {} |\n", columns.join(" | "));
    out += &format!("|{}\n", "---|".repeat(columns.len()));
    for row in flat_rows {
        let cells: Vec<String> = columns
            .iter()
            .map(|c| {
                row.iter()
                    .find(|(k, _)| k == c)
                    .map_or_else(|| "–".to_string(), |(_, v)| v.clone())
            })
            .collect();
        out += &format!("| {} |\n", cells.join(" | "));
    }
    out
}

fn is_object_list(value: &Value) -> bool {
    matches!(value, Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_object))
}

/// The tables of one suite's JSON: a list of objects is one table; an object gives its scalar
/// fields as a list and each list-of-objects field as a table of its own.
pub fn json_section(value: &Value) -> String {
    let mut out = String::new();
    match value {
        Value::Array(items) if is_object_list(value) => out += &markdown_table(items),
        Value::Object(fields) => {
            for (key, field) in fields {
                if !field.is_array() && !field.is_object() {
                    out += &format!("- {key}: {}\n", cell_text(field));
                }
            }
            for (key, field) in fields {
                if let Value::Array(items) = field
                    && is_object_list(field)
                {
                    out += &format!("\n`{key}`:\n\n{}", markdown_table(items));
                }
            }
        }
        other => out += &format!("{}\n", cell_text(other)),
    }
    out
}

fn human_bytes(bytes: usize) -> String {
    for (unit, factor) in [("GiB", 1usize << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        if bytes >= factor && bytes.is_multiple_of(factor) {
            return format!("{} {unit}", bytes / factor);
        }
    }
    format!("{bytes} B")
}

/// Our collectives against gloo, cell by cell: busbw ratio (ours / gloo, higher is better)
/// and latency ratio (ours / gloo, lower is better). Cells ≥ 1 MiB below gloo are listed,
/// since issue 8 asks for every one of them to be named.
pub fn collectives_vs_gloo(rows: &[CollectiveRow], gloo: &GlooTable) -> String {
    let mut out = format!("{}.\n\n", gloo.source.describe());
    out += "| world | op | size | backend | median us | busbw GB/s | gloo median us | gloo busbw GB/s | busbw ratio | latency ratio |\n";
    out += "|---|---|---|---|---|---|---|---|---|---|\n";
    let mut below = Vec::new();
    for row in rows {
        let key = CellKey {
            op: row.op.clone(),
            world: row.world,
            bytes: row.bytes,
        };
        let Some(peer) = gloo.cells.get(&key) else {
            continue;
        };
        let busbw_ratio = row.busbw_gbps / peer.busbw_gbps;
        let latency_ratio = row.median_us / peer.median_us;
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {}× | {}× |\n",
            row.world,
            row.op,
            human_bytes(row.bytes),
            row.backend,
            format_number(row.median_us),
            format_number(row.busbw_gbps),
            format_number(peer.median_us),
            format_number(peer.busbw_gbps),
            format_number(busbw_ratio),
            format_number(latency_ratio),
        );
        if row.bytes >= 1 << 20 && busbw_ratio < 1.0 {
            below.push(format!(
                "{} {} {} world {} ({}×)",
                row.backend,
                row.op,
                human_bytes(row.bytes),
                row.world,
                format_number(busbw_ratio)
            ));
        }
    }
    if below.is_empty() {
        out += "\nEvery compared cell ≥ 1 MiB is at or above gloo's busbw.\n";
    } else {
        out += &format!(
            "\nCells ≥ 1 MiB below gloo's busbw: {}.\n",
            below.join("; ")
        );
    }
    out
}

fn number_field(row: &Value, name: &str) -> Option<f64> {
    row.get(name).and_then(Value::as_f64)
}

/// nn's same-sitting ratios from its `summary` rows (ours / torch).
fn nn_ratios(value: &Value) -> String {
    let Some(Value::Array(summary)) = value.get("summary") else {
        return String::new();
    };
    let mut out = String::new();
    for row in summary {
        let threads = number_field(row, "threads").unwrap_or(f64::NAN);
        let pair =
            |ours: &str, theirs: &str| Some(number_field(row, ours)? / number_field(row, theirs)?);
        if let (Some(gemm), Some(step)) = (
            pair("rust_gemm_gflops_best", "torch_gemm_gflops_best"),
            pair("rust_step_s_best", "torch_step_s_best"),
        ) {
            out += &format!(
                "- {} thread(s): GEMM GFLOP/s ours/torch {}× (higher is better); GPT step time ours/torch {}× (lower is better), best rounds\n",
                format_number(threads),
                format_number(gemm),
                format_number(step)
            );
        }
    }
    if out.is_empty() {
        out += "- no torch figures in this run (run with `--compare-pytorch`)\n";
    }
    out
}

/// fsdp's same-sitting ratios (step time ours / torch, lower is better).
fn fsdp_ratios(value: &Value) -> String {
    let Value::Array(rows) = value else {
        return String::new();
    };
    let mut out = String::new();
    for row in rows {
        let (Some(mode), Some(ours), Some(torch)) = (
            row.get("mode").and_then(Value::as_str),
            number_field(row, "median_ms"),
            number_field(row, "torch_median_ms"),
        ) else {
            continue;
        };
        out += &format!(
            "- {mode}: {} ms vs PyTorch {} ms = {}× (lower is better)\n",
            format_number(ours),
            format_number(torch),
            format_number(ours / torch)
        );
    }
    if out.is_empty() {
        out += "- no torch figures in this run (run with `--compare-pytorch`)\n";
    }
    out
}

/// The memory suite's target ratios, each with its verdict.
fn memory_targets(value: &Value) -> String {
    let Some(Value::Array(targets)) = value.get("targets") else {
        return String::new();
    };
    let mut out = String::new();
    for t in targets {
        let name = t.get("name").and_then(Value::as_str).unwrap_or("?");
        let at_most = number_field(t, "at_most").map_or("?".into(), format_number);
        let verdict = match t.get("met").and_then(Value::as_bool) {
            Some(true) => "met",
            Some(false) => "NOT met",
            None => "not judged",
        };
        match number_field(t, "ratio") {
            Some(ratio) => {
                out += &format!(
                    "- {name}: {} (target at most {at_most}): {verdict}\n",
                    format_number(ratio)
                )
            }
            None => out += &format!("- {name}: not measured (target at most {at_most})\n"),
        }
    }
    out
}

/// The memory demonstration's outcome per run.
fn memory_demo_lines(value: &Value) -> String {
    let Some(Value::Array(runs)) = value.get("runs") else {
        return String::new();
    };
    let limit = value.get("limit").and_then(Value::as_str).unwrap_or("?");
    let mut out = String::new();
    for run in runs {
        let case = run.get("case").and_then(Value::as_str).unwrap_or("?");
        let outcome = if run.get("trained").and_then(Value::as_bool) == Some(true) {
            let peak = number_field(run, "max_peak_rss_mib").map_or("?".into(), format_number);
            format!("trained; max peak RSS per rank {peak} MiB (limit {limit})")
        } else {
            let rank = run
                .get("failed_rank")
                .and_then(Value::as_u64)
                .map_or("no rank named".into(), |r| format!("rank {r}"));
            format!("did not train ({rank}; limit {limit})")
        };
        let wall = number_field(run, "wall_s").map_or("?".into(), format_number);
        out += &format!("- {case}: {outcome}, {wall} s\n");
    }
    out
}

/// The whole report.
pub fn render(input: &ReportInput) -> String {
    let mut out = format!("# hypershard benchmarks\n\n{}\n\n", input.invocation);
    out += "| suite | status |\n|---|---|\n";
    for section in &input.sections {
        let status = match &section.status {
            SuiteStatus::Ran { seconds } => format!("ran in {seconds:.1} s"),
            SuiteStatus::Failed { reason } => format!("FAILED: {}", reason.replace('|', "\\|")),
            SuiteStatus::NotRun => "not run now (figures from an earlier run)".to_string(),
        };
        out += &format!("| {} | {status} |\n", section.suite);
    }
    if !input.plots.is_empty() {
        out += "\nPlots:\n\n";
        for plot in &input.plots {
            let _ = writeln!(out, "- ![{0}]({0})", plot.display());
        }
    }
    for section in &input.sections {
        out += &format!("\n## {}\n\n", section.suite);
        let Some(json) = &section.json else {
            out += "No results.\n";
            continue;
        };
        out += &json_section(json);
        match section.suite.as_str() {
            "collectives" => match (
                &input.gloo,
                serde_json::from_value::<Vec<CollectiveRow>>(json.clone()),
            ) {
                (Some(gloo), Ok(rows)) => {
                    out += "\n### against PyTorch gloo\n\n";
                    out += &collectives_vs_gloo(&rows, gloo);
                }
                (None, _) => out += "\nNo gloo figures to compare with.\n",
                (_, Err(e)) => {
                    out += &format!("\nThe rows do not have the collectives layout: {e}\n")
                }
            },
            "nn" => {
                out += &format!(
                    "\n### against PyTorch (interleaved runs)\n\n{}",
                    nn_ratios(json)
                )
            }
            "fsdp" => {
                out += &format!(
                    "\n### against PyTorch FSDP2 (interleaved runs)\n\n{}",
                    fsdp_ratios(json)
                )
            }
            "memory" => out += &format!("\n### targets\n\n{}", memory_targets(json)),
            "memory-demo" => out += &format!("\n### outcome\n\n{}", memory_demo_lines(json)),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::{GlooCell, GlooSource};
    use std::collections::BTreeMap;

    #[test]
    fn numbers_are_formatted_for_tables() {
        assert_eq!(format_number(42.0), "42");
        assert_eq!(format_number(123.456), "123.5");
        assert_eq!(format_number(1.23456), "1.235");
        assert_eq!(format_number(85.2), "85.20");
        assert_eq!(format_number(0.012346), "0.01235");
        assert_eq!(format_number(f64::NAN), "–");
    }

    #[test]
    fn tables_take_the_union_of_fields_and_flatten_one_level() {
        let rows: Vec<Value> = serde_json::from_str(
            r#"[{"mode":"fsdp","median_ms":12.5},
                {"mode":"single","gemm":{"median_s":0.5,"max_s":0.9,"reps":7},"note":"a|b"}]"#,
        )
        .expect("json");
        let table = markdown_table(&rows);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[0], "| mode | median_ms | gemm.median_s | note |");
        assert_eq!(lines[1], "|---|---|---|---|");
        assert_eq!(lines[2], "| fsdp | 12.50 | – | – |");
        assert_eq!(lines[3], "| single | – | 0.5000 | a\\|b |");
    }

    #[test]
    fn an_object_gives_scalars_and_its_lists_as_tables() {
        let value: Value = serde_json::from_str(
            r#"{"gemm_n":1024,"rounds":[[1]],"summary":[{"threads":1,"x":2.5}]}"#,
        )
        .expect("json");
        let text = json_section(&value);
        assert!(text.starts_with("- gemm_n: 1024\n"), "{text}");
        assert!(text.contains("`summary`:\n\n| threads | x |\n|---|---|\n| 1 | 2.500 |\n"));
        assert!(!text.contains("rounds"));
    }

    fn sample_gloo() -> GlooTable {
        let mut cells = BTreeMap::new();
        for (op, bytes, busbw) in [
            ("all_reduce", 1usize << 20, 1.0),
            ("all_gather", 1 << 20, 0.5),
        ] {
            cells.insert(
                CellKey {
                    op: op.into(),
                    world: 2,
                    bytes,
                },
                GlooCell {
                    median_us: 1000.0,
                    busbw_gbps: busbw,
                },
            );
        }
        GlooTable {
            source: GlooSource::ResultsMd(PathBuf::from("RESULTS.md")),
            cells,
        }
    }

    fn sample_rows() -> Vec<CollectiveRow> {
        vec![
            CollectiveRow {
                op: "all_reduce".into(),
                backend: "tcp".into(),
                world: 2,
                bytes: 1 << 20,
                median_us: 500.0,
                busbw_gbps: 2.0,
            },
            CollectiveRow {
                op: "all_gather".into(),
                backend: "tcp".into(),
                world: 2,
                bytes: 1 << 20,
                median_us: 2000.0,
                busbw_gbps: 0.25,
            },
            CollectiveRow {
                op: "broadcast".into(),
                backend: "tcp".into(),
                world: 2,
                bytes: 4096,
                median_us: 10.0,
                busbw_gbps: 0.4,
            },
        ]
    }

    #[test]
    fn gloo_comparison_gives_ratios_and_names_the_cells_below() {
        let text = collectives_vs_gloo(&sample_rows(), &sample_gloo());
        assert!(text.contains("NOT measured in this sitting"), "{text}");
        assert!(
            text.contains("| 2 | all_reduce | 1 MiB | tcp | 500 | 2 | 1000 | 1 | 2× | 0.5000× |"),
            "{text}"
        );
        assert!(
            text.contains(
                "| 2 | all_gather | 1 MiB | tcp | 2000 | 0.2500 | 1000 | 0.5000 | 0.5000× | 2× |"
            ),
            "{text}"
        );
        // The broadcast cell has no gloo counterpart and is left out.
        assert!(!text.contains("broadcast"), "{text}");
        assert!(
            text.contains("below gloo's busbw: tcp all_gather 1 MiB world 2 (0.5000×)"),
            "{text}"
        );
    }

    #[test]
    fn the_report_has_a_section_per_suite_with_status_and_ratios() {
        let collectives = serde_json::to_value(sample_rows()).expect("rows");
        let fsdp: Value = serde_json::from_str(
            r#"[{"mode":"fsdp","world":2,"median_ms":30.0,"torch_median_ms":120.0},
                {"mode":"single","world":1,"median_ms":20.0}]"#,
        )
        .expect("json");
        let input = ReportInput {
            invocation: "`cargo xtask bench --quick`".into(),
            sections: vec![
                SuiteSection {
                    suite: "collectives".into(),
                    status: SuiteStatus::Ran { seconds: 3.25 },
                    json: Some(collectives),
                },
                SuiteSection {
                    suite: "fsdp".into(),
                    status: SuiteStatus::Failed {
                        reason: "exit status 1".into(),
                    },
                    json: Some(fsdp),
                },
                SuiteSection {
                    suite: "fusion".into(),
                    status: SuiteStatus::NotRun,
                    json: None,
                },
            ],
            gloo: Some(sample_gloo()),
            plots: vec![PathBuf::from("plots/busbw.svg")],
        };
        let text = render(&input);
        assert!(
            text.contains("| collectives | ran in 3.2 s |")
                || text.contains("| collectives | ran in 3.3 s |"),
            "{text}"
        );
        assert!(text.contains("| fsdp | FAILED: exit status 1 |"));
        assert!(text.contains("| fusion | not run now"));
        assert!(text.contains("- ![plots/busbw.svg](plots/busbw.svg)"));
        assert!(text.contains("### against PyTorch gloo"));
        assert!(
            text.contains("- fsdp: 30 ms vs PyTorch 120 ms = 0.2500× (lower is better)"),
            "{text}"
        );
        assert!(text.contains("## fusion\n\nNo results.\n"));
    }

    #[test]
    fn the_memory_sections_give_verdicts_and_outcomes() {
        let memory: Value = serde_json::from_str(
            r#"{"mode":"full","runs":[{"case":"hypershard-deferred-w1","world":1}],
                "targets":[
                  {"name":"startup_per_rank","ratio":0.3,"at_most":0.35,"met":true},
                  {"name":"training_per_rank_ckpt","ratio":0.61,"at_most":0.5,"met":false},
                  {"name":"vs_torch_peak_minus_idle","ratio":null,"at_most":0.8,"met":null}]}"#,
        )
        .expect("json");
        let demo: Value = serde_json::from_str(
            r#"{"limit":"1.25GiB","runs":[
                {"case":"deferred","trained":true,"max_peak_rss_mib":1000.5,"wall_s":300.0},
                {"case":"eager","trained":false,"failed_rank":3,"wall_s":20.0}]}"#,
        )
        .expect("json");
        let section = |suite: &str, json| SuiteSection {
            suite: suite.into(),
            status: SuiteStatus::Ran { seconds: 1.0 },
            json: Some(json),
        };
        let text = render(&ReportInput {
            invocation: "`cargo xtask bench memory`".into(),
            sections: vec![section("memory", memory), section("memory-demo", demo)],
            gloo: None,
            plots: Vec::new(),
        });
        assert!(text.contains("- startup_per_rank: 0.3000 (target at most 0.3500): met\n"));
        assert!(text.contains("- training_per_rank_ckpt: 0.6100 (target at most 0.5000): NOT met"));
        assert!(text.contains("- vs_torch_peak_minus_idle: not measured (target at most 0.8000)"));
        assert!(
            text.contains(
                "- deferred: trained; max peak RSS per rank 1000.5 MiB (limit 1.25GiB), 300 s"
            ),
            "{text}"
        );
        assert!(text.contains("- eager: did not train (rank 3; limit 1.25GiB), 20 s"));
    }
}
