//! Packing local tensors into collective send buffers.
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
//!    rows of bytes (`memcpy`), never element by element, into a send buffer from the mesh's
//!    [`BufferPool`]: send buffers come back from the collective (`BufferPair::input`) and are
//!    kept there, so the next redistribute of the same size writes into warm memory instead of
//!    faulting in a fresh allocation. A pooled buffer is dirty: every byte of the padding is
//!    zeroed explicitly.

use hypershard_collectives::Buffer;
use hypershard_tensor::Tensor;

use crate::bridge::{
    lend_buffer, reclaim_buffer, staging_into_buffer, staging_tensor, wire_dtype, with_bytes,
};
use crate::error::Result;
use crate::pool::{BufferPool, Taken};

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
    pool: &BufferPool,
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
    let Taken { mut buffer, zeroed } = pool.take_send(wire_dtype(tensor.dtype()), len);
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
pub(crate) fn pack_padded(pool: &BufferPool, major: Tensor, rows: usize) -> Result<Buffer> {
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
    pool: &BufferPool,
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
    let Taken { mut buffer, zeroed } = pool.take_send(wire_dtype(dtype), len);
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
        let pool = BufferPool::new();
        let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
        let first = pack_padded(&pool, t.clone(), 3)?;
        assert_eq!(first.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0, 0.0, 0.0]);
        // A dirty buffer of the same size comes back and is reused.
        pool.keep(Buffer::from_vec(vec![9.0f32; 6]));
        assert_eq!(pool.stats().cached_buffers, 1);
        let second = pack_padded(&pool, t.clone(), 3)?;
        assert_eq!(pool.stats().cached_buffers, 0);
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
        let idle = pool.stats().cached_buffers;
        let again = pack_padded(&pool, shared.clone(), 2)?;
        pool.keep(again);
        assert_eq!(
            pool.stats().cached_buffers,
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
        let pool = BufferPool::new();
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
        pool.keep(Buffer::from_vec(vec![-1i64; 18]));
        let reused = pack_all_to_all(&pool, &t, &layout)?;
        assert_eq!(reused.as_slice::<i64>()?, expected.as_slice());
        // The same values through a transposed (non-contiguous) view.
        let columns: Vec<i64> = (0..5).flat_map(|j| [j, 5 + j]).collect();
        let strided = Tensor::from_vec(columns, &[5, 2])?.transpose(0, 1)?;
        assert!(!strided.is_contiguous());
        assert_eq!(pack_all_to_all(&pool, &strided, &layout)?, fresh);
        Ok(())
    }
}
