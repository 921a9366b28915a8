//! [`TcpCommunicator`]: the [`Communicator`] of the TCP backend.
//!
//! Every op runs on the communicator's [`ProgressEngine`] in issue order. A collective first
//! exchanges phase-0 descriptors with every peer (see [`Link::open`](crate::algorithms::link::Link)), so
//! argument errors and cross-rank disagreements fail the op on every rank before data moves,
//! then runs its algorithm (ring, chain, dissemination, pairwise or direct) over the shared
//! [`Transport`]. Split groups reuse the world's sockets: their frames carry their own group
//! id, derived deterministically from the parent's id, the split count and the color.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use super::split;
use crate::algorithms::group::{Inner, WORLD_GROUP};
use crate::algorithms::{alltoall, barrier, broadcast, p2p, ring, rooted};
use crate::buffer::BufferPair;
use crate::buffer::{Buffer, HostBuffer};
use crate::communicator::Communicator;
use crate::config::CommConfig;
use crate::dtype::DType;
use crate::engine::{JobContext, JobSpec, ProgressEngine};
use crate::error::Result;
use crate::op::{OpKind, StridedBlocks};
use crate::progress::ProgressBoard;
use crate::rendezvous::Store;
use crate::transport::tcp::config::TcpConfig;
use crate::transport::tcp::mesh::Mesh;
use crate::transport::tcp::transport::Transport;
use crate::work::Work;

pub use crate::algorithms::group::BACKEND;

/// One rank of a TCP group.
#[derive(Debug)]
pub struct TcpCommunicator {
    inner: Arc<Inner>,
    engine: ProgressEngine,
}

/// How large a frame may be: one segment, or a descriptor (whose all-to-all-v counts grow
/// with the world), whichever is larger.
fn frame_cap(tcp: &TcpConfig, world_size: usize) -> u64 {
    let descriptor = 1024 + 16 * world_size as u64;
    (tcp.segment_bytes.max(8) as u64).max(descriptor)
}

impl TcpCommunicator {
    /// Joins a world of `world_size` ranks as `rank`: builds the mesh through `store`
    /// (`Mesh::establish`) and starts the transport. Collective over the world.
    pub fn connect(
        store: &dyn Store,
        rank: usize,
        world_size: usize,
        tcp: &TcpConfig,
        config: CommConfig,
    ) -> Result<TcpCommunicator> {
        let mesh = Mesh::establish(store, rank, world_size, tcp)?;
        TcpCommunicator::from_mesh_with_store(mesh, store, tcp, config)
    }

    /// The world communicator over an established mesh, TCP for every peer (the store is
    /// needed to find co-located peers; see [`TcpCommunicator::from_mesh_with_store`]).
    pub fn from_mesh(mesh: Mesh, tcp: &TcpConfig, config: CommConfig) -> Result<TcpCommunicator> {
        TcpCommunicator::build(mesh, tcp, config, None)
    }

    /// The world communicator over an established mesh, with the shared-memory transport
    /// for co-located peers when [`TcpConfig::transport`] (or `HYPERSHARD_TRANSPORT`) asks
    /// for it: the ranks publish their host ids in `store` and set up one ring per ordered
    /// pair on the same host (`crate::transport::shm::establish`). Collective over the world.
    pub fn from_mesh_with_store(
        mesh: Mesh,
        store: &dyn Store,
        tcp: &TcpConfig,
        config: CommConfig,
    ) -> Result<TcpCommunicator> {
        let policy = crate::transport::shm::TransportPolicy::from_env_or(tcp.transport)?;
        let shm = crate::transport::shm::establish(&crate::transport::shm::ShmSetup {
            store,
            rank: mesh.rank(),
            world_size: mesh.world_size(),
            policy,
            ring_bytes: tcp.shm_ring_bytes,
            max_payload: frame_cap(tcp, mesh.world_size()),
            timeout: tcp.rendezvous_timeout,
            dir: std::path::Path::new(crate::transport::shm::SEGMENT_DIR),
        })?;
        TcpCommunicator::build(mesh, tcp, config, shm.map(Arc::new))
    }

    /// The world ranks this rank reaches through shared memory (empty: TCP only).
    pub fn shm_peers(&self) -> Vec<usize> {
        self.inner
            .shm
            .as_ref()
            .map(|links| links.shm_peers())
            .unwrap_or_default()
    }

    fn build(
        mesh: Mesh,
        tcp: &TcpConfig,
        config: CommConfig,
        shm: Option<Arc<crate::transport::shm::ShmLinks>>,
    ) -> Result<TcpCommunicator> {
        let (rank, world_size) = (mesh.rank(), mesh.world_size());
        let transport = Arc::new(Transport::start(mesh, frame_cap(tcp, world_size))?);
        let members: Vec<usize> = (0..world_size).collect();
        let board = Arc::new(ProgressBoard::new(rank));
        let slot = board.register(WORLD_GROUP, "world", &members);
        TcpCommunicator::new(Inner {
            transport,
            group_id: WORLD_GROUP,
            members,
            rank,
            config,
            segment_bytes: tcp.segment_bytes,
            all_reduce: tcp.all_reduce,
            small_all_reduce_bytes: tcp.small_all_reduce_bytes,
            halving_doubling_bytes: tcp.halving_doubling_bytes,
            broadcast: tcp.broadcast,
            tree_broadcast_bytes: tcp.tree_broadcast_bytes,
            shm,
            name: "world".to_string(),
            next_collective: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            board,
            slot,
            scratch: Mutex::new(HostBuffer::zeros(DType::U8, 0)),
        })
    }

    /// A child group over the parent's transport.
    pub(crate) fn child(
        parent: &Inner,
        group_id: u32,
        members: Vec<usize>,
        rank: usize,
        name: String,
    ) -> Result<TcpCommunicator> {
        let slot = parent.board.register(group_id, &name, &members);
        TcpCommunicator::new(Inner {
            transport: Arc::clone(&parent.transport),
            group_id,
            members,
            rank,
            config: parent.config.clone(),
            segment_bytes: parent.segment_bytes,
            all_reduce: parent.all_reduce,
            small_all_reduce_bytes: parent.small_all_reduce_bytes,
            halving_doubling_bytes: parent.halving_doubling_bytes,
            broadcast: parent.broadcast,
            tree_broadcast_bytes: parent.tree_broadcast_bytes,
            shm: parent.shm.clone(),
            name,
            next_collective: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            board: Arc::clone(&parent.board),
            slot,
            scratch: Mutex::new(HostBuffer::zeros(DType::U8, 0)),
        })
    }

    fn new(inner: Inner) -> Result<TcpCommunicator> {
        let engine = ProgressEngine::new(inner.name.clone())?;
        Ok(TcpCommunicator {
            inner: Arc::new(inner),
            engine,
        })
    }

    fn submit<T, F>(&self, op: OpKind, bytes: usize, job: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&Inner, &JobContext) -> Result<T> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        let spec = JobSpec {
            op,
            bytes,
            timeout: inner.config.timeout,
        };
        self.engine.submit(spec, move |ctx| {
            // From here until the job returns, the watchdog sees this rank inside the op.
            let _entered = inner.slot.enter(ctx.seq, ctx.op);
            job(&inner, ctx).map_err(|error| inner.global_view(error))
        })
    }

    /// The progress board of this rank process (shared with every group split from the
    /// world), which the stall watchdog publishes.
    pub fn progress_board(&self) -> Arc<ProgressBoard> {
        Arc::clone(&self.inner.board)
    }
}

impl Communicator for TcpCommunicator {
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn size(&self) -> usize {
        self.inner.members.len()
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
        all_reduce: ring::all_reduce,
        all_gather: ring::all_gather,
        reduce_scatter: ring::reduce_scatter,
        broadcast: broadcast::broadcast,
        reduce: rooted::reduce,
        gather: rooted::gather,
        scatter: rooted::scatter,
        all_to_all: alltoall::all_to_all,
        send: p2p::send,
        recv: p2p::recv,
        barrier: barrier::barrier,
        split: split::split,
    }

    fn all_to_all_strided_async(
        &self,
        input: Buffer,
        output: Buffer,
        blocks: StridedBlocks,
    ) -> Work<BufferPair> {
        // The bytes this rank sends, as for the plain all-to-all of the packed blocks.
        let bytes = blocks
            .block_len()
            .saturating_mul(self.size())
            .saturating_mul(input.dtype().size_bytes());
        self.submit(OpKind::AllToAll, bytes, move |inner, ctx| {
            alltoall::all_to_all_strided(inner, ctx, input, output, blocks)
        })
    }

    fn abort(&self) {
        // The sockets are shared by the world and every group split from it, so aborting any
        // of them aborts the transport they all use (as an aborted NCCL communicator would).
        self.engine.abort();
        self.inner.transport.abort();
    }

    fn is_aborted(&self) -> bool {
        self.engine.is_aborted()
    }
}
