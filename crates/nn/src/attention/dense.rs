//! The materialised attention path: every head's weights `P` `[T, T]` are computed, handed
//! to the `attn_dropout` child as one `[B, H, T, T]` tensor, and cached for backward.
//!
//! [`super::CausalSelfAttention`] takes this path only when its `attn_dropout` child is not a
//! plain [`crate::Dropout`] (a wrapper replaced it), since only then must the weights exist as
//! a tensor for the child to see; otherwise the tiled kernels of [`super::flash`] run. The
//! tests use this path as the reference the tiled kernels are compared against.

use rayon::prelude::*;

use super::Dims;
use crate::Result;
use crate::kernels::Float;
use crate::linalg::{GemmShape, MatmulOptions, gemm};

/// `S = scale · q kᵀ` with a row-wise causal softmax: row `i` covers columns `0..=i`, the rest
/// are exactly 0. One fused pass per row for the maximum, the exponentials and their sum.
fn causal_softmax<F: Float>(scores: &mut [F], seq: usize, scale: F) {
    if seq == 0 {
        return;
    }
    for (i, row) in scores.chunks_exact_mut(seq).enumerate() {
        let (visible, masked) = row.split_at_mut(i + 1);
        let max = visible
            .iter()
            .fold(visible[0] * scale, |m, &v| m.max(v * scale));
        let mut sum = F::ZERO;
        for v in visible.iter_mut() {
            let e = (*v * scale - max).exp();
            *v = e;
            sum += e;
        }
        let inv = F::ONE / sum;
        for v in visible.iter_mut() {
            *v *= inv;
        }
        masked.fill(F::ZERO);
    }
}

/// The gradient of the scores from the gradient of the softmax output, scaled:
/// `dS = scale · P ⊙ (dP − rowsum(dP ⊙ P))` (zero on the masked triangle, where `P = 0`).
fn softmax_backward<F: Float>(probs: &[F], grad_probs: &mut [F], seq: usize, scale: F) {
    if seq == 0 {
        return;
    }
    for (p_row, g_row) in probs
        .chunks_exact(seq)
        .zip(grad_probs.chunks_exact_mut(seq))
    {
        let dot: F = p_row.iter().zip(g_row.iter()).map(|(&p, &g)| p * g).sum();
        for (g, &p) in g_row.iter_mut().zip(p_row) {
            *g = scale * p * (*g - dot);
        }
    }
}

/// Which operands of a GEMM are transposed.
fn options(transpose_a: bool, transpose_b: bool) -> MatmulOptions {
    MatmulOptions {
        transpose_a,
        transpose_b,
    }
}

/// The softmax weights `[B·H][T, T]` of every head.
pub(super) fn attention_probs<F: Float>(qkv: &[F], dims: Dims) -> Result<Vec<F>> {
    let (t, d) = (dims.seq, dims.head_dim());
    let scale = F::of(1.0 / (d as f64).sqrt());
    let scores_shape = GemmShape::new(t, d, t, options(false, true))?;
    let heads: Vec<Vec<F>> = (0..dims.batch * dims.n_head)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / dims.n_head, bh % dims.n_head);
            let q = dims.gather_head(qkv, b, h, 0);
            let k = dims.gather_head(qkv, b, h, 1);
            let mut scores = gemm(&q, &k, scores_shape)?;
            causal_softmax(&mut scores, t, scale);
            Ok(scores)
        })
        .collect::<Result<_>>()?;
    Ok(heads.concat())
}

/// `y = P v` for every head, assembled into `[B, T, C]`.
pub(super) fn attention_output<F: Float>(qkv: &[F], probs: &[F], dims: Dims) -> Result<Vec<F>> {
    let (t, d) = (dims.seq, dims.head_dim());
    let shape = GemmShape::new(t, t, d, MatmulOptions::default())?;
    let heads: Vec<Vec<F>> = (0..dims.batch * dims.n_head)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / dims.n_head, bh % dims.n_head);
            let v = dims.gather_head(qkv, b, h, 2);
            gemm(&probs[bh * t * t..(bh + 1) * t * t], &v, shape)
        })
        .collect::<Result<_>>()?;
    let mut y = vec![F::ZERO; dims.batch * t * dims.n_embd];
    for (bh, head) in heads.iter().enumerate() {
        let (b, h) = (bh / dims.n_head, bh % dims.n_head);
        for (ti, src) in head.chunks_exact(d).enumerate() {
            let start = (b * t + ti) * dims.n_embd + h * d;
            y[start..start + d].copy_from_slice(src);
        }
    }
    Ok(y)
}

/// Per head: `dP' = dy vᵀ` (the gradient of the weights after dropout) and `dv = P'ᵀ dy`.
pub(super) struct ValueGrads<F> {
    pub(super) grad_dropped_probs: Vec<F>,
    pub(super) grad_v: Vec<Vec<F>>,
}

pub(super) fn value_backward<F: Float>(
    qkv: &[F],
    dropped_probs: &[F],
    grad_y: &[F],
    dims: Dims,
) -> Result<ValueGrads<F>> {
    let (t, d) = (dims.seq, dims.head_dim());
    let dp_shape = GemmShape::new(t, d, t, options(false, true))?;
    let dv_shape = GemmShape::new(t, t, d, options(true, false))?;
    let per_head: Vec<(Vec<F>, Vec<F>)> = (0..dims.batch * dims.n_head)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / dims.n_head, bh % dims.n_head);
            let v = dims.gather_head(qkv, b, h, 2);
            let dy = dims.gather_output_head(grad_y, b, h);
            let dp = gemm(&dy, &v, dp_shape)?;
            let dv = gemm(&dropped_probs[bh * t * t..(bh + 1) * t * t], &dy, dv_shape)?;
            Ok((dp, dv))
        })
        .collect::<Result<_>>()?;
    let mut grad_dropped_probs = Vec::with_capacity(dropped_probs.len());
    let mut grad_v = Vec::with_capacity(per_head.len());
    for (dp, dv) in per_head {
        grad_dropped_probs.extend_from_slice(&dp);
        grad_v.push(dv);
    }
    Ok(ValueGrads {
        grad_dropped_probs,
        grad_v,
    })
}

/// Per head: `dS` from `dP`, then `dq = dS k` and `dk = dSᵀ q`; assembles `dq, dk, dv` into the
/// fused `[B, T, 3C]` gradient of `c_attn`'s output.
pub(super) fn query_key_backward<F: Float>(
    qkv: &[F],
    probs: &[F],
    grad_probs: &[F],
    grad_v: &[Vec<F>],
    dims: Dims,
) -> Result<Vec<F>> {
    let (t, d) = (dims.seq, dims.head_dim());
    let scale = F::of(1.0 / (d as f64).sqrt());
    let dq_shape = GemmShape::new(t, t, d, MatmulOptions::default())?;
    let dk_shape = GemmShape::new(t, t, d, options(true, false))?;
    let per_head: Vec<(Vec<F>, Vec<F>)> = (0..dims.batch * dims.n_head)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / dims.n_head, bh % dims.n_head);
            let q = dims.gather_head(qkv, b, h, 0);
            let k = dims.gather_head(qkv, b, h, 1);
            let range = bh * t * t..(bh + 1) * t * t;
            let mut ds = grad_probs[range.clone()].to_vec();
            softmax_backward(&probs[range], &mut ds, t, scale);
            let dq = gemm(&ds, &k, dq_shape)?;
            let dk = gemm(&ds, &q, dk_shape)?;
            Ok((dq, dk))
        })
        .collect::<Result<_>>()?;
    let row_len = 3 * dims.n_embd;
    let mut grad_qkv = vec![F::ZERO; dims.batch * t * row_len];
    for (bh, ((dq, dk), dv)) in per_head.iter().zip(grad_v).enumerate() {
        let (b, h) = (bh / dims.n_head, bh % dims.n_head);
        for (part, src) in [dq, dk, dv].into_iter().enumerate() {
            for (ti, row) in src.chunks_exact(d).enumerate() {
                let start = (b * t + ti) * row_len + part * dims.n_embd + h * d;
                grad_qkv[start..start + d].copy_from_slice(row);
            }
        }
    }
    Ok(grad_qkv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_softmax_rows_sum_to_one_and_mask_the_future() {
        let mut scores: Vec<f64> = (0..9).map(f64::from).collect();
        causal_softmax(&mut scores, 3, 1.0);
        assert_eq!(scores[0], 1.0);
        assert_eq!(&scores[1..3], &[0.0, 0.0]);
        // Row 1 sees [3, 4]: softmax = [1, e] / (1 + e).
        let e = 1f64.exp();
        assert!((scores[3] - 1.0 / (1.0 + e)).abs() < 1e-15);
        assert!((scores[4] - e / (1.0 + e)).abs() < 1e-15);
        assert_eq!(scores[5], 0.0);
        let last: f64 = scores[6..9].iter().sum();
        assert!((last - 1.0).abs() < 1e-15);
    }
}
