//! `fully_shard` and `FsdpModule`, the wrapper whose forward and backward run the hooks.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hypershard_nn::{ChildVisitorMut, Identity, Module, ParamVisitor, ParamVisitorMut};
use hypershard_tensor::{DType, Tensor};

use crate::build::build_group;
use crate::config::{FullyShardConfig, MixedPrecisionPolicy, ReshardAfterForward};
use crate::error::{FsdpError, Result};
use crate::group::ParamGroup;
use crate::param::{FsdpParamInfo, ParamRole};
use crate::schedule::{Schedule, ScheduledUnit, lock};
use crate::state::{ShardedState, TrainingState};

mod clip;
mod hooks;

/// Unit ids: unique in the process, so the schedule can tell units apart.
static NEXT_UNIT_ID: AtomicUsize = AtomicUsize::new(0);

/// A module wrapped by [`fully_shard`]: it holds only its local shards between uses and runs
/// FSDP's hooks around the wrapped module's `forward` and `backward`.
///
/// It implements [`Module`] transparently: parameter names, children and shapes seen through
/// it are those of the wrapped module (shards while resharded). Its inherent
/// [`forward`](FsdpModule::forward) and [`backward`](FsdpModule::backward) return the typed
/// [`FsdpError`]; through the `Module` trait, a failure in a unit's own hook is recorded and
/// the root's inherent method returns it.
pub struct FsdpModule {
    inner: Box<dyn Module>,
    group: Arc<Mutex<ParamGroup>>,
    /// Which module of the group `inner` is (0 for a unit of one module).
    member: usize,
    id: usize,
    schedule: Option<Arc<Schedule>>,
    is_root: bool,
    mp: MixedPrecisionPolicy,
    /// The dtypes of the last forward's input and of the wrapped module's output, so backward
    /// can cast the gradients back.
    last_dtypes: Option<ForwardDtypes>,
}

#[derive(Debug, Clone, Copy)]
struct ForwardDtypes {
    input: DType,
    inner_output: DType,
}

/// A module `fully_shard` refused, handed back with the reason.
pub struct Rejected {
    /// Why.
    pub error: FsdpError,
    /// The module, unchanged.
    pub module: Box<dyn Module>,
}

impl std::fmt::Debug for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rejected")
            .field("error", &self.error)
            .field("module", &self.module.kind())
            .finish()
    }
}

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fully_shard refused {}: {}",
            self.module.kind(),
            self.error
        )
    }
}

impl std::error::Error for Rejected {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<Rejected> for FsdpError {
    fn from(rejected: Rejected) -> Self {
        rejected.error
    }
}

/// A reference to a unit that stays valid after the unit moved into its parent: for the
/// explicit prefetch lists and for inspecting state.
#[derive(Clone)]
pub struct UnitHandle {
    id: usize,
    member: usize,
    group: Arc<Mutex<ParamGroup>>,
}

impl UnitHandle {
    /// The unit's id.
    pub fn id(&self) -> usize {
        self.id
    }

    /// The unit's managed parameters and their states (for a member of a group, those of
    /// its own module).
    pub fn params(&self) -> Vec<FsdpParamInfo> {
        param_infos(&lock(&self.group), self.member)
    }

    /// The unit's training state.
    pub fn training_state(&self) -> TrainingState {
        lock(&self.group).training
    }

    /// Whether the unit's all-gather was issued (a prefetch) and not yet consumed.
    pub fn gather_in_flight(&self) -> bool {
        lock(&self.group).gather_in_flight()
    }

    /// Whether the unit's gradient reductions were issued and not yet finished.
    pub fn reduction_in_flight(&self) -> bool {
        lock(&self.group).reduce_in_flight
    }

    /// Whether every managed parameter is unsharded (false for a unit without parameters).
    pub fn is_unsharded(&self) -> bool {
        let group = lock(&self.group);
        !group.params.is_empty()
            && group
                .params
                .iter()
                .all(|p| p.state == ShardedState::Unsharded)
    }
}

impl std::fmt::Debug for UnitHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnitHandle").field("id", &self.id).finish()
    }
}

fn param_infos(group: &ParamGroup, member: usize) -> Vec<FsdpParamInfo> {
    group
        .params
        .iter()
        .filter(|p| p.member == member)
        .map(|p| FsdpParamInfo {
            name: p.name.clone(),
            global_shape: match (&p.tp, p.role) {
                (Some(tp), _) => tp.global_shape.clone(),
                (None, ParamRole::Replicated) => p.sharded.shape().to_vec(),
                (None, ParamRole::Sharded) => p.layout.shape.clone(),
            },
            tp_placement: p.tp.as_ref().map(|tp| tp.placement),
            local_shape: p.sharded.shape().to_vec(),
            shard_dim: p.layout.dim,
            replicated: p.role == ParamRole::Replicated,
            state: p.state,
        })
        .collect()
}

/// Wraps `module` as one FSDP unit over `config.mesh`: its parameters (except those already
/// in nested units and the ignored ones) are cut into local shards now, and gathered around
/// each forward and backward. Every rank calls it alike (it may split communicators).
///
/// On refusal the module comes back unchanged inside [`Rejected`].
pub fn fully_shard(
    mut module: Box<dyn Module>,
    config: FullyShardConfig,
) -> std::result::Result<FsdpModule, Rejected> {
    let id = NEXT_UNIT_ID.fetch_add(1, Ordering::Relaxed);
    match build_group::<FsdpModule>(std::slice::from_mut(&mut module), &config, id) {
        Ok(parts) => Ok(FsdpModule {
            inner: module,
            group: Arc::new(Mutex::new(ParamGroup::new(parts))),
            member: 0,
            id,
            schedule: None,
            is_root: false,
            mp: config.mp_policy,
            last_dtypes: None,
        }),
        Err(error) => Err(Rejected { error, module }),
    }
}

/// Modules `fully_shard_group` refused, handed back unchanged with the reason.
pub struct RejectedGroup {
    /// Why ([`FsdpError::GroupMember`] names the module concerned).
    pub error: FsdpError,
    /// The modules, unchanged and in their order.
    pub modules: Vec<Box<dyn Module>>,
}

impl std::fmt::Debug for RejectedGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kinds: Vec<&str> = self.modules.iter().map(|m| m.kind()).collect();
        f.debug_struct("RejectedGroup")
            .field("error", &self.error)
            .field("modules", &kinds)
            .finish()
    }
}

impl std::fmt::Display for RejectedGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fully_shard_group refused {} modules: {}",
            self.modules.len(),
            self.error
        )
    }
}

impl std::error::Error for RejectedGroup {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<Box<RejectedGroup>> for FsdpError {
    fn from(rejected: Box<RejectedGroup>) -> Self {
        rejected.error
    }
}

/// Wraps a list of modules as **one** unit (FSDP2's `fully_shard([m1, m2])`): their
/// parameters share one `ParamGroup`, so one all-gather per bucket serves them all, and one
/// reduce-scatter per bucket reduces their gradients. Returns one [`FsdpModule`] per module,
/// in order, to put back where each module lived.
///
/// The members' forwards must run in list order, once each per step: the all-gather runs at
/// the first member's pre-forward, the parameters are resharded after the last member's
/// forward, and the gradients of every member are reduced after the first member's backward
/// (the last to run; backwards run in reverse list order). Anything else gives
/// [`FsdpError::GroupOrder`]. When the unit reshards after forward, each member's module
/// holds its shards again from its own post-forward on, while the group keeps the unsharded
/// parameters until the last member is done with them.
///
/// A module that is already a unit (wrapped, or a member of another group) is refused with
/// [`FsdpError::GroupMember`] wrapping [`FsdpError::AlreadySharded`]; an empty list with
/// [`FsdpError::EmptyGroup`]. On refusal the modules come back unchanged (boxed, because
/// the list makes the refusal large).
pub fn fully_shard_group(
    mut modules: Vec<Box<dyn Module>>,
    config: FullyShardConfig,
) -> std::result::Result<Vec<FsdpModule>, Box<RejectedGroup>> {
    let ids: Vec<usize> = modules
        .iter()
        .map(|_| NEXT_UNIT_ID.fetch_add(1, Ordering::Relaxed))
        .collect();
    match build_group::<FsdpModule>(&mut modules, &config, ids.first().copied().unwrap_or(0)) {
        Ok(parts) => {
            let group = Arc::new(Mutex::new(ParamGroup::new(parts)));
            Ok(modules
                .into_iter()
                .zip(ids)
                .enumerate()
                .map(|(member, (inner, id))| FsdpModule {
                    inner,
                    group: group.clone(),
                    member,
                    id,
                    schedule: None,
                    is_root: false,
                    mp: config.mp_policy,
                    last_dtypes: None,
                })
                .collect())
        }
        Err(error) => Err(Box::new(RejectedGroup { error, modules })),
    }
}

/// Wraps, in place, every direct child of `parent` for which `select(name, child)` is true,
/// returning their handles in order. A refused child stays in place unchanged and the error
/// is returned.
pub fn fully_shard_children(
    parent: &mut dyn Module,
    config: &FullyShardConfig,
    select: &mut dyn FnMut(&str, &dyn Module) -> bool,
) -> Result<Vec<UnitHandle>> {
    let mut handles = Vec::new();
    let mut failure: Option<FsdpError> = None;
    parent.visit_children_mut(&mut |name, slot| {
        if failure.is_some() || !select(name, slot.as_ref()) {
            return Ok(());
        }
        let child = std::mem::replace(slot, Box::new(Identity));
        match fully_shard(child, config.clone()) {
            Ok(unit) => {
                handles.push(unit.handle());
                *slot = Box::new(unit);
            }
            Err(rejected) => {
                *slot = rejected.module;
                failure = Some(rejected.error);
            }
        }
        Ok(())
    })?;
    match failure {
        Some(error) => Err(error),
        None => Ok(handles),
    }
}

/// Whether `module` has any parameter (a handy `select` for [`fully_shard_children`]).
pub fn has_params(module: &dyn Module) -> bool {
    let mut any = false;
    // A visitor that only sets a flag cannot fail.
    let _ = module.visit_params("", &mut |_, _| {
        any = true;
        Ok(())
    });
    any
}

/// Calls `f` with the dotted path of every unit strictly below `module` (relative to it).
fn walk_units_with_path(
    module: &mut dyn Module,
    prefix: &str,
    f: &mut dyn FnMut(&str, &mut FsdpModule),
) -> hypershard_nn::Result<()> {
    module.visit_children_mut(&mut |name, child| {
        let path = hypershard_nn::join_name(prefix, name);
        if let Some(unit) = child
            .as_any_mut()
            .and_then(|any| any.downcast_mut::<FsdpModule>())
        {
            f(&path, unit);
        }
        walk_units_with_path(child.as_mut(), &path, f)
    })
}

/// Calls `f` on every unit strictly below `module`.
fn walk_units(
    module: &mut dyn Module,
    f: &mut dyn FnMut(&mut FsdpModule),
) -> hypershard_nn::Result<()> {
    module.visit_children_mut(&mut |_, child| {
        if let Some(unit) = child
            .as_any_mut()
            .and_then(|any| any.downcast_mut::<FsdpModule>())
        {
            f(unit);
        }
        walk_units(child.as_mut(), f)
    })
}

fn cast_if(tensor: &Tensor, dtype: Option<DType>) -> Result<Tensor> {
    match dtype {
        Some(dtype) if tensor.dtype() != dtype && tensor.dtype().is_float() => {
            Ok(tensor.to_dtype(dtype)?)
        }
        _ => Ok(tensor.clone()),
    }
}

impl FsdpModule {
    /// A handle to this unit.
    pub fn handle(&self) -> UnitHandle {
        UnitHandle {
            id: self.id,
            member: self.member,
            group: self.group.clone(),
        }
    }

    /// The wrapped module.
    pub fn inner(&self) -> &dyn Module {
        self.inner.as_ref()
    }

    /// The wrapped module, mutably (calling its forward directly bypasses the hooks: its
    /// parameters are then the local shards).
    pub fn inner_mut(&mut self) -> &mut dyn Module {
        self.inner.as_mut()
    }

    /// Whether this unit became the root at its first forward.
    pub fn is_root(&self) -> bool {
        self.is_root
    }

    /// This unit's managed parameters (for a member of a group, those of its own module).
    pub fn params(&self) -> Vec<FsdpParamInfo> {
        param_infos(&lock(&self.group), self.member)
    }

    /// The position of this unit's module in its `fully_shard_group` list (0 for a unit of
    /// one module).
    pub fn member(&self) -> usize {
        self.member
    }

    /// This unit's training state.
    pub fn training_state(&self) -> TrainingState {
        lock(&self.group).training
    }

    /// The fp32 main gradient of this unit's parameter `name` (with `fp32_main_grad`).
    pub fn main_grad(&self, name: &str) -> Option<Tensor> {
        let group = lock(&self.group);
        let index = *group.by_name.get(self.member)?.get(name)?;
        group.params[index].main_grad.clone()
    }

    /// Handles of this unit and every unit below it, root first, pre-order.
    pub fn units(&mut self) -> Vec<UnitHandle> {
        let mut handles = vec![self.handle()];
        // The visitor only collects handles and cannot fail.
        let _ = walk_units(self.inner.as_mut(), &mut |unit| handles.push(unit.handle()));
        handles
    }

    fn for_each_group(&mut self, f: &mut dyn FnMut(&mut ParamGroup)) {
        f(&mut lock(&self.group));
        // The visitor cannot fail.
        let _ = walk_units(self.inner.as_mut(), &mut |unit| f(&mut lock(&unit.group)));
    }

    /// With `false`, backward accumulates unsharded gradients locally and communicates
    /// nothing (gradient accumulation); the next synchronised backward reduces the sum.
    /// Applies to this unit and every unit below it.
    pub fn set_requires_gradient_sync(&mut self, requires: bool) {
        self.for_each_group(&mut |g| g.controls.requires_gradient_sync = requires);
    }

    /// HSDP: with `false`, gradients are reduce-scattered but the replicate all-reduce is
    /// deferred; reduce-scatter outputs are summed until an all-reducing backward.
    pub fn set_requires_all_reduce(&mut self, requires: bool) {
        self.for_each_group(&mut |g| g.controls.requires_all_reduce = requires);
    }

    /// With `false`, the root does not drain pending reductions at the end of its backward
    /// (they finish at the next backward hook or the next forward).
    pub fn set_is_last_backward(&mut self, last: bool) {
        self.for_each_group(&mut |g| g.controls.is_last_backward = last);
    }

    /// With `false`, the root keeps the step's idle communication buffers cached after the
    /// last backward of a step instead of freeing them (the default, `true`), so the next
    /// step finds every buffer it needs without allocating, as PyTorch's caching allocator
    /// does on a GPU. A step then costs no page faults for them, at the price of those idle
    /// buffers staying resident through the optimizer step (the tracker's peak of live
    /// tensors is the same either way). nn's cached kernel outputs are not affected: they
    /// stay cached, in use plus cached within a tenth above the most kernel-output bytes
    /// ever in use at once.
    /// [`release_cached_buffers`](Self::release_cached_buffers) frees both on demand (torch's
    /// `empty_cache`).
    pub fn set_release_buffers_after_backward(&mut self, release: bool) {
        self.for_each_group(&mut |g| g.controls.release_buffers_after_backward = release);
    }

    /// Frees the idle communication buffers of this module's mesh and the cached kernel
    /// outputs now; returns the communication bytes freed.
    pub fn release_cached_buffers(&self) -> usize {
        let freed = lock(&self.group).mesh.pool().release_cached();
        hypershard_nn::release_cached_kernel_buffers();
        freed
    }

    /// With `false`, units keep their unsharded parameters after backward (so the next
    /// forward needs no all-gather); call [`reshard`](Self::reshard) before stepping.
    pub fn set_reshard_after_backward(&mut self, reshard: bool) {
        self.for_each_group(&mut |g| g.controls.reshard_after_backward = reshard);
    }

    /// Changes what this unit and every unit below it do after forward (FSDP2's
    /// `set_reshard_after_forward`, here with the int form too): `ToGroupOf(k)` splits the
    /// `k`-rank group off the shard group on first use, so every rank must call this alike.
    /// Every unit is checked first (all resharded, `k` dividing each shard group), so an
    /// error changes nothing. The root still keeps its parameters after forward.
    pub fn set_reshard_after_forward(&mut self, policy: ReshardAfterForward) -> Result<()> {
        let mut groups = vec![self.group.clone()];
        walk_units(self.inner.as_mut(), &mut |unit| {
            groups.push(unit.group.clone())
        })?;
        for group in &groups {
            lock(group).check_post_forward_change(policy)?;
        }
        for group in &groups {
            lock(group).set_post_forward(policy)?;
        }
        Ok(())
    }

    /// Reduce gradients as `factor · Σ_ranks grad` instead of the mean (or sum).
    pub fn set_gradient_scaling_factor(&mut self, factor: f64) {
        self.for_each_group(&mut |g| g.controls.gradient_scaling_factor = Some(factor));
    }

    /// The units whose all-gathers this unit issues before its own forward computes
    /// (replacing the implicit next-unit prefetch; an empty list turns prefetch off).
    pub fn set_modules_to_forward_prefetch(&mut self, units: &[UnitHandle]) {
        lock(&self.group).forward_prefetch =
            Some(units.iter().map(|u| Arc::downgrade(&u.group)).collect());
    }

    /// The units whose all-gathers this unit issues before its own backward computes.
    pub fn set_modules_to_backward_prefetch(&mut self, units: &[UnitHandle]) {
        lock(&self.group).backward_prefetch =
            Some(units.iter().map(|u| Arc::downgrade(&u.group)).collect());
    }

    /// Issues this unit's all-gather without waiting; the next forward (or
    /// [`unshard`](Self::unshard)) waits for it.
    pub fn unshard_async(&mut self) -> Result<()> {
        lock(&self.group).issue_unshard()
    }

    /// All-gathers this unit's parameters and makes the module hold them.
    pub fn unshard(&mut self) -> Result<()> {
        let mut group = lock(&self.group);
        group.wait_unshard()?;
        group.install(self.inner.as_mut(), self.member)
    }

    /// Frees this unit's unsharded parameters; the module holds the shards again. For a
    /// member of a group, its module gets its shards back now, and the group's unsharded
    /// parameters are freed once no member holds them.
    pub fn reshard(&mut self) -> Result<()> {
        lock(&self.group).reshard(self.inner.as_mut(), self.member, false)
    }

    /// Drops every gradient: the module's (`Parameter::grad`) and those the units keep
    /// (unsynchronised accumulation, deferred all-reduce partials, main grads).
    pub fn zero_grad(&mut self) -> Result<()> {
        hypershard_nn::zero_grad(self)?;
        self.for_each_group(&mut |g| g.clear_grads());
        Ok(())
    }

    /// The shared group of this unit.
    pub(crate) fn group_arc(&self) -> &Arc<Mutex<ParamGroup>> {
        &self.group
    }

    /// This rank in the world communicator of the unit's mesh.
    pub(crate) fn global_rank(&self) -> usize {
        lock(&self.group).mesh.rank()
    }

    /// Calls `f` with the path and unit of every unit strictly below this one.
    pub(crate) fn walk_nested_with_path(
        &mut self,
        f: &mut dyn FnMut(&str, &mut FsdpModule),
    ) -> Result<()> {
        Ok(walk_units_with_path(self.inner.as_mut(), "", f)?)
    }

    /// Makes this unit the root unless a root already linked it, linking every unit below.
    fn lazy_init(&mut self) -> Arc<Schedule> {
        if let Some(schedule) = &self.schedule {
            return schedule.clone();
        }
        let schedule = Arc::new(Schedule::default());
        schedule.register(ScheduledUnit {
            id: self.id,
            group: self.group.clone(),
        });
        // The visitor only links units and cannot fail.
        let _ = walk_units(self.inner.as_mut(), &mut |unit| {
            unit.schedule = Some(schedule.clone());
            unit.is_root = false;
            schedule.register(ScheduledUnit {
                id: unit.id,
                group: unit.group.clone(),
            });
        });
        self.schedule = Some(schedule.clone());
        self.is_root = true;
        schedule
    }

    /// Runs the hooks around the wrapped forward.
    pub fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        let schedule = self.lazy_init();
        let result = self.forward_hooks(&schedule, input);
        self.idle_on_error(&result);
        Self::root_result(result)
    }

    /// Runs the hooks around the wrapped backward.
    pub fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let Some(schedule) = self.schedule.clone() else {
            return Err(FsdpError::Nn(hypershard_nn::Error::BackwardBeforeForward {
                module: "FsdpModule",
            }));
        };
        let result = self.backward_hooks(&schedule, grad_output);
        self.idle_on_error(&result);
        Self::root_result(result)
    }

    /// A hook that failed leaves the unit `Idle`, so the caller may retry the step (the
    /// transitions are asserted only along successful paths).
    fn idle_on_error<T>(&self, result: &Result<T>) {
        if result.is_err() {
            lock(&self.group).training = TrainingState::Idle;
        }
    }

    /// An nn error that carries a nested unit's hook error (through the `Module` trait)
    /// becomes that typed error again, at every unit.
    fn root_result<T>(result: Result<T>) -> Result<T> {
        match result {
            Err(FsdpError::Nn(hypershard_nn::Error::Foreign { op, source })) => {
                match source.downcast::<FsdpError>() {
                    Ok(hook_error) => Err(*hook_error),
                    Err(source) => Err(FsdpError::Nn(hypershard_nn::Error::Foreign { op, source })),
                }
            }
            other => other,
        }
    }

    /// Converts a hook error for the `Module` trait: nn errors pass through, others travel
    /// whole inside [`hypershard_nn::Error::Foreign`], which the root unwraps again.
    fn to_nn_error(error: FsdpError) -> hypershard_nn::Error {
        match error {
            FsdpError::Nn(error) => error,
            other => hypershard_nn::Error::Foreign {
                op: "fully_shard hook",
                source: Box::new(other),
            },
        }
    }

    /// Whether every managed parameter of this unit is in `state`.
    pub fn is_in_state(&self, state: ShardedState) -> bool {
        lock(&self.group).params.iter().all(|p| p.state == state)
    }
}

impl std::fmt::Debug for FsdpModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpModule")
            .field("id", &self.id)
            .field("inner", &self.inner.kind())
            .field("is_root", &self.is_root)
            .field("params", &self.params().len())
            .finish()
    }
}

impl Module for FsdpModule {
    fn kind(&self) -> &'static str {
        "FsdpModule"
    }

    fn forward(&mut self, input: &Tensor) -> hypershard_nn::Result<Tensor> {
        FsdpModule::forward(self, input).map_err(Self::to_nn_error)
    }

    fn backward(&mut self, grad_output: &Tensor) -> hypershard_nn::Result<Tensor> {
        FsdpModule::backward(self, grad_output).map_err(Self::to_nn_error)
    }

    // The wrapper is transparent: the wrapped module's own caches and random streams (a leaf
    // such as `Linear` has no children to reach them through) are its.
    fn clear_cache(&mut self) -> hypershard_nn::Result<()> {
        self.inner.clear_cache()
    }

    fn visit_rng_counters_mut(&mut self, f: &mut dyn FnMut(&mut u64)) -> hypershard_nn::Result<()> {
        self.inner.visit_rng_counters_mut(f)
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> hypershard_nn::Result<()> {
        self.inner.visit_params(prefix, f)
    }

    fn visit_params_mut(
        &mut self,
        prefix: &str,
        f: &mut ParamVisitorMut<'_>,
    ) -> hypershard_nn::Result<()> {
        self.inner.visit_params_mut(prefix, f)
    }

    fn visit_children_mut(&mut self, f: &mut ChildVisitorMut<'_>) -> hypershard_nn::Result<()> {
        self.inner.visit_children_mut(f)
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}
