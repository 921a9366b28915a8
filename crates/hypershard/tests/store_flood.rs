//! 3000 idle connections to the job's store during `hypershard train`: the launcher (which
//! hosts the store) keeps a bounded number of threads, refuses the excess, and the run's
//! losses are those of an undisturbed run.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hypershard::train::read_losses;
use hypershard_collectives::store::tcp::MAX_PENDING_HANDSHAKES;

const IDLE_CONNECTIONS: usize = 3000;

fn hypershard() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hypershard"))
}

fn start(out: &Path, port: u16) -> Child {
    Command::new(hypershard())
        .args([
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
            "3000",
            "--master-port",
        ])
        .arg(port.to_string())
        .arg("--out")
        .arg(out)
        .env_remove("HYPERSHARD_FAULT")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("hypershard starts")
}

/// Losses by step, as the run recorded them.
fn losses(out: &Path) -> Vec<(u64, f64)> {
    read_losses(&out.join("losses.jsonl"))
        .unwrap()
        .into_iter()
        .map(|r| (r.step, r.loss))
        .collect()
}

/// The `Threads:` line of a process's status (`None` once it is gone).
fn threads(pid: u32) -> Option<usize> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
}

#[test]
fn idle_connections_to_the_store_leave_threads_bounded_and_losses_unchanged() {
    let base = std::env::temp_dir().join(format!("hypershard-flood-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();

    let quiet = base.join("quiet");
    let output = start(&quiet, hypershard_testkit::unused_port())
        .wait_with_output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");

    let flooded = base.join("flooded");
    let port = hypershard_testkit::unused_port();
    let mut child = start(&flooded, port);
    let pid = child.id();
    // Connect as soon as the store listens; keep every connection open and silent.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut idle = Vec::with_capacity(IDLE_CONNECTIONS);
    while idle.is_empty() {
        assert!(Instant::now() < deadline, "the store never listened");
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => idle.push(stream),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    let mut peak = 0;
    // Four connecting threads: one connect at a time waits on the server's accept loop,
    // which shares the CPU with the training ranks.
    let openers: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                let mut mine = Vec::new();
                let mut errors = 0usize;
                let give_up = Instant::now() + Duration::from_secs(60);
                while mine.len() < IDLE_CONNECTIONS / 4 && Instant::now() < give_up {
                    // A refused connection is closed by the server; connecting itself still
                    // succeeds (the kernel's backlog accepts it first).
                    match TcpStream::connect(("127.0.0.1", port)) {
                        Ok(stream) => mine.push(stream),
                        Err(_) => {
                            errors += 1;
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                }
                (mine, errors)
            })
        })
        .collect();
    while openers.iter().any(|o| !o.is_finished()) {
        peak = peak.max(threads(pid).unwrap_or(0));
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut errors = 0;
    for opener in openers {
        let (mine, failed) = opener.join().unwrap();
        idle.extend(mine);
        errors += failed;
    }
    let still_running = child.try_wait().unwrap().is_none();
    let flood_done = Instant::now();
    while child.try_wait().unwrap().is_none() {
        peak = peak.max(threads(pid).unwrap_or(0));
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        idle.len() > IDLE_CONNECTIONS && still_running,
        "{} connections ({errors} connects failed); the run ended before the flood did: {}",
        idle.len(),
        !still_running
    );
    eprintln!(
        "launcher threads peaked at {peak} with {} idle connections; the run went on {:?} \
         after the flood",
        idle.len(),
        flood_done.elapsed()
    );
    // The launcher's own threads (main, store acceptor, output copiers, the ranks' store
    // connections) plus at most the cap of handshakes in flight.
    let bound = MAX_PENDING_HANDSHAKES + 32;
    assert!(
        peak <= bound,
        "the launcher peaked at {peak} threads (bound {bound})"
    );
    assert!(peak > 0, "the launcher's threads were never seen");
    assert!(
        stderr.contains("too many connections in their handshake"),
        "the refusals must be logged: {stderr}"
    );
    assert_eq!(losses(&quiet), losses(&flooded));
    drop(idle);
    let _ = std::fs::remove_dir_all(&base);
}
