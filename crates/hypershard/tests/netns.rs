//! Two hosts for real: two Linux network namespaces joined by a veth pair, each running one
//! `hypershard train` launcher with 2 ranks (`--nnodes 2 --nproc 2 --mesh 2x2`, HSDP: the
//! shard groups stay inside a host, the replica all-reduce crosses the veth). The tests check
//! that such a job trains to exactly the losses of the same job on one host, and that a link
//! cut mid-run (after a checkpoint was committed) makes both launchers fail within a bound set
//! by the op deadline, after which `--resume` over the restored link reproduces the
//! uninterrupted losses.
//!
//! The namespaces, the veth and the addresses (10.231.T.1 and .2, inside the namespaces only)
//! are created per test with names that carry this process's id, and are always deleted (a
//! `Drop` guard), on failure too. Creating them needs root and iproute2's `ip`; without them
//! the tests fail with a message saying so, never skip (CI runs as root).

mod common;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use common::{losses, recorded_steps};
use hypershard::checkpoint::Checkpoint;

/// The op deadline of every run, in seconds (`HYPERSHARD_TIMEOUT`): after the link is cut,
/// each rank fails once an op has waited this long for a peer on the other host.
const TIMEOUT_S: u64 = 4;

/// Optimizer steps of every run. Enough that the run is still training well after the first
/// checkpoint (step 2) is committed, when the link is cut.
const STEPS: u64 = 40;

/// How long any one training run may take before the test kills it and fails.
const RUN_DEADLINE: Duration = Duration::from_secs(60);

/// How long both launchers may take to exit once the link is cut: the op deadline, the
/// launcher's stop grace (5 s) and slack for a loaded machine.
const CUT_DEADLINE: Duration = Duration::from_secs(TIMEOUT_S + 26);

/// The port the node-0 launcher hosts the Store on, inside namespace 0. Each run uses its own
/// offset from it, so a run never meets the sockets a cut run left behind.
const BASE_PORT: u16 = 29600;

fn hypershard() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hypershard"))
}

/// iproute2's `ip`: /usr/sbin/ip where it is (Debian), else whatever `PATH` finds.
fn ip_binary() -> &'static str {
    if Path::new("/usr/sbin/ip").is_file() {
        "/usr/sbin/ip"
    } else {
        "ip"
    }
}

/// The tests run one at a time: each starts 4 rank processes, and the link-cut test bounds
/// how long failing takes, which a second job competing for the cores would stretch.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A fresh directory for one test; the run's `--out` is `run/` inside it and the launchers'
/// stderr files sit next to it.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hypershard-netns-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("run")
}

/// Where the launcher of `node` (`None`: the one-host run) on `port` writes its stderr.
fn log_path(out: &Path, node: Option<usize>, port: u16) -> PathBuf {
    let name = match node {
        Some(node) => format!("node{node}-port{port}.stderr"),
        None => "one-host.stderr".to_string(),
    };
    out.parent().unwrap().join(name)
}

/// Runs `ip ARGS` and returns its output.
fn ip(args: &[&str]) -> Output {
    Command::new(ip_binary())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `{} {}`: {e}. This test needs iproute2 (Debian package iproute2) \
                 and root, and must not be skipped",
                ip_binary(),
                args.join(" ")
            )
        })
}

/// Runs `ip ARGS` and fails the test, naming the command and its error, when it fails.
fn ip_ok(args: &[&str]) {
    let output = ip(args);
    assert!(
        output.status.success(),
        "`{} {}` failed ({}): {}. Creating network namespaces and veth links needs root \
         (CAP_NET_ADMIN and CAP_SYS_ADMIN); this test must run as root, it is not skipped",
        ip_binary(),
        args.join(" "),
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    );
}

/// Two network namespaces joined by a veth pair; deleted on drop.
struct TwoHosts {
    namespaces: [String; 2],
    veths: [String; 2],
    addrs: [String; 2],
}

impl TwoHosts {
    /// Creates the namespaces `hypershard-<pid>-<tag>-{0,1}`, the veth `hs<pid>t<tag>{a,b}`
    /// (one end in each) with 10.231.<tag>.1/24 and .2/24, and brings the links and each
    /// namespace's loopback up.
    fn create(tag: u8) -> TwoHosts {
        let pid = std::process::id();
        let hosts = TwoHosts {
            namespaces: [0, 1].map(|k| format!("hypershard-{pid}-{tag}-{k}")),
            // Interface names are at most 15 bytes: "hs" + up to 7 pid digits + "t" + tag.
            veths: ["a", "b"].map(|end| format!("hs{}t{tag}{end}", pid % 10_000_000)),
            addrs: [1, 2].map(|host| format!("10.231.{tag}.{host}")),
        };
        // From here on, whatever was created is deleted when `hosts` drops, also if a step
        // below fails.
        for ns in &hosts.namespaces {
            ip_ok(&["netns", "add", ns]);
        }
        ip_ok(&[
            "link",
            "add",
            &hosts.veths[0],
            "type",
            "veth",
            "peer",
            "name",
            &hosts.veths[1],
        ]);
        for k in 0..2 {
            let (ns, veth, addr) = (&hosts.namespaces[k], &hosts.veths[k], &hosts.addrs[k]);
            ip_ok(&["link", "set", veth, "netns", ns]);
            ip_ok(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", veth]);
            ip_ok(&["-n", ns, "link", "set", veth, "up"]);
            ip_ok(&["-n", ns, "link", "set", "lo", "up"]);
        }
        hosts
    }

    /// Takes host 1's end of the link down (both ends lose carrier: nothing crosses).
    fn cut(&self) {
        ip_ok(&[
            "-n",
            &self.namespaces[1],
            "link",
            "set",
            &self.veths[1],
            "down",
        ]);
    }

    /// Brings host 1's end back up (the addresses stay configured across down/up).
    fn restore(&self) {
        ip_ok(&[
            "-n",
            &self.namespaces[1],
            "link",
            "set",
            &self.veths[1],
            "up",
        ]);
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        // Deleting a namespace destroys the veth end inside it, and with it the peer end. A
        // veth that never got moved is still in this namespace: delete it by name (an error
        // just means it is gone already).
        for ns in &self.namespaces {
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = ip(&["link", "del", &self.veths[0]]);
    }
}

/// A launcher process that is SIGKILLed on drop if it is still running (its ranks die with
/// it: `PR_SET_PDEATHSIG`), so a failing test leaves nothing behind.
struct Launcher {
    child: Child,
    stderr: PathBuf,
}

impl Launcher {
    /// Waits until the launcher exits or `deadline` passes (then `None`).
    fn wait_until(&mut self, deadline: Instant) -> Option<ExitStatus> {
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The flags every run shares: the tiny model, 4 ranks on a 2x2 HSDP mesh, 2 sequences per
/// rank, a checkpoint every 2 steps, and the stall watchdog off (these tests are about the op
/// deadline across hosts; tests/stall.rs covers the watchdog).
fn common_args(out: &Path) -> Vec<String> {
    [
        "train",
        "--on-stall",
        "off",
        "--model",
        "tiny",
        "--mesh",
        "2x2",
        "--batch-size",
        "2",
        "--steps",
        &STEPS.to_string(),
        "--warmup-steps",
        "2",
        "--checkpoint-every",
        "2",
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([out.display().to_string()])
    .collect()
}

/// The environment of every run: the op deadline, TCP between all ranks (the two "hosts"
/// share /dev/shm, which real hosts do not), no fault, and one job secret shared by both
/// launchers (a multi-node launcher takes it from the environment).
fn job_env(command: &mut Command) {
    command
        .env("HYPERSHARD_TIMEOUT", TIMEOUT_S.to_string())
        .env("HYPERSHARD_TRANSPORT", "tcp")
        .env(
            "HYPERSHARD_JOB_SECRET",
            format!("netns-test-secret-{}", std::process::id()),
        )
        .env_remove("HYPERSHARD_JOB_SECRET_FILE")
        .env_remove("HYPERSHARD_FAULT")
        .env_remove("HYPERSHARD_BACKEND")
        .stdin(Stdio::null());
}

/// Starts host `node`'s launcher inside its namespace: `ip netns exec` execs the launcher
/// itself, so the child is the launcher.
fn start_node(hosts: &TwoHosts, node: usize, port: u16, out: &Path, extra: &[&str]) -> Launcher {
    let stderr = log_path(out, Some(node), port);
    let mut command = Command::new(ip_binary());
    command
        .args(["netns", "exec", &hosts.namespaces[node]])
        .arg(hypershard())
        .args(common_args(out))
        .args([
            "--nproc",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            &node.to_string(),
            "--master-addr",
            &hosts.addrs[0],
            "--master-port",
            &port.to_string(),
        ])
        .args(extra);
    job_env(&mut command);
    command
        .stdout(Stdio::null())
        .stderr(File::create(&stderr).unwrap());
    Launcher {
        child: command.spawn().expect("ip netns exec hypershard starts"),
        stderr,
    }
}

/// Runs both hosts' launchers to completion (bounded by [`RUN_DEADLINE`]) and checks both
/// succeed.
fn run_two_hosts(hosts: &TwoHosts, port: u16, out: &Path, extra: &[&str]) -> Duration {
    let started = Instant::now();
    let mut nodes = [0, 1].map(|node| start_node(hosts, node, port, out, extra));
    for (node, launcher) in nodes.iter_mut().enumerate() {
        let status = launcher.wait_until(started + RUN_DEADLINE);
        assert!(
            status.is_some_and(|s| s.success()),
            "node {node} {status:?} within {RUN_DEADLINE:?}: {}\n--- node 0: {}",
            launcher.stderr(),
            nodes_stderr(&[0], out, port)
        );
    }
    started.elapsed()
}

/// The saved stderr of the given nodes of the run on `port` (for failure messages).
fn nodes_stderr(nodes: &[usize], out: &Path, port: u16) -> String {
    nodes
        .iter()
        .map(|node| std::fs::read_to_string(log_path(out, Some(*node), port)).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The same job on one host: one launcher, 4 ranks, 127.0.0.1. Computed once.
fn one_host() -> &'static BTreeMap<u64, f64> {
    static ONE_HOST: OnceLock<BTreeMap<u64, f64>> = OnceLock::new();
    ONE_HOST.get_or_init(|| {
        let out = scratch("one-host");
        let mut command = Command::new(hypershard());
        command.args(common_args(&out)).args(["--nproc", "4"]);
        job_env(&mut command);
        let stderr = log_path(&out, None, 0);
        let mut launcher = Launcher {
            child: command
                .stdout(Stdio::null())
                .stderr(File::create(&stderr).unwrap())
                .spawn()
                .expect("hypershard runs"),
            stderr,
        };
        let status = launcher.wait_until(Instant::now() + RUN_DEADLINE);
        assert!(
            status.is_some_and(|s| s.success()),
            "one-host run {status:?}: {}",
            launcher.stderr()
        );
        let losses = losses(&out);
        assert_eq!(losses.len() as u64, STEPS, "{losses:?}");
        losses
    })
}

#[test]
fn two_hosts_over_a_veth_train_to_the_losses_of_one_host() {
    let _serial = serial();
    let reference = one_host();
    let hosts = TwoHosts::create(0);
    let out = scratch("two-hosts");
    let took = run_two_hosts(&hosts, BASE_PORT, &out, &[]);
    // Same global ranks, same mesh, same reduction order: bitwise the same losses.
    assert_eq!(&losses(&out), reference, "two hosts vs one host");
    eprintln!("two hosts, {STEPS} steps: {took:?}");
}

#[test]
fn a_link_cut_mid_run_fails_both_hosts_in_bounded_time_and_resume_matches() {
    let _serial = serial();
    let reference = one_host();
    let hosts = TwoHosts::create(1);
    let out = scratch("cut");
    let latest = out.join("checkpoints").join("latest");
    let started = Instant::now();
    let port = BASE_PORT + 1;
    let mut nodes = [0, 1].map(|node| start_node(&hosts, node, port, &out, &[]));

    // Cut the link as soon as the first checkpoint (step 2) is committed.
    while !latest.exists() {
        for (node, launcher) in nodes.iter_mut().enumerate() {
            assert!(
                launcher.is_running(),
                "node {node} ended before the first checkpoint: {}",
                launcher.stderr()
            );
        }
        assert!(
            started.elapsed() < RUN_DEADLINE,
            "no checkpoint within {RUN_DEADLINE:?}: {}",
            nodes_stderr(&[0, 1], &out, port)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    hosts.cut();
    let cut_at = Instant::now();
    let done_before_cut = losses(&out).len() as u64;
    assert!(
        done_before_cut < STEPS,
        "the run finished before the cut; nothing was cut mid-run"
    );

    for (node, launcher) in nodes.iter_mut().enumerate() {
        let status = launcher.wait_until(cut_at + CUT_DEADLINE);
        let text = launcher.stderr();
        let status = status.unwrap_or_else(|| {
            panic!("node {node} still running {CUT_DEADLINE:?} after the cut: {text}")
        });
        assert!(!status.success(), "node {node} must fail: {text}");
        // The launcher names the rank that failed first on its host, and some rank of that
        // host failed on the op deadline (not a hang, not a crash).
        assert!(
            text.contains("failed with exit code"),
            "node {node} names the failed rank: {text}"
        );
        assert!(
            text.contains(&format!("timed out after {TIMEOUT_S}s")),
            "node {node}: a rank times out waiting for the other host: {text}"
        );
    }
    let failed_after = cut_at.elapsed();

    // The newest committed checkpoint loads in full (CRC32C verified).
    let checkpoint = Checkpoint::open(&out).unwrap();
    let saved = checkpoint.step();
    assert!(
        saved >= 2 && saved.is_multiple_of(2) && saved < STEPS,
        "checkpoint of step {saved}"
    );
    for name in checkpoint.metadata().tensors.keys() {
        checkpoint.read_tensor(name).unwrap();
    }
    // What was trained before the cut matches the reference step by step.
    let partial = losses(&out);
    for (step, loss) in &partial {
        assert_eq!(
            reference.get(step),
            Some(loss),
            "step {step} before the cut"
        );
    }

    hosts.restore();
    let before = recorded_steps(&out).len();
    run_two_hosts(&hosts, port + 1, &out, &["--resume"]);
    // The resumed run started at the checkpoint (its records follow the cut run's), not from
    // scratch, and the whole curve is the one-host curve.
    let resumed = recorded_steps(&out).split_off(before);
    assert_eq!(
        resumed,
        (saved..STEPS).collect::<Vec<_>>(),
        "steps the resume trained"
    );
    assert_eq!(
        &losses(&out),
        reference,
        "resumed after the cut vs one host"
    );
    eprintln!(
        "link cut after {done_before_cut} steps (checkpoint of step {saved}); both hosts \
         failed {failed_after:?} after the cut; whole test {:?}",
        started.elapsed()
    );
}
