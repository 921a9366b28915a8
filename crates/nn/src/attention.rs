//! Causal multi-head self-attention with nanoGPT's names: `c_attn` (the fused q, k, v
//! projection) and `c_proj` (the output projection).
//!
//! The attention itself runs the tiled kernels of [`flash`], which keep only a log-sum-exp per
//! row for backward; [`dense`] materialises the weights, for an `attn_dropout` child that a
//! wrapper replaced (and as the tests' reference).

mod dense;
mod flash;

use hypershard_tensor::{DType, Tensor};

use crate::dropout::DropMask;
use crate::elementwise::check_float;
use crate::kernels::{
    Float, build_overwrite, load, overwrite_target, same_device, store, with_float, with_values,
    with_values2,
};
use crate::module::{ChildVisitorMut, ParamVisitor, ParamVisitorMut, join_name};
use crate::{Dropout, Error, Linear, LinearConfig, Module, Result};

/// The query and key block size of the tiled kernels. Every tile product runs on the
/// packing-free f32 kernels (`kernels::small_gemm`) in pieces of 32 rows, which beat the
/// packing GEMM at these sizes; with 64 the products' other side is 64 wide (a key block or
/// a head of GPT-2's width), which those kernels handle best. At C = 768, H = 12,
/// T = 64..512, forward + backward of the kernels alone measured 64 faster than 32 and 128.
const TILE: usize = 64;

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
///
/// The attention runs one task per (batch, head) pair on rayon's threads, tiled over query
/// and key blocks with an online softmax: blocks above the causal diagonal are skipped, the
/// `[T, T]` weights are never stored, and backward recomputes them from the per-row
/// log-sum-exp, so the extra memory is `O(B·H·T)` instead of `O(B·H·T²)`. While
/// `attn_dropout` is the plain [`Dropout`] it was built as, its masks are drawn inside the
/// kernel, element for element the ones its `forward` would have drawn; if a wrapper replaced
/// it, the weights are materialised as a `[B, H, T, T]` tensor and passed through it as
/// before.
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

/// What backward needs, in the compute type.
enum AttentionCache {
    /// The tiled path: every head's q, k and v `[B, H, 3, T, D]` (the fused projection,
    /// regrouped by head), the attention output `[B, T, C]` (before `c_proj`, unrounded), the
    /// per-row log-sum-exp `[B, H, T]` and the dropout mask.
    Flash {
        heads: Tensor,
        out: Tensor,
        lse: Tensor,
        mask: Option<DropMask>,
        dims: Dims,
        dtype: DType,
    },
    /// The materialised path: the fused projection and the weights before and after the
    /// `attn_dropout` child `[B, H, T, T]` (one tensor when it is the identity).
    Dense {
        qkv: Tensor,
        probs: Tensor,
        dropped_probs: Tensor,
        dims: Dims,
        dtype: DType,
    },
    /// The CUDA materialised path: the heads and the `[B·H, T, T]` weights (see
    /// `kernels::cuda`).
    #[cfg(feature = "cuda")]
    Cuda {
        cache: crate::kernels::cuda::AttentionCache,
        dims: Dims,
    },
    /// The CUDA tiled path: the fused projection, the output and log-sum-exps, the mask.
    #[cfg(feature = "cuda")]
    CudaFlash {
        qkv: Tensor,
        forward: hypershard_tensor::cuda::FlashForward,
        mask: Option<DropMask>,
        dims: Dims,
    },
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
        let mut out = vec![F::ZERO; self.seq * self.head_dim()];
        self.gather_head_into(qkv, b, head, part, &mut out);
        out
    }

    /// [`gather_head`](Self::gather_head) into `out` (`[T, D]`, every element overwritten).
    fn gather_head_into<F: Float>(
        self,
        qkv: &[F],
        b: usize,
        head: usize,
        part: usize,
        out: &mut [F],
    ) {
        let d = self.head_dim();
        let row_len = 3 * self.n_embd;
        for (t, dst) in out.chunks_exact_mut(d).enumerate() {
            let start = (b * self.seq + t) * row_len + part * self.n_embd + head * d;
            copy_head_row(dst, &qkv[start..start + d]);
        }
    }

    /// Copies head `head` of batch row `b` out of a `[B, T, C]` buffer.
    fn gather_output_head<F: Float>(self, y: &[F], b: usize, head: usize) -> Vec<F> {
        let mut out = vec![F::ZERO; self.seq * self.head_dim()];
        self.gather_output_head_into(y, b, head, &mut out);
        out
    }

    /// [`gather_output_head`](Self::gather_output_head) into `out` (`[T, D]`, every element
    /// overwritten).
    fn gather_output_head_into<F: Float>(self, y: &[F], b: usize, head: usize, out: &mut [F]) {
        let d = self.head_dim();
        for (t, dst) in out.chunks_exact_mut(d).enumerate() {
            copy_head_row(dst, self.output_head_row(y, b, head, t));
        }
    }

    /// Head `head`'s `D` values of token `t` of batch row `b` in a `[B, T, C]` buffer.
    fn output_head_row<F>(self, y: &[F], b: usize, head: usize, t: usize) -> &[F] {
        let d = self.head_dim();
        let start = (b * self.seq + t) * self.n_embd + head * d;
        &y[start..start + d]
    }
}

/// Copies one head's row (`D` values, a few cache lines) between the `[B, T, C]` layout and a
/// head's own buffer. In pieces of 16 values, each a copy of known size, so a head width such
/// as 32 or 64 moves in a few vector loads and stores; a plain `copy_from_slice` of a length
/// known only at run time is a `memmove` call per row, which at medium's `D = 32` cost more
/// than the copy itself.
#[inline]
fn copy_head_row<F: Float>(dst: &mut [F], src: &[F]) {
    const PIECE: usize = 16;
    let mut dst_pieces = dst.chunks_exact_mut(PIECE);
    let mut src_pieces = src.chunks_exact(PIECE);
    for (d, s) in (&mut dst_pieces).zip(&mut src_pieces) {
        let s: &[F; PIECE] = s
            .try_into()
            .expect("invariant: chunks_exact yields PIECE values");
        let d: &mut [F; PIECE] = d
            .try_into()
            .expect("invariant: chunks_exact yields PIECE values");
        *d = *s;
    }
    dst_pieces
        .into_remainder()
        .copy_from_slice(src_pieces.remainder());
}

/// `t` as a contiguous tensor of the compute type `F`: `t` itself (shared storage) when it
/// already is one, a converted copy otherwise.
fn compute_tensor<F: Float>(t: &Tensor) -> Result<Tensor> {
    if t.dtype() == F::COMPUTE_DTYPE && t.is_contiguous() {
        Ok(t.clone())
    } else {
        Ok(Tensor::from_vec_on(load::<F>(t)?, t.shape(), &t.device())?)
    }
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

    /// The mask for the weights when `attn_dropout` is the plain [`Dropout`] (`Some(None)` in
    /// evaluation or with `p = 0`; drawing a mask advances the layer's call counter as its
    /// `forward` would), or `None` when a wrapper replaced the child.
    fn fused_dropout(&mut self) -> Option<Option<DropMask>> {
        self.attn_dropout
            .as_any_mut()
            .and_then(|any| any.downcast_mut::<Dropout>())
            .map(Dropout::draw_mask)
    }

    /// The tiled forward: returns the attention output `[B, T, C]` in `qkv`'s dtype.
    fn forward_flash(
        &mut self,
        qkv: &Tensor,
        dims: Dims,
        mask: Option<DropMask>,
    ) -> Result<Tensor> {
        const OP: &str = "CausalSelfAttention::forward";
        let dtype = qkv.dtype();
        let y_shape = [dims.batch, dims.seq, dims.n_embd];
        let lse_shape = [dims.batch, dims.n_head, dims.seq];
        let heads_shape = [dims.batch, dims.n_head, 3, dims.seq, dims.head_dim()];
        let device = qkv.device();
        let (heads, out, lse) = with_float!(OP, dtype, F => {
            let qkv = compute_tensor::<F>(qkv)?;
            // The heads' operands and outputs go straight into (recycled) storage.
            let out = overwrite_target::<F>(&y_shape, &device)?;
            let heads = overwrite_target::<F>(&heads_shape, &device)?;
            let row_lse = out.with_kernel_data_mut::<F, _>(OP, |y| {
                heads.with_kernel_data_mut::<F, _>(OP, |h| {
                    with_values::<F, _>(&qkv, |values| {
                        flash::forward_into(values, dims, TILE, mask.as_ref(), (h, y))
                    })
                })
            })????;
            (heads, out, Tensor::from_vec_on(row_lse, &lse_shape, &device)?)
        });
        let y = if dtype == out.dtype() {
            out.clone()
        } else {
            out.to_dtype(dtype)?
        };
        self.cache = Some(AttentionCache::Flash {
            heads,
            out,
            lse,
            mask,
            dims,
            dtype,
        });
        Ok(y)
    }

    /// The materialised forward, through the `attn_dropout` child.
    fn forward_dense(&mut self, qkv: &Tensor, dims: Dims) -> Result<Tensor> {
        const OP: &str = "CausalSelfAttention::forward";
        let dtype = qkv.dtype();
        let probs_shape = [dims.batch, dims.n_head, dims.seq, dims.seq];
        let device = qkv.device();
        let (qkv_cached, probs) = with_float!(OP, dtype, F => {
            let qkv_values = load::<F>(qkv)?;
            let probs = dense::attention_probs(&qkv_values, dims)?;
            (
                Tensor::from_vec_on(qkv_values, qkv.shape(), &device)?,
                Tensor::from_vec_on(probs, &probs_shape, &device)?,
            )
        });
        let dropped_probs = self.attn_dropout.forward(&probs)?;
        let y = with_float!(OP, dtype, F => {
            let y = dense::attention_output(
                &load::<F>(&qkv_cached)?,
                &load::<F>(&dropped_probs)?,
                dims,
            )?;
            store(y, &[dims.batch, dims.seq, dims.n_embd], dtype, &device)?
        });
        self.cache = Some(AttentionCache::Dense {
            qkv: qkv_cached,
            probs,
            dropped_probs,
            dims,
            dtype,
        });
        Ok(y)
    }

    /// The materialised backward: the gradient of `c_attn`'s output.
    fn backward_dense(
        &mut self,
        (qkv, probs, dropped_probs): (&Tensor, &Tensor, &Tensor),
        grad_y: &Tensor,
        dims: Dims,
        dtype: DType,
    ) -> Result<Tensor> {
        const OP: &str = "CausalSelfAttention::backward";
        let probs_shape = [dims.batch, dims.n_head, dims.seq, dims.seq];
        let device = same_device(OP, &[qkv, grad_y])?;
        let (grad_dropped, grad_v) = with_float!(OP, dtype, F => {
            let grads = dense::value_backward(
                &load::<F>(qkv)?,
                &load::<F>(dropped_probs)?,
                &load::<F>(grad_y)?,
                dims,
            )?;
            let grad_v: Vec<Tensor> = grads
                .grad_v
                .into_iter()
                .map(|dv| Tensor::from_vec_on(dv, &[dims.seq, dims.head_dim()], &device))
                .collect::<std::result::Result<_, _>>()?;
            (Tensor::from_vec_on(grads.grad_dropped_probs, &probs_shape, &device)?, grad_v)
        });
        let grad_probs = self.attn_dropout.backward(&grad_dropped)?;
        Ok(with_float!(OP, dtype, F => {
            let grad_v = grad_v.iter().map(load::<F>).collect::<Result<Vec<_>>>()?;
            let g = dense::query_key_backward(
                &load::<F>(qkv)?,
                &load::<F>(probs)?,
                &load::<F>(&grad_probs)?,
                &grad_v,
                dims,
            )?;
            store(g, qkv.shape(), dtype, &device)?
        }))
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
        let dims = self.dims("CausalSelfAttention::forward", input.shape())?;
        let qkv = self.c_attn.forward(input)?;
        // A replaced `c_attn` could return another shape; the kernels index by `dims`.
        let qkv_shape = [dims.batch, dims.seq, 3 * dims.n_embd];
        if qkv.shape() != qkv_shape {
            return Err(Error::ShapeMismatch {
                op: "CausalSelfAttention::forward",
                lhs: qkv_shape.to_vec(),
                rhs: qkv.shape().to_vec(),
            });
        }
        #[cfg(feature = "cuda")]
        if qkv.device().is_cuda() {
            let qkv = qkv.contiguous()?;
            let head_dim = dims.n_embd / dims.n_head.max(1);
            // The tiled kernels, as on the host, for the plain dropout child and heads the
            // kernels take.
            if head_dim <= hypershard_tensor::cuda::FLASH_MAX_HEAD_DIM
                && let Some(mask) = self.fused_dropout()
            {
                let forward = crate::kernels::cuda::flash_attention(&qkv, dims.n_head, mask)?;
                let y = forward.out.clone();
                self.cache = Some(AttentionCache::CudaFlash {
                    qkv,
                    forward,
                    mask,
                    dims,
                });
                let out = self.c_proj.forward(&y)?;
                return self.resid_dropout.forward(&out);
            }
            // Otherwise the dense attention of GEMMs and the causal softmax kernel, with the
            // weights going through the `attn_dropout` child (its kernel draws the mask the
            // host's tiled kernel draws).
            let attn_dropout = &mut self.attn_dropout;
            let (y, cache) = crate::kernels::cuda::attention(&qkv, self.n_head, &mut |weights| {
                attn_dropout.forward(weights)
            })?;
            self.cache = Some(AttentionCache::Cuda { cache, dims });
            let out = self.c_proj.forward(&y)?;
            return self.resid_dropout.forward(&out);
        }
        let y = match self.fused_dropout() {
            Some(mask) => self.forward_flash(&qkv, dims, mask)?,
            None => self.forward_dense(&qkv, dims)?,
        };
        let out = self.c_proj.forward(&y)?;
        self.resid_dropout.forward(&out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        const OP: &str = "CausalSelfAttention::backward";
        let cache = self.cache.take().ok_or(Error::BackwardBeforeForward {
            module: "CausalSelfAttention",
        })?;
        let dims = match &cache {
            AttentionCache::Flash { dims, .. } | AttentionCache::Dense { dims, .. } => *dims,
            #[cfg(feature = "cuda")]
            AttentionCache::Cuda { dims, .. } | AttentionCache::CudaFlash { dims, .. } => *dims,
        };
        let grad_out = self.resid_dropout.backward(grad_output)?;
        let grad_y = self.c_proj.backward(&grad_out)?;
        if grad_y.shape() != [dims.batch, dims.seq, dims.n_embd] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: vec![dims.batch, dims.seq, dims.n_embd],
                rhs: grad_y.shape().to_vec(),
            });
        }
        let grad_qkv = match cache {
            AttentionCache::Flash {
                heads,
                out,
                lse,
                mask,
                dims,
                dtype,
            } => with_float!(OP, dtype, F => {
                // The heads, the output and its gradient are read in place; the `[B, H, T]`
                // log-sum-exps are copied. One thread never read-locks one storage twice:
                // `with_values2` copies its second operand if it shares the first's storage,
                // and a gradient sharing the heads' storage is copied here.
                let device = same_device(OP, &[&heads, &grad_y])?;
                let row_lse = load::<F>(&lse)?;
                drop(lse);
                let shape = [dims.batch, dims.seq, 3 * dims.n_embd];
                let dy_copy = if grad_y.shares_storage(&heads) {
                    Some(Tensor::from_vec_on(load::<F>(&grad_y)?, grad_y.shape(), &device)?)
                } else {
                    None
                };
                let dy_tensor = dy_copy.as_ref().unwrap_or(&grad_y);
                // The heads' gradients go straight into the gradient's (recycled) storage.
                build_overwrite::<F>(&shape, dtype, &device, |g| {
                    with_values::<F, _>(&heads, |heads| {
                        with_values2::<F, _>(dy_tensor, &out, |dy, o| {
                            let operands = (heads, o, &row_lse[..]);
                            flash::backward_into(operands, dy, dims, TILE, mask.as_ref(), g)
                        })
                    })???;
                    Ok(())
                })?
            }),
            AttentionCache::Dense {
                qkv,
                probs,
                dropped_probs,
                dims,
                dtype,
            } => self.backward_dense((&qkv, &probs, &dropped_probs), &grad_y, dims, dtype)?,
            #[cfg(feature = "cuda")]
            AttentionCache::CudaFlash {
                qkv,
                forward,
                mask,
                dims,
            } => crate::kernels::cuda::flash_attention_backward(
                &qkv,
                &forward,
                &grad_y,
                dims.n_head,
                mask,
            )?,
            #[cfg(feature = "cuda")]
            AttentionCache::Cuda { cache, dims } => {
                let attn_dropout = &mut self.attn_dropout;
                crate::kernels::cuda::attention_backward(
                    &cache,
                    &grad_y,
                    dims.n_head,
                    &mut |grad| attn_dropout.backward(grad),
                )?
            }
        };
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
