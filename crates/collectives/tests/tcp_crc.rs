//! Per-frame CRC32C checksums on the TCP backend (`TcpConfig::frame_checksum`), end to end:
//! every rank is a thread of this process with its own [`TcpCommunicator`] over 127.0.0.1.
//!
//! - The ops give their closed-form values with checksums on, at world 3 with lengths that
//!   world 3 does not divide, with segments larger than the reader's staging chunk (so the
//!   running checksum spans chunks and frames) and with tiny segments (the conformance suite).
//! - Ranks that disagree on the setting fail their rendezvous at once, both of them, with a
//!   typed error naming both ranks and both settings.
//! - A byte flipped on the wire (by a proxy between two ranks) fails the op with
//!   `ProtocolViolation::ChecksumFailed` on the receiving rank, and every rank's op fails
//!   within the deadline.
//! - `HYPERSHARD_CRC32C` turns checksums on for `Mesh::establish` (checked in child processes,
//!   since the environment is process-wide).
//!
//! The meshes are built with `Mesh::establish_with_secret`, which takes the config as it is,
//! so a `HYPERSHARD_CRC32C` in the test's own environment cannot change what is tested.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use hypershard_collectives::conformance::{self, SuiteParams};
use hypershard_collectives::tcp::{AllReduceAlgorithm, CRC32C_VAR, TcpCommunicator, TcpConfig};
use hypershard_collectives::testing::Mesh;
use hypershard_collectives::{
    Buffer, CommConfig, Communicator, DType, Error, MemoryStore, ProtocolViolation, ReduceOp,
    Result, Store,
};
use hypershard_testkit::{run_ranks, run_ranks_with_deadline};

/// Larger than the reader's 256 KiB staging chunk, and not a multiple of it.
const LARGE_SEGMENT: usize = 300_000;

fn config(checksum: bool, segment_bytes: usize) -> TcpConfig {
    TcpConfig::default()
        .with_frame_checksum(checksum)
        .with_segment_bytes(segment_bytes)
        .with_rendezvous_timeout(Duration::from_secs(20))
}

/// Rank `rank`'s communicator over a mesh built through `store` with `tcp` as given.
fn join(
    store: &dyn Store,
    rank: usize,
    size: usize,
    tcp: &TcpConfig,
    timeout: Duration,
) -> Result<TcpCommunicator> {
    let mesh = Mesh::establish_with_secret(store, rank, size, tcp, None)?;
    assert_eq!(mesh.frame_checksum(), tcp.frame_checksum, "rank {rank}");
    TcpCommunicator::from_mesh(mesh, tcp, CommConfig::default().with_timeout(timeout))
}

fn world(size: usize, tcp: TcpConfig) -> Vec<Arc<TcpCommunicator>> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    run_ranks(size, move |rank| {
        join(store.as_ref(), rank, size, &tcp, Duration::from_secs(30)).map(Arc::new)
    })
    .unwrap()
}

/// Rank `r`'s element `i`: small integers, so every sum is exact in f32.
fn value(rank: usize, i: usize) -> f32 {
    ((i * 7 + rank * 13) % 1000) as f32
}

fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| value(rank, i)).collect()
}

fn vec_of(buffer: Buffer) -> Vec<f32> {
    buffer.into_host().unwrap().into_vec::<f32>().unwrap()
}

/// Runs all-reduce, all-gather, reduce-scatter, broadcast and all-to-all on `comm` and checks
/// each against its closed form.
fn check_ops(comm: &TcpCommunicator) -> Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    // All-reduce: 300_001 elements, blocks of 100_000-odd elements (400 KB) over 300 KB
    // segments.
    let len = 300_001;
    let reduced = vec_of(comm.all_reduce(Buffer::from_vec(input(rank, len)), ReduceOp::Sum)?);
    let expected: Vec<f32> = (0..len)
        .map(|i| (0..n).map(|r| value(r, i)).sum())
        .collect();
    assert_eq!(reduced, expected, "all_reduce on rank {rank}");

    // All-gather: rank-major concatenation of every rank's 100_001 elements.
    let m = 100_001;
    let pair = comm.all_gather(
        Buffer::from_vec(input(rank, m)),
        Buffer::zeros(DType::F32, n * m),
    )?;
    let expected: Vec<f32> = (0..n).flat_map(|r| input(r, m)).collect();
    assert_eq!(vec_of(pair.output), expected, "all_gather on rank {rank}");

    // Reduce-scatter: rank r gets block r of the sum.
    let pair = comm.reduce_scatter(
        Buffer::from_vec(input(rank, n * m)),
        Buffer::zeros(DType::F32, m),
        ReduceOp::Sum,
    )?;
    let expected: Vec<f32> = (0..m)
        .map(|i| (0..n).map(|r| value(r, rank * m + i)).sum())
        .collect();
    assert_eq!(
        vec_of(pair.output),
        expected,
        "reduce_scatter on rank {rank}"
    );

    // Broadcast from rank 1 (the chain for this size).
    let len = 250_007;
    let mine = if rank == 1 {
        input(1, len)
    } else {
        vec![0.0; len]
    };
    let got = vec_of(comm.broadcast(Buffer::from_vec(mine), 1)?);
    assert_eq!(got, input(1, len), "broadcast on rank {rank}");

    // All-to-all: block j of the output is block `rank` of rank j's input.
    let block = 50_001;
    let pair = comm.all_to_all(
        Buffer::from_vec(input(rank, n * block)),
        Buffer::zeros(DType::F32, n * block),
    )?;
    let expected: Vec<f32> = (0..n)
        .flat_map(|j| (0..block).map(move |i| value(j, rank * block + i)))
        .collect();
    assert_eq!(vec_of(pair.output), expected, "all_to_all on rank {rank}");
    Ok(())
}

#[test]
fn ops_with_checksums_give_closed_form_values_at_world_three() {
    for algorithm in [AllReduceAlgorithm::Auto, AllReduceAlgorithm::Ring] {
        let comms = world(3, config(true, LARGE_SEGMENT).with_all_reduce(algorithm));
        run_ranks(3, move |rank| check_ops(&comms[rank]))
            .unwrap_or_else(|e| panic!("{algorithm:?}: {e}"));
    }
}

#[test]
fn the_conformance_suite_passes_with_checksums_and_tiny_segments() {
    // 256-byte segments: every ring step, chain hop and message spans several frames.
    for size in [2, 3] {
        let comms = world(size, config(true, 256));
        let reports = run_ranks(size, move |rank| {
            conformance::run_all(comms[rank].as_ref(), &SuiteParams::new(256))
        })
        .unwrap_or_else(|e| panic!("world {size}: {e}"));
        for report in &reports {
            assert!(report.cases > 1000, "world {size}: {} cases", report.cases);
        }
    }
}

#[test]
fn ranks_that_disagree_on_checksums_both_fail_the_rendezvous_at_once() {
    for (zero, one) in [(true, false), (false, true)] {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let started = Instant::now();
        let outcomes = run_ranks(2, move |rank| {
            let on = if rank == 0 { zero } else { one };
            let outcome =
                Mesh::establish_with_secret(store.as_ref(), rank, 2, &config(on, 1 << 20), None);
            Ok::<_, Error>(outcome.err())
        })
        .unwrap();
        // Well before the 20 s rendezvous deadline: nobody waits it out.
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            let (ours, theirs) = if rank == 0 { (zero, one) } else { (one, zero) };
            let peer = 1 - rank;
            let error = outcome.unwrap_or_else(|| panic!("rank {rank} joined a mismatched mesh"));
            let text = error.to_string();
            match error {
                Error::Protocol {
                    peer: Some(p),
                    violation:
                        ProtocolViolation::ChecksumSettingMismatch {
                            rank: r,
                            ours: o,
                            peer: q,
                            theirs: t,
                        },
                } => {
                    assert_eq!((p, r, q), (peer, rank as u64, peer as u64), "rank {rank}");
                    assert_eq!((o, t), (ours, theirs), "rank {rank}");
                }
                other => panic!("rank {rank}: {other:?}"),
            }
            // The message names both ranks and both settings.
            let state = |on: bool| if on { "on" } else { "off" };
            let said = format!(
                "rank {rank} has per-frame CRC32C checksums {} but rank {peer} has them {}",
                state(ours),
                state(theirs)
            );
            assert!(text.contains(&said), "{text}");
        }
    }
}

/// A store that hands rank `victim` the address of a proxy instead of rank 0's listener.
struct Rewriting {
    inner: Arc<dyn Store>,
    proxy: String,
}

impl Store for Rewriting {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        if key == "tcp/addr/0" {
            return Ok(self.proxy.as_bytes().to_vec());
        }
        self.inner.get(key, timeout)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.inner.wait(keys, timeout)
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.inner.check(keys)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(key, delta)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(key, expected, desired)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(key)
    }
    fn num_keys(&self) -> Result<usize> {
        self.inner.num_keys()
    }
}

/// Copies `from` to `to` until either side closes, flipping bit 3 of the byte at stream
/// offset `flip_at` (when given) on the way.
fn pump(mut from: TcpStream, mut to: TcpStream, flip_at: Option<usize>) {
    let mut buffer = vec![0u8; 64 * 1024];
    let mut offset = 0usize;
    loop {
        let n = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(at) = flip_at
            && (offset..offset + n).contains(&at)
        {
            buffer[at - offset] ^= 0x08;
        }
        offset += n;
        if to.write_all(&buffer[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

/// Starts a one-connection proxy to rank 0's listener (looked up in `store` once a client
/// arrives) that corrupts one byte of what the client sends at `flip_at`; returns its address.
fn corrupting_proxy(store: Arc<dyn Store>, flip_at: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    thread::spawn(move || {
        let Ok((client, _)) = listener.accept() else {
            return;
        };
        let Ok(target) = store.get("tcp/addr/0", Duration::from_secs(20)) else {
            return;
        };
        let target = String::from_utf8(target).unwrap();
        let Ok(server) = TcpStream::connect(target) else {
            return;
        };
        let (client_in, server_out) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let upstream = thread::spawn(move || pump(client_in, server_out, Some(flip_at)));
        pump(server, client, None);
        let _ = upstream.join();
    });
    address
}

#[test]
fn a_byte_flipped_on_the_wire_fails_the_op_on_every_rank_within_the_deadline() {
    // Rank 2 reaches rank 0 through the proxy; in a ring all-reduce rank 2 sends its data to
    // rank 0. What rank 2 sends starts with the handshake (hello 40 + nonce 32 + proof 32 =
    // 104 bytes), then the all-reduce's descriptor frame (well under 2 KB), then 64 KiB data
    // segments: offset 104 + 32_000 lies inside the first data segment's payload.
    const TIMEOUT: Duration = Duration::from_secs(4);
    let flip_at = 104 + 32_000;
    let shared: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let proxy = corrupting_proxy(Arc::clone(&shared), flip_at);
    let tcp = config(true, 64 * 1024).with_all_reduce(AllReduceAlgorithm::Ring);
    let comms = run_ranks(3, move |rank| {
        let store: Arc<dyn Store> = if rank == 2 {
            Arc::new(Rewriting {
                inner: Arc::clone(&shared),
                proxy: proxy.clone(),
            })
        } else {
            Arc::clone(&shared)
        };
        join(store.as_ref(), rank, 3, &tcp, TIMEOUT).map(Arc::new)
    })
    .unwrap();
    let start = Arc::new(Barrier::new(3));
    let started = Instant::now();
    // Every rank keeps its communicator until all have returned, so the failure reaches the
    // others through the protocol (a shut connection, or the deadline), not a drop.
    let outcomes = run_ranks_with_deadline(3, Duration::from_secs(30), move |rank| {
        start.wait();
        let began = Instant::now();
        let result = comms[rank].all_reduce(Buffer::from_vec(input(rank, 1 << 20)), ReduceOp::Sum);
        Ok::<_, Error>((result.err(), began.elapsed(), Arc::clone(&comms[rank])))
    })
    .unwrap();
    for (rank, (error, took, _comm)) in outcomes.iter().enumerate() {
        let error = error
            .as_ref()
            .unwrap_or_else(|| panic!("rank {rank}: a corrupted all-reduce succeeded"));
        assert!(
            took <= &(TIMEOUT + Duration::from_secs(2)),
            "rank {rank} took {took:?}: {error}"
        );
        if rank == 0 {
            match error {
                Error::Protocol {
                    peer: Some(2),
                    violation:
                        ProtocolViolation::ChecksumFailed {
                            frame: Some(key),
                            sent,
                            computed,
                        },
                } => {
                    assert_eq!(key.kind, hypershard_collectives::FrameKind::Data);
                    assert_eq!((key.group, key.seq), (0, 0), "the world's first op");
                    assert_ne!(sent, computed);
                }
                other => panic!("rank 0: {other:?}"),
            }
        } else {
            // The others see their peer go (rank 0 shut the corrupted connection and stopped
            // sending) or their deadline pass; never a hang, never a result.
            assert!(
                matches!(
                    error,
                    Error::PeerLost { .. } | Error::Timeout { .. } | Error::Protocol { .. }
                ),
                "rank {rank}: {error:?}"
            );
        }
    }
    assert!(started.elapsed() < TIMEOUT + Duration::from_secs(5));
}

/// Set in the child processes of the environment test: `on`, `off` or `bogus`.
const CHILD_VAR: &str = "HYPERSHARD_TEST_CRC_CHILD";

#[test]
fn the_environment_variable_overrides_the_config_in_mesh_establish() {
    if let Ok(case) = std::env::var(CHILD_VAR) {
        // A child: the config says off, HYPERSHARD_CRC32C says otherwise.
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let outcomes = run_ranks(2, move |rank| {
            Ok::<_, Error>(
                Mesh::establish(store.as_ref(), rank, 2, &config(case == "off", 1 << 20))
                    .map(|mesh| mesh.frame_checksum()),
            )
        })
        .unwrap();
        let case = std::env::var(CHILD_VAR).unwrap();
        for outcome in outcomes {
            match (case.as_str(), outcome) {
                ("on", Ok(true)) | ("off", Ok(false)) => {}
                ("bogus", Err(Error::InvalidEnv { variable, .. })) => {
                    assert_eq!(variable, CRC32C_VAR)
                }
                (case, other) => panic!("{case}: {other:?}"),
            }
        }
        return;
    }
    let me = std::env::current_exe().unwrap();
    // "off" starts from a config that says on, the others from one that says off.
    for (case, value) in [("on", "1"), ("off", "0"), ("bogus", "maybe")] {
        let child = std::process::Command::new(&me)
            .args([
                "--exact",
                "the_environment_variable_overrides_the_config_in_mesh_establish",
                "--test-threads=1",
            ])
            .env(CHILD_VAR, case)
            .env(CRC32C_VAR, value)
            .env_remove("HYPERSHARD_JOB_SECRET")
            .env_remove("HYPERSHARD_JOB_SECRET_FILE")
            .output()
            .unwrap();
        assert!(
            child.status.success(),
            "{case}: {}\n{}{}",
            child.status,
            String::from_utf8_lossy(&child.stdout),
            String::from_utf8_lossy(&child.stderr)
        );
        // The child ran the test (a filter that matched nothing would pass too).
        let said = String::from_utf8_lossy(&child.stdout);
        assert!(said.contains("1 passed"), "{case}: {said}");
    }
}
