//! Buckets: which parameters share one collective and where each sits in its slot. Their
//! communication buffers come from the mesh's pool
//! ([`hypershard_dtensor::BufferPool`], shared with redistribute); a recycled buffer holds
//! stale bytes, so every bucket is written whole through a [`SlotWriter`].

use hypershard_tensor::{DType, Tensor};

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

/// Writes the regions of a (possibly recycled) flat bucket in increasing order and zeroes
/// every element between and after them, so no stale byte of an earlier use reaches a
/// collective: gaps left by slot alignment and the slots of parameters without a gradient
/// become zeros, as in a freshly zeroed buffer. Offsets and lengths count elements; the
/// writes are tensor ops on the bucket's device.
pub(crate) struct SlotWriter<'a> {
    flat: &'a Tensor,
    cursor: usize,
}

impl<'a> SlotWriter<'a> {
    /// A writer over the whole (1-d) bucket.
    pub fn new(flat: &'a Tensor) -> Self {
        SlotWriter { flat, cursor: 0 }
    }

    /// The `len` elements at `start` (which must not precede the end of the previous region),
    /// after zeroing the gap before them.
    pub fn region(&mut self, start: usize, len: usize, op: &'static str) -> Result<Tensor> {
        let total = self.flat.numel();
        let end = start.checked_add(len).filter(|&e| e <= total);
        let Some(end) = end.filter(|_| start >= self.cursor) else {
            return Err(FsdpError::BufferLength {
                op,
                expected: total,
                actual: start.saturating_add(len),
            });
        };
        if start > self.cursor {
            self.flat
                .narrow(0, self.cursor, start - self.cursor)?
                .zero_()?;
        }
        self.cursor = end;
        Ok(self.flat.narrow(0, start, len)?)
    }

    /// Zeroes everything after the last region.
    pub fn finish(self) -> Result<()> {
        let total = self.flat.numel();
        if total > self.cursor {
            self.flat
                .narrow(0, self.cursor, total - self.cursor)?
                .zero_()?;
        }
        Ok(())
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
    fn slot_writer_zeroes_gaps_and_tail() -> Result<()> {
        use hypershard_tensor::Device;
        for device in [Device::Cpu, Device::Emulated { ordinal: 0 }] {
            let flat = Tensor::full(&[10], 7.0, DType::U8)?.to_device(&device)?;
            let mut writer = SlotWriter::new(&flat);
            writer.region(2, 3, "test")?.fill_(1.0)?;
            writer.region(6, 1, "test")?.fill_(2.0)?;
            // Regions must come in increasing order and stay inside the buffer.
            assert!(writer.region(5, 2, "test").is_err());
            assert!(writer.region(8, 3, "test").is_err());
            writer.finish()?;
            assert_eq!(
                flat.to_host()?.to_vec::<u8>()?,
                vec![0, 0, 1, 1, 1, 0, 2, 0, 0, 0]
            );
        }
        Ok(())
    }
}
