//! Deferred (shape-only) tensors: PyTorch's meta device, done as a storage kind.
//!
//! A model too big for one rank cannot be built on one rank and sharded afterwards. Inside
//! [`deferred_init`], the factory functions [`Tensor::zeros`], [`Tensor::ones`],
//! [`Tensor::full`] and [`Tensor::random`] allocate nothing: they return a tensor whose
//! storage is [`Storage::Deferred`](crate::Storage::Deferred), which carries the byte length and
//! the recipe ([`Fill`]) the factory would have used. Shapes, dtypes, views and parameter
//! counts work as usual; any kernel that reads or writes the data is
//! [`Error::Deferred`] naming the kernel.
//!
//! The recipe makes sharded materialisation exact: [`Tensor::materialize_block`] builds any
//! block of the tensor alone, and because the random generator is counter-based (see
//! [`random`](crate::random)) the block equals, bit for bit, the same block of the tensor the
//! factory would have built eagerly. FSDP uses this to give each rank only its shard.
//!
//! ```
//! use hypershard_tensor::{DType, RandomInit, Tensor, deferred_init};
//! let init = RandomInit::normal(7, 0.0, 0.02);
//! let meta = deferred_init(|| Tensor::random(&[6, 4], DType::F32, init))?;
//! assert!(meta.is_deferred());
//! assert!(meta.to_vec::<f32>().is_err()); // no data to read
//! let rows = meta.materialize_block(&[2, 0], &[3, 4])?;
//! let eager = Tensor::random(&[6, 4], DType::F32, init)?;
//! assert_eq!(rows.to_vec::<f32>()?, eager.narrow(0, 2, 3)?.to_vec::<f32>()?);
//! # Ok::<(), hypershard_tensor::Error>(())
//! ```

use std::cell::Cell;

use crate::random::{Block, RandomInit};
use crate::{DType, Error, Result, Tensor};

/// How a deferred tensor's elements would have been filled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fill {
    /// Every element the same value (`zeros`, `ones`, `full`), converted to the dtype.
    Constant(f64),
    /// The counter-based random tensor of this init (`random`).
    Random(RandomInit),
}

/// The storage of a deferred tensor: the bytes it would take and, when known, its recipe.
#[derive(Debug, Clone)]
pub struct DeferredStorage {
    len: usize,
    fill: Option<Fill>,
}

impl DeferredStorage {
    /// The length in bytes the data would take.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the data would take no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The recipe, when the tensor came from a factory function.
    pub fn fill(&self) -> Option<Fill> {
        self.fill
    }
}

thread_local! {
    /// How many [`deferred_init`] scopes are open on this thread.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Closes one scope when dropped, so a panic inside `f` does not leave the thread deferred.
struct ScopeGuard;

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        DEPTH.with(|depth| depth.set(depth.get().saturating_sub(1)));
    }
}

/// Runs `f` with deferred factories on this thread: every [`Tensor::zeros`], `ones`, `full`
/// and `random` made inside returns a shape-only tensor (see the [module](self) docs).
/// Scopes nest; other threads are unaffected, so ranks that run as threads each build their
/// own deferred model.
pub fn deferred_init<R>(f: impl FnOnce() -> R) -> R {
    DEPTH.with(|depth| depth.set(depth.get() + 1));
    let _guard = ScopeGuard;
    f()
}

/// Whether a [`deferred_init`] scope is open on this thread.
pub fn in_deferred_init() -> bool {
    DEPTH.with(|depth| depth.get() > 0)
}

impl Tensor {
    /// A shape-only tensor of `shape` and `dtype` with no recipe: it can be sharded and
    /// counted but only materialised through an explicit init (FSDP's per-parameter hook).
    pub fn deferred(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::deferred_with("deferred", shape, dtype, None)
    }

    /// A shape-only tensor that remembers `fill`.
    pub(crate) fn deferred_with(
        op: &'static str,
        shape: &[usize],
        dtype: DType,
        fill: Option<Fill>,
    ) -> Result<Tensor> {
        let numel = crate::layout::checked_numel(op, shape)?;
        let len = numel
            .checked_mul(dtype.size_of())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| Error::SizeOverflow {
                op,
                shape: shape.to_vec(),
            })?;
        Ok(Tensor::from_storage(
            crate::Storage::Deferred(DeferredStorage { len, fill }),
            dtype,
            shape.to_vec(),
        ))
    }

    /// Whether the tensor is deferred (shape and dtype only, no data).
    pub fn is_deferred(&self) -> bool {
        self.storage().read().is_deferred()
    }

    /// The recipe of a deferred tensor made by a factory function inside [`deferred_init`];
    /// `None` for a materialised tensor or a deferred one without a recipe.
    pub fn deferred_fill(&self) -> Option<Fill> {
        match &*self.storage().read() {
            crate::Storage::Deferred(deferred) => deferred.fill,
            _ => None,
        }
    }

    /// Builds the block of a deferred tensor at `offset` with shape `shape`, alone: equal bit
    /// for bit to the same block of the tensor its factory would have built eagerly.
    ///
    /// Only the whole deferred tensor (not a view of it) with a recipe can be materialised;
    /// anything else is [`Error::NotMaterializable`] saying why.
    pub fn materialize_block(&self, offset: &[usize], shape: &[usize]) -> Result<Tensor> {
        const OP: &str = "materialize_block";
        let fill = match &*self.storage().read() {
            crate::Storage::Deferred(deferred) => deferred.fill,
            _ => {
                return Err(Error::NotMaterializable {
                    op: OP,
                    reason: "the tensor already has data",
                });
            }
        };
        let whole = self.offset() == 0
            && self.is_contiguous()
            && self.storage().read().len() == self.nbytes();
        if !whole {
            return Err(Error::NotMaterializable {
                op: OP,
                reason: "a view of a deferred tensor has no recipe of its own",
            });
        }
        let Some(fill) = fill else {
            return Err(Error::NotMaterializable {
                op: OP,
                reason: "the tensor was made deferred without a recipe; give it an init",
            });
        };
        let block = Block {
            global_shape: self.shape(),
            offset,
            shape,
        };
        check_block(OP, block)?;
        match fill {
            // Outside any deferred scope, so these allocate.
            Fill::Constant(value) => Tensor::eager_full(shape, value, self.dtype()),
            Fill::Random(init) => Tensor::random_block(block, self.dtype(), init),
        }
    }

    /// The whole tensor of a deferred recipe, materialised.
    pub fn materialize(&self) -> Result<Tensor> {
        let zeros = vec![0; self.ndim()];
        self.materialize_block(&zeros, self.shape())
    }
}

/// Errors unless `block` lies inside its global shape.
fn check_block(op: &'static str, block: Block<'_>) -> Result<()> {
    let fits = block.offset.len() == block.global_shape.len()
        && block.shape.len() == block.global_shape.len()
        && block
            .offset
            .iter()
            .zip(block.shape)
            .zip(block.global_shape)
            .all(|((&o, &s), &g)| o.checked_add(s).is_some_and(|end| end <= g));
    if fits {
        Ok(())
    } else {
        Err(Error::BlockOutOfBounds {
            op,
            global_shape: block.global_shape.to_vec(),
            offset: block.offset.to_vec(),
            block_shape: block.shape.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryTracker;

    #[test]
    fn factories_inside_the_scope_allocate_nothing() {
        let tracker = MemoryTracker::new();
        let _scope = tracker.enter();
        let (z, o, r) = deferred_init(|| {
            (
                Tensor::zeros(&[1000, 1000], DType::F32).expect("zeros"),
                Tensor::ones(&[3, 5], DType::BF16).expect("ones"),
                Tensor::random(&[7, 9], DType::F32, RandomInit::normal(1, 0.0, 1.0))
                    .expect("random"),
            )
        });
        assert_eq!(tracker.peak_bytes(), 0);
        assert!(z.is_deferred() && o.is_deferred() && r.is_deferred());
        assert_eq!(z.nbytes(), 4_000_000);
        assert_eq!(o.deferred_fill(), Some(Fill::Constant(1.0)));
        assert!(!in_deferred_init());
        // Outside the scope the factories allocate again.
        let eager = Tensor::zeros(&[4], DType::F32).expect("zeros");
        assert!(!eager.is_deferred());
    }

    #[test]
    fn every_data_access_is_a_typed_error_naming_the_op() {
        let t = deferred_init(|| Tensor::ones(&[4], DType::F32)).expect("ones");
        let op_of = |r: Result<()>| match r {
            Err(Error::Deferred { op }) => op,
            other => panic!("expected Error::Deferred, got {other:?}"),
        };
        assert_eq!(op_of(t.to_vec::<f32>().map(drop)), "to_vec");
        assert_eq!(op_of(t.fill_(2.0)), "fill_");
        assert_eq!(op_of(t.add(&t).map(drop)), "add");
        assert_eq!(op_of(t.with_data(|_: &[f32]| ())), "with_data");
        assert_eq!(op_of(t.sum(0, false).map(drop)), "sum");
        let message = t.to_bytes().expect_err("deferred").to_string();
        assert!(message.contains("to_bytes") && message.contains("deferred"));
        // Views keep shapes working.
        assert_eq!(t.narrow(0, 1, 2).expect("view").shape(), &[2]);
    }

    #[test]
    fn blocks_equal_the_eager_tensor_bitwise() {
        let init = RandomInit::normal(11, 0.0, 0.02);
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            let meta = deferred_init(|| Tensor::random(&[7, 5], dtype, init)).expect("random");
            let eager = Tensor::random(&[7, 5], dtype, init).expect("random");
            for (start, len) in [(0, 7), (0, 3), (3, 3), (6, 1), (7, 0)] {
                let block = meta
                    .materialize_block(&[start, 0], &[len, 5])
                    .expect("block");
                let expected = eager.narrow(0, start, len).expect("narrow");
                assert_eq!(
                    block.to_bytes().expect("bytes"),
                    expected.to_bytes().expect("bytes"),
                    "{dtype} rows {start}+{len}"
                );
            }
        }
        let ones = deferred_init(|| Tensor::full(&[5], 3.5, DType::F32)).expect("full");
        let part = ones.materialize_block(&[1], &[3]).expect("block");
        assert_eq!(part.to_vec::<f32>().expect("f32"), vec![3.5; 3]);
    }

    #[test]
    fn refusals_say_why() {
        let meta = deferred_init(|| Tensor::zeros(&[4, 4], DType::F32)).expect("zeros");
        let out_of_range = meta.materialize_block(&[3, 0], &[2, 4]);
        assert!(matches!(out_of_range, Err(Error::BlockOutOfBounds { .. })));
        let view = meta.narrow(0, 1, 2).expect("view");
        assert!(matches!(
            view.materialize(),
            Err(Error::NotMaterializable { .. })
        ));
        let bare = Tensor::deferred(&[2], DType::F32).expect("deferred");
        assert!(matches!(
            bare.materialize(),
            Err(Error::NotMaterializable { .. })
        ));
        let eager = Tensor::zeros(&[2], DType::F32).expect("zeros");
        assert!(matches!(
            eager.materialize(),
            Err(Error::NotMaterializable { .. })
        ));
    }
}
