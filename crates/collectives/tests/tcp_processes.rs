//! Real processes: this binary spawns itself once per rank (torchrun-style environment read by
//! `tcp::init_from_env`, rank 0 hosting the store).
//!
//! 1. The conformance suite over real processes at world sizes 2, 3 and 4, while a stray
//!    client sends garbage to the store's port and another connects and stays silent: the
//!    job must not notice.
//! 2. A world of 3 checks an all-reduce, then rank 2 is killed with SIGKILL while ranks 0 and 1
//!    wait in an all-reduce it never joins: both must fail with `PeerLost` or `Timeout` well
//!    within their deadline, and no process may hang.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use hypershard_collectives::conformance::{self, SuiteParams};
use hypershard_collectives::tcp::{TcpConfig, init_from_env};
use hypershard_collectives::{Buffer, Communicator, DType, Error, ReduceOp};

const KILL_WORLD: usize = 3;
const VICTIM: usize = 2;
/// Set in every rank process; its value names what the rank does.
const CHILD_VAR: &str = "HYPERSHARD_TCP_PROCESS_CHILD";
const CONFORMANCE: &str = "conformance";
const KILL: &str = "kill";
/// Long enough that only a detected peer loss (not the deadline) ends the last op quickly.
const OP_TIMEOUT: Duration = Duration::from_secs(20);
/// Small enough that the suite's larger cases cross many segment boundaries.
const SEGMENT_BYTES: usize = 256;

fn tcp_config() -> TcpConfig {
    TcpConfig::default()
        .with_segment_bytes(SEGMENT_BYTES)
        .with_rendezvous_timeout(Duration::from_secs(20))
}

/// A rank of the conformance job: the whole suite, then a barrier so no rank leaves while
/// another still needs it.
fn conformance_child() -> ExitCode {
    // The op timeout comes from HYPERSHARD_TIMEOUT, set by the parent.
    let world = init_from_env(&tcp_config()).expect("tcp world");
    let comm = world.comm.as_ref();
    match conformance::run_all(comm, &SuiteParams::new(SEGMENT_BYTES)) {
        Ok(report) if report.cases > 1000 => {}
        Ok(report) => {
            eprintln!("rank {}: only {} cases", comm.rank(), report.cases);
            return ExitCode::from(5);
        }
        Err(failure) => {
            eprintln!("rank {}: {failure}", comm.rank());
            return ExitCode::from(6);
        }
    }
    match comm.barrier() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rank {}: final barrier: {e}", comm.rank());
            ExitCode::from(7)
        }
    }
}

fn kill_child() -> ExitCode {
    let world = init_from_env(&tcp_config()).expect("tcp world");
    let comm = world.comm.as_ref();
    // rank r contributes r + i; the sum over 3 ranks is 3 + 3i.
    let values: Vec<f32> = (0..1000).map(|i| (comm.rank() + i) as f32).collect();
    let sum = comm
        .all_reduce(Buffer::from_vec(values), ReduceOp::Sum)
        .expect("all-reduce")
        .into_vec::<f32>()
        .expect("f32");
    let expected: Vec<f32> = (0..1000).map(|i| (3 + 3 * i) as f32).collect();
    if sum != expected {
        eprintln!("rank {}: wrong all-reduce result", comm.rank());
        return ExitCode::from(2);
    }
    comm.barrier().expect("barrier");
    if comm.rank() == VICTIM {
        println!("ready");
        // Wait to be killed; the parent's deadline bounds this.
        std::thread::sleep(Duration::from_secs(60));
        return ExitCode::from(3);
    }
    let start = Instant::now();
    let result = comm.all_reduce(Buffer::zeros(DType::F32, 4096), ReduceOp::Sum);
    let fast = start.elapsed() < OP_TIMEOUT;
    match result {
        Err(Error::PeerLost { .. } | Error::Timeout { .. }) if fast => ExitCode::SUCCESS,
        other => {
            eprintln!(
                "rank {}: expected PeerLost or Timeout, got {other:?}",
                comm.rank()
            );
            ExitCode::from(4)
        }
    }
}

/// Spawns `world` rank processes doing `mode`; returns them and the store's port.
fn launch(world: usize, mode: &str) -> (Vec<Child>, u16) {
    // A port for the store that rank 0 binds; see `unused_port` for why not port 0's.
    let port = hypershard_testkit::unused_port();
    let exe = std::env::current_exe().expect("own path");
    let children = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .env(CHILD_VAR, mode)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("HYPERSHARD_TIMEOUT", OP_TIMEOUT.as_secs().to_string())
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn rank")
        })
        .collect();
    (children, port)
}

/// Waits for every child until `deadline` (then kills what is left); returns whether every
/// rank other than `skip` exited successfully.
fn reap(children: &mut [Child], skip: Option<usize>, deadline: Instant) -> bool {
    let mut ok = true;
    for (rank, child) in children.iter_mut().enumerate() {
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
            }
        };
        if Some(rank) != skip && !status.is_some_and(|s| s.success()) {
            eprintln!("rank {rank}: {status:?}");
            ok = false;
        }
    }
    ok
}

/// Connects to the store port once rank 0 listens, bounded by `deadline`.
fn connect_when_listening(port: u16, deadline: Instant) -> Option<TcpStream> {
    while Instant::now() < deadline {
        if let Ok(stream) = TcpStream::connect(("127.0.0.1", port)) {
            return Some(stream);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// The conformance suite at one world size, with two stray clients on the store's port.
fn conformance_job(world: usize) -> bool {
    let start = Instant::now();
    let deadline = start + Duration::from_secs(60);
    let (mut children, port) = launch(world, CONFORMANCE);
    let garbage = connect_when_listening(port, deadline).map(|mut stream| {
        // Not the store's hello: the server drops this connection with a warning.
        let _ = stream.write_all(&[0x5a; 64]);
        stream
    });
    // Connects and says nothing; it must not hold anything up.
    let silent = connect_when_listening(port, deadline);
    let ok = reap(&mut children, None, deadline);
    drop((garbage, silent));
    eprintln!(
        "tcp_processes: conformance at world {world}: {} in {:?}",
        if ok { "ok" } else { "FAILED" },
        start.elapsed()
    );
    ok
}

fn kill_job() -> bool {
    let (mut children, _) = launch(KILL_WORLD, KILL);
    let start = Instant::now();
    let victim_out = children[VICTIM].stdout.take().expect("piped stdout");
    let mut line = String::new();
    let ready = BufReader::new(victim_out).read_line(&mut line).is_ok() && line.trim() == "ready";
    let _ = children[VICTIM].kill();
    let ok = reap(&mut children, Some(VICTIM), start + Duration::from_secs(40));
    let elapsed = start.elapsed();
    let fast = elapsed < Duration::from_secs(15);
    eprintln!("tcp_processes: kill test: ready {ready}, ok {ok}, {elapsed:?}");
    ready && ok && fast
}

fn main() -> ExitCode {
    match std::env::var(CHILD_VAR).as_deref() {
        Ok(CONFORMANCE) => return conformance_child(),
        Ok(KILL) => return kill_child(),
        _ => {}
    }
    let mut ok = true;
    for world in [2, 3, 4] {
        ok &= conformance_job(world);
    }
    ok &= kill_job();
    if ok {
        println!("tcp_processes: ok");
        ExitCode::SUCCESS
    } else {
        eprintln!("tcp_processes: failed");
        ExitCode::FAILURE
    }
}
