//! Worlds of rank threads for the suites that run every rank inside one process: each thread
//! gets its own `TcpCommunicator` over 127.0.0.1 (the same sockets, framing and, with
//! `--transport shm`, shared-memory rings as separate processes would use) and a one-thread
//! compute pool, as PyTorch runs one intra-op thread per rank.

use std::sync::Arc;
use std::time::Duration;

use hypershard_collectives::tcp::{TcpCommunicator, TcpConfig};
use hypershard_collectives::{CommConfig, Communicator, MemoryStore, Store};

/// The error type of the bench helpers: any error, with its message.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Connects `world` tcp communicators through an in-memory store, one per thread.
pub fn tcp_thread_world(
    world: usize,
    tcp: &TcpConfig,
) -> Result<Vec<Arc<dyn Communicator>>, BoxError> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let tcp = tcp.clone().with_rendezvous_timeout(Duration::from_secs(30));
    let config = CommConfig::default().with_timeout(Duration::from_secs(120));
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, tcp, config) = (store.clone(), tcp.clone(), config.clone());
            std::thread::spawn(move || {
                TcpCommunicator::connect(store.as_ref(), rank, world, &tcp, config)
                    .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            })
        })
        .collect();
    let mut comms = Vec::with_capacity(world);
    for handle in handles {
        comms.push(handle.join().map_err(|_| "rendezvous thread panicked")??);
    }
    Ok(comms)
}

/// Runs `f(rank, comm)` on one thread per rank, each with a one-thread compute pool, and
/// returns the results in rank order.
pub fn on_rank_threads<T: Send + 'static>(
    comms: Vec<Arc<dyn Communicator>>,
    f: impl Fn(usize, Arc<dyn Communicator>) -> Result<T, BoxError> + Send + Sync + 'static,
) -> Result<Vec<T>, BoxError> {
    let f = Arc::new(f);
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let f = f.clone();
            std::thread::spawn(move || -> Result<T, BoxError> {
                hypershard_nn::with_num_threads(1, || f(rank, comm))?
            })
        })
        .collect();
    let mut out = Vec::with_capacity(handles.len());
    for handle in handles {
        out.push(handle.join().map_err(|_| "rank thread panicked")??);
    }
    Ok(out)
}

/// The per-repetition maximum over ranks of `per_rank[rank][rep]`, skipping `warmup` reps:
/// a collective is as slow as its slowest rank.
pub fn max_over_ranks(per_rank: &[Vec<Duration>], warmup: usize) -> Vec<Duration> {
    let reps = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    (warmup.min(reps)..reps)
        .map(|rep| {
            per_rank
                .iter()
                .map(|times| times[rep])
                .max()
                .unwrap_or_default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowest_rank_counts_and_warmup_is_dropped() {
        let ms = Duration::from_millis;
        let per_rank = vec![vec![ms(9), ms(1), ms(5)], vec![ms(2), ms(3), ms(4), ms(7)]];
        assert_eq!(max_over_ranks(&per_rank, 1), vec![ms(3), ms(5)]);
        assert_eq!(max_over_ranks(&per_rank, 5), Vec::<Duration>::new());
        assert!(max_over_ranks(&[], 0).is_empty());
    }

    #[test]
    fn rank_threads_see_their_rank_and_a_working_communicator() {
        let comms = tcp_thread_world(2, &TcpConfig::default()).expect("world");
        let sums = on_rank_threads(comms, |rank, comm| {
            let mine = hypershard_collectives::Buffer::from_vec(vec![rank as f32 + 1.0; 4]);
            let sum = comm.all_reduce(mine, hypershard_collectives::ReduceOp::Sum)?;
            Ok((rank, sum.into_vec::<f32>()?))
        })
        .expect("ranks");
        assert_eq!(sums, vec![(0, vec![3.0; 4]), (1, vec![3.0; 4])]);
    }
}
