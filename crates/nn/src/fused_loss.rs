//! The lm_head and the cross-entropy fused and chunked over tokens: the `[tokens, vocab]`
//! logits, their copy and their gradient are never held whole.
//!
//! With GPT-2's vocabulary (50 304) and 1 024 tokens a step, each of those buffers is 196 MiB:
//! more than all of a rank's sharded training state once a model is spread over a few ranks.
//! The fused head computes, for a block of token rows at a time, the logits, the loss and the
//! gradient of the loss with respect to the logits (in place), and at once folds that
//! gradient into the gradients of the final hidden state (`[tokens, C]`) and of the lm_head
//! weight (`[V, C]`, which the tied embedding needs anyway). Only a block of logits is ever
//! alive. The loss and the hidden-state gradient are the unfused head's bit for bit; the
//! weight gradient sums the same products in blocks, so it may differ in the last bits.

use std::sync::{Arc, Mutex, PoisonError};

use hypershard_tensor::Tensor;

use crate::kernels::Float;
use crate::linalg::{GemmShape, MatmulOptions, gemm_accumulate_into, gemm_into};
use crate::loss::{TargetClasses, cross_entropy_rows_in_place};
use crate::{Error, Result};

/// Logit elements per block of token rows (32 MiB of f32): large enough that the lm_head's
/// GEMMs stay efficient, small next to the whole logits of a large vocabulary.
const BLOCK_ELEMENTS: usize = 1 << 23;

/// The targets of the next forward of a model whose loss head is fused (see
/// [`Gpt::fused_loss`](crate::Gpt::fused_loss)): a handle the training loop keeps after the
/// model is wrapped (by `fully_shard`, activation checkpointing), since the forward's one
/// input is the token ids.
#[derive(Debug, Clone, Default)]
pub struct LossTargets {
    next: Arc<Mutex<Option<PendingTargets>>>,
}

#[derive(Debug)]
pub(crate) struct PendingTargets {
    pub(crate) targets: Tensor,
    pub(crate) backward: bool,
}

impl LossTargets {
    /// Targets (I64, one per token) for a forward that a backward will follow: the forward
    /// also computes the head's gradients, so its logits need not be kept.
    pub fn for_backward(&self, targets: Tensor) {
        self.set(targets, true);
    }

    /// Targets for a forward that only evaluates the loss (no gradients computed).
    pub fn for_eval(&self, targets: Tensor) {
        self.set(targets, false);
    }

    fn set(&self, targets: Tensor, backward: bool) {
        *self.next.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(PendingTargets { targets, backward });
    }

    /// The targets set for this forward (each set is used once).
    pub(crate) fn take(&self, module: &'static str) -> Result<PendingTargets> {
        self.next
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or(Error::LossTargetsMissing { module })
    }
}

/// What the fused head computed for one forward.
pub(crate) struct FusedHead {
    /// `Σ −log softmax(logits)[target]` over the counted targets, in f64.
    pub(crate) loss_sum: f64,
    /// How many targets were not ignored (the mean's denominator).
    pub(crate) counted: usize,
}

/// Where [`fused_head`] writes the gradients of the mean loss, when it computes them. The
/// caller makes the tensors they live in, so no gradient is built in a buffer of its own and
/// copied: at GPT-2's vocabulary the weight's is 154 MiB.
pub(crate) struct HeadGradTargets<'a, F> {
    /// `∂mean/∂hidden` `[tokens, C]`, overwritten.
    pub(crate) hidden: &'a mut [F],
    pub(crate) weight: WeightGradTarget<'a, F>,
}

/// Where the head weight's gradient goes.
pub(crate) enum WeightGradTarget<'a, F> {
    /// `∂mean/∂W` `[V, C]`, overwritten.
    Into(&'a mut [F]),
    /// Formed later by [`weight_grad_into`], once the weight is no longer read (its memory may
    /// then take the gradient): the vector receives every token's logit gradients
    /// `[tokens, V]`, block by block as the head computed them.
    Defer(&'a mut Vec<F>),
}

/// Token rows per block of the fused head: as many as keep a block's logits within
/// `BLOCK_ELEMENTS`, at least one.
pub(crate) fn rows_per_block(tokens: usize, v: usize) -> usize {
    (BLOCK_ELEMENTS / v.max(1)).clamp(1, tokens.max(1))
}

/// Writes `∂mean/∂W = Σ_blocks gᵀ · h` `[V, C]` into `out` from the logit gradients a
/// [`WeightGradTarget::Defer`] received and the head's `hidden` input: the same products in
/// the same blocks and order as [`fused_head`] forms it directly, so bit for bit that gradient.
pub(crate) fn weight_grad_into<F: Float>(
    logit_grads: &[F],
    hidden: &[F],
    [tokens, c, v]: [usize; 3],
    out: &mut [F],
) -> Result<()> {
    if tokens == 0 {
        out.fill(F::ZERO);
    }
    let rows_per_block = rows_per_block(tokens, v);
    let mut first = 0;
    while first < tokens {
        let rows = rows_per_block.min(tokens - first);
        weight_grad_block(
            first,
            &logit_grads[first * v..(first + rows) * v],
            &hidden[first * c..(first + rows) * c],
            [rows, c, v],
            out,
        )?;
        first += rows;
    }
    Ok(())
}

/// `∂W (+)= gᵀ · h` for the block of token rows starting at `first`, `[V, rows]·[rows, C]`:
/// the first block overwrites `out` (no zero-fill of a fresh `[V, C]` buffer, whose pages it
/// would fault in on one thread), the later ones add into it.
fn weight_grad_block<F: Float>(
    first: usize,
    logit_grads: &[F],
    hidden: &[F],
    [rows, c, v]: [usize; 3],
    out: &mut [F],
) -> Result<()> {
    let shape = GemmShape::new(
        v,
        rows,
        c,
        MatmulOptions {
            transpose_a: true,
            transpose_b: false,
        },
    )?;
    if first == 0 {
        gemm_into(logit_grads, hidden, shape, out)
    } else {
        gemm_accumulate_into(logit_grads, hidden, shape, out)
    }
}

/// The fused head over `hidden` `[tokens, C]` and the head weight `weight` `[V, C]`
/// (logits = hidden · weightᵀ), against `targets`, in blocks of token rows; with `grads`, the
/// gradients written there. A deferred weight gradient ([`WeightGradTarget::Defer`]) keeps
/// every block's logit gradients (`tokens·V` elements instead of one block's) and writes no
/// `[V, C]` buffer here.
pub(crate) fn fused_head<F: Float>(
    op: &'static str,
    hidden: &[F],
    weight: &[F],
    targets: &TargetClasses,
    [tokens, c, v]: [usize; 3],
    grads: Option<HeadGradTargets<'_, F>>,
) -> Result<FusedHead> {
    if hidden.len() != tokens * c {
        return Err(Error::ShapeMismatch {
            op,
            lhs: vec![tokens, c],
            rhs: vec![hidden.len()],
        });
    }
    if targets.classes_of.len() != tokens {
        return Err(Error::ShapeMismatch {
            op,
            lhs: vec![tokens],
            rhs: vec![targets.classes_of.len()],
        });
    }
    let counted = targets.counted;
    // torch gives NaN when every target is ignored (0/0); the gradients are then zero.
    let scale = if counted > 0 {
        1.0 / counted as f64
    } else {
        0.0
    };
    let rows_per_block = rows_per_block(tokens, v);
    let (mut hidden_grad, mut weight_grad, deferred) = match grads {
        Some(HeadGradTargets { hidden, weight }) => match weight {
            WeightGradTarget::Into(out) => (Some(hidden), Some(out), None),
            WeightGradTarget::Defer(logit_grads) => (Some(hidden), None, Some(logit_grads)),
        },
        None => (None, None, None),
    };
    for (target, shape) in [
        (hidden_grad.as_deref(), [tokens, c]),
        (weight_grad.as_deref(), [v, c]),
    ] {
        if let Some(target) = target.filter(|t| t.len() != shape[0] * shape[1]) {
            return Err(Error::ShapeMismatch {
                op,
                lhs: shape.to_vec(),
                rhs: vec![target.len()],
            });
        }
    }
    let defer = deferred.is_some();
    // Deferred, each block's logits (then their gradients) stay where they were computed.
    let mut block = vec![F::ZERO; if defer { tokens } else { rows_per_block } * v];
    if tokens == 0
        && let Some(out) = weight_grad.as_deref_mut()
    {
        out.fill(F::ZERO);
    }
    let mut loss_sum = 0.0;
    let mut first = 0;
    while first < tokens {
        let rows = rows_per_block.min(tokens - first);
        let h = &hidden[first * c..(first + rows) * c];
        let at = if defer { first * v } else { 0 };
        let logits = &mut block[at..at + rows * v];
        let head = MatmulOptions {
            transpose_a: false,
            transpose_b: true,
        };
        gemm_into(h, weight, GemmShape::new(rows, c, v, head)?, logits)?;
        cross_entropy_rows_in_place(
            logits,
            &targets.classes_of[first..first + rows],
            v,
            F::of(scale),
            &mut loss_sum,
        );
        if let Some(hidden_grad) = hidden_grad.as_deref_mut() {
            // ∂hidden = g · W for these rows, [rows, V]·[V, C].
            let dh = &mut hidden_grad[first * c..(first + rows) * c];
            gemm_into(
                logits,
                weight,
                GemmShape::new(rows, v, c, MatmulOptions::default())?,
                dh,
            )?;
        }
        if let Some(out) = weight_grad.as_deref_mut() {
            // ∂W += gᵀ · h (what `weight_grad_into` does when deferred).
            weight_grad_block(first, logits, h, [rows, c, v], out)?;
        }
        first += rows;
    }
    if let Some(logit_grads) = deferred {
        *logit_grads = block;
    }
    Ok(FusedHead { loss_sum, counted })
}
