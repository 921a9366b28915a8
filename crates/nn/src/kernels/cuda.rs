//! The CUDA arms of nn's ops (feature `cuda`): a layer whose tensors are on a CUDA device
//! calls one of these instead of its host kernel (one device check per call, made where the
//! layer already checks that its tensors share a device). Each runs the tensor crate's CUDA
//! kernels and cuBLAS on the tensors' own storage; what they compute is the host layer's
//! maths in f32 (see docs/gpu.md for how far the results may differ).

use hypershard_tensor::cuda::{self as gpu, TokenIndex, Transpose};
use hypershard_tensor::{DType, Device, Tensor};

use crate::{Error, Result};

/// A `[rows, 1]` column of ones on `device`: a GEMM with it broadcasts a bias over rows or
/// sums rows into a bias gradient.
fn ones(rows: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    Ok(Tensor::full(&[rows, 1], 1.0, dtype)?.to_device(device)?)
}

/// `Linear`'s forward on `x: [rows, in]`: `x · Wᵀ (+ b)`, shaped `out_shape`. The bias is
/// the GEMM `ones[rows, 1] · b[1, out]` written first, which the product then adds to.
pub(crate) fn linear_forward(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    out_shape: &[usize],
) -> Result<Tensor> {
    let (rows, n_out) = (x.shape()[0], weight.shape()[0]);
    let device = x.device();
    let y = Tensor::zeros_on(&[rows, n_out], weight.dtype(), &device)?;
    let beta = match bias {
        Some(b) => {
            let column = ones(rows, b.dtype(), &device)?;
            let row = b.reshape(&[1, n_out])?;
            gpu::gemm(1.0, &column, Transpose::No, &row, Transpose::No, 0.0, &y)?;
            1.0
        }
        None => 0.0,
    };
    gpu::gemm(1.0, x, Transpose::No, weight, Transpose::Yes, beta, &y)?;
    Ok(y.reshape(out_shape)?)
}

/// `Linear`'s backward on `x: [rows, in]` and `gy: [rows, out]`: `dx = gy · W` (shaped
/// `input_shape`), and when asked `dW = gyᵀ · x` and `db = gyᵀ · ones`.
pub(crate) fn linear_backward(
    x: &Tensor,
    gy: &Tensor,
    weight: &Tensor,
    [want_weight, want_bias]: [bool; 2],
    input_shape: &[usize],
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    let (rows, n_in, n_out) = (x.shape()[0], x.shape()[1], gy.shape()[1]);
    let (dtype, device) = (weight.dtype(), x.device());
    let dx = Tensor::zeros_on(&[rows, n_in], dtype, &device)?;
    gpu::gemm(1.0, gy, Transpose::No, weight, Transpose::No, 0.0, &dx)?;
    let dw = if want_weight {
        let dw = Tensor::zeros_on(&[n_out, n_in], dtype, &device)?;
        gpu::gemm(1.0, gy, Transpose::Yes, x, Transpose::No, 0.0, &dw)?;
        Some(dw)
    } else {
        None
    };
    let db = if want_bias {
        let db = Tensor::zeros_on(&[n_out, 1], dtype, &device)?;
        let column = ones(rows, dtype, &device)?;
        gpu::gemm(1.0, gy, Transpose::Yes, &column, Transpose::No, 0.0, &db)?;
        Some(db.reshape(&[n_out])?)
    } else {
        None
    };
    Ok((dx.reshape(input_shape)?, dw, db))
}

/// `op(a) · op(b)` through cuBLAS into a new `[m, n]` tensor (strided operands are refused by
/// the device view: a transposed operand is passed as a flag instead).
pub(crate) fn matmul(
    a: &Tensor,
    b: &Tensor,
    options: crate::linalg::MatmulOptions,
    [m, n]: [usize; 2],
) -> Result<Tensor> {
    let flag = |t| if t { Transpose::Yes } else { Transpose::No };
    let c = Tensor::zeros_on(&[m, n], a.dtype(), &a.device())?;
    let (op_a, op_b) = (flag(options.transpose_a), flag(options.transpose_b));
    gpu::gemm(1.0, a, op_a, b, op_b, 0.0, &c)?;
    Ok(c)
}

/// `a + b` (one shape and dtype) in new device memory.
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let out = a.deep_copy()?;
    out.add_(b)?;
    Ok(out)
}

/// ReLU's forward: `max(x, 0)` in new device memory.
pub(crate) fn relu(x: &Tensor) -> Result<Tensor> {
    let y = x.deep_copy()?;
    gpu::relu_(&y)?;
    Ok(y)
}

/// ReLU's backward: `grad` where the input was positive (exactly where the output is).
pub(crate) fn relu_backward(x: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let dx = grad.deep_copy()?;
    gpu::relu_grad_(&dx, x)?;
    Ok(dx)
}

/// The activations with a kernel pair (exact and tanh GELU, SiLU): forward and backward.
pub(crate) use gpu::{Activation, activation, activation_backward};

pub(crate) use gpu::Norm;

/// Dropout's mask applied on the device (f32): `x · scale` with each element's scale drawn
/// from `(seed, index)` exactly as the host's `DropMask` draws it.
pub(crate) fn dropout(x: &Tensor, seed: u64, p: f64, keep_scale: f64) -> Result<Tensor> {
    Ok(gpu::dropout(x, seed, p, keep_scale)?)
}

/// LayerNorm's or RMSNorm's forward: the output, `x̂` and `1/σ` per row.
pub(crate) fn norm(
    kind: Norm,
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<gpu::LayerNormOutput> {
    Ok(gpu::norm(kind, x, weight, bias, eps)?)
}

/// The norm's backward: `[dx, dw, db]` (fresh gradients, which the layer accumulates).
pub(crate) fn norm_backward(
    kind: Norm,
    grad: &Tensor,
    saved: [&Tensor; 2],
    weight: &Tensor,
) -> Result<[Tensor; 3]> {
    let d = weight.numel();
    let device = weight.device();
    let dw = Tensor::zeros_on(&[d], DType::F32, &device)?;
    let db = Tensor::zeros_on(&[d], DType::F32, &device)?;
    let dx = gpu::norm_backward(kind, grad, saved, weight, &dw, Some(&db))?;
    Ok([dx, dw, db])
}

/// Token ids (I64, any shape, any device) checked against a table of `vocab` rows and
/// indexed on `device`.
/// An id out of range is the host layer's [`Error::IndexOutOfRange`] naming `op`.
pub(crate) fn token_index(
    op: &'static str,
    device: &Device,
    ids: &Tensor,
    vocab: usize,
) -> Result<TokenIndex> {
    // `[B, T]` keeps its positions (GPT's position table reads them); any other shape is
    // one row of ids.
    let ids = if ids.ndim() == 2 {
        ids.clone()
    } else {
        ids.reshape(&[ids.numel()])?
    };
    TokenIndex::new(device, &ids, vocab).map_err(|e| match e {
        hypershard_tensor::Error::IndexOutOfRange {
            position,
            index,
            size,
            ..
        } => Error::IndexOutOfRange {
            op,
            position,
            index,
            size,
        },
        other => other.into(),
    })
}

/// `Embedding`'s forward: the rows of `weight` (`[V, C]`) for every id, shaped `[*ids, C]`.
pub(crate) fn embedding(
    weight: &Tensor,
    tokens: &TokenIndex,
    ids_shape: &[usize],
) -> Result<Tensor> {
    let rows = gpu::embedding(weight, None, tokens)?;
    let mut shape = ids_shape.to_vec();
    shape.push(weight.shape()[1]);
    Ok(rows.reshape(&shape)?)
}

/// `Embedding`'s backward: the table's gradient `[V, C]` from the rows' gradient.
pub(crate) fn embedding_backward(
    grad: &Tensor,
    tokens: &TokenIndex,
    weight: &Tensor,
) -> Result<Tensor> {
    let [v, c] = [weight.shape()[0], weight.shape()[1]];
    let grad_table = Tensor::zeros_on(&[v, c], DType::F32, &weight.device())?;
    let rows = grad.reshape(&[grad.numel() / c.max(1), c])?;
    gpu::embedding_backward(&rows, tokens, &grad_table, None)?;
    Ok(grad_table)
}

/// GPT's input `wte[ids] + wpe[t]`, `[B, T, C]`.
pub(crate) fn gpt_embed(wte: &Tensor, wpe: &Tensor, tokens: &TokenIndex) -> Result<Tensor> {
    let [batch, seq] = tokens.shape();
    let c = wte.shape()[1];
    Ok(gpu::embedding(wte, Some(wpe), tokens)?.reshape(&[batch, seq, c])?)
}

/// GPT's embeddings' backward from `g` (`[B, T, C]`): adds the token rows into `head_grad`
/// (the lm_head's `[V, C]` gradient of the tied weight) in place and returns the position
/// table's gradient `[block_size, C]`.
pub(crate) fn gpt_embed_backward(
    g: &Tensor,
    tokens: &TokenIndex,
    head_grad: &Tensor,
    block_size: usize,
) -> Result<Tensor> {
    let c = head_grad.shape()[1];
    let wpe_grad = Tensor::zeros_on(&[block_size, c], DType::F32, &head_grad.device())?;
    let rows = g.reshape(&[g.numel() / c.max(1), c])?;
    gpu::embedding_backward(&rows, tokens, head_grad, Some(&wpe_grad))?;
    Ok(wpe_grad)
}

/// The lm_head: `h[N, C] · wteᵀ`, shaped `[B, T, V]`.
pub(crate) fn gpt_head(
    hidden: &Tensor,
    wte: &Tensor,
    [batch, seq, c, v]: [usize; 4],
) -> Result<Tensor> {
    let h = hidden.reshape(&[batch * seq, c])?;
    let logits = Tensor::zeros_on(&[batch * seq, v], wte.dtype(), &wte.device())?;
    gpu::gemm(1.0, &h, Transpose::No, wte, Transpose::Yes, 0.0, &logits)?;
    Ok(logits.reshape(&[batch, seq, v])?)
}

/// The lm_head's backward from `g` (`[B, T, V]`): `(dwte = gᵀ · h, dh = g · wte)`.
pub(crate) fn gpt_head_backward(
    g: &Tensor,
    hidden: &Tensor,
    wte: &Tensor,
    [batch, seq, c, v]: [usize; 4],
) -> Result<(Tensor, Tensor)> {
    let n = batch * seq;
    let (g, h) = (g.reshape(&[n, v])?, hidden.reshape(&[n, c])?);
    let device = wte.device();
    let dw = Tensor::zeros_on(&[v, c], wte.dtype(), &device)?;
    gpu::gemm(1.0, &g, Transpose::Yes, &h, Transpose::No, 0.0, &dw)?;
    let dh = Tensor::zeros_on(&[n, c], wte.dtype(), &device)?;
    gpu::gemm(1.0, &g, Transpose::No, wte, Transpose::No, 0.0, &dh)?;
    Ok((dw, dh.reshape(&[batch, seq, c])?))
}

/// What the dense attention's backward needs: the heads `[B·H, T, D]`, the weights
/// `[B·H, T, T]`, and the weights after the dropout child (the same tensor without dropout).
pub(crate) struct AttentionCache {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor,
    dropped: Tensor,
}

/// `[B, T, C, H]` of the fused projection `[B, T, 3C]`, with the softmax scale `1/√D` (in
/// f64, as the host attention computes it).
fn attention_dims(qkv: &Tensor, n_head: usize) -> ([usize; 4], f64) {
    let (batch, seq, c) = (qkv.shape()[0], qkv.shape()[1], qkv.shape()[2] / 3);
    let d = c / n_head.max(1);
    ([batch, seq, c, n_head], 1.0 / (d as f64).sqrt())
}

/// The attention weights' dropout: the `attn_dropout` child's forward or backward on a
/// `[B, H, T, T]` tensor (as the host's materialised path hands it over).
pub(crate) type WeightsDropout<'a> = &'a mut dyn FnMut(&Tensor) -> Result<Tensor>;

/// `f` on `t` (`[B·H, T, T]`) viewed as `[B, H, T, T]`, the result back as a contiguous
/// `[B·H, T, T]`.
fn through_dropout(
    f: WeightsDropout<'_>,
    t: &Tensor,
    [batch, heads, seq]: [usize; 3],
) -> Result<Tensor> {
    let out = f(&t.view(&[batch, heads, seq, seq])?)?;
    Ok(out.contiguous()?.view(&[batch * heads, seq, seq])?)
}

/// Causal self-attention from the fused projection `qkv` (`[B, T, 3C]`): `dropout(softmax(q
/// kᵀ/√D + mask)) v` per head through batched GEMMs, the causal softmax kernel and the
/// `dropout` child, merged to `[B, T, C]`. The `[B·H, T, T]` weights (and the dropped ones)
/// are kept for backward. The dropout's mask counts over the `[B, H, T, T]` weights in
/// row-major order, as the host's tiled kernel draws it.
pub(crate) fn attention(
    qkv: &Tensor,
    n_head: usize,
    dropout: WeightsDropout<'_>,
) -> Result<(Tensor, AttentionCache)> {
    let ([batch, seq, c, h], scale) = attention_dims(qkv, n_head);
    let device = qkv.device();
    let (q, k, v) = (
        gpu::split_heads(qkv, 0, 3, h)?,
        gpu::split_heads(qkv, 1, 3, h)?,
        gpu::split_heads(qkv, 2, 3, h)?,
    );
    let bh = batch * h;
    let probs = Tensor::zeros_on(&[bh, seq, seq], DType::F32, &device)?;
    gpu::gemm_strided_batched(1.0, &q, Transpose::No, &k, Transpose::Yes, 0.0, &probs)?;
    gpu::causal_softmax_(&probs, scale)?;
    let dropped = through_dropout(dropout, &probs, [batch, h, seq])?;
    let heads = Tensor::zeros_on(&[bh, seq, c / h], DType::F32, &device)?;
    gpu::gemm_strided_batched(1.0, &dropped, Transpose::No, &v, Transpose::No, 0.0, &heads)?;
    let y = Tensor::zeros_on(&[batch, seq, c], DType::F32, &device)?;
    gpu::merge_heads(&heads, &y, 0, 1, h)?;
    Ok((
        y,
        AttentionCache {
            q,
            k,
            v,
            probs,
            dropped,
        },
    ))
}

/// The attention's backward from the gradient of its output (`[B, T, C]`), with `dropout`
/// the child's backward: the gradient of the fused projection, `[B, T, 3C]`.
pub(crate) fn attention_backward(
    cache: &AttentionCache,
    grad_y: &Tensor,
    n_head: usize,
    dropout: WeightsDropout<'_>,
) -> Result<Tensor> {
    let AttentionCache {
        q,
        k,
        v,
        probs,
        dropped,
    } = cache;
    let (batch, seq, c) = (grad_y.shape()[0], grad_y.shape()[1], grad_y.shape()[2]);
    let h = n_head;
    let (bh, d) = (batch * h, c / h.max(1));
    let scale = 1.0 / (d as f64).sqrt();
    let device = grad_y.device();
    let zeros = |shape: &[usize]| Tensor::zeros_on(shape, DType::F32, &device);
    let dy = gpu::split_heads(&grad_y.contiguous()?, 0, 1, h)?;
    let grad_dropped = zeros(&[bh, seq, seq])?;
    gpu::gemm_strided_batched(
        1.0,
        &dy,
        Transpose::No,
        v,
        Transpose::Yes,
        0.0,
        &grad_dropped,
    )?;
    let dv = zeros(&[bh, seq, d])?;
    gpu::gemm_strided_batched(1.0, dropped, Transpose::Yes, &dy, Transpose::No, 0.0, &dv)?;
    let dp = through_dropout(dropout, &grad_dropped, [batch, h, seq])?;
    gpu::causal_softmax_backward_(&dp, probs, scale)?;
    let dq = zeros(&[bh, seq, d])?;
    gpu::gemm_strided_batched(1.0, &dp, Transpose::No, k, Transpose::No, 0.0, &dq)?;
    let dk = zeros(&[bh, seq, d])?;
    gpu::gemm_strided_batched(1.0, &dp, Transpose::Yes, q, Transpose::No, 0.0, &dk)?;
    let dqkv = zeros(&[batch, seq, 3 * c])?;
    for (part, grad) in [&dq, &dk, &dv].into_iter().enumerate() {
        gpu::merge_heads(grad, &dqkv, part, 3, h)?;
    }
    Ok(dqkv)
}

/// The tiled causal attention of the fused projection (`[B, T, 3C]`, f32) with the weights'
/// dropout `mask`: the output `[B, T, C]` and what the backward needs.
pub(crate) fn flash_attention(
    qkv: &Tensor,
    n_head: usize,
    mask: Option<crate::dropout::DropMask>,
) -> Result<gpu::FlashForward> {
    Ok(gpu::flash_attention(qkv, n_head, flash_dropout(mask))?)
}

/// The gradient of the fused projection from the output's, for [`flash_attention`].
pub(crate) fn flash_attention_backward(
    qkv: &Tensor,
    forward: &gpu::FlashForward,
    grad_y: &Tensor,
    n_head: usize,
    mask: Option<crate::dropout::DropMask>,
) -> Result<Tensor> {
    Ok(gpu::flash_attention_backward(
        qkv,
        forward,
        &grad_y.contiguous()?,
        n_head,
        flash_dropout(mask),
    )?)
}

fn flash_dropout(mask: Option<crate::dropout::DropMask>) -> Option<gpu::FlashDropout> {
    mask.map(|mask| {
        let (seed, p, keep_scale) = mask.parameters();
        gpu::FlashDropout {
            seed,
            p,
            keep_scale,
        }
    })
}

/// Cross-entropy of f32 logits against I64 targets: `(mean loss, ∂loss/∂logits)`. A target
/// out of range is the host loss's [`Error::TargetOutOfRange`].
pub(crate) fn cross_entropy(
    op: &'static str,
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
) -> Result<(f64, Tensor)> {
    match gpu::cross_entropy(logits, targets, ignore_index) {
        Ok(out) => Ok((out.loss, out.grad)),
        Err(hypershard_tensor::Error::IndexOutOfRange {
            position,
            index,
            size,
            ..
        }) => Err(Error::TargetOutOfRange {
            op,
            position,
            target: index,
            classes: size,
        }),
        Err(other) => Err(other.into()),
    }
}

/// `Σ x²` over a contiguous tensor on a CUDA device, as the GEMM `x[1, n] · xᵀ` into an f32
/// scalar (cuBLAS accumulates in f32, as torch's norms on a GPU do). An empty tensor (a
/// rank's empty shard of an uneven split) sums to zero, as on the host.
pub(crate) fn sum_of_squares(x: &Tensor) -> Result<f64> {
    let n = x.numel();
    if n == 0 {
        return Ok(0.0);
    }
    let row = x.reshape(&[1, n])?;
    let sum = Tensor::zeros_on(&[1, 1], DType::F32, &x.device())?;
    gpu::gemm(1.0, &row, Transpose::No, &row, Transpose::Yes, 0.0, &sum)?;
    let sum = sum.to_host()?.to_vec::<f32>()?;
    Ok(f64::from(sum.first().copied().unwrap_or(f32::NAN)))
}

/// The mean squared error and its gradient: `d = p − t` (one `axpy` in the dtype's compute
/// precision), `Σd²` by [`sum_of_squares`], and `2d/n`.
pub(crate) fn mse_loss(prediction: &Tensor, target: &Tensor) -> Result<(f64, Tensor)> {
    let n = prediction.numel();
    let diff = prediction.deep_copy()?;
    diff.axpy(-1.0, target)?;
    // torch gives NaN for an empty input (a mean over nothing); so does 0/0 here.
    let loss = sum_of_squares(&diff)? / n as f64;
    diff.scale_(2.0 / n as f64)?;
    Ok((loss, diff))
}

/// One AdamW step in place on f32 tensors (`step` is the step number, from 1).
/// One general SGD step (momentum and weight decay as `config` says) in place on an f32
/// parameter; `momentum` is the buffer and whether this is its first step.
pub(crate) fn sgd(
    param: &Tensor,
    grad: &Tensor,
    config: &crate::optim::SgdConfig,
    momentum: Option<(&Tensor, bool)>,
) -> Result<()> {
    let step = gpu::SgdStep {
        lr: config.lr,
        weight_decay: config.weight_decay,
    };
    let momentum = momentum.map(|(buffer, first)| gpu::SgdMomentum {
        buffer,
        first,
        momentum: config.momentum,
        dampening: config.dampening,
        nesterov: config.nesterov,
    });
    Ok(gpu::sgd_(param, grad, &step, momentum)?)
}

pub(crate) fn adamw(
    [param, exp_avg, exp_avg_sq, grad]: [&Tensor; 4],
    config: &crate::optim::AdamWConfig,
    step: u64,
) -> Result<()> {
    let step = std::num::NonZeroU64::new(step).ok_or(Error::InvalidConfig {
        op: "AdamW::step",
        field: "step",
        value: 0.0,
        reason: "steps count from 1",
    })?;
    let update = gpu::AdamWStep {
        lr: config.lr,
        betas: config.betas,
        eps: config.eps,
        weight_decay: config.weight_decay,
        step,
    };
    Ok(gpu::adamw_(param, exp_avg, exp_avg_sq, grad, &update)?)
}
