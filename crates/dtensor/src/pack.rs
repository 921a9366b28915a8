//! Packing local tensors into collective send buffers, and a small pool of those buffers.
//!
//! A redistribute hands this rank's data to a collective in the cheapest form the data allows,
//! tried in this order (see `docs/redistribute.md`, "What is copied"):
//! 1. **moved**: the local tensor is the sole owner of collective memory and needs no padding
//!    (a consuming redistribute of a tensor that came out of a collective or a factory): that
//!    memory is the send buffer ([`reclaim_buffer`]);
//! 2. **lent**: the tensor is collective memory that others still view (a borrowing
//!    redistribute keeps its source) and the op only reads its input (all-gather,
//!    reduce-scatter): a copy-on-write share of that memory is the send buffer
//!    ([`lend_buffer`]). An all-to-all without padding takes its source in one of these two
//!    ways and reads each peer's block as rows in place
//!    (`Communicator::all_to_all_strided`, see the executor), so it packs nothing;
//! 3. **copied** otherwise (padding, a strided source, an all-to-all that needs padding, an
//!    all-reduce that works in place, memory from elsewhere). Contiguous data is copied as whole
//!    rows of bytes (`memcpy`), never element by element, into a send buffer from a
//!    [`WirePool`]: send buffers come back from the collective (`BufferPair::input`) and are
//!    kept per mesh family, so the next redistribute of the same size writes into warm memory
//!    instead of faulting in a fresh allocation. A pooled buffer is dirty: every byte of the
//!    padding is zeroed explicitly.

use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Mutex, OnceLock, PoisonError};

use hypershard_collectives::{Buffer, DType as WireDType, HostBuffer as WireBuffer};
use hypershard_tensor::Tensor;

use crate::bridge::{
    lend_buffer, reclaim_buffer, staging_into_buffer, staging_tensor, wire_dtype, with_bytes,
};
use crate::error::Result;

/// At most this many idle send buffers are kept.
const MAX_POOLED: usize = 4;
/// At most this many idle bytes are kept (a larger buffer is freed when it comes back).
const MAX_POOLED_BYTES: usize = 256 << 20;

/// Buffers at least this large are freed on a background thread when the pool lets them go:
/// handing a 64 MiB allocation back to the OS takes milliseconds (its pages are unmapped),
/// which a redistribute should not wait for.
const DEFERRED_FREE_BYTES: usize = 1 << 20;
/// At most this many large buffers wait for the background thread; past that they are freed
/// on the caller's thread, so the deferred memory stays bounded.
const DEFERRED_FREE_QUEUE: usize = 4;

/// Drops `buffer`, on a background thread when it is large (and the thread could be started
/// and has room), on this thread otherwise.
fn release(buffer: WireBuffer) {
    if buffer.byte_len() < DEFERRED_FREE_BYTES {
        return;
    }
    static FREER: OnceLock<Option<SyncSender<WireBuffer>>> = OnceLock::new();
    let freer = FREER.get_or_init(|| {
        let (sender, receiver) = sync_channel::<WireBuffer>(DEFERRED_FREE_QUEUE);
        std::thread::Builder::new()
            .name("dtensor-free".into())
            .spawn(move || receiver.into_iter().for_each(drop))
            .ok()
            .map(|_| sender)
    });
    if let Some(freer) = freer {
        // A full queue (or a thread that is gone) gives the buffer back: it drops here.
        let _ = freer.try_send(buffer);
    }
}

/// Idle collective send buffers, reused by exact (dtype, length).
#[derive(Debug, Default)]
pub(crate) struct WirePool {
    idle: Mutex<Vec<WireBuffer>>,
}

/// A send buffer and whether its bytes are known to be zero.
struct Taken {
    buffer: WireBuffer,
    zeroed: bool,
}

impl WirePool {
    /// A buffer of `len` elements of `dtype`: an idle one (dirty) or a fresh one (zeroed).
    fn take(&self, dtype: WireDType, len: usize) -> Taken {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        match idle
            .iter()
            .position(|b| b.dtype() == dtype && b.len() == len)
        {
            Some(found) => Taken {
                buffer: idle.swap_remove(found),
                zeroed: false,
            },
            None => Taken {
                buffer: WireBuffer::zeros(dtype, len),
                zeroed: true,
            },
        }
    }

    /// A buffer for the output of a collective that writes every element of it (all-gather,
    /// reduce-scatter and all-to-all outputs, padding included): an idle buffer of that size
    /// when the pool has one, so the output lands in warm memory instead of faulting in a
    /// fresh allocation; otherwise a fresh zeroed one. Its stale bytes are all overwritten.
    pub(crate) fn output(&self, dtype: WireDType, len: usize) -> Buffer {
        Buffer::Host(self.take(dtype, len).buffer)
    }

    /// Keeps a send buffer that a collective handed back (or a consumed source), within the
    /// pool's limits (a buffer that would take the idle bytes past [`MAX_POOLED_BYTES`] is
    /// freed; a fifth buffer evicts the oldest). A lent buffer whose owner still holds the
    /// memory is let go: it is the owner's tensor, not spare memory.
    ///
    /// At most one idle buffer of each (dtype, length) is kept. A collective takes at most one
    /// buffer of a size from the pool for its output and one for its send buffer, and hands
    /// back at most one (its send buffer, or the source a consuming redistribute moved into
    /// it), so a second idle buffer of a size already held is only reused if two ops of that
    /// size run back to back without handing anything back; meanwhile it takes a slot and
    /// pushes the oldest buffer, of another size, out of the pool, to be unmapped and faulted
    /// in afresh by the next redistribute of that shape. A buffer whose size is already idle
    /// is therefore freed itself (off-thread when large), and the pool's slots hold distinct
    /// sizes.
    pub(crate) fn give(&self, buffer: Buffer) {
        let Ok(buffer) = buffer.into_host() else {
            return;
        };
        if buffer.is_empty() || buffer.is_shared() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let duplicate = idle
            .iter()
            .any(|b| b.dtype() == buffer.dtype() && b.len() == buffer.len());
        let held: usize = idle.iter().map(WireBuffer::byte_len).sum();
        if duplicate || held + buffer.byte_len() > MAX_POOLED_BYTES {
            drop(idle);
            release(buffer);
            return;
        }
        let evicted = (idle.len() == MAX_POOLED).then(|| idle.remove(0));
        idle.push(buffer);
        drop(idle);
        if let Some(evicted) = evicted {
            release(evicted);
        }
    }

    /// Keeps the memory of a local tensor that a consuming redistribute has used up (its
    /// values were copied into a send buffer), when nobody else views it; otherwise the
    /// tensor is simply dropped.
    pub(crate) fn retire(&self, tensor: Tensor) -> Result<()> {
        if let Ok(buffer) = reclaim_buffer(tensor)? {
            self.give(buffer);
        }
        Ok(())
    }

    /// Frees every idle buffer; returns the bytes freed.
    pub(crate) fn clear(&self) -> usize {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let bytes = idle.iter().map(WireBuffer::byte_len).sum();
        idle.clear();
        bytes
    }

    /// The (dtype, length) of every idle buffer, oldest first (for tests).
    #[cfg(test)]
    pub(crate) fn idle_sizes(&self) -> Vec<(WireDType, usize)> {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|b| (b.dtype(), b.len()))
            .collect()
    }

    /// How many idle buffers are held (for tests).
    #[cfg(test)]
    pub(crate) fn idle(&self) -> usize {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// What the collective does with its send buffer, which decides whether it may be lent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum InputUse {
    /// The op only reads its input (all-gather, reduce-scatter): a copy-on-write share of
    /// the tensor's memory serves without a copy.
    ReadOnly,
    /// The op works in place on its buffer (all-reduce): a share would be copied on the
    /// first write, so a pooled buffer is filled instead.
    InPlace,
}

/// A send buffer of `len` elements holding `tensor`'s elements (row-major) and then zeros.
///
/// When no padding is needed, the tensor's own collective memory is moved ([`reclaim_buffer`])
/// or, for a read-only use, lent ([`lend_buffer`]); only otherwise is it copied.
pub(crate) fn pack_whole(
    pool: &WirePool,
    tensor: Tensor,
    len: usize,
    usage: InputUse,
) -> Result<Buffer> {
    let tensor = if len == tensor.numel() {
        let tensor = match reclaim_buffer(tensor)? {
            Ok(buffer) => return Ok(buffer),
            Err(tensor) => tensor,
        };
        if usage == InputUse::ReadOnly
            && let Some(lent) = lend_buffer(&tensor)
        {
            return Ok(lent);
        }
        tensor
    } else {
        tensor
    };
    let tensor = tensor.contiguous()?;
    let Taken { mut buffer, zeroed } = pool.take(wire_dtype(tensor.dtype()), len);
    let out = buffer.as_bytes_mut();
    let data = tensor.nbytes();
    with_bytes(&tensor, |bytes| out[..data].copy_from_slice(bytes))?;
    if !zeroed {
        out[data..].fill(0);
    }
    Ok(Buffer::Host(buffer))
}

/// A send buffer holding the dim-major tensor `major` followed by zeros up to `rows` rows of
/// its leading dim, for an op that only reads it (moved or lent when no padding is needed).
pub(crate) fn pack_padded(pool: &WirePool, major: Tensor, rows: usize) -> Result<Buffer> {
    let held = major.shape().first().copied().unwrap_or(1);
    let row_elems: usize = major.shape().iter().skip(1).product();
    if !major.is_contiguous() {
        let mut shape = major.shape().to_vec();
        if let Some(first) = shape.first_mut() {
            *first = rows;
        }
        let staging = staging_tensor(&shape, major.dtype())?;
        if major.numel() > 0 {
            staging.narrow(0, 0, held)?.copy_from(&major)?;
        }
        return staging_into_buffer(staging);
    }
    pack_whole(pool, major, rows * row_elems, InputUse::ReadOnly)
}

/// The geometry of an all-to-all send buffer: `peers` blocks of `[from_chunk, to_chunk, rest]`
/// elements, block `m` holding this rank's `held` rows cut to peer `m`'s `to_dim` span.
pub(crate) struct AllToAllLayout<'a> {
    /// The number of peers.
    pub peers: usize,
    /// The padded length of the dim this rank holds a shard of.
    pub from_chunk: usize,
    /// The padded length of the dim being sharded.
    pub to_chunk: usize,
    /// `(offset, len)` of every peer's span of the dim being sharded.
    pub spans: &'a [(usize, usize)],
}

/// Packs `major` (`[held, to_extent, rest...]`, dim-major) into an all-to-all send buffer.
pub(crate) fn pack_all_to_all(
    pool: &WirePool,
    major: &Tensor,
    layout: &AllToAllLayout<'_>,
) -> Result<Buffer> {
    let dtype = major.dtype();
    let held = major.shape()[0];
    let rest: Vec<usize> = major.shape()[2..].to_vec();
    if !major.is_contiguous() {
        let mut shape = vec![layout.peers, layout.from_chunk, layout.to_chunk];
        shape.extend_from_slice(&rest);
        let staging = staging_tensor(&shape, dtype)?;
        for (peer, &(offset, len)) in layout.spans.iter().enumerate() {
            if len == 0 || held == 0 {
                continue;
            }
            staging
                .narrow(0, peer, 1)?
                .narrow(1, 0, held)?
                .narrow(2, 0, len)?
                .copy_from(&major.narrow(1, offset, len)?)?;
        }
        return staging_into_buffer(staging);
    }
    let element = dtype.size_of();
    let rest_bytes = rest.iter().product::<usize>() * element;
    let to_extent = major.shape()[1];
    let (src_row, dst_row) = (to_extent * rest_bytes, layout.to_chunk * rest_bytes);
    let block = layout.from_chunk * dst_row;
    let len = layout.peers * layout.from_chunk * layout.to_chunk * rest_bytes / element.max(1);
    let Taken { mut buffer, zeroed } = pool.take(wire_dtype(dtype), len);
    let out = buffer.as_bytes_mut();
    with_bytes(major, |src| {
        for (peer, &(offset, span)) in layout.spans.iter().enumerate() {
            let base = peer * block;
            for row in 0..held {
                let to = base + row * dst_row;
                let from = row * src_row + offset * rest_bytes;
                let width = span * rest_bytes;
                out[to..to + width].copy_from_slice(&src[from..from + width]);
                if !zeroed {
                    out[to + width..to + dst_row].fill(0);
                }
            }
            if !zeroed {
                out[base + held * dst_row..base + block].fill(0);
            }
        }
    })?;
    Ok(Buffer::Host(buffer))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hypershard_tensor::DType;

    #[test]
    fn padded_packs_from_the_pool_zero_their_padding() -> Result<()> {
        let pool = WirePool::default();
        let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
        let first = pack_padded(&pool, t.clone(), 3)?;
        assert_eq!(first.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0, 0.0, 0.0]);
        // A dirty buffer of the same size comes back and is reused.
        pool.give(Buffer::from_vec(vec![9.0f32; 6]));
        assert_eq!(pool.idle(), 1);
        let second = pack_padded(&pool, t.clone(), 3)?;
        assert_eq!(pool.idle(), 0);
        assert_eq!(second.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0, 0.0, 0.0]);
        // A strided source takes the element path with the same result.
        let strided = Tensor::from_vec(vec![1.0f32, 3.0, 2.0, 4.0], &[2, 2])?.transpose(0, 1)?;
        assert_eq!(pack_padded(&pool, strided, 3)?, first);
        // A sole owner of collective memory needing no padding is handed over as it is.
        let owned = crate::bridge::staging_tensor(&[2, 2], DType::F32)?;
        owned.copy_from(&t)?;
        let address = owned.with_data(|xs: &[f32]| xs.as_ptr() as usize)?;
        let whole = pack_whole(&pool, owned, 4, InputUse::InPlace)?;
        assert_eq!(whole.as_host()?.as_bytes().as_ptr() as usize, address);
        assert_eq!(whole.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0]);
        // A shared view is copied for an in-place op, leaving the other view intact.
        let shared = crate::bridge::staging_tensor(&[2, 2], DType::F32)?;
        shared.copy_from(&t)?;
        let copied = pack_whole(&pool, shared.clone(), 4, InputUse::InPlace)?;
        assert_eq!(copied.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0]);
        assert_ne!(
            copied.as_host()?.as_bytes().as_ptr(),
            shared_address(&shared)?
        );
        // For a read-only op it is lent: the same memory, and the view keeps it.
        let lent = pack_padded(&pool, shared.clone(), 2)?;
        assert_eq!(
            lent.as_host()?.as_bytes().as_ptr(),
            shared_address(&shared)?
        );
        assert!(lent.as_host()?.is_shared());
        // A write to the view while lent goes to a private copy: the share keeps the values
        // it was lent with, and the pool does not keep a share that the view still holds.
        shared.fill_(5.0)?;
        assert_eq!(lent.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(shared.to_vec::<f32>()?, vec![5.0; 4]);
        assert_ne!(
            lent.as_host()?.as_bytes().as_ptr(),
            shared_address(&shared)?
        );
        let idle = pool.idle();
        let again = pack_padded(&pool, shared.clone(), 2)?;
        pool.give(again);
        assert_eq!(
            pool.idle(),
            idle,
            "a share the tensor still holds is not pooled"
        );
        // Padding, or memory that is not collective memory, is copied even for a read.
        assert_ne!(
            pack_padded(&pool, shared.clone(), 3)?
                .as_host()?
                .as_bytes()
                .as_ptr(),
            shared_address(&shared)?
        );
        let plain = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
        let from_plain = pack_padded(&pool, plain.clone(), 2)?;
        assert!(!from_plain.as_host()?.is_shared());
        assert_eq!(from_plain.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0]);
        Ok(())
    }

    fn shared_address(tensor: &Tensor) -> Result<*const u8> {
        Ok(tensor.with_data(|xs: &[f32]| xs.as_ptr().cast::<u8>())?)
    }

    #[test]
    fn all_to_all_packs_cut_and_pad_every_block() -> Result<()> {
        let pool = WirePool::default();
        // 2 held rows of 5 columns over 3 peers: column spans 2, 2, 1 (chunk 2); rows padded
        // to 3.
        let t = Tensor::from_vec((0..10).map(|i| i as i64).collect(), &[2, 5])?;
        let spans = [(0, 2), (2, 2), (4, 1)];
        let layout = AllToAllLayout {
            peers: 3,
            from_chunk: 3,
            to_chunk: 2,
            spans: &spans,
        };
        let expected: Vec<i64> = vec![
            0, 1, 5, 6, 0, 0, // peer 0: columns 0..2
            2, 3, 7, 8, 0, 0, // peer 1: columns 2..4
            4, 0, 9, 0, 0, 0, // peer 2: column 4, padded
        ];
        let fresh = pack_all_to_all(&pool, &t, &layout)?;
        assert_eq!(fresh.as_slice::<i64>()?, expected.as_slice());
        pool.give(Buffer::from_vec(vec![-1i64; 18]));
        let reused = pack_all_to_all(&pool, &t, &layout)?;
        assert_eq!(reused.as_slice::<i64>()?, expected.as_slice());
        // The same values through a transposed (non-contiguous) view.
        let columns: Vec<i64> = (0..5).flat_map(|j| [j, 5 + j]).collect();
        let strided = Tensor::from_vec(columns, &[5, 2])?.transpose(0, 1)?;
        assert!(!strided.is_contiguous());
        assert_eq!(pack_all_to_all(&pool, &strided, &layout)?, fresh);
        Ok(())
    }

    #[test]
    fn large_buffers_past_the_limits_are_freed_off_thread_and_used_up_tensors_retired() -> Result<()>
    {
        let pool = WirePool::default();
        let large = MAX_POOLED_BYTES / 2 - 4096;
        // Three sizes (the pool keeps one buffer per size), each just under half the limit.
        for i in 0..3 {
            pool.give(Buffer::zeros(WireDType::U8, large - 64 * i));
        }
        // Two fit under the byte limit; the third went to the background thread.
        assert_eq!(pool.idle(), 2);
        // A used-up tensor in collective memory is kept; a shared one or plain memory is not.
        let used = crate::bridge::staging_tensor(&[16], DType::F32)?;
        let view = used.clone();
        pool.retire(used)?;
        assert_eq!(pool.idle(), 2);
        pool.retire(view)?;
        assert_eq!(pool.idle(), 3);
        pool.retire(Tensor::zeros(&[16], DType::F32)?)?;
        assert_eq!(pool.idle(), 3);
        assert_eq!(pool.clear(), 2 * large - 64 + 64);
        Ok(())
    }

    #[test]
    fn the_pool_keeps_few_buffers() {
        let pool = WirePool::default();
        // Ten sizes, 8 ..= 80 bytes: the oldest are evicted, the last four stay.
        for i in 1..=10 {
            pool.give(Buffer::from_vec(vec![0u8; 8 * i]));
        }
        assert_eq!(pool.idle(), MAX_POOLED);
        assert_eq!(
            pool.idle_sizes(),
            vec![
                (WireDType::U8, 56),
                (WireDType::U8, 64),
                (WireDType::U8, 72),
                (WireDType::U8, 80)
            ]
        );
        pool.give(Buffer::from_vec(vec![0u8; MAX_POOLED_BYTES]));
        assert_eq!(pool.idle(), MAX_POOLED);
        assert_eq!(pool.clear(), 56 + 64 + 72 + 80);
        assert_eq!(pool.idle(), 0);
    }

    #[test]
    fn a_consumed_source_is_not_kept_when_a_buffer_of_its_size_is_idle() -> Result<()> {
        let pool = WirePool::default();
        // Two sizes idle: 4 f32 and 6 f32.
        let first = Buffer::from_vec(vec![1.0f32; 4]);
        let kept = first.as_host()?.as_bytes().as_ptr() as usize;
        pool.give(first);
        pool.give(Buffer::from_vec(vec![2.0f32; 6]));
        assert_eq!(pool.idle(), 2);
        // A used-up source of 4 f32 (collective memory, sole owner) finds its size idle: it
        // is freed, and neither the idle buffer of its size nor the other size is pushed out.
        let used = crate::bridge::staging_tensor(&[2, 2], DType::F32)?;
        pool.retire(used)?;
        assert_eq!(
            pool.idle_sizes(),
            vec![(WireDType::F32, 4), (WireDType::F32, 6)]
        );
        // The same for a send buffer (or a moved source) a collective hands back.
        pool.give(Buffer::from_vec(vec![3.0f32; 6]));
        assert_eq!(pool.idle(), 2);
        // The buffer that stayed is the first one: the next take of that size gets it.
        let taken = pool.output(WireDType::F32, 4);
        assert_eq!(taken.as_host()?.as_bytes().as_ptr() as usize, kept);
        assert_eq!(taken.as_slice::<f32>()?, &[1.0; 4]);
        // Once it is taken, a consumed source of that size is kept again.
        pool.retire(crate::bridge::staging_tensor(&[4], DType::F32)?)?;
        assert_eq!(
            pool.idle_sizes(),
            vec![(WireDType::F32, 6), (WireDType::F32, 4)]
        );
        // The same length in another dtype is another size.
        pool.give(Buffer::zeros(WireDType::I32, 4));
        assert_eq!(pool.idle(), 3);
        Ok(())
    }

    #[test]
    fn the_pool_never_exceeds_its_bounds_and_holds_distinct_sizes() {
        let pool = WirePool::default();
        // A fixed pseudo-random walk of gives and takes over a few sizes (a 64-bit LCG, so
        // the test is the same on every run), with sizes near the byte limit now and then.
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as usize
        };
        let sizes = [16, 24, 40, 64, 100, 256, 1000];
        for step in 0..400 {
            let len = if step % 97 == 13 {
                MAX_POOLED_BYTES / 3 + next() % 4096
            } else {
                sizes[next() % sizes.len()]
            };
            if next() % 3 == 0 {
                let taken = pool.output(WireDType::U8, len);
                assert_eq!(taken.len(), len);
            } else {
                pool.give(Buffer::zeros(WireDType::U8, len));
            }
            let idle = pool.idle_sizes();
            assert!(idle.len() <= MAX_POOLED, "step {step}: {idle:?}");
            let bytes: usize = idle.iter().map(|&(_, len)| len).sum();
            assert!(bytes <= MAX_POOLED_BYTES, "step {step}: {bytes} bytes");
            let mut distinct = idle.clone();
            distinct.sort_by_key(|&(dtype, len)| (dtype.name(), len));
            distinct.dedup();
            assert_eq!(distinct.len(), idle.len(), "step {step}: {idle:?}");
        }
    }
}
