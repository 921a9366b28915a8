//! Recycled storage for large kernel outputs that are overwritten in full.
//!
//! A training step allocates the same large outputs again and again: each `Linear`'s weight
//! gradient (4 MiB for a 1024 × 1024 layer), its output and input gradient. Fresh zeroed
//! allocations of that size come from the kernel as new pages, and the profile of the FSDP
//! benchmark showed their page faults and clearing at 5–6% of the step (and a third of the
//! single-rank step after the GEMM work). Outputs a kernel overwrites completely need neither
//! the zeroing nor new pages: [`tensor`] hands out storage whose bytes go back to a
//! process-wide free list when the last view of the tensor is dropped.
//!
//! The list is bounded: it keeps at most [`MAX_BUFFERS`] buffers, and cached plus live storage
//! stays within twice the most bytes ever handed out and alive at once (the peak the program
//! needs anyway). The bound is on the sum, not on the cache alone: between the end of a
//! backward (everything cached, little live) and the next one, a cache capped at the peak by
//! itself evicted the largest activations to make room for the weight gradients freed after
//! them, and every step then allocated and zeroed those activations again. Storage below [`MIN_BYTES`] is left to the allocator,
//! which serves small sizes well. The memory tracker counts a recycled tensor's bytes while
//! the tensor is alive, like any other storage, and not while they sit in the list.

use std::sync::{Mutex, MutexGuard, PoisonError};

use hypershard_tensor::{DType, ForeignBytes, HostBuffer, Tensor};

use crate::Result;

/// Outputs smaller than this are allocated normally.
pub(crate) const MIN_BYTES: usize = 64 << 10;
/// The most buffers the free list keeps: enough for every large output of a step of a deep
/// stack of layers (a dozen per layer, each kept for backward), so that the bound in bytes,
/// not the count, is what limits the list.
pub(crate) const MAX_BUFFERS: usize = 512;

/// One 64-byte, 64-aligned block: a `Vec` of these is aligned storage without `unsafe`.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Block([u8; 64]);

#[derive(Default)]
struct FreeList {
    free: Vec<Vec<Block>>,
    cached_bytes: usize,
    outstanding: usize,
    peak_outstanding: usize,
}

static FREE: Mutex<FreeList> = Mutex::new(FreeList {
    free: Vec::new(),
    cached_bytes: 0,
    outstanding: 0,
    peak_outstanding: 0,
});

fn lock() -> MutexGuard<'static, FreeList> {
    FREE.lock().unwrap_or_else(PoisonError::into_inner)
}

impl FreeList {
    /// Counts `blocks` whole blocks as handed out and returns a cached allocation of exactly
    /// that size (stale bytes), if one is cached.
    fn take_cached(&mut self, blocks: usize) -> Option<Vec<Block>> {
        let bytes = blocks * 64;
        self.outstanding += bytes;
        self.peak_outstanding = self.peak_outstanding.max(self.outstanding);
        let index = self.free.iter().position(|b| b.len() == blocks)?;
        self.cached_bytes -= bytes;
        Some(self.free.swap_remove(index))
    }

    /// Takes `blocks` back, dropping the oldest entries to stay within the bounds; returns
    /// what it does not keep, for the caller to free outside the lock.
    fn give(&mut self, blocks: Vec<Block>) -> Vec<Vec<Block>> {
        let bytes = blocks.len() * 64;
        self.outstanding = self.outstanding.saturating_sub(bytes);
        // What the cache may hold so that cached + live stays within twice the peak of live.
        let cap = (2 * self.peak_outstanding).saturating_sub(self.outstanding);
        if bytes > cap {
            return vec![blocks];
        }
        let mut dropped = Vec::new();
        while !self.free.is_empty()
            && (self.cached_bytes + bytes > cap || self.free.len() >= MAX_BUFFERS)
        {
            let oldest = self.free.remove(0);
            self.cached_bytes -= oldest.len() * 64;
            dropped.push(oldest);
        }
        self.cached_bytes += bytes;
        self.free.push(blocks);
        dropped
    }
}

/// `blocks` whole blocks: a cached allocation of exactly that size (stale bytes) or a new
/// zeroed one.
fn take(blocks: usize) -> Vec<Block> {
    let cached = lock().take_cached(blocks);
    cached.unwrap_or_else(|| bytemuck::zeroed_vec(blocks))
}

/// Returns `blocks` to the list; what the list does not keep is freed after the lock is let go.
fn give(blocks: Vec<Block>) {
    let dropped = lock().give(blocks);
    drop(dropped);
}

/// Drops every cached buffer, returning its memory to the allocator (and, for large ones, to
/// the system). The training step's other phases (the optimizer step, a checkpoint) then do
/// not run on top of a step's worth of idle kernel outputs; the next step refills the list
/// with its first allocation of each size.
pub fn release_cached() {
    let mut list = lock();
    list.free.clear();
    list.cached_bytes = 0;
}

/// The bytes of kernel outputs cached for reuse now (not counting those in use), torch's
/// `memory_reserved` minus `memory_allocated` for this cache.
pub fn cached_bytes() -> usize {
    lock().cached_bytes
}

/// Recycled memory adopted as tensor storage; it returns to the list when dropped.
struct Recycled {
    blocks: Vec<Block>,
    len: usize,
}

impl ForeignBytes for Recycled {
    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.blocks)[..self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.blocks)[..self.len]
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        give(std::mem::take(&mut self.blocks));
    }
}

/// A contiguous tensor of `shape` and `dtype` whose elements hold arbitrary (stale) values:
/// the caller must overwrite every one. Small tensors are ordinary zeroed allocations.
pub(crate) fn tensor(shape: &[usize], dtype: DType) -> Result<Tensor> {
    let numel: usize = shape.iter().product();
    let len = numel.saturating_mul(dtype.size_of());
    if len < MIN_BYTES {
        return Ok(Tensor::zeros(shape, dtype)?);
    }
    let bytes = Box::new(Recycled {
        blocks: take(len.div_ceil(64)),
        len,
    });
    let storage = match HostBuffer::from_foreign(bytes) {
        Ok(storage) => storage,
        Err(foreign) => HostBuffer::from_bytes(foreign.bytes()),
    };
    Ok(Tensor::from_host_buffer(storage, shape, dtype)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_outputs_come_back_and_small_ones_are_plain() -> Result<()> {
        // A size no other test uses, so the process-wide list is this test's alone.
        let shape = [3, 7001];
        let first = tensor(&shape, DType::F32)?;
        first.with_data_mut::<f32, _>(|v| v.fill(2.5))?;
        let address = first.with_data::<f32, _>(|v| v.as_ptr() as usize)?;
        drop(first);
        let second = tensor(&shape, DType::F32)?;
        assert_eq!(second.shape(), &shape);
        // Same memory, stale values: exactly what the caller promises to overwrite.
        assert_eq!(
            second.with_data::<f32, _>(|v| v.as_ptr() as usize)?,
            address
        );
        assert!(second.with_data::<f32, _>(|v| v.iter().all(|&x| x == 2.5))?);
        // Below MIN_BYTES the tensor is an ordinary zeroed one.
        let small = tensor(&[4, 4], DType::F32)?;
        assert_eq!(small.to_vec::<f32>()?, vec![0.0; 16]);
        // While one is alive, another of the same size is a different allocation.
        let third = tensor(&shape, DType::F32)?;
        assert_ne!(third.with_data::<f32, _>(|v| v.as_ptr() as usize)?, address);
        drop(second);
        drop(third);
        let list = lock();
        assert!(list.cached_bytes + list.outstanding <= 2 * list.peak_outstanding);
        assert!(list.free.len() <= MAX_BUFFERS);
        Ok(())
    }

    /// A training step's pattern: activations live through forward, weight gradients taken
    /// and freed after them, then the next forward asks for the activations again. A cache
    /// capped at the live peak on its own evicted the activations to keep the gradients, and
    /// the next forward missed; with the bound on cached plus live it hits every time.
    #[test]
    fn a_step_after_the_first_finds_every_buffer_cached() {
        let mut list = FreeList::default();
        let activation = 6 * 1024;
        let gradient = 3 * 1024;
        let mut allocations = 0;
        let mut take = |list: &mut FreeList, blocks: usize| {
            list.take_cached(blocks).unwrap_or_else(|| {
                allocations += 1;
                vec![Block([0; 64]); blocks]
            })
        };
        for step in 0..3 {
            // Forward: two activations alive at once (the peak).
            let a = take(&mut list, activation);
            let b = take(&mut list, activation);
            // Backward frees them; the gradients are taken and freed after them.
            assert!(list.give(a).is_empty());
            assert!(list.give(b).is_empty());
            let g = take(&mut list, gradient);
            let h = take(&mut list, gradient);
            assert!(list.give(g).is_empty(), "step {step}: nothing evicted");
            assert!(list.give(h).is_empty(), "step {step}: nothing evicted");
            assert!(list.cached_bytes + list.outstanding <= 2 * list.peak_outstanding);
        }
        // Four buffers in the first step, none after it.
        assert_eq!(allocations, 4);
        assert_eq!(list.peak_outstanding, 2 * activation * 64);
        assert_eq!(list.cached_bytes, (2 * activation + 2 * gradient) * 64);
    }

    #[test]
    fn cached_plus_live_stays_within_twice_the_peak() {
        let mut list = FreeList::default();
        let a = list
            .take_cached(100)
            .unwrap_or_else(|| vec![Block([0; 64]); 100]);
        assert!(list.give(a).is_empty());
        // Distinct sizes, one at a time: each is a new allocation, and the oldest go once the
        // cached bytes would pass twice the peak (100 blocks live at most).
        let mut dropped = 0;
        for blocks in 60..70 {
            let b = list
                .take_cached(blocks)
                .unwrap_or_else(|| vec![Block([0; 64]); blocks]);
            dropped += list.give(b).len();
            assert!(list.cached_bytes + list.outstanding <= 2 * list.peak_outstanding);
        }
        assert!(dropped > 0);
        // A buffer larger than twice the peak is never kept.
        list.outstanding = 0;
        let big = vec![Block([0; 64]); 250];
        assert_eq!(list.give(big).len(), 1);
    }
}
