//! `ParamGroup`: the parameters of one unit and the fused collectives that move them.
//!
//! Unshard = copy-in (each shard cast to `param_dtype` into its slot of one flat buffer per
//! bucket) → one all-gather per bucket → copy-out (every rank's slot into the unsharded
//! parameter). A unit whose data-parallel world is one rank skips all three (`local`).
//! Post-backward = copy-in (each unsharded gradient cast to `reduce_dtype`, cut
//! into one padded slot per rank) → one reduce-scatter per bucket → (HSDP) one all-reduce per
//! bucket over the replicate group → accumulate into the sharded gradient.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use hypershard_collectives::{Buffer, BufferPair, Communicator, ReduceOp, Work};
use hypershard_dtensor::bridge::{reducible, wire_dtype};
use hypershard_nn::Module;
use hypershard_tensor::{DType, Device, Tensor};

use crate::bucket::{BucketItem, BucketPlan, plan_buckets};
use crate::config::{CommFusionPolicy, GradReduceOp, MixedPrecisionPolicy, ReshardAfterForward};
use crate::error::{FsdpError, Result};
use crate::layout::ShardLayout;
use crate::mesh::DataParallelMesh;
use crate::param::{FsdpParam, ParamRole};
use crate::state::{ShardedState, TrainingState};

mod local;
mod reduce;
mod route;
mod unshard;

use route::CommRoute;

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
    /// Whether the root frees the idle communication buffers at the end
    /// of the last backward of a step (see `FsdpModule::set_release_buffers_after_backward`).
    pub release_buffers_after_backward: bool,
}

impl Default for Controls {
    fn default() -> Self {
        Controls {
            requires_gradient_sync: true,
            requires_all_reduce: true,
            reshard_after_backward: true,
            is_last_backward: true,
            gradient_scaling_factor: None,
            release_buffers_after_backward: true,
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
    /// Where the unit's parameters, gradients and buckets live.
    pub device: Device,
    /// How its collectives reach that memory (see [`CommRoute`]).
    route: CommRoute,
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
    pub device: Device,
}

/// The dtype FSDP's buffers of `dtype` travel as (the bridge's one map), for every dtype FSDP
/// can reduce: a `Bool` parameter is refused, since its gradient would be summed as bytes.
pub(crate) fn buffer_dtype(dtype: DType, name: &str) -> Result<hypershard_collectives::DType> {
    if !reducible(dtype) {
        return Err(FsdpError::UnsupportedDType {
            param: name.to_string(),
            dtype,
        });
    }
    Ok(wire_dtype(dtype))
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
        let route = CommRoute::choose(
            &parts.device,
            parts.mesh.world().as_ref(),
            parts.tp.is_some(),
        );
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
            device: parts.device,
            route,
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
                let slot =
                    Tensor::zeros_on(&[layout.slot_numel()?], param.param_dtype, &self.device)?;
                layout.pack_from_full(full, group_rank, &slot)?;
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

/// The post-forward policy and, for a smaller group, its size, after checking
/// `reshard_after_forward` against the shard group.
pub(crate) fn post_forward_policy(
    policy: ReshardAfterForward,
    shard_world: usize,
) -> Result<(PostForward, Option<usize>)> {
    match policy {
        ReshardAfterForward::Reshard => Ok((PostForward::Reshard, None)),
        ReshardAfterForward::Keep => Ok((PostForward::Keep, None)),
        ReshardAfterForward::ToGroupOf(size) => {
            if size == 0 || !shard_world.is_multiple_of(size) {
                return Err(FsdpError::ReshardSize {
                    value: size,
                    shard_world,
                });
            }
            if size == shard_world {
                Ok((PostForward::Reshard, None))
            } else if size == 1 {
                Ok((PostForward::Keep, None))
            } else {
                Ok((PostForward::ToGroup, Some(size)))
            }
        }
    }
}
