//! Activation checkpointing: a wrapper that keeps only its input through forward and runs the
//! wrapped module's forward again in backward.

use hypershard_tensor::Tensor;

use crate::module::{ChildVisitorMut, ParamVisitor, ParamVisitorMut};
use crate::{Error, Module, Result};

/// Activation checkpointing around any module (torch's `checkpoint_wrapper`, non-reentrant in
/// effect): `forward` runs the wrapped forward, keeps only the input and drops every
/// activation the wrapped module cached ([`Module::clear_cache`]); `backward` runs the wrapped
/// forward again from that input, then the wrapped backward.
///
/// The recomputation is exact: it draws the same dropout masks, because the random-stream
/// counters ([`Module::visit_rng_counters_mut`]) are rewound to where they stood before the
/// first forward and, after the recomputation, put back where they were, so a later forward
/// draws what it would have drawn without checkpointing. Losses and gradients are therefore
/// bitwise those of the unwrapped module.
///
/// The wrapper is transparent: parameter names, children, training mode and the `Any` seen by
/// [`Module::as_any_mut`] are the wrapped module's, so state dicts are identical with and
/// without it and `fully_shard` finds a unit inside it. It costs one more forward of the
/// wrapped module per backward and saves everything that forward caches except the input,
/// which the caller holds anyway (it is the previous block's output).
///
/// Under `fully_shard`, wrap the block first and shard the wrapper
/// (`fully_shard(Box::new(Checkpointed::new(block)))`); wrapping a unit
/// (`Checkpointed::new(Box::new(unit))`) works too and communicates the same. Checkpoint the
/// blocks, not the root unit.
pub struct Checkpointed {
    inner: Box<dyn Module>,
    saved: Option<Saved>,
}

/// What the forward keeps: its input and the random-stream counters before it ran.
struct Saved {
    input: Tensor,
    rng_before: Vec<u64>,
}

impl std::fmt::Debug for Checkpointed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpointed")
            .field("inner", &self.inner.kind())
            .field("saved", &self.saved.is_some())
            .finish()
    }
}

impl Checkpointed {
    /// Wraps `inner`.
    pub fn new(inner: Box<dyn Module>) -> Self {
        Checkpointed { inner, saved: None }
    }

    /// The wrapped module.
    pub fn inner(&self) -> &dyn Module {
        self.inner.as_ref()
    }

    /// The wrapped module, mutably.
    pub fn inner_mut(&mut self) -> &mut dyn Module {
        self.inner.as_mut()
    }

    /// Unwraps, dropping a saved input.
    pub fn into_inner(self) -> Box<dyn Module> {
        self.inner
    }

    fn rng_counters(&mut self) -> Result<Vec<u64>> {
        let mut counters = Vec::new();
        self.inner
            .visit_rng_counters_mut(&mut |c| counters.push(*c))?;
        Ok(counters)
    }

    /// Sets the counters to `values`, which must be as many as the module has.
    fn set_rng_counters(&mut self, values: &[u64]) -> Result<()> {
        let mut next = values.iter();
        let mut visited = 0usize;
        self.inner.visit_rng_counters_mut(&mut |c| {
            visited += 1;
            if let Some(&v) = next.next() {
                *c = v;
            }
        })?;
        if visited != values.len() {
            // A module gained or lost a random stream between forward and backward (a child
            // replaced in between): the recomputation could not draw the same masks.
            return Err(Error::RecomputeMismatch {
                module: self.inner.kind(),
                expected: values.len(),
                actual: visited,
            });
        }
        Ok(())
    }
}

impl Module for Checkpointed {
    fn kind(&self) -> &'static str {
        "Checkpointed"
    }

    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        let rng_before = self.rng_counters()?;
        // An earlier forward without backward (evaluation) leaves nothing to keep.
        self.saved = None;
        let output = self.inner.forward(input)?;
        self.inner.clear_cache()?;
        self.saved = Some(Saved {
            input: input.clone(),
            rng_before,
        });
        Ok(output)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let saved = self.saved.take().ok_or(Error::BackwardBeforeForward {
            module: "Checkpointed",
        })?;
        let rng_after = self.rng_counters()?;
        self.set_rng_counters(&saved.rng_before)?;
        // Only the caches matter; the output equals the first forward's and is dropped.
        let recomputed = self.inner.forward(&saved.input);
        self.set_rng_counters(&rng_after)?;
        drop(recomputed?);
        self.inner.backward(grad_output)
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        self.inner.visit_params(prefix, f)
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        self.inner.visit_params_mut(prefix, f)
    }

    fn visit_children_mut(&mut self, f: &mut ChildVisitorMut<'_>) -> Result<()> {
        self.inner.visit_children_mut(f)
    }

    fn set_training(&mut self, training: bool) -> Result<()> {
        self.inner.set_training(training)
    }

    fn clear_cache(&mut self) -> Result<()> {
        self.saved = None;
        self.inner.clear_cache()
    }

    fn visit_rng_counters_mut(&mut self, f: &mut dyn FnMut(&mut u64)) -> Result<()> {
        self.inner.visit_rng_counters_mut(f)
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        self.inner.as_any_mut()
    }
}

#[cfg(test)]
mod tests {
    use hypershard_tensor::DType;

    use super::*;
    use crate::{Dropout, Linear, LinearConfig, Relu, Sequential};

    fn model() -> Sequential {
        let linear = |i, o, seed| {
            Linear::new(LinearConfig {
                in_features: i,
                out_features: o,
                bias: true,
                dtype: DType::F64,
                seed,
            })
            .expect("invariant: valid sizes")
        };
        Sequential::default()
            .with(linear(3, 5, 1))
            .with(Relu::new())
            .with(Dropout::new(0.5, 9).expect("invariant: valid p"))
            .with(linear(5, 2, 3))
    }

    #[test]
    fn backward_without_forward_is_an_error_and_forward_keeps_no_inner_cache() {
        let mut wrapped = Checkpointed::new(Box::new(model()));
        let g = Tensor::ones(&[4, 2], DType::F64).expect("ones");
        assert!(matches!(
            wrapped.backward(&g),
            Err(Error::BackwardBeforeForward {
                module: "Checkpointed"
            })
        ));
        let x = Tensor::ones(&[4, 3], DType::F64).expect("ones");
        wrapped.forward(&x).expect("forward");
        // The inner caches are gone: the wrapped module alone cannot run backward.
        assert!(matches!(
            wrapped.inner_mut().backward(&g),
            Err(Error::BackwardBeforeForward { .. })
        ));
    }

    #[test]
    fn recomputation_leaves_the_dropout_stream_where_a_plain_run_leaves_it() {
        let x = Tensor::ones(&[4, 3], DType::F64).expect("ones");
        let g = Tensor::ones(&[4, 2], DType::F64).expect("ones");
        let mut plain = model();
        let mut wrapped = Checkpointed::new(Box::new(model()));
        for _ in 0..3 {
            let a = plain.forward(&x).expect("forward");
            let b = wrapped.forward(&x).expect("forward");
            assert_eq!(
                a.to_vec::<f64>().expect("f64"),
                b.to_vec::<f64>().expect("f64")
            );
            let ga = plain.backward(&g).expect("backward");
            let gb = wrapped.backward(&g).expect("backward");
            assert_eq!(
                ga.to_vec::<f64>().expect("f64"),
                gb.to_vec::<f64>().expect("f64")
            );
        }
        let mut counters = Vec::new();
        wrapped
            .visit_rng_counters_mut(&mut |c| counters.push(*c))
            .expect("visit");
        assert_eq!(
            counters,
            [3],
            "one mask per forward, none for the recomputation"
        );
    }
}
