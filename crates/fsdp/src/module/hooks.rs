//! The hooks `FsdpModule` runs around the wrapped module's forward and backward: unshard,
//! prefetch, reshard, reduce-scatter.

use std::sync::Mutex;

use hypershard_tensor::Tensor;

use super::{FsdpModule, ForwardDtypes, cast_if};
use crate::error::Result;
use crate::group::{ParamGroup, PostForward};
use crate::param::TrainingState;
use crate::schedule::{Schedule, ScheduledUnit, lock};

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
        }
        let explicit = {
            let mut group = lock(&self.group);
            group.check_forward_order(self.member)?;
            group.training = TrainingState::Forward;
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
            group.training = TrainingState::Idle;
        }
        schedule.record_post_forward(self.id);
        self.last_dtypes = Some(ForwardDtypes {
            input: input_dtype,
            inner_output: output.dtype(),
        });
        cast_if(&output, self.mp.output_dtype)
    }

    pub(super) fn backward_hooks(&mut self, schedule: &Schedule, grad_output: &Tensor) -> Result<Tensor> {
        let explicit = {
            let mut group = lock(&self.group);
            group.check_backward_order(self.member)?;
            group.training = TrainingState::PreBackward;
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
            group.training = TrainingState::PostBackward;
            let pending = group.post_backward(self.inner.as_mut(), self.member)?;
            group.training = TrainingState::Idle;
            (pending, group.controls.is_last_backward)
        };
        if let Some(pending) = pending {
            schedule.push_pending(self.group.clone(), pending);
        }
        if self.is_root && last {
            schedule.drain()?;
        }
        match dtypes {
            Some(d) => cast_if(&grad_input, Some(d.input)),
            None => Ok(grad_input),
        }
    }
}
