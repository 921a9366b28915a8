//! Faults with real processes under `hypershard train` (which runs `hypershard launch`): a
//! rank SIGKILLed in the forward, one SIGKILLed in the backward, one SIGKILLed in the middle
//! of a checkpoint save, and one SIGSTOPped (a stall). Each time the job must end quickly with a non-zero exit naming the
//! rank, the last committed checkpoint must load, and `--resume` must reproduce the losses
//! of an uninterrupted run. The fault is armed with `HYPERSHARD_FAULT` (see
//! `hypershard::train::Fault`); op deadlines are a few seconds (`HYPERSHARD_TIMEOUT`).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{losses, recorded_steps};
use hypershard::checkpoint::Checkpoint;

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

/// Resumes `out` to the end and checks that the resumed run started at the newest
/// checkpoint's step (not from scratch: its records follow the interrupted run's in
/// `losses.jsonl`) and that every step's loss equals the uninterrupted run's.
fn resume_matches_straight(out: &Path) {
    let saved = Checkpoint::open(out).unwrap().step();
    let before = recorded_steps(out).len();
    let (output, _) = run(out, None, &["--resume"]);
    assert!(output.status.success(), "resume: {}", stderr(&output));
    let resumed = recorded_steps(out).split_off(before);
    assert_eq!(
        resumed,
        (saved..6).collect::<Vec<_>>(),
        "steps the resumed run trained"
    );
    assert_eq!(&losses(out), straight());
}

/// Checks the newest complete checkpoint is the one of `step` and that every tensor of it
/// reads (CRC32C verified).
fn newest_checkpoint_loads(out: &Path, step: u64) {
    let checkpoint = Checkpoint::open(out).unwrap();
    assert_eq!(checkpoint.step(), step);
    for name in checkpoint.metadata().tensors.keys() {
        checkpoint.read_tensor(name).unwrap();
    }
}

#[test]
fn a_rank_killed_in_the_forward_fails_the_job_fast_and_resume_matches() {
    let out = scratch("forward");
    // Rank 0 (the rank that writes the losses and commits checkpoints) dies before the
    // forward of step 3, while rank 1 is inside that forward's parameter all-gathers; the
    // checkpoint of step 2 was committed before.
    let (output, elapsed) = run(&out, Some("forward@3:0"), &[]);
    let text = stderr(&output);
    assert!(!output.status.success(), "{text}");
    assert!(
        text.contains("rank 0 kills itself at Forward of step 3"),
        "the fault must have fired where armed: {text}"
    );
    assert!(
        text.contains("rank 0 failed with signal 9"),
        "the launcher must name the dead rank: {text}"
    );
    // Rank 1 sees its peer's connections close at once (PeerLost) or is stopped by the
    // launcher; it never sits out the op deadline.
    assert!(
        !text.contains("timed out"),
        "a dead peer is noticed without waiting for the deadline: {text}"
    );
    assert!(
        elapsed < Duration::from_secs(60),
        "took {elapsed:?}: {text}"
    );
    // Steps 0..=2 finished before the kill; step 3 never did.
    let partial = losses(&out);
    assert_eq!(
        partial.keys().copied().collect::<Vec<_>>(),
        vec![0, 1, 2],
        "{partial:?}"
    );
    newest_checkpoint_loads(&out, 2);
    resume_matches_straight(&out);
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
    // With the stall watchdog off, the op deadline is what ends the wait (tests/stall.rs
    // covers the watchdog, which names the stopped rank long before).
    let (output, elapsed) = run(&out, Some("forward@1:1:stop"), &["--on-stall", "off"]);
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
