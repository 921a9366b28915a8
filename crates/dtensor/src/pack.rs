//! Packing local tensors into collective send buffers, and a small pool of those buffers.
//!
//! A redistribute copies this rank's data into a send buffer once (the collective takes its
//! buffers by value, and the source DTensor keeps its local tensor). Two things keep that copy
//! cheap:
//! - contiguous data is copied as whole rows of bytes (`memcpy`), never element by element;
//!   only a strided source (a non-leading tensor dim moved to the front) takes the strided path;
//! - send buffers come back from the collective (`BufferPair::input`) and are kept in a
//!   [`WirePool`] per mesh family, so the next redistribute of the same size writes into warm
//!   memory instead of faulting in and zeroing a fresh allocation. A pooled buffer is dirty:
//!   every byte of the padding is zeroed explicitly.

use std::sync::{Mutex, PoisonError};

use hypershard_collectives::{Buffer, DType as WireDType, HostBuffer as WireBuffer};
use hypershard_tensor::{DType, Tensor};

use crate::bridge::{reclaim_buffer, staging_into_buffer, staging_tensor, wire_dtype};
use crate::error::Result;

/// At most this many idle send buffers are kept.
const MAX_POOLED: usize = 4;
/// At most this many idle bytes are kept (a larger buffer is freed when it comes back).
const MAX_POOLED_BYTES: usize = 256 << 20;

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

    /// Keeps a send buffer that a collective handed back, within the pool's limits.
    pub(crate) fn give(&self, buffer: Buffer) {
        let Ok(buffer) = buffer.into_host() else {
            return;
        };
        if buffer.is_empty() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let held: usize = idle.iter().map(WireBuffer::byte_len).sum();
        if held + buffer.byte_len() > MAX_POOLED_BYTES {
            return;
        }
        if idle.len() == MAX_POOLED {
            idle.remove(0);
        }
        idle.push(buffer);
    }

    /// Frees every idle buffer; returns the bytes freed.
    pub(crate) fn clear(&self) -> usize {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let bytes = idle.iter().map(WireBuffer::byte_len).sum();
        idle.clear();
        bytes
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

/// Runs `f` on the bytes of a contiguous tensor (bool is read through a copy).
fn with_bytes<R>(tensor: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    macro_rules! bytes_as {
        ($t:ty) => {
            tensor.with_data(|xs: &[$t]| f(bytemuck::cast_slice(xs)))?
        };
    }
    Ok(match tensor.dtype() {
        DType::F32 => bytes_as!(f32),
        DType::F64 => bytes_as!(f64),
        DType::BF16 => bytes_as!(half::bf16),
        DType::F16 => bytes_as!(half::f16),
        DType::I32 => bytes_as!(i32),
        DType::I64 => bytes_as!(i64),
        DType::U8 => bytes_as!(u8),
        DType::Bool => f(&tensor.to_bytes()?),
    })
}

/// A send buffer of `len` elements holding `tensor`'s elements (row-major) and then zeros.
///
/// When no padding is needed and `tensor` is the sole owner of collective memory (see
/// [`reclaim_buffer`]), that memory is the buffer and nothing is copied.
pub(crate) fn pack_whole(pool: &WirePool, tensor: Tensor, len: usize) -> Result<Buffer> {
    let tensor = if len == tensor.numel() {
        match reclaim_buffer(tensor)? {
            Ok(buffer) => return Ok(buffer),
            Err(tensor) => tensor,
        }
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
/// its leading dim.
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
    pack_whole(pool, major, rows * row_elems)
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
        let whole = pack_whole(&pool, owned, 4)?;
        assert_eq!(whole.as_host()?.as_bytes().as_ptr() as usize, address);
        assert_eq!(whole.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0]);
        // A shared view is copied, leaving the other view intact.
        let shared = crate::bridge::staging_tensor(&[2, 2], DType::F32)?;
        shared.copy_from(&t)?;
        let copied = pack_whole(&pool, shared.clone(), 4)?;
        assert_eq!(copied.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(shared.to_vec::<f32>()?, vec![1.0, 2.0, 3.0, 4.0]);
        Ok(())
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
    fn the_pool_keeps_few_buffers() {
        let pool = WirePool::default();
        for _ in 0..10 {
            pool.give(Buffer::from_vec(vec![0u8; 8]));
        }
        assert_eq!(pool.idle(), MAX_POOLED);
        pool.give(Buffer::from_vec(vec![0u8; MAX_POOLED_BYTES]));
        assert_eq!(pool.idle(), MAX_POOLED);
        assert_eq!(pool.clear(), MAX_POOLED * 8);
        assert_eq!(pool.idle(), 0);
    }
}
