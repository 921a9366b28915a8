//! The device operations of nn's layers on CUDA tensors, f32 only: layer norm and RMS norm,
//! the causal softmax of attention, attention's head split and merge, the token and position
//! embeddings (and one table's rows) and cross-entropy; each with its backward (the optimizer
//! steps are in `optim.rs`). hypershard-nn dispatches its layers here when their tensors are on a CUDA device.
//!
//! Every operation checks dtypes, shapes and (for token ids and class targets) index ranges on
//! the host, then launches the kernels of kernels.cu that follow hypershard-nn's host code step
//! by step (see the comments there). No kernel uses atomics, so every result is the same from
//! run to run: the embedding gradient is a gather over a host-built index of each token's
//! positions rather than a scatter.

use cudarc::driver::PushKernelArg;

#[cfg(test)]
use super::KERNEL_NAMES;
use super::kernels::{launch_config, row_launch_config};
use super::view::{Dev, launch};
use crate::{DType, Error, Result, Tensor};

/// The kernels this module launches (all in [`KERNEL_NAMES`]; a unit test checks).
const LAYER_NORM: &str = "layer_norm_f32";
const LAYER_NORM_BACKWARD: &str = "layer_norm_backward_f32";
const LAYER_NORM_PARAM_GRAD: &str = "layer_norm_param_grad_f32";
const CAUSAL_SOFTMAX: &str = "causal_softmax_f32";
const CAUSAL_SOFTMAX_BACKWARD: &str = "causal_softmax_backward_f32";
const CROSS_ENTROPY: &str = "cross_entropy_f32";
const EMBEDDING: &str = "embedding_f32";
const EMBEDDING_BACKWARD: &str = "embedding_backward_f32";
const POSITION_BACKWARD: &str = "position_backward_f32";
const SPLIT_HEADS: &str = "split_heads_f32";
const MERGE_HEADS: &str = "merge_heads_f32";

#[cfg(test)]
const ALL: &[&str] = &[
    LAYER_NORM,
    LAYER_NORM_BACKWARD,
    LAYER_NORM_PARAM_GRAD,
    CAUSAL_SOFTMAX,
    CAUSAL_SOFTMAX_BACKWARD,
    CROSS_ENTROPY,
    EMBEDDING,
    EMBEDDING_BACKWARD,
    POSITION_BACKWARD,
    SPLIT_HEADS,
    MERGE_HEADS,
];

/// The view of `t` for `op`, which must be f32.
pub(super) fn f32_of(op: &'static str, t: &Tensor) -> Result<Dev> {
    let dev = Dev::of(op, t)?;
    dev.f32(op)?;
    Ok(dev)
}

/// The rows of a tensor read as rows of its last dim; the width must be `width`.
fn rows_of(op: &'static str, t: &Dev, width: usize) -> Result<usize> {
    match t.shape.last() {
        Some(&last) if last == width => Ok(t.numel.checked_div(width).unwrap_or(0)),
        _ => Err(Error::ShapeMismatch {
            op,
            lhs: vec![width],
            rhs: t.shape.clone(),
        }),
    }
}

/// What a layer norm's forward gives: the output and what its backward needs.
#[derive(Debug)]
pub struct LayerNormOutput {
    /// `x̂ · w + b`, the input's shape.
    pub out: Tensor,
    /// The normalised input `x̂ = (x − mean) · r`, the input's shape.
    pub xhat: Tensor,
    /// `r = 1/√(var + eps)` per row, `[rows]`.
    pub rstd: Tensor,
}

/// Which row normalisation the norm kernels compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    /// LayerNorm: the row's mean is subtracted first.
    Layer,
    /// RMSNorm: no centring (`x̂ = x · r`, `r = 1/√(mean(x²) + eps)`).
    Rms,
}

impl Norm {
    /// The kernels' `center` flag.
    fn center(self) -> u32 {
        u32::from(self == Norm::Layer)
    }
}

/// torch's LayerNorm over the last dim of `x` (f32), as hypershard-nn's host `LayerNorm`:
/// `weight` and `bias` are `[d]` with `d` the last dim, the variance biased, `eps` rounded to
/// f32 as the host does. [`norm`] with [`Norm::Layer`].
pub fn layer_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<LayerNormOutput> {
    norm(Norm::Layer, x, weight, bias, eps)
}

/// The row normalisation `kind` over the last dim of `x` (f32), as hypershard-nn's host
/// `LayerNorm` and `RmsNorm` (`x̂` is `(x − mean)·r` or `x·r`); see [`layer_norm`].
pub fn norm(
    kind: Norm,
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<LayerNormOutput> {
    const OP: &str = "cuda::norm";
    let xd = f32_of(OP, x)?;
    let w = f32_of(OP, weight)?;
    let d = w.numel;
    w.shape_is(OP, &[d])?;
    xd.same_device(OP, &w)?;
    let b = bias.map(|b| f32_of(OP, b)).transpose()?;
    if let Some(b) = &b {
        b.shape_is(OP, &[d])?;
        xd.same_device(OP, b)?;
    }
    let rows = rows_of(OP, &xd, d)?;
    let (out, o) = xd.output(OP, &xd.shape, DType::F32)?;
    let (xhat, h) = xd.output(OP, &xd.shape, DType::F32)?;
    let (rstd, r) = xd.output(OP, &[rows], DType::F32)?;
    // No rows, or rows of width 0: nothing to normalise (the outputs are empty), and the host
    // leaves no statistics either; `rstd` stays zero.
    if let Some(config) = row_launch_config(if d == 0 { 0 } else { rows }) {
        let (rows64, d64) = (rows as u64, d as u64);
        let inv_d = (1.0 / d as f64) as f32;
        let eps = eps as f32;
        let has_bias = u32::from(b.is_some());
        let center = kind.center();
        // Without a bias the kernel never reads `b`, and the weight stands in for it.
        let b_ptr = b.as_ref().map_or(w.ptr, |b| b.ptr);
        // Checked: x, out, xhat hold rows·d f32; rstd holds rows; weight (and bias) hold d.
        launch!(OP, &xd, LAYER_NORM, config, |l| {
            l.arg(&o.ptr)
                .arg(&h.ptr)
                .arg(&r.ptr)
                .arg(&xd.ptr)
                .arg(&w.ptr)
                .arg(&b_ptr)
                .arg(&has_bias)
                .arg(&center)
                .arg(&rows64)
                .arg(&d64)
                .arg(&inv_d)
                .arg(&eps);
        })?;
    }
    Ok(LayerNormOutput { out, xhat, rstd })
}

/// LayerNorm's backward from `grad` (the output's gradient) and the forward's `x̂` and `r`
/// (see [`LayerNormOutput`]): accumulates `grad_weight += Σ g·x̂` and `grad_bias += Σ g` in
/// place (each column summed over the rows in order, as the host does) and returns the input
/// gradient. [`norm_backward`] with [`Norm::Layer`].
pub fn layer_norm_backward(
    grad: &Tensor,
    saved: [&Tensor; 2],
    weight: &Tensor,
    grad_weight: &Tensor,
    grad_bias: Option<&Tensor>,
) -> Result<Tensor> {
    norm_backward(Norm::Layer, grad, saved, weight, grad_weight, grad_bias)
}

/// The backward of the row normalisation `kind` (see [`layer_norm_backward`]); RMSNorm's
/// input gradient leaves out LayerNorm's `mean(g·w)` term, as the host's does.
pub fn norm_backward(
    kind: Norm,
    grad: &Tensor,
    [xhat, rstd]: [&Tensor; 2],
    weight: &Tensor,
    grad_weight: &Tensor,
    grad_bias: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "cuda::norm_backward";
    let g = f32_of(OP, grad)?;
    let [xhat, rstd, w, dw] = [xhat, rstd, weight, grad_weight].map(|t| f32_of(OP, t));
    let (xhat, rstd, w, dw) = (xhat?, rstd?, w?, dw?);
    for t in [&xhat, &rstd, &w, &dw] {
        g.same_device(OP, t)?;
    }
    let d = w.numel;
    w.shape_is(OP, &[d])?;
    dw.shape_is(OP, &[d])?;
    g.shape_is(OP, &xhat.shape)?;
    let rows = rows_of(OP, &g, d)?;
    rstd.shape_is(OP, &[rows])?;
    let db = grad_bias.map(|b| f32_of(OP, b)).transpose()?;
    if let Some(db) = &db {
        db.shape_is(OP, &[d])?;
        g.same_device(OP, db)?;
    }
    let (dx, dxd) = g.output(OP, &g.shape, DType::F32)?;
    let rows = if d == 0 { 0 } else { rows };
    let (rows64, d64) = (rows as u64, d as u64);
    if let Some(config) = row_launch_config(rows) {
        let inv_d = (1.0 / d as f64) as f32;
        // Checked: grad, xhat, dx hold rows·d f32, rstd holds rows, weight holds d.
        let center = kind.center();
        launch!(OP, &g, LAYER_NORM_BACKWARD, config, |l| {
            l.arg(&dxd.ptr)
                .arg(&g.ptr)
                .arg(&xhat.ptr)
                .arg(&rstd.ptr)
                .arg(&w.ptr)
                .arg(&center)
                .arg(&rows64)
                .arg(&d64)
                .arg(&inv_d);
        })?;
    }
    let param_config = launch_config(OP, if rows == 0 { 0 } else { d }, 1).map_err(g.error(OP))?;
    if let Some(config) = param_config {
        let has_bias = u32::from(db.is_some());
        // Without a bias the kernel never touches `db`, which is passed as a null pointer.
        let db_ptr = db.as_ref().map_or(0u64, |db| db.ptr);
        // Checked: grad and xhat hold rows·d f32, grad_weight (and grad_bias) hold d.
        launch!(OP, &g, LAYER_NORM_PARAM_GRAD, config, |l| {
            l.arg(&dw.ptr)
                .arg(&db_ptr)
                .arg(&g.ptr)
                .arg(&xhat.ptr)
                .arg(&has_bias)
                .arg(&rows64)
                .arg(&d64);
        })?;
    }
    Ok(dx)
}

/// The `(rows, T)` of attention scores `[.., T, T]` (at least 2-D, square in the last two).
fn square_rows(op: &'static str, t: &Dev) -> Result<(usize, usize)> {
    match t.shape.as_slice() {
        [.., r, c] if r == c => Ok((t.numel.checked_div(*c).unwrap_or(0), *c)),
        other => Err(Error::ShapeMismatch {
            op,
            lhs: vec![0, 0],
            rhs: other.to_vec(),
        }),
    }
}

/// The causal softmax of attention scores `[.., T, T]` in place: row `i` of each `T × T`
/// matrix becomes `softmax(scale · s[i, 0..=i])` and exactly 0 beyond `i`, as the host's
/// attention does (`scale` rounded to f32).
pub fn causal_softmax_(scores: &Tensor, scale: f64) -> Result<()> {
    const OP: &str = "cuda::causal_softmax_";
    let s = f32_of(OP, scores)?;
    let (rows, t) = square_rows(OP, &s)?;
    let Some(config) = row_launch_config(rows) else {
        return Ok(());
    };
    let (rows64, t64, scale) = (rows as u64, t as u64, scale as f32);
    // Checked: scores holds rows·t f32, rows a multiple of t (whole T × T matrices).
    launch!(OP, &s, CAUSAL_SOFTMAX, config, |l| {
        l.arg(&s.ptr).arg(&rows64).arg(&t64).arg(&scale);
    })
}

/// The causal softmax's backward in place on `grad` (the gradient of its output `probs`):
/// `grad = scale · probs ⊙ (grad − Σ_row grad ⊙ probs)`, the gradient of the unscaled scores.
pub fn causal_softmax_backward_(grad: &Tensor, probs: &Tensor, scale: f64) -> Result<()> {
    const OP: &str = "cuda::causal_softmax_backward_";
    let g = f32_of(OP, grad)?;
    let p = f32_of(OP, probs)?;
    g.same_device(OP, &p)?;
    g.shape_is(OP, &p.shape)?;
    let (rows, t) = square_rows(OP, &p)?;
    let Some(config) = row_launch_config(rows) else {
        return Ok(());
    };
    let (rows64, t64, scale) = (rows as u64, t as u64, scale as f32);
    // Checked: grad and probs hold rows·t f32.
    launch!(OP, &g, CAUSAL_SOFTMAX_BACKWARD, config, |l| {
        l.arg(&g.ptr).arg(&p.ptr).arg(&rows64).arg(&t64).arg(&scale);
    })
}

/// `(batch, seq, parts · C)` checks of a head split or merge; returns `[B, T, H, D]`.
pub(super) fn head_dims(
    op: &'static str,
    rows: &Dev,
    part: usize,
    parts: usize,
    n_head: usize,
) -> Result<[usize; 4]> {
    rows.f32(op)?;
    let bad = || Error::ShapeMismatch {
        op,
        lhs: vec![0, 0, parts, n_head],
        rhs: rows.shape.clone(),
    };
    let &[batch, seq, width] = rows.shape.as_slice() else {
        return Err(bad());
    };
    let c = width.checked_div(parts).unwrap_or(0);
    if parts == 0 || part >= parts || n_head == 0 || c * parts != width || c % n_head != 0 {
        return Err(bad());
    }
    Ok([batch, seq, n_head, c / n_head])
}

/// Part `part` of `parts` of every row of `rows` (`[B, T, parts · C]`, the fused q, k, v
/// projection has 3 parts), split into `n_head` heads: a new `[B · n_head, T, C / n_head]`.
pub fn split_heads(rows: &Tensor, part: usize, parts: usize, n_head: usize) -> Result<Tensor> {
    const OP: &str = "cuda::split_heads";
    let r = Dev::of(OP, rows)?;
    let [batch, seq, h, hd] = head_dims(OP, &r, part, parts, n_head)?;
    let (heads, hd_dev) = r.output(OP, &[batch * h, seq, hd], DType::F32)?;
    if let Some(config) = launch_config(OP, hd_dev.numel, 1).map_err(r.error(OP))? {
        let args = [batch, seq, h, hd, part, parts].map(|v| v as u64);
        // Checked: heads holds B·H·T·D f32 and rows B·T·parts·H·D; the kernel's index map
        // stays inside both for part < parts.
        launch!(OP, &r, SPLIT_HEADS, config, |l| {
            l.arg(&hd_dev.ptr).arg(&r.ptr);
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
    heads: &Tensor,
    rows: &Tensor,
    part: usize,
    parts: usize,
    n_head: usize,
) -> Result<()> {
    const OP: &str = "cuda::merge_heads";
    let r = Dev::of(OP, rows)?;
    let [batch, seq, h, hd] = head_dims(OP, &r, part, parts, n_head)?;
    let hs = f32_of(OP, heads)?;
    r.same_device(OP, &hs)?;
    hs.shape_is(OP, &[batch * h, seq, hd])?;
    let Some(config) = launch_config(OP, hs.numel, 1).map_err(r.error(OP))? else {
        return Ok(());
    };
    let args = [batch, seq, h, hd, part, parts].map(|v| v as u64);
    // Checked as in `split_heads`.
    launch!(OP, &r, MERGE_HEADS, config, |l| {
        l.arg(&r.ptr).arg(&hs.ptr);
        for v in &args {
            l.arg(v);
        }
    })
}

/// Token ids `[B, T]` checked against a table and uploaded, with the index the embedding
/// backward needs: for each table row, its positions in increasing order (a stable counting
/// sort on the host), so the gradient is a gather with a fixed order instead of a scatter with
/// atomics.
#[derive(Debug)]
pub struct TokenIndex {
    ids: Tensor,
    offsets: Tensor,
    order: Tensor,
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

/// The ids as rows of a table of `size`, or the first out of range.
pub(crate) fn checked_rows(op: &'static str, ids: &[i64], size: usize) -> Result<Vec<usize>> {
    ids.iter()
        .enumerate()
        .map(|(position, &index)| {
            usize::try_from(index)
                .ok()
                .filter(|&row| row < size)
                .ok_or(Error::IndexOutOfRange {
                    op,
                    position,
                    index,
                    size,
                })
        })
        .collect()
}

impl TokenIndex {
    /// Checks `ids` (I64, `[B, T]` or `[N]`, on any device; each in `0..vocab`) and uploads
    /// them with their index to `device`. A 1-D `[N]` is read as `[1, N]`.
    pub fn new(device: &crate::Device, ids: &Tensor, vocab: usize) -> Result<TokenIndex> {
        const OP: &str = "cuda::TokenIndex::new";
        if ids.dtype() != DType::I64 {
            return Err(Error::DTypeMismatch {
                op: OP,
                lhs: DType::I64,
                rhs: ids.dtype(),
            });
        }
        let (batch, seq) = match *ids.shape() {
            [batch, seq] => (batch, seq),
            [n] => (1, n),
            _ => {
                return Err(Error::ShapeMismatch {
                    op: OP,
                    lhs: vec![0, 0],
                    rhs: ids.shape().to_vec(),
                });
            }
        };
        let values = ids.to_host()?.to_vec::<i64>()?;
        let rows = checked_rows(OP, &values, vocab)?;
        let (offsets, order) = positions_by_row(&rows, vocab);
        let upload = |v: Vec<i64>| {
            let n = v.len();
            Tensor::from_vec(v, &[n])?.to_device(device)
        };
        Ok(TokenIndex {
            ids: upload(values)?,
            offsets: upload(offsets)?,
            order: upload(order)?,
            batch,
            seq,
            vocab,
        })
    }

    /// `[B, T]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.batch, self.seq]
    }

    /// The table size the ids were checked against.
    pub fn vocab(&self) -> usize {
        self.vocab
    }
}

/// Checks a `[rows, c]` f32 table on the index's device; returns `[rows, c]`.
fn table(op: &'static str, t: &Tensor, ids: &Dev) -> Result<(Dev, [usize; 2])> {
    let dev = f32_of(op, t)?;
    ids.same_device(op, &dev)?;
    match *dev.shape.as_slice() {
        [rows, c] => Ok((dev, [rows, c])),
        _ => Err(Error::ShapeMismatch {
            op,
            lhs: vec![0, 0],
            rhs: dev.shape.clone(),
        }),
    }
}

/// The rows of `wte` (`[V, C]`, f32, `V` the index's vocabulary) for every id, plus GPT's
/// position rows `wpe[t]` (`[P, C]` with `T ≤ P`) when given: `[B · T, C]`.
pub fn embedding(wte: &Tensor, wpe: Option<&Tensor>, tokens: &TokenIndex) -> Result<Tensor> {
    const OP: &str = "cuda::embedding";
    let ids = Dev::of(OP, &tokens.ids)?;
    let (te, [v, c]) = table(OP, wte, &ids)?;
    let pe = wpe.map(|p| table(OP, p, &ids)).transpose()?;
    let positions_fit = pe
        .as_ref()
        .is_none_or(|(_, [p, pc])| *pc == c && tokens.seq <= *p);
    if v != tokens.vocab || !positions_fit {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: vec![tokens.vocab, c],
            rhs: pe.map_or(te.shape.clone(), |(p, _)| p.shape),
        });
    }
    let n = tokens.batch * tokens.seq;
    let (out, o) = te.output(OP, &[n, c], DType::F32)?;
    if let Some(config) = launch_config(OP, n * c, 1).map_err(te.error(OP))? {
        let (n64, seq64, c64) = (n as u64, tokens.seq as u64, c as u64);
        let has_pos = u32::from(pe.is_some());
        // Without positions the kernel never reads `wpe`; the table stands in for it.
        let pe_ptr = pe.as_ref().map_or(te.ptr, |(p, _)| p.ptr);
        // Checked: ids holds n entries, each below V (TokenIndex::new), wte V·c f32, wpe P·c
        // with every position's t = n mod seq < seq ≤ P, out n·c.
        launch!(OP, &te, EMBEDDING, config, |l| {
            l.arg(&o.ptr)
                .arg(&te.ptr)
                .arg(&pe_ptr)
                .arg(&ids.ptr)
                .arg(&n64)
                .arg(&seq64)
                .arg(&c64)
                .arg(&has_pos);
        })?;
    }
    Ok(out)
}

/// The embedding's backward from `grad` (`[B · T, C]`), in place: `grad_wte[v] += Σ grad[p]`
/// over the positions `p` of token `v` in increasing order and, when given,
/// `grad_wpe[t] += Σ_b grad[b, t]`.
pub fn embedding_backward(
    grad: &Tensor,
    tokens: &TokenIndex,
    grad_wte: &Tensor,
    grad_wpe: Option<&Tensor>,
) -> Result<()> {
    const OP: &str = "cuda::embedding_backward";
    let ids = Dev::of(OP, &tokens.ids)?;
    let (dt, [v, c]) = table(OP, grad_wte, &ids)?;
    let pe = grad_wpe.map(|p| table(OP, p, &ids)).transpose()?;
    let g = f32_of(OP, grad)?;
    g.shape_is(OP, &[tokens.batch * tokens.seq, c])?;
    g.same_device(OP, &dt)?;
    let positions_fit = pe
        .as_ref()
        .is_none_or(|(_, [p, pc])| *pc == c && tokens.seq <= *p);
    if v != tokens.vocab || !positions_fit {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: vec![tokens.vocab, c],
            rhs: pe.map_or(dt.shape.clone(), |(p, _)| p.shape),
        });
    }
    if let Some(config) = launch_config(OP, v * c, 1).map_err(g.error(OP))? {
        let offsets = Dev::of(OP, &tokens.offsets)?;
        let order = Dev::of(OP, &tokens.order)?;
        let (v64, c64) = (v as u64, c as u64);
        // Checked: offsets holds V + 1 nondecreasing entries ending at n, order n positions
        // below n (positions_by_row), grad n·c f32, grad_wte V·c.
        launch!(OP, &g, EMBEDDING_BACKWARD, config, |l| {
            l.arg(&dt.ptr)
                .arg(&g.ptr)
                .arg(&offsets.ptr)
                .arg(&order.ptr)
                .arg(&v64)
                .arg(&c64);
        })?;
    }
    let (Some((pe, _)), Some(config)) = (
        pe,
        launch_config(OP, tokens.seq * c, 1).map_err(g.error(OP))?,
    ) else {
        return Ok(());
    };
    let (b64, seq64, c64) = (tokens.batch as u64, tokens.seq as u64, c as u64);
    // Checked: grad holds B·T·c f32, grad_wpe P·c with T ≤ P (the kernel writes rows < T).
    launch!(OP, &g, POSITION_BACKWARD, config, |l| {
        l.arg(&pe.ptr).arg(&g.ptr).arg(&b64).arg(&seq64).arg(&c64);
    })
}

/// A cross-entropy's mean loss (read back) and the gradient of the logits (on the device).
#[derive(Debug)]
pub struct CrossEntropyOutput {
    /// The mean over the counted targets (NaN when every target is ignored, as torch).
    pub loss: f64,
    /// `∂loss/∂logits`, the logits' shape.
    pub grad: Tensor,
}

/// Cross-entropy of f32 `logits` `[*, V]` against I64 `targets` `[*]` (on any device),
/// averaged over the targets other than `ignore_index`, as hypershard-nn's host
/// `cross_entropy`: the row losses are computed in f64 on the device and summed in row order
/// on the host. A target outside `0..V` is [`Error::IndexOutOfRange`].
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
) -> Result<CrossEntropyOutput> {
    const OP: &str = "cuda::cross_entropy";
    let x = f32_of(OP, logits)?;
    if targets.dtype() != DType::I64 {
        return Err(Error::DTypeMismatch {
            op: OP,
            lhs: DType::I64,
            rhs: targets.dtype(),
        });
    }
    let Some((&classes, leading)) = x.shape.split_last() else {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: vec![0],
            rhs: x.shape.clone(),
        });
    };
    if leading != targets.shape() {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: x.shape.clone(),
            rhs: targets.shape().to_vec(),
        });
    }
    let labels = targets.to_host()?.to_vec::<i64>()?;
    let rows = labels.len();
    let mut mapped = Vec::with_capacity(rows);
    for (position, &label) in labels.iter().enumerate() {
        if label == ignore_index {
            mapped.push(-1i64);
            continue;
        }
        if !usize::try_from(label).is_ok_and(|class| class < classes) {
            return Err(Error::IndexOutOfRange {
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
    let (grad, gd) = x.output(OP, &x.shape, DType::F32)?;
    // Rows of width 0 have no counted target (none is in range), so there is nothing to do.
    let Some(config) = row_launch_config(if classes == 0 { 0 } else { rows }) else {
        return Ok(CrossEntropyOutput {
            loss: 0.0 / counted as f64,
            grad,
        });
    };
    let device = x.label();
    let classes_of = Tensor::from_vec(mapped.clone(), &[rows])?.to_device(&device)?;
    let t = Dev::of(OP, &classes_of)?;
    let (row_loss, rl) = x.output(OP, &[rows], DType::F64)?;
    let (rows64, classes64, scale32) = (rows as u64, classes as u64, scale as f32);
    // Checked: logits and grad hold rows·classes f32, targets rows entries each −1 or below
    // classes, row_loss rows f64.
    launch!(OP, &x, CROSS_ENTROPY, config, |l| {
        l.arg(&gd.ptr)
            .arg(&rl.ptr)
            .arg(&x.ptr)
            .arg(&t.ptr)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_exists() {
        for name in ALL {
            assert!(KERNEL_NAMES.contains(name), "{name}");
            assert!(name.ends_with("_f32"), "{name}");
        }
        assert_eq!(ALL.len(), 11);
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
            Err(Error::IndexOutOfRange {
                position: 1,
                index: 5,
                size: 5,
                ..
            })
        ));
        assert!(matches!(
            checked_rows("t", &[-1], 5),
            Err(Error::IndexOutOfRange {
                position: 0,
                index: -1,
                ..
            })
        ));
    }
}
