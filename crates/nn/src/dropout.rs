//! Dropout with a seeded, counter-based mask.

use hypershard_tensor::{RandomInit, Tensor};

use crate::elementwise::check_float;
use crate::kernels::{Float, load, store, with_float};
use crate::module::{ParamVisitor, ParamVisitorMut};
use crate::{Error, Module, Result};

/// Zeroes each element with probability `p` in training and scales the rest by `1/(1 − p)`;
/// the identity in evaluation or when `p = 0` (as torch's `nn.Dropout`).
///
/// The mask of the `n`-th training forward is drawn from the tensor crate's counter-based
/// generator with seed `seed + n`, so a run is reproducible but the masks differ per call.
/// With `p = 1` every element is zeroed, as in torch.
#[derive(Debug)]
pub struct Dropout {
    p: f64,
    seed: u64,
    calls: u64,
    /// Whether the layer drops elements (torch's `module.train()` / `module.eval()`).
    pub training: bool,
    mask: Option<MaskCache>,
}

/// What the backward needs of the last forward: its mask (`None` when it dropped nothing),
/// which regenerates each element's scale from its index, and the input's shape. Keeping the
/// mask's seed instead of the scales costs nothing per element.
#[derive(Debug)]
struct MaskCache {
    mask: Option<DropMask>,
    shape: Vec<usize>,
}

impl Dropout {
    /// A dropout layer in training mode; `p` must lie in `[0, 1]`.
    pub fn new(p: f64, seed: u64) -> Result<Self> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::InvalidConfig {
                op: "Dropout::new",
                field: "p",
                value: p,
                reason: "must lie in [0, 1]",
            });
        }
        Ok(Dropout {
            p,
            seed,
            calls: 0,
            training: true,
            mask: None,
        })
    }
}

/// The mask of one training forward: element `i` is kept, scaled by `1/(1 − p)`, unless the
/// counter-based uniform `(seed, i)` falls below `p`. Any element of the mask can be produced
/// on its own, so a fused kernel (attention) can regenerate a tile of it where it needs it
/// instead of materialising the whole mask.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct DropMask {
    init: RandomInit,
    p: f64,
    keep_scale: f64,
}

impl DropMask {
    /// The seed, the drop probability and the keep scale: what a device kernel needs to draw
    /// the same mask.
    #[cfg(feature = "cuda")]
    pub(crate) fn parameters(&self) -> (u64, f64, f64) {
        (self.init.seed, self.p, self.keep_scale)
    }

    /// The factor of element `index` (row-major over the tensor the mask covers): 0 or
    /// `1/(1 − p)` (0 for every element when `p = 1`).
    #[inline]
    pub(crate) fn scale_at(&self, index: u64) -> f64 {
        if self.init.value_at(index) < self.p {
            0.0
        } else {
            self.keep_scale
        }
    }
}

impl Dropout {
    /// The mask of the next training forward, advancing the call counter exactly as
    /// [`Module::forward`] does; `None` (and no advance) in evaluation or when `p = 0`.
    ///
    /// Attention uses this to apply its weights' dropout inside its fused kernel, with the
    /// masks this layer's own `forward` would have drawn.
    pub(crate) fn draw_mask(&mut self) -> Option<DropMask> {
        if !self.training || self.p == 0.0 {
            return None;
        }
        let init = RandomInit::uniform(self.seed.wrapping_add(self.calls), 0.0, 1.0);
        self.calls += 1;
        let keep_scale = if self.p < 1.0 {
            1.0 / (1.0 - self.p)
        } else {
            0.0
        };
        Some(DropMask {
            init,
            p: self.p,
            keep_scale,
        })
    }
}

/// `x[i] · scale_at(i)` in the compute type of `x`'s dtype (the scale rounded to it): the
/// forward on the input, the backward on the output's gradient. On a CUDA device the
/// `dropout_f32` kernel computes the same, element by element.
fn apply_mask(op: &'static str, x: &Tensor, mask: &DropMask) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let (seed, p, keep) = mask.parameters();
        return crate::kernels::cuda::dropout(&x.contiguous()?, seed, p, keep);
    }
    with_float!(op, x.dtype(), F => {
        let xs = load::<F>(x)?;
        let out: Vec<F> = xs
            .iter()
            .enumerate()
            .map(|(i, &v)| v * F::of(mask.scale_at(i as u64)))
            .collect();
        store(out, x.shape(), x.dtype(), &x.device())
    })
}

impl Module for Dropout {
    fn kind(&self) -> &'static str {
        "Dropout"
    }

    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        check_float("Dropout::forward", input.dtype())?;
        let mask = self.draw_mask();
        self.mask = Some(MaskCache {
            mask,
            shape: input.shape().to_vec(),
        });
        match mask {
            None => Ok(input.clone()),
            Some(mask) => apply_mask("Dropout::forward", input, &mask),
        }
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let mask = self
            .mask
            .take()
            .ok_or(Error::BackwardBeforeForward { module: "Dropout" })?;
        if grad_output.shape() != mask.shape.as_slice() {
            return Err(Error::ShapeMismatch {
                op: "Dropout::backward",
                lhs: mask.shape,
                rhs: grad_output.shape().to_vec(),
            });
        }
        match mask.mask {
            None => Ok(grad_output.clone()),
            Some(drop) => apply_mask("Dropout::backward", grad_output, &drop),
        }
    }

    fn clear_cache(&mut self) -> Result<()> {
        self.mask = None;
        Ok(())
    }

    fn visit_rng_counters_mut(&mut self, f: &mut dyn FnMut(&mut u64)) -> Result<()> {
        f(&mut self.calls);
        Ok(())
    }

    fn set_training(&mut self, training: bool) -> Result<()> {
        self.training = training;
        Ok(())
    }

    fn visit_params(&self, _prefix: &str, _f: &mut ParamVisitor<'_>) -> Result<()> {
        Ok(())
    }

    fn visit_params_mut(&mut self, _prefix: &str, _f: &mut ParamVisitorMut<'_>) -> Result<()> {
        Ok(())
    }

    /// Attention finds its weights' dropout through this, to draw the mask inside its fused
    /// kernel (see `Dropout::draw_mask`).
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use hypershard_tensor::DType;

    use super::*;

    #[test]
    fn p_zero_and_eval_are_the_identity() {
        let x = Tensor::arange(6, DType::F64).expect("arange");
        let mut off = Dropout::new(0.0, 1).expect("dropout");
        assert_eq!(
            off.forward(&x)
                .expect("forward")
                .to_vec::<f64>()
                .expect("f64"),
            x.to_vec::<f64>().expect("f64")
        );
        let mut eval = Dropout::new(0.5, 1).expect("dropout");
        eval.training = false;
        assert_eq!(
            eval.forward(&x)
                .expect("forward")
                .to_vec::<f64>()
                .expect("f64"),
            x.to_vec::<f64>().expect("f64")
        );
        assert_eq!(
            eval.backward(&x)
                .expect("backward")
                .to_vec::<f64>()
                .expect("f64"),
            x.to_vec::<f64>().expect("f64")
        );
    }

    #[test]
    fn drops_about_p_scales_the_rest_and_reuses_the_mask_in_backward() {
        let x = Tensor::ones(&[4000], DType::F32).expect("ones");
        let mut dropout = Dropout::new(0.25, 7).expect("dropout");
        let y = dropout
            .forward(&x)
            .expect("forward")
            .to_vec::<f32>()
            .expect("f32");
        let dropped = y.iter().filter(|v| **v == 0.0).count();
        assert!(y.iter().all(|v| *v == 0.0 || (*v - 4.0 / 3.0).abs() < 1e-6));
        // 1000 expected; ±120 is about 4.4 standard deviations (σ ≈ 27.4) either side.
        assert!((880..1120).contains(&dropped), "dropped {dropped}");
        let g = dropout
            .backward(&x)
            .expect("backward")
            .to_vec::<f32>()
            .expect("f32");
        assert_eq!(g, y, "backward applies the forward's mask");
        let again = dropout
            .forward(&x)
            .expect("forward")
            .to_vec::<f32>()
            .expect("f32");
        assert_ne!(again, y, "each call draws a new mask");
        let mut same_seed = Dropout::new(0.25, 7).expect("dropout");
        assert_eq!(
            same_seed
                .forward(&x)
                .expect("forward")
                .to_vec::<f32>()
                .expect("f32"),
            y
        );
    }

    #[test]
    fn p_one_zeroes_and_bad_p_is_rejected() {
        let x = Tensor::ones(&[5], DType::F64).expect("ones");
        let mut all = Dropout::new(1.0, 0).expect("dropout");
        assert_eq!(
            all.forward(&x)
                .expect("forward")
                .to_vec::<f64>()
                .expect("f64"),
            vec![0.0; 5]
        );
        assert!(matches!(
            Dropout::new(1.5, 0),
            Err(Error::InvalidConfig { field: "p", .. })
        ));
        assert!(matches!(
            Dropout::new(f64::NAN, 0),
            Err(Error::InvalidConfig { .. })
        ));
    }
}
