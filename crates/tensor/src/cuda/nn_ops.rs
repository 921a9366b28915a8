//! The device operations of a GPT's layers (for hypershard-nn's `DeviceGpt`), f32 only: layer
//! norm, exact GELU, the causal softmax of attention, attention's head split and merge, the
//! token and position embeddings, cross-entropy, and an AdamW step; each with its backward.
//!
//! Every operation checks dtypes, shapes and (for token ids and class targets) index ranges on
//! the host, then launches the kernels of kernels.cu that follow hypershard-nn's CPU code step
//! by step (see the comments there). No kernel uses atomics, so every result is the same from
//! run to run: the embedding gradient is a gather over a host-built index of each token's
//! positions rather than a scatter.

use cudarc::driver::PushKernelArg;

use super::CudaDevice;
#[cfg(test)]
use super::KERNEL_NAMES;
use super::error::{CudaError, CudaResult, driver};
use super::kernels::{launch_config, row_launch_config};
use super::tensor::CudaTensor;
use crate::{DType, Tensor};

/// The kernels this module launches (all in [`KERNEL_NAMES`]; a unit test checks).
const LAYER_NORM: &str = "layer_norm_f32";
const LAYER_NORM_BACKWARD: &str = "layer_norm_backward_f32";
const LAYER_NORM_PARAM_GRAD: &str = "layer_norm_param_grad_f32";
const GELU: &str = "gelu_f32";
const GELU_GRAD: &str = "gelu_grad_f32";
const CAUSAL_SOFTMAX: &str = "causal_softmax_f32";
const CAUSAL_SOFTMAX_BACKWARD: &str = "causal_softmax_backward_f32";
const CROSS_ENTROPY: &str = "cross_entropy_f32";
const EMBEDDING: &str = "embedding_f32";
const EMBEDDING_BACKWARD: &str = "embedding_backward_f32";
const POSITION_BACKWARD: &str = "position_backward_f32";
const SPLIT_HEADS: &str = "split_heads_f32";
const MERGE_HEADS: &str = "merge_heads_f32";
const ADAMW: &str = "adamw_f32";

#[cfg(test)]
const ALL: &[&str] = &[
    LAYER_NORM,
    LAYER_NORM_BACKWARD,
    LAYER_NORM_PARAM_GRAD,
    GELU,
    GELU_GRAD,
    CAUSAL_SOFTMAX,
    CAUSAL_SOFTMAX_BACKWARD,
    CROSS_ENTROPY,
    EMBEDDING,
    EMBEDDING_BACKWARD,
    POSITION_BACKWARD,
    SPLIT_HEADS,
    MERGE_HEADS,
    ADAMW,
];

/// Errors unless `t` is f32 (the only dtype these kernels have).
fn check_f32(op: &'static str, t: &CudaTensor) -> CudaResult<()> {
    if t.dtype == DType::F32 {
        Ok(())
    } else {
        Err(CudaError::UnsupportedDType {
            op,
            from: t.dtype,
            to: t.dtype,
        })
    }
}

/// Errors unless `t` has exactly `shape`.
fn check_shape(op: &'static str, t: &CudaTensor, shape: &[usize]) -> CudaResult<()> {
    if t.shape == shape {
        Ok(())
    } else {
        Err(CudaError::ShapeMismatch {
            op,
            lhs: shape.to_vec(),
            rhs: t.shape.clone(),
        })
    }
}

/// `(rows, width)` of a tensor read as rows of its last dim; the width must be `width`.
fn rows_of(op: &'static str, t: &CudaTensor, width: usize) -> CudaResult<usize> {
    match t.shape.last() {
        Some(&last) if last == width => Ok(t.numel.checked_div(width).unwrap_or(0)),
        _ => Err(CudaError::ShapeMismatch {
            op,
            lhs: vec![width],
            rhs: t.shape.clone(),
        }),
    }
}

/// Launches kernel `$name` of `$device` with `$config`, after `$push` has pushed its arguments
/// onto the launch builder `$l`; evaluates to `CudaResult<()>`. (A macro rather than a
/// function: the builder borrows the kernel table, which must live in the caller's frame.)
macro_rules! launch {
    ($op:expr, $device:expr, $name:expr, $config:expr, |$l:ident| $push:block) => {{
        let device: &CudaDevice = $device;
        match device.kernels($op) {
            Err(error) => Err(error),
            Ok(kernels) => match kernels.function($op, $name) {
                Err(error) => Err(error),
                Ok(function) => {
                    let stream = device.stream();
                    let mut $l = stream.launch_builder(function);
                    $push
                    // SAFETY: every caller pushes exactly the arguments its kernel declares in
                    // kernels.cu, in order and with the declared types (device buffers as
                    // `CudaSlice`s, `u64` counts, `u32` flags, `f32` scalars), after checking
                    // on the host that each buffer holds the elements the kernel reads or
                    // writes for those counts (stated at each call). The buffers are borrowed
                    // by the caller (the written ones exclusively) until the launch is ordered
                    // on the stream, and cudarc frees memory on the same stream, so none is
                    // freed while the kernel runs. Tested by the device tests of
                    // crates/nn/tests/cuda_gpt.rs (each kernel against the CPU op).
                    unsafe { $l.launch($config) }
                        .map(|_| ())
                        .map_err(driver($op, "cuLaunchKernel"))
                }
            },
        }
    }};
}

/// What a layer norm's forward gives: the output and what its backward needs.
#[derive(Debug)]
pub struct LayerNormOutput {
    /// `x̂ · w + b`, the input's shape.
    pub out: CudaTensor,
    /// The normalised input `x̂ = (x − mean) · r`, the input's shape.
    pub xhat: CudaTensor,
    /// `r = 1/√(var + eps)` per row, `[rows]`.
    pub rstd: CudaTensor,
}

/// torch's LayerNorm over the last dim of `x` (f32), as hypershard-nn's CPU `LayerNorm`:
/// `weight` and `bias` are `[d]` with `d` the last dim, the variance biased, `eps` rounded to
/// f32 as the CPU does.
pub fn layer_norm(
    x: &CudaTensor,
    weight: &CudaTensor,
    bias: Option<&CudaTensor>,
    eps: f64,
) -> CudaResult<LayerNormOutput> {
    const OP: &str = "cuda::layer_norm";
    check_f32(OP, x)?;
    check_f32(OP, weight)?;
    let d = weight.numel;
    check_shape(OP, weight, &[d])?;
    if let Some(bias) = bias {
        check_f32(OP, bias)?;
        check_shape(OP, bias, &[d])?;
        x.device.check_same(OP, &bias.device)?;
    }
    x.device.check_same(OP, &weight.device)?;
    let rows = rows_of(OP, x, d)?;
    let mut out = x.output(OP, &x.shape, DType::F32)?;
    let mut xhat = x.output(OP, &x.shape, DType::F32)?;
    let mut rstd = CudaTensor::zeros(&x.device, &[rows], DType::F32)?;
    let Some(config) = row_launch_config(if d == 0 { 0 } else { rows }) else {
        // No rows, or rows of width 0: nothing to normalise (the outputs are empty), and the
        // CPU leaves no statistics either; `rstd` stays zero.
        return Ok(LayerNormOutput { out, xhat, rstd });
    };
    let (rows64, d64) = (rows as u64, d as u64);
    let inv_d = (1.0 / d as f64) as f32;
    let eps = eps as f32;
    let has_bias = u32::from(bias.is_some());
    // Checked: x, out, xhat hold rows·d f32; rstd holds rows; weight (and bias) hold d. Without
    // a bias the kernel never reads `b`, and the weight's pointer stands in for it.
    launch!(OP, &x.device, LAYER_NORM, config, |l| {
        l.arg(&mut out.data)
            .arg(&mut xhat.data)
            .arg(&mut rstd.data)
            .arg(&x.data)
            .arg(&weight.data)
            .arg(&bias.unwrap_or(weight).data)
            .arg(&has_bias)
            .arg(&rows64)
            .arg(&d64)
            .arg(&inv_d)
            .arg(&eps);
    })?;
    Ok(LayerNormOutput { out, xhat, rstd })
}

/// LayerNorm's backward from `grad` (the output's gradient) and the forward's `x̂` and `r`:
/// accumulates `grad_weight += Σ g·x̂` and `grad_bias += Σ g` (each column summed over the rows
/// in order, as the CPU does) and returns the input gradient.
pub fn layer_norm_backward(
    grad: &CudaTensor,
    saved: &LayerNormOutput,
    weight: &CudaTensor,
    grad_weight: &mut CudaTensor,
    grad_bias: Option<&mut CudaTensor>,
) -> CudaResult<CudaTensor> {
    const OP: &str = "cuda::layer_norm_backward";
    for t in [grad, &saved.xhat, &saved.rstd, weight, &*grad_weight] {
        check_f32(OP, t)?;
        grad.device.check_same(OP, &t.device)?;
    }
    let d = weight.numel;
    check_shape(OP, weight, &[d])?;
    check_shape(OP, grad_weight, &[d])?;
    check_shape(OP, grad, &saved.xhat.shape)?;
    let rows = rows_of(OP, grad, d)?;
    check_shape(OP, &saved.rstd, &[rows])?;
    if let Some(grad_bias) = &grad_bias {
        check_f32(OP, grad_bias)?;
        check_shape(OP, grad_bias, &[d])?;
        grad.device.check_same(OP, &grad_bias.device)?;
    }
    let mut dx = grad.output(OP, &grad.shape, DType::F32)?;
    let rows = if d == 0 { 0 } else { rows };
    let (rows64, d64) = (rows as u64, d as u64);
    if let Some(config) = row_launch_config(rows) {
        let inv_d = (1.0 / d as f64) as f32;
        // Checked: grad, xhat, dx hold rows·d f32, rstd holds rows, weight holds d.
        launch!(OP, &grad.device, LAYER_NORM_BACKWARD, config, |l| {
            l.arg(&mut dx.data)
                .arg(&grad.data)
                .arg(&saved.xhat.data)
                .arg(&saved.rstd.data)
                .arg(&weight.data)
                .arg(&rows64)
                .arg(&d64)
                .arg(&inv_d);
        })?;
    }
    if let Some(config) = launch_config(OP, if rows == 0 { 0 } else { d }, 1)? {
        let has_bias = u32::from(grad_bias.is_some());
        let null = 0u64;
        // Checked: grad and xhat hold rows·d f32, grad_weight (and grad_bias) hold d. Without
        // a bias the kernel never touches `db`, which is passed as a null pointer.
        launch!(OP, &grad.device, LAYER_NORM_PARAM_GRAD, config, |l| {
            l.arg(&mut grad_weight.data);
            match grad_bias {
                Some(grad_bias) => l.arg(&mut grad_bias.data),
                None => l.arg(&null),
            };
            l.arg(&grad.data)
                .arg(&saved.xhat.data)
                .arg(&has_bias)
                .arg(&rows64)
                .arg(&d64);
        })?;
    }
    Ok(dx)
}

/// The exact GELU `x · Φ(x)` of every element (f32), with the CPU's own `erf` and `exp`
/// approximations, so each element rounds as on the CPU.
pub fn gelu(x: &CudaTensor) -> CudaResult<CudaTensor> {
    const OP: &str = "cuda::gelu";
    check_f32(OP, x)?;
    let mut y = x.output(OP, &x.shape, DType::F32)?;
    if let Some(config) = launch_config(OP, x.numel, 1)? {
        let n = x.numel as u64;
        // Checked: x and y hold n f32.
        launch!(OP, &x.device, GELU, config, |l| {
            l.arg(&mut y.data).arg(&x.data).arg(&n);
        })?;
    }
    Ok(y)
}

/// GELU's backward: `grad · (Φ(x) + x·φ(x))` for the forward's input `x`.
pub fn gelu_backward(x: &CudaTensor, grad: &CudaTensor) -> CudaResult<CudaTensor> {
    const OP: &str = "cuda::gelu_backward";
    check_f32(OP, x)?;
    x.device.check_same(OP, &grad.device)?;
    grad.check_like(OP, &x.shape, DType::F32)?;
    let mut dx = x.output(OP, &x.shape, DType::F32)?;
    if let Some(config) = launch_config(OP, x.numel, 1)? {
        let n = x.numel as u64;
        // Checked: x, grad and dx hold n f32.
        launch!(OP, &x.device, GELU_GRAD, config, |l| {
            l.arg(&mut dx.data).arg(&grad.data).arg(&x.data).arg(&n);
        })?;
    }
    Ok(dx)
}

/// The `T` of attention scores `[.., T, T]` (at least 2-D, square in the last two dims).
fn square_rows(op: &'static str, t: &CudaTensor) -> CudaResult<(usize, usize)> {
    match t.shape.as_slice() {
        [.., r, c] if r == c => Ok((t.numel.checked_div(*c).unwrap_or(0), *c)),
        other => Err(CudaError::ShapeMismatch {
            op,
            lhs: vec![0, 0],
            rhs: other.to_vec(),
        }),
    }
}

/// The causal softmax of attention scores `[.., T, T]` in place: row `i` of each `T × T`
/// matrix becomes `softmax(scale · s[i, 0..=i])` and exactly 0 beyond `i`, as the CPU's
/// attention does (`scale` rounded to f32).
pub fn causal_softmax_(scores: &mut CudaTensor, scale: f64) -> CudaResult<()> {
    const OP: &str = "cuda::causal_softmax_";
    check_f32(OP, scores)?;
    let (rows, t) = square_rows(OP, scores)?;
    let Some(config) = row_launch_config(rows) else {
        return Ok(());
    };
    let (rows64, t64, scale) = (rows as u64, t as u64, scale as f32);
    let device = scores.device.clone();
    // Checked: scores holds rows·t f32, rows a multiple of t (whole T × T matrices).
    launch!(OP, &device, CAUSAL_SOFTMAX, config, |l| {
        l.arg(&mut scores.data).arg(&rows64).arg(&t64).arg(&scale);
    })
}

/// The causal softmax's backward in place on `grad` (the gradient of its output `probs`):
/// `grad = scale · probs ⊙ (grad − Σ_row grad ⊙ probs)`, the gradient of the unscaled scores.
pub fn causal_softmax_backward_(
    grad: &mut CudaTensor,
    probs: &CudaTensor,
    scale: f64,
) -> CudaResult<()> {
    const OP: &str = "cuda::causal_softmax_backward_";
    check_f32(OP, probs)?;
    grad.device.check_same(OP, &probs.device)?;
    grad.check_like(OP, &probs.shape, DType::F32)?;
    let (rows, t) = square_rows(OP, probs)?;
    let Some(config) = row_launch_config(rows) else {
        return Ok(());
    };
    let (rows64, t64, scale) = (rows as u64, t as u64, scale as f32);
    let device = grad.device.clone();
    // Checked: grad and probs hold rows·t f32.
    launch!(OP, &device, CAUSAL_SOFTMAX_BACKWARD, config, |l| {
        l.arg(&mut grad.data)
            .arg(&probs.data)
            .arg(&rows64)
            .arg(&t64)
            .arg(&scale);
    })
}

/// `(batch, seq, parts · C)` checks of a head split or merge; returns the head width.
fn head_dims(
    op: &'static str,
    rows: &CudaTensor,
    part: usize,
    parts: usize,
    n_head: usize,
) -> CudaResult<[usize; 4]> {
    check_f32(op, rows)?;
    let &[batch, seq, width] = rows.shape.as_slice() else {
        return Err(CudaError::ShapeMismatch {
            op,
            lhs: vec![0, 0, parts],
            rhs: rows.shape.clone(),
        });
    };
    let c = width.checked_div(parts).unwrap_or(0);
    if parts == 0 || part >= parts || n_head == 0 || c * parts != width || c % n_head != 0 {
        return Err(CudaError::ShapeMismatch {
            op,
            lhs: vec![batch, seq, parts, n_head],
            rhs: rows.shape.clone(),
        });
    }
    Ok([batch, seq, n_head, c / n_head])
}

/// Part `part` of `parts` of every row of `rows` (`[B, T, parts · C]`, the fused q, k, v
/// projection has 3 parts), split into `n_head` heads: a new `[B · n_head, T, C / n_head]`.
pub fn split_heads(
    rows: &CudaTensor,
    part: usize,
    parts: usize,
    n_head: usize,
) -> CudaResult<CudaTensor> {
    const OP: &str = "cuda::split_heads";
    let [batch, seq, h, hd] = head_dims(OP, rows, part, parts, n_head)?;
    let mut heads = rows.output(OP, &[batch * h, seq, hd], DType::F32)?;
    if let Some(config) = launch_config(OP, heads.numel, 1)? {
        let args = [batch, seq, h, hd, part, parts].map(|v| v as u64);
        // Checked: heads holds B·H·T·D f32 and rows B·T·parts·H·D; the kernel's index map
        // stays inside both for part < parts.
        launch!(OP, &rows.device, SPLIT_HEADS, config, |l| {
            l.arg(&mut heads.data).arg(&rows.data);
            for v in &args {
                l.arg(v);
            }
        })?;
    }
    Ok(heads)
}

/// The inverse of [`split_heads`]: writes `heads` (`[B · n_head, T, C / n_head]`) into part
/// `part` of every row of `rows` (`[B, T, parts · C]`), leaving the other parts as they are.
pub fn merge_heads(
    heads: &CudaTensor,
    rows: &mut CudaTensor,
    part: usize,
    parts: usize,
    n_head: usize,
) -> CudaResult<()> {
    const OP: &str = "cuda::merge_heads";
    let [batch, seq, h, hd] = head_dims(OP, rows, part, parts, n_head)?;
    rows.device.check_same(OP, &heads.device)?;
    heads.check_like(OP, &[batch * h, seq, hd], DType::F32)?;
    let Some(config) = launch_config(OP, heads.numel, 1)? else {
        return Ok(());
    };
    let args = [batch, seq, h, hd, part, parts].map(|v| v as u64);
    let device = rows.device.clone();
    // Checked as in `split_heads`.
    launch!(OP, &device, MERGE_HEADS, config, |l| {
        l.arg(&mut rows.data).arg(&heads.data);
        for v in &args {
            l.arg(v);
        }
    })
}

/// Token ids `[B, T]` checked against a vocabulary and uploaded, with the index the embedding
/// backward needs: for each vocabulary row, its positions in increasing order (a stable
/// counting sort on the host), so the gradient is a gather with a fixed order instead of a
/// scatter with atomics.
#[derive(Debug)]
pub struct TokenIndex {
    ids: CudaTensor,
    offsets: CudaTensor,
    order: CudaTensor,
    batch: usize,
    seq: usize,
    vocab: usize,
}

/// The counting sort of `rows` (each below `vocab`): `offsets[v]..offsets[v + 1]` are the
/// entries of `order` holding, in increasing order, the positions `p` with `rows[p] == v`.
pub(crate) fn positions_by_row(rows: &[usize], vocab: usize) -> (Vec<i64>, Vec<i64>) {
    let mut offsets = vec![0i64; vocab + 1];
    for &row in rows {
        offsets[row + 1] += 1;
    }
    for v in 0..vocab {
        offsets[v + 1] += offsets[v];
    }
    let mut next: Vec<i64> = offsets[..vocab].to_vec();
    let mut order = vec![0i64; rows.len()];
    for (position, &row) in rows.iter().enumerate() {
        order[next[row] as usize] = position as i64;
        next[row] += 1;
    }
    (offsets, order)
}

/// The ids of an I64 tensor as rows of a table of `size`, or the first out of range.
pub(crate) fn checked_rows(op: &'static str, ids: &[i64], size: usize) -> CudaResult<Vec<usize>> {
    ids.iter()
        .enumerate()
        .map(|(position, &index)| {
            usize::try_from(index).ok().filter(|&row| row < size).ok_or(
                CudaError::IndexOutOfRange {
                    op,
                    position,
                    index,
                    size,
                },
            )
        })
        .collect()
}

impl TokenIndex {
    /// Checks `ids` (I64 `[B, T]`, each in `0..vocab`) and uploads them with their index.
    pub fn new(device: &CudaDevice, ids: &Tensor, vocab: usize) -> CudaResult<TokenIndex> {
        const OP: &str = "cuda::TokenIndex::new";
        if ids.dtype() != DType::I64 {
            return Err(CudaError::DTypeMismatch {
                op: OP,
                lhs: DType::I64,
                rhs: ids.dtype(),
            });
        }
        let &[batch, seq] = ids.shape() else {
            return Err(CudaError::ShapeMismatch {
                op: OP,
                lhs: vec![0, 0],
                rhs: ids.shape().to_vec(),
            });
        };
        let values = ids.to_vec::<i64>()?;
        let rows = checked_rows(OP, &values, vocab)?;
        let (offsets, order) = positions_by_row(&rows, vocab);
        let upload = |v: &[i64]| -> CudaResult<CudaTensor> {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            CudaTensor::from_bytes(device, &bytes, &[v.len()], DType::I64)
        };
        Ok(TokenIndex {
            ids: upload(&values)?,
            offsets: upload(&offsets)?,
            order: upload(&order)?,
            batch,
            seq,
            vocab,
        })
    }

    /// `[B, T]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.batch, self.seq]
    }

    /// The vocabulary size the ids were checked against.
    pub fn vocab(&self) -> usize {
        self.vocab
    }
}

/// Checks a `[rows, c]` table of the index's device; returns `rows`.
fn table(op: &'static str, t: &CudaTensor, index: &TokenIndex) -> CudaResult<[usize; 2]> {
    check_f32(op, t)?;
    index.ids.device.check_same(op, &t.device)?;
    match t.shape.as_slice() {
        &[rows, c] => Ok([rows, c]),
        other => Err(CudaError::ShapeMismatch {
            op,
            lhs: vec![0, 0],
            rhs: other.to_vec(),
        }),
    }
}

/// GPT's input: `wte[ids[b, t]] + wpe[t]` for every position, `[B · T, C]` (f32 tables
/// `wte: [V, C]` with `V` the index's vocabulary and `wpe: [P, C]` with `T ≤ P`).
pub fn embedding(
    wte: &CudaTensor,
    wpe: &CudaTensor,
    tokens: &TokenIndex,
) -> CudaResult<CudaTensor> {
    const OP: &str = "cuda::embedding";
    let [v, c] = table(OP, wte, tokens)?;
    let [p, pc] = table(OP, wpe, tokens)?;
    if v != tokens.vocab || pc != c || tokens.seq > p {
        return Err(CudaError::ShapeMismatch {
            op: OP,
            lhs: wte.shape.clone(),
            rhs: wpe.shape.clone(),
        });
    }
    let n = tokens.batch * tokens.seq;
    let mut out = wte.output(OP, &[n, c], DType::F32)?;
    if let Some(config) = launch_config(OP, n * c, 1)? {
        let (n64, seq64, c64) = (n as u64, tokens.seq as u64, c as u64);
        // Checked: ids holds n entries, each below V (TokenIndex::new), wte V·c f32, wpe P·c
        // with every position's t = n mod seq < seq ≤ P, out n·c.
        launch!(OP, &wte.device, EMBEDDING, config, |l| {
            l.arg(&mut out.data)
                .arg(&wte.data)
                .arg(&wpe.data)
                .arg(&tokens.ids.data)
                .arg(&n64)
                .arg(&seq64)
                .arg(&c64);
        })?;
    }
    Ok(out)
}

/// The embeddings' backward from `grad` (`[B · T, C]`): `grad_wte[v] += Σ grad[p]` over the
/// positions `p` of token `v`, in increasing order, and `grad_wpe[t] += Σ_b grad[b, t]`.
pub fn embedding_backward(
    grad: &CudaTensor,
    tokens: &TokenIndex,
    grad_wte: &mut CudaTensor,
    grad_wpe: &mut CudaTensor,
) -> CudaResult<()> {
    const OP: &str = "cuda::embedding_backward";
    let [v, c] = table(OP, grad_wte, tokens)?;
    let [p, pc] = table(OP, grad_wpe, tokens)?;
    let n = tokens.batch * tokens.seq;
    check_f32(OP, grad)?;
    check_shape(OP, grad, &[n, c])?;
    grad.device.check_same(OP, &grad_wte.device)?;
    if v != tokens.vocab || pc != c || tokens.seq > p {
        return Err(CudaError::ShapeMismatch {
            op: OP,
            lhs: grad_wte.shape.clone(),
            rhs: grad_wpe.shape.clone(),
        });
    }
    if let Some(config) = launch_config(OP, v * c, 1)? {
        let (v64, c64) = (v as u64, c as u64);
        // Checked: offsets holds V + 1 nondecreasing entries ending at n, order n positions
        // below n (positions_by_row), grad n·c f32, grad_wte V·c.
        launch!(OP, &grad.device, EMBEDDING_BACKWARD, config, |l| {
            l.arg(&mut grad_wte.data)
                .arg(&grad.data)
                .arg(&tokens.offsets.data)
                .arg(&tokens.order.data)
                .arg(&v64)
                .arg(&c64);
        })?;
    }
    if let Some(config) = launch_config(OP, tokens.seq * c, 1)? {
        let (b64, seq64, c64) = (tokens.batch as u64, tokens.seq as u64, c as u64);
        // Checked: grad holds B·T·c f32, grad_wpe P·c with T ≤ P (the kernel writes rows < T).
        launch!(OP, &grad.device, POSITION_BACKWARD, config, |l| {
            l.arg(&mut grad_wpe.data)
                .arg(&grad.data)
                .arg(&b64)
                .arg(&seq64)
                .arg(&c64);
        })?;
    }
    Ok(())
}

/// A cross-entropy's mean loss (read back) and the gradient of the logits (on the device).
#[derive(Debug)]
pub struct CrossEntropyOutput {
    /// The mean over the counted targets (NaN when every target is ignored, as torch).
    pub loss: f64,
    /// `∂loss/∂logits`, the logits' shape.
    pub grad: CudaTensor,
}

/// Cross-entropy of f32 `logits` `[*, V]` against I64 `targets` `[*]`, averaged over the
/// targets other than `ignore_index`, as hypershard-nn's CPU `cross_entropy`: the row losses
/// are computed in f64 on the device and summed in row order on the host.
pub fn cross_entropy(
    logits: &CudaTensor,
    targets: &Tensor,
    ignore_index: i64,
) -> CudaResult<CrossEntropyOutput> {
    const OP: &str = "cuda::cross_entropy";
    check_f32(OP, logits)?;
    if targets.dtype() != DType::I64 {
        return Err(CudaError::DTypeMismatch {
            op: OP,
            lhs: DType::I64,
            rhs: targets.dtype(),
        });
    }
    let Some((&classes, leading)) = logits.shape.split_last() else {
        return Err(CudaError::ShapeMismatch {
            op: OP,
            lhs: vec![0],
            rhs: logits.shape.clone(),
        });
    };
    if leading != targets.shape() {
        return Err(CudaError::ShapeMismatch {
            op: OP,
            lhs: logits.shape.clone(),
            rhs: targets.shape().to_vec(),
        });
    }
    let labels = targets.to_vec::<i64>()?;
    let rows = labels.len();
    let mut mapped = Vec::with_capacity(rows);
    for (position, &label) in labels.iter().enumerate() {
        if label == ignore_index {
            mapped.push(-1i64);
            continue;
        }
        if !usize::try_from(label).is_ok_and(|class| class < classes) {
            return Err(CudaError::IndexOutOfRange {
                op: OP,
                position,
                index: label,
                size: classes,
            });
        }
        mapped.push(label);
    }
    let counted = mapped.iter().filter(|&&c| c >= 0).count();
    let scale = if counted > 0 {
        1.0 / counted as f64
    } else {
        0.0
    };
    let mut grad = CudaTensor::zeros(&logits.device, &logits.shape, DType::F32)?;
    // Rows of width 0 have no counted target (none is in range), so there is nothing to do.
    let Some(config) = row_launch_config(if classes == 0 { 0 } else { rows }) else {
        return Ok(CrossEntropyOutput {
            loss: 0.0 / counted as f64,
            grad,
        });
    };
    let bytes: Vec<u8> = mapped.iter().flat_map(|x| x.to_le_bytes()).collect();
    let targets = CudaTensor::from_bytes(&logits.device, &bytes, &[rows], DType::I64)?;
    let mut row_loss = CudaTensor::zeros(&logits.device, &[rows], DType::F64)?;
    let (rows64, classes64, scale32) = (rows as u64, classes as u64, scale as f32);
    // Checked: logits and grad hold rows·classes f32, targets rows entries each −1 or below
    // classes, row_loss rows f64.
    launch!(OP, &logits.device, CROSS_ENTROPY, config, |l| {
        l.arg(&mut grad.data)
            .arg(&mut row_loss.data)
            .arg(&logits.data)
            .arg(&targets.data)
            .arg(&rows64)
            .arg(&classes64)
            .arg(&scale32);
    })?;
    let losses = row_loss.to_host()?.to_vec::<f64>()?;
    let mut total = 0.0;
    for (loss, class) in losses.iter().zip(&mapped) {
        if *class >= 0 {
            total += loss;
        }
    }
    Ok(CrossEntropyOutput {
        loss: total / counted as f64,
        grad,
    })
}

/// The hyperparameters of one AdamW step, as hypershard-nn's `AdamWConfig`, with the step
/// number (1 for the first step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// The learning rate.
    pub lr: f64,
    /// `(β₁, β₂)`.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// The step number (the first step is 1).
    pub step: std::num::NonZeroU64,
}

/// One AdamW step in place on an f32 parameter and its f32 moments, from `grad`: the CPU
/// `AdamW`'s update (which runs in f64) in f32, with the bias corrections computed on the
/// host in f64 and rounded once.
pub fn adamw_(
    param: &mut CudaTensor,
    exp_avg: &mut CudaTensor,
    exp_avg_sq: &mut CudaTensor,
    grad: &CudaTensor,
    config: &AdamWStep,
) -> CudaResult<()> {
    const OP: &str = "cuda::adamw_";
    for t in [&*param, &*exp_avg, &*exp_avg_sq, grad] {
        check_f32(OP, t)?;
        param.device.check_same(OP, &t.device)?;
        t.check_like(OP, &param.shape, DType::F32)?;
    }
    let Some(launch_cfg) = launch_config(OP, param.numel, 1)? else {
        return Ok(());
    };
    let (beta1, beta2) = config.betas;
    let exponent = i32::try_from(config.step.get()).unwrap_or(i32::MAX);
    let bias_correction1 = 1.0 - beta1.powi(exponent);
    let bc2_sqrt = (1.0 - beta2.powi(exponent)).sqrt();
    let scalars = [
        1.0 - config.lr * config.weight_decay,
        beta1,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        config.lr / bias_correction1,
        bc2_sqrt,
        config.eps,
    ]
    .map(|v| v as f32);
    let n = param.numel as u64;
    let device = param.device.clone();
    // Checked: param, exp_avg, exp_avg_sq and grad hold n f32 each, distinct allocations
    // (three `&mut` and one `&`).
    launch!(OP, &device, ADAMW, launch_cfg, |l| {
        l.arg(&mut param.data)
            .arg(&mut exp_avg.data)
            .arg(&mut exp_avg_sq.data)
            .arg(&grad.data)
            .arg(&n);
        for v in &scalars {
            l.arg(v);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_exists() {
        for name in ALL {
            assert!(KERNEL_NAMES.contains(name), "{name}");
            assert!(name.ends_with("_f32"), "{name}");
        }
        assert_eq!(ALL.len(), 14);
    }

    #[test]
    fn token_positions_are_grouped_in_order() {
        let rows = [3usize, 0, 3, 1, 3, 0];
        let (offsets, order) = positions_by_row(&rows, 5);
        assert_eq!(offsets, vec![0, 2, 3, 3, 6, 6]);
        assert_eq!(order, vec![1, 5, 3, 0, 2, 4]);
        // Every vocabulary row lists exactly its positions, increasing.
        for v in 0..5 {
            let listed = &order[offsets[v] as usize..offsets[v + 1] as usize];
            let expected: Vec<i64> = (0..rows.len())
                .filter(|&p| rows[p] == v)
                .map(|p| p as i64)
                .collect();
            assert_eq!(listed, expected.as_slice());
        }
        let (offsets, order) = positions_by_row(&[], 2);
        assert_eq!((offsets, order), (vec![0, 0, 0], vec![]));
    }

    #[test]
    fn ids_outside_the_table_are_errors() {
        assert_eq!(checked_rows("t", &[0, 4, 2], 5).unwrap(), vec![0, 4, 2]);
        assert!(matches!(
            checked_rows("t", &[0, 5], 5),
            Err(CudaError::IndexOutOfRange {
                position: 1,
                index: 5,
                size: 5,
                ..
            })
        ));
        assert!(matches!(
            checked_rows("t", &[-1], 5),
            Err(CudaError::IndexOutOfRange {
                position: 0,
                index: -1,
                ..
            })
        ));
    }
}
