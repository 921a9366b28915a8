//! Real processes: this binary spawns itself once per rank (torchrun-style environment read by
//! `tcp::init_from_env`, rank 0 hosting the store), checks an all-reduce across the processes, then kills rank 2 with
//! SIGKILL while ranks 0 and 1 wait in an all-reduce it never joins: both must fail with
//! `PeerLost` or `Timeout` well within their deadline, and no process may hang.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use hypershard_collectives::tcp::{TcpConfig, init_from_env};
use hypershard_collectives::{Buffer, Communicator, DType, Error, ReduceOp};

const WORLD: usize = 3;
const VICTIM: usize = 2;
const CHILD_VAR: &str = "HYPERSHARD_TCP_PROCESS_CHILD";
/// Long enough that only a detected peer loss (not the deadline) ends the last op quickly.
const OP_TIMEOUT: Duration = Duration::from_secs(20);

fn child() -> ExitCode {
    let tcp = TcpConfig::default()
        .with_segment_bytes(256)
        .with_rendezvous_timeout(Duration::from_secs(20));
    // The op timeout comes from HYPERSHARD_TIMEOUT, set by the parent.
    let world = init_from_env(&tcp).expect("tcp world");
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

fn main() -> ExitCode {
    if std::env::var_os(CHILD_VAR).is_some() {
        return child();
    }
    // A free port for the store: bind port 0, read it, release it for rank 0 to take.
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let exe = std::env::current_exe().expect("own path");
    let mut children: Vec<_> = (0..WORLD)
        .map(|rank| {
            Command::new(&exe)
                .env(CHILD_VAR, "1")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", WORLD.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", WORLD.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("HYPERSHARD_TIMEOUT", OP_TIMEOUT.as_secs().to_string())
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn rank")
        })
        .collect();
    let start = Instant::now();
    let victim_out = children[VICTIM].stdout.take().expect("piped stdout");
    let mut line = String::new();
    let ready = BufReader::new(victim_out).read_line(&mut line).is_ok() && line.trim() == "ready";
    let _ = children[VICTIM].kill();
    let mut ok = ready;
    for (rank, child) in children.iter_mut().enumerate() {
        // Bounded wait: poll until the overall deadline, then kill what is left.
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if start.elapsed() < Duration::from_secs(40) => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                _ => {
                    let _ = child.kill();
                    break None;
                }
            }
        };
        if rank != VICTIM && !status.is_some_and(|s| s.success()) {
            eprintln!("rank {rank}: {status:?}");
            ok = false;
        }
    }
    let elapsed = start.elapsed();
    if ok && elapsed < Duration::from_secs(15) {
        println!("tcp_processes: ok in {elapsed:?}");
        ExitCode::SUCCESS
    } else {
        eprintln!("tcp_processes: failed (ready: {ready}, elapsed {elapsed:?})");
        ExitCode::FAILURE
    }
}
