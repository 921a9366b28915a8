//! The `local` backend: every rank is a thread of one process, and ranks exchange data through
//! shared memory.
//!
//! [`spawn_world`] returns one [`Communicator`] per rank; hand each to its own thread. Every
//! communicator has its own progress thread ([`ProgressEngine`]), so ops overlap the caller's
//! compute and run in issue order exactly as on the other backends. The ranks of a group share
//! a `Group` (in `local/group.rs`): collectives rendezvous there in numbered phases (see that module), and
//! point-to-point messages go through per-(sender, receiver, tag) mailboxes.
//!
//! Data moves with at most one copy per destination: a rank posts its input buffer itself
//! (no copy), every peer reads what it needs straight from it, and the author takes it back
//! once the peers are done. All-reduce splits the reduction: rank `r` reduces block `r` of all
//! inputs, then every rank copies the reduced blocks into its buffer, so the work is spread
//! over the ranks like a ring's reduce-scatter + all-gather.

pub(crate) mod group;
pub(crate) mod ops;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::communicator::Communicator;
use crate::config::CommConfig;
use crate::engine::{JobContext, JobSpec, ProgressEngine};
use crate::error::{Error, Result};
use crate::op::OpKind;
use crate::work::Work;

use group::Group;

/// The backend name reported by [`Communicator::backend`].
pub const BACKEND: &str = "local";

/// A world of `size` local ranks with options from the environment
/// ([`CommConfig::from_env`]: `HYPERSHARD_TIMEOUT`). Element `r` is rank `r`.
pub fn spawn_world(size: usize) -> Result<Vec<Arc<dyn Communicator>>> {
    spawn_world_with(size, CommConfig::from_env()?)
}

/// A world of `size` local ranks with explicit options.
pub fn spawn_world_with(size: usize, config: CommConfig) -> Result<Vec<Arc<dyn Communicator>>> {
    if size == 0 {
        return Err(Error::InvalidWorldSize { size });
    }
    let group = Arc::new(Group::new(size));
    (0..size)
        .map(|rank| {
            LocalComm::new(group.clone(), rank, config.clone(), "world".to_string())
                .map(|comm| Arc::new(comm) as Arc<dyn Communicator>)
        })
        .collect()
}

/// What a rank's jobs need, shared between the handle and its progress thread.
#[derive(Debug)]
struct Inner {
    group: Arc<Group>,
    rank: usize,
    config: CommConfig,
    name: String,
    /// The sequence number of the next collective (p2p ops do not take one).
    next_collective: AtomicU64,
    /// How many splits this rank has made, for naming the children.
    splits: AtomicU64,
}

/// One rank of a local group.
#[derive(Debug)]
pub struct LocalComm {
    inner: Arc<Inner>,
    engine: ProgressEngine,
}

impl LocalComm {
    fn new(group: Arc<Group>, rank: usize, config: CommConfig, name: String) -> Result<Self> {
        let engine = ProgressEngine::new(name.clone())?;
        Ok(LocalComm {
            inner: Arc::new(Inner {
                group,
                rank,
                config,
                name,
                next_collective: AtomicU64::new(0),
                splits: AtomicU64::new(0),
            }),
            engine,
        })
    }

    fn submit<T, F>(&self, op: OpKind, bytes: usize, job: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&Inner, &JobContext) -> Result<T> + Send + 'static,
    {
        let inner = self.inner.clone();
        let spec = JobSpec {
            op,
            bytes,
            timeout: inner.config.timeout,
        };
        self.engine.submit(spec, move |ctx| job(&inner, ctx))
    }
}

impl Inner {
    fn next_seq(&self) -> u64 {
        self.next_collective.fetch_add(1, Ordering::Relaxed)
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn size(&self) -> usize {
        self.inner.group.size()
    }

    fn config(&self) -> &CommConfig {
        &self.inner.config
    }

    fn group_name(&self) -> &str {
        &self.inner.name
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    crate::communicator::forward_ops! {
        all_reduce: ops::all_reduce,
        all_gather: ops::all_gather,
        reduce_scatter: ops::reduce_scatter,
        broadcast: ops::broadcast,
        reduce: ops::reduce,
        gather: ops::gather,
        scatter: ops::scatter,
        all_to_all: ops::all_to_all,
        send: ops::send,
        recv: ops::recv,
        barrier: ops::barrier,
        split: ops::split,
    }

    fn abort(&self) {
        self.engine.abort();
        self.inner.group.abort_rank(self.inner.rank);
    }

    fn is_aborted(&self) -> bool {
        self.engine.is_aborted()
    }
}
