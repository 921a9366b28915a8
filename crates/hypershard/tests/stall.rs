//! The stall watchdog and the launcher's verdict with real processes under `hypershard train`:
//! a rank SIGSTOPped (in the forward, as rank 0, in the optimizer step) must be named by
//! global rank and pid in every live rank's report and the launcher's, the launcher's exit
//! line must name it, and every process must be gone within the stall threshold + 5 s; a
//! rank SIGKILLed in the backward must be named by the launcher every time, never a peer
//! that failed after it. Faults are armed with `HYPERSHARD_FAULT` (`hypershard::train::Fault`).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The stall threshold of these runs, in seconds.
const STALL_S: u64 = 3;

fn hypershard() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hypershard"))
}

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hypershard-stall-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// What a faulty run printed and how long its processes outlived the fault.
struct Run {
    stderr: String,
    success: bool,
    /// From the fault's own line to the launcher's exit.
    after_fault: Option<Duration>,
}

/// Runs `train` with `fault` armed, timing the launcher's exit from the fault's line.
fn run(test: &str, fault: &str, args: &[&str]) -> Run {
    let out = scratch(test);
    let mut child = Command::new(hypershard())
        .arg("train")
        .args(["--model", "tiny", "--batch-size", "2", "--out"])
        .arg(out.join("run"))
        .args(args)
        .env("HYPERSHARD_FAULT", fault)
        .env_remove("HYPERSHARD_TIMEOUT")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("hypershard starts");
    let stderr = child.stderr.take().unwrap();
    let (lines, received) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = lines.send((Instant::now(), line));
        }
    });
    // A hung job must fail this test, not hang it.
    let limit = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > limit {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let exited = Instant::now();
    reader.join().unwrap();
    let mut text = String::new();
    let mut fired = None;
    for (at, line) in received.try_iter() {
        if line.contains("HYPERSHARD_FAULT: rank") && fired.is_none() {
            fired = Some(at);
        }
        text.push_str(&line);
        text.push('\n');
    }
    let _ = std::fs::remove_dir_all(&out);
    Run {
        stderr: text,
        success: status.success(),
        after_fault: fired.map(|at| exited.saturating_duration_since(at)),
    }
}

/// The pid the fault line of `rank` printed.
fn fault_pid(text: &str, rank: usize) -> u32 {
    let line = text
        .lines()
        .find(|l| l.contains(&format!("HYPERSHARD_FAULT: rank {rank} ")))
        .unwrap_or_else(|| panic!("the fault of rank {rank} never fired: {text}"));
    let pid = line
        .rsplit("(pid ")
        .next()
        .and_then(|rest| rest.strip_suffix(')'))
        .unwrap_or_else(|| panic!("no pid in {line:?}"));
    pid.parse().unwrap()
}

/// Every pid that printed a report, as the report's heading gives it.
fn report_pids(text: &str) -> Vec<u32> {
    text.lines()
        .filter_map(|l| l.split("hypershard watchdog (rank ").nth(1))
        .filter_map(|rest| rest.split("pid ").nth(1))
        .filter_map(|rest| rest.split(')').next())
        .filter_map(|pid| pid.parse().ok())
        .collect()
}

/// Whether `pid` is gone (or a zombie waiting to be reaped: it runs nothing any more).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state is the field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit(") ")
            .next()
            .is_some_and(|rest| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

fn stalled_rank_is_named(test: &str, point: &str, stopped: usize) {
    let fault = format!("{point}@2:{stopped}:stop");
    let stall = STALL_S.to_string();
    let run = run(
        test,
        &fault,
        &[
            "--nproc",
            "4",
            "--mesh",
            "2x2",
            "--steps",
            "40",
            "--stall-timeout",
            &stall,
            "--timeout",
            "120",
        ],
    );
    let text = &run.stderr;
    assert!(!run.success, "{text}");
    let pid = fault_pid(text, stopped);
    // Within the stall threshold and 5 s of the stop, the launcher has exited...
    let after = run.after_fault.expect("the fault line was seen");
    assert!(
        after <= Duration::from_secs(STALL_S + 5),
        "the job outlived the stop by {after:?}: {text}"
    );
    // ...and so has every rank, the stopped one included.
    let mut pids = report_pids(text);
    pids.push(pid);
    let deadline = Instant::now() + Duration::from_secs(2);
    for p in &pids {
        while !process_gone(*p) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(process_gone(*p), "pid {p} is still running: {text}");
    }
    // One report per live rank and one from the launcher, each naming the stopped rank by
    // global rank and pid.
    let named = format!("rank {stopped} (host ");
    for rank in (0..4).filter(|&r| r != stopped) {
        let heading = format!("hypershard watchdog (rank {rank},");
        assert_eq!(
            text.matches(&heading).count(),
            1,
            "rank {rank} must print one report: {text}"
        );
    }
    assert_eq!(
        text.matches("hypershard watchdog (launcher)").count(),
        1,
        "{text}"
    );
    let launcher_report: String = text
        .split("hypershard watchdog (launcher)")
        .nth(1)
        .unwrap()
        .lines()
        .take_while(|l| !l.contains("the job fails"))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        launcher_report.contains(&named) && launcher_report.contains(&format!("pid {pid})")),
        "the launcher's report must name rank {stopped} (pid {pid}): {launcher_report}"
    );
    assert!(
        launcher_report.contains(&format!("most likely stuck: rank {stopped}")),
        "{launcher_report}"
    );
    // The exit line blames the stopped rank, not a peer that aborted.
    let exit_line = text
        .lines()
        .rfind(|l| l.starts_with("hypershard: error:"))
        .unwrap_or_else(|| panic!("no exit line: {text}"));
    assert!(
        exit_line.starts_with(&format!(
            "hypershard: error: rank {stopped} (pid {pid} on host "
        )) && exit_line.contains("stalled the job"),
        "{exit_line}"
    );
}

#[test]
fn a_rank_stopped_in_the_forward_is_named_and_every_process_exits() {
    stalled_rank_is_named("forward", "forward", 2);
}

#[test]
fn rank_0_stopped_is_named_and_every_process_exits() {
    stalled_rank_is_named("rank0", "forward", 0);
}

#[test]
fn a_rank_stopped_in_the_optimizer_step_is_named_and_every_process_exits() {
    stalled_rank_is_named("optimizer", "optimizer", 3);
}

#[test]
fn a_rank_killed_in_the_backward_is_named_every_time() {
    const TRIALS: usize = 50;
    let started = Instant::now();
    for trial in 0..TRIALS {
        let killed = trial % 2;
        let fault = format!("backward@1:{killed}");
        let run = run(
            &format!("kill{trial}"),
            &fault,
            &["--nproc", "2", "--mesh", "2", "--steps", "3"],
        );
        let text = &run.stderr;
        assert!(!run.success, "trial {trial}: {text}");
        let exit_line = text
            .lines()
            .rfind(|l| l.starts_with("hypershard: error:"))
            .unwrap_or_else(|| panic!("trial {trial}: no exit line: {text}"));
        assert_eq!(
            exit_line,
            format!(
                "hypershard: error: rank {killed} failed with signal 9; stopped the other ranks"
            ),
            "trial {trial}: {text}"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "{TRIALS} trials took {:?}",
        started.elapsed()
    );
}

#[test]
fn with_on_stall_wait_the_ranks_report_once_and_wait_for_the_deadline() {
    let run = run(
        "wait",
        "forward@2:1:stop",
        &[
            "--nproc",
            "2",
            "--mesh",
            "2",
            "--steps",
            "40",
            "--stall-timeout",
            "1",
            "--timeout",
            "6",
            "--on-stall",
            "wait",
        ],
    );
    let text = &run.stderr;
    assert!(!run.success, "{text}");
    // The live rank and the launcher report the stall once each and say they wait on...
    assert_eq!(
        text.matches("hypershard watchdog (rank 0,").count(),
        1,
        "{text}"
    );
    assert_eq!(
        text.matches("hypershard watchdog (launcher)").count(),
        1,
        "{text}"
    );
    assert!(text.contains("waiting on (--on-stall wait)"), "{text}");
    assert!(!text.contains("stalled the job"), "{text}");
    // ...until the op deadline ends the wait, naming the stopped peer.
    assert!(
        text.contains("timed out after 6s waiting for rank 1"),
        "{text}"
    );
    let after = run.after_fault.expect("the fault line was seen");
    assert!(
        after >= Duration::from_secs(5),
        "ended after {after:?}: {text}"
    );
}
