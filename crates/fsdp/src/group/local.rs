//! A unit whose data-parallel world is one rank: nothing to gather and nothing to reduce.
//!
//! With one rank the shard *is* the parameter and a reduce-scatter over one rank returns its
//! input, so the copy-in → collective → copy-out of the other paths would only move every
//! parameter and gradient three times per use. Here the unsharded parameter is the shard
//! itself (a cast to `param_dtype` when that differs), and the module's gradient becomes the
//! sharded gradient as it is (added into an existing one), after the same dtype steps and
//! scaling the collective would have applied. What a rank holds is then what an unsharded
//! single-process run holds: parameters once, gradients once, no communication buffers.

use hypershard_collectives::ReduceOp;
use hypershard_tensor::{DType, Tensor};

use super::ParamGroup;
use crate::error::{FsdpError, Result};
use crate::state::ShardedState;

impl ParamGroup {
    /// Whether the unit's data-parallel world is this rank alone (no replicas, no tensor
    /// parallelism), so that its parameters and gradients need no collective.
    pub(crate) fn is_single_rank(&self) -> bool {
        self.mesh.shard_world() == 1 && self.mesh.replicate().is_none() && self.tp.is_none()
    }

    /// The unshard of a one-rank unit: each parameter's unsharded form is its shard, shared
    /// (or cast to `param_dtype`).
    pub(super) fn unshard_single_rank(&mut self) -> Result<()> {
        let _span = tracing::debug_span!("fsdp.unshard_local", unit = %self.unit).entered();
        for param in &mut self.params {
            if param.state == ShardedState::Unsharded {
                continue;
            }
            // A post-forward group needs a shard group of more than one rank, so a one-rank
            // unit is never `ShardedPostForward`.
            param.assert_state(&self.unit, "unshard", &[ShardedState::Sharded])?;
            let full = if param.param_dtype == param.orig_dtype {
                param.sharded.clone()
            } else {
                param.sharded.to_dtype(param.param_dtype)?
            };
            param.unsharded = Some(full.view(&param.layout.shape)?);
            param.post_forward = None;
            param.state = ShardedState::Unsharded;
        }
        Ok(())
    }

    /// Lands parameter `index`'s unsharded gradient of a one-rank unit as its sharded
    /// gradient (the fp32 main gradient with `fp32_main_grad`): cast to `reduce_dtype` and
    /// scaled as the reduction would, then adopted when nothing holds one yet, added into the
    /// one held otherwise.
    pub(super) fn land_single_rank_grad(&mut self, index: usize, grad: Tensor) -> Result<()> {
        let op = self.reduce_scatter_op();
        let fp32_main_grad = self.mp.fp32_main_grad;
        let device = self.device;
        let param = &mut self.params[index];
        if grad.shares_storage(&param.sharded) {
            return Err(FsdpError::GradAliasesParam {
                unit: self.unit.clone(),
                param: param.name.clone(),
            });
        }
        let reduced = if grad.dtype() == param.reduce_dtype {
            grad
        } else {
            grad.to_dtype(param.reduce_dtype)?
        };
        // `Avg` over one rank divides by one and `Sum` adds nothing: only a pre-scaling
        // factor changes values.
        if let ReduceOp::PreMulSum(factor) = op {
            reduced.scale_(factor)?;
        }
        let shape = param.sharded.shape().to_vec();
        let (slot, dtype) = if fp32_main_grad {
            (&mut param.main_grad, DType::F32)
        } else {
            (&mut param.sharded_grad, param.orig_dtype)
        };
        match slot {
            Some(existing) if reduced.dtype() == existing.dtype() => existing.add_(&reduced)?,
            Some(existing) => existing.add_(&reduced.to_dtype(existing.dtype())?)?,
            None => {
                // The gradient itself when it is exactly the shard's tensor (nothing else in
                // its storage, which it would keep alive); a copy otherwise.
                let whole = reduced.offset() == 0
                    && reduced.storage().read().len() == reduced.numel() * dtype.size_of();
                let adopt = reduced.dtype() == dtype
                    && reduced.shape() == shape.as_slice()
                    && reduced.is_contiguous()
                    && whole;
                *slot = Some(if adopt {
                    reduced
                } else {
                    let target = Tensor::zeros_on(&shape, dtype, &device)?;
                    target.copy_from(&reduced)?;
                    target
                });
            }
        }
        Ok(())
    }
}
