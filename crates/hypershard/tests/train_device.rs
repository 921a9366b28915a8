//! `hypershard train --device`: the small preset trained on the emulated device (real
//! processes over tcp, FSDP at world 2 and HSDP 2×2) records the very losses of the same run
//! on the host, and a device this build cannot use is one clear error line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use hypershard::train::read_losses;

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "hypershard-train-device-{}-{test}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hypershard"))
        .args(args)
        .env("HYPERSHARD_TIMEOUT", "120")
        .stdin(Stdio::null())
        .output()
        .expect("hypershard runs")
}

/// Trains the small preset for 3 steps on `device` over `mesh` and returns the losses.
fn train(out: &Path, device: &str, nproc: &str, mesh: &str) -> Vec<f64> {
    let output = run(&[
        "train",
        "--model",
        "small",
        "--out",
        out.to_str().unwrap(),
        "--device",
        device,
        "--nproc",
        nproc,
        "--mesh",
        mesh,
        "--batch-size",
        "2",
        "--steps",
        "3",
        "--warmup-steps",
        "1",
    ]);
    assert!(
        output.status.success(),
        "train --device {device} --mesh {mesh} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    read_losses(&out.join("losses.jsonl"))
        .unwrap()
        .iter()
        .map(|r| r.loss)
        .collect()
}

#[test]
fn the_emulated_device_trains_the_small_preset_to_the_cpu_losses() {
    let dir = scratch("parity");
    for (nproc, mesh) in [("2", "2"), ("4", "2x2")] {
        let cpu = train(&dir.join(format!("cpu-{mesh}")), "cpu", nproc, mesh);
        let emulated = train(
            &dir.join(format!("emulated-{mesh}")),
            "emulated",
            nproc,
            mesh,
        );
        assert_eq!(cpu.len(), 3, "mesh {mesh}");
        assert!(cpu.iter().all(|l| l.is_finite()), "{cpu:?}");
        // Bit for bit: the same kernels on the same values, staged through host buffers.
        let bits = |losses: &[f64]| losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&emulated),
            bits(&cpu),
            "mesh {mesh}: {emulated:?} vs {cpu:?}"
        );
        // The checkpoint the device run wrote is the host run's, byte for byte.
        let shards = |run: &str| {
            let step = dir
                .join(format!("{run}-{mesh}"))
                .join("checkpoints/step-00000003");
            let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&step)
                .unwrap_or_else(|e| panic!("{}: {e}", step.display()))
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.ends_with(".safetensors"))
                .map(|name| {
                    let bytes = std::fs::read(step.join(&name)).unwrap();
                    (name, bytes)
                })
                .collect();
            files.sort();
            files
        };
        let (cpu_shards, emulated_shards) = (shards("cpu"), shards("emulated"));
        assert!(!cpu_shards.is_empty(), "mesh {mesh}: no shard files");
        assert!(
            cpu_shards == emulated_shards,
            "mesh {mesh}: checkpoint shards differ"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_is_one_clear_error_and_starts_nothing() {
    let dir = scratch("cuda");
    let out = dir.join("run");
    let output = run(&[
        "train",
        "--model",
        "tiny",
        "--out",
        out.to_str().unwrap(),
        "--device",
        "cuda",
        "--nproc",
        "1",
        "--mesh",
        "1",
        "--steps",
        "1",
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--device cuda") && stderr.contains("no CUDA support"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!out.join("losses.jsonl").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
