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
pub(crate) struct FusedHead<F> {
    /// `Σ −log softmax(logits)[target]` over the counted targets, in f64.
    pub(crate) loss_sum: f64,
    /// How many targets were not ignored (the mean's denominator).
    pub(crate) counted: usize,
    /// With gradients: `∂mean/∂hidden` `[tokens, C]` and `∂mean/∂W` `[V, C]`.
    pub(crate) grads: Option<HeadGrads<F>>,
}

/// The gradients of the mean loss with respect to the head's two inputs.
pub(crate) struct HeadGrads<F> {
    pub(crate) hidden: Vec<F>,
    pub(crate) weight: WeightGrad<F>,
}

/// The head weight's gradient, or what it is made of when the caller asked to form it later.
pub(crate) enum WeightGrad<F> {
    /// `∂mean/∂W` `[V, C]`.
    Done(Vec<F>),
    /// The logits' gradients of every token `[tokens, V]`, block by block as the head computed
    /// them, for [`weight_grad_into`] once the weight is no longer read (its memory may then
    /// take the gradient).
    Deferred {
        logit_grads: Vec<F>,
        rows_per_block: usize,
    },
}

/// Writes `∂mean/∂W = Σ_blocks gᵀ · h` `[V, C]` into `out` from a [`WeightGrad::Deferred`]'s
/// logit gradients and the head's `hidden` input: zeros, then the same products accumulated in
/// the same blocks and order as [`fused_head`] does, so bit for bit its `Done` gradient.
pub(crate) fn weight_grad_into<F: Float>(
    logit_grads: &[F],
    rows_per_block: usize,
    hidden: &[F],
    [tokens, c, v]: [usize; 3],
    out: &mut [F],
) -> Result<()> {
    out.fill(F::ZERO);
    let rows_per_block = rows_per_block.max(1);
    let mut first = 0;
    while first < tokens {
        let rows = rows_per_block.min(tokens - first);
        let dw = MatmulOptions {
            transpose_a: true,
            transpose_b: false,
        };
        gemm_accumulate_into(
            &logit_grads[first * v..(first + rows) * v],
            &hidden[first * c..(first + rows) * c],
            GemmShape::new(v, rows, c, dw)?,
            out,
        )?;
        first += rows;
    }
    Ok(())
}

/// The fused head over `hidden` `[tokens, C]` and the head weight `weight` `[V, C]`
/// (logits = hidden · weightᵀ), against `targets`, in blocks of token rows. With
/// `defer_weight_grad` the weight's gradient is left as [`WeightGrad::Deferred`]: every
/// block's logit gradients are kept (`tokens·V` elements instead of one block's) and no
/// `[V, C]` buffer is made here.
pub(crate) fn fused_head<F: Float>(
    op: &'static str,
    hidden: &[F],
    weight: &[F],
    targets: &TargetClasses,
    [tokens, c, v]: [usize; 3],
    with_grads: bool,
    defer_weight_grad: bool,
) -> Result<FusedHead<F>> {
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
    let rows_per_block = (BLOCK_ELEMENTS / v.max(1)).clamp(1, tokens.max(1));
    let defer = with_grads && defer_weight_grad;
    // Deferred, each block's logits (then their gradients) stay where they were computed.
    let mut block = vec![F::ZERO; if defer { tokens } else { rows_per_block } * v];
    let mut hidden_grad = if with_grads {
        vec![F::ZERO; tokens * c]
    } else {
        Vec::new()
    };
    let mut weight_grad = if with_grads && !defer {
        vec![F::ZERO; v * c]
    } else {
        Vec::new()
    };
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
        if with_grads {
            // ∂hidden = g · W for these rows, [rows, V]·[V, C].
            let dh = &mut hidden_grad[first * c..(first + rows) * c];
            gemm_into(
                logits,
                weight,
                GemmShape::new(rows, v, c, MatmulOptions::default())?,
                dh,
            )?;
        }
        if with_grads && !defer {
            // ∂W += gᵀ · h, [V, rows]·[rows, C] (what `weight_grad_into` does when deferred).
            let dw = MatmulOptions {
                transpose_a: true,
                transpose_b: false,
            };
            gemm_accumulate_into(logits, h, GemmShape::new(v, rows, c, dw)?, &mut weight_grad)?;
        }
        first += rows;
    }
    let grads = with_grads.then_some(HeadGrads {
        hidden: hidden_grad,
        weight: if defer {
            WeightGrad::Deferred {
                logit_grads: block,
                rows_per_block,
            }
        } else {
            WeightGrad::Done(weight_grad)
        },
    });
    Ok(FusedHead {
        loss_sum,
        counted,
        grads,
    })
}
