//! The shared-memory transport inside one process (ranks as threads meeting through one
//! [`MemoryStore`]): which pairs get shared memory under each policy, split groups over the
//! world's channels (group ranks that are not world ranks), and two groups driving the same
//! channel at once from their own progress threads (the stash and post paths across threads).

use std::sync::Arc;
use std::time::Duration;

use hypershard_collectives::shm::TransportPolicy;
use hypershard_collectives::tcp::{TcpCommunicator, TcpConfig};
use hypershard_collectives::{Buffer, CommConfig, Communicator, MemoryStore, ReduceOp, Store};
use hypershard_testkit::run_ranks;

/// Small segments and rings: every op crosses many segments and wraps its rings.
fn config(policy: TransportPolicy) -> TcpConfig {
    TcpConfig::default()
        .with_segment_bytes(512)
        .with_shm_ring_bytes(2048)
        .with_transport(policy)
        .with_rendezvous_timeout(Duration::from_secs(20))
}

/// A world of `policies.len()` ranks, rank `r` under `policies[r]`. An explicit
/// `HYPERSHARD_TRANSPORT` in the environment would override the policies, so these tests
/// run only when it is unset (the process tests cover the variable).
fn world(policies: &[TransportPolicy]) -> Option<Vec<Arc<TcpCommunicator>>> {
    let configs = policies.iter().map(|&policy| config(policy)).collect();
    world_of(configs)
}

/// A world of `configs.len()` ranks, rank `r` connecting with `configs[r]` (see [`world`]).
fn world_of(configs: Vec<TcpConfig>) -> Option<Vec<Arc<TcpCommunicator>>> {
    if std::env::var_os(hypershard_collectives::shm::TRANSPORT_ENV).is_some() {
        eprintln!("HYPERSHARD_TRANSPORT is set; the policy tests need it unset");
        return None;
    }
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let size = configs.len();
    let comm_config = CommConfig::default().with_timeout(Duration::from_secs(20));
    Some(
        run_ranks(size, move |rank| {
            TcpCommunicator::connect(
                store.as_ref(),
                rank,
                size,
                &configs[rank],
                comm_config.clone(),
            )
            .map(Arc::new)
        })
        .unwrap(),
    )
}

/// All-reduces `n` f32 where rank r contributes `r + i`, on every communicator at once, and
/// checks the sum `size * i + size (size - 1) / 2`.
fn check_all_reduce(comms: &[Arc<dyn Communicator>], n: usize) {
    let size = comms.len();
    let works: Vec<_> = comms
        .iter()
        .map(|comm| {
            let values: Vec<f32> = (0..n).map(|i| (comm.rank() + i) as f32).collect();
            comm.all_reduce_async(Buffer::from_vec(values), ReduceOp::Sum)
        })
        .collect();
    let offset = (size * (size - 1) / 2) as f32;
    for work in works {
        let sum = work.wait().unwrap().into_vec::<f32>().unwrap();
        assert!(
            (0..n).all(|i| sum[i] == (size * i) as f32 + offset),
            "wrong sum"
        );
    }
}

fn dyn_comms(comms: &[Arc<TcpCommunicator>]) -> Vec<Arc<dyn Communicator>> {
    comms
        .iter()
        .map(|c| Arc::clone(c) as Arc<dyn Communicator>)
        .collect()
}

#[test]
fn auto_and_shm_connect_every_co_located_pair_and_tcp_none() {
    let Some(shm) = world(&[
        TransportPolicy::Auto,
        TransportPolicy::Shm,
        TransportPolicy::Auto,
    ]) else {
        return;
    };
    for comm in &shm {
        let others: Vec<usize> = (0..3).filter(|&p| p != comm.rank()).collect();
        assert_eq!(comm.shm_peers(), others);
    }
    check_all_reduce(&dyn_comms(&shm), 10_000);
    // A rank that says tcp keeps every pair it is in on TCP; the others still pair up.
    let Some(mixed) = world(&[
        TransportPolicy::Tcp,
        TransportPolicy::Auto,
        TransportPolicy::Auto,
    ]) else {
        return;
    };
    assert_eq!(mixed[0].shm_peers(), Vec::<usize>::new());
    assert_eq!(mixed[1].shm_peers(), vec![2]);
    assert_eq!(mixed[2].shm_peers(), vec![1]);
    check_all_reduce(&dyn_comms(&mixed), 10_000);
    let Some(tcp) = world(&[TransportPolicy::Tcp, TransportPolicy::Tcp]) else {
        return;
    };
    assert!(tcp.iter().all(|c| c.shm_peers().is_empty()));
}

#[test]
fn split_groups_and_concurrent_groups_share_the_worlds_channels() {
    let Some(world) = world(&[TransportPolicy::Shm; 3]) else {
        return;
    };
    let world = dyn_comms(&world);
    // Ranks 0 and 2 form a group (group rank 1 is world rank 2); rank 1 is alone.
    let children: Vec<Arc<dyn Communicator>> = run_ranks(3, {
        let world = world.clone();
        move |rank| {
            let color = if rank == 1 { 1 } else { 0 };
            world[rank]
                .split(Some(color), 0)
                .map(|child| child.expect("every rank has a color"))
        }
    })
    .unwrap();
    let pair = vec![Arc::clone(&children[0]), Arc::clone(&children[2])];
    check_all_reduce(&pair, 5_000);
    // The world and the pair all-reduce at the same time: ranks 0 and 2 drive their shared
    // channel from two progress threads, so messages of one group arrive while the other
    // reads (the stash) and land in each other's posts only on the posting thread.
    for _ in 0..3 {
        let world_works: Vec<_> = world
            .iter()
            .map(|comm| {
                let values: Vec<f32> = (0..20_000).map(|i| (comm.rank() * 7 + i) as f32).collect();
                comm.all_reduce_async(Buffer::from_vec(values), ReduceOp::Sum)
            })
            .collect();
        check_all_reduce(&pair, 20_000);
        for work in world_works {
            let sum = work.wait().unwrap().into_vec::<f32>().unwrap();
            assert!((0..20_000).all(|i| sum[i] == (3 * i + 21) as f32));
        }
    }
}

#[test]
fn a_large_all_gather_streams_its_blocks_intact() {
    // 16 MiB per rank: each posted block is past the streaming-store threshold (8 MiB).
    check_large_all_gather(TransportPolicy::Shm, vec![4 << 20; 2]);
}

/// Rank `rank`'s element `i` in the reduce-scatter tests: small integers, so every sum is
/// exact in f32 whatever the order of the combines.
fn contribution(rank: usize, i: usize) -> f32 {
    ((i * 7 + rank * 13) % 1024) as f32
}

/// Reduce-scatters (`counts` as in `reduce_scatter_v`, or even when `None`) over a world of
/// `size` shared-memory ranks with segments and rings large enough that each message crosses
/// several ring chunks and streaming tiles, and checks every rank's block against the sum of
/// the contributions.
fn check_large_reduce_scatter(size: usize, counts: Option<Vec<usize>>, per_rank: usize) {
    // Odd sizes: a message (100 000 bytes) is not a multiple of the ring's 64 KiB chunks or
    // of the 8 KiB tiles, so pieces end at every kind of offset.
    let tcp = TcpConfig::default()
        .with_segment_bytes(100_000)
        .with_shm_ring_bytes(256 << 10)
        .with_transport(TransportPolicy::Shm)
        .with_rendezvous_timeout(Duration::from_secs(20));
    let Some(world) = world_of(vec![tcp; size]) else {
        return;
    };
    let counts_of = counts.clone().unwrap_or_else(|| vec![per_rank; size]);
    let total: usize = counts_of.iter().sum();
    let works: Vec<_> = world
        .iter()
        .map(|comm| {
            let r = comm.rank();
            let input: Vec<f32> = (0..total).map(|i| contribution(r, i)).collect();
            let output = Buffer::zeros(hypershard_collectives::DType::F32, counts_of[r]);
            match &counts {
                Some(counts) => comm.reduce_scatter_v_async(
                    Buffer::from_vec(input),
                    output,
                    counts.clone(),
                    ReduceOp::Sum,
                ),
                None => comm.reduce_scatter_async(Buffer::from_vec(input), output, ReduceOp::Sum),
            }
        })
        .collect();
    for (r, work) in works.into_iter().enumerate() {
        let out = work.wait().unwrap().output.into_vec::<f32>().unwrap();
        let start: usize = counts_of[..r].iter().sum();
        assert_eq!(out.len(), counts_of[r], "rank {r}'s block length");
        for (j, &v) in out.iter().enumerate() {
            let expected: f32 = (0..size).map(|q| contribution(q, start + j)).sum();
            assert_eq!(v, expected, "rank {r}, element {j} of {}", out.len());
        }
    }
}

#[test]
fn a_large_reduce_scatter_streams_its_output_intact_at_world_two() {
    // 2 100 003 f32 per rank, 8.4 MB: the output is past the streaming-store threshold
    // (8 MiB), and the one step lands straight in it.
    check_large_reduce_scatter(2, None, 2_100_003);
}

#[test]
fn an_uneven_large_reduce_scatter_streams_intact_at_world_three() {
    // Two outputs and the scratch blocks of the first step are past the streaming-store
    // threshold (the forwarded step included), the third output is 7 elements.
    check_large_reduce_scatter(3, Some(vec![2_100_003, 2_200_001, 7]), 0);
}

/// All-gathers `counts` of i32 (rank `r`'s element `i` is a hash of both) over a world of
/// `counts.len()` ranks under `policy`, with 100 000-byte segments, and checks every output
/// element: through `all_gather` when the counts are even, `all_gather_v` otherwise. Blocks
/// of at least 8 MiB are copied (own block) and filled (the others) with streaming stores.
fn check_large_all_gather(policy: TransportPolicy, counts: Vec<usize>) {
    let tcp = TcpConfig::default()
        .with_segment_bytes(100_000)
        .with_shm_ring_bytes(256 << 10)
        .with_transport(policy)
        .with_rendezvous_timeout(Duration::from_secs(20));
    let Some(world) = world_of(vec![tcp; counts.len()]) else {
        return;
    };
    let value = |r: usize, i: usize| (i as i32).wrapping_mul(-7) ^ (r as i32 * 977 + 1);
    let total: usize = counts.iter().sum();
    let works: Vec<_> = world
        .iter()
        .map(|comm| {
            let r = comm.rank();
            let mine: Vec<i32> = (0..counts[r]).map(|i| value(r, i)).collect();
            let output = Buffer::zeros(hypershard_collectives::DType::I32, total);
            if counts.iter().all(|&c| c == counts[0]) {
                comm.all_gather_async(Buffer::from_vec(mine), output)
            } else {
                comm.all_gather_v_async(Buffer::from_vec(mine), output, counts.clone())
            }
        })
        .collect();
    for (rank, work) in works.into_iter().enumerate() {
        let out = work.wait().unwrap().output.into_vec::<i32>().unwrap();
        let mut at = 0;
        for (r, &count) in counts.iter().enumerate() {
            for i in 0..count {
                assert_eq!(
                    out[at + i],
                    value(r, i),
                    "rank {rank}: block {r}, element {i}"
                );
            }
            at += count;
        }
    }
}

#[test]
fn an_uneven_large_all_gather_streams_its_own_blocks_intact_over_tcp_and_shm() {
    // Ranks 0 and 1 own blocks past the streaming-store threshold (8 MiB), rank 2 five
    // elements; over plain TCP only the own-block copy streams, over shm the posts do too.
    for policy in [TransportPolicy::Tcp, TransportPolicy::Shm] {
        check_large_all_gather(policy, vec![2_097_155, 2_200_001, 5]);
    }
}
