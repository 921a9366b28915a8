//! Global-norm gradient clipping (torch's `clip_grad_norm_`).

use hypershard_tensor::{DType, Tensor};

use crate::kernels::load_f64;
use crate::{Module, Parameter, Result};

/// Elements per task of [`sum_of_squares`]: fixed, so the sum's bits do not depend on the
/// number of threads.
const SQUARES_CHUNK: usize = 1 << 16;
/// Independent f64 accumulators per task, which the compiler keeps in vector registers (one
/// running sum would serialise every add).
const SQUARES_LANES: usize = 8;

/// `Σ x²` over the elements of `t`, accumulated in f64: the square of a gradient's L2 norm.
///
/// A contiguous f32 tensor (every gradient of an f32 model) is read in place, in chunks spread
/// over the kernel threads whose sums are added in order; other dtypes and layouts are widened
/// to f64 first. On a CUDA device the sum is one cuBLAS product, accumulated in f32.
pub fn sum_of_squares(t: &Tensor) -> Result<f64> {
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        return crate::kernels::cuda::sum_of_squares(&t.contiguous()?);
    }
    if t.dtype() != DType::F32 || !t.is_contiguous() {
        return Ok(load_f64(t)?.iter().map(|g| g * g).sum::<f64>());
    }
    Ok(t.with_kernel_data::<f32, _>("sum_of_squares", |xs| {
        let chunk_sum = |chunk: &[f32]| {
            let mut lanes = [0.0f64; SQUARES_LANES];
            let mut groups = chunk.chunks_exact(SQUARES_LANES);
            for group in &mut groups {
                for (lane, &x) in lanes.iter_mut().zip(group) {
                    *lane += f64::from(x) * f64::from(x);
                }
            }
            let rest: f64 = groups
                .remainder()
                .iter()
                .map(|&x| f64::from(x) * f64::from(x))
                .sum();
            lanes.iter().sum::<f64>() + rest
        };
        if xs.len() <= SQUARES_CHUNK {
            chunk_sum(xs)
        } else {
            use rayon::prelude::*;
            let sums: Vec<f64> = xs.par_chunks(SQUARES_CHUNK).map(chunk_sum).collect();
            sums.iter().sum()
        }
    })?)
}

/// Scales every gradient of `module` so that their joint L2 norm is at most `max_norm`, and
/// returns the norm before clipping.
///
/// As in torch, the scale is `max_norm / (total_norm + 1e-6)` and is applied only when it is
/// below 1; the norm is accumulated in f64 over all gradients. A non-finite norm is returned
/// as is (torch's `error_if_nonfinite=False`).
pub fn clip_grad_norm(module: &mut dyn Module, max_norm: f64) -> Result<f64> {
    // The visitors cannot hand out references that outlive them, so one pass sums the squares
    // and a second one scales.
    let mut sum_sq = 0.0;
    module.visit_params("", &mut |_, param| {
        if let Some(grad) = &param.grad {
            sum_sq += sum_of_squares(grad)?;
        }
        Ok(())
    })?;
    let total_norm = sum_sq.sqrt();
    let coef = max_norm / (total_norm + 1e-6);
    if coef < 1.0 {
        module.visit_params_mut("", &mut |_, param| {
            if let Some(grad) = &param.grad {
                grad.scale_(coef)?;
            }
            Ok(())
        })?;
    }
    Ok(total_norm)
}

/// [`clip_grad_norm`] over an explicit set of parameters.
pub fn clip_grad_norm_params(params: &mut [&mut Parameter], max_norm: f64) -> Result<f64> {
    let mut sum_sq = 0.0;
    for param in params.iter() {
        if let Some(grad) = &param.grad {
            sum_sq += sum_of_squares(grad)?;
        }
    }
    let total_norm = sum_sq.sqrt();
    let coef = max_norm / (total_norm + 1e-6);
    if coef < 1.0 {
        for param in params.iter() {
            if let Some(grad) = &param.grad {
                grad.scale_(coef)?;
            }
        }
    }
    Ok(total_norm)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Several chunks and a remainder: the f64 reference to rounding, the same bits on one
    /// thread and two, and the widening path (strided, bf16) on the same values.
    #[test]
    fn sum_of_squares_matches_the_reference() -> Result<()> {
        let n = 3 * SQUARES_CHUNK + 13;
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 % 255) as f32 - 127.0) / 32.0)
            .collect();
        let want: f64 = values.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let t = Tensor::from_vec(values.clone(), &[n])?;
        let one = crate::with_num_threads(1, || sum_of_squares(&t))??;
        let two = crate::with_num_threads(2, || sum_of_squares(&t))??;
        assert_eq!(one.to_bits(), two.to_bits());
        assert!((two - want).abs() <= 1e-12 * want, "{two} vs {want}");
        // Every value is a multiple of 1/32 of at most 7 significant bits: exact in bf16, so the
        // widened sum agrees.
        let bf16 = t.to_dtype(DType::BF16)?;
        assert!((sum_of_squares(&bf16)? - want).abs() <= 1e-12 * want);
        let strided =
            Tensor::from_vec(values[..n - 13].to_vec(), &[3, SQUARES_CHUNK])?.transpose(0, 1)?;
        let want_strided: f64 = values[..n - 13].iter().map(|&v| f64::from(v).powi(2)).sum();
        assert!((sum_of_squares(&strided)? - want_strided).abs() <= 1e-12 * want_strided);
        Ok(())
    }
}
