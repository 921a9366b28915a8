//! Runs that cannot fit in memory, as a user starts them: under an address-space limit
//! (`ulimit -v`), a huge batch or model is refused before any rank starts, with one
//! `hypershard: error:` line naming the estimate, the limit and the flags behind it; sizes
//! that overflow are refused too; and a run that fits is not.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// 6 GiB of address space, in the KiB `ulimit -v` takes.
const LIMIT_KIB: u64 = 6 << 20;

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "hypershard-memory-check-{}-{test}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `hypershard ARGS` under `ulimit -v LIMIT_KIB`, as a shell user would run it.
fn run_limited(args: &[&str]) -> Output {
    let script = format!("ulimit -v {LIMIT_KIB} && exec \"$0\" \"$@\"");
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg(env!("CARGO_BIN_EXE_hypershard"))
        .args(args)
        .env("HYPERSHARD_TIMEOUT", "60")
        .stdin(Stdio::null())
        .output()
        .expect("sh runs")
}

/// What the refusal names as the limit: `ulimit -v` (6 GiB, less the 1 GiB of address space
/// the estimate adds for the runtime), unless this machine's available memory, less the
/// 64 MiB runtime, leaves less room (shared by `ranks`).
fn expected_limit(ranks: u64) -> &'static str {
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines().find_map(|line| {
                let kib = line
                    .strip_prefix("MemAvailable:")?
                    .trim()
                    .strip_suffix("kB")?;
                kib.trim().parse::<u64>().ok()
            })
        })
        .map_or(u64::MAX, |kib| kib * 1024 / ranks);
    if available.saturating_sub(64 << 20) < (LIMIT_KIB << 10) - (1 << 30) {
        "MemAvailable"
    } else {
        "ulimit -v"
    }
}

/// One error line (no backtrace, no rank's abort), a failed exit, nothing written to `out`.
fn assert_refused(output: &Output, out: &Path, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    // Killed by a signal (SIGABRT) there would be no exit code.
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("hypershard: error: "), "{stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "wanted {needle:?} in {stderr}");
    }
    assert!(!out.join("checkpoints").exists(), "no checkpoint");
    assert!(!out.join("losses.jsonl").exists(), "no losses");
}

#[test]
fn a_huge_batch_under_ulimit_v_is_one_error_line_naming_limit_and_flags() {
    let dir = scratch("batch");
    let out = dir.join("run");
    let output = run_limited(&[
        "train",
        "--batch-size",
        "100000000",
        "--nproc",
        "1",
        "--mesh",
        "1",
        "--steps",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_refused(
        &output,
        &out,
        &[
            "each rank needs about",
            expected_limit(1),
            "--batch-size 100000000",
            "--no-memory-check",
        ],
    );
    // The same on 4 ranks: refused before any of them starts (no rank's line, no abort).
    let output = run_limited(&[
        "train",
        "--batch-size",
        "100000000",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_refused(
        &output,
        &out,
        &["each rank needs about", "--batch-size 100000000"],
    );
}

#[test]
fn a_huge_model_file_under_ulimit_v_is_refused_naming_the_model() {
    let dir = scratch("model");
    let model = dir.join("wide.json");
    // 48 layers of width 16384: 155 G parameters, 1.2 TB of state per rank even sharded 2 ways.
    std::fs::write(
        &model,
        r#"{"block_size": 64, "n_layer": 48, "n_head": 16, "n_embd": 16384}"#,
    )
    .unwrap();
    let out = dir.join("run");
    let output = run_limited(&[
        "train",
        "--model",
        model.to_str().unwrap(),
        "--nproc",
        "2",
        "--mesh",
        "2",
        "--steps",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_refused(
        &output,
        &out,
        &[
            expected_limit(2),
            "--model (154634321920 parameters) with 2-way sharding (--mesh)",
        ],
    );
}

#[test]
fn sizes_that_overflow_are_refused_even_without_the_check() {
    let dir = scratch("overflow");
    let out = dir.join("run");
    // 2^50 sequences of 64 tokens fit a token count, but not their logits' bytes.
    let batch = (1u64 << 50).to_string();
    let output = run_limited(&[
        "train",
        "--batch-size",
        &batch,
        "--nproc",
        "1",
        "--mesh",
        "1",
        "--steps",
        "2",
        "--no-memory-check",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_refused(
        &output,
        &out,
        &[
            "overflows a 64-bit byte count",
            &format!("--batch-size {batch}"),
        ],
    );
}

#[test]
fn a_run_that_fits_is_not_refused() {
    let dir = scratch("fits");
    let out = dir.join("run");
    let output = run_limited(&[
        "train",
        "--model",
        "tiny",
        "--nproc",
        "2",
        "--mesh",
        "2",
        "--steps",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(out.join("checkpoints").exists());
}

/// The estimate's communication-buffer term of `hypershard train ARGS --max-rank-memory 16MiB`
/// (a refusal, so nothing starts), in MiB.
fn comm_estimate_mib(args: &[&str]) -> f64 {
    let dir = scratch(&format!("keep-{}", args.join("-").replace('=', "_")));
    let output = Command::new(env!("CARGO_BIN_EXE_hypershard"))
        .args(["train", "--model", "medium", "--max-rank-memory", "16MiB"])
        .args(args)
        .arg("--out")
        .arg(dir.join("run"))
        .env("HYPERSHARD_TIMEOUT", "60")
        .stdin(Stdio::null())
        .output()
        .expect("hypershard runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "refused: {stderr}");
    // "communication buffers 17.2 MiB," or "communication buffers 0 B,".
    let term = stderr
        .split("communication buffers ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .unwrap_or_else(|| panic!("no communication term in {stderr}"));
    let (value, unit) = term
        .split_once(' ')
        .unwrap_or_else(|| panic!("{term:?} in {stderr}"));
    let value: f64 = value
        .parse()
        .unwrap_or_else(|_| panic!("{term:?} in {stderr}"));
    let scale = match unit {
        "B" => 1.0 / (1024.0 * 1024.0),
        "KiB" => 1.0 / 1024.0,
        "MiB" => 1.0,
        "GiB" => 1024.0,
        other => panic!("unit {other:?} in {stderr}"),
    };
    value * scale
}

#[test]
fn one_rank_gathers_nothing_and_more_ranks_keep_their_step_buffers_by_default() {
    // One rank's unsharded parameters are its shards: no communication buffers, kept or not;
    // only bf16 compute copies of the parameters remain.
    let one = ["--nproc", "1", "--mesh", "1"];
    for flag in [
        &[][..],
        &["--keep-step-buffers=false"],
        &["--keep-step-buffers"],
    ] {
        let mib = comm_estimate_mib(&[&one[..], flag].concat());
        assert_eq!(mib, 0.0, "one rank, {flag:?}");
    }
    let bf16 = comm_estimate_mib(&[&one[..], &["--param-dtype", "bf16"]].concat());
    assert!(
        bf16 > 0.0,
        "one rank with bf16 parameters holds their casts"
    );
    let two = ["--nproc", "2", "--mesh", "2"];
    let default_two = comm_estimate_mib(&two);
    let freed_two = comm_estimate_mib(&[&two[..], &["--keep-step-buffers=false"]].concat());
    let kept_two = comm_estimate_mib(&[&two[..], &["--keep-step-buffers=true"]].concat());
    assert_eq!(default_two, kept_two, "two ranks keep them by default");
    assert!(
        kept_two > freed_two,
        "two ranks: kept {kept_two}, freed {freed_two}"
    );
    assert!(
        freed_two > bf16,
        "two ranks gather f32 parameters: {freed_two} MiB against one rank's bf16 casts {bf16}"
    );
}
