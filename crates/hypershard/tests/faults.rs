//! Faults with real processes under `hypershard train` (which runs `hypershard launch`): a
//! rank SIGKILLed in the backward, one SIGKILLed in the middle of a checkpoint save, and one
//! SIGSTOPped (a stall). Each time the job must end quickly with a non-zero exit naming the
//! rank, the last committed checkpoint must load, and `--resume` must reproduce the losses
//! of an uninterrupted run. The fault is armed with `HYPERSHARD_FAULT` (see
//! `hypershard::train::Fault`); op deadlines are a few seconds (`HYPERSHARD_TIMEOUT`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use hypershard::checkpoint::Checkpoint;
use hypershard::train::read_losses;

/// The op deadline of the faulty runs, in seconds.
const TIMEOUT_S: u64 = 4;

fn hypershard() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hypershard"))
}

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hypershard-faults-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The run every test compares against: the tiny model, 2 FSDP ranks, 6 steps,
/// a checkpoint every 2 steps.
const COMMON: [&str; 14] = [
    "train",
    "--model",
    "tiny",
    "--nproc",
    "2",
    "--mesh",
    "2",
    "--batch-size",
    "2",
    "--steps",
    "6",
    "--warmup-steps",
    "2",
    "--checkpoint-every",
];

fn run(out: &Path, fault: Option<&str>, extra: &[&str]) -> (Output, Duration) {
    let mut command = Command::new(hypershard());
    command
        .args(COMMON)
        .arg("2")
        .arg("--out")
        .arg(out)
        .args(extra)
        .env("HYPERSHARD_TIMEOUT", TIMEOUT_S.to_string())
        .env_remove("HYPERSHARD_FAULT")
        .stdin(Stdio::null());
    if let Some(fault) = fault {
        command.env("HYPERSHARD_FAULT", fault);
    }
    let started = Instant::now();
    let output = command.output().expect("hypershard runs");
    (output, started.elapsed())
}

/// Losses by step (a resumed run appends to the interrupted run's file; the last record of
/// a step wins).
fn losses(out: &Path) -> BTreeMap<u64, f64> {
    read_losses(&out.join("losses.jsonl"))
        .unwrap()
        .into_iter()
        .map(|r| (r.step, r.loss))
        .collect()
}

/// The uninterrupted run, computed once and shared by the tests.
fn straight() -> &'static BTreeMap<u64, f64> {
    static STRAIGHT: OnceLock<BTreeMap<u64, f64>> = OnceLock::new();
    STRAIGHT.get_or_init(|| {
        let out = scratch("straight");
        let (output, _) = run(&out, None, &[]);
        assert!(output.status.success(), "{output:?}");
        let straight = losses(&out);
        assert_eq!(straight.len(), 6, "{straight:?}");
        straight
    })
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Resumes `out` to the end and checks every step's loss equals the uninterrupted run's.
fn resume_matches_straight(out: &Path) {
    let (output, _) = run(out, None, &["--resume"]);
    assert!(output.status.success(), "resume: {}", stderr(&output));
    assert_eq!(&losses(out), straight());
}

#[test]
fn a_rank_killed_in_the_backward_fails_the_job_fast_and_resume_matches() {
    let out = scratch("backward");
    let (output, elapsed) = run(&out, Some("backward@3:1"), &[]);
    let text = stderr(&output);
    assert!(!output.status.success(), "{text}");
    assert!(
        text.contains("rank 1 failed with signal 9"),
        "the launcher must name the dead rank: {text}"
    );
    assert!(
        elapsed < Duration::from_secs(60),
        "took {elapsed:?}: {text}"
    );
    // The checkpoint of step 2 is the newest complete one and loads.
    let checkpoint = Checkpoint::open(&out).unwrap();
    assert_eq!(checkpoint.step(), 2);
    for name in checkpoint.metadata().tensors.keys() {
        checkpoint.read_tensor(name).unwrap();
    }
    resume_matches_straight(&out);
}

#[test]
fn a_rank_killed_mid_checkpoint_leaves_the_previous_one_and_resume_matches() {
    let out = scratch("checkpoint");
    // Rank 0 dies after writing its shard of the step-4 checkpoint, before the commit.
    let (output, _) = run(&out, Some("checkpoint@4:0"), &[]);
    let text = stderr(&output);
    assert!(!output.status.success(), "{text}");
    assert!(text.contains("rank 0 failed with signal 9"), "{text}");
    let checkpoint = Checkpoint::open(&out).unwrap();
    assert_eq!(
        checkpoint.step(),
        2,
        "the half-written step 4 must not count"
    );
    for name in checkpoint.metadata().tensors.keys() {
        checkpoint.read_tensor(name).unwrap();
    }
    assert!(!out.join("checkpoints/step-00000004").exists());
    resume_matches_straight(&out);
}

#[test]
fn a_stalled_rank_is_a_timeout_naming_the_op_and_the_peer() {
    let out = scratch("stall");
    let (output, elapsed) = run(&out, Some("forward@1:1:stop"), &[]);
    let text = stderr(&output);
    assert!(!output.status.success(), "{text}");
    // Rank 0 waits in an op for the stopped rank 1 until its deadline, then fails with a
    // Timeout that names the op and the peer; the launcher then stops everyone (SIGKILL
    // reaches the stopped rank too) and names rank 0 as the rank that failed. (Rank 0 owns
    // the terminal under `train`, so its lines are not prefixed.)
    let timeout_line = text
        .lines()
        .find(|l| l.contains("timed out after"))
        .unwrap_or_else(|| panic!("no timeout from rank 0: {text}"));
    assert!(
        timeout_line.contains(&format!("timed out after {TIMEOUT_S}s waiting for rank 1")),
        "{timeout_line}"
    );
    assert!(
        timeout_line.contains("all_gather"),
        "the op: {timeout_line}"
    );
    assert!(text.contains("rank 0 failed"), "{text}");
    assert!(
        elapsed < Duration::from_secs(TIMEOUT_S + 45),
        "took {elapsed:?}: {text}"
    );
}
