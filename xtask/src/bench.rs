//! `cargo xtask bench [SUITE] [--quick] [--compare-pytorch] [--report-only] [ARGS...]`.
//!
//! Without a suite every suite runs, in the order of [`ALL_SUITES`]; with one, only it (and
//! `ARGS` go to its binary). `--quick` passes `--quick` to each binary: the CI smoke, tiny
//! sizes, no timing claims. `--compare-pytorch` runs the PyTorch peer in the same run, interleaved when
//! a python with torch is found (`HYPERSHARD_TORCH_PYTHON`, else `$TORCH_VENV/bin/python`,
//! else `~/.cache/hypershard-bench/torch-venv/bin/python`): `bench_gloo.py` interleaved with
//! the collectives world by world, and the torch sides the nn and fsdp binaries run themselves
//! right after theirs (without the flag they get `--no-torch`). `--report-only` runs nothing and
//! rebuilds the report and plots from the JSON already under `target/bench/`.
//!
//! Afterwards `target/bench/report.md` holds a section per suite (a table of its JSON, the
//! ratios against PyTorch) and `target/bench/plots/` the SVGs: busbw against message size per
//! op and world with gloo's curve on the same axes (this sitting's when `--compare-pytorch`
//! ran it, else the figures of the peer's RESULTS.md, labelled as such), FSDP step time by
//! mode, and the comm-fusion speedups.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde_json::Value;

use crate::plot::{BarChart, BarSeries, plot_bars, plot_busbw};
use crate::report::{ReportInput, SuiteSection, SuiteStatus, render};
use crate::results::{load_gloo, read_collectives, read_json};

/// Every suite `cargo xtask bench` runs without a suite name, in this order. `memory` is
/// among them because its `--quick` (the CI smoke) takes about a second once
/// `hypershard`'s release binary is built (which [`bench()`] does when the suite is planned);
/// its full run (minutes) and `--demo` run only when asked for.
pub const ALL_SUITES: [&str; 7] = [
    "collectives",
    "dtensor",
    "nn",
    "fsdp",
    "fusion",
    "memory",
    "train",
];

/// What the command line asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchArgs {
    /// The suites to run, in order.
    pub suites: Vec<String>,
    /// `--quick`: the CI smoke.
    pub quick: bool,
    /// `--compare-pytorch`: run the PyTorch peer in the same run, interleaved.
    pub compare_pytorch: bool,
    /// `--report-only`: rebuild report and plots from existing JSON, run nothing.
    pub report_only: bool,
    /// Arguments for the one suite's binary.
    pub passthrough: Vec<String>,
}

/// Parses the arguments after `bench`. `available` are the suites that have a binary.
pub fn parse_bench_args(args: &[String], available: &[String]) -> Result<BenchArgs, String> {
    let mut parsed = BenchArgs {
        suites: Vec::new(),
        quick: false,
        compare_pytorch: false,
        report_only: false,
        passthrough: Vec::new(),
    };
    let mut rest = args;
    if let Some(first) = args.first()
        && !first.starts_with("--")
    {
        if !available.contains(first) {
            return Err(format!(
                "unknown benchmark suite `{first}`; suites: {}",
                available.join(", ")
            ));
        }
        parsed.suites.push(first.clone());
        rest = &args[1..];
    }
    for arg in rest {
        match arg.as_str() {
            "--quick" => parsed.quick = true,
            "--compare-pytorch" => parsed.compare_pytorch = true,
            "--report-only" => parsed.report_only = true,
            _ => parsed.passthrough.push(arg.clone()),
        }
    }
    if parsed.suites.is_empty() {
        if let Some(arg) = parsed.passthrough.first() {
            return Err(format!(
                "`{arg}` is not a flag of `cargo xtask bench`; arguments for a binary need a suite: \
                 cargo xtask bench <suite> {arg} ..."
            ));
        }
        parsed.suites = ALL_SUITES
            .iter()
            .filter(|s| available.iter().any(|a| a == *s))
            .map(|s| s.to_string())
            .collect();
    }
    Ok(parsed)
}

/// What the suite binaries and scripts get to run PyTorch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TorchPython {
    /// The python interpreter with torch.
    pub python: PathBuf,
    /// A directory with `bin/python` that runs `python`: what the nn and fsdp binaries read
    /// from `TORCH_VENV`.
    pub venv: PathBuf,
}

/// One process of the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// A suite binary of `hypershard-benches`, run in release.
    Binary {
        /// `bench-<suite>`.
        bin: String,
        /// Its arguments.
        args: Vec<String>,
        /// `TORCH_VENV` for it, when it runs torch itself.
        torch_venv: Option<PathBuf>,
    },
    /// `bench_gloo.py` for one world size.
    Gloo {
        /// The script.
        script: PathBuf,
        /// Its arguments.
        args: Vec<String>,
        /// Where it writes its CSV.
        csv: PathBuf,
    },
}

/// The PyTorch peer's scripts: `HYPERSHARD_PYTORCH_BENCH_DIR`, else `../shared/bench/pytorch`
/// beside the workspace.
pub fn pytorch_dir() -> PathBuf {
    std::env::var_os("HYPERSHARD_PYTORCH_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared/bench/pytorch"))
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The world sizes the collectives suite runs at.
fn collective_worlds(quick: bool) -> Vec<usize> {
    if quick { vec![2] } else { vec![2, 4] }
}

/// The transports of the tcp backend the collectives suite compares (the plain socket path
/// and the shared-memory one for co-located ranks).
const TRANSPORTS: [&str; 2] = ["tcp", "shm"];

/// The processes one suite's run consists of, in order.
pub fn plan_suite(
    suite: &str,
    args: &BenchArgs,
    torch: Option<&TorchPython>,
    out_dir: &Path,
) -> Vec<Step> {
    let bin = format!("bench-{suite}");
    let mut base: Vec<String> = Vec::new();
    if args.quick {
        base.push("--quick".into());
    }
    match suite {
        "collectives" => {
            let mut steps = Vec::new();
            let gloo = |world: usize| {
                let csv = out_dir.join(format!("gloo-w{world}.csv"));
                let mut gloo_args = vec!["--world-sizes".to_string(), world.to_string()];
                if args.quick {
                    gloo_args.extend(
                        [
                            "--sizes",
                            "4K",
                            "64K",
                            "--warmup",
                            "1",
                            "--min-iters",
                            "1",
                            "--max-iters",
                            "2",
                            "--target-s",
                            "0.001",
                        ]
                        .map(String::from),
                    );
                }
                gloo_args.push("--csv".into());
                gloo_args.push(csv.display().to_string());
                Step::Gloo {
                    script: pytorch_dir().join("bench_gloo.py"),
                    args: gloo_args,
                    csv,
                }
            };
            if !args.passthrough.is_empty() {
                // The caller chose the cells; one run as asked, gloo at every world after it.
                let mut run_args = base;
                run_args.extend(args.passthrough.iter().cloned());
                steps.push(Step::Binary {
                    bin,
                    args: run_args,
                    torch_venv: None,
                });
                if torch.is_some() {
                    steps.extend(collective_worlds(args.quick).into_iter().map(gloo));
                }
                return steps;
            }
            // World by world: ours over tcp, gloo, ours over shared memory, so the two
            // libraries see the same machine load.
            for world in collective_worlds(args.quick) {
                for (i, transport) in TRANSPORTS.iter().enumerate() {
                    let mut run_args = base.clone();
                    run_args.extend([
                        "--world".to_string(),
                        world.to_string(),
                        "--transport".to_string(),
                        transport.to_string(),
                        "--json".to_string(),
                        out_dir
                            .join(format!("collectives-{transport}-w{world}.json"))
                            .display()
                            .to_string(),
                    ]);
                    steps.push(Step::Binary {
                        bin: bin.clone(),
                        args: run_args,
                        torch_venv: None,
                    });
                    if i == 0 && torch.is_some() {
                        steps.push(gloo(world));
                    }
                }
            }
            steps
        }
        "nn" | "fsdp" | "memory" | "train" => {
            let mut run_args = base;
            if torch.is_none() {
                run_args.push("--no-torch".into());
            }
            run_args.extend(args.passthrough.iter().cloned());
            vec![Step::Binary {
                bin,
                args: run_args,
                torch_venv: torch.map(|t| t.venv.clone()),
            }]
        }
        _ => {
            let mut run_args = base;
            run_args.extend(args.passthrough.iter().cloned());
            vec![Step::Binary {
                bin,
                args: run_args,
                torch_venv: None,
            }]
        }
    }
}

/// Where results go: `$CARGO_TARGET_DIR/bench`, else `target/bench` of the workspace (the
/// same rule as `hypershard_benches::bench_output_dir`).
pub fn output_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    target.join("bench")
}

/// Finds a python with torch, or says why not.
fn find_torch(out_dir: &Path) -> Result<TorchPython, String> {
    let (python, venv) = match std::env::var_os("HYPERSHARD_TORCH_PYTHON") {
        Some(python) => {
            let python = PathBuf::from(python);
            // The nn and fsdp binaries run `$TORCH_VENV/bin/python`: a one-line shim keeps the
            // interpreter's own path (and so its venv) intact.
            let shim = out_dir.join("torch-shim");
            let bin = shim.join("bin");
            std::fs::create_dir_all(&bin).map_err(|e| format!("{}: {e}", bin.display()))?;
            let script = format!("#!/bin/sh\nexec '{}' \"$@\"\n", python.display());
            let path = bin.join("python");
            std::fs::write(&path, script).map_err(|e| format!("{}: {e}", path.display()))?;
            make_executable(&path)?;
            (python, shim)
        }
        None => {
            let venv = std::env::var_os("TORCH_VENV")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME")
                        .map(|h| PathBuf::from(h).join(".cache/hypershard-bench/torch-venv"))
                })
                .ok_or("neither HYPERSHARD_TORCH_PYTHON, TORCH_VENV nor HOME is set")?;
            (venv.join("bin/python"), venv)
        }
    };
    let status = Command::new(&python)
        .args(["-c", "import torch"])
        .status()
        .map_err(|e| format!("{}: {e}", python.display()))?;
    if !status.success() {
        return Err(format!("{} cannot import torch", python.display()));
    }
    Ok(TorchPython { python, venv })
}

fn make_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn run_step(step: &Step, torch: Option<&TorchPython>) -> Result<(), String> {
    let mut command = match step {
        Step::Binary {
            bin,
            args,
            torch_venv,
        } => {
            eprintln!("==> {bin} {}", args.join(" "));
            let mut command = Command::new(env!("CARGO"));
            command.args([
                "run",
                "--release",
                "--quiet",
                "-p",
                "hypershard-benches",
                "--bin",
                bin,
                "--",
            ]);
            command.args(args);
            if let Some(venv) = torch_venv {
                command.env("TORCH_VENV", venv);
            }
            command
        }
        Step::Gloo { script, args, .. } => {
            let python = torch
                .map(|t| t.python.clone())
                .ok_or("gloo step without a torch python")?;
            eprintln!(
                "==> {} {} {}",
                python.display(),
                script.display(),
                args.join(" ")
            );
            let mut command = Command::new(python);
            command
                .arg(script)
                .args(args)
                .env("GLOO_SOCKET_IFNAME", "lo")
                .env("OMP_NUM_THREADS", "1");
            command
        }
    };
    let status = command
        .status()
        .map_err(|e| format!("could not start: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("exited with {status}"))
    }
}

/// Merges the per-world, per-transport collectives JSON into `collectives.json`, and the
/// per-world gloo CSVs into `gloo.csv`.
fn merge_collectives(out_dir: &Path, steps: &[Step]) -> Result<(), String> {
    let mut rows: Vec<Value> = Vec::new();
    let mut gloo = String::new();
    for step in steps {
        match step {
            Step::Binary { args, .. } => {
                let Some(json) = args
                    .iter()
                    .position(|a| a == "--json")
                    .and_then(|i| args.get(i + 1))
                else {
                    continue;
                };
                if let Ok(Value::Array(items)) = read_json(Path::new(json)) {
                    rows.extend(items);
                }
            }
            Step::Gloo { csv, .. } => {
                if let Ok(text) = std::fs::read_to_string(csv) {
                    let mut lines = text.lines();
                    let header = lines.next().unwrap_or_default();
                    if gloo.is_empty() {
                        gloo += header;
                        gloo += "\n";
                    }
                    for line in lines {
                        gloo += line;
                        gloo += "\n";
                    }
                }
            }
        }
    }
    if !rows.is_empty() {
        let path = out_dir.join("collectives.json");
        let text = serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?;
        std::fs::write(&path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if !gloo.is_empty() {
        let path = out_dir.join("gloo.csv");
        std::fs::write(&path, gloo).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// Writes every plot the results allow and returns their paths relative to `out_dir`.
pub fn write_plots(out_dir: &Path) -> Result<Vec<PathBuf>, String> {
    let plots_dir = out_dir.join("plots");
    std::fs::create_dir_all(&plots_dir).map_err(|e| format!("{}: {e}", plots_dir.display()))?;
    let mut written = Vec::new();
    let gloo = load_gloo(&out_dir.join("gloo.csv"), &pytorch_dir().join("RESULTS.md"));
    if let Ok(rows) = read_collectives(&out_dir.join("collectives.json")) {
        let mut cells: Vec<(String, usize)> =
            rows.iter().map(|r| (r.op.clone(), r.world)).collect();
        cells.sort();
        cells.dedup();
        for (op, world) in cells {
            let name = format!("busbw-{op}-w{world}.svg");
            if plot_busbw(&plots_dir.join(&name), &op, world, &rows, gloo.as_ref())? {
                written.push(PathBuf::from("plots").join(name));
            }
        }
    }
    if let Ok(Value::Array(rows)) = read_json(&out_dir.join("fsdp.json"))
        && let Some(chart) = fsdp_chart(&rows)
        && plot_bars(&plots_dir.join("fsdp-step.svg"), &chart)?
    {
        written.push(PathBuf::from("plots/fsdp-step.svg"));
    }
    if let Ok(value) = read_json(&out_dir.join("fusion.json"))
        && let Some(chart) = fusion_chart(&value)
        && plot_bars(&plots_dir.join("fusion-speedup.svg"), &chart)?
    {
        written.push(PathBuf::from("plots/fusion-speedup.svg"));
    }
    if let Ok(value) = read_json(&out_dir.join("train.json")) {
        for (name, chart) in train_charts(&value) {
            if plot_bars(&plots_dir.join(name), &chart)? {
                written.push(PathBuf::from("plots").join(name));
            }
        }
    }
    Ok(written)
}

/// The training suite's charts from `train.json`'s `cells`: steady-state tokens/s relative to
/// PyTorch FSDP2 per model and mesh (when PyTorch ran), and each library's fraction of the
/// machine's f32 FMA peak. The raw tokens/s span three orders of magnitude between the
/// presets, so the charts show ratios.
pub fn train_charts(value: &Value) -> Vec<(&'static str, BarChart)> {
    let Some(cells) = value.get("cells").and_then(Value::as_array) else {
        return Vec::new();
    };
    let label = |c: &Value| {
        let preset = c.get("preset").and_then(Value::as_str).unwrap_or("?");
        match c.get("mesh").and_then(Value::as_str).unwrap_or("?") {
            "1" => format!("{preset} 1 proc"),
            m if m.contains('x') => format!("{preset} HSDP {m}"),
            m => format!("{preset} FSDP {m}"),
        }
    };
    let field = |name: &str| -> Vec<Option<f64>> {
        cells
            .iter()
            .map(|c| c.get(name).and_then(Value::as_f64))
            .collect()
    };
    let categories: Vec<String> = cells.iter().map(label).collect();
    let mut charts = Vec::new();
    let ratio = field("ratio");
    if ratio.iter().any(Option::is_some) {
        charts.push((
            "train-ratio.svg",
            BarChart {
                title: "hypershard train / PyTorch FSDP2, steady-state tokens/s (higher is better)"
                    .into(),
                y_desc: "ratio ×".into(),
                categories: categories.clone(),
                series: vec![BarSeries {
                    label: "median of interleaved runs".into(),
                    values: ratio,
                }],
            },
        ));
    }
    let ours = field("ours_peak_fraction");
    let torch = field("torch_peak_fraction");
    if ours.iter().any(Option::is_some) {
        let percent = |v: Vec<Option<f64>>| v.into_iter().map(|f| f.map(|f| 100.0 * f)).collect();
        let mut series = vec![BarSeries {
            label: "hypershard".into(),
            values: percent(ours),
        }];
        if torch.iter().any(Option::is_some) {
            series.push(BarSeries {
                label: "PyTorch FSDP2 (interleaved runs)".into(),
                values: percent(torch),
            });
        }
        charts.push((
            "train-peak.svg",
            BarChart {
                title: "model FLOP/s as % of the measured f32 FMA peak".into(),
                y_desc: "% of peak".into(),
                categories,
                series,
            },
        ));
    }
    charts
}

/// FSDP step time by mode: the training-step rows of `fsdp.json` (those with a `mode` and a
/// `median_ms`, fusion rows excluded), ours and PyTorch's when it ran.
pub fn fsdp_chart(rows: &[Value]) -> Option<BarChart> {
    let steps: Vec<&Value> = rows
        .iter()
        .filter(|r| {
            r.get("mode")
                .and_then(Value::as_str)
                .is_some_and(|m| !m.starts_with("fusion"))
                && r.get("median_ms").and_then(Value::as_f64).is_some()
        })
        .collect();
    if steps.is_empty() {
        return None;
    }
    let label = |r: &Value| {
        let mode = r.get("mode").and_then(Value::as_str).unwrap_or("?");
        match r.get("world").and_then(Value::as_u64) {
            Some(world) => format!("{mode} (world {world})"),
            None => mode.to_string(),
        }
    };
    let field = |name: &'static str| -> Vec<Option<f64>> {
        steps
            .iter()
            .map(|r| r.get(name).and_then(Value::as_f64))
            .collect()
    };
    let torch = field("torch_median_ms");
    let mut series = vec![BarSeries {
        label: "hypershard".into(),
        values: field("median_ms"),
    }];
    if torch.iter().any(Option::is_some) {
        series.push(BarSeries {
            label: "PyTorch FSDP2 (interleaved runs)".into(),
            values: torch,
        });
    }
    Some(BarChart {
        title: "FSDP training step time by mode (median, lower is better)".into(),
        y_desc: "step time ms".into(),
        categories: steps.iter().map(|r| label(r)).collect(),
        series,
    })
}

/// The comm-fusion speedups: one bar per row of `fusion.json`'s `rows` that has a `label` and
/// a `speedup`.
pub fn fusion_chart(value: &Value) -> Option<BarChart> {
    let rows = value.get("rows")?.as_array()?;
    let bars: Vec<(String, f64)> = rows
        .iter()
        .filter_map(|r| {
            Some((
                r.get("label")?.as_str()?.to_string(),
                r.get("speedup")?.as_f64()?,
            ))
        })
        .collect();
    if bars.is_empty() {
        return None;
    }
    Some(BarChart {
        title: "comm fusion, world 2 tcp: per-parameter time / fused time".into(),
        y_desc: "speedup ×".into(),
        categories: bars.iter().map(|(l, _)| l.clone()).collect(),
        series: vec![BarSeries {
            label: "fused speedup".into(),
            values: bars.iter().map(|(_, s)| Some(*s)).collect(),
        }],
    })
}

/// Builds the report from whatever JSON is under `out_dir`.
pub fn write_report(
    out_dir: &Path,
    invocation: String,
    outcomes: &[(String, SuiteStatus)],
) -> Result<PathBuf, String> {
    let plots = write_plots(out_dir)?;
    let mut sections: Vec<SuiteSection> = Vec::new();
    let mut names: Vec<String> = ALL_SUITES.iter().map(|s| s.to_string()).collect();
    for (suite, _) in outcomes {
        if !names.contains(suite) {
            names.push(suite.clone());
        }
    }
    // The memory suite's `--demo` writes a file of its own; it gets a section when present.
    if out_dir.join("memory-demo.json").exists() {
        names.push("memory-demo".to_string());
    }
    for suite in names {
        let status = outcomes
            .iter()
            .find(|(s, _)| *s == suite)
            .map_or(SuiteStatus::NotRun, |(_, status)| status.clone());
        let json = read_json(&out_dir.join(format!("{suite}.json"))).ok();
        sections.push(SuiteSection {
            suite,
            status,
            json,
        });
    }
    let gloo = load_gloo(&out_dir.join("gloo.csv"), &pytorch_dir().join("RESULTS.md"));
    let text = render(&ReportInput {
        invocation,
        sections,
        gloo,
        plots,
    });
    let path = out_dir.join("report.md");
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

/// `cargo xtask bench ...`.
pub fn bench(raw: &[String], available: &[String]) -> Result<(), String> {
    let args = parse_bench_args(raw, available)?;
    let out_dir = output_dir();
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let invocation = format!("`cargo xtask bench {}`", raw.join(" "));
    if args.report_only {
        let path = write_report(&out_dir, invocation, &[])?;
        eprintln!("wrote {}", path.display());
        return Ok(());
    }
    let torch = if args.compare_pytorch {
        match find_torch(&out_dir) {
            Ok(torch) => {
                eprintln!("xtask bench: PyTorch from {}", torch.python.display());
                Some(torch)
            }
            Err(e) => {
                eprintln!("xtask bench: --compare-pytorch without PyTorch ({e}); ours only");
                None
            }
        }
    } else {
        None
    };
    // One release build of every suite first, so the timings below exclude compiling.
    let build = Command::new(env!("CARGO"))
        .args(["build", "--release", "-p", "hypershard-benches", "--bins"])
        .status()
        .map_err(|e| format!("could not start cargo: {e}"))?;
    if !build.success() {
        return Err(format!("building the benchmarks failed with {build}"));
    }
    if args.suites.iter().any(|s| s == "memory" || s == "train") {
        // The memory and train suites measure the `hypershard train` processes themselves.
        let build = Command::new(env!("CARGO"))
            .args([
                "build",
                "--release",
                "-p",
                "hypershard",
                "--bin",
                "hypershard",
            ])
            .status()
            .map_err(|e| format!("could not start cargo: {e}"))?;
        if !build.success() {
            return Err(format!("building hypershard failed with {build}"));
        }
    }
    let mut outcomes = Vec::new();
    for suite in &args.suites {
        let steps = plan_suite(suite, &args, torch.as_ref(), &out_dir);
        if suite == "collectives" && torch.is_none() {
            // A gloo CSV of an earlier sitting must not pass for this one's.
            let _ = std::fs::remove_file(out_dir.join("gloo.csv"));
        }
        let started = Instant::now();
        let mut failures = Vec::new();
        for step in &steps {
            if let Err(e) = run_step(step, torch.as_ref()) {
                let what = match step {
                    Step::Binary { bin, args, .. } => format!("{bin} {}", args.join(" ")),
                    Step::Gloo { .. } => "bench_gloo.py".to_string(),
                };
                eprintln!("xtask bench: {what}: {e}");
                failures.push(format!("{what}: {e}"));
            }
        }
        if suite == "collectives" {
            merge_collectives(&out_dir, &steps)?;
        }
        let seconds = started.elapsed().as_secs_f64();
        eprintln!("xtask bench: {suite} took {seconds:.1} s");
        let status = if failures.is_empty() {
            SuiteStatus::Ran { seconds }
        } else {
            SuiteStatus::Failed {
                reason: failures.join("; "),
            }
        };
        // `memory --demo` writes `memory-demo.json`, not `memory.json`: its outcome is that
        // section's.
        let section = if suite == "memory" && args.passthrough.iter().any(|a| a == "--demo") {
            "memory-demo".to_string()
        } else {
            suite.clone()
        };
        outcomes.push((section, status));
    }
    let path = write_report(&out_dir, invocation, &outcomes)?;
    eprintln!("wrote {}", path.display());
    let failed: Vec<&str> = outcomes
        .iter()
        .filter(|(_, s)| matches!(s, SuiteStatus::Failed { .. }))
        .map(|(suite, _)| suite.as_str())
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("failed suites: {}", failed.join(", ")))
    }
}

#[cfg(test)]
mod tests;
