//! Copy-in → one collective → copy-out for the unshard: the shards of every bucket written
//! into one all-gather input, the all-gathers issued (async, so the next unit's can overlap
//! this one's compute), and on wait the outputs adopted as the unsharded parameters' storage.

use super::{ParamGroup, PendingGather, buffer_dtype, check_len, host_bytes, host_bytes_mut};
use crate::bucket::SlotWriter;
use crate::error::{FsdpError, Result};
use crate::param::ParamRole;
use crate::state::ShardedState;

impl ParamGroup {
    /// Issues this unit's all-gathers without waiting (a no-op when they are in flight or the
    /// parameters are already unsharded).
    pub fn issue_unshard(&mut self) -> Result<()> {
        if self.pending_gather.is_some() || self.is_unsharded() {
            return Ok(());
        }
        let post_forward = self
            .params
            .iter()
            .any(|p| p.state == ShardedState::ShardedPostForward);
        let (plan, comm) = if post_forward {
            let comm = self
                .post_forward_comm
                .clone()
                .ok_or_else(|| FsdpError::InvalidState {
                    unit: self.unit.clone(),
                    param: String::new(),
                    op: "unshard",
                    expected: &[ShardedState::Sharded],
                    actual: ShardedState::ShardedPostForward,
                })?;
            (&self.post_forward_plan, comm)
        } else {
            (&self.gather_plan, self.mesh.shard().clone())
        };
        let _span = tracing::debug_span!("fsdp.unshard", unit = %self.unit, post_forward).entered();
        let world = comm.size();
        let pool = self.mesh.pool();
        let mut works = Vec::with_capacity(plan.len());
        for bucket in plan {
            let dtype = buffer_dtype(bucket.dtype, &self.unit)?;
            let mut input = pool.take(dtype, bucket.per_rank);
            let mut writer = SlotWriter::new(host_bytes_mut(&mut input, "unshard copy-in")?);
            let size = bucket.dtype.size_of();
            for (&member, &offset) in bucket.members.iter().zip(&bucket.offsets) {
                let param = &self.params[member];
                let start = offset * size;
                if post_forward {
                    let layout = param.post_layout.as_ref().unwrap_or(&param.layout);
                    let slot_len = layout.slot_numel()? * size;
                    let saved =
                        param
                            .post_forward
                            .as_ref()
                            .ok_or_else(|| FsdpError::InvalidState {
                                unit: self.unit.clone(),
                                param: param.name.clone(),
                                op: "unshard",
                                expected: &[ShardedState::ShardedPostForward],
                                actual: param.state,
                            })?;
                    writer
                        .region(start, slot_len, "unshard copy-in")?
                        .copy_from_slice(&saved[..slot_len]);
                } else {
                    param.assert_state(&self.unit, "unshard", &[ShardedState::Sharded])?;
                    let slot_len = param.layout.slot_numel()? * size;
                    param.layout.pack(
                        &param.sharded,
                        bucket.dtype,
                        writer.region(start, slot_len, "unshard copy-in")?,
                    )?;
                }
            }
            writer.finish();
            // The output is overwritten in full by the all-gather.
            let output = pool.take(dtype, bucket.per_rank * world);
            works.push(comm.all_gather_async(input, output));
        }
        self.pending_gather = Some(PendingGather {
            post_forward,
            works,
        });
        Ok(())
    }

    /// Waits for (or issues and waits for) the all-gathers and builds the unsharded
    /// parameters. Replicated parameters are unsharded locally.
    pub fn wait_unshard(&mut self) -> Result<()> {
        for param in &mut self.params {
            if param.role == ParamRole::Replicated && param.state != ShardedState::Unsharded {
                let full = if param.param_dtype == param.orig_dtype {
                    param.sharded.clone()
                } else {
                    param.sharded.to_dtype(param.param_dtype)?
                };
                param.unsharded = Some(full);
                param.state = ShardedState::Unsharded;
            }
        }
        if self.is_unsharded() && self.pending_gather.is_none() {
            return Ok(());
        }
        self.issue_unshard()?;
        let Some(pending) = self.pending_gather.take() else {
            return Ok(());
        };
        let _span = tracing::debug_span!("fsdp.unshard_wait", unit = %self.unit).entered();
        let plan = if pending.post_forward {
            self.post_forward_plan.clone()
        } else {
            self.gather_plan.clone()
        };
        let pool = self.mesh.pool().clone();
        for (bucket, work) in plan.iter().zip(pending.works) {
            let pair = work.wait()?;
            pool.give(pair.input);
            let output = pair.output;
            let size = bucket.dtype.size_of();
            let numels: Vec<usize> = bucket
                .members
                .iter()
                .map(|&m| self.params[m].layout.shape.iter().product())
                .collect();
            // With zero_copy the bucket's parameters are views into one flat storage, freed
            // together on reshard; otherwise each parameter owns its storage.
            // Every element of the unsharded storage is written by the copy-out below, so it
            // comes from the pool without a zero-fill; it returns there on reshard.
            let flat = if self.fusion.zero_copy && bucket.members.len() > 1 {
                Some(pool.tensor(&[numels.iter().sum::<usize>()], bucket.dtype)?)
            } else {
                None
            };
            // A bucket of one dim-0 parameter holds exactly the padded parameter in rank
            // order, so with zero_copy the parameter is a view straight into the output.
            if self.fusion.zero_copy && bucket.members.len() == 1 {
                let member = bucket.members[0];
                let layout = if pending.post_forward {
                    self.params[member]
                        .post_layout
                        .clone()
                        .unwrap_or_else(|| self.params[member].layout.clone())
                } else {
                    self.params[member].layout.clone()
                };
                if layout.dim == 0 && bucket.offsets[0] == 0 {
                    check_len(&output, bucket.per_rank * layout.world, "unshard copy-out")?;
                    let flat = pool.adopt(output, bucket.dtype)?;
                    let param = &mut self.params[member];
                    param.unsharded = Some(flat.narrow(0, 0, numels[0])?.view(&layout.shape)?);
                    param.post_forward = None;
                    param.state = ShardedState::Unsharded;
                    continue;
                }
            }
            // A large dim-0 parameter at the start of every rank block need not be copied:
            // after the other members are copied out, it is compacted in place and becomes a
            // view into the output (see `ShardLayout::compact_in_place`).
            let first = bucket.members[0];
            let first_layout = if pending.post_forward {
                self.params[first]
                    .post_layout
                    .clone()
                    .unwrap_or_else(|| self.params[first].layout.clone())
            } else {
                self.params[first].layout.clone()
            };
            let compact = flat.is_none()
                && bucket.offsets[0] == 0
                && first_layout.dim == 0
                && numels[0] * size >= crate::bucket::COMPACT_MIN_BYTES;
            let mut output = output;
            let bytes = host_bytes(&output, "unshard copy-out")?;
            let mut flat_offset = 0;
            for (position, ((&member, &offset), &numel)) in bucket
                .members
                .iter()
                .zip(&bucket.offsets)
                .zip(&numels)
                .enumerate()
            {
                if compact && position == 0 {
                    continue;
                }
                let param = &mut self.params[member];
                let layout = if pending.post_forward {
                    param
                        .post_layout
                        .clone()
                        .unwrap_or_else(|| param.layout.clone())
                } else {
                    param.layout.clone()
                };
                let world = layout.world;
                check_len(&output, bucket.per_rank * world, "unshard copy-out")?;
                let full = match &flat {
                    Some(flat) => flat.narrow(0, flat_offset, numel)?.view(&layout.shape)?,
                    None => pool.tensor(&layout.shape, bucket.dtype)?,
                };
                flat_offset += numel;
                let slot_len = layout.slot_numel()? * size;
                for rank in 0..world {
                    let start = (rank * bucket.per_rank + offset) * size;
                    layout.unpack_into_full(&bytes[start..start + slot_len], rank, &full)?;
                }
                param.unsharded = Some(full);
                param.post_forward = None;
                param.state = ShardedState::Unsharded;
            }
            if compact {
                check_len(
                    &output,
                    bucket.per_rank * first_layout.world,
                    "unshard copy-out",
                )?;
                let bytes = host_bytes_mut(&mut output, "unshard copy-out")?;
                if first_layout.compact_in_place(bytes, bucket.per_rank * size, size)? {
                    let flat = pool.adopt(output, bucket.dtype)?;
                    let param = &mut self.params[first];
                    param.unsharded =
                        Some(flat.narrow(0, 0, numels[0])?.view(&first_layout.shape)?);
                    param.post_forward = None;
                    param.state = ShardedState::Unsharded;
                    continue;
                }
                // Not a prefix layout: copy it out like the others.
                let full = pool.tensor(&first_layout.shape, bucket.dtype)?;
                let slot_len = first_layout.slot_numel()? * size;
                let bytes = host_bytes(&output, "unshard copy-out")?;
                for rank in 0..first_layout.world {
                    let start = rank * bucket.per_rank * size;
                    first_layout.unpack_into_full(&bytes[start..start + slot_len], rank, &full)?;
                }
                let param = &mut self.params[first];
                param.unsharded = Some(full);
                param.post_forward = None;
                param.state = ShardedState::Unsharded;
            }
            pool.give(output);
        }
        Ok(())
    }
}
