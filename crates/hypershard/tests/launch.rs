//! `hypershard launch` with real processes: the `allreduce` example under 1, 2 and 3 ranks, a
//! failing rank, a port in use, and a forwarded SIGTERM.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

#[path = "support/example.rs"]
mod example;

fn hypershard() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hypershard"))
}

fn allreduce_example() -> PathBuf {
    example::allreduce()
}

fn run_launch(args: &[&str], env: &[(&str, &str)]) -> (Output, Duration) {
    // Built (the first time) before the clock starts: the timings are the launcher's.
    let example = allreduce_example();
    let started = Instant::now();
    let output = Command::new(hypershard())
        .arg("launch")
        .args(args)
        .arg("--")
        .arg(example)
        .envs(env.iter().copied())
        .env("HYPERSHARD_TIMEOUT", "20")
        .stdin(Stdio::null())
        .output()
        .expect("hypershard runs");
    (output, started.elapsed())
}

#[test]
fn all_reduce_under_one_two_and_three_ranks() {
    for n in 1..=3usize {
        let (output, _) = run_launch(&["--nproc-per-node", &n.to_string()], &[]);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "n={n}: {output:?}");
        let sum = n * (n + 1) / 2;
        for rank in 0..n {
            let line = format!("[rank {rank}] rank {rank} of {n} local {rank} sum {sum}");
            assert!(
                stdout.lines().any(|l| l == line),
                "n={n}: missing {line:?} in {stdout}"
            );
        }
        assert_eq!(stdout.lines().count(), n, "{stdout}");
    }
}

#[test]
fn a_failing_rank_stops_the_others_and_is_named() {
    let (output, elapsed) = run_launch(
        &["--nproc-per-node", "3", "--stop-timeout", "1"],
        &[
            ("HYPERSHARD_EXAMPLE_FAIL_RANK", "1"),
            ("HYPERSHARD_EXAMPLE_HANG", "1"),
        ],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    // The others sleep 600 s unless stopped, so a quick exit proves they were stopped.
    assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
    assert_eq!(output.status.code(), Some(7), "{stderr}");
    assert!(
        stderr.contains("hypershard: error: rank 1 failed with exit code 7"),
        "{stderr}"
    );
    assert!(
        stderr.contains("[rank 1] rank 1 failing on purpose"),
        "{stderr}"
    );
}

#[test]
fn a_port_in_use_is_one_clear_error_line() {
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let (output, _) = run_launch(
        &["--nproc-per-node", "2", "--master-port", &port.to_string()],
        &[],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&format!("port {port} on 127.0.0.1 is already in use")),
        "{stderr}"
    );
    assert!(output.stdout.is_empty(), "no rank may start");
}

#[test]
fn sigterm_is_forwarded_to_every_rank() {
    let example = allreduce_example();
    let started = Instant::now();
    let mut child = Command::new(hypershard())
        .args(["launch", "--nproc-per-node", "2", "--"])
        .arg(example)
        .env("HYPERSHARD_EXAMPLE_HANG", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until both ranks are up (each prints "sleeping"), bounded by a deadline.
    std::thread::sleep(Duration::from_millis(500));
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "launcher did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_eq!(output.status.code(), Some(128 + 15), "{stderr}");
    assert!(stderr.contains("interrupted by signal 15"), "{stderr}");
}
