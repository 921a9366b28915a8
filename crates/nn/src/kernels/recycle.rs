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
//! The list is bounded so that caching never costs much memory the program would not need
//! anyway: the bytes of recycled storage in use plus the bytes cached never exceed the most
//! ever in use at once by more than a tenth ([`HEADROOM_TENTHS`]); where the bound requires
//! it, the oldest cached buffers are freed first. A request takes a cached buffer of exactly
//! its size, or failing that the smallest one at most half again as large
//! ([`MAX_SLACK_HALVES`]): a step's weight gradients are smaller than its activations and are
//! allocated while the activations are being freed, so they can live in those buffers instead
//! of every size keeping buffers of its own. Replayed over the sequences of requests of
//! `hypershard train` steps (medium and gpt2, 1 and 4 ranks), these rules leave nothing to
//! allocate afresh in a steady step, where bounding the cached bytes alone by the peak, with
//! exact sizes only, re-allocated a sixth of medium's activations every step while holding
//! more at its height.
//!
//! Storage below [`MIN_BYTES`] is left to the allocator, which serves small sizes well. The
//! memory tracker counts a recycled tensor's requested bytes while the tensor is alive, like
//! any other storage, and not while they sit in the list.

use std::sync::{Mutex, MutexGuard, PoisonError};

use hypershard_tensor::{DType, ForeignBytes, HostBuffer, Tensor};

use crate::Result;

/// Outputs smaller than this are allocated normally.
pub(crate) const MIN_BYTES: usize = 64 << 10;
/// The most buffers the free list keeps: enough for every large output of a step of a deep
/// stack of layers (a dozen per layer, each kept for backward), so that the bound in bytes,
/// not the count, is what limits the list.
pub(crate) const MAX_BUFFERS: usize = 512;
/// Storage in use plus cached stays within `(10 + HEADROOM_TENTHS) / 10` of the most ever in
/// use at once.
const HEADROOM_TENTHS: usize = 1;
/// A request may take a cached buffer up to `(2 + MAX_SLACK_HALVES) / 2` times its size.
const MAX_SLACK_HALVES: usize = 1;

/// One 64-byte, 64-aligned block: a `Vec` of these is aligned storage without `unsafe`.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Block([u8; 64]);

/// The cached buffers (oldest first) and the byte counts that bound them. `in_use` and
/// `peak_in_use` count whole buffers, so a request served from a larger buffer counts the
/// larger size.
struct FreeList {
    free: Vec<Vec<Block>>,
    cached_bytes: usize,
    in_use: usize,
    peak_in_use: usize,
}

/// What [`FreeList::take`] found for a request.
enum Taken {
    /// A cached buffer of at least the requested size.
    Cached(Vec<Block>),
    /// Nothing cached fits: the caller allocates this many blocks (room was made for them).
    Allocate(usize),
}

impl FreeList {
    const fn new() -> Self {
        FreeList {
            free: Vec::new(),
            cached_bytes: 0,
            in_use: 0,
            peak_in_use: 0,
        }
    }

    /// The most bytes in use plus cached that the list allows, given the peak in use.
    fn limit(peak: usize) -> usize {
        peak.saturating_add(peak / 10 * HEADROOM_TENTHS)
    }

    /// A buffer of at least `blocks` blocks: a cached one of exactly that size, else the
    /// smallest within the slack, else room for a new one (evicting the oldest cached
    /// buffers while in use plus cached plus the new one would exceed the limit).
    fn take(&mut self, blocks: usize) -> Taken {
        let largest = blocks.saturating_add(blocks / 2 * MAX_SLACK_HALVES);
        // The smallest that fits, the oldest of equals: one of exactly this size if any.
        let fitting = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() >= blocks && b.len() <= largest)
            .min_by_key(|(_, b)| b.len())
            .map(|(index, _)| index);
        if let Some(index) = fitting {
            let found = self.free.remove(index);
            let bytes = found.len() * 64;
            self.cached_bytes -= bytes;
            self.note_in_use(bytes);
            return Taken::Cached(found);
        }
        let bytes = blocks.saturating_mul(64);
        let limit = Self::limit(self.peak_in_use.max(self.in_use.saturating_add(bytes)));
        while !self.free.is_empty() && self.in_use + self.cached_bytes + bytes > limit {
            self.evict_oldest();
        }
        self.note_in_use(bytes);
        Taken::Allocate(blocks)
    }

    fn note_in_use(&mut self, bytes: usize) {
        self.in_use = self.in_use.saturating_add(bytes);
        self.peak_in_use = self.peak_in_use.max(self.in_use);
    }

    /// Takes `blocks` back into the cache, evicting the oldest cached buffers as the bounds
    /// require. It always fits: it was counted in use, and in use never exceeds the peak.
    fn give(&mut self, blocks: Vec<Block>) {
        let bytes = blocks.len() * 64;
        self.in_use = self.in_use.saturating_sub(bytes);
        let limit = Self::limit(self.peak_in_use);
        while !self.free.is_empty()
            && (self.in_use + self.cached_bytes + bytes > limit || self.free.len() >= MAX_BUFFERS)
        {
            self.evict_oldest();
        }
        self.cached_bytes += bytes;
        self.free.push(blocks);
    }

    fn evict_oldest(&mut self) {
        let oldest = self.free.remove(0);
        self.cached_bytes -= oldest.len() * 64;
    }
}

/// The process-wide list that nn's kernels draw from.
static FREE: Mutex<FreeList> = Mutex::new(FreeList::new());

fn lock(list: &Mutex<FreeList>) -> MutexGuard<'_, FreeList> {
    list.lock().unwrap_or_else(PoisonError::into_inner)
}

/// At least `blocks` whole blocks from `list`: cached storage (stale bytes) or a new zeroed
/// allocation.
fn take(list: &Mutex<FreeList>, blocks: usize) -> Vec<Block> {
    // The lock is released before a new allocation is zeroed.
    let taken = lock(list).take(blocks);
    match taken {
        Taken::Cached(found) => found,
        Taken::Allocate(blocks) => bytemuck::zeroed_vec(blocks),
    }
}

/// Returns `blocks` to `list`.
fn give(list: &Mutex<FreeList>, blocks: Vec<Block>) {
    lock(list).give(blocks);
}

/// Drops every cached buffer, returning its memory to the allocator (and, for large ones, to
/// the system). The training step's other phases (the optimizer step, a checkpoint) then do
/// not run on top of a step's worth of idle kernel outputs; the next step refills the list
/// with its first allocation of each size.
pub fn release_cached() {
    let mut list = lock(&FREE);
    list.free.clear();
    list.cached_bytes = 0;
}

/// The bytes of kernel outputs cached for reuse now (not counting those in use), torch's
/// `memory_reserved` minus `memory_allocated` for this cache.
pub fn cached_bytes() -> usize {
    lock(&FREE).cached_bytes
}

/// Recycled memory adopted as tensor storage; it returns to its list when dropped. `blocks`
/// may be larger than the `len` bytes the tensor uses.
struct Recycled {
    blocks: Vec<Block>,
    len: usize,
    list: &'static Mutex<FreeList>,
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
        give(self.list, std::mem::take(&mut self.blocks));
    }
}

/// A contiguous tensor of `shape` and `dtype` whose elements hold arbitrary (stale) values:
/// the caller must overwrite every one. Small tensors are ordinary zeroed allocations.
pub(crate) fn tensor(shape: &[usize], dtype: DType) -> Result<Tensor> {
    tensor_from(&FREE, shape, dtype)
}

/// [`tensor`] drawing on `list`.
fn tensor_from(list: &'static Mutex<FreeList>, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let numel: usize = shape.iter().product();
    let len = numel.saturating_mul(dtype.size_of());
    if len < MIN_BYTES {
        return Ok(Tensor::zeros(shape, dtype)?);
    }
    let bytes = Box::new(Recycled {
        blocks: take(list, len.div_ceil(64)),
        len,
        list,
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

    const MIB: usize = 1 << 20;

    /// A list's bookkeeping: in use plus cached within the limit, the count cap kept, and
    /// `cached_bytes` the sum of the cached buffers.
    fn assert_bounded(list: &FreeList) {
        assert!(list.in_use + list.cached_bytes <= FreeList::limit(list.peak_in_use));
        assert!(list.free.len() <= MAX_BUFFERS);
        let sum: usize = list.free.iter().map(|b| b.len() * 64).sum();
        assert_eq!(sum, list.cached_bytes);
    }

    /// Takes `bytes` (a multiple of 64) from `list`, allocating on a miss; counts the miss.
    fn take_counting(list: &mut FreeList, bytes: usize, misses: &mut usize) -> Vec<Block> {
        match list.take(bytes / 64) {
            Taken::Cached(found) => found,
            Taken::Allocate(blocks) => {
                *misses += 1;
                vec![Block([0; 64]); blocks]
            }
        }
    }

    #[test]
    fn dropped_outputs_come_back_and_small_ones_are_plain() -> Result<()> {
        // A list of this test's own: the process-wide one is shared with every other test.
        static LIST: Mutex<FreeList> = Mutex::new(FreeList::new());
        let shape = [4, 9001];
        let first = tensor_from(&LIST, &shape, DType::F32)?;
        first.with_data_mut::<f32, _>(|v| v.fill(2.5))?;
        let address = first.with_data::<f32, _>(|v| v.as_ptr() as usize)?;
        drop(first);
        assert_eq!(
            lock(&LIST).cached_bytes,
            (4 * 9001 * 4usize).div_ceil(64) * 64
        );
        let second = tensor_from(&LIST, &shape, DType::F32)?;
        assert_eq!(second.shape(), &shape);
        // Same memory, stale values: exactly what the caller promises to overwrite.
        assert_eq!(
            second.with_data::<f32, _>(|v| v.as_ptr() as usize)?,
            address
        );
        assert!(second.with_data::<f32, _>(|v| v.iter().all(|&x| x == 2.5))?);
        // A smaller request within the slack takes the same buffer once it is back, and sees
        // only its own length of it.
        drop(second);
        let smaller = tensor_from(&LIST, &[3, 9001], DType::F32)?;
        assert_eq!(smaller.numel(), 3 * 9001);
        assert_eq!(
            smaller.with_data::<f32, _>(|v| v.as_ptr() as usize)?,
            address
        );
        // Below MIN_BYTES the tensor is an ordinary zeroed one.
        let small = tensor_from(&LIST, &[4, 4], DType::F32)?;
        assert_eq!(small.to_vec::<f32>()?, vec![0.0; 16]);
        // While one is alive, another of the same size is a different allocation.
        let third = tensor_from(&LIST, &[3, 9001], DType::F32)?;
        assert_ne!(third.with_data::<f32, _>(|v| v.as_ptr() as usize)?, address);
        drop(smaller);
        drop(third);
        assert_bounded(&lock(&LIST));
        Ok(())
    }

    #[test]
    fn a_request_takes_its_own_size_first_then_the_smallest_within_half_again() {
        let mut list = FreeList::new();
        let mut misses = 0;
        let sizes = [4 * MIB, 3 * MIB, 2 * MIB];
        let held: Vec<_> = sizes
            .iter()
            .map(|&s| take_counting(&mut list, s, &mut misses))
            .collect();
        assert_eq!(misses, 3);
        for blocks in held {
            list.give(blocks);
        }
        // Exact size although a larger one fits.
        let exact = take_counting(&mut list, 2 * MIB, &mut misses);
        assert_eq!((exact.len() * 64, misses), (2 * MIB, 3));
        // 2.5 MiB: 3 MiB is the smallest that fits (4 MiB would fit the slack too).
        let fitted = take_counting(&mut list, 5 * MIB / 2, &mut misses);
        assert_eq!((fitted.len() * 64, misses), (3 * MIB, 3));
        // 2 MiB again: only 4 MiB is left, twice the request: past the slack, a miss.
        let missed = take_counting(&mut list, 2 * MIB, &mut misses);
        assert_eq!((missed.len() * 64, misses), (2 * MIB, 4));
        assert_bounded(&list);
    }

    #[test]
    fn in_use_plus_cached_stays_within_a_tenth_of_the_peak() {
        let mut list = FreeList::new();
        let mut misses = 0;
        // 10 MiB in use at the peak, then all of it back.
        let held: Vec<_> = (0..10)
            .map(|_| take_counting(&mut list, MIB, &mut misses))
            .collect();
        for blocks in held {
            list.give(blocks);
        }
        assert_eq!(list.cached_bytes, 10 * MIB);
        // A size nothing cached fits: room is made by evicting the oldest, so in use plus
        // cached never passes 11 MiB.
        let big = take_counting(&mut list, 6 * MIB, &mut misses);
        assert_eq!(misses, 11);
        assert_eq!(list.in_use, 6 * MIB);
        assert_eq!(list.cached_bytes, 5 * MIB);
        assert_bounded(&list);
        // A second one raises the peak to 12 MiB: the limit grows with it (13.2 MiB), and
        // of the cached buffers only as many stay as fit beside the 12 MiB in use.
        let over = take_counting(&mut list, 6 * MIB, &mut misses);
        assert_eq!((list.peak_in_use, list.cached_bytes), (12 * MIB, MIB));
        assert_bounded(&list);
        // Both come back and are kept: 13 MiB within 13.2.
        list.give(big);
        list.give(over);
        assert_eq!((list.in_use, list.cached_bytes), (0, 13 * MIB));
        assert_bounded(&list);
    }

    #[test]
    fn a_steady_training_step_allocates_nothing_after_the_first() {
        // A step's shape: forward keeps 8 activations of 3 MiB; backward frees them one by
        // one while allocating a 2.25 MiB weight gradient per layer, held until the next
        // step begins (as `zero_grad` drops them).
        let mut list = FreeList::new();
        let mut misses_per_step = Vec::new();
        let mut grads: Vec<Vec<Block>> = Vec::new();
        for _ in 0..4 {
            let mut misses = 0;
            for g in grads.drain(..) {
                list.give(g);
            }
            let mut activations: Vec<_> = (0..8)
                .map(|_| take_counting(&mut list, 3 * MIB, &mut misses))
                .collect();
            while let Some(a) = activations.pop() {
                grads.push(take_counting(&mut list, 9 * MIB / 4, &mut misses));
                list.give(a);
                assert_bounded(&list);
            }
            misses_per_step.push(misses);
        }
        // The first step allocates the activations and the first gradient; the gradients
        // then live in the activations' buffers, and nothing is allocated again.
        assert_eq!(misses_per_step, [9, 0, 0, 0]);
        assert!(list.peak_in_use <= 27 * MIB);
    }
}
