//! [`CommCounter`]: a communicator wrapper that counts calls and bytes per op, so tests can
//! assert "one all-gather per unit per forward".

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::buffer::Buffer;
use crate::buffer::BufferPair;
use crate::communicator::Communicator;
use crate::config::CommConfig;
use crate::error::Result;
use crate::op::{AllToAllCounts, OpKind, ReduceOp, StridedBlocks};
use crate::work::Work;

/// Calls and bytes of one op kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpCount {
    /// How many times the op was issued (async and blocking forms alike).
    pub calls: u64,
    /// The input bytes this rank handed to the op, summed over calls (for all-reduce and
    /// broadcast the buffer, for two-buffer ops the input).
    pub bytes: u64,
}

/// The counts of every op issued so far, by op kind (ops never issued are absent).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// Per-op counts.
    pub ops: BTreeMap<OpKind, OpCount>,
}

impl CounterSnapshot {
    /// The count of one op kind (zero when never issued).
    pub fn get(&self, op: OpKind) -> OpCount {
        self.ops.get(&op).copied().unwrap_or_default()
    }
}

/// Wraps a communicator and counts what goes through it. Sub-communicators made by
/// [`split`](Communicator::split) are wrapped too, with their own counts (see
/// [`CommCounter::children`]).
pub struct CommCounter {
    inner: Arc<dyn Communicator>,
    counts: Mutex<CounterSnapshot>,
    children: Mutex<Vec<Arc<CommCounter>>>,
}

impl CommCounter {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Communicator>) -> Arc<Self> {
        Arc::new(CommCounter {
            inner,
            counts: Mutex::new(CounterSnapshot::default()),
            children: Mutex::new(Vec::new()),
        })
    }

    /// The counts so far.
    pub fn snapshot(&self) -> CounterSnapshot {
        self.counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// How many times `op` was issued.
    pub fn calls(&self, op: OpKind) -> u64 {
        self.snapshot().get(op).calls
    }

    /// The input bytes issued to `op`.
    pub fn bytes(&self, op: OpKind) -> u64 {
        self.snapshot().get(op).bytes
    }

    /// Clears the counts (children keep theirs).
    pub fn reset(&self) {
        *self.counts.lock().unwrap_or_else(PoisonError::into_inner) = CounterSnapshot::default();
    }

    /// The counters of the sub-communicators split from this one, in creation order.
    pub fn children(&self) -> Vec<Arc<CommCounter>> {
        self.children
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The wrapped communicator.
    pub fn inner(&self) -> &Arc<dyn Communicator> {
        &self.inner
    }

    fn record(&self, op: OpKind, bytes: usize) {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = counts.ops.entry(op).or_default();
        entry.calls += 1;
        entry.bytes += bytes as u64;
    }
}

impl std::fmt::Debug for CommCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommCounter")
            .field("group", &self.inner.group_name())
            .field("counts", &self.snapshot())
            .finish()
    }
}

impl Communicator for CommCounter {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn config(&self) -> &CommConfig {
        self.inner.config()
    }

    fn group_name(&self) -> &str {
        self.inner.group_name()
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn all_reduce_async(&self, buffer: Buffer, op: ReduceOp) -> Work<Buffer> {
        self.record(OpKind::AllReduce, buffer.byte_len());
        self.inner.all_reduce_async(buffer, op)
    }

    fn all_gather_async(&self, input: Buffer, output: Buffer) -> Work<BufferPair> {
        self.record(OpKind::AllGather, input.byte_len());
        self.inner.all_gather_async(input, output)
    }

    fn all_gather_v_async(
        &self,
        input: Buffer,
        output: Buffer,
        counts: Vec<usize>,
    ) -> Work<BufferPair> {
        self.record(OpKind::AllGatherV, input.byte_len());
        self.inner.all_gather_v_async(input, output, counts)
    }

    fn reduce_scatter_async(
        &self,
        input: Buffer,
        output: Buffer,
        op: ReduceOp,
    ) -> Work<BufferPair> {
        self.record(OpKind::ReduceScatter, input.byte_len());
        self.inner.reduce_scatter_async(input, output, op)
    }

    fn reduce_scatter_v_async(
        &self,
        input: Buffer,
        output: Buffer,
        counts: Vec<usize>,
        op: ReduceOp,
    ) -> Work<BufferPair> {
        self.record(OpKind::ReduceScatterV, input.byte_len());
        self.inner.reduce_scatter_v_async(input, output, counts, op)
    }

    fn broadcast_async(&self, buffer: Buffer, root: usize) -> Work<Buffer> {
        self.record(OpKind::Broadcast, buffer.byte_len());
        self.inner.broadcast_async(buffer, root)
    }

    fn reduce_async(&self, buffer: Buffer, root: usize, op: ReduceOp) -> Work<Buffer> {
        self.record(OpKind::Reduce, buffer.byte_len());
        self.inner.reduce_async(buffer, root, op)
    }

    fn gather_async(&self, input: Buffer, output: Buffer, root: usize) -> Work<BufferPair> {
        self.record(OpKind::Gather, input.byte_len());
        self.inner.gather_async(input, output, root)
    }

    fn scatter_async(&self, input: Buffer, output: Buffer, root: usize) -> Work<BufferPair> {
        self.record(OpKind::Scatter, input.byte_len());
        self.inner.scatter_async(input, output, root)
    }

    fn all_to_all_async(&self, input: Buffer, output: Buffer) -> Work<BufferPair> {
        self.record(OpKind::AllToAll, input.byte_len());
        self.inner.all_to_all_async(input, output)
    }

    fn all_to_all_v_async(
        &self,
        input: Buffer,
        output: Buffer,
        counts: AllToAllCounts,
    ) -> Work<BufferPair> {
        self.record(OpKind::AllToAllV, input.byte_len());
        self.inner.all_to_all_v_async(input, output, counts)
    }

    fn all_to_all_strided_async(
        &self,
        input: Buffer,
        output: Buffer,
        blocks: StridedBlocks,
    ) -> Work<BufferPair> {
        // Counted as the all-to-all it is, with the bytes of the packed blocks it sends.
        let packed = blocks.block_len().saturating_mul(self.inner.size());
        self.record(
            OpKind::AllToAll,
            packed.saturating_mul(input.dtype().size_bytes()),
        );
        self.inner.all_to_all_strided_async(input, output, blocks)
    }

    fn send_async(&self, buffer: Buffer, peer: usize, tag: u32) -> Work<Buffer> {
        self.record(OpKind::Send, buffer.byte_len());
        self.inner.send_async(buffer, peer, tag)
    }

    fn recv_async(&self, buffer: Buffer, peer: usize, tag: u32) -> Work<Buffer> {
        self.record(OpKind::Recv, buffer.byte_len());
        self.inner.recv_async(buffer, peer, tag)
    }

    fn barrier_async(&self) -> Work<()> {
        self.record(OpKind::Barrier, 0);
        self.inner.barrier_async()
    }

    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Arc<dyn Communicator>>> {
        self.record(OpKind::Split, 0);
        let Some(child) = self.inner.split(color, key)? else {
            return Ok(None);
        };
        let counter = CommCounter::new(child);
        self.children
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(counter.clone());
        Ok(Some(counter))
    }

    fn abort(&self) {
        self.inner.abort();
    }

    fn is_aborted(&self) -> bool {
        self.inner.is_aborted()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CommunicatorExt;
    use crate::backend::local::spawn_world_with;
    use std::time::Duration;

    #[test]
    fn counts_calls_and_bytes_per_op() {
        let mut comms = spawn_world_with(
            1,
            CommConfig::default().with_timeout(Duration::from_secs(10)),
        )
        .unwrap();
        let counter = CommCounter::new(comms.remove(0));
        counter.all_gather_vec(vec![1.0f32; 8]).unwrap();
        counter.all_gather_vec(vec![1.0f32; 4]).unwrap();
        counter
            .all_reduce_vec(vec![1i64; 3], ReduceOp::Sum)
            .unwrap();
        counter.barrier().unwrap();
        assert_eq!(counter.get_counts(), (2, 48, 1, 24));
        let child = counter.split(Some(0), 0).unwrap().unwrap();
        child.barrier().unwrap();
        assert_eq!(counter.children()[0].calls(OpKind::Barrier), 1);
        assert_eq!(counter.calls(OpKind::Barrier), 1);
        assert_eq!(counter.calls(OpKind::Split), 1);
        counter.reset();
        assert_eq!(counter.snapshot(), CounterSnapshot::default());
    }

    impl CommCounter {
        fn get_counts(&self) -> (u64, u64, u64, u64) {
            (
                self.calls(OpKind::AllGather),
                self.bytes(OpKind::AllGather),
                self.calls(OpKind::AllReduce),
                self.bytes(OpKind::AllReduce),
            )
        }
    }
}
