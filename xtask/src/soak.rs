//! `cargo xtask soak [--minutes M] [--steps N] [--nproc P] [--mesh MESH] [--model MODEL]`:
//! trains once without faults (the reference), then, until `M` minutes have passed, runs the
//! same training with one rank killed (`HYPERSHARD_FAULT`, rotating over the backward, the
//! forward and a checkpoint save, over the ranks and over the steps) and resumes it until it
//! finishes. Each cycle's per-step losses are compared with the reference; the report counts
//! the restarts survived and the largest divergence, and is written to
//! `target/soak/soak.json`. Everything runs the release build of `hypershard`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The soak's knobs.
struct SoakOptions {
    minutes: f64,
    steps: u64,
    nproc: usize,
    mesh: String,
    model: String,
}

fn parse(args: &[String]) -> Result<SoakOptions, String> {
    let mut options = SoakOptions {
        minutes: 20.0,
        steps: 24,
        nproc: 4,
        mesh: "2x2".to_string(),
        model: "tiny".to_string(),
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("soak: {flag} needs a value"))?;
        let bad = |what: &str| format!("soak: {flag} {value:?} is not {what}");
        match flag.as_str() {
            "--minutes" => {
                options.minutes = value
                    .parse()
                    .ok()
                    .filter(|m: &f64| *m > 0.0)
                    .ok_or_else(|| bad("a positive number"))?
            }
            "--steps" => {
                options.steps = value
                    .parse()
                    .ok()
                    .filter(|s| *s >= 9)
                    .ok_or_else(|| bad("an integer of at least 9"))?
            }
            "--nproc" => {
                options.nproc = value
                    .parse()
                    .ok()
                    .filter(|n| *n >= 2)
                    .ok_or_else(|| bad("an integer of at least 2"))?
            }
            "--mesh" => options.mesh = value.clone(),
            "--model" => options.model = value.clone(),
            other => return Err(format!("soak: unknown flag {other}")),
        }
    }
    Ok(options)
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"))
}

/// Per-step losses of a run (the last record of a step wins: a resumed run appends).
fn losses(out: &Path) -> Result<BTreeMap<u64, f64>, String> {
    let path = out.join("losses.jsonl");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut by_step = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let record: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{}: {e}", path.display()))?;
        let step = record["step"].as_u64();
        let loss = record["loss"].as_f64();
        if let (Some(step), Some(loss)) = (step, loss) {
            by_step.insert(step, loss);
        }
    }
    Ok(by_step)
}

/// One training run: how it ended and how long it took.
struct RunOutcome {
    success: bool,
    elapsed: Duration,
}

fn train(
    bin: &Path,
    options: &SoakOptions,
    out: &Path,
    fault: Option<&str>,
    resume: bool,
) -> Result<RunOutcome, String> {
    let mut command = Command::new(bin);
    command
        .args(["train", "--model", &options.model, "--mesh", &options.mesh])
        .args(["--nproc", &options.nproc.to_string()])
        .args(["--batch-size", "2", "--warmup-steps", "2"])
        .args(["--steps", &options.steps.to_string()])
        .args(["--checkpoint-every", "3"])
        .arg("--out")
        .arg(out)
        .env("HYPERSHARD_TIMEOUT", "10")
        .env_remove("HYPERSHARD_FAULT")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if resume {
        command.arg("--resume");
    }
    if let Some(fault) = fault {
        command.env("HYPERSHARD_FAULT", fault);
    }
    let started = Instant::now();
    let status = command
        .status()
        .map_err(|e| format!("soak: cannot run {}: {e}", bin.display()))?;
    Ok(RunOutcome {
        success: status.success(),
        elapsed: started.elapsed(),
    })
}

/// The fault of cycle `i`: the point, the step and the rank rotate independently.
fn fault_of_cycle(i: u64, options: &SoakOptions) -> String {
    let points = ["backward", "forward", "checkpoint"];
    let point = points[(i % 3) as usize];
    let rank = (i / 3) as usize % options.nproc;
    // A step inside the run after the first checkpoint (step 3), so there is something to
    // resume from; for a checkpoint fault, a later checkpointed step (a multiple of 3).
    let span = options.steps - 5;
    let mut step = 4 + (i * 5) % span;
    if point == "checkpoint" {
        step = (step / 3).max(2) * 3;
    }
    format!("{point}@{step}:{rank}")
}

/// Runs the soak.
pub fn soak(args: &[String]) -> Result<(), String> {
    let options = parse(args)?;
    eprintln!("==> soak: cargo build --release -p hypershard");
    let status = Command::new(env!("CARGO"))
        .args(["build", "--release", "-p", "hypershard"])
        .status()
        .map_err(|e| format!("soak: cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("soak: the release build failed with {status}"));
    }
    let bin = target_dir().join("release").join("hypershard");
    let root = target_dir().join("soak");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
    let reference_dir = root.join("reference");
    let reference_run = train(&bin, &options, &reference_dir, None, false)?;
    if !reference_run.success {
        return Err("soak: the reference run failed".to_string());
    }
    let reference = losses(&reference_dir)?;
    eprintln!(
        "soak: reference run of {} steps took {:.1} s",
        options.steps,
        reference_run.elapsed.as_secs_f64()
    );
    let deadline = Instant::now() + Duration::from_secs_f64(options.minutes * 60.0);
    let mut cycles = Vec::new();
    let mut restarts_survived = 0u64;
    let mut worst_divergence = 0.0f64;
    let mut failures = Vec::new();
    let mut i = 0u64;
    while Instant::now() < deadline {
        let fault = fault_of_cycle(i, &options);
        let out = root.join(format!("cycle-{i:04}"));
        let faulty = train(&bin, &options, &out, Some(&fault), false)?;
        let mut resumes = 0;
        let mut finished = faulty.success;
        while !finished && resumes < 3 {
            resumes += 1;
            finished = train(&bin, &options, &out, None, true)?.success;
        }
        let divergence = if finished {
            let got = losses(&out)?;
            if got.len() != reference.len() {
                failures.push(format!("{fault}: {} steps logged", got.len()));
                f64::INFINITY
            } else {
                got.iter()
                    .zip(&reference)
                    .map(|((_, a), (_, b))| (a - b).abs())
                    .fold(0.0, f64::max)
            }
        } else {
            failures.push(format!("{fault}: did not finish after {resumes} resumes"));
            f64::INFINITY
        };
        if !faulty.success && finished {
            restarts_survived += 1;
        }
        if faulty.success {
            failures.push(format!("{fault}: the fault did not fire"));
        }
        worst_divergence = worst_divergence.max(divergence);
        eprintln!(
            "soak: cycle {i} {fault}: killed after {:.1} s, {resumes} resume(s), max |Δloss| {divergence:e}",
            faulty.elapsed.as_secs_f64()
        );
        cycles.push(serde_json::json!({
            "fault": fault,
            "fault_run_s": faulty.elapsed.as_secs_f64(),
            "resumes": resumes,
            "finished": finished,
            "max_abs_loss_diff": if divergence.is_finite() { serde_json::json!(divergence) } else { serde_json::Value::Null },
        }));
        // Only the newest cycle's directory is kept, so a long soak does not fill the disk.
        if i > 0 {
            let _ = std::fs::remove_dir_all(root.join(format!("cycle-{:04}", i - 1)));
        }
        i += 1;
    }
    let report = serde_json::json!({
        "minutes": options.minutes,
        "model": options.model,
        "mesh": options.mesh,
        "nproc": options.nproc,
        "steps": options.steps,
        "cycles": i,
        "restarts_survived": restarts_survived,
        "max_abs_loss_diff": if worst_divergence.is_finite() { serde_json::json!(worst_divergence) } else { serde_json::Value::Null },
        "failures": failures,
        "per_cycle": cycles,
    });
    let path = root.join("soak.json");
    std::fs::write(
        &path,
        serde_json::to_vec_pretty(&report).map_err(|e| e.to_string())?,
    )
    .map_err(|e| format!("{}: {e}", path.display()))?;
    println!(
        "soak: {i} cycles in {:.1} min, {restarts_survived} restarts survived, max |Δloss| vs the uninterrupted run {worst_divergence:e}, {} failures ({})",
        options.minutes,
        failures.len(),
        path.display()
    );
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("soak: {}", failures.join("; ")))
    }
}
