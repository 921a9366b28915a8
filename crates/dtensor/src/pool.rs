//! [`BufferPool`]: the communication buffers of one mesh family, recycled by redistribute and
//! by FSDP alike.
//!
//! Every collective needs flat host buffers, and a training loop asks for the same few sizes
//! step after step. A fresh buffer costs a zero-fill (or page faults on fresh pages), which
//! profiling showed to be a quarter of an FSDP step's CPU time; a buffer that comes back from
//! a collective, or from a tensor that is dropped, is handed out again for the next request
//! of the same dtype and length instead. A reused buffer holds stale bytes: every user writes
//! all of it (a redistribute zeroes its padding, FSDP writes every slot and gap).
//!
//! Two kinds of traffic share the pool:
//! - **loans** ([`BufferPool::take`], [`BufferPool::tensor`], [`BufferPool::adopt`]): FSDP's
//!   gather and reduce buffers, its unsharded parameters and gradients. They come back by
//!   [`BufferPool::give`] or when the tensor over them is dropped, and they are what
//!   [`PoolStats::in_use_bytes`] counts;
//! - **passing buffers** of a redistribute: a send buffer taken for one collective and kept
//!   again when it completes, a used-up source, and outputs that leave the pool as the
//!   caller's tensor. They are not counted as in use.
//!
//! # The cap
//! While idle, the pool holds at most `max(4 × the largest buffer requested, the most bytes
//! lent at once)` and at most 512 buffers, both measured since the pool was last emptied
//! ([`BufferPool::release_cached`], which FSDP's root calls at the end of every backward unless
//! told to keep its buffers: the window is then one training step). Past the cap the oldest
//! idle buffers are freed first. Of one (dtype, length) it keeps at most as many buffers as
//! were lent at once (at least one), so buffers that no request of their size will take back
//! (a redistribute's used-up sources) do not pile up. So pooled and live communication memory
//! together stay within twice what one step needs anyway (FSDP2's caching allocator plays the
//! same part, with no bound). A step that repeats the previous one finds every buffer it asks
//! for when its buffers fit under the cap, as those of like units (a transformer's blocks) do;
//! units of many different shapes would need the whole unsharded model cached, so there the
//! oldest buffers are freed and allocated again: memory comes before allocations.
//!
//! Freeing a large buffer unmaps its pages, which takes milliseconds; buffers the pool lets go
//! of while it is in use are freed on a background thread that the pool starts on first need
//! and stops (and joins) when it is dropped. [`BufferPool::release_cached`] frees on the
//! caller's thread: its caller wants the memory back now.

use std::collections::HashMap;
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::thread::JoinHandle;

use hypershard_collectives::{Buffer, DType as WireDType, HostBuffer as WireBuffer};
use hypershard_tensor::{DType, Tensor};

use crate::bridge::{self, Home, reclaim_buffer, wire_dtype};
use crate::error::{Error, Result};

/// The idle cap is at least this many times the largest buffer requested.
const IDLE_CAP_FACTOR: usize = 4;
/// At most this many idle buffers are kept. A unit returns one storage per parameter on
/// reshard, and zero_grad returns one gradient shard per parameter of the model at once: a
/// 6-block GPT's step uses about a hundred, and at 64 the oldest of them (the next forward's
/// gathered parameters) were evicted every step. The count only bounds the idle list's
/// length (each request scans it); the byte bound is what bounds the memory.
const MAX_IDLE_BUFFERS: usize = 512;
/// Buffers at least this large are freed on the background thread when the pool lets them go
/// while in use.
const DEFERRED_FREE_BYTES: usize = 1 << 20;
/// At most this many large buffers wait for the background thread; past that they are freed
/// on the caller's thread, so the deferred memory stays bounded.
const DEFERRED_FREE_QUEUE: usize = 4;

/// What a [`BufferPool`] holds and has done (see [`BufferPool::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Bytes lent (by `take`, `tensor`, `adopt`) and not yet back.
    pub in_use_bytes: usize,
    /// The most bytes lent at once since the pool was made.
    pub peak_in_use_bytes: usize,
    /// Bytes held idle for reuse now.
    pub cached_bytes: usize,
    /// Buffers held idle for reuse now.
    pub cached_buffers: usize,
    /// The most bytes the pool may hold idle now (see [`BufferPool`]).
    pub idle_cap_bytes: usize,
    /// Requests served from the idle buffers.
    pub hits: usize,
    /// Requests that allocated a new buffer.
    pub misses: usize,
}

/// The communication buffers of one mesh family: owned by the
/// [`ProcessMesh`](crate::ProcessMesh) (and every mesh `select`ed or `flatten`ed from it),
/// used by its redistributes and by every FSDP unit over it.
///
/// Buffers are reused by exact dtype and length and hold stale bytes. While idle the pool
/// holds at most `max(4 × the largest buffer requested, the most bytes lent at once)` and 64
/// buffers, both measured since it was last emptied ([`release_cached`](BufferPool::release_cached),
/// which FSDP calls at the end of every backward); past that the oldest buffers are freed,
/// large ones on a background thread that belongs to the pool and is joined when it drops.
///
/// ```
/// use std::sync::Arc;
/// use hypershard_dtensor::BufferPool;
/// use hypershard_dtensor::collectives::DType;
///
/// let pool = Arc::new(BufferPool::new());
/// let first = pool.take(DType::F32, 1024);
/// let address = first.as_host()?.as_bytes().as_ptr();
/// pool.give(first);
/// let again = pool.take(DType::F32, 1024);
/// assert_eq!(again.as_host()?.as_bytes().as_ptr(), address, "the same memory");
/// assert_eq!((pool.stats().hits, pool.stats().misses), (1, 1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct BufferPool {
    state: Mutex<State>,
    freer: Mutex<Freer>,
}

/// The bookkeeping behind the pool's lock.
#[derive(Default)]
struct State {
    /// Idle buffers, oldest first.
    idle: Vec<WireBuffer>,
    idle_bytes: usize,
    /// The largest buffer requested since the pool was last emptied.
    largest_request: usize,
    /// Bytes lent and not back.
    in_use: usize,
    /// The most bytes lent at once since the pool was last emptied.
    window_peak: usize,
    /// The most bytes lent at once ever (for [`PoolStats`]).
    peak_in_use: usize,
    /// Per (dtype, length): buffers lent now and the most lent at once since the pool was
    /// last emptied.
    sizes: HashMap<(WireDType, usize), SizeUse>,
    hits: usize,
    misses: usize,
}

#[derive(Default, Clone, Copy)]
struct SizeUse {
    lent: usize,
    peak: usize,
}

impl State {
    /// The most bytes that may sit idle.
    fn cap(&self) -> usize {
        self.largest_request
            .saturating_mul(IDLE_CAP_FACTOR)
            .max(self.window_peak)
    }

    /// How many idle buffers of `key` may be held.
    fn allowed(&self, key: (WireDType, usize)) -> usize {
        self.sizes.get(&key).map_or(0, |size| size.peak).max(1)
    }

    /// A buffer of `key` came back or left: it ends a loan when one of its size is out (a
    /// buffer the pool never lent leaves the accounting alone).
    fn end_loan(&mut self, key: (WireDType, usize), bytes: usize) {
        if let Some(size) = self.sizes.get_mut(&key).filter(|size| size.lent > 0) {
            size.lent -= 1;
            self.in_use = self.in_use.saturating_sub(bytes);
        }
    }
}

/// The background thread that frees large buffers, started on first need.
#[derive(Default)]
struct Freer {
    queue: Option<SyncSender<WireBuffer>>,
    thread: Option<JoinHandle<()>>,
    /// The thread could not be started: free on the caller's thread from then on.
    unavailable: bool,
}

/// A buffer for a redistribute's send side and whether its bytes are known to be zero.
pub(crate) struct Taken {
    pub buffer: WireBuffer,
    pub zeroed: bool,
}

impl Default for BufferPool {
    fn default() -> Self {
        BufferPool::new()
    }
}

impl BufferPool {
    /// An empty pool. A [`ProcessMesh`](crate::ProcessMesh) makes its own; a standalone pool
    /// is for code that runs collectives without a mesh.
    pub fn new() -> Self {
        BufferPool {
            state: Mutex::new(State::default()),
            freer: Mutex::new(Freer::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An idle buffer of exactly `dtype` × `len` (stale bytes), or a new zeroed one; a loan
    /// is counted as in use until it comes back.
    fn take_inner(&self, dtype: WireDType, len: usize, loan: bool) -> Taken {
        let bytes = len.saturating_mul(dtype.size_bytes());
        {
            let mut state = self.lock();
            state.largest_request = state.largest_request.max(bytes);
            if loan {
                state.in_use = state.in_use.saturating_add(bytes);
                state.window_peak = state.window_peak.max(state.in_use);
                state.peak_in_use = state.peak_in_use.max(state.in_use);
                let size = state.sizes.entry((dtype, len)).or_default();
                size.lent += 1;
                size.peak = size.peak.max(size.lent);
            }
            let found = state
                .idle
                .iter()
                .position(|b| b.dtype() == dtype && b.len() == len);
            if let Some(index) = found {
                let buffer = state.idle.remove(index);
                state.idle_bytes -= buffer.byte_len();
                state.hits += 1;
                return Taken {
                    buffer,
                    zeroed: false,
                };
            }
            state.misses += 1;
        }
        Taken {
            buffer: WireBuffer::zeros(dtype, len),
            zeroed: true,
        }
    }

    /// Lends a host buffer of `len` elements of `dtype`: a recycled one (stale contents) when
    /// the pool holds one of exactly that dtype and length, else a new zeroed one. Give it
    /// back with [`give`](BufferPool::give).
    pub fn take(&self, dtype: WireDType, len: usize) -> Buffer {
        Buffer::Host(self.take_inner(dtype, len, true).buffer)
    }

    /// Takes back a buffer lent by [`take`](BufferPool::take) (or any other buffer worth
    /// keeping), within the cap; a buffer that is not host memory, is empty, or is still
    /// shared with another handle (writing it would copy) is let go.
    pub fn give(&self, buffer: Buffer) {
        self.accept(buffer, true);
    }

    /// A contiguous tensor of `shape` and `dtype` over lent memory, which comes back to the
    /// pool when the last view of the tensor is dropped. Its contents are stale: the caller
    /// overwrites every element.
    pub fn tensor(self: &Arc<Self>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let numel = shape
            .iter()
            .try_fold(1usize, |acc, &s| acc.checked_mul(s))
            .ok_or(hypershard_tensor::Error::SizeOverflow {
                op: "BufferPool::tensor",
                shape: shape.to_vec(),
            })?;
        let lent = self.take_inner(wire_dtype(dtype), numel, true).buffer;
        bridge::adopt(lent, shape, dtype, Some(self.home()))
    }

    /// A flat tensor of `dtype` over `buffer` (lent by [`take`](BufferPool::take); no copy),
    /// which comes back to the pool when the last view of the tensor is dropped. The buffer's
    /// dtype must be [`wire_dtype(dtype)`](crate::bridge::wire_dtype).
    pub fn adopt(self: &Arc<Self>, buffer: Buffer, dtype: DType) -> Result<Tensor> {
        let wire = buffer.into_host()?;
        if wire.dtype() != wire_dtype(dtype) {
            let error = Error::BufferMismatch {
                op: "BufferPool::adopt",
                expected: wire.len(),
                actual: wire.len(),
                wire_dtype: wire.dtype().name(),
            };
            self.give(Buffer::Host(wire));
            return Err(error);
        }
        let numel = wire.len();
        bridge::adopt(wire, &[numel], dtype, Some(self.home()))
    }

    /// Frees every idle buffer now, on this thread, and starts a new window for the cap (the
    /// largest request and the most bytes lent at once are measured afresh); returns the
    /// bytes freed. FSDP's root calls it at the end of every backward, so the step's buffers
    /// are back with the allocator before the optimizer step allocates its own.
    pub fn release_cached(&self) -> usize {
        let freed = {
            let mut state = self.lock();
            let idle = std::mem::take(&mut state.idle);
            state.idle_bytes = 0;
            state.largest_request = 0;
            state.window_peak = state.in_use;
            state.sizes.retain(|_, size| size.lent > 0);
            for size in state.sizes.values_mut() {
                size.peak = size.lent;
            }
            idle
        };
        freed.iter().map(WireBuffer::byte_len).sum()
    }

    /// What the pool holds and has done.
    pub fn stats(&self) -> PoolStats {
        let state = self.lock();
        PoolStats {
            in_use_bytes: state.in_use,
            peak_in_use_bytes: state.peak_in_use,
            cached_bytes: state.idle_bytes,
            cached_buffers: state.idle.len(),
            idle_cap_bytes: state.cap(),
            hits: state.hits,
            misses: state.misses,
        }
    }

    /// A buffer for a redistribute's send side: not a loan (it passes through one
    /// collective and is [`keep`](BufferPool::keep)t again).
    pub(crate) fn take_send(&self, dtype: WireDType, len: usize) -> Taken {
        self.take_inner(dtype, len, false)
    }

    /// A buffer for the output of a collective that writes every element of it (all-gather,
    /// reduce-scatter and all-to-all outputs, padding included); it leaves the pool as the
    /// caller's tensor. Its stale bytes are all overwritten.
    pub(crate) fn output(&self, dtype: WireDType, len: usize) -> Buffer {
        Buffer::Host(self.take_inner(dtype, len, false).buffer)
    }

    /// Keeps a buffer that a redistribute is done with (a send buffer a collective handed
    /// back, or a source it moved into one), within the cap. A lent share whose owner still
    /// holds the memory is let go: it is the owner's tensor, not spare memory.
    pub(crate) fn keep(&self, buffer: Buffer) {
        self.accept(buffer, false);
    }

    /// Keeps the memory of a local tensor that a consuming redistribute has used up (its
    /// values were copied into a send buffer), when nobody else views it; otherwise the
    /// tensor is simply dropped.
    pub(crate) fn retire(&self, tensor: Tensor) -> Result<()> {
        if let Ok(buffer) = reclaim_buffer(tensor)? {
            self.keep(buffer);
        }
        Ok(())
    }

    /// Where a tensor over a loan gives its memory back.
    fn home(self: &Arc<Self>) -> Weak<dyn Home> {
        let home: Weak<BufferPool> = Arc::downgrade(self);
        home
    }

    fn accept(&self, buffer: Buffer, returning: bool) {
        let Ok(buffer) = buffer.into_host() else {
            return;
        };
        let key = (buffer.dtype(), buffer.len());
        let bytes = buffer.byte_len();
        let mut freed = Vec::new();
        {
            let mut state = self.lock();
            if returning {
                state.end_loan(key, bytes);
            }
            let cap = state.cap();
            let same = state
                .idle
                .iter()
                .filter(|b| (b.dtype(), b.len()) == key)
                .count();
            if buffer.is_empty() || buffer.is_shared() || bytes > cap || same >= state.allowed(key)
            {
                freed.push(buffer);
            } else {
                while !state.idle.is_empty()
                    && (state.idle_bytes + bytes > cap || state.idle.len() >= MAX_IDLE_BUFFERS)
                {
                    let oldest = state.idle.remove(0);
                    state.idle_bytes -= oldest.byte_len();
                    freed.push(oldest);
                }
                state.idle_bytes += bytes;
                state.idle.push(buffer);
            }
        }
        for buffer in freed {
            self.release(buffer);
        }
    }

    /// Drops `buffer`: on the background thread when it is large and its memory is ours
    /// alone (and the thread is up and has room), on this thread otherwise.
    fn release(&self, buffer: WireBuffer) {
        if buffer.byte_len() < DEFERRED_FREE_BYTES || buffer.is_shared() {
            return;
        }
        let mut freer = self.freer.lock().unwrap_or_else(PoisonError::into_inner);
        if freer.queue.is_none() && !freer.unavailable {
            let (queue, freed) = sync_channel::<WireBuffer>(DEFERRED_FREE_QUEUE);
            let started = std::thread::Builder::new()
                .name("buffer-pool-free".into())
                .spawn(move || freed.into_iter().for_each(drop));
            match started {
                Ok(thread) => {
                    freer.queue = Some(queue);
                    freer.thread = Some(thread);
                }
                Err(_) => freer.unavailable = true,
            }
        }
        // A full queue gives the buffer back: it is dropped below, after the lock.
        let refused = freer.queue.as_ref().map(|queue| queue.try_send(buffer));
        drop(freer);
        drop(refused);
    }
}

impl Home for BufferPool {
    fn give_back(&self, buffer: WireBuffer) {
        self.accept(Buffer::Host(buffer), true);
    }

    fn end_loan(&self, buffer: &WireBuffer) {
        self.lock()
            .end_loan((buffer.dtype(), buffer.len()), buffer.byte_len());
    }
}

impl Drop for BufferPool {
    /// Stops the background thread: closing its queue ends its loop once the buffers queued
    /// are freed. A thread that panicked is not this drop's concern.
    fn drop(&mut self) {
        let freer = self.freer.get_mut().unwrap_or_else(PoisonError::into_inner);
        freer.queue = None;
        if let Some(thread) = freer.thread.take() {
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
