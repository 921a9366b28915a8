//! Losses that return their value and the gradient of their input together.

use hypershard_tensor::{DType, Tensor};

use crate::elementwise::{check_float, from_f64};
use crate::kernels::{Float, load, load_f64, read_all, same_device, store, with_float};
use crate::{Error, Result};

/// A loss value and the gradient of the loss with respect to the prediction (or logits).
#[derive(Debug, Clone)]
pub struct LossOutput {
    /// The loss, computed in f64.
    pub loss: f64,
    /// `∂loss/∂input`, in the input's shape and dtype.
    pub grad: Tensor,
}

/// torch's default `ignore_index` for `cross_entropy`.
pub const DEFAULT_IGNORE_INDEX: i64 = -100;

/// Mean squared error `mean((prediction − target)²)`, as torch's `mse_loss(reduction="mean")`.
pub fn mse_loss(prediction: &Tensor, target: &Tensor) -> Result<LossOutput> {
    const OP: &str = "mse_loss";
    check_float(OP, prediction.dtype())?;
    if prediction.shape() != target.shape() {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: prediction.shape().to_vec(),
            rhs: target.shape().to_vec(),
        });
    }
    if prediction.dtype() != target.dtype() {
        return Err(Error::DTypeMismatch {
            op: OP,
            lhs: prediction.dtype(),
            rhs: target.dtype(),
        });
    }
    let device = same_device(OP, &[prediction, target])?;
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let (loss, grad) = crate::kernels::cuda::mse_loss(prediction, target)?;
        return Ok(LossOutput { loss, grad });
    }
    let p = load_f64(prediction)?;
    let t = load_f64(target)?;
    // torch gives NaN for an empty input (a mean over nothing); so does 0/0 here.
    let n = p.len() as f64;
    let loss = p
        .iter()
        .zip(&t)
        .map(|(p, t)| (p - t) * (p - t))
        .sum::<f64>()
        / n;
    let grad = p.iter().zip(&t).map(|(p, t)| 2.0 * (p - t) / n).collect();
    Ok(LossOutput {
        loss,
        grad: from_f64(grad, prediction.shape(), prediction.dtype(), &device)?,
    })
}

/// Cross-entropy of `logits` `[*, C]` against class indices `targets` (I64, `[*]`), averaged
/// over the targets that are not `ignore_index` (torch's `cross_entropy(reduction="mean")`).
///
/// Pass [`DEFAULT_IGNORE_INDEX`] for torch's default. When every target is ignored the loss is
/// NaN (0/0, as in torch) and the gradient is zero. The log-softmax is computed in f64 with the
/// row maximum subtracted first.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, ignore_index: i64) -> Result<LossOutput> {
    const OP: &str = "cross_entropy";
    check_float(OP, logits.dtype())?;
    let Some((&classes, leading)) = logits.shape().split_last() else {
        return Err(Error::BadShape {
            op: OP,
            expected: "logits [*, C]".to_string(),
            actual: logits.shape().to_vec(),
        });
    };
    if leading != targets.shape() {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: logits.shape().to_vec(),
            rhs: targets.shape().to_vec(),
        });
    }
    let device = same_device(OP, &[logits, targets])?;
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let (loss, grad) = crate::kernels::cuda::cross_entropy(OP, logits, targets, ignore_index)?;
        return Ok(LossOutput { loss, grad });
    }
    let TargetClasses {
        classes_of,
        counted,
    } = TargetClasses::new(OP, targets, classes, ignore_index)?;
    // torch gives NaN when every target is ignored (0/0); the gradient is then zero.
    let scale = if counted > 0 {
        1.0 / counted as f64
    } else {
        0.0
    };
    with_float!(OP, logits.dtype(), F => {
        // The loaded copy of the logits becomes the gradient in place.
        let mut grad = load::<F>(logits)?;
        let mut total = 0.0;
        cross_entropy_rows_in_place(&mut grad, &classes_of, classes, F::of(scale), &mut total);
        Ok(LossOutput {
            loss: total / counted as f64,
            grad: store(grad, logits.shape(), logits.dtype(), &device)?,
        })
    })
}

/// The class of every target position (`None` where it is `ignore_index`) and how many count.
pub(crate) struct TargetClasses {
    pub(crate) classes_of: Vec<Option<usize>>,
    pub(crate) counted: usize,
}

impl TargetClasses {
    /// Reads I64 `targets`, checking each against `classes` (`TargetOutOfRange` names the
    /// position).
    pub(crate) fn new(
        op: &'static str,
        targets: &Tensor,
        classes: usize,
        ignore_index: i64,
    ) -> Result<Self> {
        if targets.dtype() != DType::I64 {
            return Err(Error::DTypeMismatch {
                op,
                lhs: DType::I64,
                rhs: targets.dtype(),
            });
        }
        let labels = read_all::<i64>(op, targets)?;
        let mut counted = 0usize;
        let mut classes_of = Vec::with_capacity(labels.len());
        for (position, &label) in labels.iter().enumerate() {
            if label == ignore_index {
                classes_of.push(None);
                continue;
            }
            let class = usize::try_from(label).ok().filter(|&c| c < classes).ok_or(
                Error::TargetOutOfRange {
                    op,
                    position,
                    target: label,
                    classes,
                },
            )?;
            counted += 1;
            classes_of.push(Some(class));
        }
        Ok(TargetClasses {
            classes_of,
            counted,
        })
    }
}

/// Turns each row of logits `x` into `scale · (softmax − onehot)` in place (zero for ignored
/// rows) and adds each row's loss, in order, to `total` (f64), so a caller working through the
/// logits in chunks never holds a second buffer of their size and sums the rows in the same
/// order as one call over all of them.
///
/// Each row is one fused pass for the maximum, one for `Σ exp(x − max)` (vectorised for f32),
/// one for the gradient.
pub(crate) fn cross_entropy_rows_in_place<F: Float>(
    x: &mut [F],
    classes_of: &[Option<usize>],
    classes: usize,
    scale: F,
    total: &mut f64,
) {
    if classes == 0 {
        return;
    }
    for (row, class) in x.chunks_exact_mut(classes).zip(classes_of) {
        let Some(class) = *class else {
            row.fill(F::ZERO);
            continue;
        };
        let max = row.iter().copied().fold(row[0], F::max);
        let target_logit = row[class].as_f64();
        let mut sum = F::ZERO;
        for v in row.iter_mut() {
            let e = (*v - max).exp();
            *v = e;
            sum += e;
        }
        let log_sum = sum.as_f64().ln() + max.as_f64();
        *total += log_sum - target_logit;
        let factor = scale / sum;
        for g in row.iter_mut() {
            *g *= factor;
        }
        row[class] -= scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mse_closed_form() {
        let p = Tensor::from_vec(vec![1.0f64, 2.0, 4.0], &[3]).expect("tensor");
        let t = Tensor::from_vec(vec![0.0f64, 2.0, 1.0], &[3]).expect("tensor");
        let out = mse_loss(&p, &t).expect("loss");
        assert!((out.loss - 10.0 / 3.0).abs() < 1e-15);
        let g = out.grad.to_vec::<f64>().expect("f64");
        assert_eq!(g, vec![2.0 / 3.0, 0.0, 2.0]);
    }

    #[test]
    fn cross_entropy_closed_form_and_ignore_index() {
        // Uniform logits over 4 classes: the loss is ln 4 per counted row.
        let logits = Tensor::zeros(&[3, 4], DType::F64).expect("zeros");
        let targets = Tensor::from_vec(vec![1i64, -100, 3], &[3]).expect("targets");
        let out = cross_entropy(&logits, &targets, DEFAULT_IGNORE_INDEX).expect("loss");
        assert!((out.loss - 4f64.ln()).abs() < 1e-15);
        let g = out.grad.to_vec::<f64>().expect("f64");
        // Counted rows: (softmax − onehot) / 2; the ignored row is zero.
        assert_eq!(&g[0..4], &[0.125, -0.375, 0.125, 0.125]);
        assert_eq!(&g[4..8], &[0.0; 4]);
        assert_eq!(&g[8..12], &[0.125, 0.125, 0.125, -0.375]);
    }

    #[test]
    fn cross_entropy_errors_and_all_ignored() {
        let logits = Tensor::zeros(&[2, 3], DType::F32).expect("zeros");
        let bad = Tensor::from_vec(vec![0i64, 3], &[2]).expect("targets");
        assert!(matches!(
            cross_entropy(&logits, &bad, DEFAULT_IGNORE_INDEX),
            Err(Error::TargetOutOfRange {
                position: 1,
                target: 3,
                classes: 3,
                ..
            })
        ));
        let ignored = Tensor::from_vec(vec![-100i64, -100], &[2]).expect("targets");
        let out = cross_entropy(&logits, &ignored, DEFAULT_IGNORE_INDEX).expect("loss");
        assert!(out.loss.is_nan());
        assert_eq!(out.grad.to_vec::<f32>().expect("f32"), vec![0.0; 6]);
        let wrong_dtype = Tensor::from_vec(vec![0i32, 1], &[2]).expect("targets");
        assert!(matches!(
            cross_entropy(&logits, &wrong_dtype, DEFAULT_IGNORE_INDEX),
            Err(Error::DTypeMismatch { .. })
        ));
    }
}
