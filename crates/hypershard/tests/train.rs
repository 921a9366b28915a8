//! `hypershard train`, `export` and `sample` as a user runs them (real processes over tcp):
//! 1 rank vs a 2×2 HSDP run of the same global batch, determinism, resume, bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use hypershard::train::read_losses;

fn hypershard() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hypershard"))
}

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hypershard-train-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(args: &[&str]) -> Output {
    Command::new(hypershard())
        .args(args)
        .env("HYPERSHARD_TIMEOUT", "60")
        // The transport is the command line's to choose here (`--transport`).
        .env_remove("HYPERSHARD_TRANSPORT")
        .stdin(Stdio::null())
        .output()
        .expect("hypershard runs")
}

/// Trains the tiny preset and returns its per-step losses.
fn train(out: &Path, extra: &[&str]) -> Vec<f64> {
    train_with_output(out, extra).0
}

/// [`train`], with what the run printed.
fn train_with_output(out: &Path, extra: &[&str]) -> (Vec<f64>, String) {
    let out_text = out.to_str().unwrap();
    let mut args = vec![
        "train",
        "--model",
        "tiny",
        "--out",
        out_text,
        "--warmup-steps",
        "2",
    ];
    args.extend_from_slice(extra);
    let output = run(&args);
    assert!(
        output.status.success(),
        "train {extra:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let losses = read_losses(&out.join("losses.jsonl"))
        .unwrap()
        .iter()
        .map(|r| r.loss)
        .collect();
    (losses, String::from_utf8_lossy(&output.stdout).into_owned())
}

fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-12))
        .fold(0.0, f64::max)
}

#[test]
fn one_rank_and_a_2x2_hsdp_run_of_the_same_global_batch_agree() {
    let dir = scratch("parity");
    // Global batch 8 windows: 1 rank × 8, or 4 ranks × 2 on a 2×2 mesh.
    let one = train(
        &dir.join("one"),
        &[
            "--nproc",
            "1",
            "--mesh",
            "1",
            "--batch-size",
            "8",
            "--steps",
            "6",
        ],
    );
    let (hsdp, printed) = train_with_output(
        &dir.join("hsdp"),
        &[
            "--nproc",
            "4",
            "--mesh",
            "2x2",
            "--batch-size",
            "2",
            "--steps",
            "6",
        ],
    );
    let (again, printed_again) = train_with_output(
        &dir.join("again"),
        &[
            "--nproc",
            "4",
            "--mesh",
            "2x2",
            "--batch-size",
            "2",
            "--steps",
            "6",
            "--transport",
            "tcp",
        ],
    );
    // And split the other way: 2 FSDP ranks × 2 accumulated micro-steps × 2 windows.
    let accumulated = train(
        &dir.join("accum"),
        &[
            "--nproc",
            "2",
            "--mesh",
            "2",
            "--batch-size",
            "2",
            "--grad-accum",
            "2",
            "--steps",
            "6",
        ],
    );
    assert_eq!(one.len(), 6);
    assert!(max_rel_diff(&hsdp, &one) < 1e-4, "{hsdp:?} vs {one:?}");
    assert!(
        max_rel_diff(&accumulated, &one) < 1e-4,
        "{accumulated:?} vs {one:?}"
    );
    // Same seed, data and mesh: the same losses, run to run, whichever transport carries the
    // collectives: shared memory by default on one node, TCP when asked.
    assert!(
        printed.contains("collectives over shared memory (3 of 3 peers)"),
        "{printed}"
    );
    assert!(
        printed_again.contains("collectives over TCP"),
        "{printed_again}"
    );
    assert_eq!(hsdp, again);
    // And the loss falls.
    assert!(one[5] < one[0], "{one:?}");
    assert!(dir.join("hsdp/loss.svg").exists());
    let ckpt = dir.join("hsdp/checkpoints/step-00000006");
    for rank in 0..4 {
        assert!(ckpt.join(format!("rank-{rank:05}.safetensors")).exists());
    }
}

#[test]
fn resume_continues_exactly() {
    let dir = scratch("resume");
    let common = ["--nproc", "4", "--mesh", "2x2", "--batch-size", "2"];
    let straight = train(
        &dir.join("straight"),
        &[&common[..], &["--steps", "8"]].concat(),
    );
    let split = dir.join("split");
    train(
        &split,
        &[&common[..], &["--steps", "4", "--lr-decay-steps", "8"]].concat(),
    );
    let resumed = train(
        &split,
        &[&common[..], &["--steps", "8", "--resume"]].concat(),
    );
    // The same layout: the same arithmetic, so the same losses.
    assert_eq!(resumed, straight);
    // Resharded: the 2x2 checkpoint at step 4 resumed as plain FSDP on 2 ranks (same global
    // batch: 2 ranks × 4).
    let other = dir.join("other");
    train(
        &other,
        &[&common[..], &["--steps", "4", "--lr-decay-steps", "8"]].concat(),
    );
    let resharded = train(
        &other,
        &[
            "--nproc",
            "2",
            "--mesh",
            "2",
            "--batch-size",
            "4",
            "--steps",
            "8",
            "--resume",
        ],
    );
    assert!(
        max_rel_diff(&resharded, &straight) < 1e-4,
        "{resharded:?} vs {straight:?}"
    );
}

/// Asserts a run failed with exactly one error line containing `needle`.
fn assert_one_error_line(output: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("hypershard: error: "), "{stderr}");
    assert!(stderr.contains(needle), "{stderr}");
}

#[test]
fn bad_input_is_one_clear_error_line_and_overwrites_nothing() {
    let dir = scratch("bad");
    let out = dir.join("out");
    let out_text = out.to_str().unwrap();
    assert_one_error_line(
        &run(&["train", "--nproc", "3", "--mesh", "2x2", "--out", out_text]),
        "--mesh 2x2 holds 4 ranks but --nproc is 3",
    );
    assert_one_error_line(
        &run(&["train", "--mesh", "2x", "--out", out_text]),
        "invalid --mesh \"2x\"",
    );
    let missing = dir.join("missing.txt");
    assert_one_error_line(
        &run(&[
            "train",
            "--data",
            missing.to_str().unwrap(),
            "--out",
            out_text,
        ]),
        "could not read",
    );
    let corrupt = dir.join("corrupt.bin");
    std::fs::write(&corrupt, [1u8, 2, 3]).unwrap();
    assert_one_error_line(
        &run(&[
            "train",
            "--data",
            corrupt.to_str().unwrap(),
            "--out",
            out_text,
        ]),
        "is not a token file: 3 bytes",
    );
    assert!(!out.exists(), "a failed preflight must not create --out");
    // A finished run is not overwritten by a fresh one, and another model cannot resume it.
    train(&out, &["--nproc", "1", "--mesh", "1", "--steps", "2"]);
    let before = std::fs::read(out.join("losses.jsonl")).unwrap();
    assert_one_error_line(
        &run(&[
            "train", "--model", "tiny", "--nproc", "1", "--mesh", "1", "--out", out_text,
        ]),
        "already exists",
    );
    assert_one_error_line(
        &run(&[
            "train", "--model", "small", "--nproc", "1", "--mesh", "1", "--resume", "--out",
            out_text,
        ]),
        "was saved for another model",
    );
    assert_eq!(std::fs::read(out.join("losses.jsonl")).unwrap(), before);
}

#[test]
fn export_and_sample_read_a_sharded_checkpoint() {
    let dir = scratch("export");
    let out = dir.join("run");
    train(
        &out,
        &[
            "--nproc",
            "2",
            "--mesh",
            "2",
            "--batch-size",
            "2",
            "--steps",
            "3",
        ],
    );
    let file = dir.join("model.safetensors");
    let output = run(&[
        "export",
        "--checkpoint",
        out.to_str().unwrap(),
        "--out",
        file.to_str().unwrap(),
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let tensors = hypershard::tensor::load_safetensors_file(&file).unwrap();
    // nanoGPT names and shapes, whole (the checkpoint holds two dim-0 shards of each).
    assert_eq!(tensors["transformer.wte.weight"].shape(), &[256, 32]);
    assert_eq!(
        tensors["transformer.h.1.attn.c_attn.weight"].shape(),
        &[96, 32]
    );
    assert!(!tensors.keys().any(|k| k.starts_with("optim")));
    // The exported (trained) weights, loaded with --init, give a lower first loss on the same
    // first batch than the fresh initialisation does.
    let single = [
        "--nproc",
        "1",
        "--mesh",
        "1",
        "--batch-size",
        "4",
        "--steps",
        "1",
    ];
    let fresh = train(&dir.join("fresh"), &single);
    let init = train(
        &dir.join("init"),
        &[&single[..], &["--init", file.to_str().unwrap()]].concat(),
    );
    assert!(init[0] < fresh[0] - 1e-3, "{init:?} vs {fresh:?}");
    let sample = run(&[
        "sample",
        "--checkpoint",
        out.to_str().unwrap(),
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "20",
    ]);
    assert!(
        sample.status.success(),
        "{}",
        String::from_utf8_lossy(&sample.stderr)
    );
    let text = String::from_utf8_lossy(&sample.stdout);
    assert!(text.starts_with("ROMEO:"), "{text}");
}

#[test]
fn a_run_stopped_mid_training_resumes_from_its_last_complete_checkpoint() {
    let dir = scratch("stopped");
    let common = [
        "--nproc",
        "4",
        "--mesh",
        "2x2",
        "--batch-size",
        "2",
        "--steps",
        "30",
    ];
    let straight = train(&dir.join("straight"), &common);
    // Checkpoint every step and stop the job (SIGTERM, forwarded to every rank) soon after the
    // first checkpoint exists: the ranks die wherever they are, often in the middle of a save.
    let out = dir.join("stopped");
    let mut child = Command::new(hypershard())
        .args([
            "train",
            "--model",
            "tiny",
            "--warmup-steps",
            "2",
            "--checkpoint-every",
            "1",
        ])
        .args(common)
        .arg("--out")
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !out.join("checkpoints/latest").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "no checkpoint appeared"
        );
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    std::thread::sleep(std::time::Duration::from_millis(150));
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    child.wait().unwrap();
    let checkpoint = hypershard::checkpoint::Checkpoint::open(&out).unwrap();
    assert!(checkpoint.step() >= 1);
    // A run that finished before the signal landed has nothing left to resume (and --resume
    // refuses a --steps that is not beyond the checkpoint); its losses must still match.
    let resumed = if checkpoint.step() < 30 {
        train(&out, &[&common[..], &["--resume"]].concat())
    } else {
        read_losses(&out.join("losses.jsonl"))
            .unwrap()
            .iter()
            .map(|r| r.loss)
            .collect()
    };
    assert_eq!(resumed, straight);
}
