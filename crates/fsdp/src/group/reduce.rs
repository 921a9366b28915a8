//! Gradient reduction after backward: unsharded gradients copied into one reduce-scatter
//! input per bucket, the reduce-scatters (and, for HSDP, the all-reduces over replicas, and
//! the all-reduce of replicated parameters) issued, and on finish the reduced shards
//! accumulated into the sharded gradients.

use std::collections::HashMap;

use hypershard_collectives::{Buffer, ReduceOp};
use hypershard_nn::Module;
use hypershard_tensor::{DType, Tensor};

use super::{
    ParamGroup, PendingReduce, TpGroup, buffer_dtype, check_len, host_bytes, host_bytes_mut,
};
use crate::bucket::{BucketPlan, SlotWriter};
use crate::config::GradReduceOp;
use crate::error::Result;
use crate::param::ParamRole;
use hypershard_dtensor::bridge::reclaim_buffer;

impl ParamGroup {
    pub(super) fn reduce_scatter_op(&self) -> ReduceOp {
        match (self.controls.gradient_scaling_factor, self.reduce_op) {
            (Some(factor), _) => ReduceOp::PreMulSum(factor),
            (None, GradReduceOp::Avg) => ReduceOp::Avg,
            (None, GradReduceOp::Sum) => ReduceOp::Sum,
        }
    }

    fn replicate_all_reduce_op(&self) -> ReduceOp {
        match (self.controls.gradient_scaling_factor, self.reduce_op) {
            (Some(_), _) | (None, GradReduceOp::Sum) => ReduceOp::Sum,
            (None, GradReduceOp::Avg) => ReduceOp::Avg,
        }
    }

    /// After member `member`'s wrapped backward: takes its unsharded gradients. The member
    /// whose backward runs last (member 0, the whole module of a one-module unit) then either
    /// keeps every member's gradients (no gradient sync) or issues the reduce-scatters (and
    /// the replicate-parameter all-reduce), returning them in flight. Each member's module
    /// gets its shards back when asked (`reshard_after_backward`), and the unsharded
    /// parameters are freed once no member holds them.
    pub fn post_backward(
        &mut self,
        module: &mut dyn Module,
        member: usize,
    ) -> Result<Option<PendingReduce>> {
        let _span = tracing::debug_span!("fsdp.post_backward", unit = %self.unit, member).entered();
        let sync = self.controls.requires_gradient_sync;
        let reshard = self.controls.reshard_after_backward;
        if self.members > 1 {
            self.backward_next = member.checked_sub(1);
        }
        // Take every unsharded gradient off the module, adding what earlier unsynchronised
        // micro-steps left; earlier members of a group left theirs in `collected`.
        let mut grads = std::mem::take(&mut self.collected);
        grads.resize(self.params.len(), None);
        let mut taken = Vec::new();
        {
            let Some(by_name) = self.by_name.get(member) else {
                return Ok(None);
            };
            let params = &mut self.params;
            module.visit_params_mut("", &mut |name, slot| {
                let Some(&index) = by_name.get(name) else {
                    return Ok(());
                };
                let param = &mut params[index];
                if !param.installed || !param.requires_grad {
                    return Ok(());
                }
                taken.push(index);
                let mut grad = slot.grad.take();
                if let Some(acc) = param.unsharded_grad_accum.take() {
                    grad = Some(match grad {
                        Some(g) => {
                            acc.add_(&g)?;
                            acc
                        }
                        None => acc,
                    });
                }
                if !sync && !reshard {
                    // Stay unsharded: the module keeps accumulating into the same tensor.
                    slot.grad = grad;
                } else {
                    grads[index] = grad;
                }
                Ok(())
            })?;
        }
        let single_rank = self.is_single_rank();
        if sync && single_rank {
            // Nothing to reduce over one rank: each gradient becomes the sharded gradient now,
            // before resharding hands that to the module.
            for index in taken {
                if let Some(grad) = grads[index].take() {
                    self.land_single_rank_grad(index, grad)?;
                }
            }
        } else if sync {
            // The tensors the reduced shards land in are made now, while this member's
            // module still holds the unsharded parameters, so that resharding hands them to
            // the module as its `grad` (a group's earlier members cannot be reached later).
            let fresh_ok = self.mesh.replicate().is_none() || self.controls.requires_all_reduce;
            for index in taken {
                let fresh = fresh_ok && self.params[index].role == ParamRole::Sharded;
                let target = self.grad_target(index, fresh)?;
                self.targets.insert(index, target);
            }
        }
        if reshard {
            self.uninstall(module, member)?;
        }
        if member != 0 {
            self.collected = grads;
            return Ok(None);
        }
        // The unsharded parameters go back before the copy-in: the reduce-scatter input then
        // takes the memory they held, so the unit's peak in backward is its gradients and that
        // input, not those two and its parameters as well (a third of the root's peak with
        // tied embeddings).
        if reshard && !self.any_installed() {
            self.release(false)?;
        }
        let pending = if sync && single_rank {
            None
        } else if sync {
            self.reduce_in_flight = true;
            Some(self.issue_reductions(&mut grads)?)
        } else {
            for (param, grad) in self.params.iter_mut().zip(grads) {
                if grad.is_some() {
                    param.unsharded_grad_accum = grad;
                }
            }
            None
        };
        Ok(pending)
    }

    /// The tensor the reduced gradient of parameter `index` lands in, and whether it is new.
    ///
    /// An existing gradient is added into. A new one is zeros, or, with `fresh_ok` (the
    /// caller copies the reduced shard over every element), stale pooled memory, which saves
    /// the zero-fill and the read of the add.
    fn grad_target(&mut self, index: usize, fresh_ok: bool) -> Result<(Tensor, bool)> {
        let fp32_main_grad = self.mp.fp32_main_grad;
        fn existing(param: &mut crate::param::FsdpParam, main: bool) -> &mut Option<Tensor> {
            if main {
                &mut param.main_grad
            } else {
                &mut param.sharded_grad
            }
        }
        if let Some(t) = existing(&mut self.params[index], fp32_main_grad) {
            return Ok((t.clone(), false));
        }
        let shape = self.params[index].sharded.shape().to_vec();
        let dtype = if fp32_main_grad {
            DType::F32
        } else {
            self.params[index].orig_dtype
        };
        let (target, fresh) = if fresh_ok {
            (self.scratch(&shape, dtype)?, true)
        } else {
            (Tensor::zeros_on(&shape, dtype, &self.device)?, false)
        };
        let existing = existing(&mut self.params[index], fp32_main_grad);
        *existing = Some(target.clone());
        Ok((target, fresh))
    }

    /// The reduce-scatter input made in place from the buffer that `grad`, the gradient of
    /// `bucket`'s first member, is the prefix of: when that buffer is exactly the input's size
    /// and dtype, nothing else holds it, and the member's shards are a prefix layout, its
    /// shards are moved to their rank blocks ([`ShardLayout::expand_in_place`]) and the buffer
    /// is returned, `grad` taken. Otherwise `grad` is left as it was and `None` returned.
    ///
    /// [`ShardLayout::expand_in_place`]: crate::layout::ShardLayout::expand_in_place
    fn input_from_gathered(
        &self,
        bucket: &BucketPlan,
        grad: &mut Option<Tensor>,
        shard_world: usize,
    ) -> Result<Option<Buffer>> {
        let Some(&first) = bucket.members.first() else {
            return Ok(None);
        };
        let layout = &self.params[first].layout;
        let size = bucket.dtype.size_of();
        // The in-place expansion moves host bytes: a device unit takes the copy-in.
        let fits = self.device.is_cpu()
            && grad.as_ref().is_some_and(|g| {
                g.dtype() == bucket.dtype
                    && g.shape() == layout.shape.as_slice()
                    && layout.dim == 0
                    && layout.world == shard_world
                    && g.storage().read().len() == bucket.per_rank * shard_world * size
            });
        if !fits {
            return Ok(None);
        }
        let Some(taken) = grad.take() else {
            return Ok(None);
        };
        let shape = taken.shape().to_vec();
        let numel = taken.numel();
        let whole = match taken.into_whole_storage() {
            Ok(whole) => whole,
            Err(taken) => {
                *grad = Some(taken);
                return Ok(None);
            }
        };
        let mut buffer = match reclaim_buffer(whole)? {
            Ok(buffer) => buffer,
            Err(whole) => {
                *grad = Some(whole.narrow(0, 0, numel)?.view(&shape)?);
                return Ok(None);
            }
        };
        let bytes = host_bytes_mut(&mut buffer, "reduce-scatter copy-in")?;
        if layout.expand_in_place(bytes, bucket.per_rank * size, size)? {
            return Ok(Some(buffer));
        }
        let whole = self.mesh.pool().adopt(buffer, bucket.dtype)?;
        *grad = Some(whole.narrow(0, 0, numel)?.view(&shape)?);
        Ok(None)
    }

    fn issue_reductions(&mut self, grads: &mut [Option<Tensor>]) -> Result<PendingReduce> {
        let mut targets = HashMap::new();
        let shard_comm = self.mesh.shard().clone();
        let shard_world = shard_comm.size();
        let mut reduce_scatters = Vec::with_capacity(self.reduce_plan.len());
        let op = self.reduce_scatter_op();
        let pool = self.mesh.pool().clone();
        // New gradients may skip their zero-fill when the reduced shard is copied over them
        // in this backward's finish; a deferred HSDP all-reduce leaves them untouched, so
        // they must be zeros then.
        let fresh_ok = self.mesh.replicate().is_none() || self.controls.requires_all_reduce;
        for bucket_index in 0..self.reduce_plan.len() {
            let bucket = self.reduce_plan[bucket_index].clone();
            // The gradient of the bucket's first member may already live in a buffer of the
            // input's size: the gathered buffer its parameter was a prefix of, when the model
            // accumulated the gradient there (nn's `Gpt::keep_head_grad_in_gathered_weight`).
            // That buffer is the input then, with no new memory and no copy of that member.
            let gathered = match grads.get_mut(bucket.members[0]) {
                Some(grad) if bucket.offsets.first() == Some(&0) => {
                    self.input_from_gathered(&bucket, grad, shard_world)?
                }
                _ => None,
            };
            let in_place = gathered.is_some();
            let cached = pool.stats().cached_bytes;
            let input = match gathered {
                Some(buffer) => {
                    let len = buffer.len();
                    hypershard_dtensor::bridge::buffer_to_tensor(buffer, &[len], bucket.dtype)?
                }
                None => self.bucket(bucket.dtype, bucket.per_rank * shard_world)?,
            };
            let lean = self.controls.release_buffers_after_backward;
            if lean && !in_place && cached > 0 && pool.stats().cached_bytes == cached {
                // The pool had no buffer of this size, so this one is new memory whose pages
                // the copy-in is about to fault in. What the pool holds idle is of other sizes
                // (blocks' buffers, last step's gradient shards), of no use to this unit: it
                // goes back to the allocator first, so the copy-in does not stack on top of
                // it. The root meets this every step when its gathered head weight holds the
                // head's gradient (nn's `Gpt::keep_head_grad_in_gathered_weight`): its 200 MiB
                // copy-in at GPT-2's vocabulary would otherwise be the rank's peak. A module told
                // to keep its step's buffers keeps them here too: freed here, every unit of the
                // next step would allocate its buffers again.
                pool.release_cached();
            }
            {
                // Rank-major order, so the regions come in increasing order; slots of
                // parameters without a gradient are zeroed by the writer.
                let mut writer = SlotWriter::new(&input);
                for rank in 0..shard_world {
                    for (position, (&member, &offset)) in
                        bucket.members.iter().zip(&bucket.offsets).enumerate()
                    {
                        let param = &self.params[member];
                        let slot_numel = param.layout.slot_numel()?;
                        let start = rank * bucket.per_rank + offset;
                        if in_place && position == 0 {
                            // Already in its place: claim the region so it is not zeroed.
                            writer.region(start, slot_numel, "reduce-scatter copy-in")?;
                            continue;
                        }
                        let Some(grad) = &grads[member] else {
                            continue;
                        };
                        param.layout.pack_from_full(
                            grad,
                            rank,
                            &writer.region(start, slot_numel, "reduce-scatter copy-in")?,
                        )?;
                    }
                }
                writer.finish()?;
            }
            let input = self.stage_out(input, "reduce-scatter copy-in")?;
            for &member in &bucket.members {
                let target = match self.targets.remove(&member) {
                    Some(target) => target,
                    None => self.grad_target(member, fresh_ok)?,
                };
                targets.insert(member, target);
            }
            let output = self.comm_output(bucket.dtype, bucket.per_rank)?;
            reduce_scatters.push(shard_comm.reduce_scatter_async(input, output, op));
        }
        let mut replicate_all_reduces = Vec::with_capacity(self.replicate_plan.len());
        let all_reduce_op = match (self.controls.gradient_scaling_factor, self.reduce_op) {
            (Some(factor), _) => ReduceOp::PreMulSum(factor),
            (None, GradReduceOp::Avg) => ReduceOp::Avg,
            (None, GradReduceOp::Sum) => ReduceOp::Sum,
        };
        for bucket_index in 0..self.replicate_plan.len() {
            let bucket = self.replicate_plan[bucket_index].clone();
            let flat = self.bucket(bucket.dtype, bucket.per_rank)?;
            {
                let mut writer = SlotWriter::new(&flat);
                for (&member, &offset) in bucket.members.iter().zip(&bucket.offsets) {
                    let param = &self.params[member];
                    let Some(grad) = &grads[member] else {
                        continue;
                    };
                    let slot_numel = param.layout.slot_numel()?;
                    param.layout.pack(
                        grad,
                        &writer.region(offset, slot_numel, "all-reduce copy-in")?,
                    )?;
                }
                writer.finish()?;
            }
            let buffer = self.stage_out(flat, "all-reduce copy-in")?;
            for &member in &bucket.members {
                let target = match self.targets.remove(&member) {
                    Some(target) => target,
                    None => self.grad_target(member, false)?,
                };
                targets.insert(member, target);
            }
            replicate_all_reduces.push(self.mesh.world().all_reduce_async(buffer, all_reduce_op));
        }
        Ok(PendingReduce {
            reduce_scatters,
            replicate_all_reduces,
            targets,
        })
    }

    /// Waits for a unit's reductions, runs the HSDP all-reduce (or defers it) and adds the
    /// reduced shards into the gradients.
    pub fn finish_reduce(&mut self, pending: PendingReduce) -> Result<()> {
        let _span = tracing::debug_span!("fsdp.reduce_wait", unit = %self.unit).entered();
        self.reduce_in_flight = false;
        let shard_rank = self.mesh.shard_rank();
        let PendingReduce {
            reduce_scatters,
            replicate_all_reduces,
            targets,
        } = pending;
        let pool = self.mesh.pool().clone();
        let mut outputs = Vec::with_capacity(reduce_scatters.len());
        for work in reduce_scatters {
            let pair = work.wait()?;
            pool.give(pair.input);
            outputs.push(pair.output);
        }
        let replicate = self.mesh.replicate().cloned();
        let all_reduce_op = self.replicate_all_reduce_op();
        for (bucket_index, mut output) in outputs.into_iter().enumerate() {
            let bucket = self.reduce_plan[bucket_index].clone();
            check_len(&output, bucket.per_rank, "reduce-scatter copy-out")?;
            if let Some(replicate) = &replicate {
                if let Some(partial) = self.partial_outputs[bucket_index].take() {
                    output = self.add_outputs(output, partial, bucket.dtype)?;
                }
                if !self.controls.requires_all_reduce {
                    // Nothing lands in the gradients this time; new ones must read as zeros.
                    for member in &bucket.members {
                        if let Some((target, true)) = targets.get(member) {
                            target.zero_()?;
                        }
                    }
                    self.partial_outputs[bucket_index] = Some(output);
                    continue;
                }
                let _span = tracing::debug_span!("fsdp.all_reduce", unit = %self.unit).entered();
                output = replicate.all_reduce_async(output, all_reduce_op).wait()?;
            }
            if let (Some(tail), Some(tp)) = (bucket.tp_tail, &self.tp) {
                let _span = tracing::debug_span!("fsdp.tp_all_reduce", unit = %self.unit).entered();
                tp_all_reduce_tail(&mut output, tail, &bucket, tp, &pool)?;
            }
            // The reduced shards on the unit's device (one host → device copy from a
            // device), then copied or added into the gradients there.
            let reduced = self.stage_in(output, bucket.dtype, "reduce-scatter copy-out")?;
            for (&member, &offset) in bucket.members.iter().zip(&bucket.offsets) {
                let param = &self.params[member];
                let slot_numel = param.layout.slot_numel()?;
                if let Some((target, fresh)) = targets.get(&member) {
                    param.layout.unpack_shard_into(
                        &reduced.narrow(0, offset, slot_numel)?,
                        shard_rank,
                        target,
                        !fresh,
                    )?;
                }
            }
        }
        for (bucket_index, work) in replicate_all_reduces.into_iter().enumerate() {
            let buffer = work.wait()?;
            let bucket = &self.replicate_plan[bucket_index];
            check_len(&buffer, bucket.per_rank, "all-reduce copy-out")?;
            let reduced = self.stage_in(buffer, bucket.dtype, "all-reduce copy-out")?;
            for (&member, &offset) in bucket.members.iter().zip(&bucket.offsets) {
                let param = &self.params[member];
                let slot_numel = param.layout.slot_numel()?;
                if let Some((target, fresh)) = targets.get(&member) {
                    param.layout.unpack_shard_into(
                        &reduced.narrow(0, offset, slot_numel)?,
                        0,
                        target,
                        !fresh,
                    )?;
                }
            }
        }
        Ok(())
    }
}

/// All-reduces the elements `tail..` of a reduced shard buffer (the TP-replicated members of
/// its bucket) over the TP group, in place.
fn tp_all_reduce_tail(
    output: &mut Buffer,
    tail: usize,
    bucket: &BucketPlan,
    tp: &TpGroup,
    pool: &hypershard_dtensor::BufferPool,
) -> Result<()> {
    let size = bucket.dtype.size_of();
    let len = bucket.per_rank.saturating_sub(tail);
    let mut part = pool.take(buffer_dtype(bucket.dtype, "tp all-reduce")?, len);
    host_bytes_mut(&mut part, "tp all-reduce copy-in")?
        .copy_from_slice(&host_bytes(output, "tp all-reduce copy-in")?[tail * size..]);
    let part = tp.comm.all_reduce_async(part, tp.op).wait()?;
    check_len(&part, len, "tp all-reduce copy-out")?;
    host_bytes_mut(output, "tp all-reduce copy-out")?[tail * size..]
        .copy_from_slice(host_bytes(&part, "tp all-reduce copy-out")?);
    pool.give(part);
    Ok(())
}
