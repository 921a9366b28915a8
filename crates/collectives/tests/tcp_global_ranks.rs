//! Errors of a split TCP group name peers by their global rank (the `RANK` a user can find),
//! not by their position in the group.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use hypershard_collectives::tcp::{TcpCommunicator, TcpConfig};
use hypershard_collectives::{
    CommConfig, Communicator, CommunicatorExt, Error, MemoryStore, ReduceOp, Store,
};

#[test]
fn a_split_groups_timeout_names_the_global_rank() {
    const SIZE: usize = 4;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let tcp = TcpConfig::default().with_rendezvous_timeout(Duration::from_secs(20));
    let config = CommConfig::default().with_timeout(Duration::from_secs(2));
    let ranks: Vec<_> = (0..SIZE)
        .map(|rank| {
            let (store, tcp, config) = (Arc::clone(&store), tcp.clone(), config.clone());
            thread::spawn(move || -> Result<Option<Error>, Error> {
                let world = TcpCommunicator::connect(store.as_ref(), rank, SIZE, &tcp, config)?;
                // Odd ranks form group {1, 3}: global rank 3 is group rank 1 there.
                let group = world.split(Some((rank % 2) as u32), 0)?;
                let Some(group) = group else { return Ok(None) };
                if rank == 1 {
                    // Rank 3 never joins this all-reduce.
                    return Ok(group.all_reduce_vec(vec![1.0f32], ReduceOp::Sum).err());
                }
                // Stay up (sockets open) until rank 1 has given up.
                thread::sleep(Duration::from_secs(4));
                Ok(None)
            })
        })
        .collect();
    let results: Vec<_> = ranks
        .into_iter()
        .map(|r| r.join().unwrap().unwrap())
        .collect();
    match &results[1] {
        Some(error @ Error::Timeout { peer, .. }) => {
            assert_eq!(*peer, Some(3), "{error}");
            assert!(error.to_string().contains("waiting for rank 3"), "{error}");
        }
        other => panic!("rank 1 got {other:?}"),
    }
}
