//! Losses that return their value and the gradient of their input together.

use hypershard_tensor::{DType, Tensor};

use crate::elementwise::{check_float, from_f64};
use crate::kernels::vector_isa::vectorized;
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
/// rows) and adds each row's loss, in row order, to `total` (f64), so a caller working through
/// the logits in chunks never holds a second buffer of their size and sums the rows in the same
/// order as one call over all of them.
///
/// Rows are independent, so they are spread over the kernel threads (a GPT-2 head block is a
/// few hundred rows of 50 k classes); each row's loss lands in its own slot and the slots are
/// summed in row order afterwards, so the total does not depend on the thread count. Within a
/// row the maximum and `Σ exp(x − max)` run over [`LANES`] independent accumulators, which the
/// compiler keeps in vector registers: one running sum would serialise every add.
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
    let rows = x.len() / classes;
    let mut losses = vec![0.0f64; rows];
    let one_row = |(row, (class, loss)): (&mut [F], (&Option<usize>, &mut f64))| {
        *loss = vectorized!(|| cross_entropy_row(row, *class, scale));
    };
    if x.len() < PARALLEL_ELEMENTS {
        x.chunks_exact_mut(classes)
            .zip(classes_of.iter().zip(losses.iter_mut()))
            .for_each(one_row);
    } else {
        use rayon::prelude::*;
        x.par_chunks_exact_mut(classes)
            .zip(classes_of.par_iter().zip(losses.par_iter_mut()))
            .for_each(one_row);
    }
    for loss in losses {
        *total += loss;
    }
}

/// Logit elements below which one thread does the whole loss (spreading costs more).
const PARALLEL_ELEMENTS: usize = 1 << 16;
/// Independent accumulators per row reduction.
const LANES: usize = 16;

/// One row of [`cross_entropy_rows_in_place`]: the row becomes its gradient; returns its loss
/// (0 for an ignored row).
#[inline(always)]
fn cross_entropy_row<F: Float>(row: &mut [F], class: Option<usize>, scale: F) -> f64 {
    let Some(class) = class else {
        row.fill(F::ZERO);
        return 0.0;
    };
    let target_logit = row[class].as_f64();
    let mut maxes = [row[0]; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (m, &v) in maxes.iter_mut().zip(chunk) {
            *m = m.max(v);
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .chain(&maxes)
        .copied()
        .fold(row[0], F::max);
    let mut sums = [F::ZERO; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for (s, v) in sums.iter_mut().zip(chunk) {
            let e = (*v - max).exp();
            *v = e;
            *s += e;
        }
    }
    let mut sum = F::ZERO;
    for v in chunks.into_remainder() {
        let e = (*v - max).exp();
        *v = e;
        sum += e;
    }
    let sum = sums.iter().fold(sum, |acc, &s| acc + s);
    let factor = scale / sum;
    for g in row.iter_mut() {
        *g *= factor;
    }
    row[class] -= scale;
    sum.as_f64().ln() + max.as_f64() - target_logit
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

    /// Rows spread over threads with lane-wise reductions: checked against an f64 reference per
    /// row, at a size past the parallel threshold, with a row length that leaves a remainder
    /// after the lanes, an ignored row and a row whose maximum sits in that remainder; and the
    /// loss is the same bits on one thread and on two.
    #[test]
    fn cross_entropy_rows_in_parallel_match_the_reference() {
        let (rows, classes) = (40usize, 3001usize);
        assert!(rows * classes >= PARALLEL_ELEMENTS);
        let logits: Vec<f32> = (0..rows * classes)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 6.0)
            .collect();
        let mut logits = logits;
        logits[3 * classes + classes - 1] = 40.0;
        let targets: Vec<i64> = (0..rows)
            .map(|r| {
                if r == 5 {
                    -100
                } else {
                    (r * 131 % classes) as i64
                }
            })
            .collect();
        let logits_t = Tensor::from_vec(logits.clone(), &[rows, classes]).expect("logits");
        let targets_t = Tensor::from_vec(targets.clone(), &[rows]).expect("targets");
        let run = |threads| {
            crate::with_num_threads(threads, || {
                cross_entropy(&logits_t, &targets_t, DEFAULT_IGNORE_INDEX)
            })
            .expect("pool")
            .expect("loss")
        };
        let (one, two) = (run(1), run(2));
        assert_eq!(one.loss.to_bits(), two.loss.to_bits());
        let grad = two.grad.to_vec::<f32>().expect("f32");
        assert_eq!(grad, one.grad.to_vec::<f32>().expect("f32"));
        let counted = (rows - 1) as f64;
        let mut want_loss = 0.0;
        for r in 0..rows {
            let row = &logits[r * classes..(r + 1) * classes];
            let got = &grad[r * classes..(r + 1) * classes];
            if targets[r] < 0 {
                assert!(got.iter().all(|&g| g == 0.0));
                continue;
            }
            let max = row.iter().fold(f64::MIN, |m, &v| m.max(f64::from(v)));
            let sum: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
            let class = targets[r] as usize;
            want_loss += sum.ln() + max - f64::from(row[class]);
            for (c, (&v, &g)) in row.iter().zip(got).enumerate() {
                let onehot = if c == class { 1.0 } else { 0.0 };
                let want = ((f64::from(v) - max).exp() / sum - onehot) / counted;
                assert!(
                    (f64::from(g) - want).abs() < 1e-8,
                    "row {r} class {c}: {g} vs {want}"
                );
            }
        }
        want_loss /= counted;
        assert!(
            (two.loss - want_loss).abs() < 1e-5 * want_loss.abs(),
            "{} vs {want_loss}",
            two.loss
        );
    }
}
