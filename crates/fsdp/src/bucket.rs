//! Buckets: which parameters share one collective, where each sits in its slot, and the
//! pool their communication buffers are recycled through.

use std::sync::{Arc, Mutex, PoisonError, Weak};

use hypershard_collectives::{Buffer, DType as CommDType};
use hypershard_tensor::{DType, ForeignBytes, HostBuffer, Tensor};

use crate::error::{FsdpError, Result};

/// Slot offsets are aligned to this many bytes, so every parameter's piece of a fused buffer
/// starts on a cache line (and views into it are aligned for vector loads).
pub(crate) const ALIGN_BYTES: usize = 64;

/// One fused collective: its members (indices into the group's parameters), their element
/// offsets inside every rank's part, and the part's length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BucketPlan {
    pub dtype: DType,
    pub members: Vec<usize>,
    pub offsets: Vec<usize>,
    /// Elements each rank contributes (the sum of aligned slots).
    pub per_rank: usize,
    /// With tensor parallelism, where (in elements of a rank's part) the TP-replicated
    /// members start; they come last, and their reduced shards are all-reduced over TP.
    pub tp_tail: Option<usize>,
}

/// One parameter to place: its index, dtype and padded slot length.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BucketItem {
    pub index: usize,
    pub dtype: DType,
    pub slot_numel: usize,
}

/// Packs `items` into buckets: grouped by dtype (in order of first appearance), offsets
/// aligned to [`ALIGN_BYTES`], and a new bucket started when the next slot would take a
/// bucket past `cap_bytes` per rank. `fused = false` gives one bucket per parameter.
pub(crate) fn plan_buckets(items: &[BucketItem], fused: bool, cap_bytes: usize) -> Vec<BucketPlan> {
    let mut dtypes: Vec<DType> = Vec::new();
    for item in items {
        if !dtypes.contains(&item.dtype) {
            dtypes.push(item.dtype);
        }
    }
    let mut plans = Vec::new();
    for dtype in dtypes {
        let align = (ALIGN_BYTES / dtype.size_of()).max(1);
        let mut current: Option<BucketPlan> = None;
        for item in items.iter().filter(|i| i.dtype == dtype) {
            let start = current
                .as_ref()
                .map(|p| p.per_rank.div_ceil(align) * align)
                .unwrap_or(0);
            let over_cap = (start + item.slot_numel) * dtype.size_of() > cap_bytes;
            let must_split = !fused || (over_cap && start > 0);
            if must_split && let Some(done) = current.take() {
                plans.push(done);
            }
            let plan = current.get_or_insert_with(|| BucketPlan {
                dtype,
                members: Vec::new(),
                offsets: Vec::new(),
                per_rank: 0,
                tp_tail: None,
            });
            let offset = plan.per_rank.div_ceil(align) * align;
            plan.members.push(item.index);
            plan.offsets.push(offset);
            plan.per_rank = offset + item.slot_numel;
        }
        if let Some(done) = current {
            plans.push(done);
        }
    }
    plans
}

/// A dim-0 parameter of at least this many bytes at the start of a bucket becomes a view
/// into the all-gather output (compacted in place) instead of being copied out; below it the
/// copy is cheap and the parameter gets storage of its exact size.
pub(crate) const COMPACT_MIN_BYTES: usize = 64 << 10;

/// The pool keeps at least room for this many times the largest buffer it was asked for.
const POOL_CAP_FACTOR: usize = 4;
/// The pool keeps at most this many buffers (a unit of many small parameters returns one
/// storage per parameter on reshard).
const POOL_MAX_BUFFERS: usize = 64;

/// A per-rank cache of host communication buffers, shared by every unit of one mesh.
///
/// Every unshard and gradient reduction needs flat buffers of the same few sizes step after
/// step. Allocating them fresh costs a zero-fill (or page faults on fresh pages) per pass,
/// which profiling showed to be a quarter of an FSDP step's CPU time. Buffers handed back
/// after a collective, and the storage of unsharded parameters once they are freed, go into
/// this pool and are handed out again for the next request of the same dtype and length.
///
/// A reused buffer holds stale bytes, so every user writes all of it (see [`SlotWriter`]).
/// The pool is bounded: at most [`POOL_MAX_BUFFERS`] buffers, and at most as many bytes as
/// its users ever held from it at once (or [`POOL_CAP_FACTOR`] × the largest request, if
/// more), so pooled and live memory together stay within twice the peak the training loop
/// needs anyway. FSDP2's caching allocator plays the same part, with no bound. The oldest
/// buffers are dropped first.
#[derive(Debug, Default)]
pub(crate) struct BufferPool {
    inner: Mutex<PoolInner>,
}

#[derive(Debug, Default)]
struct PoolInner {
    free: Vec<Buffer>,
    cached_bytes: usize,
    largest_request: usize,
    /// Bytes handed out and not yet given back, and the most there ever were.
    outstanding: usize,
    peak_outstanding: usize,
    hits: usize,
    misses: usize,
}

impl BufferPool {
    fn lock(&self) -> std::sync::MutexGuard<'_, PoolInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A host buffer of `len` elements of `dtype`: a recycled one (stale contents) when the
    /// pool holds one, else a new zeroed one.
    pub fn take(&self, dtype: CommDType, len: usize) -> Buffer {
        let bytes = len.saturating_mul(dtype.size_bytes());
        {
            let mut inner = self.lock();
            inner.largest_request = inner.largest_request.max(bytes);
            inner.outstanding = inner.outstanding.saturating_add(bytes);
            inner.peak_outstanding = inner.peak_outstanding.max(inner.outstanding);
            if let Some(index) = inner
                .free
                .iter()
                .position(|b| b.dtype() == dtype && b.len() == len)
            {
                let buffer = inner.free.swap_remove(index);
                inner.cached_bytes -= buffer.byte_len();
                inner.hits += 1;
                return buffer;
            }
            inner.misses += 1;
        }
        Buffer::zeros(dtype, len)
    }

    /// Keeps `buffer` for a later [`take`](Self::take), or drops it when it is not host
    /// memory, is still shared with another handle (writing it would copy), or does not fit.
    pub fn give(&self, buffer: Buffer) {
        let bytes = buffer.byte_len();
        let mut inner = self.lock();
        inner.outstanding = inner.outstanding.saturating_sub(bytes);
        let keep = buffer.as_host().is_ok_and(|h| !h.is_shared()) && !buffer.is_empty();
        if !keep {
            return;
        }
        let cap = inner
            .largest_request
            .saturating_mul(POOL_CAP_FACTOR)
            .max(inner.peak_outstanding);
        if bytes > cap {
            return;
        }
        while !inner.free.is_empty()
            && (inner.cached_bytes + bytes > cap || inner.free.len() >= POOL_MAX_BUFFERS)
        {
            let oldest = inner.free.remove(0);
            inner.cached_bytes -= oldest.byte_len();
        }
        inner.cached_bytes += bytes;
        inner.free.push(buffer);
    }

    /// A contiguous tensor of `shape` and `dtype` over pooled memory whose storage goes back
    /// to the pool when the last view of it is dropped. Its contents are stale: the caller
    /// must overwrite every element.
    pub fn tensor(self: &Arc<Self>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        let Some(comm) = crate::bridge::comm_dtype(dtype) else {
            return Ok(Tensor::zeros(shape, dtype)?);
        };
        let buffer = self.take(comm, numel);
        let flat = self.adopt(buffer, dtype)?;
        Ok(flat.view(shape)?)
    }

    /// A flat tensor over `buffer` (no copy) whose storage goes back to the pool when the last
    /// view of it is dropped.
    pub fn adopt(self: &Arc<Self>, buffer: Buffer, dtype: DType) -> Result<Tensor> {
        let host = buffer
            .into_host()
            .map_err(|_| FsdpError::NotHostStorage { op: "pool adopt" })?;
        let numel = host.len();
        let bytes = Box::new(PooledBytes {
            host: Some(host),
            pool: Arc::downgrade(self),
        });
        let storage = match HostBuffer::from_foreign(bytes) {
            Ok(storage) => storage,
            Err(foreign) => HostBuffer::from_bytes(foreign.bytes()),
        };
        Ok(Tensor::from_host_buffer(storage, &[numel], dtype)?)
    }

    /// Drops every cached buffer (the end of a backward: see `FsdpModule`'s hooks).
    pub fn release_cached(&self) {
        let mut inner = self.lock();
        inner.free.clear();
        inner.cached_bytes = 0;
    }

    /// The most bytes ever handed out at once (gather outputs, which hold the unsharded
    /// parameters, and reduce inputs) and the bytes cached for reuse now.
    pub fn stats(&self) -> crate::mesh::CommBufferStats {
        let inner = self.lock();
        crate::mesh::CommBufferStats {
            peak_in_use_bytes: inner.peak_outstanding,
            cached_bytes: inner.cached_bytes,
        }
    }

    /// How many requests were served from the pool and how many allocated.
    #[cfg(test)]
    pub fn hits_and_misses(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.hits, inner.misses)
    }
}

/// Pooled memory adopted as tensor storage; it returns to its pool when dropped.
struct PooledBytes {
    host: Option<hypershard_collectives::HostBuffer>,
    pool: Weak<BufferPool>,
}

impl ForeignBytes for PooledBytes {
    fn bytes(&self) -> &[u8] {
        self.host.as_ref().map_or(&[], |h| h.as_bytes())
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.host.as_mut().map_or(&mut [], |h| h.as_bytes_mut())
    }
}

impl Drop for PooledBytes {
    fn drop(&mut self) {
        if let (Some(host), Some(pool)) = (self.host.take(), self.pool.upgrade()) {
            pool.give(Buffer::Host(host));
        }
    }
}

/// Writes the regions of a (possibly recycled) bucket buffer in increasing order and zeroes
/// every byte between and after them, so no stale byte of an earlier use reaches a
/// collective: gaps left by slot alignment and the slots of parameters without a gradient
/// become zeros, as in a freshly zeroed buffer.
pub(crate) struct SlotWriter<'a> {
    bytes: &'a mut [u8],
    cursor: usize,
}

impl<'a> SlotWriter<'a> {
    /// A writer over the whole buffer.
    pub fn new(bytes: &'a mut [u8]) -> Self {
        SlotWriter { bytes, cursor: 0 }
    }

    /// The `len` bytes at `start` (which must not precede the end of the previous region),
    /// after zeroing the gap before them.
    pub fn region(&mut self, start: usize, len: usize, op: &'static str) -> Result<&mut [u8]> {
        let end = start.checked_add(len).filter(|&e| e <= self.bytes.len());
        let Some(end) = end.filter(|_| start >= self.cursor) else {
            return Err(FsdpError::BufferLength {
                op,
                expected: self.bytes.len(),
                actual: start.saturating_add(len),
            });
        };
        self.bytes[self.cursor..start].fill(0);
        self.cursor = end;
        Ok(&mut self.bytes[start..end])
    }

    /// Zeroes everything after the last region.
    pub fn finish(self) {
        self.bytes[self.cursor..].fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(index: usize, dtype: DType, slot_numel: usize) -> BucketItem {
        BucketItem {
            index,
            dtype,
            slot_numel,
        }
    }

    #[test]
    fn fused_buckets_group_by_dtype_align_and_cap() {
        let items = [
            item(0, DType::F32, 5),
            item(1, DType::BF16, 3),
            item(2, DType::F32, 17),
            item(3, DType::F32, 1),
        ];
        let plans = plan_buckets(&items, true, usize::MAX);
        assert_eq!(plans.len(), 2);
        assert_eq!(plans[0].members, vec![0, 2, 3]);
        // f32: 16 elements per 64 bytes.
        assert_eq!(plans[0].offsets, vec![0, 16, 48]);
        assert_eq!(plans[0].per_rank, 49);
        assert_eq!(plans[1].members, vec![1]);
        // A cap of 100 bytes (25 f32): the 17-element slot would end at 33 elements, so it
        // starts a bucket; the next one would end at 33 (aligned 32 + 1) and starts another.
        let capped = plan_buckets(&items, true, 100);
        let f32_members: Vec<Vec<usize>> = capped
            .iter()
            .filter(|p| p.dtype == DType::F32)
            .map(|p| p.members.clone())
            .collect();
        assert_eq!(f32_members, vec![vec![0], vec![2], vec![3]]);
        // A slot larger than the cap still gets a bucket of its own.
        let big = plan_buckets(&[item(0, DType::F32, 1000)], true, 100);
        assert_eq!(big[0].members, vec![0]);
        let unfused = plan_buckets(&items, false, usize::MAX);
        assert_eq!(unfused.len(), 4);
        assert!(
            unfused
                .iter()
                .all(|p| p.members.len() == 1 && p.offsets == [0])
        );
    }

    #[test]
    fn pool_recycles_buffers_within_its_bound() {
        let pool = Arc::new(BufferPool::default());
        let a = pool.take(CommDType::F32, 100);
        assert_eq!(a.as_slice::<f32>().expect("host"), &[0.0; 100][..]);
        let address = a.as_host().expect("host").as_bytes().as_ptr() as usize;
        pool.give(a);
        // Same dtype and length: the same memory comes back.
        let b = pool.take(CommDType::F32, 100);
        assert_eq!(
            b.as_host().expect("host").as_bytes().as_ptr() as usize,
            address
        );
        // Another dtype of the same byte length is a miss.
        let c = pool.take(CommDType::I32, 100);
        assert_eq!(pool.hits_and_misses(), (1, 2));
        pool.give(b);
        pool.give(c);
        // A buffer larger than 4 x the largest request (and than the peak held) is never
        // kept.
        pool.give(Buffer::zeros(CommDType::F32, 401));
        let d = pool.take(CommDType::F32, 401);
        assert_eq!(pool.hits_and_misses(), (1, 3));
        // A buffer another handle still shares is not kept (writing it would copy).
        let shared = Buffer::zeros(CommDType::F32, 8);
        let other = shared.as_host().expect("host").share();
        pool.give(shared);
        drop(other);
        let _e = pool.take(CommDType::F32, 8);
        assert_eq!(pool.hits_and_misses(), (1, 4));
        // The byte bound (4 x 401 f32, above the peak held so far) drops the oldest buffers
        // first.
        for _ in 0..5 {
            pool.give(Buffer::zeros(CommDType::F32, 400));
        }
        {
            let inner = pool.lock();
            assert!(inner.cached_bytes <= 4 * 401 * 4, "{}", inner.cached_bytes);
            assert_eq!(inner.free.len(), 4);
        }
        // Holding 10 buffers of 400 at once raises the bound to that peak: all 10 are kept
        // when they come back (a step's gradients, handed back together by zero_grad).
        let held: Vec<Buffer> = (0..10).map(|_| pool.take(CommDType::F32, 400)).collect();
        for buffer in held {
            pool.give(buffer);
        }
        let inner = pool.lock();
        assert_eq!(inner.free.len(), 10);
        assert_eq!(
            inner.cached_bytes,
            inner.free.iter().map(Buffer::byte_len).sum::<usize>()
        );
        drop(inner);
        drop(d);
    }

    #[test]
    fn pooled_tensors_return_their_storage_when_dropped() -> Result<()> {
        let pool = Arc::new(BufferPool::default());
        let t = pool.tensor(&[2, 3], DType::F32)?;
        assert_eq!(t.shape(), &[2, 3]);
        t.with_data_mut::<f32, _>(|v| v.copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))?;
        let view = t.narrow(0, 1, 1)?;
        drop(t);
        // A view keeps the storage alive; the values are intact.
        assert_eq!(view.to_vec::<f32>()?, vec![4.0, 5.0, 6.0]);
        drop(view);
        // Now the memory is back: the next request of 6 f32 is a hit with the old values.
        let again = pool.take(CommDType::F32, 6);
        assert_eq!(pool.hits_and_misses(), (1, 1));
        assert_eq!(
            again.as_slice::<f32>().expect("host"),
            &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        );
        // With the pool gone the storage is simply freed.
        let orphan = pool.tensor(&[4], DType::F32)?;
        drop(pool);
        drop(orphan);
        Ok(())
    }

    #[test]
    fn slot_writer_zeroes_gaps_and_tail() -> Result<()> {
        let mut bytes = vec![7u8; 10];
        let mut writer = SlotWriter::new(&mut bytes);
        writer.region(2, 3, "test")?.fill(1);
        writer.region(6, 1, "test")?.fill(2);
        // Regions must come in increasing order and stay inside the buffer.
        assert!(writer.region(5, 2, "test").is_err());
        assert!(writer.region(8, 3, "test").is_err());
        writer.finish();
        assert_eq!(bytes, vec![0, 0, 1, 1, 1, 0, 2, 0, 0, 0]);
        Ok(())
    }
}
