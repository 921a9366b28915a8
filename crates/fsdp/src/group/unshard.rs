//! Copy-in → one collective → copy-out for the unshard: the shards of every bucket written
//! into one all-gather input, the all-gathers issued (async, so the next unit's can overlap
//! this one's compute), and on wait the outputs adopted as the unsharded parameters' storage.

use super::{ParamGroup, PendingGather, check_len, host_bytes_mut};
use crate::bucket::SlotWriter;
use crate::error::{FsdpError, Result};
use crate::param::ParamRole;
use crate::state::ShardedState;

impl ParamGroup {
    /// Issues this unit's all-gathers without waiting (a no-op when they are in flight or the
    /// parameters are already unsharded).
    pub fn issue_unshard(&mut self) -> Result<()> {
        // A one-rank unit has nothing to gather: its unshard happens on wait.
        if self.pending_gather.is_some() || self.is_unsharded() || self.is_single_rank() {
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
        let mut works = Vec::with_capacity(plan.len());
        for bucket in plan {
            // Copy-in on the unit's device, then the one staging copy the backend needs.
            let flat = self.bucket(bucket.dtype, bucket.per_rank)?;
            let mut writer = SlotWriter::new(&flat);
            for (&member, &offset) in bucket.members.iter().zip(&bucket.offsets) {
                let param = &self.params[member];
                if post_forward {
                    let layout = param.post_layout.as_ref().unwrap_or(&param.layout);
                    let slot_numel = layout.slot_numel()?;
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
                        .region(offset, slot_numel, "unshard copy-in")?
                        .copy_from(&saved.narrow(0, 0, slot_numel)?)?;
                } else {
                    param.assert_state(&self.unit, "unshard", &[ShardedState::Sharded])?;
                    let slot_numel = param.layout.slot_numel()?;
                    param.layout.pack(
                        &param.sharded,
                        &writer.region(offset, slot_numel, "unshard copy-in")?,
                    )?;
                }
            }
            writer.finish()?;
            let input = self.stage_out(flat, "unshard copy-in")?;
            // The output is overwritten in full by the all-gather.
            let output = self.comm_output(bucket.dtype, bucket.per_rank * world)?;
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
        if self.is_single_rank() {
            return self.unshard_single_rank();
        }
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
            let mut output = pair.output;
            let size = bucket.dtype.size_of();
            let numels: Vec<usize> = bucket
                .members
                .iter()
                .map(|&m| self.params[m].layout.shape.iter().product())
                .collect();
            let layouts: Vec<_> = bucket
                .members
                .iter()
                .map(|&m| {
                    let param = &self.params[m];
                    match (pending.post_forward, &param.post_layout) {
                        (true, Some(layout)) => layout.clone(),
                        _ => param.layout.clone(),
                    }
                })
                .collect();
            for layout in &layouts {
                check_len(&output, bucket.per_rank * layout.world, "unshard copy-out")?;
            }
            // A bucket of one dim-0 parameter holds exactly the padded parameter in rank
            // order, so with zero_copy the parameter is a view straight into the output.
            let single_view = self.fusion.zero_copy
                && bucket.members.len() == 1
                && layouts[0].dim == 0
                && bucket.offsets[0] == 0;
            // A large dim-0 parameter at the start of every rank block need not be copied on
            // the host: after the other members are copied out, it is compacted in place and
            // becomes a view into the output (see `ShardLayout::compact_in_place`). The
            // compaction moves host bytes, so a device unit copies that member out instead.
            let flat_members = self.fusion.zero_copy && bucket.members.len() > 1;
            let compact = self.device.is_cpu()
                && !single_view
                && !flat_members
                && bucket.offsets[0] == 0
                && layouts[0].dim == 0
                && numels[0] * size >= crate::bucket::COMPACT_MIN_BYTES;
            // With more than one member, the compacting one is copied out after the others
            // (they sit in its way) and then compacted; until then the output is viewed
            // without a way home, so taking it back keeps its loan. A lone member is
            // compacted at once.
            let defer_first = compact && bucket.members.len() > 1;
            let compacted = compact
                && !defer_first
                && layouts[0].compact_in_place(
                    host_bytes_mut(&mut output, "unshard copy-out")?,
                    bucket.per_rank * size,
                    size,
                )?;
            // The gather output on the unit's device: adopted on the host, one host → device
            // copy onto a device.
            let gathered = if defer_first {
                let len = output.len();
                hypershard_dtensor::bridge::buffer_to_tensor(output, &[len], bucket.dtype)?
            } else {
                self.stage_in(output, bucket.dtype, "unshard copy-out")?
            };
            if single_view || compacted {
                let param = &mut self.params[bucket.members[0]];
                param.unsharded = Some(gathered.narrow(0, 0, numels[0])?.view(&layouts[0].shape)?);
                param.post_forward = None;
                param.state = ShardedState::Unsharded;
                continue;
            }
            // With zero_copy the bucket's parameters are views into one flat storage, freed
            // together on reshard; otherwise each parameter owns its storage.
            // Every element of the unsharded storage is written by the copy-out below, so it
            // comes from the pool without a zero-fill; it returns there on reshard.
            let flat = if flat_members {
                Some(self.scratch(&[numels.iter().sum::<usize>()], bucket.dtype)?)
            } else {
                None
            };
            let mut flat_offset = 0;
            for (position, ((&member, &offset), &numel)) in bucket
                .members
                .iter()
                .zip(&bucket.offsets)
                .zip(&numels)
                .enumerate()
            {
                if defer_first && position == 0 {
                    continue;
                }
                let layout = &layouts[position];
                let full = match &flat {
                    Some(flat) => flat.narrow(0, flat_offset, numel)?.view(&layout.shape)?,
                    None => self.scratch(&layout.shape, bucket.dtype)?,
                };
                flat_offset += numel;
                let slot_numel = layout.slot_numel()?;
                for rank in 0..layout.world {
                    let start = rank * bucket.per_rank + offset;
                    layout.unpack_into_full(
                        &gathered.narrow(0, start, slot_numel)?,
                        rank,
                        &full,
                    )?;
                }
                let param = &mut self.params[member];
                param.unsharded = Some(full);
                param.post_forward = None;
                param.state = ShardedState::Unsharded;
            }
            if defer_first {
                let first = bucket.members[0];
                let layout = &layouts[0];
                // The output is the pool's buffer again (nothing else holds it now).
                let mut output = match hypershard_dtensor::bridge::reclaim_buffer(gathered)? {
                    Ok(buffer) => buffer,
                    Err(tensor) => hypershard_dtensor::bridge::tensor_to_buffer(&tensor)?,
                };
                let bytes = host_bytes_mut(&mut output, "unshard copy-out")?;
                let gathered = if layout.compact_in_place(bytes, bucket.per_rank * size, size)? {
                    let gathered = pool.adopt(output, bucket.dtype)?;
                    let param = &mut self.params[first];
                    param.unsharded = Some(gathered.narrow(0, 0, numels[0])?.view(&layout.shape)?);
                    param.post_forward = None;
                    param.state = ShardedState::Unsharded;
                    continue;
                } else {
                    pool.adopt(output, bucket.dtype)?
                };
                // Not a prefix layout: copy it out like the others.
                let full = self.scratch(&layout.shape, bucket.dtype)?;
                let slot_numel = layout.slot_numel()?;
                for rank in 0..layout.world {
                    let start = rank * bucket.per_rank;
                    layout.unpack_into_full(
                        &gathered.narrow(0, start, slot_numel)?,
                        rank,
                        &full,
                    )?;
                }
                let param = &mut self.params[first];
                param.unsharded = Some(full);
                param.post_forward = None;
                param.state = ShardedState::Unsharded;
            }
        }
        Ok(())
    }
}
