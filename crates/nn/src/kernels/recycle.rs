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
//! The list is bounded: it keeps at most [`MAX_BUFFERS`] buffers, and at most as many bytes as
//! were ever handed out and alive at once (so cached plus live storage stays within twice the
//! peak the program needs anyway). Storage below [`MIN_BYTES`] is left to the allocator,
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

/// `blocks` whole blocks: a cached allocation of exactly that size (stale bytes) or a new
/// zeroed one.
fn take(blocks: usize) -> Vec<Block> {
    let bytes = blocks * 64;
    {
        let mut list = lock();
        list.outstanding += bytes;
        list.peak_outstanding = list.peak_outstanding.max(list.outstanding);
        if let Some(index) = list.free.iter().position(|b| b.len() == blocks) {
            let found = list.free.swap_remove(index);
            list.cached_bytes -= bytes;
            return found;
        }
    }
    bytemuck::zeroed_vec(blocks)
}

/// Returns `blocks` to the list, dropping the oldest entries to stay within the bounds.
fn give(blocks: Vec<Block>) {
    let bytes = blocks.len() * 64;
    let mut list = lock();
    list.outstanding = list.outstanding.saturating_sub(bytes);
    let cap = list.peak_outstanding;
    if bytes > cap {
        return;
    }
    while !list.free.is_empty()
        && (list.cached_bytes + bytes > cap || list.free.len() >= MAX_BUFFERS)
    {
        let oldest = list.free.remove(0);
        list.cached_bytes -= oldest.len() * 64;
    }
    list.cached_bytes += bytes;
    list.free.push(blocks);
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
        assert!(list.cached_bytes <= list.peak_outstanding);
        assert!(list.free.len() <= MAX_BUFFERS);
        Ok(())
    }
}
