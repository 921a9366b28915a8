//! Causal multi-head self-attention with nanoGPT's names: `c_attn` (the fused q, k, v
//! projection) and `c_proj` (the output projection).

use hypershard_tensor::{DType, Tensor};
use rayon::prelude::*;

use crate::elementwise::check_float;
use crate::kernels::{Float, load, store, with_float};
use crate::linalg::{GemmShape, MatmulOptions, gemm};
use crate::module::{ChildVisitorMut, ParamVisitor, ParamVisitorMut, join_name};
use crate::{Dropout, Error, Linear, LinearConfig, Module, Result};

/// How to build a [`CausalSelfAttention`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CausalSelfAttentionConfig {
    /// The model width `C`; must be a multiple of `n_head`.
    pub n_embd: usize,
    /// The number of heads `H`; each has width `C / H`.
    pub n_head: usize,
    /// Whether the projections have biases.
    pub bias: bool,
    /// The dropout probability on the attention weights and on the output (nanoGPT's
    /// `attn_dropout` and `resid_dropout`).
    pub dropout: f64,
    /// The parameters' dtype.
    pub dtype: DType,
    /// The seed of the projections (torch's `nn.Linear` initialisation) and the dropout masks;
    /// the module uses seeds `seed .. seed + 8`.
    pub seed: u64,
}

/// `y = c_proj(softmax(q kᵀ / √d + causal mask) v)` with `q, k, v = split(c_attn(x))`, over
/// inputs `[B, T, C]`, as nanoGPT's `CausalSelfAttention`.
///
/// The children are `c_attn` (`Linear(C, 3C)`), `c_proj` (`Linear(C, C)`), `attn_dropout`
/// and `resid_dropout`, all called through [`Module`], so a wrapper can replace any of them.
/// The attention itself runs one task per (batch, head) pair on rayon's threads; its scores
/// never touch the masked upper triangle.
pub struct CausalSelfAttention {
    c_attn: Box<dyn Module>,
    c_proj: Box<dyn Module>,
    attn_dropout: Box<dyn Module>,
    resid_dropout: Box<dyn Module>,
    n_embd: usize,
    n_head: usize,
    cache: Option<AttentionCache>,
}

impl std::fmt::Debug for CausalSelfAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CausalSelfAttention")
            .field("n_embd", &self.n_embd)
            .field("n_head", &self.n_head)
            .finish_non_exhaustive()
    }
}

/// What backward needs, in the compute type: the fused projection `[B, T, 3C]`, the attention
/// weights before and after dropout `[B, H, T, T]` (one tensor when dropout is off), the
/// sizes, and the dtype of the input.
struct AttentionCache {
    qkv: Tensor,
    probs: Tensor,
    dropped_probs: Tensor,
    dims: Dims,
    dtype: DType,
}

/// The sizes of one attention call.
#[derive(Debug, Clone, Copy)]
struct Dims {
    batch: usize,
    seq: usize,
    n_embd: usize,
    n_head: usize,
}

impl Dims {
    fn head_dim(self) -> usize {
        self.n_embd / self.n_head
    }

    /// Copies part `part` (0 = q, 1 = k, 2 = v) of head `head` of batch row `b` out of the
    /// fused `[B, T, 3C]` buffer into a contiguous `[T, D]` buffer.
    fn gather_head<F: Float>(self, qkv: &[F], b: usize, head: usize, part: usize) -> Vec<F> {
        let d = self.head_dim();
        let row_len = 3 * self.n_embd;
        let mut out = Vec::with_capacity(self.seq * d);
        for t in 0..self.seq {
            let start = (b * self.seq + t) * row_len + part * self.n_embd + head * d;
            out.extend_from_slice(&qkv[start..start + d]);
        }
        out
    }

    /// Copies head `head` of batch row `b` out of a `[B, T, C]` buffer.
    fn gather_output_head<F: Float>(self, y: &[F], b: usize, head: usize) -> Vec<F> {
        let d = self.head_dim();
        let mut out = Vec::with_capacity(self.seq * d);
        for t in 0..self.seq {
            let start = (b * self.seq + t) * self.n_embd + head * d;
            out.extend_from_slice(&y[start..start + d]);
        }
        out
    }
}

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
fn attention_probs<F: Float>(qkv: &[F], dims: Dims) -> Result<Vec<F>> {
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
fn attention_output<F: Float>(qkv: &[F], probs: &[F], dims: Dims) -> Result<Vec<F>> {
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
struct ValueGrads<F> {
    grad_dropped_probs: Vec<F>,
    grad_v: Vec<Vec<F>>,
}

fn value_backward<F: Float>(
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
fn query_key_backward<F: Float>(
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

impl CausalSelfAttention {
    /// Attention with torch-initialised projections (a GPT re-initialises them as nanoGPT).
    pub fn new(config: CausalSelfAttentionConfig) -> Result<Self> {
        check_float("CausalSelfAttention::new", config.dtype)?;
        if config.n_embd == 0 {
            return Err(Error::InvalidConfig {
                op: "CausalSelfAttention::new",
                field: "n_embd",
                value: 0.0,
                reason: "must be positive",
            });
        }
        if config.n_head == 0 || !config.n_embd.is_multiple_of(config.n_head) {
            return Err(Error::InvalidConfig {
                op: "CausalSelfAttention::new",
                field: "n_head",
                value: config.n_head as f64,
                reason: "must be positive and divide n_embd",
            });
        }
        let linear = |in_features, out_features, seed| {
            Linear::new(LinearConfig {
                in_features,
                out_features,
                bias: config.bias,
                dtype: config.dtype,
                seed,
            })
        };
        let c = config.n_embd;
        Ok(CausalSelfAttention {
            c_attn: Box::new(linear(c, 3 * c, config.seed)?),
            c_proj: Box::new(linear(c, c, config.seed.wrapping_add(2))?),
            attn_dropout: Box::new(Dropout::new(config.dropout, config.seed.wrapping_add(4))?),
            resid_dropout: Box::new(Dropout::new(config.dropout, config.seed.wrapping_add(6))?),
            n_embd: c,
            n_head: config.n_head,
            cache: None,
        })
    }

    /// The number of heads.
    pub fn n_head(&self) -> usize {
        self.n_head
    }

    /// The sizes of an input `[B, T, C]`.
    fn dims(&self, op: &'static str, shape: &[usize]) -> Result<Dims> {
        match shape {
            &[batch, seq, n_embd] if n_embd == self.n_embd => Ok(Dims {
                batch,
                seq,
                n_embd,
                n_head: self.n_head,
            }),
            other => Err(Error::BadShape {
                op,
                expected: format!("[B, T, {}]", self.n_embd),
                actual: other.to_vec(),
            }),
        }
    }
}

impl Module for CausalSelfAttention {
    fn kind(&self) -> &'static str {
        "CausalSelfAttention"
    }

    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        const OP: &str = "CausalSelfAttention::forward";
        let dims = self.dims(OP, input.shape())?;
        let qkv = self.c_attn.forward(input)?;
        let dtype = qkv.dtype();
        let probs_shape = [dims.batch, dims.n_head, dims.seq, dims.seq];
        let (qkv_cached, probs) = with_float!(OP, dtype, F => {
            let qkv_values = load::<F>(&qkv)?;
            let probs = attention_probs(&qkv_values, dims)?;
            (
                Tensor::from_vec(qkv_values, qkv.shape())?,
                Tensor::from_vec(probs, &probs_shape)?,
            )
        });
        let dropped_probs = self.attn_dropout.forward(&probs)?;
        let y = with_float!(OP, dtype, F => {
            let y = attention_output(&load::<F>(&qkv_cached)?, &load::<F>(&dropped_probs)?, dims)?;
            store(y, input.shape(), dtype)?
        });
        self.cache = Some(AttentionCache {
            qkv: qkv_cached,
            probs,
            dropped_probs,
            dims,
            dtype,
        });
        let out = self.c_proj.forward(&y)?;
        self.resid_dropout.forward(&out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        const OP: &str = "CausalSelfAttention::backward";
        let cache = self.cache.take().ok_or(Error::BackwardBeforeForward {
            module: "CausalSelfAttention",
        })?;
        let dims = cache.dims;
        let grad_out = self.resid_dropout.backward(grad_output)?;
        let grad_y = self.c_proj.backward(&grad_out)?;
        if grad_y.shape() != [dims.batch, dims.seq, dims.n_embd] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: vec![dims.batch, dims.seq, dims.n_embd],
                rhs: grad_y.shape().to_vec(),
            });
        }
        let probs_shape = [dims.batch, dims.n_head, dims.seq, dims.seq];
        let (grad_dropped, grad_v) = with_float!(OP, cache.dtype, F => {
            let grads = value_backward(
                &load::<F>(&cache.qkv)?,
                &load::<F>(&cache.dropped_probs)?,
                &load::<F>(&grad_y)?,
                dims,
            )?;
            let grad_v: Vec<Tensor> = grads
                .grad_v
                .into_iter()
                .map(|dv| Tensor::from_vec(dv, &[dims.seq, dims.head_dim()]))
                .collect::<std::result::Result<_, _>>()?;
            (Tensor::from_vec(grads.grad_dropped_probs, &probs_shape)?, grad_v)
        });
        let grad_probs = self.attn_dropout.backward(&grad_dropped)?;
        let grad_qkv = with_float!(OP, cache.dtype, F => {
            let grad_v = grad_v.iter().map(load::<F>).collect::<Result<Vec<_>>>()?;
            let g = query_key_backward(
                &load::<F>(&cache.qkv)?,
                &load::<F>(&cache.probs)?,
                &load::<F>(&grad_probs)?,
                &grad_v,
                dims,
            )?;
            store(g, cache.qkv.shape(), cache.dtype)?
        });
        self.c_attn.backward(&grad_qkv)
    }

    fn clear_cache(&mut self) -> Result<()> {
        self.cache = None;
        self.visit_children_mut(&mut |_, child| child.clear_cache())
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        self.c_attn.visit_params(&join_name(prefix, "c_attn"), f)?;
        self.c_proj.visit_params(&join_name(prefix, "c_proj"), f)
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        self.c_attn
            .visit_params_mut(&join_name(prefix, "c_attn"), f)?;
        self.c_proj
            .visit_params_mut(&join_name(prefix, "c_proj"), f)
    }

    fn visit_children_mut(&mut self, f: &mut ChildVisitorMut<'_>) -> Result<()> {
        f("c_attn", &mut self.c_attn)?;
        f("c_proj", &mut self.c_proj)?;
        f("attn_dropout", &mut self.attn_dropout)?;
        f("resid_dropout", &mut self.resid_dropout)
    }
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
