//! The `own_model` example (a user-defined module under `fully_shard`, see
//! docs/guide/own-model.md) launched at 4 ranks on a 2 x 2 HSDP mesh with bf16 compute and
//! gradient accumulation, against the same example's unsharded f32 run in one process: the
//! per-step losses agree within bf16 rounding, and the 4-rank checkpoint, loaded whole by the
//! one-process run, holds exactly the parameters the 4 ranks trained.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

#[path = "support/example.rs"]
#[allow(dead_code)] // this test builds its own example, not `allreduce`
mod example;

/// Optimizer steps the example runs (its `STEPS`).
const STEPS: usize = 8;

/// Relative tolerance on each step's loss. The launched run computes in bf16 (8 significant
/// bits: one rounding is off by at most 2^-9 ≈ 2e-3 relative) while the reference computes in
/// f32; the loss after a few rounded matmuls, LayerNorms and SGD steps drifts by about one
/// such rounding (1.1e-3 at most over the 8 steps on x86-64). 1e-2 allows five; a
/// sharding or accumulation error moves the loss by far more (dropping the first
/// micro-batch's gradient of every step moves step 1's loss by 4%).
const LOSS_TOL: f64 = 1e-2;

fn run(mut command: Command) -> Output {
    let output = command
        .env("HYPERSHARD_TIMEOUT", "30")
        .stdin(Stdio::null())
        .output()
        .expect("the command runs");
    assert!(
        output.status.success(),
        "{command:?} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// The `step N loss X` values of `stdout`, in step order (lines may carry a prefix).
fn losses(stdout: &str) -> Vec<f64> {
    let mut out = Vec::new();
    for line in stdout.lines() {
        let Some(at) = line.find("step ") else {
            continue;
        };
        let words: Vec<&str> = line[at..].split_whitespace().collect();
        if let ["step", step, "loss", value] = words[..] {
            assert_eq!(step.parse::<usize>().ok(), Some(out.len()), "{stdout}");
            out.push(value.parse::<f64>().expect("a loss is a number"));
        }
    }
    out
}

/// The word after `checksum` on the line containing `marker`.
fn checksum(stdout: &str, marker: &str) -> String {
    let line = stdout
        .lines()
        .find(|l| l.contains(marker))
        .unwrap_or_else(|| panic!("no line with {marker:?} in {stdout}"));
    line.split("checksum ")
        .nth(1)
        .unwrap_or_else(|| panic!("no checksum in {line:?}"))
        .trim()
        .to_string()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hypershard-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn hsdp_bf16_accumulation_matches_unsharded_and_its_checkpoint_reloads() {
    let hypershard = Path::new(env!("CARGO_BIN_EXE_hypershard"));
    let example = example::build_example(hypershard, "own_model");
    let out = scratch("own-model");

    let mut launch = Command::new(hypershard);
    launch
        .args(["launch", "--nproc-per-node", "4", "--"])
        .arg(&example)
        .arg("--out")
        .arg(&out);
    let sharded = run(launch);
    let sharded = String::from_utf8_lossy(&sharded.stdout).into_owned();

    let mut reference = Command::new(&example);
    reference.arg("--reference").arg("--load").arg(&out);
    let unsharded = run(reference);
    let unsharded = String::from_utf8_lossy(&unsharded.stdout).into_owned();
    let _ = std::fs::remove_dir_all(&out);

    let got = losses(&sharded);
    let want = losses(&unsharded);
    assert_eq!(got.len(), STEPS, "{sharded}");
    assert_eq!(want.len(), STEPS, "{unsharded}");
    let mut worst = 0.0f64;
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        let rel = (g - w).abs() / w.abs();
        assert!(
            rel <= LOSS_TOL,
            "step {step}: HSDP bf16 loss {g} vs unsharded f32 {w} (relative {rel:.2e})"
        );
        worst = worst.max(rel);
    }
    // Training happened, and in bf16: the loss falls, and not bit for bit as in f32.
    assert!(want[STEPS - 1] < 0.8 * want[0], "{unsharded}");
    assert!(got[STEPS - 1] < 0.8 * got[0], "{sharded}");
    assert!(
        worst > 1e-7,
        "bf16 losses equal the f32 ones: the policy did not apply"
    );

    // The checkpoint the 4 ranks saved and reloaded equal holds, loaded whole in one process,
    // exactly what they trained: the same f64 sum of every value.
    let saved = checksum(&sharded, "checkpoint saved by 4 ranks and reloaded equal");
    let loaded = checksum(&unsharded, "loaded");
    assert_eq!(saved, loaded, "{sharded}\n{unsharded}");
}
