//! Global-norm gradient clipping over shards (torch's `clip_grad_norm_` for FSDP2).

use std::sync::Arc;

use hypershard_mesh::Placement;

use super::{FsdpModule, lock, walk_units_with_path};
use crate::error::Result;
use crate::group::ParamGroup;
use crate::param::ParamRole;

impl FsdpModule {
    /// Scales every gradient of this unit's tree so that their global L2 norm is at most
    /// `max_norm`, and returns the norm before clipping (torch's `clip_grad_norm_` with
    /// `foreach` semantics: `coef = max_norm / (norm + 1e-6)`, applied when below 1).
    ///
    /// Squares of sharded gradients are summed locally and all-reduced over each mesh's shard
    /// group only (one all-reduce per distinct mesh, usually one): shards of one replica
    /// partition a parameter, and the replicas of HSDP hold equal shards, so nothing is
    /// counted twice. Replicated, ignored and unmanaged parameters hold whole gradients that
    /// are equal on every rank after reduction and are counted once, locally. With tensor
    /// parallelism, squares of TP-sharded gradients are summed over the TP group as well
    /// (one more all-reduce), TP-replicated ones are not. Collective over the shard groups
    /// (and the TP group).
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        // Full name of every sharded parameter → index of its mesh in `meshes`, and whether
        // it is also sharded over TP (so its squares are summed over the TP group too).
        let mut meshes: Vec<Arc<crate::mesh::DataParallelMesh>> = Vec::new();
        let mut sharded: std::collections::HashMap<String, (usize, bool)> =
            std::collections::HashMap::new();
        let mut record = |path: &str, group: &ParamGroup, member: usize| {
            let index = match meshes.iter().position(|m| Arc::ptr_eq(m, &group.mesh)) {
                Some(index) => index,
                None => {
                    meshes.push(group.mesh.clone());
                    meshes.len() - 1
                }
            };
            for param in group
                .params
                .iter()
                .filter(|p| p.member == member && p.role == ParamRole::Sharded)
            {
                let tp_sharded = param.tp.as_ref().is_some_and(|tp| !tp.is_replicated());
                sharded.insert(
                    hypershard_nn::join_name(path, &param.name),
                    (index, tp_sharded),
                );
            }
        };
        record("", &lock(&self.group), self.member);
        walk_units_with_path(self.inner.as_mut(), "", &mut |path, unit| {
            record(path, &lock(&unit.group), unit.member);
        })?;
        // Whole (unmanaged, ignored) parameters of TP layers are TP shards as well.
        let tp = self.tp_group()?;
        let mut layouts = std::collections::BTreeMap::new();
        if tp.is_some() {
            crate::tp::tp_layouts(self.inner.as_mut(), "", &mut layouts)?;
        }
        // Per mesh: squares summed over its shard group only, and over its shard group and TP.
        let mut sums = vec![[0.0f64; 2]; meshes.len()];
        let mut local = 0.0f64;
        let mut tp_only = 0.0f64;
        self.inner.visit_params("", &mut |name, param| {
            if let Some(grad) = &param.grad {
                // Summed where the gradient lives (a kernel on the device's memory); only the
                // scalar crosses to the host.
                let wide = grad.to_dtype(hypershard_tensor::DType::F64)?.contiguous()?;
                let sq: f64 = wide.with_kernel_data::<f64, _>("fsdp clip_grad_norm", |gs| {
                    gs.iter().map(|g| g * g).sum()
                })?;
                match sharded.get(name) {
                    Some(&(index, tp_sharded)) => sums[index][usize::from(tp_sharded)] += sq,
                    None => match layouts.get(name) {
                        Some((layout, _)) if layout.placement != Placement::Replicate => {
                            tp_only += sq
                        }
                        _ => local += sq,
                    },
                }
            }
            Ok(())
        })?;
        let mut total = local;
        let mut over_tp = tp_only;
        for (mesh, sum) in meshes.iter().zip(sums) {
            let reduced = mesh
                .shard()
                .all_reduce(
                    hypershard_collectives::Buffer::from_vec(sum.to_vec()),
                    hypershard_collectives::ReduceOp::Sum,
                )?
                .into_vec::<f64>()?;
            total += reduced.first().copied().unwrap_or(0.0);
            over_tp += reduced.get(1).copied().unwrap_or(0.0);
        }
        match &tp {
            Some(tp) => {
                let reduced = tp
                    .comm
                    .all_reduce(
                        hypershard_collectives::Buffer::from_vec(vec![over_tp]),
                        hypershard_collectives::ReduceOp::Sum,
                    )?
                    .into_vec::<f64>()?;
                total += reduced.first().copied().unwrap_or(0.0);
            }
            None => total += over_tp,
        }
        let norm = total.sqrt();
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            self.inner.visit_params_mut("", &mut |_, param| {
                if let Some(grad) = &param.grad {
                    grad.scale_(coef)?;
                }
                Ok(())
            })?;
        }
        Ok(norm)
    }
}
