//! Tiled causal attention with an online softmax (the flash-attention algorithm), which never
//! holds a head's `[T, T]` weights.
//!
//! Forward, per (batch, head) and per block of `tile` query rows: walk the key blocks left of
//! and on the diagonal (blocks wholly above it are skipped, not masked), and keep per row the
//! running maximum `m`, the running sum `l` of `exp(s − m)` and the running output
//! accumulator, rescaling both by `exp(m_old − m_new)` when the maximum grows. At the end the
//! output row is the accumulator over `l` and the row's log-sum-exp `m + ln l` is kept.
//!
//! Backward recomputes each tile's weights from the log-sum-exp, `P = exp(scale·q kᵀ − lse)`,
//! and forms `dS = scale · P ⊙ (dP − D)` with `D = rowsum(dO ⊙ O)` (which equals the softmax
//! backward's `rowsum(P ⊙ dP)`, since `O = P' v` row by row). It walks key blocks outermost so
//! each block's `dk` and `dv` accumulate in a small buffer, and adds into the head's `dq`.
//!
//! Dropout on the weights multiplies `P` by a mask drawn per element from the counter-based
//! generator at the element's index in the `[B, H, T, T]` tensor the materialised path would
//! have built, so both paths drop the same weights; the normaliser `l` is taken before the
//! mask, as `dropout(softmax(s))` requires.
//!
//! The forward gathers each head's q, k and v out of the fused projection `[B, T, 3C]` into
//! one `[B, H, 3, T, D]` buffer, which replaces the projection as what backward keeps (the
//! same size): backward then reads every head's operands where they lie, contiguous, instead
//! of gathering them out of `[B, T, 3C]` rows again. The results go the other way without a
//! detour: each head's task writes its output rows straight into its columns of `y`
//! `[B, T, C]`, and its `dq`, `dk` and `dv` rows into theirs of the projection's gradient
//! `[B, T, 3C]` (the tasks' columns are disjoint, see `SharedRows`).
//!
//! Extra memory beyond the heads and the output: the log-sum-exp (`B·H·T` values) kept for
//! backward; and per rayon task (reused for every head the task runs) the head's gathered
//! `[T, D]` output gradient and its `dq` in backward (`D = rowsum(dO ⊙ O)` reads the output's
//! rows where they lie), block-wise transposed copies of k and v, and a few `tile × tile`
//! and `tile × D` scratch buffers.

use std::marker::PhantomData;

use rayon::prelude::*;

use super::{Dims, copy_head_row};
use crate::dropout::DropMask;
use crate::kernels::vector_isa::vectorized;
use crate::kernels::{Float, add_assign, small_nn_rows};
use crate::linalg::{GemmShape, MatmulOptions, gemm_into};
use crate::{Error, Result};

/// What the forward returns: the attention output `[B, T, C]` (heads side by side, before
/// `c_proj`), the heads' `q, k, v` `[B, H, 3, T, D]` and every row's log-sum-exp of its scaled
/// scores, `[B, H, T]`.
#[cfg(test)]
pub(super) struct FlashOutput<F> {
    pub(super) y: Vec<F>,
    pub(super) heads: Vec<F>,
    pub(super) lse: Vec<F>,
}

/// The dropout of the weights of head `bh`: the mask and the index of the head's first weight
/// in the `[B, H, T, T]` tensor it is drawn over.
#[derive(Clone, Copy)]
struct HeadMask<'a> {
    mask: &'a DropMask,
    first: u64,
    seq: usize,
}

impl HeadMask<'_> {
    /// Writes the factors of rows `r0 .. r0 + rows`, columns `c0 .. c0 + cols` into `out`
    /// (`[rows, cols]`).
    fn fill(&self, r0: usize, c0: usize, rows: usize, cols: usize, out: &mut [impl Float]) {
        for (i, row) in out.chunks_exact_mut(cols).take(rows).enumerate() {
            let start = self.first + ((r0 + i) * self.seq + c0) as u64;
            for (j, m) in row.iter_mut().enumerate() {
                *m = Float::of(self.mask.scale_at(start + j as u64));
            }
        }
    }
}

/// `c[m, n] = a[m, k] · b[k, n]`, by the packing-free kernel when it takes the shape.
fn mm_nn<F: Float>(a: &[F], b: &[F], (m, k, n): (usize, usize, usize), c: &mut [F]) -> Result<()> {
    if small_nn_rows(a, b, (m, k, n), c, false) {
        return Ok(());
    }
    gemm_into(a, b, GemmShape::new(m, k, n, MatmulOptions::default())?, c)
}

/// `c[m, n] = a[k, m]ᵀ · b[k, n]`: the packing-free kernel reads `a` down its columns where
/// it takes the product; the general GEMM reads `a` transposed in place otherwise.
fn mm_tn<F: Float>(a: &[F], b: &[F], (m, k, n): (usize, usize, usize), c: &mut [F]) -> Result<()> {
    if F::small_gemm_tn(a, b, m, k, n, c) {
        return Ok(());
    }
    let options = MatmulOptions {
        transpose_a: true,
        transpose_b: false,
    };
    gemm_into(a, b, GemmShape::new(m, k, n, options)?, c)
}

/// `x` `[T, D]` with each block of `tile` rows transposed in place of itself: block
/// `c0 .. c0 + cols` becomes the `[D, cols]` matrix at the same offset `c0 · D`. The tiles'
/// products `a · blockᵀ` then run as `a · (transposed block)` on the kernels without
/// transposes: the packing-free `a · bᵀ` kernel reduces each output across a vector, which
/// costs as much as its multiply-adds when `D` is a head width.
fn transpose_blocks<F: Float>(x: &[F], seq: usize, d: usize, tile: usize, out: &mut [F]) {
    for c0 in (0..seq).step_by(tile) {
        let cols = tile.min(seq - c0);
        let (src, dst) = (
            &x[c0 * d..(c0 + cols) * d],
            &mut out[c0 * d..(c0 + cols) * d],
        );
        for (j, row) in src.chunks_exact(d).enumerate() {
            for (p, &value) in row.iter().enumerate() {
                dst[p * cols + j] = value;
            }
        }
    }
}

/// Independent accumulators of the row reductions below: a single running maximum or sum
/// would chain every element's operation on the previous one, which keeps the loop (and the
/// `exp` in it) from being vectorised.
const LANES: usize = 16;

/// Folds the `LANES` partial results pairwise (8 + 8, 4 + 4, ...): a handful of vector
/// shuffles, where folding them one after the other is a chain of 16 dependent scalar steps
/// per row.
#[inline(always)]
fn fold_lanes<F: Float>(mut lanes: [F; LANES], op: impl Fn(F, F) -> F) -> F {
    let mut half = LANES / 2;
    while half > 0 {
        for i in 0..half {
            lanes[i] = op(lanes[i], lanes[i + half]);
        }
        half /= 2;
    }
    lanes[0]
}

/// The maximum of the first `seen` (≥ 1) entries of `row`.
///
/// Whole groups of `LANES` entries are read, the entries past `seen` replaced by `−∞`: a
/// row on the causal diagonal then still runs in vectors instead of ending in up to 15
/// scalar steps.
#[inline(always)]
fn row_max<F: Float>(row: &[F], seen: usize) -> F {
    let neg_inf = F::of(f64::NEG_INFINITY);
    let mut maxes = [neg_inf; LANES];
    let end = (seen.div_ceil(LANES) * LANES).min(row.len());
    for (c, chunk) in row[..end].chunks(LANES).enumerate() {
        for (l, (m, &x)) in maxes.iter_mut().zip(chunk).enumerate() {
            let x = if c * LANES + l < seen { x } else { neg_inf };
            *m = m.max(x);
        }
    }
    fold_lanes(maxes, F::max)
}

/// Replaces the first `seen` entries `x` of `row` by `exp(x·scale − shift)` and the others
/// by zero, and returns the sum of the first `seen`.
///
/// As in [`row_max`], whole groups of `LANES` are computed and the entries past `seen`
/// masked out (an `exp` of a hidden score may overflow to `+∞`; it is discarded, not summed).
#[inline(always)]
fn exp_in_place_and_sum<F: Float>(row: &mut [F], seen: usize, scale: F, shift: F) -> F {
    let mut sums = [F::ZERO; LANES];
    let end = (seen.div_ceil(LANES) * LANES).min(row.len());
    let (head, tail) = row.split_at_mut(end);
    for (c, chunk) in head.chunks_mut(LANES).enumerate() {
        for (l, (sum, x)) in sums.iter_mut().zip(chunk).enumerate() {
            let e = (*x * scale - shift).exp();
            let e = if c * LANES + l < seen { e } else { F::ZERO };
            *x = e;
            *sum += e;
        }
    }
    tail.fill(F::ZERO);
    fold_lanes(sums, |a, b| a + b)
}

/// Replaces the first `seen` entries `x` of `row` by `exp(x·scale − shift)` and the others
/// by zero (the backward's weights, recomputed from the log-sum-exp `shift`), in whole
/// groups of `LANES` as [`exp_in_place_and_sum`].
#[inline(always)]
fn exp_in_place<F: Float>(row: &mut [F], seen: usize, scale: F, shift: F) {
    let end = (seen.div_ceil(LANES) * LANES).min(row.len());
    let (head, tail) = row.split_at_mut(end);
    for (c, chunk) in head.chunks_mut(LANES).enumerate() {
        for (l, x) in chunk.iter_mut().enumerate() {
            let e = (*x * scale - shift).exp();
            *x = if c * LANES + l < seen { e } else { F::ZERO };
        }
    }
    tail.fill(F::ZERO);
}

/// The number of columns of key block `c0 .. c0 + cols` that row `row` sees (`col ≤ row`).
/// Key blocks start at or left of the query block's first row, so this is at least 1.
fn visible(row: usize, c0: usize, cols: usize) -> usize {
    cols.min(row + 1 - c0)
}

/// A row-major `[rows, width]` buffer that the tasks of one parallel loop write in disjoint
/// pieces: each head's task writes only its own head's columns (`D` of them) of its batch
/// row's tokens, so the attention's output and input gradient go straight to their places in
/// `[B, T, C]` and `[B, T, 3C]` instead of through a per-head buffer and a scatter pass.
struct SharedRows<'a, F> {
    start: *mut F,
    len: usize,
    width: usize,
    _buffer: PhantomData<&'a mut [F]>,
}

// SAFETY: a `SharedRows` is made from a `&mut [F]` it holds for `'a`, so nothing else reads or
// writes the buffer meanwhile; the tasks it is shared with write it only through
// [`SharedRows::piece`], whose contract keeps their pieces disjoint; `F` is a plain float.
unsafe impl<F: Send> Send for SharedRows<'_, F> {}
// SAFETY: as for `Send`.
unsafe impl<F: Send> Sync for SharedRows<'_, F> {}

impl<'a, F> SharedRows<'a, F> {
    fn new(buffer: &'a mut [F], width: usize) -> Self {
        SharedRows {
            start: buffer.as_mut_ptr(),
            len: buffer.len(),
            width,
            _buffer: PhantomData,
        }
    }

    /// Columns `col .. col + len` of row `row`.
    ///
    /// # Safety
    /// While the returned slice lives, no other slice from this `SharedRows` (in this task or
    /// another) may cover any of its elements.
    #[allow(clippy::mut_from_ref)]
    unsafe fn piece(&self, row: usize, col: usize, len: usize) -> &mut [F] {
        let first = row * self.width + col;
        // invariant: the callers address rows and head columns of the `[B, T, C]` or
        // `[B, T, 3C]` buffer whose length `forward_into` / `backward_into` checked.
        assert!(
            col + len <= self.width && first + len <= self.len,
            "attention: piece ({row}, {col}..{}) outside a buffer of {} rows of {}",
            col + len,
            self.len / self.width.max(1),
            self.width
        );
        // SAFETY: `first + len ≤ len` of the buffer (asserted), which `'a` keeps borrowed
        // for this `SharedRows`; the caller keeps the piece apart from every other one.
        // Tested against the materialised path (several batch rows and heads, on the test
        // pool's threads) by `tiled_forward_and_gradients_match_the_materialised_path` and
        // `tiled_dropout_matches_the_materialised_path_with_the_same_mask`.
        unsafe { std::slice::from_raw_parts_mut(self.start.add(first), len) }
    }
}

/// Where one head's `[T, D]` rows go in a shared `[B·T, width]` buffer: row `t` is row
/// `first_row + t`, columns `col .. col + d`.
#[derive(Clone, Copy)]
struct HeadRows<'s, 'a, F> {
    rows: &'s SharedRows<'a, F>,
    first_row: usize,
    col: usize,
    d: usize,
}

impl<F> HeadRows<'_, '_, F> {
    /// Row `t` of the head.
    ///
    /// # Safety
    /// As [`SharedRows::piece`]: no other live slice covers these `d` elements (each head's
    /// task holds the only `HeadRows` of its `(b, h)` and uses one row at a time).
    #[allow(clippy::mut_from_ref)]
    unsafe fn row(&self, t: usize) -> &mut [F] {
        // SAFETY: the caller's contract.
        unsafe { self.rows.piece(self.first_row + t, self.col, self.d) }
    }
}

/// Scratch buffers of one running head task.
struct ForwardScratch<F> {
    scores: Vec<F>,
    mask: Vec<F>,
    pv: Vec<F>,
    acc: Vec<F>,
    row_max: Vec<F>,
    row_sum: Vec<F>,
}

/// What one rayon task of the forward needs for a head, allocated once per task (rayon's
/// `*_init`) and reused for every head it runs: `k`'s block-transposed copy and the tiles'
/// scratch. Allocating them per head cost page faults and zeroing on every head of every
/// layer (at GPT-2's `[1024, 64]` heads each is 256 KiB, which the allocator maps fresh from
/// the system).
struct ForwardTask<F> {
    k_t: Vec<F>,
    scratch: ForwardScratch<F>,
}

impl<F: Float> ForwardTask<F> {
    fn new((seq, d, tile): (usize, usize, usize), masked: bool) -> Self {
        ForwardTask {
            k_t: vec![F::ZERO; seq * d],
            scratch: ForwardScratch {
                scores: vec![F::ZERO; tile * tile],
                mask: vec![F::ZERO; if masked { tile * tile } else { 0 }],
                pv: vec![F::ZERO; tile * d],
                acc: vec![F::ZERO; tile * d],
                row_max: vec![F::ZERO; tile],
                row_sum: vec![F::ZERO; tile],
            },
        }
    }
}

/// One head's forward: its output rows `o` (`T` rows of `D`, in place in `y`) and `lse[T]`
/// from the head's `q, k, v` (`[3, T, D]`; every element of both overwritten; the task's
/// scratch may hold any values).
#[inline(always)]
fn forward_head<F: Float>(
    task: &mut ForwardTask<F>,
    qkv: &[F],
    (seq, d, tile): (usize, usize, usize),
    mask: Option<HeadMask<'_>>,
    (o, lse): (HeadRows<'_, '_, F>, &mut [F]),
) -> Result<()> {
    let scale = F::of(1.0 / (d as f64).sqrt());
    let neg_inf = F::of(f64::NEG_INFINITY);
    let ForwardTask { k_t, scratch: s } = task;
    let (q, k, v) = head_parts(qkv, seq * d);
    transpose_blocks(k, seq, d, tile, k_t);
    for r0 in (0..seq).step_by(tile) {
        let rows = tile.min(seq - r0);
        let acc = &mut s.acc[..rows * d];
        acc.fill(F::ZERO);
        s.row_max[..rows].fill(neg_inf);
        s.row_sum[..rows].fill(F::ZERO);
        let q_block = &q[r0 * d..(r0 + rows) * d];
        // Key blocks right of `r0` lie wholly above the diagonal: never visited.
        for c0 in (0..=r0).step_by(tile) {
            let cols = tile.min(seq - c0);
            let scores = &mut s.scores[..rows * cols];
            mm_nn(
                q_block,
                &k_t[c0 * d..(c0 + cols) * d],
                (rows, d, cols),
                scores,
            )?;
            if let Some(m) = &mask {
                m.fill(r0, c0, rows, cols, &mut s.mask[..rows * cols]);
            }
            for i in 0..rows {
                let seen = visible(r0 + i, c0, cols);
                let row = &mut scores[i * cols..(i + 1) * cols];
                // `scale` > 0, and rounding is monotonic: the maximum of the scaled scores is
                // the scaled maximum.
                let block_max = row_max(row, seen) * scale;
                let new_max = s.row_max[i].max(block_max);
                // exp(−∞) = 0 on a row's first block: nothing accumulated yet to rescale.
                let correction = (s.row_max[i] - new_max).exp();
                let sum = exp_in_place_and_sum(row, seen, scale, new_max);
                let vis = &mut row[..seen];
                s.row_sum[i] = s.row_sum[i] * correction + sum;
                s.row_max[i] = new_max;
                if correction != F::ONE {
                    for a in &mut acc[i * d..(i + 1) * d] {
                        *a *= correction;
                    }
                }
                if mask.is_some() {
                    for (x, &f) in vis.iter_mut().zip(&s.mask[i * cols..i * cols + seen]) {
                        *x *= f;
                    }
                }
            }
            let pv = &mut s.pv[..rows * d];
            mm_nn(scores, &v[c0 * d..(c0 + cols) * d], (rows, cols, d), pv)?;
            add_assign(acc, pv);
        }
        for i in 0..rows {
            let inv = F::ONE / s.row_sum[i];
            // SAFETY: this head's row `r0 + i`, the only piece of it live here (`o` is this
            // task's head's alone).
            let out = unsafe { o.row(r0 + i) };
            for (dst, &a) in out.iter_mut().zip(&acc[i * d..(i + 1) * d]) {
                *dst = a * inv;
            }
            lse[r0 + i] = s.row_max[i] + s.row_sum[i].ln();
        }
    }
    Ok(())
}

/// The forward of every head: `y` `[B, T, C]` and the log-sum-exp `[B, H, T]` from the fused
/// projection `qkv` `[B, T, 3C]`, in blocks of `tile` rows and columns.
#[cfg(test)]
pub(super) fn forward<F: Float>(
    qkv: &[F],
    dims: Dims,
    tile: usize,
    mask: Option<&DropMask>,
) -> Result<FlashOutput<F>> {
    let mut y = vec![F::ZERO; dims.batch * dims.seq * dims.n_embd];
    let mut heads = vec![F::ZERO; qkv.len()];
    let lse = forward_into(qkv, dims, tile, mask, (&mut heads, &mut y))?;
    Ok(FlashOutput { y, heads, lse })
}

/// A head's `[3, T, D]` operands as `q`, `k` and `v`.
fn head_parts<F>(qkv: &[F], part: usize) -> (&[F], &[F], &[F]) {
    let (q, rest) = qkv.split_at(part);
    let (k, v) = rest.split_at(part);
    (q, k, &v[..part])
}

/// Gathers every head's `q, k, v` out of `qkv` `[B, T, 3C]` into `qkv_heads`
/// (`[B·H, 3, T, D]`, head `b · H + h` at its index), and writes the heads' outputs into
/// their columns of `y` (`[B, T, C]`) and their log-sum-exps into `lse` (`[B·H, T]`); every
/// element of the three is overwritten.
fn forward_heads<F: Float>(
    qkv: &[F],
    dims: Dims,
    tile: usize,
    mask: Option<&DropMask>,
    (qkv_heads, y, lse): (&mut [F], &mut [F], &mut [F]),
) -> Result<()> {
    let (t, d, tile) = (dims.seq, dims.head_dim(), tile.max(1));
    let y_rows = SharedRows::new(y, dims.n_embd);
    qkv_heads
        .par_chunks_mut((3 * t * d).max(1))
        .zip(lse.par_chunks_mut(t.max(1)))
        .enumerate()
        .try_for_each_init(
            || ForwardTask::new((t, d, tile), mask.is_some()),
            |task, (bh, (head_qkv, lse))| {
                let (b, h) = (bh / dims.n_head, bh % dims.n_head);
                for (part, dst) in head_qkv.chunks_exact_mut((t * d).max(1)).enumerate() {
                    dims.gather_head_into(qkv, b, h, part, dst);
                }
                let head_mask = mask.map(|mask| HeadMask {
                    mask,
                    first: (bh * t * t) as u64,
                    seq: t,
                });
                let head = &*head_qkv;
                // Each task's `bh` is its own, so no two tasks write the same head's columns.
                let o = HeadRows {
                    rows: &y_rows,
                    first_row: b * t,
                    col: h * d,
                    d,
                };
                vectorized!(|| forward_head(task, head, (t, d, tile), head_mask, (o, lse)))
            },
        )
}

/// [`forward`] writing the attention output into `y` `[B, T, C]` and the heads' `q, k, v`,
/// which the backward reads, into `qkv_heads` `[B, H, 3, T, D]` (every element of both
/// overwritten); returns the log-sum-exps `[B, H, T]`.
pub(super) fn forward_into<F: Float>(
    qkv: &[F],
    dims: Dims,
    tile: usize,
    mask: Option<&DropMask>,
    (qkv_heads, y): (&mut [F], &mut [F]),
) -> Result<Vec<F>> {
    check_len(
        "attention forward output",
        y.len(),
        dims.batch * dims.seq * dims.n_embd,
    )?;
    check_len("attention forward heads", qkv_heads.len(), qkv.len())?;
    check_len(
        "attention forward input",
        qkv.len(),
        dims.batch * dims.seq * 3 * dims.n_embd,
    )?;
    let mut lse = vec![F::ZERO; dims.batch * dims.n_head * dims.seq];
    forward_heads(qkv, dims, tile, mask, (qkv_heads, y, &mut lse))?;
    Ok(lse)
}

/// Fails unless an output slice has the length its shape needs.
fn check_len(what: &'static str, len: usize, expected: usize) -> Result<()> {
    if len == expected {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            op: what,
            lhs: vec![expected],
            rhs: vec![len],
        })
    }
}

/// Scratch buffers of one running head task in backward.
struct BackwardScratch<F> {
    probs: Vec<F>,
    dropped: Vec<F>,
    mask: Vec<F>,
    grad: Vec<F>,
    tmp: Vec<F>,
    dk: Vec<F>,
    dv: Vec<F>,
}

/// What one rayon task of the backward needs for a head, allocated once per task and reused
/// for every head it runs (as [`ForwardTask`]): the head's gathered output gradient `dout`
/// (`[T, D]`), its `dq` as it accumulates (`[T, D]`), the block-transposed `k` and `v`, the
/// rows' `D` values `[T]`, and the tiles' scratch.
struct BackwardTask<F> {
    dout: Vec<F>,
    dq: Vec<F>,
    k_t: Vec<F>,
    v_t: Vec<F>,
    delta: Vec<F>,
    scratch: BackwardScratch<F>,
}

impl<F: Float> BackwardTask<F> {
    fn new((seq, d, tile): (usize, usize, usize), masked: bool) -> Self {
        let head = || vec![F::ZERO; seq * d];
        let masked_len = if masked { tile * tile } else { 0 };
        BackwardTask {
            dout: head(),
            dq: head(),
            k_t: head(),
            v_t: head(),
            delta: vec![F::ZERO; seq],
            scratch: BackwardScratch {
                probs: vec![F::ZERO; tile * tile],
                dropped: vec![F::ZERO; masked_len],
                mask: vec![F::ZERO; masked_len],
                grad: vec![F::ZERO; tile * tile],
                tmp: vec![F::ZERO; tile * d],
                dk: vec![F::ZERO; tile * d],
                dv: vec![F::ZERO; tile * d],
            },
        }
    }
}

/// One head's backward: its `dq, dk, dv` rows (`T` rows of `D` each, in place in the
/// gradient of the fused projection; every element overwritten) from the head's `q, k, v`
/// (`[3, T, D]`) and log-sum-exps `lse`, saved by the forward, and the task's gathered output
/// gradient `dout` and rows' `D = rowsum(dO ⊙ O)` in `delta`. `dq` sums over every key block,
/// so it accumulates in the task's own buffer and is written out at the end; each key
/// block's `dk` and `dv` are complete when its query blocks are done and go out then.
#[inline(always)]
fn backward_head<F: Float>(
    task: &mut BackwardTask<F>,
    (qkv, lse): (&[F], &[F]),
    (seq, d, tile): (usize, usize, usize),
    mask: Option<HeadMask<'_>>,
    [dq_rows, dk_rows, dv_rows]: [HeadRows<'_, '_, F>; 3],
) -> Result<()> {
    let (q, k, v) = head_parts(qkv, seq * d);
    let BackwardTask {
        dout,
        dq,
        k_t,
        v_t,
        delta,
        scratch: s,
    } = task;
    let scale = F::of(1.0 / (d as f64).sqrt());
    transpose_blocks(k, seq, d, tile, k_t);
    transpose_blocks(v, seq, d, tile, v_t);
    dq.fill(F::ZERO);
    for c0 in (0..seq).step_by(tile) {
        let cols = tile.min(seq - c0);
        let k_block = &k[c0 * d..(c0 + cols) * d];
        let (k_t_block, v_t_block) = (&k_t[c0 * d..(c0 + cols) * d], &v_t[c0 * d..(c0 + cols) * d]);
        let dk_block = &mut s.dk[..cols * d];
        let dv_block = &mut s.dv[..cols * d];
        dk_block.fill(F::ZERO);
        dv_block.fill(F::ZERO);
        // Query blocks above `c0` see none of these keys: never visited.
        for r0 in (c0..seq).step_by(tile) {
            let rows = tile.min(seq - r0);
            let n = rows * cols;
            let q_block = &q[r0 * d..(r0 + rows) * d];
            let dout_block = &dout[r0 * d..(r0 + rows) * d];
            let probs = &mut s.probs[..n];
            mm_nn(q_block, k_t_block, (rows, d, cols), probs)?;
            for i in 0..rows {
                let row = r0 + i;
                let seen = visible(row, c0, cols);
                exp_in_place(&mut probs[i * cols..(i + 1) * cols], seen, scale, lse[row]);
            }
            // The weights after dropout, `P' = P ⊙ M`, feed `dv`; `dP = dP' ⊙ M` below.
            let dropped: &[F] = if let Some(m) = &mask {
                let factors = &mut s.mask[..n];
                m.fill(r0, c0, rows, cols, factors);
                let dropped = &mut s.dropped[..n];
                for ((x, &p), &f) in dropped.iter_mut().zip(probs.iter()).zip(factors.iter()) {
                    *x = p * f;
                }
                dropped
            } else {
                probs
            };
            let tmp = &mut s.tmp[..cols * d];
            mm_tn(dropped, dout_block, (cols, rows, d), tmp)?;
            add_assign(dv_block, tmp);
            let grad = &mut s.grad[..n];
            mm_nn(dout_block, v_t_block, (rows, d, cols), grad)?;
            if mask.is_some() {
                for (g, &f) in grad.iter_mut().zip(s.mask[..n].iter()) {
                    *g *= f;
                }
            }
            // dS = scale · P ⊙ (dP − D); zero where P is (the masked triangle).
            for i in 0..rows {
                let dl = delta[r0 + i];
                let p_row = &s.probs[i * cols..(i + 1) * cols];
                for (g, &p) in grad[i * cols..(i + 1) * cols].iter_mut().zip(p_row) {
                    *g = scale * p * (*g - dl);
                }
            }
            let tmp = &mut s.tmp[..rows * d];
            mm_nn(grad, k_block, (rows, cols, d), tmp)?;
            add_assign(&mut dq[r0 * d..(r0 + rows) * d], tmp);
            let tmp = &mut s.tmp[..cols * d];
            mm_tn(grad, q_block, (cols, rows, d), tmp)?;
            add_assign(dk_block, tmp);
        }
        for (j, (dk_row, dv_row)) in dk_block
            .chunks_exact(d)
            .zip(dv_block.chunks_exact(d))
            .enumerate()
        {
            // SAFETY: this head's rows `c0 + j` of its `dk` and `dv` columns, the only
            // pieces of them live here (the rows are this task's head's alone).
            unsafe {
                copy_head_row(dk_rows.row(c0 + j), dk_row);
                copy_head_row(dv_rows.row(c0 + j), dv_row);
            }
        }
    }
    for (t, row) in dq.chunks_exact(d).enumerate() {
        // SAFETY: as for `dk` above, this head's `dq` row `t`.
        unsafe { copy_head_row(dq_rows.row(t), row) };
    }
    Ok(())
}

/// The backward of every head: the gradient of the fused projection `[B, T, 3C]` from the
/// forward's heads `[B, H, 3, T, D]`, output `y` `[B, T, C]` and log-sum-exp `[B, H, T]`, and
/// the gradient of `y`.
#[cfg(test)]
pub(super) fn backward<F: Float>(
    (qkv_heads, y, lse): (&[F], &[F], &[F]),
    grad_y: &[F],
    dims: Dims,
    tile: usize,
    mask: Option<&DropMask>,
) -> Result<Vec<F>> {
    let mut grad_qkv = vec![F::ZERO; dims.batch * dims.seq * 3 * dims.n_embd];
    backward_into((qkv_heads, y, lse), grad_y, dims, tile, mask, &mut grad_qkv)?;
    Ok(grad_qkv)
}

/// Every head's `dq, dk, dv` into their columns of `grad_qkv` (`[B, T, 3C]`, the gradient of
/// the fused projection; every element overwritten), from the heads' `q, k, v` as the
/// forward saved them (`[B·H, 3, T, D]`).
fn backward_heads<F: Float>(
    (qkv_heads, y, lse): (&[F], &[F], &[F]),
    grad_y: &[F],
    dims: Dims,
    tile: usize,
    mask: Option<&DropMask>,
    grad_qkv: &mut [F],
) -> Result<()> {
    let (t, d, tile) = (dims.seq, dims.head_dim(), tile.max(1));
    let grad_rows = SharedRows::new(grad_qkv, 3 * dims.n_embd);
    qkv_heads
        .par_chunks((3 * t * d).max(1))
        .enumerate()
        .try_for_each_init(
            || BackwardTask::new((t, d, tile), mask.is_some()),
            |task, (bh, head_qkv)| {
                let (b, h) = (bh / dims.n_head, bh % dims.n_head);
                dims.gather_output_head_into(grad_y, b, h, &mut task.dout);
                row_deltas(&task.dout, y, dims, (b, h), &mut task.delta);
                let head_mask = mask.map(|mask| HeadMask {
                    mask,
                    first: (bh * t * t) as u64,
                    seq: t,
                });
                let lse = &lse[bh * t..(bh + 1) * t];
                // Each task's `bh` is its own, so no two tasks write the same head's columns.
                let grads = [0, 1, 2].map(|part| HeadRows {
                    rows: &grad_rows,
                    first_row: b * t,
                    col: part * dims.n_embd + h * d,
                    d,
                });
                vectorized!(|| backward_head(task, (head_qkv, lse), (t, d, tile), head_mask, grads))
            },
        )
}

/// Every row's `D = rowsum(dO ⊙ O)` of head `h` of batch row `b` into `delta` (`[T]`), from
/// the head's gathered output gradient `dout` (`[T, D]`) and the output's rows where they lie
/// in `y` `[B, T, C]`: the output itself is needed nowhere else, so it is not gathered.
fn row_deltas<F: Float>(dout: &[F], y: &[F], dims: Dims, (b, h): (usize, usize), delta: &mut [F]) {
    let d = dims.head_dim();
    for (t, (dst, g)) in delta.iter_mut().zip(dout.chunks_exact(d)).enumerate() {
        let o = dims.output_head_row(y, b, h, t);
        *dst = g.iter().zip(o).map(|(&a, &b)| a * b).sum();
    }
}

/// [`backward`] writing the gradient of the fused projection into `grad_qkv` `[B, T, 3C]`
/// (every element overwritten).
pub(super) fn backward_into<F: Float>(
    operands: (&[F], &[F], &[F]),
    grad_y: &[F],
    dims: Dims,
    tile: usize,
    mask: Option<&DropMask>,
    grad_qkv: &mut [F],
) -> Result<()> {
    check_len(
        "attention backward output",
        grad_qkv.len(),
        dims.batch * dims.seq * 3 * dims.n_embd,
    )?;
    check_len("attention backward heads", operands.0.len(), grad_qkv.len())?;
    let rows = dims.batch * dims.seq * dims.n_embd;
    check_len("attention backward forward output", operands.1.len(), rows)?;
    check_len("attention backward output gradient", grad_y.len(), rows)?;
    backward_heads(operands, grad_y, dims, tile, mask, grad_qkv)
}

#[cfg(test)]
mod tests;
