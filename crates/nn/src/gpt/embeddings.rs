//! The GPT's token and position embeddings on the host: the forward's lookup and sum, and the
//! backward's scatter of the gradient into the tied head's and the position table's.

use crate::embedding::gather_rows;
use crate::kernels::{Float, add_assign};

/// `wte[ids] + wpe[t]` for every position, `[B·T, C]`.
pub(super) fn embed<F: Float>(
    wte: &[F],
    wpe: &[F],
    rows: &[usize],
    seq: usize,
    c: usize,
) -> Vec<F> {
    let mut x = gather_rows(wte, rows, c);
    if c == 0 || seq == 0 {
        return x;
    }
    for (position, x_row) in x.chunks_exact_mut(c).enumerate() {
        let t = position % seq;
        add_assign(x_row, &wpe[t * c..(t + 1) * c]);
    }
    x
}

/// Adds the token embedding's gradient into the head's, `head` `[V, C]`: row `r` becomes
/// `(Σ g[t] over the tokens t of row r, in token order) + head[r]`, the sum starting from zero.
/// That is bit for bit what scattering `g` into `[V, C]` zeros and adding `head` after gives
/// (each element is one `a + b` of the same two values, and IEEE addition commutes), without
/// the zeros: only the rows the tokens touch get a buffer. Rows no token touches get
/// `0 + head[r]`, as there (it turns a `-0.0` into `+0.0`).
pub(super) fn add_token_rows<F: Float>(head: &mut [F], g: &[F], rows: &[usize], c: usize) {
    if c == 0 {
        return;
    }
    const UNTOUCHED: usize = usize::MAX;
    let mut slot_of = vec![UNTOUCHED; head.len() / c];
    let mut sums: Vec<F> = Vec::new();
    for (&row, g_row) in rows.iter().zip(g.chunks_exact(c)) {
        // `Embedding::rows` checked every id against the vocabulary.
        let Some(slot) = slot_of.get_mut(row) else {
            continue;
        };
        if *slot == UNTOUCHED {
            *slot = sums.len() / c;
            sums.resize(sums.len() + c, F::ZERO);
        }
        let start = *slot * c;
        add_assign(&mut sums[start..start + c], g_row);
    }
    for (head_row, &slot) in head.chunks_exact_mut(c).zip(&slot_of) {
        if slot == UNTOUCHED {
            for h in head_row {
                *h = F::ZERO + *h;
            }
        } else {
            for (h, &sum) in head_row.iter_mut().zip(&sums[slot * c..(slot + 1) * c]) {
                *h = sum + *h;
            }
        }
    }
}

/// `dwpe[t] = Σ_b g[b, t]` for a `[block_size, C]` position table.
pub(super) fn position_grad<F: Float>(g: &[F], seq: usize, block_size: usize, c: usize) -> Vec<F> {
    let mut grad = vec![F::ZERO; block_size * c];
    if c == 0 || seq == 0 {
        return grad;
    }
    for (position, g_row) in g.chunks_exact(c).enumerate() {
        let t = position % seq;
        add_assign(&mut grad[t * c..(t + 1) * c], g_row);
    }
    grad
}
