//! The hooks `FsdpModule` runs around the wrapped module's forward and backward: unshard,
//! prefetch, reshard, reduce-scatter.

use std::sync::Mutex;

use hypershard_tensor::Tensor;

use super::{ForwardDtypes, FsdpModule, cast_if};
use crate::error::{FsdpError, Result};
use crate::group::{ParamGroup, PostForward};
use crate::schedule::{Schedule, ScheduledUnit, lock};
use crate::state::{ShardedState, TrainingState};

/// Moves `group` to `next`, refusing a transition the state machine does not have
/// ([`TrainingState::may_enter`]).
fn enter(group: &mut ParamGroup, next: TrainingState) -> Result<()> {
    if !group.training.may_enter(next) {
        return Err(FsdpError::TrainingTransition {
            unit: group.unit.clone(),
            from: group.training,
            to: next,
        });
    }
    group.training = next;
    Ok(())
}

impl FsdpModule {
    fn prefetch(&self, targets: Vec<ScheduledUnit>) -> Result<()> {
        for target in targets {
            if target.id == self.id {
                continue;
            }
            lock(&target.group).issue_unshard()?;
        }
        Ok(())
    }

    fn explicit_targets(list: &[std::sync::Weak<Mutex<ParamGroup>>]) -> Vec<ScheduledUnit> {
        list.iter()
            .filter_map(|weak| weak.upgrade())
            .map(|group| {
                let id = lock(&group).id;
                ScheduledUnit { id, group }
            })
            .collect()
    }

    pub(super) fn forward_hooks(&mut self, schedule: &Schedule, input: &Tensor) -> Result<Tensor> {
        if self.is_root {
            schedule.begin_forward()?;
        } else if schedule.in_backward() {
            return self.recompute_forward(input);
        }
        let explicit = {
            let mut group = lock(&self.group);
            group.check_forward_order(self.member)?;
            enter(&mut group, TrainingState::Forward)?;
            // A group's later members find the parameters the first member gathered.
            group.wait_unshard()?;
            group.install(self.inner.as_mut(), self.member)?;
            group.forward_prefetch.clone()
        };
        schedule.record_pre_forward(self.id);
        let targets = match explicit {
            Some(list) => Self::explicit_targets(&list),
            None => schedule.next_in_forward(self.id).into_iter().collect(),
        };
        self.prefetch(targets)?;
        let input_dtype = input.dtype();
        let x = if self.mp.cast_forward_inputs {
            cast_if(input, self.mp.param_dtype)?
        } else {
            input.clone()
        };
        let output = self.inner.forward(&x)?;
        {
            let mut group = lock(&self.group);
            let last = group.forward_done(self.member);
            // The root keeps its parameters: backward starts with it (FSDP2's heuristic).
            if !self.is_root {
                let to_post_forward = match group.post_forward {
                    PostForward::Reshard => Some(false),
                    PostForward::ToGroup => Some(true),
                    PostForward::Keep => None,
                };
                if let Some(to_post_forward) = to_post_forward {
                    // A group frees the parameters after its last member's forward; each
                    // earlier member's module gets its shards back at once.
                    if last {
                        group.reshard(self.inner.as_mut(), self.member, to_post_forward)?;
                    } else {
                        group.uninstall(self.inner.as_mut(), self.member)?;
                    }
                }
            }
            enter(&mut group, TrainingState::Idle)?;
        }
        schedule.record_post_forward(self.id);
        self.last_dtypes = Some(ForwardDtypes {
            input: input_dtype,
            inner_output: output.dtype(),
        });
        cast_if(&output, self.mp.output_dtype)
    }

    pub(super) fn backward_hooks(
        &mut self,
        schedule: &Schedule,
        grad_output: &Tensor,
    ) -> Result<Tensor> {
        if self.is_root {
            schedule.begin_backward();
        }
        let explicit = {
            let mut group = lock(&self.group);
            group.check_backward_order(self.member)?;
            let recomputed = group.training == TrainingState::ForwardInBackward;
            enter(&mut group, TrainingState::PreBackward)?;
            if recomputed {
                // The recomputation gathered the parameters for this backward; anything else
                // would be a second all-gather.
                if let Some(param) = group
                    .params
                    .iter()
                    .find(|p| p.member == self.member && p.state != ShardedState::Unsharded)
                {
                    return Err(FsdpError::InvalidState {
                        unit: group.unit.clone(),
                        param: param.name.clone(),
                        op: "pre-backward after a recomputed forward",
                        expected: &[ShardedState::Unsharded],
                        actual: param.state,
                    });
                }
            }
            group.wait_unshard()?;
            group.install(self.inner.as_mut(), self.member)?;
            group.backward_prefetch.clone()
        };
        let targets = match explicit {
            Some(list) => Self::explicit_targets(&list),
            None => schedule.next_in_backward(self.id).into_iter().collect(),
        };
        self.prefetch(targets)?;
        let dtypes = self.last_dtypes;
        let grad = match dtypes {
            Some(d) => cast_if(grad_output, Some(d.inner_output))?,
            None => grad_output.clone(),
        };
        let grad_input = self.inner.backward(&grad)?;
        // The previous unit's reduce-scatter ran while this unit computed; finish it now.
        schedule.finish_pending()?;
        let (pending, last) = {
            let mut group = lock(&self.group);
            enter(&mut group, TrainingState::PostBackward)?;
            let pending = group.post_backward(self.inner.as_mut(), self.member)?;
            enter(&mut group, TrainingState::Idle)?;
            (pending, group.controls.is_last_backward)
        };
        if let Some(pending) = pending {
            schedule.push_pending(self.group.clone(), pending);
        }
        if self.is_root && last {
            schedule.drain()?;
            // By default the step's communication buffers go back to the allocator before the
            // optimizer step (and a checkpoint) allocate their own: cached, they would add a
            // step's worth of idle unsharded parameters and gradients to the resident peak.
            // Kept, the next step re-faults none of them (docs/fsdp.md weighs the two). nn's
            // kernel outputs stay cached either way: they are bounded by the activations'
            // own peak, and freeing them cost more time than it saved resident memory.
            let group = lock(&self.group);
            if group.controls.release_buffers_after_backward {
                group.mesh.pool().release_cached();
            }
        }
        match dtypes {
            Some(d) => cast_if(&grad_input, Some(d.input)),
            None => Ok(grad_input),
        }
    }

    /// A nested unit's forward while the root's backward runs: activation checkpointing
    /// recomputing it just before the unit's own backward (FSDP2 skips its forward hooks in
    /// the same situation). The parameters are gathered (the prefetched backward all-gather,
    /// or one issued now) and stay unsharded for the backward that follows, whose unshard is
    /// then a no-op: the unit still all-gathers once in backward. Nothing is prefetched and no
    /// forward order is recorded; the backward hooks prefetch as usual.
    fn recompute_forward(&mut self, input: &Tensor) -> Result<Tensor> {
        {
            let mut group = lock(&self.group);
            // Only the member whose backward runs next may recompute.
            group.check_backward_order(self.member)?;
            enter(&mut group, TrainingState::ForwardInBackward)?;
            group.wait_unshard()?;
            group.install(self.inner.as_mut(), self.member)?;
        }
        let input_dtype = input.dtype();
        let x = if self.mp.cast_forward_inputs {
            cast_if(input, self.mp.param_dtype)?
        } else {
            input.clone()
        };
        let output = self.inner.forward(&x)?;
        self.last_dtypes = Some(ForwardDtypes {
            input: input_dtype,
            inner_output: output.dtype(),
        });
        cast_if(&output, self.mp.output_dtype)
    }
}
