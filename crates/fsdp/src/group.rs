//! `ParamGroup`: the parameters of one unit and the fused collectives that move them.
//!
//! Unshard = copy-in (each shard cast to `param_dtype` into its slot of one flat buffer per
//! bucket) → one all-gather per bucket → copy-out (every rank's slot into the unsharded
//! parameter). Post-backward = copy-in (each unsharded gradient cast to `reduce_dtype`, cut
//! into one padded slot per rank) → one reduce-scatter per bucket → (HSDP) one all-reduce per
//! bucket over the replicate group → accumulate into the sharded gradient.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use hypershard_collectives::{Buffer, BufferPair, Communicator, ReduceOp, Work};
use hypershard_nn::Module;
use hypershard_tensor::{DType, Tensor};

use crate::bridge::{comm_dtype, fill_zero};
use crate::bucket::{BucketItem, BucketPlan, SlotWriter, plan_buckets};
use crate::build::post_forward_policy;
use crate::config::{CommFusionPolicy, GradReduceOp, MixedPrecisionPolicy, ReshardAfterForward};
use crate::error::{FsdpError, Result};
use crate::layout::ShardLayout;
use crate::mesh::DataParallelMesh;
use crate::param::{FsdpParam, ParamRole, ShardedState, TrainingState};

/// `reshard_after_forward` after normalisation against the shard group size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PostForward {
    Reshard,
    Keep,
    ToGroup,
}

/// The per-unit switches FSDP2 exposes as `set_*` methods.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Controls {
    pub requires_gradient_sync: bool,
    pub requires_all_reduce: bool,
    pub reshard_after_backward: bool,
    pub is_last_backward: bool,
    pub gradient_scaling_factor: Option<f64>,
}

impl Default for Controls {
    fn default() -> Self {
        Controls {
            requires_gradient_sync: true,
            requires_all_reduce: true,
            reshard_after_backward: true,
            is_last_backward: true,
            gradient_scaling_factor: None,
        }
    }
}

/// All-gathers in flight for one unit.
#[derive(Debug)]
struct PendingGather {
    post_forward: bool,
    works: Vec<Work<BufferPair>>,
}

/// Gradient reductions in flight for one unit, finished by a later hook.
#[derive(Debug)]
pub(crate) struct PendingReduce {
    reduce_scatters: Vec<Work<BufferPair>>,
    replicate_all_reduces: Vec<Work<Buffer>>,
    /// The tensor each reduced gradient lands in, by parameter index, and whether it is new
    /// (stale pooled memory the reduced shard is copied over) rather than added into.
    targets: HashMap<usize, (Tensor, bool)>,
}

/// Tensor parallelism of a unit: the TP group and how TP-replicated gradients are combined.
#[derive(Clone)]
pub(crate) struct TpGroup {
    pub comm: Arc<dyn Communicator>,
    pub op: ReduceOp,
    /// The world mesh with its TP dim first and the data-parallel dim second, over which
    /// the sharded state dict's DTensors are laid out.
    pub state_mesh: hypershard_dtensor::ProcessMesh,
}

impl TpGroup {
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world(&self) -> usize {
        self.comm.size()
    }
}

/// The parameters of one unit and everything needed to move them.
pub(crate) struct ParamGroup {
    pub id: usize,
    pub unit: String,
    pub params: Vec<FsdpParam>,
    /// Per member, parameter index by name relative to that member's module.
    pub by_name: Vec<HashMap<String, usize>>,
    /// The number of modules sharing the unit (1 unless built by `fully_shard_group`).
    pub members: usize,
    /// The member whose forward runs next (groups run them in list order).
    forward_next: usize,
    /// The member whose backward runs next (reverse list order), once a forward completed.
    backward_next: Option<usize>,
    /// Unsharded gradients the group's members handed over in this backward, by parameter
    /// index, reduced together after the last member's backward.
    collected: Vec<Option<Tensor>>,
    /// The tensors reduced gradients land in, made at each member's post-backward.
    targets: HashMap<usize, (Tensor, bool)>,
    pub mesh: Arc<DataParallelMesh>,
    pub post_forward_comm: Option<Arc<dyn Communicator>>,
    pub post_forward: PostForward,
    pub mp: MixedPrecisionPolicy,
    pub fusion: CommFusionPolicy,
    pub reduce_op: GradReduceOp,
    pub gather_plan: Vec<BucketPlan>,
    pub post_forward_plan: Vec<BucketPlan>,
    pub reduce_plan: Vec<BucketPlan>,
    pub replicate_plan: Vec<BucketPlan>,
    pub controls: Controls,
    pub training: TrainingState,
    pending_gather: Option<PendingGather>,
    /// Whether this unit's reductions were issued and not yet finished.
    pub reduce_in_flight: bool,
    /// Reduce-scatter outputs summed while the replicate all-reduce is deferred.
    partial_outputs: Vec<Option<Buffer>>,
    pub forward_prefetch: Option<Vec<Weak<Mutex<ParamGroup>>>>,
    pub backward_prefetch: Option<Vec<Weak<Mutex<ParamGroup>>>>,
    /// Tensor parallelism, when configured.
    pub tp: Option<TpGroup>,
}

/// How a group is built (the fields `fully_shard` computed).
pub(crate) struct GroupParts {
    pub id: usize,
    pub unit: String,
    pub params: Vec<FsdpParam>,
    pub members: usize,
    pub mesh: Arc<DataParallelMesh>,
    pub post_forward_comm: Option<Arc<dyn Communicator>>,
    pub post_forward: PostForward,
    pub mp: MixedPrecisionPolicy,
    pub fusion: CommFusionPolicy,
    pub reduce_op: GradReduceOp,
    pub gather_plan: Vec<BucketPlan>,
    pub post_forward_plan: Vec<BucketPlan>,
    pub reduce_plan: Vec<BucketPlan>,
    pub replicate_plan: Vec<BucketPlan>,
    pub tp: Option<TpGroup>,
}

fn buffer_dtype(dtype: DType, name: &str) -> Result<hypershard_collectives::DType> {
    comm_dtype(dtype).ok_or_else(|| FsdpError::UnsupportedDType {
        param: name.to_string(),
        dtype,
    })
}

fn host_bytes_mut<'a>(buffer: &'a mut Buffer, op: &'static str) -> Result<&'a mut [u8]> {
    buffer
        .as_host_mut()
        .map(|h| h.as_bytes_mut())
        .map_err(|_| FsdpError::NotHostStorage { op })
}

fn host_bytes<'a>(buffer: &'a Buffer, op: &'static str) -> Result<&'a [u8]> {
    buffer
        .as_host()
        .map(|h| h.as_bytes())
        .map_err(|_| FsdpError::NotHostStorage { op })
}

fn check_len(buffer: &Buffer, expected: usize, op: &'static str) -> Result<()> {
    if buffer.len() != expected {
        return Err(FsdpError::BufferLength {
            op,
            expected,
            actual: buffer.len(),
        });
    }
    Ok(())
}

impl ParamGroup {
    pub fn new(parts: GroupParts) -> Self {
        let mut by_name: Vec<HashMap<String, usize>> = vec![HashMap::new(); parts.members];
        for (i, p) in parts.params.iter().enumerate() {
            if let Some(map) = by_name.get_mut(p.member) {
                map.insert(p.name.clone(), i);
            }
        }
        let partial_outputs = parts.reduce_plan.iter().map(|_| None).collect();
        ParamGroup {
            id: parts.id,
            unit: parts.unit,
            params: parts.params,
            by_name,
            members: parts.members,
            forward_next: 0,
            backward_next: None,
            collected: Vec::new(),
            targets: HashMap::new(),
            mesh: parts.mesh,
            post_forward_comm: parts.post_forward_comm,
            post_forward: parts.post_forward,
            mp: parts.mp,
            fusion: parts.fusion,
            reduce_op: parts.reduce_op,
            gather_plan: parts.gather_plan,
            post_forward_plan: parts.post_forward_plan,
            reduce_plan: parts.reduce_plan,
            replicate_plan: parts.replicate_plan,
            controls: Controls::default(),
            training: TrainingState::Idle,
            pending_gather: None,
            reduce_in_flight: false,
            partial_outputs,
            forward_prefetch: None,
            backward_prefetch: None,
            tp: parts.tp,
        }
    }

    /// Checks that the post-forward policy can change now: every parameter resharded, no
    /// all-gather in flight, `size` valid for the shard group.
    pub fn check_post_forward_change(&self, policy: ReshardAfterForward) -> Result<()> {
        post_forward_policy(policy, self.mesh.shard_world())?;
        if self.pending_gather.is_some() {
            return Err(FsdpError::InvalidState {
                unit: self.unit.clone(),
                param: String::new(),
                op: "set_reshard_after_forward",
                expected: &[ShardedState::Sharded],
                actual: ShardedState::Unsharded,
            });
        }
        for param in &self.params {
            if param.role == ParamRole::Sharded {
                param.assert_state(
                    &self.unit,
                    "set_reshard_after_forward",
                    &[ShardedState::Sharded],
                )?;
            }
        }
        Ok(())
    }

    /// Switches the post-forward policy (after [`check_post_forward_change`]): recomputes
    /// the smaller-group layouts and buckets, splitting that group off the shard group on
    /// first use (collective).
    ///
    /// [`check_post_forward_change`]: Self::check_post_forward_change
    pub fn set_post_forward(&mut self, policy: ReshardAfterForward) -> Result<()> {
        let (post_forward, size) = post_forward_policy(policy, self.mesh.shard_world())?;
        let comm = match size {
            Some(size) => Some(self.mesh.post_forward_group(size)?),
            None => None,
        };
        let mut items = Vec::new();
        for (index, param) in self.params.iter_mut().enumerate() {
            param.post_layout = match (param.role, size) {
                (ParamRole::Sharded, Some(size)) => Some(ShardLayout {
                    shape: param.layout.shape.clone(),
                    dim: param.layout.dim,
                    world: size,
                }),
                _ => None,
            };
            if let Some(layout) = &param.post_layout {
                items.push(BucketItem {
                    index,
                    dtype: param.param_dtype,
                    slot_numel: layout.slot_numel()?,
                });
            }
        }
        self.post_forward_plan =
            plan_buckets(&items, self.fusion.enabled, self.fusion.bucket_bytes);
        self.post_forward_comm = comm;
        self.post_forward = post_forward;
        Ok(())
    }

    /// Whether every sharded parameter is unsharded (or there are none).
    fn is_unsharded(&self) -> bool {
        self.params
            .iter()
            .all(|p| p.state == ShardedState::Unsharded)
    }

    /// Whether an all-gather is in flight.
    pub fn gather_in_flight(&self) -> bool {
        self.pending_gather.is_some()
    }

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

    /// Makes member `member`'s module hold its unsharded parameters (stashing the sharded
    /// gradients). A unit of one module has the single member 0.
    pub fn install(&mut self, module: &mut dyn Module, member: usize) -> Result<()> {
        let unit = self.unit.clone();
        let mut seen = vec![false; self.params.len()];
        let Some(by_name) = self.by_name.get(member) else {
            return Ok(());
        };
        let params = &mut self.params;
        let mut failure: Option<FsdpError> = None;
        module.visit_params_mut("", &mut |name, slot| {
            let Some(&index) = by_name.get(name) else {
                return Ok(());
            };
            seen[index] = true;
            let param = &mut params[index];
            if param.installed || failure.is_some() {
                return Ok(());
            }
            let Some(unsharded) = param.unsharded.clone() else {
                failure = Some(FsdpError::InvalidState {
                    unit: unit.clone(),
                    param: param.name.clone(),
                    op: "install",
                    expected: &[ShardedState::Unsharded],
                    actual: param.state,
                });
                return Ok(());
            };
            let same = slot.data.as_ref().is_some_and(|d| {
                d.shares_storage(&param.sharded) && d.shape() == param.sharded.shape()
            });
            if !same {
                failure = Some(FsdpError::ParamReplaced {
                    param: param.name.clone(),
                });
                return Ok(());
            }
            param.sharded_grad = slot.grad.take();
            slot.data = Some(unsharded);
            param.installed = true;
            Ok(())
        })?;
        if let Some(error) = failure {
            return Err(error);
        }
        self.check_seen(&seen, member)
    }

    /// Fails with `ParamMissing` for the first parameter of `member` the visit did not see.
    fn check_seen(&self, seen: &[bool], member: usize) -> Result<()> {
        let missing = self
            .params
            .iter()
            .zip(seen)
            .find(|(p, seen)| p.member == member && !**seen);
        match missing {
            Some((param, _)) => Err(FsdpError::ParamMissing {
                unit: self.unit.clone(),
                param: param.name.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Whether any member's module holds an unsharded parameter.
    pub fn any_installed(&self) -> bool {
        self.params.iter().any(|p| p.installed)
    }

    /// Makes member `member`'s module hold its shards again. The unsharded parameters stay
    /// alive in the group until [`release`](Self::release).
    pub fn uninstall(&mut self, module: &mut dyn Module, member: usize) -> Result<()> {
        let Some(by_name) = self.by_name.get(member) else {
            return Ok(());
        };
        let params = &mut self.params;
        let mut seen = vec![false; params.len()];
        module.visit_params_mut("", &mut |name, slot| {
            let Some(&index) = by_name.get(name) else {
                return Ok(());
            };
            seen[index] = true;
            let param = &mut params[index];
            if !param.installed {
                return Ok(());
            }
            // A gradient still on the unsharded parameter (a manual reshard between
            // micro-steps) is kept for the next synchronised backward.
            if let Some(grad) = slot.grad.take() {
                match param.unsharded_grad_accum.take() {
                    Some(acc) => {
                        acc.add_(&grad)?;
                        param.unsharded_grad_accum = Some(acc);
                    }
                    None => param.unsharded_grad_accum = Some(grad),
                }
            }
            slot.data = Some(param.sharded.clone());
            slot.grad = param.sharded_grad.take();
            param.installed = false;
            Ok(())
        })?;
        self.check_seen(&seen, member)
    }

    /// Frees the unsharded parameters, which no module may hold any more; with
    /// `to_post_forward` (and `reshard_after_forward = int`), keeps the larger post-forward
    /// shard for backward first.
    pub fn release(&mut self, to_post_forward: bool) -> Result<()> {
        let to_post_forward = to_post_forward && self.post_forward == PostForward::ToGroup;
        if to_post_forward {
            let group_rank =
                self.mesh.shard_rank() % self.post_forward_comm.as_ref().map_or(1, |c| c.size());
            for param in &mut self.params {
                if param.role != ParamRole::Sharded || param.state != ShardedState::Unsharded {
                    continue;
                }
                let (Some(layout), Some(full)) = (&param.post_layout, &param.unsharded) else {
                    continue;
                };
                let mut slot = vec![0u8; layout.slot_numel()? * param.param_dtype.size_of()];
                layout.pack_from_full(full, group_rank, param.param_dtype, &mut slot)?;
                param.post_forward = Some(slot);
            }
        }
        for param in &mut self.params {
            if param.state != ShardedState::Unsharded {
                continue;
            }
            param.unsharded = None;
            param.state = if to_post_forward && param.post_forward.is_some() {
                ShardedState::ShardedPostForward
            } else {
                ShardedState::Sharded
            };
        }
        Ok(())
    }

    /// Makes member `member`'s module hold its shards again and, once no member holds an
    /// unsharded parameter, frees them (see [`release`](Self::release)). For a unit of one
    /// module this is the whole reshard.
    pub fn reshard(
        &mut self,
        module: &mut dyn Module,
        member: usize,
        to_post_forward: bool,
    ) -> Result<()> {
        self.uninstall(module, member)?;
        if !self.any_installed() {
            self.release(to_post_forward)?;
        }
        Ok(())
    }

    /// Waits for and discards an all-gather nobody consumed (a prefetch for a unit whose
    /// hook never ran), so the communicator stays in step and memory is freed.
    pub fn discard_pending_gather(&mut self) -> Result<()> {
        if let Some(pending) = self.pending_gather.take() {
            for work in pending.works {
                let pair = work.wait()?;
                self.mesh.pool().give(pair.input);
                self.mesh.pool().give(pair.output);
            }
        }
        // A post-forward shard whose backward never ran would go stale once the optimizer
        // steps, so it is dropped; the module already holds the regular shard.
        for param in &mut self.params {
            if param.state == ShardedState::ShardedPostForward {
                param.post_forward = None;
                param.state = ShardedState::Sharded;
            }
        }
        Ok(())
    }

    fn reduce_scatter_op(&self) -> ReduceOp {
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

    /// Checks that member `member`'s forward may run now (a group runs its members'
    /// forwards in list order; a unit of one module always may).
    pub fn check_forward_order(&self, member: usize) -> Result<()> {
        if self.members == 1 {
            return Ok(());
        }
        // A new forward may not start while a backward is half done: the gradients the
        // earlier members already handed over would be mixed with the new step's.
        let backward_half_done = self
            .backward_next
            .is_some_and(|next| next + 1 < self.members);
        let expected = if member != self.forward_next {
            Some(self.forward_next)
        } else if member == 0 && backward_half_done {
            None
        } else {
            return Ok(());
        };
        Err(FsdpError::GroupOrder {
            unit: self.unit.clone(),
            op: "forward",
            member,
            expected,
        })
    }

    /// Records that member `member`'s forward finished; returns whether it was the last.
    pub fn forward_done(&mut self, member: usize) -> bool {
        if self.members == 1 {
            return true;
        }
        let last = member + 1 == self.members;
        self.forward_next = if last { 0 } else { member + 1 };
        if last {
            self.backward_next = Some(member);
        }
        last
    }

    /// Checks that member `member`'s backward may run now (a group runs its members'
    /// backwards in reverse list order, after a complete forward).
    pub fn check_backward_order(&self, member: usize) -> Result<()> {
        if self.members == 1 || self.backward_next == Some(member) {
            return Ok(());
        }
        Err(FsdpError::GroupOrder {
            unit: self.unit.clone(),
            op: "backward",
            member,
            expected: self.backward_next,
        })
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
        if sync {
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
        let pending = if sync {
            self.reduce_in_flight = true;
            Some(self.issue_reductions(&grads)?)
        } else {
            for (param, grad) in self.params.iter_mut().zip(grads) {
                if grad.is_some() {
                    param.unsharded_grad_accum = grad;
                }
            }
            None
        };
        if reshard && !self.any_installed() {
            self.release(false)?;
        }
        Ok(pending)
    }

    /// The tensor the reduced gradient of parameter `index` lands in, and whether it is new.
    ///
    /// An existing gradient is added into. A new one is zeros, or, with `fresh_ok` (the
    /// caller copies the reduced shard over every element), stale pooled memory, which saves
    /// the zero-fill and the read of the add.
    fn grad_target(&mut self, index: usize, fresh_ok: bool) -> Result<(Tensor, bool)> {
        let pool = self.mesh.pool().clone();
        let param = &mut self.params[index];
        let shape = param.sharded.shape().to_vec();
        let (existing, dtype) = if self.mp.fp32_main_grad {
            (&mut param.main_grad, DType::F32)
        } else {
            (&mut param.sharded_grad, param.orig_dtype)
        };
        if let Some(t) = existing {
            return Ok((t.clone(), false));
        }
        let (target, fresh) = if fresh_ok {
            (pool.tensor(&shape, dtype)?, true)
        } else {
            (Tensor::zeros(&shape, dtype)?, false)
        };
        *existing = Some(target.clone());
        Ok((target, fresh))
    }

    fn issue_reductions(&mut self, grads: &[Option<Tensor>]) -> Result<PendingReduce> {
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
            let dtype = buffer_dtype(bucket.dtype, &self.unit)?;
            let size = bucket.dtype.size_of();
            let mut input = pool.take(dtype, bucket.per_rank * shard_world);
            {
                // Rank-major order, so the regions come in increasing order; slots of
                // parameters without a gradient are zeroed by the writer.
                let mut writer =
                    SlotWriter::new(host_bytes_mut(&mut input, "reduce-scatter copy-in")?);
                for rank in 0..shard_world {
                    for (&member, &offset) in bucket.members.iter().zip(&bucket.offsets) {
                        let param = &self.params[member];
                        let Some(grad) = &grads[member] else {
                            continue;
                        };
                        let slot_len = param.layout.slot_numel()? * size;
                        let start = (rank * bucket.per_rank + offset) * size;
                        param.layout.pack_from_full(
                            grad,
                            rank,
                            bucket.dtype,
                            writer.region(start, slot_len, "reduce-scatter copy-in")?,
                        )?;
                    }
                }
                writer.finish();
            }
            for &member in &bucket.members {
                let target = match self.targets.remove(&member) {
                    Some(target) => target,
                    None => self.grad_target(member, fresh_ok)?,
                };
                targets.insert(member, target);
            }
            let output = pool.take(dtype, bucket.per_rank);
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
            let dtype = buffer_dtype(bucket.dtype, &self.unit)?;
            let size = bucket.dtype.size_of();
            let mut buffer = pool.take(dtype, bucket.per_rank);
            {
                let mut writer =
                    SlotWriter::new(host_bytes_mut(&mut buffer, "all-reduce copy-in")?);
                for (&member, &offset) in bucket.members.iter().zip(&bucket.offsets) {
                    let param = &self.params[member];
                    let Some(grad) = &grads[member] else {
                        continue;
                    };
                    let slot_len = param.layout.slot_numel()? * size;
                    let start = offset * size;
                    param.layout.pack(
                        grad,
                        bucket.dtype,
                        writer.region(start, slot_len, "all-reduce copy-in")?,
                    )?;
                }
                writer.finish();
            }
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
                    add_buffers(&mut output, &partial, bucket.dtype)?;
                }
                if !self.controls.requires_all_reduce {
                    // Nothing lands in the gradients this time; new ones must read as zeros.
                    for member in &bucket.members {
                        if let Some((target, true)) = targets.get(member) {
                            fill_zero(target)?;
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
            let bytes = host_bytes(&output, "reduce-scatter copy-out")?;
            let size = bucket.dtype.size_of();
            for (&member, &offset) in bucket.members.iter().zip(&bucket.offsets) {
                let param = &self.params[member];
                let slot_len = param.layout.slot_numel()? * size;
                let start = offset * size;
                if let Some((target, fresh)) = targets.get(&member) {
                    param.layout.unpack_shard_into(
                        &bytes[start..start + slot_len],
                        shard_rank,
                        bucket.dtype,
                        target,
                        !fresh,
                    )?;
                }
            }
            pool.give(output);
        }
        for (bucket_index, work) in replicate_all_reduces.into_iter().enumerate() {
            let buffer = work.wait()?;
            let bucket = &self.replicate_plan[bucket_index];
            check_len(&buffer, bucket.per_rank, "all-reduce copy-out")?;
            let bytes = host_bytes(&buffer, "all-reduce copy-out")?;
            let size = bucket.dtype.size_of();
            for (&member, &offset) in bucket.members.iter().zip(&bucket.offsets) {
                let param = &self.params[member];
                let slot_len = param.layout.slot_numel()? * size;
                let start = offset * size;
                if let Some((target, fresh)) = targets.get(&member) {
                    param.layout.unpack_shard_into(
                        &bytes[start..start + slot_len],
                        0,
                        bucket.dtype,
                        target,
                        !fresh,
                    )?;
                }
            }
            pool.give(buffer);
        }
        Ok(())
    }

    /// Drops every gradient the unit holds outside the module (unsynchronised accumulation,
    /// deferred all-reduce partials, stashed shards, main grads).
    pub fn clear_grads(&mut self) {
        for param in &mut self.params {
            param.unsharded_grad_accum = None;
            param.sharded_grad = None;
            param.main_grad = None;
        }
        for partial in &mut self.partial_outputs {
            *partial = None;
        }
        self.collected.clear();
        self.targets.clear();
    }
}

/// All-reduces the elements `tail..` of a reduced shard buffer (the TP-replicated members of
/// its bucket) over the TP group, in place.
fn tp_all_reduce_tail(
    output: &mut Buffer,
    tail: usize,
    bucket: &BucketPlan,
    tp: &TpGroup,
    pool: &crate::bucket::BufferPool,
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

/// `acc += other` elementwise for two host buffers of one dtype.
fn add_buffers(acc: &mut Buffer, other: &Buffer, dtype: DType) -> Result<()> {
    check_len(other, acc.len(), "partial reduce-scatter sum")?;
    let shape = [acc.len()];
    let a = Tensor::from_bytes(host_bytes(acc, "partial sum")?, &shape, dtype)?;
    let b = Tensor::from_bytes(host_bytes(other, "partial sum")?, &shape, dtype)?;
    a.add_(&b)?;
    crate::bridge::with_bytes(&a, |bytes| -> Result<()> {
        host_bytes_mut(acc, "partial sum")?.copy_from_slice(bytes);
        Ok(())
    })??;
    Ok(())
}
