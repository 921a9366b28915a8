//! `hypershard launch` with real processes: it generates a job secret, hands it to the ranks,
//! and the job's Store refuses a client without it (or with a wrong one) while the job
//! carries on; and when the launcher (the Store's host) dies, its ranks die with it.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hypershard_collectives::auth::JobSecret;
use hypershard_collectives::store::TcpStore;
use hypershard_collectives::{Error, ProtocolViolation};

#[path = "support/example.rs"]
mod example;

fn hypershard() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hypershard"))
}

fn allreduce_example() -> PathBuf {
    example::allreduce()
}

#[test]
fn strangers_are_refused_by_the_store_and_the_job_carries_on() {
    let dir = std::env::temp_dir().join(format!("hypershard-security-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let port = hypershard_testkit::unused_port();
    let child = Command::new(hypershard())
        .args(["launch", "--nproc-per-node", "2", "--master-port"])
        .arg(port.to_string())
        .arg("--")
        .arg(allreduce_example())
        .env("HYPERSHARD_EXAMPLE_READY_DIR", &dir)
        .env("HYPERSHARD_TIMEOUT", "20")
        .env_remove("HYPERSHARD_JOB_SECRET")
        .env_remove("HYPERSHARD_JOB_SECRET_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(dir.join("ready-0").exists() && dir.join("ready-1").exists()) {
        assert!(Instant::now() < deadline, "the ranks never got ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The job is up and its Store is listening; a client with no secret and one with a guess
    // are both refused.
    let guess = JobSecret::from_bytes(b"0123456789abcdef".to_vec()).unwrap();
    for secret in [None, Some(guess)] {
        let result = TcpStore::connect_with_secret(
            ("127.0.0.1", port),
            Duration::from_secs(5),
            secret.clone(),
        );
        assert!(
            matches!(
                result,
                Err(Error::Protocol {
                    violation: ProtocolViolation::AuthenticationFailed,
                    ..
                })
            ),
            "secret {secret:?}: {result:?}"
        );
    }
    std::fs::write(dir.join("go"), b"").unwrap();
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    for rank in 0..2 {
        let line = format!("[rank {rank}] rank {rank} of 2 local {rank} sum 3");
        assert!(stdout.lines().any(|l| l == line), "{stdout}");
    }
    // The launcher logged both refusals with the stranger's address, and never the secret.
    let refusals = stderr
        .lines()
        .filter(|l| l.contains("refused a client that does not hold the job secret"))
        .filter(|l| l.contains("127.0.0.1:"))
        .count();
    assert_eq!(refusals, 2, "{stderr}");
    assert!(!stderr.contains("HYPERSHARD_JOB_SECRET="), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn when_the_launcher_hosting_the_store_is_killed_its_ranks_die_too() {
    let dir = std::env::temp_dir().join(format!("hypershard-orphans-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut child = Command::new(hypershard())
        .args(["launch", "--nproc-per-node", "2", "--"])
        .arg(allreduce_example())
        .env("HYPERSHARD_EXAMPLE_READY_DIR", &dir)
        .env("HYPERSHARD_TIMEOUT", "20")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let pids: Vec<String> = loop {
        let read: Vec<Option<String>> = (0..2)
            .map(|r| std::fs::read_to_string(dir.join(format!("ready-{r}"))).ok())
            .collect();
        if read
            .iter()
            .all(|p| p.as_ref().is_some_and(|p| !p.is_empty()))
        {
            break read.into_iter().flatten().collect();
        }
        assert!(Instant::now() < deadline, "the ranks never got ready");
        std::thread::sleep(Duration::from_millis(20));
    };
    // SIGKILL cannot be forwarded: the ranks must notice on their own (PR_SET_PDEATHSIG).
    child.kill().unwrap();
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    for pid in &pids {
        // A rank that died is reaped by init; its /proc entry goes away (or turns zombie).
        let status = PathBuf::from(format!("/proc/{pid}/status"));
        loop {
            let alive = std::fs::read_to_string(&status).is_ok_and(|s| {
                !s.lines()
                    .any(|l| l.starts_with("State:") && l.contains('Z'))
            });
            if !alive {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "rank pid {pid} outlived its launcher by 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
