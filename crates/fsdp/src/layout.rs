//! Shard layout of one parameter over one group: `torch.chunk` along the shard dim, padded.
//!
//! Every rank's piece is padded to the chunk size along the shard dim, so every rank
//! contributes a slot of the same number of elements to a collective; the padding is zeros
//! and never reaches a parameter or a gradient.

use hypershard_mesh::{ShardSpan, shard_span};
use hypershard_tensor::Tensor;

use crate::error::Result;

/// How one parameter is cut over one group of `world` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardLayout {
    /// The unsharded shape.
    pub shape: Vec<usize>,
    /// The dim sharded along.
    pub dim: usize,
    /// The number of shards.
    pub world: usize,
}

impl ShardLayout {
    /// The span shard `index` holds along the shard dim.
    pub fn span(&self, index: usize) -> Result<ShardSpan> {
        Ok(shard_span(self.shape[self.dim], self.world, index)?)
    }

    /// The product of every dim but the shard dim.
    fn others(&self) -> usize {
        self.shape
            .iter()
            .enumerate()
            .filter(|(d, _)| *d != self.dim)
            .map(|(_, n)| n)
            .product()
    }

    /// Elements in one padded slot (the same for every shard).
    pub fn slot_numel(&self) -> Result<usize> {
        Ok(self.span(0)?.padded_len * self.others())
    }

    /// The shape of shard `index` (unpadded).
    pub fn shard_shape(&self, index: usize) -> Result<Vec<usize>> {
        let mut shape = self.shape.clone();
        shape[self.dim] = self.span(index)?.len;
        Ok(shape)
    }

    /// The padded shape every slot has.
    fn padded_shape(&self) -> Result<Vec<usize>> {
        let mut shape = self.shape.clone();
        shape[self.dim] = self.span(0)?.padded_len;
        Ok(shape)
    }

    /// Writes `shard` (shard `index`'s values, any dtype) cast to the slot's dtype into `slot`,
    /// a flat tensor of one padded slot (a view into a bucket), all of which is written: the
    /// padding becomes zeros, so a recycled buffer carries no stale bytes. Tensor ops on the
    /// slot's device, so the same copy-in runs on the host and on a device.
    pub fn pack(&self, shard: &Tensor, slot: &Tensor) -> Result<()> {
        let numel = shard.numel();
        let slot_numel = slot.numel();
        if self.dim == 0 {
            // Dim-0 padding sits at the end of the slot, so the shard's elements go first.
            slot.narrow(0, 0, numel)?
                .view(shard.shape())?
                .copy_from(shard)?;
            if numel < slot_numel {
                slot.narrow(0, numel, slot_numel - numel)?.zero_()?;
            }
        } else {
            let padded = slot
                .narrow(0, 0, self.slot_numel()?)?
                .view(&self.padded_shape()?)?;
            let len = shard.shape()[self.dim];
            let padded_len = padded.shape()[self.dim];
            padded.narrow(self.dim, 0, len)?.copy_from(shard)?;
            if len < padded_len {
                padded.narrow(self.dim, len, padded_len - len)?.zero_()?;
            }
        }
        Ok(())
    }

    /// Writes shard `index` of the unsharded `full` into `slot` (see [`pack`](Self::pack)).
    pub fn pack_from_full(&self, full: &Tensor, index: usize, slot: &Tensor) -> Result<()> {
        let span = self.span(index)?;
        let shard = full.narrow(self.dim, span.offset, span.len)?;
        self.pack(&shard, slot)
    }

    /// Shard `index` inside its padded slot (a flat tensor of the slot's dtype): a view, no
    /// copy (strided for a shard dim other than 0).
    pub fn unpack(&self, slot: &Tensor, index: usize) -> Result<Tensor> {
        let shape = self.shard_shape(index)?;
        if self.dim == 0 {
            let numel: usize = shape.iter().product();
            Ok(slot.narrow(0, 0, numel)?.view(&shape)?)
        } else {
            let padded = slot
                .narrow(0, 0, self.slot_numel()?)?
                .view(&self.padded_shape()?)?;
            Ok(padded.narrow(self.dim, 0, shape[self.dim])?)
        }
    }

    /// The padded slot's bytes when this parameter's shards are a prefix layout (dim 0, each
    /// non-empty shard at `rank · padded`), which compaction and expansion need; `None` when
    /// they are not. A buffer of `len` bytes too short for `world` blocks of `block_bytes`, or
    /// blocks shorter than the slot, is an error naming `op`.
    fn prefix_slot_bytes(
        &self,
        len: usize,
        block_bytes: usize,
        element: usize,
        op: &'static str,
    ) -> Result<Option<usize>> {
        if self.dim != 0 {
            return Ok(None);
        }
        let padded = self.span(0)?.padded_len;
        for index in 0..self.world {
            let span = self.span(index)?;
            if span.len > 0 && span.offset != index * padded {
                return Ok(None);
            }
        }
        let slot = self.slot_numel()? * element;
        let fits = block_bytes >= slot
            && block_bytes
                .checked_mul(self.world)
                .is_some_and(|total| total <= len);
        if !fits {
            return Err(crate::error::FsdpError::BufferLength {
                op,
                expected: block_bytes.saturating_mul(self.world),
                actual: len,
            });
        }
        Ok(Some(slot))
    }

    /// Turns an all-gather output whose every rank block starts with this parameter's slot
    /// (`bytes`: `world` blocks of `block_bytes`) into the unsharded parameter in place: the
    /// slots of ranks 1.. are moved down to follow rank 0's, after which the parameter's
    /// `numel` elements are the buffer's prefix. Rank 0's piece, usually half or more of the
    /// parameter, is not copied at all. Returns `false`, leaving `bytes` alone, when the shard
    /// dim is not 0 or the shards are not a prefix of the padded slots (a short shard before
    /// a longer one, which `torch.chunk` never makes).
    ///
    /// Other members of the blocks are overwritten, so the caller copies them out first.
    pub fn compact_in_place(
        &self,
        bytes: &mut [u8],
        block_bytes: usize,
        element: usize,
    ) -> Result<bool> {
        let Some(slot) =
            self.prefix_slot_bytes(bytes.len(), block_bytes, element, "unshard compaction")?
        else {
            return Ok(false);
        };
        // Moving down in rank order never overwrites a slot not yet moved: slot `r` lands
        // in `[r·slot, (r+1)·slot)`, below block `r+1`'s start `(r+1)·block_bytes`.
        for index in 1..self.world {
            let from = index * block_bytes;
            bytes.copy_within(from..from + slot, index * slot);
        }
        Ok(true)
    }

    /// The inverse of [`compact_in_place`](Self::compact_in_place): `bytes` starts with the
    /// whole parameter (`world` blocks of `block_bytes` in all), and each rank's shard is moved
    /// up to the start of its block, its padding zeroed, so the buffer is this parameter's
    /// part of a reduce-scatter input. Rank 0's piece does not move. Returns `false`, leaving
    /// `bytes` alone, where compaction would have: the shard dim is not 0 or the shards are not
    /// a prefix of the padded slots.
    ///
    /// The rest of every block (other members' slots) is left as it was, for the caller to
    /// write.
    pub fn expand_in_place(
        &self,
        bytes: &mut [u8],
        block_bytes: usize,
        element: usize,
    ) -> Result<bool> {
        let Some(slot) = self.prefix_slot_bytes(
            bytes.len(),
            block_bytes,
            element,
            "reduce-scatter expansion",
        )?
        else {
            return Ok(false);
        };
        let row = self.others() * element;
        // Moving up in falling rank order never overwrites a shard not yet moved: shard `r`
        // sits in `[r·slot, r·slot + len)` and lands at `r·block_bytes`, at or above where it
        // was and above every lower rank's shard, which ends by `r·slot`.
        for index in (0..self.world).rev() {
            let len = self.span(index)?.len * row;
            let to = index * block_bytes;
            if index > 0 {
                bytes.copy_within(index * slot..index * slot + len, to);
            }
            bytes[to + len..to + slot].fill(0);
        }
        Ok(true)
    }

    /// Writes shard `index` from its padded slot (a flat tensor) into `target`, a tensor of
    /// the shard's shape on the slot's device: copied over it (`accumulate = false`, every
    /// element is written) or added into it, cast to `target`'s dtype either way.
    pub fn unpack_shard_into(
        &self,
        slot: &Tensor,
        index: usize,
        target: &Tensor,
        accumulate: bool,
    ) -> Result<()> {
        let shard = self.unpack(slot, index)?;
        if !accumulate {
            target.copy_from(&shard)?;
        } else if shard.dtype() == target.dtype() {
            target.add_(&shard)?;
        } else {
            target.add_(&shard.to_dtype(target.dtype())?)?;
        }
        Ok(())
    }

    /// Writes shard `index` from its padded slot into its place in the unsharded `full`
    /// (whose dtype is the slot's).
    pub fn unpack_into_full(&self, slot: &Tensor, index: usize, full: &Tensor) -> Result<()> {
        let span = self.span(index)?;
        if span.len == 0 {
            return Ok(());
        }
        full.narrow(self.dim, span.offset, span.len)?
            .copy_from(&self.unpack(slot, index)?)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    use hypershard_tensor::{DType, Device};

    /// Packs shard `r` of `full` into a fresh host slot and returns its bytes.
    fn packed(layout: &ShardLayout, full: &Tensor, r: usize) -> Result<Vec<u8>> {
        let slot = Tensor::full(&[layout.slot_numel()?], 7.0, full.dtype())?;
        layout.pack_from_full(full, r, &slot)?;
        Ok(slot.to_bytes()?)
    }

    proptest! {
        #[test]
        fn shards_tile_the_tensor(rows in 0usize..7, cols in 1usize..5, world in 1usize..5, dim in 0usize..2, emulated in any::<bool>()) {
            // One body on the host and on the emulated device: the copy-in and copy-out are
            // tensor ops on the slot's device.
            let device = if emulated { Device::Emulated { ordinal: 0 } } else { Device::Cpu };
            let layout = ShardLayout { shape: vec![rows, cols], dim, world };
            let n = rows * cols;
            let full_host = Tensor::from_vec((0..n).map(|v| v as f32).collect(), &[rows, cols]).unwrap();
            let full = full_host.to_device(&device).unwrap();
            let slot_numel = layout.slot_numel().unwrap();
            let rebuilt = Tensor::zeros_on(&[rows, cols], DType::F32, &device).unwrap();
            for r in 0..world {
                // A recycled slot full of stale values: packing overwrites all of it, cast on
                // the way in.
                let slot = Tensor::full(&[slot_numel], 7.0, DType::F64).unwrap().to_device(&device).unwrap();
                layout.pack_from_full(&full, r, &slot).unwrap();
                let fresh = Tensor::zeros_on(&[slot_numel], DType::F64, &device).unwrap();
                layout.pack_from_full(&full, r, &fresh).unwrap();
                prop_assert_eq!(slot.to_host().unwrap().to_bytes().unwrap(), fresh.to_host().unwrap().to_bytes().unwrap());
                let slot = slot.to_dtype(DType::F32).unwrap();
                let shard = layout.unpack(&slot, r).unwrap();
                prop_assert_eq!(shard.shape(), &layout.shard_shape(r).unwrap()[..]);
                prop_assert_eq!(shard.device(), device);
                layout.unpack_into_full(&slot, r, &rebuilt).unwrap();
                // Copying into a shard-shaped target, then adding: twice the shard, in f32
                // and into an f64 target (through a cast).
                let shard = shard.to_host().unwrap();
                for target_dtype in [DType::F32, DType::F64] {
                    let target = Tensor::full(&layout.shard_shape(r).unwrap(), 9.0, target_dtype).unwrap().to_device(&device).unwrap();
                    layout.unpack_shard_into(&slot, r, &target, false).unwrap();
                    prop_assert_eq!(target.to_host().unwrap().to_f64_vec().unwrap(), shard.to_f64_vec().unwrap());
                    layout.unpack_shard_into(&slot, r, &target, true).unwrap();
                    let doubled: Vec<f64> = shard.to_f64_vec().unwrap().iter().map(|v| 2.0 * v).collect();
                    prop_assert_eq!(target.to_host().unwrap().to_f64_vec().unwrap(), doubled);
                }
            }
            prop_assert_eq!(rebuilt.to_host().unwrap().to_vec::<f32>().unwrap(), full_host.to_vec::<f32>().unwrap());
        }
    }

    #[test]
    fn expansion_lays_the_parameter_out_as_rank_blocks() -> Result<()> {
        // Each rank's block must start with what packing that rank's shard gives (padding
        // zeroed); the rest of a block is another member's place, written by the caller.
        for (rows, world) in [(7usize, 4usize), (8, 2), (1, 3), (5, 4), (6, 1)] {
            let layout = ShardLayout {
                shape: vec![rows, 3],
                dim: 0,
                world,
            };
            let full =
                Tensor::from_vec((0..rows * 3).map(|v| v as f32 + 1.0).collect(), &[rows, 3])?;
            let slot = layout.slot_numel()? * 4;
            let block = slot + 20;
            let mut bytes = vec![0xEEu8; block * world];
            bytes[..rows * 12].copy_from_slice(&full.to_bytes()?);
            assert!(layout.expand_in_place(&mut bytes, block, 4)?);
            for r in 0..world {
                let expected = packed(&layout, &full, r)?;
                assert_eq!(
                    &bytes[r * block..r * block + slot],
                    &expected[..],
                    "{rows} rows, world {world}, rank {r}"
                );
            }
            // Compacting again gives the parameter back.
            assert!(layout.compact_in_place(&mut bytes, block, 4)?);
            assert_eq!(&bytes[..rows * 12], &full.to_bytes()?[..]);
        }
        let short = ShardLayout {
            shape: vec![4, 2],
            dim: 0,
            world: 2,
        };
        assert!(short.expand_in_place(&mut [0u8; 24], 12, 4).is_err());
        Ok(())
    }

    #[test]
    fn compaction_leaves_the_parameter_as_the_prefix() -> Result<()> {
        // 7 rows of 3 over 4 ranks (chunks of 2: 2, 2, 2, 1), each rank block holding the
        // slot followed by 5 bytes of another member.
        for (rows, world) in [(7usize, 4usize), (8, 2), (1, 3), (5, 4)] {
            let layout = ShardLayout {
                shape: vec![rows, 3],
                dim: 0,
                world,
            };
            let full = Tensor::from_vec((0..rows * 3).map(|v| v as f32).collect(), &[rows, 3])?;
            let slot = layout.slot_numel()? * 4;
            let block = slot + 20;
            let mut bytes = vec![0xEEu8; block * world];
            for r in 0..world {
                bytes[r * block..r * block + slot].copy_from_slice(&packed(&layout, &full, r)?);
            }
            assert!(layout.compact_in_place(&mut bytes, block, 4)?);
            let rebuilt = Tensor::from_bytes(&bytes[..rows * 3 * 4], &[rows, 3], DType::F32)?;
            assert_eq!(
                rebuilt.to_vec::<f32>()?,
                full.to_vec::<f32>()?,
                "{rows} rows, world {world}"
            );
        }
        // Dim-1 shards are not a prefix; a block shorter than the slot is an error.
        assert!(
            !ShardLayout {
                shape: vec![2, 4],
                dim: 1,
                world: 2
            }
            .expand_in_place(&mut [0u8; 64], 32, 4)?
        );
        let dim1 = ShardLayout {
            shape: vec![2, 4],
            dim: 1,
            world: 2,
        };
        assert!(!dim1.compact_in_place(&mut [0u8; 64], 32, 4)?);
        let dim0 = ShardLayout {
            shape: vec![4, 2],
            dim: 0,
            world: 2,
        };
        assert!(dim0.compact_in_place(&mut [0u8; 24], 12, 4).is_err());
        Ok(())
    }
}
