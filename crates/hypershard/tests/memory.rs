//! Memory as users see it: the per-rank summary in `summary.json`, deferred start-up against
//! `--eager-init`, and `--max-rank-memory` stopping a rank that needs more than its budget.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

fn hypershard() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hypershard"))
}

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hypershard-mem-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch");
    dir
}

fn run(args: &[&str]) -> Output {
    Command::new(hypershard())
        .args(args)
        .env("HYPERSHARD_TIMEOUT", "60")
        .stdin(Stdio::null())
        .output()
        .expect("hypershard runs")
}

fn summary(out: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(out.join("summary.json")).expect("summary.json");
    serde_json::from_str(&text).expect("summary is JSON")
}

fn field(rank: &Value, name: &str) -> u64 {
    rank[name]
        .as_u64()
        .unwrap_or_else(|| panic!("{name} in {rank}"))
}

/// A model JSON of ~2.5 M parameters (9.9 MB of weights), big enough that its start-up shows
/// in the resident set.
fn model_file(dir: &std::path::Path) -> PathBuf {
    let path = dir.join("model.json");
    std::fs::write(
        &path,
        r#"{"vocab_size": 256, "block_size": 32, "n_layer": 4, "n_head": 4, "n_embd": 224,
            "bias": true, "dropout": 0.0}"#,
    )
    .expect("model file");
    path
}

#[test]
fn the_summary_splits_memory_per_rank_and_deferred_start_up_is_smaller() {
    let dir = scratch("summary");
    let model = model_file(&dir);
    let mut startup = Vec::new();
    for eager in [false, true] {
        let out = dir.join(if eager { "eager" } else { "deferred" });
        let mut args = vec![
            "train",
            "--model",
            model.to_str().expect("utf-8"),
            "--nproc",
            "2",
            "--mesh",
            "2",
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--out",
            out.to_str().expect("utf-8"),
        ];
        if eager {
            args.push("--eager-init");
        }
        let output = run(&args);
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let summary = summary(&out);
        assert_eq!(summary["world_size"], 2);
        let ranks = summary["memory"].as_array().expect("memory per rank");
        assert_eq!(ranks.len(), 2);
        let c = 224u64;
        let params = 256 * c + 32 * c + 4 * (12 * c * c + 13 * c) + 2 * c;
        for (rank, figures) in ranks.iter().enumerate() {
            assert_eq!(field(figures, "rank"), rank as u64);
            // State: this rank's half of weights + grads + two moments, 16 B per parameter.
            let state = field(figures, "state_bytes");
            let half = params * 16 / 2;
            assert!(
                state.abs_diff(half) < half / 50,
                "rank {rank} state {state} vs {half}"
            );
            let tracker = field(figures, "tracker_peak_bytes");
            assert!(field(figures, "comm_buffer_bytes") > 0);
            assert!(field(figures, "activation_bytes") < tracker);
            let (idle, boot, peak) = (
                field(figures, "idle_rss_bytes"),
                field(figures, "startup_peak_rss_bytes"),
                field(figures, "peak_rss_bytes"),
            );
            assert!(idle > 0 && idle <= boot && boot <= peak, "{figures}");
            assert!(
                peak >= tracker,
                "RSS counts at least the tensors: {figures}"
            );
        }
        startup.push(
            ranks
                .iter()
                .map(|r| field(r, "startup_peak_rss_bytes") - field(r, "idle_rss_bytes"))
                .max()
                .expect("two ranks"),
        );
    }
    // The eager path builds all 9.9 MB of weights on every rank before sharding; the deferred
    // one builds half. Resident growth at start-up shows at least 3 MB of the difference.
    let (deferred, eager) = (startup[0], startup[1]);
    assert!(
        eager >= deferred + 3_000_000,
        "start-up growth: deferred {deferred} B, eager {eager} B"
    );
}

#[test]
fn a_rank_over_max_rank_memory_is_stopped_and_named() {
    let dir = scratch("limit");
    let out = dir.join("run");
    // Its training state alone is 20 MB per rank: more than the 16 MiB budget.
    let model = model_file(&dir);
    let output = run(&[
        "train",
        "--model",
        model.to_str().expect("utf-8"),
        "--nproc",
        "2",
        "--mesh",
        "2",
        "--steps",
        "2",
        "--max-rank-memory",
        "16MiB",
        // The estimate would refuse this budget before the start; the kernel's limit is
        // what this test is about.
        "--no-memory-check",
        "--out",
        out.to_str().expect("utf-8"),
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if stderr.contains("no memory cgroup") || stderr.contains("cannot create the memory cgroup") {
        // A machine without a writable memory cgroup: the flag is refused with a clear line.
        assert!(!output.status.success());
        assert!(stderr.contains("--max-rank-memory"), "{stderr}");
        return;
    }
    assert!(!output.status.success(), "a 16 MiB budget cannot train");
    assert!(
        stderr.contains("went over --max-rank-memory (16.0 MiB)"),
        "{stderr}"
    );
    assert!(
        !out.join("checkpoints").exists(),
        "no checkpoint of a killed run"
    );
    // A budget that fits trains.
    let out = dir.join("fits");
    let output = run(&[
        "train",
        "--model",
        "tiny",
        "--nproc",
        "2",
        "--mesh",
        "2",
        "--steps",
        "2",
        "--max-rank-memory",
        "512MiB",
        "--out",
        out.to_str().expect("utf-8"),
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for figures in summary(&out)["memory"].as_array().expect("ranks") {
        assert!(field(figures, "peak_rss_bytes") < 512 << 20);
    }
}
