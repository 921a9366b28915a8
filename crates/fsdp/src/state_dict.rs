//! State dicts: the full form gathered to rank 0 one parameter at a time, and loading from a
//! full (global-shape) or local (shard-shape) form.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use hypershard_collectives::Buffer;
use hypershard_dtensor::bridge::{buffer_to_tensor, staging_into_buffer, staging_tensor};
use hypershard_dtensor::{DTensor, Placement};
use hypershard_mesh::shard_span;
use hypershard_nn::Module;
use hypershard_tensor::Tensor;

use crate::error::{FsdpError, Result};
use crate::group::{ParamGroup, TpGroup};
use crate::module::FsdpModule;
use crate::param::ParamRole;
use crate::schedule::lock;
use crate::state::ShardedState;
use crate::tp::tp_layouts;

/// A managed parameter found by its full name.
pub(crate) struct ManagedParam {
    pub group: Arc<Mutex<ParamGroup>>,
    pub index: usize,
}

impl FsdpModule {
    /// Every parameter managed by this unit or a unit below it, by full dotted name.
    pub(crate) fn managed_params(&mut self) -> Result<BTreeMap<String, ManagedParam>> {
        let mut out = BTreeMap::new();
        let mut record = |path: &str, group: &Arc<Mutex<ParamGroup>>, member: usize| {
            let guard = lock(group);
            for (index, param) in guard.params.iter().enumerate() {
                if param.member != member {
                    continue;
                }
                out.insert(
                    hypershard_nn::join_name(path, &param.name),
                    ManagedParam {
                        group: group.clone(),
                        index,
                    },
                );
            }
        };
        record("", self.group_arc(), self.member());
        self.walk_nested_with_path(&mut |path, unit| {
            record(path, unit.group_arc(), unit.member())
        })?;
        Ok(out)
    }

    /// The TP group of this unit or of the first unit below it that has one.
    pub(crate) fn tp_group(&mut self) -> Result<Option<TpGroup>> {
        let mut found = lock(self.group_arc()).tp.clone();
        if found.is_none() {
            self.walk_nested_with_path(&mut |_, unit| {
                if found.is_none() {
                    found = lock(unit.group_arc()).tp.clone();
                }
            })?;
        }
        Ok(found)
    }

    /// With TP: every parameter as a DTensor over the world mesh ordered `[tp, dp]`, with
    /// placements `[TP placement, Shard(d) or Replicate]`. Nested sharding of one dim splits
    /// in mesh-dim order, TP first, which is exactly how a data-parallel shard of a TP-local
    /// piece sits in the global parameter.
    fn tp_sharded_state_dict(&mut self, tp: &TpGroup) -> Result<BTreeMap<String, DTensor>> {
        let managed = self.managed_params()?;
        let mut layouts = BTreeMap::new();
        tp_layouts(self, "", &mut layouts)?;
        let mesh = tp.state_mesh.clone();
        let mut out = BTreeMap::new();
        let mut failure: Option<FsdpError> = None;
        self.visit_params("", &mut |name, param| {
            if failure.is_some() {
                return Ok(());
            }
            let (local, placements, global) = match managed.get(name) {
                Some(entry) => {
                    let group = lock(&entry.group);
                    let p = &group.params[entry.index];
                    let (tp_placement, global) = match &p.tp {
                        Some(info) => (info.placement, info.global_shape.clone()),
                        None => (Placement::Replicate, p.layout.shape.clone()),
                    };
                    let dp_placement = match p.role {
                        ParamRole::Sharded => Placement::Shard(p.layout.dim),
                        ParamRole::Replicated => Placement::Replicate,
                    };
                    (p.sharded.clone(), [tp_placement, dp_placement], global)
                }
                None => {
                    let data = param.data()?.clone();
                    let (tp_placement, global) = match layouts.get(name) {
                        Some((layout, _)) => (layout.placement, layout.global_shape.clone()),
                        None => (Placement::Replicate, data.shape().to_vec()),
                    };
                    (data, [tp_placement, Placement::Replicate], global)
                }
            };
            match DTensor::from_local(local, &mesh, &placements, Some(&global)) {
                Ok(dtensor) => {
                    out.insert(name.to_string(), dtensor);
                }
                Err(error) => failure = Some(error.into()),
            }
            Ok(())
        })?;
        match failure {
            Some(error) => Err(error),
            None => Ok(out),
        }
    }

    /// With TP: each parameter of the sharded state dict gathered whole, one at a time, kept
    /// on global rank 0. Unlike the data-parallel-only path, every rank briefly holds the one
    /// parameter being gathered (an all-gather over the `[tp, dp]` mesh), never more.
    fn tp_full_state_dict(&mut self, tp: &TpGroup) -> Result<BTreeMap<String, Tensor>> {
        let sharded = self.tp_sharded_state_dict(tp)?;
        let keep = tp.state_mesh.rank() == 0;
        let mut out = BTreeMap::new();
        for (name, dtensor) in sharded {
            let full = dtensor.full_tensor()?;
            if keep {
                // In host memory whatever the device, as without TP.
                out.insert(name, full.to_host()?);
            }
        }
        Ok(out)
    }

    /// The full state dict (PyTorch names and shapes) on global rank 0, in host memory
    /// whatever the module's device (torch's `full_state_dict` with `cpu_offload`); other
    /// ranks get an empty map. Parameters are gathered one at a time to the shard group's first rank, so no
    /// rank ever holds more than one full parameter beyond its shards. Collective over the
    /// shard groups of replica 0 (other replicas take no part).
    pub fn full_state_dict(&mut self) -> Result<BTreeMap<String, Tensor>> {
        if let Some(tp) = self.tp_group()? {
            return self.tp_full_state_dict(&tp);
        }
        let managed = self.managed_params()?;
        let mut names = Vec::new();
        let mut locals = BTreeMap::new();
        self.visit_params("", &mut |name, param| {
            names.push(name.to_string());
            if !managed.contains_key(name) {
                locals.insert(name.to_string(), param.data()?.to_host()?.deep_copy()?);
            }
            Ok(())
        })?;
        let mut out = BTreeMap::new();
        for name in names {
            let Some(entry) = managed.get(&name) else {
                if let Some(local) = locals.remove(&name)
                    && self.global_rank() == 0
                {
                    out.insert(name, local);
                }
                continue;
            };
            let group = lock(&entry.group);
            let param = &group.params[entry.index];
            let mesh = group.mesh.clone();
            let on_replica_zero = mesh.replicate().is_none_or(|c| c.rank() == 0);
            if param.role == ParamRole::Replicated {
                if mesh.rank() == 0 {
                    out.insert(name, param.sharded.to_host()?.deep_copy()?);
                }
                continue;
            }
            if !on_replica_zero {
                continue;
            }
            let dtype = param.orig_dtype;
            let comm_type = crate::group::buffer_dtype(dtype, &name)?;
            let layout = &param.layout;
            let slot = layout.slot_numel()?;
            // The shard comes to the host first (one copy from a device, none on the host):
            // the gather runs on host buffers.
            let staged = staging_tensor(&[slot], dtype)?;
            layout.pack(&param.sharded.to_host()?, &staged)?;
            let input = staging_into_buffer(staged)?;
            let shard = mesh.shard();
            let is_root = shard.rank() == 0;
            let output = Buffer::zeros(comm_type, if is_root { slot * layout.world } else { 0 });
            let pair = shard.gather_async(input, output, 0).wait()?;
            if is_root {
                let gathered = buffer_to_tensor(pair.output, &[slot * layout.world], dtype)?;
                let full = Tensor::zeros(&layout.shape, dtype)?;
                for rank in 0..layout.world {
                    layout.unpack_into_full(
                        &gathered.narrow(0, rank * slot, slot)?,
                        rank,
                        &full,
                    )?;
                }
                if mesh.rank() == 0 {
                    out.insert(name, full);
                }
            }
        }
        Ok(out)
    }

    /// The sharded state dict (PyTorch FSDP2's): every parameter as a [`DTensor`] over the
    /// data-parallel process mesh, PyTorch names, global shapes. Sharded parameters are
    /// `[Shard(d)]` (FSDP) or `[Replicate, Shard(d)]` (HSDP) with their padded-free local shard;
    /// replicated, ignored and unmanaged parameters are `Replicate` on every dim (ignored ones
    /// hold this rank's values, which fully_shard does not synchronise). No communication; the
    /// local tensors share storage with the parameters, as torch's do.
    pub fn sharded_state_dict(&mut self) -> Result<BTreeMap<String, DTensor>> {
        if let Some(tp) = self.tp_group()? {
            return self.tp_sharded_state_dict(&tp);
        }
        let managed = self.managed_params()?;
        let process_mesh = lock(self.group_arc()).mesh.process_mesh().clone();
        let ndim = process_mesh.ndim();
        let mut out = BTreeMap::new();
        let mut failure: Option<FsdpError> = None;
        self.visit_params("", &mut |name, param| {
            if failure.is_some() {
                return Ok(());
            }
            let (local, placements, global) = match managed.get(name) {
                Some(entry) => {
                    let group = lock(&entry.group);
                    let p = &group.params[entry.index];
                    let mut placements = vec![Placement::Replicate; ndim];
                    if p.role == ParamRole::Sharded {
                        placements[ndim - 1] = Placement::Shard(p.layout.dim);
                        (p.sharded.clone(), placements, p.layout.shape.clone())
                    } else {
                        (p.sharded.clone(), placements, p.sharded.shape().to_vec())
                    }
                }
                None => {
                    let data = param.data()?.clone();
                    let shape = data.shape().to_vec();
                    (data, vec![Placement::Replicate; ndim], shape)
                }
            };
            match DTensor::from_local(local, &process_mesh, &placements, Some(&global)) {
                Ok(dtensor) => {
                    out.insert(name.to_string(), dtensor);
                }
                Err(error) => failure = Some(error.into()),
            }
            Ok(())
        })?;
        match failure {
            Some(error) => Err(error),
            None => Ok(out),
        }
    }

    /// Loads a sharded state dict made by [`sharded_state_dict`](Self::sharded_state_dict)
    /// (same mesh): each DTensor's local tensor must have this rank's shard shape.
    pub fn load_sharded_state_dict(&mut self, state: &BTreeMap<String, DTensor>) -> Result<()> {
        let locals: BTreeMap<String, Tensor> = state
            .iter()
            .map(|(name, d)| (name.clone(), d.to_local().clone()))
            .collect();
        self.load_state_dict(&locals)
    }

    /// The local state dict: every parameter's local shard (or whole tensor, for replicated,
    /// ignored and unmanaged ones) by full name. With the global shapes of
    /// [`FsdpModule::params`] this is the sharded form; `load_state_dict` takes it back.
    pub fn local_state_dict(&mut self) -> Result<BTreeMap<String, Tensor>> {
        let managed = self.managed_params()?;
        let mut out = BTreeMap::new();
        self.visit_params("", &mut |name, param| {
            let value = match managed.get(name) {
                Some(entry) => lock(&entry.group).params[entry.index].sharded.deep_copy()?,
                None => param.data()?.deep_copy()?,
            };
            out.insert(name.to_string(), value);
            Ok(())
        })?;
        Ok(out)
    }

    /// Loads parameters from `state`, whose entries are full (global shape: each rank keeps
    /// its shard) or local (this rank's shard shape) tensors, cast to the parameters' dtypes.
    /// Every entry is checked before anything is written, so a bad state dict changes nothing:
    /// a missing entry is [`FsdpError::StateDictMissing`], a wrong shape
    /// [`FsdpError::StateDictShape`]. Units must be resharded (not between forward and
    /// backward). Extra entries are ignored.
    pub fn load_state_dict(&mut self, state: &BTreeMap<String, Tensor>) -> Result<()> {
        let managed = self.managed_params()?;
        // Pass 1: resolve every entry to the tensor to copy into the local storage.
        let mut plan: Vec<(String, Tensor)> = Vec::new();
        let mut failure: Option<FsdpError> = None;
        self.visit_params("", &mut |name, param| {
            if failure.is_some() {
                return Ok(());
            }
            let Some(value) = state.get(name) else {
                failure = Some(FsdpError::StateDictMissing {
                    name: name.to_string(),
                });
                return Ok(());
            };
            let resolved = match managed.get(name) {
                Some(entry) => {
                    let group = lock(&entry.group);
                    let p = &group.params[entry.index];
                    if p.installed || p.state != ShardedState::Sharded {
                        failure = Some(FsdpError::InvalidState {
                            unit: group.unit.clone(),
                            param: name.to_string(),
                            op: "load_state_dict",
                            expected: &[ShardedState::Sharded],
                            actual: p.state,
                        });
                        return Ok(());
                    }
                    let local_shape = p.sharded.shape().to_vec();
                    let global_shape = if p.role == ParamRole::Replicated {
                        local_shape.clone()
                    } else {
                        p.layout.shape.clone()
                    };
                    // With TP, a global-shape value is first narrowed to this rank's TP
                    // piece (the shape the data-parallel layout cuts).
                    let tp_piece = match (&p.tp, &group.tp) {
                        (Some(info), Some(tp))
                            if value.shape() == info.global_shape.as_slice()
                                && value.shape() != local_shape.as_slice() =>
                        {
                            match info.placement {
                                Placement::Shard(dim) => {
                                    match shard_span(info.global_shape[dim], tp.world(), tp.rank())
                                    {
                                        Ok(span) => {
                                            Some(value.narrow(dim, span.offset, span.len)?)
                                        }
                                        Err(error) => {
                                            failure = Some(error.into());
                                            return Ok(());
                                        }
                                    }
                                }
                                _ => None,
                            }
                        }
                        _ => None,
                    };
                    let tp_global = p.tp.as_ref().map(|info| info.global_shape.clone());
                    let value = tp_piece.as_ref().unwrap_or(value);
                    if value.shape() == local_shape.as_slice() {
                        Some(value.clone())
                    } else if value.shape() == global_shape.as_slice() {
                        match p.layout.span(group.mesh.shard_rank()) {
                            Ok(span) => Some(value.narrow(p.layout.dim, span.offset, span.len)?),
                            Err(error) => {
                                failure = Some(error);
                                None
                            }
                        }
                    } else {
                        failure = Some(FsdpError::StateDictShape {
                            name: name.to_string(),
                            expected: tp_global.unwrap_or(global_shape),
                            local: local_shape,
                            actual: value.shape().to_vec(),
                        });
                        None
                    }
                }
                None => {
                    let shape = param.data()?.shape().to_vec();
                    if value.shape() == shape.as_slice() {
                        Some(value.clone())
                    } else {
                        failure = Some(FsdpError::StateDictShape {
                            name: name.to_string(),
                            expected: shape.clone(),
                            local: shape,
                            actual: value.shape().to_vec(),
                        });
                        None
                    }
                }
            };
            if let Some(resolved) = resolved {
                plan.push((name.to_string(), resolved));
            }
            Ok(())
        })?;
        if let Some(error) = failure {
            return Err(error);
        }
        // Pass 2: write in place, so the module's parameters keep their storage.
        let plan: BTreeMap<String, Tensor> = plan.into_iter().collect();
        self.visit_params_mut("", &mut |name, param| {
            if let Some(value) = plan.get(name) {
                // A host state dict loads into a module on a device (one copy per entry).
                let data = param.data()?;
                data.copy_from(&value.to_device(&data.device())?)?;
            }
            Ok(())
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DataParallelMesh, FullyShardConfig, fully_shard};
    use hypershard_nn::{Linear, LinearConfig};
    use hypershard_tensor::{DType, Device};

    #[test]
    fn full_and_local_state_dicts_round_trip_at_world_3() {
        // The same round trips for a unit on the host and on the emulated device: the full
        // state dict comes back in host memory, the local and sharded ones stay on the
        // device, and host state dicts load into the device unit.
        for device in [Device::Cpu, Device::Emulated { ordinal: 0 }] {
            round_trip_at_world_3(device);
        }
    }

    /// Values of `t` wherever it lives.
    fn values(t: &Tensor) -> Vec<f64> {
        t.to_host()
            .and_then(|h| h.to_f64_vec())
            .expect("invariant: readable")
    }

    fn round_trip_at_world_3(device: Device) {
        let comms = hypershard_collectives::local::spawn_world(3).expect("world");
        let reference = Linear::new(LinearConfig {
            in_features: 4,
            out_features: 5,
            bias: true,
            dtype: DType::F32,
            seed: 3,
        })
        .expect("layer");
        let want_weight = reference.weight.data().expect("w").to_f64_vec().expect("v");
        hypershard_testkit::run_ranks(3, move |rank| {
            let device = match device {
                Device::Cpu => Device::Cpu,
                _ => Device::Emulated { ordinal: rank },
            };
            let mesh = DataParallelMesh::fsdp(comms[rank].clone())?;
            let mut layer = Linear::new(LinearConfig {
                in_features: 4,
                out_features: 5,
                bias: true,
                dtype: DType::F32,
                seed: 3,
            })?;
            hypershard_nn::to_device(&mut layer, &device)?;
            let mut unit = fully_shard(Box::new(layer), FullyShardConfig::new(mesh))?;
            let full = unit.full_state_dict()?;
            if rank == 0 {
                assert_eq!(full["weight"].shape(), &[5, 4]);
                assert_eq!(full["weight"].device(), Device::Cpu);
                assert_eq!(full["weight"].to_f64_vec()?, want_weight);
            } else {
                assert!(full.is_empty());
            }
            // Load zeros in the full form, then the saved local form back.
            let local = unit.local_state_dict()?;
            assert!(local.values().all(|t| t.device() == device));
            let zeros: BTreeMap<String, Tensor> = [
                ("weight".to_string(), Tensor::zeros(&[5, 4], DType::F32)?),
                ("bias".to_string(), Tensor::zeros(&[5], DType::F32)?),
            ]
            .into();
            unit.load_state_dict(&zeros)?;
            assert!(
                unit.local_state_dict()?
                    .values()
                    .all(|t| values(t).iter().all(|x| *x == 0.0))
            );
            unit.load_state_dict(&local)?;
            assert_eq!(
                values(&unit.local_state_dict()?["weight"]),
                values(&local["weight"])
            );
            // A wrong shape is refused before anything is written.
            let mut bad = local.clone();
            bad.insert("bias".to_string(), Tensor::zeros(&[7], DType::F32)?);
            bad.insert("weight".to_string(), Tensor::zeros(&[5, 4], DType::F32)?);
            assert!(matches!(
                unit.load_state_dict(&bad),
                Err(FsdpError::StateDictShape { name, .. }) if name == "bias"
            ));
            assert_eq!(
                values(&unit.local_state_dict()?["weight"]),
                values(&local["weight"])
            );
            let mut missing = local.clone();
            missing.remove("bias");
            assert!(matches!(
                unit.load_state_dict(&missing),
                Err(FsdpError::StateDictMissing { name }) if name == "bias"
            ));
            // The sharded form: DTensors with the global shape, and they load back.
            let sharded = unit.sharded_state_dict()?;
            assert_eq!(sharded["weight"].shape(), &[5, 4]);
            assert_eq!(sharded["weight"].placements(), &[Placement::Shard(0)]);
            let expected_rows = [2, 2, 1][rank];
            assert_eq!(sharded["weight"].to_local().shape(), &[expected_rows, 4]);
            // DTensor's collectives run on host tensors: gather a host copy of the local.
            let weight = &sharded["weight"];
            let host = DTensor::from_local(
                weight.to_local().to_host()?,
                weight.process_mesh(),
                weight.placements(),
                Some(weight.shape()),
            )?;
            assert_eq!(host.full_tensor()?.to_f64_vec()?, want_weight);
            // `sharded` shares storage with the parameters (as torch's does): keep a copy.
            let mut saved = BTreeMap::new();
            for (name, d) in &sharded {
                let copy = DTensor::from_local(
                    d.to_local().deep_copy()?,
                    d.process_mesh(),
                    d.placements(),
                    Some(d.shape()),
                )?;
                saved.insert(name.clone(), copy);
            }
            unit.load_state_dict(&zeros)?;
            unit.load_sharded_state_dict(&saved)?;
            assert_eq!(
                values(&unit.local_state_dict()?["weight"]),
                values(&local["weight"])
            );
            // The unit still trains after loading (storage identity kept).
            let y = unit.forward(&Tensor::ones(&[2, 4], DType::F32)?.to_device(&device)?)?;
            unit.backward(&Tensor::ones(y.shape(), DType::F32)?.to_device(&device)?)?;
            Ok::<_, FsdpError>(())
        })
        .expect("run");
    }
}
