//! The tiled kernels against the materialised path: outputs and gradients (ragged tiles
//! included), dropout with the same mask, the log-sum-exp, and an empty sequence.

use hypershard_tensor::{RandomInit, Tensor};

use super::super::{TILE, dense};
use super::*;
use crate::Dropout;

fn random<F: Float>(len: usize, seed: u64) -> Vec<F> {
    // invariant: a 1-D float tensor of a small length.
    Tensor::random(
        &[len],
        F::COMPUTE_DTYPE,
        RandomInit::uniform(seed, -2.0, 2.0),
    )
    .and_then(|t| t.to_vec::<F>())
    .expect("random")
}

fn dims(batch: usize, seq: usize, n_embd: usize, n_head: usize) -> Dims {
    Dims {
        batch,
        seq,
        n_embd,
        n_head,
    }
}

/// The materialised path on slices, with the mask applied to the weights and to their
/// gradient as the `attn_dropout` child would: `(y, grad_qkv)`.
fn reference<F: Float>(
    qkv: &[F],
    grad_y: &[F],
    dims: Dims,
    mask: Option<&DropMask>,
) -> (Vec<F>, Vec<F>) {
    let apply = |values: &[F]| -> Vec<F> {
        match mask {
            None => values.to_vec(),
            Some(m) => (0..values.len())
                .map(|i| values[i] * F::of(m.scale_at(i as u64)))
                .collect(),
        }
    };
    // invariant: the slices match `dims` by construction.
    let probs = dense::attention_probs(qkv, dims).expect("probs");
    let dropped = apply(&probs);
    let y = dense::attention_output(qkv, &dropped, dims).expect("output");
    let grads = dense::value_backward(qkv, &dropped, grad_y, dims).expect("dv");
    let grad_probs = apply(&grads.grad_dropped_probs);
    let g =
        dense::query_key_backward(qkv, &probs, &grad_probs, &grads.grad_v, dims).expect("dq dk");
    (y, g)
}

/// `max |got − want| ≤ tol · max(max |want|, 1)`, naming `what` on failure: relative to
/// the gradient's scale, with the inputs' scale (1) as the floor for gradients that are
/// zero up to rounding (`dq` and `dk` at `T = 1`, where the softmax is constant).
fn assert_close<F: Float>(got: &[F], want: &[F], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f64, |m, x| m.max(x.as_f64().abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (g, w)| m.max((g.as_f64() - w.as_f64()).abs()));
    assert!(
        err <= tol * scale.max(1.0),
        "{what}: max error {err} vs scale {scale}"
    );
}

/// Splits a `[B, T, 3C]` gradient into its q, k and v columns.
fn split<F: Float>(g: &[F], n_embd: usize) -> [Vec<F>; 3] {
    let mut parts = [Vec::new(), Vec::new(), Vec::new()];
    for row in g.chunks_exact(3 * n_embd) {
        for (part, cols) in parts.iter_mut().zip(row.chunks_exact(n_embd)) {
            part.extend_from_slice(cols);
        }
    }
    parts
}

fn check<F: Float>(dims: Dims, tile: usize, mask: Option<&DropMask>, tol: f64) {
    let what = format!("T={} tile={tile} mask={}", dims.seq, mask.is_some());
    let qkv = random::<F>(dims.batch * dims.seq * 3 * dims.n_embd, 1 + dims.seq as u64);
    let grad_y = random::<F>(dims.batch * dims.seq * dims.n_embd, 99);
    let (y_ref, g_ref) = reference(&qkv, &grad_y, dims, mask);
    // invariant: the slices match `dims` by construction.
    let out = forward(&qkv, dims, tile, mask).expect("forward");
    assert_close(&out.y, &y_ref, tol, &format!("{what} y"));
    // What the forward keeps for backward: each head's q, k, v, `[B, H, 3, T, D]`.
    let part = dims.seq * dims.head_dim();
    for (index, kept) in out.heads.chunks_exact(part).enumerate() {
        let (bh, which) = (index / 3, index % 3);
        let (b, h) = (bh / dims.n_head, bh % dims.n_head);
        assert_eq!(
            kept,
            dims.gather_head(&qkv, b, h, which),
            "{what} head {bh} part {which}"
        );
    }
    let g = backward((&out.heads, &out.y, &out.lse), &grad_y, dims, tile, mask).expect("backward");
    let names = ["dq", "dk", "dv"];
    for ((got, want), name) in split(&g, dims.n_embd)
        .iter()
        .zip(&split(&g_ref, dims.n_embd))
        .zip(names)
    {
        assert_close(got, want, tol, &format!("{what} {name}"));
    }
}

#[test]
fn tiled_forward_and_gradients_match_the_materialised_path() {
    // T = 1, 7, 64, 130 at the module's tile (130 ends in a ragged 2-row block) and other
    // tiles, so many blocks, ragged edges and the diagonal blocks are all covered.
    for seq in [1, 7, 64, 130] {
        check::<f32>(dims(2, seq, 128, 2), TILE, None, 1e-5);
        check::<f64>(dims(2, seq, 128, 2), TILE, None, 1e-12);
        // Heads of width 32 (medium's): the 32-wide panels of the tile products.
        check::<f32>(dims(2, seq, 192, 6), TILE, None, 1e-5);
    }
    for (seq, tile) in [(7, 2), (7, 3), (37, 8), (64, 16), (130, 32), (200, 48)] {
        check::<f32>(dims(1, seq, 12, 3), tile, None, 1e-5);
        check::<f64>(dims(1, seq, 12, 3), tile, None, 1e-12);
    }
}

#[test]
fn tiled_dropout_matches_the_materialised_path_with_the_same_mask() {
    let mut dropout = Dropout::new(0.3, 5).expect("dropout");
    for (seq, tile) in [(1, TILE), (7, 3), (70, TILE), (130, 16)] {
        // invariant: training with p > 0 draws a mask.
        let mask = dropout.draw_mask().expect("mask");
        check::<f32>(dims(2, seq, 12, 2), tile, Some(&mask), 1e-5);
        check::<f64>(dims(2, seq, 12, 2), tile, Some(&mask), 1e-12);
    }
}

#[test]
fn log_sum_exp_matches_its_definition() {
    let d = dims(1, 9, 8, 2);
    let qkv = random::<f64>(9 * 24, 3);
    let out = forward(&qkv, d, 4, None).expect("forward");
    let scale = 1.0 / 2.0; // head width 4
    for h in 0..2 {
        let q = d.gather_head(&qkv, 0, h, 0);
        let k = d.gather_head(&qkv, 0, h, 1);
        for i in 0..9 {
            let sum: f64 = (0..=i)
                .map(|j| {
                    let s: f64 = (0..4).map(|c| q[i * 4 + c] * k[j * 4 + c]).sum();
                    (s * scale).exp()
                })
                .sum();
            let got = out.lse[h * 9 + i];
            assert!((got - sum.ln()).abs() < 1e-13, "head {h} row {i}: {got}");
        }
    }
}

#[test]
fn a_zero_length_sequence_gives_empty_outputs() {
    let d = dims(2, 0, 8, 2);
    let out = forward::<f32>(&[], d, TILE, None).expect("forward");
    assert!(out.y.is_empty() && out.lse.is_empty());
    let g = backward::<f32>((&[], &[], &[]), &[], d, TILE, None).expect("backward");
    assert!(g.is_empty());
}

#[test]
fn backward_operands_of_the_wrong_length_are_typed_errors() {
    let d = dims(2, 5, 8, 2);
    let heads = random::<f64>(2 * 5 * 24, 1);
    let y = random::<f64>(2 * 5 * 8, 2);
    let lse = random::<f64>(2 * 2 * 5, 3);
    let dy = random::<f64>(2 * 5 * 8, 4);
    assert!(backward((&heads, &y, &lse), &dy, d, TILE, None).is_ok());
    let cases: [(&str, &[f64], &[f64]); 2] = [
        ("attention backward forward output", &y[1..], &dy),
        ("attention backward output gradient", &y, &dy[1..]),
    ];
    for (what, y, dy) in cases {
        match backward((&heads, y, &lse), dy, d, TILE, None) {
            Err(Error::ShapeMismatch { op, lhs, rhs }) => {
                assert_eq!(op, what);
                assert_eq!((lhs, rhs), (vec![80], vec![79]));
            }
            other => panic!("{what}: expected a shape mismatch, got {other:?}"),
        }
    }
}
