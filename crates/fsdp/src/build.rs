//! Building a unit: validating the config, choosing each parameter's role and layout,
//! cutting the local shards and planning the buckets.

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};

use hypershard_collectives::ReduceOp;
use hypershard_dtensor::bridge::reducible;
use hypershard_mesh::Placement;

use hypershard_nn::{Module, join_name};
use hypershard_tensor::Device;

use crate::bucket::{BucketItem, BucketPlan, plan_buckets};
use crate::config::TensorParallelConfig;
use crate::config::{FullyShardConfig, GradReduceOp};
use crate::error::{FsdpError, Result};
use crate::group::{GroupParts, TpGroup, post_forward_policy};
use crate::layout::ShardLayout;
use crate::param::{FsdpParam, ParamRole, TpInfo};
use crate::state::ShardedState;
use crate::tp::tp_layouts;

/// Whether `param` (a dotted name relative to the wrapped module) is named by `list`: equal to
/// an entry, or ending in `.entry` (so `bias` names every bias, and one config can be reused
/// for children and their parent).
fn named_by(list: &BTreeSet<String>, param: &str) -> bool {
    list.iter().any(|entry| {
        param == entry
            || param
                .strip_suffix(entry.as_str())
                .is_some_and(|head| head.ends_with('.'))
    })
}

/// Whether `module` is a unit already: a module of the wrapper type `Unit`.
///
/// Building takes the wrapper type (`FsdpModule`) as a type parameter instead of naming it,
/// so that this file does not import the wrapper's (which calls into it).
fn is_unit<Unit: Any>(module: &mut dyn Module) -> bool {
    module.as_any_mut().is_some_and(|any| any.is::<Unit>())
}

/// Names of every parameter that lives under a nested unit (a `Unit`) of `module`.
fn nested_unit_names<Unit: Any>(
    module: &mut dyn Module,
    prefix: &str,
    out: &mut BTreeSet<String>,
) -> hypershard_nn::Result<()> {
    module.visit_children_mut(&mut |name, child| {
        let path = join_name(prefix, name);
        if is_unit::<Unit>(child.as_mut()) {
            child.visit_params(&path, &mut |full, _| {
                out.insert(full.to_string());
                Ok(())
            })
        } else {
            nested_unit_names::<Unit>(child.as_mut(), &path, out)
        }
    })
}

/// Computes the parameters of one member module of a new unit (appended to `params`),
/// without changing the module.
fn member_params<Unit: Any>(
    module: &mut dyn Module,
    config: &FullyShardConfig,
    member: usize,
    post_size: Option<usize>,
    tp: Option<&TpGroup>,
    device: Device,
    params: &mut Vec<FsdpParam>,
) -> Result<()> {
    let mut nested = BTreeSet::new();
    nested_unit_names::<Unit>(module, "", &mut nested)?;
    // Parameters of tensor-parallel layers (outside nested units) and their TP layout.
    let mut layouts = BTreeMap::new();
    tp_layouts(module, "", &mut layouts)?;
    layouts.retain(|name, _| !nested.contains(name));
    if let Some(first) = layouts.keys().next() {
        let Some(tp) = tp else {
            return Err(FsdpError::TpConfigMissing {
                param: first.clone(),
            });
        };
        let tp_ranks = tp.state_mesh.select(&[0usize])?.mesh().ranks().to_vec();
        for (name, (_, layer_mesh)) in &layouts {
            if layer_mesh.mesh().ranks() != tp_ranks.as_slice() {
                return Err(FsdpError::TpMeshMismatch {
                    what: format!(
                        "parameter `{name}`'s layer is over ranks {:?}, this rank's TP group \
                         over {tp_ranks:?}",
                        layer_mesh.mesh().ranks()
                    ),
                });
            }
        }
    }

    let mesh = config.mesh.clone();
    let shard_world = mesh.shard_world();
    let shard_rank = mesh.shard_rank();
    let mp = config.mp_policy;
    let mut failure: Option<FsdpError> = None;
    module.visit_params("", &mut |name, param| {
        if failure.is_some() || nested.contains(name) {
            return Ok(());
        }
        let ignored = named_by(&config.ignored_params, name);
        let replicate = named_by(&config.replicate_params, name);
        if ignored && replicate {
            failure = Some(FsdpError::IgnoredAndReplicated {
                param: name.to_string(),
            });
            return Ok(());
        }
        if ignored {
            return Ok(());
        }
        // `tensor`: a deferred parameter has a shape and a dtype, which is all the plan needs.
        let data = param.tensor()?;
        let deferred = data.is_deferred();
        if !deferred && data.device() != device {
            failure = Some(FsdpError::ParamDevice {
                param: name.to_string(),
                expected: device,
                actual: data.device(),
            });
            return Ok(());
        }
        let orig_dtype = data.dtype();
        if !reducible(orig_dtype) {
            failure = Some(FsdpError::UnsupportedDType {
                param: name.to_string(),
                dtype: orig_dtype,
            });
            return Ok(());
        }
        let shape = data.shape().to_vec();
        let replicated = replicate || shape.is_empty();
        let tp_info = tp.map(|_| match layouts.get(name) {
            Some((layout, _)) => TpInfo {
                placement: layout.placement,
                global_shape: layout.global_shape.clone(),
            },
            None => TpInfo {
                placement: Placement::Replicate,
                global_shape: shape.clone(),
            },
        });
        if tp_info.is_some() && replicated {
            failure = Some(FsdpError::TpUnsupported {
                what: "a 0-d or replicate_params parameter",
            });
            return Ok(());
        }
        let dim = match &config.shard_placement_fn {
            Some(choose) if !replicated => choose(name, param).unwrap_or(0),
            _ => 0,
        };
        if !replicated && dim >= shape.len() {
            failure = Some(FsdpError::ShardDimOutOfRange {
                param: name.to_string(),
                shape: shape.clone(),
                dim,
            });
            return Ok(());
        }
        let (role, layout_shape, world) = if replicated {
            // A 0-d parameter is kept whole; its layout treats it as one element.
            let layout_shape = if shape.is_empty() {
                vec![1]
            } else {
                shape.clone()
            };
            (ParamRole::Replicated, layout_shape, 1)
        } else {
            (ParamRole::Sharded, shape.clone(), shard_world)
        };
        let layout = ShardLayout {
            shape: layout_shape.clone(),
            dim,
            world,
        };
        let sharded = if replicated {
            if deferred {
                let zeros = vec![0; shape.len()];
                param
                    .materialize_block(&zeros, &shape)?
                    .to_device(&device)?
            } else {
                data.deep_copy()?
            }
        } else {
            let span = match layout.span(shard_rank) {
                Ok(span) => span,
                Err(error) => {
                    failure = Some(error);
                    return Ok(());
                }
            };
            if deferred {
                // Only this rank's block is ever built: the full parameter never exists here.
                let mut offset = vec![0; shape.len()];
                offset[dim] = span.offset;
                let mut block = shape.clone();
                block[dim] = span.len;
                // Built on the host from the recipe, then moved to the unit's device.
                param
                    .materialize_block(&offset, &block)?
                    .to_device(&device)?
            } else {
                // A deep copy, so the shard owns its storage and the full tensor can be freed.
                data.narrow(dim, span.offset, span.len)?.deep_copy()?
            }
        };
        let post_layout = match (role, post_size) {
            (ParamRole::Sharded, Some(size)) => Some(ShardLayout {
                shape: layout_shape,
                dim,
                world: size,
            }),
            _ => None,
        };
        let param_dtype = mp.param_dtype.unwrap_or(orig_dtype);
        let reduce_dtype = mp.reduce_dtype.or(mp.param_dtype).unwrap_or(orig_dtype);
        for dtype in [param_dtype, reduce_dtype] {
            if !reducible(dtype) {
                failure = Some(FsdpError::UnsupportedDType {
                    param: name.to_string(),
                    dtype,
                });
                return Ok(());
            }
        }
        params.push(FsdpParam {
            name: name.to_string(),
            member,
            role,
            layout,
            post_layout,
            orig_dtype,
            param_dtype,
            reduce_dtype,
            requires_grad: param.requires_grad,
            sharded,
            sharded_grad: None,
            unsharded: None,
            post_forward: None,
            unsharded_grad_accum: None,
            main_grad: None,
            installed: false,
            tp: tp_info,
            state: ShardedState::Sharded,
        });
        Ok(())
    })?;
    if let Some(error) = failure {
        return Err(error);
    }
    Ok(())
}

/// The device of the first managed (not ignored) parameter that has data, the host when
/// every one is deferred.
fn unit_device(modules: &[Box<dyn Module>], config: &FullyShardConfig) -> Result<Device> {
    let mut found = None;
    for module in modules {
        module.visit_params("", &mut |name, param| {
            if found.is_none() && !named_by(&config.ignored_params, name) {
                let data = param.tensor()?;
                if !data.is_deferred() {
                    found = Some(data.device());
                }
            }
            Ok(())
        })?;
    }
    Ok(found.unwrap_or(Device::Cpu))
}

/// Checks the config and the modules and computes every parameter of the new unit; then
/// writes the shards into the modules. Nothing in any module changes unless everything
/// succeeded. `modules` holds one module for `fully_shard` and the list of
/// `fully_shard_group`, whose refusals name the member they concern. `Unit` is the type of a
/// unit's wrapper: a module of that type is sharded already, and so are its parameters when
/// it is nested in one of `modules`.
pub(crate) fn build_group<Unit: Any>(
    modules: &mut [Box<dyn Module>],
    config: &FullyShardConfig,
    id: usize,
) -> Result<GroupParts> {
    if modules.is_empty() {
        return Err(FsdpError::EmptyGroup);
    }
    let grouped = modules.len() > 1;
    let for_member = |member: usize, error: FsdpError| {
        if grouped {
            FsdpError::GroupMember {
                member,
                source: Box::new(error),
            }
        } else {
            error
        }
    };
    for (member, module) in modules.iter_mut().enumerate() {
        if is_unit::<Unit>(module.as_mut()) {
            return Err(for_member(member, FsdpError::AlreadySharded));
        }
    }
    if let Some(both) = config
        .ignored_params
        .intersection(&config.replicate_params)
        .next()
    {
        return Err(FsdpError::IgnoredAndReplicated {
            param: both.clone(),
        });
    }
    // An entry must name a parameter of some member (one config serves every member).
    let mut all_names = BTreeSet::new();
    for module in modules.iter() {
        module.visit_params("", &mut |name, _| {
            all_names.insert(name.to_string());
            Ok(())
        })?;
    }
    for (list, names) in [
        ("ignored_params", &config.ignored_params),
        ("replicate_params", &config.replicate_params),
    ] {
        let unknown = names.iter().find(|entry| {
            let single = BTreeSet::from([(*entry).clone()]);
            !all_names.iter().any(|name| named_by(&single, name))
        });
        if let Some(unknown) = unknown {
            return Err(FsdpError::UnknownParam {
                list,
                param: unknown.clone(),
            });
        }
    }
    let (post_forward, post_size) =
        post_forward_policy(config.reshard_after_forward, config.mesh.shard_world())?;
    let mesh = config.mesh.clone();
    let mp = config.mp_policy;
    let tp = match &config.tensor_parallel {
        Some(tp_config) => Some(tp_group(tp_config, config)?),
        None => None,
    };
    let device = match config.device {
        Some(device) => device,
        None => unit_device(modules, config)?,
    };
    let mut params: Vec<FsdpParam> = Vec::new();
    for (member, module) in modules.iter_mut().enumerate() {
        member_params::<Unit>(
            module.as_mut(),
            config,
            member,
            post_size,
            tp.as_ref(),
            device,
            &mut params,
        )
        .map_err(|error| for_member(member, error))?;
    }

    let fusion = config.comm_fusion;
    let plan = |select: &dyn Fn(&FsdpParam) -> Option<BucketItem>| -> Vec<BucketPlan> {
        let items: Vec<BucketItem> = params.iter().filter_map(select).collect();
        plan_buckets(&items, fusion.enabled, fusion.bucket_bytes)
    };
    let index_of = |p: &FsdpParam| {
        params
            .iter()
            .position(|q| q.member == p.member && q.name == p.name)
            .unwrap_or(0)
    };
    let gather_plan = plan(&|p| {
        (p.role == ParamRole::Sharded).then(|| BucketItem {
            index: index_of(p),
            dtype: p.param_dtype,
            slot_numel: p.layout.slot_numel().unwrap_or(0),
        })
    });
    let post_forward_plan = plan(&|p| {
        p.post_layout.as_ref().map(|layout| BucketItem {
            index: index_of(p),
            dtype: p.param_dtype,
            slot_numel: layout.slot_numel().unwrap_or(0),
        })
    });
    // TP-replicated parameters go last in every reduce bucket, so their reduced shards are
    // one range that a single all-reduce over TP covers (one reduce-scatter per bucket still).
    let tp_replicated = |p: &FsdpParam| p.tp.as_ref().is_some_and(TpInfo::is_replicated);
    let mut reduce_items: Vec<BucketItem> = params
        .iter()
        .filter(|p| p.role == ParamRole::Sharded && p.requires_grad)
        .map(|p| BucketItem {
            index: index_of(p),
            dtype: p.reduce_dtype,
            slot_numel: p.layout.slot_numel().unwrap_or(0),
        })
        .collect();
    reduce_items.sort_by_key(|item| tp_replicated(&params[item.index]));
    let mut reduce_plan = plan_buckets(&reduce_items, fusion.enabled, fusion.bucket_bytes);
    if tp.as_ref().is_some_and(|tp| tp.world() > 1) {
        for bucket in &mut reduce_plan {
            bucket.tp_tail = bucket
                .members
                .iter()
                .position(|&m| tp_replicated(&params[m]))
                .map(|first| bucket.offsets[first]);
        }
    }
    let replicate_plan = plan(&|p| {
        (p.role == ParamRole::Replicated && p.requires_grad).then(|| BucketItem {
            index: index_of(p),
            dtype: p.reduce_dtype,
            slot_numel: p.layout.slot_numel().unwrap_or(0),
        })
    });

    // Every check passed on every rank alike; the split below is collective.
    let post_forward_comm = match post_size {
        Some(size) => Some(mesh.post_forward_group(size)?),
        None => None,
    };

    // Hand the shards to the modules; the full tensors are dropped with the old data.
    for (member, module) in modules.iter_mut().enumerate() {
        let names: std::collections::HashMap<&str, usize> = params
            .iter()
            .enumerate()
            .filter(|(_, p)| p.member == member)
            .map(|(i, p)| (p.name.as_str(), i))
            .collect();
        module.visit_params_mut("", &mut |name, slot| {
            if let Some(&index) = names.get(name) {
                slot.data = Some(params[index].sharded.clone());
                slot.grad = None;
            }
            Ok(())
        })?;
    }
    let kinds: Vec<&str> = modules.iter().map(|m| m.kind()).collect();

    Ok(GroupParts {
        id,
        unit: format!("{}#{id}", kinds.join("+")),
        params,
        members: modules.len(),
        mesh,
        post_forward_comm,
        post_forward,
        mp,
        fusion,
        reduce_op: config.reduce_op,
        gather_plan,
        post_forward_plan,
        reduce_plan,
        replicate_plan,
        tp,
        device,
    })
}

/// Checks a tensor-parallel config against the data-parallel mesh and derives the unit's TP
/// group: `world` must be 2-d, its non-TP dim the (1-d) data-parallel mesh, over the same
/// ranks.
fn tp_group(tp_config: &TensorParallelConfig, config: &FullyShardConfig) -> Result<TpGroup> {
    let dp = &config.mesh;
    if dp.replicate().is_some() {
        return Err(FsdpError::TpUnsupported {
            what: "HSDP (a 2-d data-parallel mesh)",
        });
    }
    if !config.replicate_params.is_empty() {
        return Err(FsdpError::TpUnsupported {
            what: "replicate_params",
        });
    }
    let world = &tp_config.world;
    let tp_index = world.mesh().dim_index(tp_config.tp_dim.as_str())?;
    if world.ndim() != 2 {
        return Err(FsdpError::TpMeshMismatch {
            what: format!(
                "the world mesh needs 2 dims (dp, tp), got {:?}",
                world.shape()
            ),
        });
    }
    let dp_index = 1 - tp_index;
    let dp_ranks = world.select(&[dp_index])?.mesh().ranks().to_vec();
    if dp_ranks != dp.mesh().ranks() {
        return Err(FsdpError::TpMeshMismatch {
            what: format!(
                "the data-parallel mesh is over ranks {:?}, the world's non-TP dim over {:?}",
                dp.mesh().ranks(),
                dp_ranks
            ),
        });
    }
    let state_mesh = world.select(&[tp_index, dp_index])?;
    let comm = state_mesh.dim_comm(0usize)?.clone();
    let op = match tp_config.replicated_grad_op {
        GradReduceOp::Avg => ReduceOp::Avg,
        GradReduceOp::Sum => ReduceOp::Sum,
    };
    Ok(TpGroup {
        comm,
        op,
        state_mesh,
    })
}
