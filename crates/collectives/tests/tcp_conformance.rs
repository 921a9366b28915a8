//! The conformance suite on the TCP backend: every rank is a thread of this process with its
//! own [`TcpCommunicator`] over 127.0.0.1, meeting through one shared [`MemoryStore`]. A small
//! segment size makes every ring step, chain hop and message span several frames.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hypershard_collectives::conformance::{self, SuiteParams};
use hypershard_collectives::tcp::{
    AllReduceAlgorithm, BroadcastAlgorithm, TcpCommunicator, TcpConfig,
};
use hypershard_collectives::{
    Buffer, CommConfig, Communicator, DType, Error, MemoryStore, ReduceOp, Store,
};
use hypershard_testkit::run_ranks;

/// Small enough that the suite's larger cases cross many segment boundaries.
const SEGMENT_BYTES: usize = 256;

/// The algorithms one conformance run forces.
#[derive(Clone, Copy, Debug)]
struct Algorithms {
    all_reduce: AllReduceAlgorithm,
    broadcast: BroadcastAlgorithm,
}

const AUTO: Algorithms = Algorithms {
    all_reduce: AllReduceAlgorithm::Auto,
    broadcast: BroadcastAlgorithm::Auto,
};

fn tcp_world(size: usize, timeout: Duration) -> Vec<Arc<dyn Communicator>> {
    tcp_world_with(size, timeout, AUTO)
}

fn tcp_world_with(
    size: usize,
    timeout: Duration,
    algorithms: Algorithms,
) -> Vec<Arc<dyn Communicator>> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let tcp = TcpConfig::default()
        .with_segment_bytes(SEGMENT_BYTES)
        .with_all_reduce(algorithms.all_reduce)
        .with_broadcast(algorithms.broadcast)
        .with_rendezvous_timeout(Duration::from_secs(20));
    let config = CommConfig::default().with_timeout(timeout);
    run_ranks(size, move |rank| {
        TcpCommunicator::connect(store.as_ref(), rank, size, &tcp, config.clone())
            .map(|comm| Arc::new(comm) as Arc<dyn Communicator>)
    })
    .unwrap()
}

#[test]
fn full_suite_on_one_to_four_ranks() {
    // Auto sends the suite's all-reduces (all below the small-message threshold) to recursive
    // doubling and its broadcasts to the tree; the forced runs cover the ring and
    // halving-doubling all-reduces and the chain broadcast, with many segments per step.
    let forced = |all_reduce, broadcast| Algorithms {
        all_reduce,
        broadcast,
    };
    let runs = [1, 2, 3, 4]
        .map(|size| (size, AUTO))
        .into_iter()
        .chain([2, 3, 4].map(|size| {
            (
                size,
                forced(AllReduceAlgorithm::Ring, BroadcastAlgorithm::Chain),
            )
        }))
        .chain([1, 2, 3, 4].map(|size| {
            (
                size,
                forced(
                    AllReduceAlgorithm::HalvingDoubling,
                    BroadcastAlgorithm::Tree,
                ),
            )
        }));
    for (size, algorithm) in runs {
        let comms = tcp_world_with(size, Duration::from_secs(30), algorithm);
        let reports = run_ranks(size, move |rank| {
            conformance::run_all(comms[rank].as_ref(), &SuiteParams::new(SEGMENT_BYTES))
        })
        .unwrap_or_else(|e| panic!("world {size}, {algorithm:?}: {e}"));
        for report in &reports {
            assert!(
                report.cases > 1000,
                "world {size}: only {} cases",
                report.cases
            );
        }
    }
}

#[test]
fn a_peer_that_drops_mid_op_fails_the_others_fast() {
    let comms = tcp_world(3, Duration::from_secs(30));
    let slots: Vec<std::sync::Mutex<Option<Arc<dyn Communicator>>>> = comms
        .into_iter()
        .map(|c| std::sync::Mutex::new(Some(c)))
        .collect();
    let slots = Arc::new(slots);
    let ready = Arc::new(Barrier::new(3));
    let outcomes = run_ranks(3, move |rank| {
        // invariant: each rank takes only its own slot, once.
        let comm = slots[rank].lock().unwrap().take().unwrap();
        comm.barrier()?;
        if rank == 2 {
            ready.wait();
            // Let the others block in their all-reduce, then vanish.
            std::thread::sleep(Duration::from_millis(100));
            drop(comm);
            return Ok::<_, Error>(true);
        }
        ready.wait();
        let start = Instant::now();
        let result = comm.all_reduce(Buffer::zeros(DType::F32, 1000), ReduceOp::Sum);
        let failed = matches!(
            result,
            Err(Error::PeerLost { .. }) | Err(Error::Timeout { .. })
        );
        Ok(failed && start.elapsed() < Duration::from_secs(10))
    })
    .unwrap();
    assert_eq!(outcomes, vec![true, true, true]);
}

#[test]
fn an_absent_rank_times_out_the_others() {
    let comms = tcp_world(4, Duration::from_millis(300));
    let start = Instant::now();
    let counts = run_ranks(4, move |rank| {
        conformance::check_timeout_when_a_rank_is_absent(comms[rank].as_ref(), 2)
    })
    .unwrap();
    assert_eq!(counts, vec![1, 1, 0, 1]);
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn abort_fails_pending_work_and_peers_see_peer_lost() {
    let comms = tcp_world(3, Duration::from_secs(30));
    let aborted = Arc::new(Barrier::new(3));
    let outcomes = run_ranks(3, move |rank| {
        let comm = &comms[rank];
        comm.barrier()?;
        if rank == 0 {
            // Two ops the others never join: one running, one queued behind it.
            let running = comm.all_reduce_async(Buffer::zeros(DType::F32, 8), ReduceOp::Sum);
            let queued = comm.broadcast_async(Buffer::zeros(DType::F32, 8), 0);
            comm.abort();
            aborted.wait();
            let running = running.wait();
            let queued = queued.wait();
            let later = comm.barrier();
            return Ok::<_, Error>(vec![
                comm.is_aborted(),
                matches!(running, Err(Error::Aborted { .. })),
                matches!(queued, Err(Error::Aborted { .. })),
                matches!(later, Err(Error::Aborted { .. })),
            ]);
        }
        aborted.wait();
        let start = Instant::now();
        let result = comm.all_reduce(Buffer::zeros(DType::F32, 8), ReduceOp::Sum);
        Ok(vec![
            matches!(result, Err(Error::PeerLost { peer: 0, .. })),
            start.elapsed() < Duration::from_secs(10),
        ])
    })
    .unwrap();
    assert_eq!(
        outcomes,
        vec![vec![true; 4], vec![true, true], vec![true, true]]
    );
}

#[test]
fn cross_rank_disagreements_fail_every_rank_and_leave_the_comm_usable() {
    let comms = tcp_world(3, Duration::from_secs(30));
    let outcomes = run_ranks(3, move |rank| {
        let comm = &comms[rank];
        // Rank 1 asks for another reduce op.
        let op = if rank == 1 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        let reduce = comm.all_reduce(Buffer::zeros(DType::F32, 4), op);
        // Rank 2 passes another length.
        let len = if rank == 2 { 5 } else { 4 };
        let length = comm.broadcast(Buffer::zeros(DType::I32, len), 0);
        // Rank 0 issues another op at the same seq.
        let kind = if rank == 0 {
            comm.barrier().map(|()| 0)
        } else {
            comm.broadcast(Buffer::zeros(DType::U8, 1), 0).map(|_| 0)
        };
        // The comm is still in step: a real all-reduce gives 0 + 1 + 2 everywhere.
        let sum = comm.all_reduce(Buffer::from_vec(vec![rank as f32; 3]), ReduceOp::Sum)?;
        Ok::<_, Error>((
            matches!(
                reduce,
                Err(Error::ArgumentMismatch {
                    argument: hypershard_collectives::Argument::ReduceOp,
                    peer: 1,
                    ..
                })
            ),
            matches!(
                length,
                Err(Error::LengthMismatch {
                    role: hypershard_collectives::BufferRole::Peer { rank: 2 },
                    expected: 4,
                    got: 5,
                    ..
                })
            ),
            matches!(kind, Err(Error::OpMismatch { .. })),
            sum.into_host()?.into_vec::<f32>()?,
        ))
    })
    .unwrap();
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        assert_eq!(outcome, (true, true, true, vec![3.0; 3]), "rank {rank}");
    }
}

/// What the knob test changes on rank 1 only.
type Tweak = fn(TcpConfig) -> TcpConfig;

#[test]
fn ranks_with_different_algorithm_knobs_fail_every_op_with_a_typed_error() {
    use hypershard_collectives::{Argument, Knob};

    const SIZE: usize = 3;
    let tweaks: [(Knob, Tweak); 4] = [
        (Knob::AllReduceAlgorithm, |c| {
            c.with_all_reduce(AllReduceAlgorithm::Ring)
        }),
        (Knob::SegmentBytes, |c| {
            c.with_segment_bytes(2 * SEGMENT_BYTES)
        }),
        (Knob::BroadcastAlgorithm, |c| {
            c.with_broadcast(BroadcastAlgorithm::Chain)
        }),
        (Knob::SmallAllReduceBytes, |mut c| {
            c.small_all_reduce_bytes = 1;
            c
        }),
    ];
    for (knob, tweak) in tweaks {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let base = TcpConfig::default()
            .with_segment_bytes(SEGMENT_BYTES)
            .with_rendezvous_timeout(Duration::from_secs(20));
        let config = CommConfig::default().with_timeout(Duration::from_secs(20));
        let started = Instant::now();
        let outcomes = run_ranks(SIZE, move |rank| {
            let tcp = if rank == 1 {
                tweak(base.clone())
            } else {
                base.clone()
            };
            let comm = TcpCommunicator::connect(store.as_ref(), rank, SIZE, &tcp, config.clone())?;
            let data: Vec<f32> = (0..4096).map(|i| (rank * 7 + i) as f32).collect();
            let reduced = comm.all_reduce(Buffer::from_vec(data), ReduceOp::Sum);
            let broadcast = comm.broadcast(Buffer::zeros(DType::F32, 4096), 0);
            let gathered = comm.all_gather(
                Buffer::zeros(DType::F32, 8),
                Buffer::zeros(DType::F32, 8 * SIZE),
            );
            let expected = |result: &Result<_, Error>| {
                matches!(
                    result,
                    Err(Error::ArgumentMismatch {
                        argument: Argument::AlgorithmKnob(k),
                        peer: 1,
                        reference: 0,
                        ..
                    }) if *k == knob
                )
            };
            Ok::<_, Error>([
                expected(&reduced.map(|_| ())),
                expected(&broadcast.map(|_| ())),
                expected(&gathered.map(|_| ())),
            ])
        })
        .unwrap();
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            assert_eq!(outcome, [true; 3], "{knob}: rank {rank}");
        }
        // Phase 0 rejects the op on every rank, long before any deadline.
        assert!(started.elapsed() < Duration::from_secs(10), "{knob}");
    }
}

#[test]
fn stray_clients_on_a_ranks_port_are_refused_and_the_world_still_works() {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};

    use hypershard_collectives::testing::{MESH_MAGIC, MESH_PROTOCOL_VERSION};

    const SIZE: usize = 3;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let tcp = TcpConfig::default()
        .with_segment_bytes(SEGMENT_BYTES)
        .with_job_token(42)
        .with_rendezvous_timeout(Duration::from_secs(20));
    let config = CommConfig::default().with_timeout(Duration::from_secs(20));
    let join = |rank: usize| {
        let (store, tcp, config) = (store.clone(), tcp.clone(), config.clone());
        std::thread::spawn(move || {
            TcpCommunicator::connect(store.as_ref(), rank, SIZE, &tcp, config)
        })
    };
    // Rank 0 starts alone, so the strays reach its listener before the real ranks do.
    let rank0 = join(0);
    let published = store.get("tcp/addr/0", Duration::from_secs(10)).unwrap();
    let addr: SocketAddr = std::str::from_utf8(&published).unwrap().parse().unwrap();
    let mut garbage = TcpStream::connect(addr).unwrap();
    garbage.write_all(&[0xab; 64]).unwrap();
    // A well-formed hello with another job's token is refused with code 2 (token).
    let mut foreign = TcpStream::connect(addr).unwrap();
    let mut hello = Vec::new();
    hello.extend_from_slice(&MESH_MAGIC.to_le_bytes());
    hello.extend_from_slice(&MESH_PROTOCOL_VERSION.to_le_bytes());
    // Token, rank, world size, flags (no frame checksums, like the world's default).
    for word in [7u64, 1, SIZE as u64, 0] {
        hello.extend_from_slice(&word.to_le_bytes());
    }
    foreign.write_all(&hello).unwrap();
    foreign
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut refusal = [0u8; 1];
    foreign.read_exact(&mut refusal).unwrap();
    assert_eq!(refusal[0], 2, "token refusal code");
    // The garbage gets no answer at all: the rank closes the connection.
    garbage
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut answer = [0u8; 8];
    assert!(matches!(garbage.read(&mut answer), Ok(0) | Err(_)));
    // The real ranks still form the world, and it computes.
    let others = [join(1), join(2)];
    let mut comms = vec![rank0.join().unwrap().unwrap()];
    comms.extend(others.map(|h| h.join().unwrap().unwrap()));
    let comms: Vec<Arc<dyn Communicator>> = comms
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Communicator>)
        .collect();
    let sums = run_ranks(SIZE, move |rank| {
        let values: Vec<f64> = (0..100).map(|i| (rank * 100 + i) as f64).collect();
        comms[rank]
            .all_reduce(Buffer::from_vec(values), ReduceOp::Sum)?
            .into_vec::<f64>()
    })
    .unwrap();
    // Σ_r (100 r + i) over 3 ranks = 300 + 3 i.
    let expected: Vec<f64> = (0..100).map(|i| (300 + 3 * i) as f64).collect();
    assert!(sums.iter().all(|sum| *sum == expected));
    // The listener closes with the rendezvous: a late stray cannot even connect.
    assert!(TcpStream::connect(addr).is_err());
}
