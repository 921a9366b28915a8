//! `hypershard train --activation-checkpointing` as a user runs it (2 processes over tcp): the
//! same losses, bit for bit, as the run without it, and the same collectives.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use hypershard::train::read_losses;

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hypershard-train-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// What one run reports: the per-step losses' bits, the summary's line of bytes communicated
/// per step, and rank 0's peak tensor memory.
#[derive(Debug)]
struct Report {
    losses: Vec<u64>,
    comm: String,
    peak_bytes: f64,
}

/// Trains `model` on 2 FSDP ranks.
fn train(model: &Path, out: &Path, extra: &[&str]) -> Report {
    let out_text = out.to_str().expect("utf-8 temp path");
    let mut args = vec![
        "train",
        "--model",
        model.to_str().expect("utf-8 temp path"),
        "--out",
        out_text,
        "--nproc",
        "2",
        "--mesh",
        "2",
        "--batch-size",
        "2",
        "--steps",
        "4",
        "--warmup-steps",
        "2",
    ];
    args.extend_from_slice(extra);
    let output = Command::new(env!("CARGO_BIN_EXE_hypershard"))
        .args(&args)
        .env("HYPERSHARD_TIMEOUT", "60")
        .stdin(Stdio::null())
        .output()
        .expect("hypershard runs");
    assert!(
        output.status.success(),
        "train {extra:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let losses = read_losses(&out.join("losses.jsonl"))
        .expect("losses")
        .iter()
        .map(|r| r.loss.to_bits())
        .collect();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = |label: &str| {
        stdout
            .lines()
            .find_map(|line| line.trim_start().strip_prefix(label))
            .unwrap_or_else(|| panic!("no {label} line in the summary: {stdout}"))
            .trim()
            .to_string()
    };
    // Rank 0's tensor-storage peak, from the summary rank 0 writes.
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json"),
    )
    .expect("summary is JSON");
    let peak_bytes = summary["memory"][0]["tracker_peak_bytes"]
        .as_f64()
        .expect("rank 0's tracker peak");
    Report {
        losses,
        comm: line("comm"),
        peak_bytes,
    }
}

#[test]
fn checkpointed_training_matches_plain_training_bit_for_bit() {
    let dir = scratch();
    // The tiny preset's shape with dropout, so the recomputation must replay the masks.
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.1}"#,
    )
    .expect("model file");
    let plain = train(&model, &dir.join("plain"), &[]);
    let checkpointed = train(&model, &dir.join("ckpt"), &["--activation-checkpointing"]);
    assert_eq!(plain.losses.len(), 4);
    // Equal losses, and equal bytes on the wire: the recomputation gathers nothing extra.
    assert_eq!(checkpointed.losses, plain.losses);
    assert_eq!(checkpointed.comm, plain.comm);
    // And the flag took effect: the blocks' activations were not kept.
    assert!(
        checkpointed.peak_bytes < plain.peak_bytes,
        "peak {} vs {} bytes",
        checkpointed.peak_bytes,
        plain.peak_bytes
    );
    let _ = std::fs::remove_dir_all(&dir);
}
