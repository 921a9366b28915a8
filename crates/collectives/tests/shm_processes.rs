//! Real processes over the shared-memory transport: this binary spawns itself once per rank
//! (torchrun-style environment read by `tcp::init_from_env`, rank 0 hosting the store) with
//! `HYPERSHARD_TRANSPORT=shm`, tiny segments and tiny rings, so every message wraps around
//! its ring many times.
//!
//! 1. The conformance suite at world sizes 2, 3 and 4; every rank checks that it reaches
//!    every peer through shared memory.
//! 2. A world of 3 runs all-reduces in a loop; once all are inside the loop, rank 2 is killed
//!    with SIGKILL. Ranks 0 and 1 must fail with `PeerLost` or `Timeout` well within their
//!    deadline, and no segment of any rank may be left in `/dev/shm` (they are unlinked as
//!    soon as the peer has mapped them, before any op runs).
//!
//! Both run twice: with the single-copy path off (`HYPERSHARD_SHM_CMA=0`: every byte through
//! the rings) and on with a 64-byte threshold (`HYPERSHARD_SHM_CMA_MIN_BYTES=64`: nearly
//! every segment lent and read out of the sender), and every rank checks with
//! `shm::cross_memory_reads` that the path it expects is the one that ran. In the kill test
//! with lending on, the victim dies with its peers waiting for the release of lent segments,
//! or reading out of it.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use hypershard_collectives::conformance::{self, SuiteParams};
use hypershard_collectives::shm::{CMA_ENV, CMA_MIN_BYTES_ENV, TRANSPORT_ENV, TransportPolicy};
use hypershard_collectives::tcp::{TcpConfig, init_from_env};
use hypershard_collectives::testing::{CmaConfig, SEGMENT_DIR, SEGMENT_PREFIX, cross_memory_reads};
use hypershard_collectives::{Buffer, Communicator, Error, ReduceOp};

const KILL_WORLD: usize = 3;
const VICTIM: usize = 2;
/// Set in every rank process; its value names what the rank does.
const CHILD_VAR: &str = "HYPERSHARD_SHM_PROCESS_CHILD";
const CONFORMANCE: &str = "conformance";
const KILL: &str = "kill";
/// Long enough that only a detected peer loss (not the deadline) ends the last op quickly.
const OP_TIMEOUT: Duration = Duration::from_secs(20);
/// Small enough that the suite's larger cases cross many segment boundaries.
const SEGMENT_BYTES: usize = 256;
/// Rings of 1 KiB: a few messages each, so the suite wraps around them constantly and
/// senders often find them full.
const RING_BYTES: usize = 1024;

/// The threshold of the runs with lending on: everything but the smallest segments is lent.
const CMA_MIN_BYTES: usize = 64;

/// Whether this rank's single-copy path ran as the parent asked: some lent reads with it on,
/// none with it off.
fn cma_as_expected(rank: usize) -> bool {
    let on = CmaConfig::from_env().expect("cma variables").enabled;
    let reads = cross_memory_reads();
    if on != (reads > 0) {
        eprintln!("rank {rank}: cma on {on}, but {reads} cross-memory reads");
        return false;
    }
    true
}

fn tcp_config() -> TcpConfig {
    TcpConfig::default()
        .with_segment_bytes(SEGMENT_BYTES)
        .with_shm_ring_bytes(RING_BYTES)
        .with_transport(TransportPolicy::Auto)
        .with_rendezvous_timeout(Duration::from_secs(20))
}

/// A rank of the conformance job: checks that every peer is reached through shared memory,
/// runs the whole suite, then a barrier so no rank leaves while another still needs it.
fn conformance_child() -> ExitCode {
    // HYPERSHARD_TRANSPORT=shm (set by the parent) overrides the config's `auto`.
    let world = init_from_env(&tcp_config()).expect("tcp world");
    let comm = world.comm.as_ref();
    let expected: Vec<usize> = (0..comm.size()).filter(|&p| p != comm.rank()).collect();
    if world.comm.shm_peers() != expected {
        eprintln!(
            "rank {}: shm peers {:?}, expected {expected:?}",
            comm.rank(),
            world.comm.shm_peers()
        );
        return ExitCode::from(8);
    }
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
    if !cma_as_expected(comm.rank()) {
        return ExitCode::from(9);
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
    if world.comm.shm_peers().len() != KILL_WORLD - 1 {
        eprintln!("rank {}: not on shared memory", comm.rank());
        return ExitCode::from(8);
    }
    // 64 Ki f32 per all-reduce (256 KiB, about a thousand segments through 1 KiB rings):
    // rank r contributes r + i; the sum over 3 ranks is 3 + 3i.
    let n = 1 << 16;
    let expected: Vec<f32> = (0..n).map(|i| (3 + 3 * i) as f32).collect();
    let mut rounds = 0u64;
    loop {
        let values: Vec<f32> = (0..n).map(|i| (comm.rank() + i) as f32).collect();
        let start = Instant::now();
        match comm.all_reduce(Buffer::from_vec(values), ReduceOp::Sum) {
            Ok(sum) => {
                if sum.into_vec::<f32>().expect("f32") != expected {
                    eprintln!("rank {}: wrong all-reduce result", comm.rank());
                    return ExitCode::from(2);
                }
            }
            Err(Error::PeerLost { .. } | Error::Timeout { .. })
                if comm.rank() != VICTIM && rounds > 0 && start.elapsed() < OP_TIMEOUT =>
            {
                if !cma_as_expected(comm.rank()) {
                    return ExitCode::from(9);
                }
                return ExitCode::SUCCESS;
            }
            Err(other) => {
                eprintln!("rank {}: round {rounds}: {other:?}", comm.rank());
                return ExitCode::from(4);
            }
        }
        rounds += 1;
        if rounds == 3 && comm.rank() == VICTIM {
            // The parent kills this rank now, while it and the others keep all-reducing.
            println!("ready");
        }
        if rounds > 100_000 {
            return ExitCode::from(3);
        }
    }
}

/// Spawns `world` rank processes doing `mode`, lending segments of at least
/// [`CMA_MIN_BYTES`] when `cma` is on.
fn launch(world: usize, mode: &str, cma: bool) -> Vec<Child> {
    // A port for the store that rank 0 binds; see `unused_port` for why not port 0's.
    let port = hypershard_testkit::unused_port();
    let exe = std::env::current_exe().expect("own path");
    (0..world)
        .map(|rank| {
            Command::new(&exe)
                .env(CHILD_VAR, mode)
                .env(TRANSPORT_ENV, "shm")
                .env(CMA_ENV, if cma { "1" } else { "0" })
                .env(CMA_MIN_BYTES_ENV, CMA_MIN_BYTES.to_string())
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
        .collect()
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

/// The segment files in /dev/shm created by any of `pids`.
fn leftover_segments(pids: &[u32]) -> Vec<String> {
    let prefixes: Vec<String> = pids
        .iter()
        .map(|pid| format!("{SEGMENT_PREFIX}{pid}-"))
        .collect();
    std::fs::read_dir(Path::new(SEGMENT_DIR))
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|name| prefixes.iter().any(|p| name.starts_with(p)))
                .collect()
        })
        .unwrap_or_default()
}

fn conformance_job(world: usize, cma: bool) -> bool {
    let start = Instant::now();
    let mut children = launch(world, CONFORMANCE, cma);
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    let ok = reap(&mut children, None, start + Duration::from_secs(60));
    let left = leftover_segments(&pids);
    eprintln!(
        "shm_processes: conformance at world {world}, cma {cma}: {} in {:?}{}",
        if ok { "ok" } else { "FAILED" },
        start.elapsed(),
        if left.is_empty() {
            String::new()
        } else {
            format!(", LEFT IN /dev/shm: {left:?}")
        }
    );
    ok && left.is_empty()
}

fn kill_job(cma: bool) -> bool {
    let mut children = launch(KILL_WORLD, KILL, cma);
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    let start = Instant::now();
    let victim_out = children[VICTIM].stdout.take().expect("piped stdout");
    let mut line = String::new();
    let ready = BufReader::new(victim_out).read_line(&mut line).is_ok() && line.trim() == "ready";
    // The ranks are all-reducing now; their segments must already be gone from /dev/shm.
    let during = leftover_segments(&pids);
    let killed_at = Instant::now();
    let _ = children[VICTIM].kill();
    let ok = reap(
        &mut children,
        Some(VICTIM),
        killed_at + Duration::from_secs(40),
    );
    let after_kill = killed_at.elapsed();
    let left = leftover_segments(&pids);
    let fast = after_kill < Duration::from_secs(15);
    eprintln!(
        "shm_processes: kill test, cma {cma}: ready {ready}, ok {ok}, survivors done {after_kill:?} after the kill ({:?} in all), /dev/shm during {during:?}, after {left:?}",
        start.elapsed()
    );
    ready && ok && fast && during.is_empty() && left.is_empty()
}

fn main() -> ExitCode {
    match std::env::var(CHILD_VAR).as_deref() {
        Ok(CONFORMANCE) => return conformance_child(),
        Ok(KILL) => return kill_child(),
        _ => {}
    }
    let mut ok = true;
    for cma in [false, true] {
        for world in [2, 3, 4] {
            ok &= conformance_job(world, cma);
        }
        ok &= kill_job(cma);
    }
    if ok {
        println!("shm_processes: ok");
        ExitCode::SUCCESS
    } else {
        eprintln!("shm_processes: failed");
        ExitCode::FAILURE
    }
}
